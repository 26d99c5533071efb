"""The timm model contract (DESIGN.md section 4) with every registered image encoding, on a tiny ViT.

Per encoding: pretrained timm weights into a headless backbone; timm's factory kwargs (``dtype=``,
``device='meta'``, then ``to_empty`` and ``init_weights``); a forward under ``torch.inference_mode``
before training; ``torch.export`` before plain forwards; ``torch.fx`` feature extraction; an empty
batch. Each runs on the smallest model that shows it (``TINY``).
"""
import pytest
import timm
import torch
from timm.layers import create_feature_extractor
from torch._subclasses.fake_tensor import is_fake

import vispe
from conftest import TINY, image_pes

PES = image_pes()
X = (2, 3, TINY['img_size'], TINY['img_size'])


def _tensors(module: torch.nn.Module) -> dict:
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


# ------------------------------------------------------------------ pretrained timm weights
@pytest.fixture(scope='module')
def timm_checkpoint(tmp_path_factory):
    """A tiny timm ViT (1000 classes, as timm's pretrained configs) and its saved state dict."""
    torch.manual_seed(0)
    ref = timm.create_model('vit_tiny_patch16_224', **dict(TINY, num_classes=1000)).eval()
    path = tmp_path_factory.mktemp('timm') / 'vit.pth'
    torch.save(ref.state_dict(), path)
    return ref, str(path)


def test_timm_itself_loads_its_checkpoint_as_a_headless_backbone(timm_checkpoint):
    _, path = timm_checkpoint
    m = timm.create_model('vit_tiny_patch16_224', pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=0))
    assert m(torch.randn(*X)).shape == (2, TINY['embed_dim'])


@pytest.mark.parametrize('pe', PES)
def test_headless_backbone_loads_timm_weights_and_reports_the_classifier(pe, timm_checkpoint):
    ref, path = timm_checkpoint
    m = timm.create_model('vit_tiny', pe=pe, pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=0)).eval()
    report = m.pretrained_report
    moved = pe == 'learned'  # the table moves into the encoding; every other encoding drops it
    assert report.dropped == ([] if moved else ['pos_embed']) + ['head.bias', 'head.weight']
    assert report.initialized == sorted(k for k in m.state_dict() if k.startswith('pe.') and not moved)
    ours = m.state_dict()
    for k, v in ref.state_dict().items():
        if k not in ('pos_embed', 'head.weight', 'head.bias'):
            assert torch.equal(ours[k], v), k
    x = torch.randn(*X)
    with torch.no_grad():
        out = m(x)
        assert out.shape == (2, TINY['embed_dim']) and torch.isfinite(out).all()
        if moved:
            torch.testing.assert_close(out, ref.forward_head(ref.forward_features(x), pre_logits=True))


# ------------------------------------------------------------------ factory kwargs and meta init
@pytest.mark.parametrize('pe', PES)
def test_bfloat16_model_builds_and_runs(pe):
    m = timm.create_model('vit_tiny', pe=pe, dtype=torch.bfloat16, **TINY)
    # weights follow the dtype; tables computed from the options (non-persistent) keep float32
    assert all(t.dtype == torch.bfloat16 for t in m.pe.state_dict().values() if t.is_floating_point())
    x = torch.randn(*X, dtype=torch.bfloat16)
    out = m(x)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    cast = timm.create_model('vit_tiny', pe=pe, **TINY).to(torch.bfloat16)  # cast after building
    assert torch.isfinite(cast(x)).all()


@pytest.mark.parametrize('pe', PES + ['irpe+learned'])
def test_meta_build_runs_and_initialises_like_a_normal_build(pe):
    m = timm.create_model('vit_tiny', pe=pe, device='meta', **TINY)
    assert all(t.is_meta for t in _tensors(m).values())
    assert repr(m)
    assert m(torch.randn(*X, device='meta')).shape == (2, TINY['num_classes'])

    m.to_empty(device='cpu')
    m.init_weights()
    built = _tensors(timm.create_model('vit_tiny', pe=pe, **TINY).pe)
    torch.manual_seed(1)
    other_seed = _tensors(timm.create_model('vit_tiny', pe=pe, **TINY).pe)
    for name, t in _tensors(m.pe).items():
        assert not t.is_floating_point() or torch.isfinite(t).all(), name
        if torch.equal(built[name], other_seed[name]):  # not random: exactly what construction gives
            assert torch.equal(t, built[name]), name
    # random ones too, from the same random state
    torch.manual_seed(2)
    m.pe.reset_parameters()
    torch.manual_seed(2)
    fresh = vispe.create_pe(pe, m.pe_context)
    for name, t in _tensors(fresh).items():
        assert torch.equal(_tensors(m.pe)[name], t), name
    out = m(torch.randn(*X))
    out.sum().backward()
    assert torch.isfinite(out).all()


