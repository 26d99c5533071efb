"""patch_vision on transformers' video encoders (VideoMAE): parity of the model's own encoding with the unpatched
model first (the configured clip, masked pretraining inputs), the own encoding against transformers' own table
function, other frame counts and sizes where the host refuses them; then every video encoding, the adapter
mechanism, bfloat16 and the refusals."""
import copy

import pytest
import torch

transformers = pytest.importorskip('transformers')

import vispe  # noqa: E402
from vispe.integrations import patch_vision  # noqa: E402

from adapter_checks import check_deepcopy, check_one_patch_per_tree, check_pickle  # noqa: E402
from conftest import image_pes  # noqa: E402
from transformers_vision_models import VIDEO_OTHER, build_videomae, sharpen, video_inputs  # noqa: E402

PARITY = 1e-6
# encodings defined on a 2D plane (or DETR's 2D sine): a video tower refuses them with an error naming 2D
TWO_D_ONLY = {'detr_learned', 'detr_sine', 'irpe', 'lookhere', 'rope_golden', 'rope_spiral', 'rope_timm', 'swin_rpb'}


def _mask(batch=2, tokens=32, seed=0):
    """The same number of masked tubelets in every sample, at different places."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(tokens, generator=g) < tokens // 2 for _ in range(batch)])


def test_own_encoding_equals_the_unpatched_model():
    model = build_videomae()
    x = video_inputs()
    mask = _mask()
    with torch.no_grad():
        want, want_masked = model(**x).last_hidden_state, model(**x, bool_masked_pos=mask).last_hidden_state
        with patch_vision(model) as handle:
            assert handle.encoding.name == 'sincos' and not handle.report.dropped and not handle.report.initialized
            got, got_masked = model(**x).last_hidden_state, model(**x, bool_masked_pos=mask).last_hidden_state
        again = model(**x).last_hidden_state
    assert (got - want).abs().max().item() <= PARITY
    assert (got_masked - want_masked).abs().max().item() <= PARITY
    assert torch.equal(again, want)


@pytest.mark.parametrize('size', [(4, 32, 32), (8, 32, 32), (2, 16, 24)])
def test_flattened_interleaved_sincos_is_videomaes_table(size):
    """``sincos:flatten=true,pairing=interleaved`` is transformers' ``get_sinusoid_encoding_table`` over the
    tubelets' row-major index, at the configured clip and, for a longer clip, as its first rows."""
    from transformers.models.videomae.modeling_videomae import get_sinusoid_encoding_table
    grid = (size[0] // 2, size[1] // 8, size[2] // 8)
    pe = vispe.create_pe('sincos:flatten=true,pairing=interleaved', vispe.PEContext(dim=48, grid_size=(2, 4, 4)))
    ours = pe.embedding(vispe.positions.grid(*grid))[0]
    host = get_sinusoid_encoding_table(ours.shape[0], 48)[0]
    assert (ours - host).abs().max().item() <= 1.2e-7


def test_other_frame_counts_and_sizes_where_the_host_refuses_them():
    """The host's table has the configured clip's tubelet count: it refuses another size and another frame
    count; patched, the model takes them, and a longer clip at the configured size keeps the first frames'
    positions (the flat index continues)."""
    model = build_videomae()
    longer = video_inputs((8, 32, 32), batch=1)
    with pytest.raises(ValueError, match="doesn't match model"):
        model(**video_inputs(VIDEO_OTHER))
    with pytest.raises(RuntimeError):
        model(**longer)
    with torch.no_grad(), patch_vision(model) as handle:
        assert model(**video_inputs(VIDEO_OTHER)).last_hidden_state.shape == (2, 3 * 5 * 3, 48)
        assert model(**longer).last_hidden_state.shape == (1, 4 * 4 * 4, 48)
        table = handle.encoding.embedding(vispe.positions.grid(4, 4, 4))[0]
        first = handle.encoding.embedding(vispe.positions.grid(2, 4, 4))[0]
        torch.testing.assert_close(table[:32], first, rtol=0, atol=0)


@pytest.mark.parametrize('cls', ['VideoMAEForVideoClassification', 'VideoMAEForPreTraining'])
def test_a_whole_videomae_model_finds_its_encoder(cls):
    source = build_videomae()
    torch.manual_seed(0)
    model = sharpen(getattr(transformers, cls)(source.config)).eval()
    x = video_inputs()
    extra = dict(bool_masked_pos=_mask()) if cls == 'VideoMAEForPreTraining' else {}
    with torch.no_grad():
        want = model(**x, **extra).logits
        with patch_vision(model) as handle:
            assert handle.tower is model.videomae
            assert (model(**x, **extra).logits - want).abs().max().item() <= PARITY
        with patch_vision(model, 'rope_axial'):
            assert (model(**x, **extra).logits - want).abs().max().item() > 10 * PARITY
    check_one_patch_per_tree(model, model.videomae, lambda m: patch_vision(m, 'rope_mixed'),
                             lambda m: patch_vision(m, 'liere'))


# ------------------------------------------------------------------ any video encoding
PES = image_pes()


@pytest.fixture(scope='module')
def video_model():
    return build_videomae()


@pytest.mark.parametrize('pe', PES)
def test_every_video_encoding_trains_a_step_and_takes_another_clip(video_model, pe):
    model = copy.deepcopy(video_model).train()
    if pe in TWO_D_ONLY:
        with pytest.raises(ValueError, match='2D'):  # at patch time, or (DETR's) at the first forward
            patch_vision(model, pe)
            model(**video_inputs())
        return
    handle = patch_vision(model, pe)
    loss = model(**video_inputs()).last_hidden_state.square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    params = [p for n, p in model.named_parameters() if 'vispe_pe.' in n and p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params), pe
    if params:
        assert any(p.grad.abs().sum() > 0 for p in params), f'no gradient reaches {pe}'
    model.eval()
    with torch.no_grad():
        out = model(**video_inputs(VIDEO_OTHER)).last_hidden_state
    assert out.shape == (2, 3 * 5 * 3, 48) and torch.isfinite(out).all()
    handle.remove()


def test_masked_pretraining_positions_follow_the_kept_tokens(video_model):
    """A relative encoding on the kept tubelets equals the whole clip's at those tubelets' positions: the
    attention of a masked forward sees the kept tokens' true positions."""
    model = copy.deepcopy(video_model)
    x = video_inputs(batch=1)
    mask = _mask(batch=1)
    with torch.no_grad(), patch_vision(model, 'rope_axial') as handle:
        pos = vispe.positions.grid(2, 4, 4, train_grid=(2, 4, 4))
        kept = (~mask).nonzero()[:, 1].view(1, -1)
        prepared = handle.encoding.prepare(pos).select(kept)
        assert torch.equal(prepared.pos_q.coords[0], pos.coords[kept[0]])
        out = model(**x, bool_masked_pos=mask).last_hidden_state
    assert out.shape == (1, 16, 48) and torch.isfinite(out).all()


def test_patched_encoder_deep_copies_and_pickles():
    def run(model):
        with torch.no_grad():
            return model(**video_inputs()).last_hidden_state

    check_deepcopy(build_videomae(), lambda m: patch_vision(m, 'rope_mixed+peg'), run)
    check_pickle(build_videomae(), lambda m: patch_vision(m, 'liere+sincos'), run)


def test_tables_stay_float32_in_a_bfloat16_model(video_model):
    model = copy.deepcopy(video_model)
    handle = patch_vision(model)
    pos = vispe.positions.grid(4, 4, 4)
    want = handle.encoding.embedding(pos)
    model.to(torch.bfloat16)
    handle.encoding.clear_cache()
    got = handle.encoding.embedding(pos)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    with torch.no_grad():
        out = model(pixel_values=video_inputs()['pixel_values'].bfloat16()).last_hidden_state
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    handle.remove()


# ------------------------------------------------------------------ refusals
def test_clips_the_tubelet_does_not_divide_are_refused(video_model):
    model = copy.deepcopy(video_model)
    with patch_vision(model, 'rope_axial'):
        with pytest.raises(ValueError, match=r'5 frames of 32x32 are not divisible by the tubelet 2x8x8'):
            model(**video_inputs((5, 32, 32)))
        with pytest.raises(ValueError, match=r'pixel_values must be a \(B, frames, C, H, W\) tensor'):
            model(pixel_values=torch.randn(2, 3, 32, 32))
        with pytest.raises(ValueError, match='must mask as many tokens in every sample'):
            mask = _mask()
            mask[0, ~mask[0]] = True
            model(**video_inputs(), bool_masked_pos=mask)
