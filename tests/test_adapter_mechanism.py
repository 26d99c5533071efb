"""The one adapter mechanism (`vispe.integrations.base`) as each adapter uses it: a patched model deep-copies
into an independent patched model and pickles, a second patch anywhere in the model tree is refused,
one version gate names the extra, and ``None`` means the model's own encoding at every entry point."""
import pytest
import torch
from torch import nn

import vispe
from vispe.extras import SUPPORTED, UnsupportedVersionError, check_version
from vispe.integrations import AlreadyPatchedError, patch_detr, use_pe

from adapter_checks import check_deepcopy, check_one_patch_per_tree, check_pickle

transformers = pytest.importorskip('transformers')
open_clip = pytest.importorskip('open_clip')

from test_hf_detr import build, run  # noqa: E402
from test_open_clip import _clip  # noqa: E402

IMAGE = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))


def _detr_logits(model):
    with torch.no_grad():
        return run(model)[0]


def _clip_features(model):
    with torch.no_grad():
        return model.encode_image(IMAGE)


@pytest.mark.parametrize('kind, spec', [('detr', 'rope_mixed+peg'), ('rt_detr', 'liere'), ('conditional', 'detr_sine')])
def test_patched_detr_deep_copies_into_an_independent_patched_model(kind, spec):
    check_deepcopy(build(kind), lambda m: patch_detr(m, spec), _detr_logits)


@pytest.mark.parametrize('kind, spec', [('detr', 'irpe'), ('rt_detr', 'rope_mixed')])
def test_patched_detr_pickles_with_torch_save(kind, spec):
    check_pickle(build(kind), lambda m: patch_detr(m, spec), _detr_logits)


def test_detr_refuses_a_second_patch_on_the_model_or_inside_it():
    model = build('detr')
    check_one_patch_per_tree(model, model.model, lambda m: patch_detr(m, 'rope_mixed'), lambda m: patch_detr(m, 'irpe'))


def test_patched_open_clip_model_deep_copies_and_pickles():
    check_deepcopy(_clip(), lambda m: use_pe(m, 'rope_mixed'), _clip_features)
    check_pickle(_clip(), lambda m: use_pe(m, 'liere'), _clip_features)


def test_open_clip_refuses_a_second_patch():
    model = _clip()
    handle = use_pe(model, 'rope_mixed')
    with pytest.raises(AlreadyPatchedError, match='already patched'):
        use_pe(model, 'liere')
    handle.remove()
    use_pe(model, 'liere').remove()


def test_none_is_the_models_own_encoding_at_every_entry_point():
    import timm
    timm_model = timm.create_model('vit_tiny_patch16_224', depth=2, img_size=64, num_classes=3).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        want = timm_model(x)
        converted = vispe.convert(timm_model, None)
        assert converted.pe.name == 'learned'
        torch.testing.assert_close(converted(x), want, rtol=0, atol=1e-6)
    model = _clip()
    with torch.no_grad():
        want = model.encode_image(IMAGE)
        handle = use_pe(model, None)
        assert model.visual.trunk.pe.name == 'learned'
        torch.testing.assert_close(model.encode_image(IMAGE), want, rtol=0, atol=1e-6)
    handle.remove()
    detr = build('detr')
    want = _detr_logits(detr)
    with patch_detr(detr, None) as h:
        assert h.encoding.name == 'detr_sine'
        torch.testing.assert_close(_detr_logits(detr), want, rtol=0, atol=1e-6)


def test_one_version_gate_names_the_range_and_the_extra(monkeypatch):
    for module, (low, high) in SUPPORTED.items():
        check_version(module, low, 'x')  # the floor is supported
        with pytest.raises(UnsupportedVersionError, match=rf'{module} >= {low}, < {high}; {module} {high}.0 is installed'):
            check_version(module, f'{high}.0', 'x')
    monkeypatch.setattr(open_clip, '__version__', '2.0.0')
    with pytest.raises(ImportError, match=r'pip install "vispe\[open_clip\]"'):
        use_pe(_clip(), 'rope_mixed')