def test_non_persistent_buffers_are_recomputed_without_touching_parameters():
    pe = vispe.create_pe('fourier_gaussian+alibi2d', dim=32, num_heads=2, grid_size=(4, 4), device='meta')
    pe.to_empty(device='cpu')
    with torch.no_grad():
        for p in pe.parameters():
            p.fill_(0.5)
    state = torch.random.get_rng_state()
    pe.init_non_persistent_buffers()
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(pe.encodings[1].slopes, vispe.encodings.relative_bias.alibi_slopes(2))
    assert all(bool((p == 0.5).all()) for p in pe.parameters())


# ------------------------------------------------------------------ execution modes
# The next two tests run at input sizes no other test uses, so that what they exercise is what fills
# the caches (process-wide or per model) for that size, whatever ran before them.
@pytest.mark.parametrize('pe', PES + ['irpe+learned'])
def test_inference_mode_forward_then_training(pe):
    """Lightning's validation sanity check runs in inference mode before the first training step."""
    m = timm.create_model('vit_tiny', pe=pe, **TINY).eval()
    x = torch.randn(2, 3, 40, 40)
    with torch.inference_mode():
        m(x)
    m.train()
    m(x).sum().backward()
    assert all(p.grad is not None for p in m.pe.parameters())


@pytest.mark.parametrize('pe', PES)
def test_export_matches_eager_and_leaves_plain_forwards_alone(pe):
    m = timm.create_model('vit_tiny', pe=pe, **TINY).eval()
    x = torch.randn(2, 3, 48, 40)
    exported = torch.export.export(m, (x,))
    with torch.no_grad():
        # what was built while exporting (fake tensors) must reach neither this model nor a new one
        out = m(x)
        fresh = timm.create_model('vit_tiny', pe=pe, **TINY).eval()(x)
        assert not is_fake(out) and not is_fake(fresh) and torch.isfinite(fresh).all()
        torch.testing.assert_close(exported.module()(x), out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize('pe', PES)
def test_fx_feature_extraction(pe):
    m = timm.create_model('vit_tiny', pe=pe, **TINY).eval()
    x = torch.randn(*X)
    traced = create_feature_extractor(m, {'blocks.0': 'block0', 'norm': 'features'})
    with torch.no_grad():
        out = traced(x)
        torch.testing.assert_close(out['features'], m.forward_features(x))
    assert out['block0'].shape == out['features'].shape


def test_fx_features_only_backbone():
    m = timm.create_model('vit_tiny', pe='rope_mixed', features_only=True, feature_cls='fx', out_indices=(0, 1),
                          **TINY)
    n = 1 + (TINY['img_size'] // TINY['patch_size']) ** 2
    assert [tuple(f.shape) for f in m(torch.randn(*X))] == [(2, n, TINY['embed_dim'])] * 2


@pytest.mark.parametrize('pe', PES)
def test_empty_batch_gives_empty_output(pe):
    m = timm.create_model('vit_tiny', pe=pe, **TINY)
    assert m(torch.empty(0, *X[1:])).shape == (0, TINY['num_classes'])
    with torch.no_grad():
        assert m.eval()(torch.empty(0, *X[1:])).shape == (0, TINY['num_classes'])


@pytest.mark.filterwarnings('ignore:`torch.jit.script` is deprecated:FutureWarning')
def test_torchscript_is_refused_with_the_alternatives():
    with pytest.raises(ValueError, match=r'scriptable=True.*TorchScript.*torch.compile or torch.export'):
        timm.create_model('vit_tiny', pe='rope_axial', scriptable=True, **TINY)
    with pytest.raises(RuntimeError, match=r'TorchScript.*torch.compile or torch.export'):
        torch.jit.script(timm.create_model('vit_tiny', pe='rope_axial', **TINY))


# ------------------------------------------------------------------ encoding options
def test_fourier_learnable_groups_zero_names_the_option_and_allowed_values():
    match = r"option 'groups' of encoding 'fourier_learnable'.*allowed: 1, 2.*got groups=0"
    with pytest.raises(ValueError, match=match):
        timm.create_model('vit_tiny', pe='fourier_learnable:groups=0', **TINY)
