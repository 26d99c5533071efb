"""patch_vision on transformers' video encoders (VideoMAE, V-JEPA 2): parity of the model's own encoding with the
unpatched model first (the configured clip, masked pretraining inputs), the own encoding against transformers' own
functions, other frame counts and sizes where the host refuses them (VideoMAE) or positions them wrongly (V-JEPA 2),
V-JEPA 2's own q/k map measured against a rotation; then every video encoding in both, the adapter mechanism,
bfloat16 and the refusals."""
import copy

import pytest
import torch

transformers = pytest.importorskip('transformers')

import vispe  # noqa: E402
from vispe.integrations import patch_vision  # noqa: E402

from adapter_checks import check_deepcopy, check_one_patch_per_tree, check_pickle  # noqa: E402
from conftest import image_pes  # noqa: E402
from transformers_vision_models import (VIDEO_OTHER, build_videomae, build_vjepa2, sharpen, video_inputs,  # noqa: E402
                                       vjepa2_inputs)
from vispe.integrations.transformers_vision import VJEPA2HostRope, find_tower  # noqa: E402

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


@pytest.fixture(scope='module')
def vjepa2_model():
    return build_vjepa2()


# each video family: its model fixture, its inputs, and the call's options (V-JEPA 2's encoder without its predictor)
VIDEO_FAMILIES = {'videomae': ('video_model', video_inputs, {}),
                  'vjepa2': ('vjepa2_model', vjepa2_inputs, dict(skip_predictor=True))}


@pytest.mark.parametrize('pe', PES)
@pytest.mark.parametrize('kind', list(VIDEO_FAMILIES))
def test_every_video_encoding_trains_a_step_and_takes_another_clip(request, kind, pe):
    fixture, inputs, call = VIDEO_FAMILIES[kind]
    model = copy.deepcopy(request.getfixturevalue(fixture)).train()
    if pe in TWO_D_ONLY:
        with pytest.raises(ValueError, match='2D'):  # at patch time, or (DETR's) at the first forward
            patch_vision(model, pe)
            model(**inputs(), **call)
        return
    handle = patch_vision(model, pe)
    loss = model(**inputs(), **call).last_hidden_state.square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    params = [p for n, p in model.named_parameters() if 'vispe_pe.' in n and p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params), pe
    if params:
        assert any(p.grad.abs().sum() > 0 for p in params), f'no gradient reaches {pe}'
    model.eval()
    with torch.no_grad():
        out = model(**inputs(VIDEO_OTHER), **call).last_hidden_state
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


# ------------------------------------------------------------------ V-JEPA 2: its own q/k map, the true grid, the fix
VJEPA2_FIX = 'rope_axial:theta=10000,axis_order=yx'
"""The rotation V-JEPA 2's map means: per-axis groups of ``2 floor(hd / 6)`` channels in (t, h, w) order, pairs
``(2j, 2j + 1)``, frequency ``10000^(-j / (d / 2))`` for pair ``j`` of a group, integer positions."""


def _outputs(out):
    return [out.last_hidden_state] + ([out.predictor_output.last_hidden_state]
                                      if getattr(out, 'predictor_output', None) is not None else [])


@pytest.mark.parametrize('heads', [2, 3])
def test_vjepa2_own_map_equals_the_unpatched_model(heads):
    """``pe=None``: V-JEPA 2's own q/k map, computed by vispe, gives the unpatched encoder's output and the
    predictor's on it at the configured clip, and for an image (one frame, which the host repeats into one
    tubelet). ``heads=3``: a head width of 16, whose last 4 channels pass through."""
    model = build_vjepa2(heads=heads)
    for x in (vjepa2_inputs(), vjepa2_inputs((1, 32, 32))):
        with torch.no_grad():
            want = _outputs(model(**x))
            with patch_vision(model) as handle:
                assert isinstance(handle.encoding, VJEPA2HostRope) and handle.spec is None
                assert not handle.report.dropped and not handle.report.initialized
                got = _outputs(model(**x))
            again = model(**x).last_hidden_state
        assert len(got) == 2
        for a, b in zip(got, want):
            assert (a - b).abs().max().item() <= PARITY
        assert torch.equal(again, want[0])


@pytest.mark.parametrize('head_dim', [64, 15])
def test_vjepa2_own_map_is_transformers_map(head_dim):
    """The own map on the configured grid is transformers' ``apply_rotary_embeddings`` with its
    ``get_position_ids``, at V-JEPA 2's head width 64 on an 8 x 8 x 8 grid and at an odd width (15: groups
    of 4, three channels through)."""
    from transformers.models.vjepa2.modeling_vjepa2 import VJEPA2RopeAttention
    config = transformers.VJEPA2Config(patch_size=8, crop_size=64, frames_per_clip=16, tubelet_size=2)
    attention = VJEPA2RopeAttention(config, hidden_size=2 * head_dim, num_attention_heads=2)
    n = 8 * 8 * 8
    q = torch.randn(2, 2, n, head_dim, generator=torch.Generator().manual_seed(0))
    want = attention.apply_rotary_embeddings(q, attention.get_position_ids(torch.zeros(1, n, 2 * head_dim)))
    own = VJEPA2HostRope(vispe.PEContext(dim=2 * head_dim, num_heads=2, head_dim=head_dim, grid_size=(8, 8, 8)))
    got, _ = own.prepare(vispe.positions.grid(8, 8, 8)).qk(q, q, 0)
    assert (got - want).abs().max().item() <= PARITY * q.abs().max().item()


def test_vjepa2_takes_the_true_grid_where_the_host_takes_its_configured_one():
    """At 48 x 48 pixels (a 2 x 6 x 6 grid) the host numbers its 72 tokens on the configured 4 x 4 grid, so its
    positions reach (4, 3, 3); patched, they reach (1, 5, 5), and the output is the host's own map at the true
    positions (this instance's ``get_position_ids`` given the true grid, in this test only). Where the host's
    positions are right (more frames at the configured size) the patched model equals the unpatched one."""
    model = build_vjepa2()
    x = vjepa2_inputs((4, 48, 48))
    tower, _, family = find_tower(model)
    pos = family.positions(family, tower, (), x)
    assert pos.coords.amax(0).tolist() == [1, 5, 5]
    host_ids = torch.stack(tower.layer[0].attention.get_position_ids(torch.zeros(1, 72, 48)), -1)
    assert host_ids.amax(0).tolist() == [4, 3, 3]

    true_ids = tuple(pos.coords.long().unbind(-1))
    reference = copy.deepcopy(model)
    for layer in reference.encoder.layer:
        layer.attention.get_position_ids = lambda hidden_states, masks=None: true_ids
    longer = vjepa2_inputs((8, 32, 32))
    with torch.no_grad():
        host = model(**x, skip_predictor=True).last_hidden_state
        true = reference(**x, skip_predictor=True).last_hidden_state
        host_longer = model(**longer, skip_predictor=True).last_hidden_state
        with patch_vision(model):
            got = model(**x, skip_predictor=True).last_hidden_state
            got_longer = model(**longer, skip_predictor=True).last_hidden_state
    assert (got - true).abs().max().item() <= PARITY
    assert (got - host).abs().max().item() > 1e-2
    assert (got_longer - host_longer).abs().max().item() <= PARITY


def _shift_and_norms(pe, pos, offset):
    """(largest relative change of a q's norm, largest change of a logit between tokens when every position
    moves by ``offset``, over |q| |k|): one q and one k vector at every token of ``pos``."""
    g = torch.Generator().manual_seed(0)
    hd = pe.ctx.head_dim
    q, k = torch.randn(hd, generator=g), torch.randn(hd, generator=g)
    n = pos.num_tokens
    qs, ks = q.expand(1, 1, n, hd), k.expand(1, 1, n, hd)
    rq, rk = pe.prepare(pos).qk(qs, ks, 0)
    sq, sk = pe.prepare(pos.replace(coords=pos.coords + torch.tensor(offset))).qk(qs, ks, 0)
    norm = (rq.norm(dim=-1) / q.norm() - 1).abs().max().item()
    logits, shifted = rq @ rk.transpose(-1, -2), sq @ sk.transpose(-1, -2)
    return norm, (shifted - logits).abs().max().item() / (q.norm() * k.norm()).item()


def _one_frequency_per_pair(x, coords):
    """The rotation V-JEPA 2's map means, by hand: in each axis' group of ``d`` channels, pair ``j`` as a complex
    number times ``exp(i p w_j)``, ``w_j = 10000^(-j / (d / 2))``."""
    d = 2 * ((x.shape[-1] // 3) // 2)
    w = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
    groups = []
    for axis in range(3):
        z = torch.view_as_complex(x[..., axis * d:(axis + 1) * d].double().unflatten(-1, (-1, 2)).contiguous())
        turn = torch.polar(torch.ones((), dtype=torch.float64), coords[:, axis:axis + 1].double() * w)
        groups.append(torch.view_as_real(z * turn).flatten(-2))
    return torch.cat(groups + [x[..., 3 * d:].double()], -1)


def test_vjepa2_own_map_is_no_rotation_and_rope_axial_is_the_rotation_it_means():
    """At V-JEPA 2's head width 64 on a 4 x 8 x 8 grid: the host's map changes the norm of q and changes logits
    under a common shift of all positions; ``rope_axial:theta=10000,axis_order=yx`` keeps norms, is shift
    invariant, and is the hand-written rotation with one frequency per pair."""
    ctx = vispe.PEContext(dim=128, num_heads=2, grid_size=(4, 8, 8))
    pos = vispe.positions.grid(4, 8, 8)
    host, fix = VJEPA2HostRope(ctx), vispe.create_pe(VJEPA2_FIX, ctx)
    host_norm, host_shift = _shift_and_norms(host, pos, (1.0, 2.0, 3.0))
    fix_norm, fix_shift = _shift_and_norms(fix, pos, (1.0, 2.0, 3.0))
    assert host_norm > 0.05 and host_shift > 0.05
    assert fix_norm <= 1e-6 and fix_shift <= 1e-5
    q = torch.randn(1, 2, pos.num_tokens, 64, generator=torch.Generator().manual_seed(1))
    got, _ = fix.prepare(pos).qk(q, q, 0)
    torch.testing.assert_close(got.double(), _one_frequency_per_pair(q, pos.coords), rtol=0, atol=1e-5)


@pytest.mark.parametrize('cls', ['VJEPA2Model', 'VJEPA2ForVideoClassification'])
def test_a_whole_vjepa2_model_finds_its_encoder(cls):
    model = build_vjepa2(cls)
    encoder = model.encoder if cls == 'VJEPA2Model' else model.vjepa2.encoder
    x = vjepa2_inputs()

    def run():
        out = model(**x)
        return out.logits if cls != 'VJEPA2Model' else out.predictor_output.last_hidden_state

    with torch.no_grad():
        want = run()
        with patch_vision(model) as handle:
            assert handle.tower is encoder
            assert (run() - want).abs().max().item() <= PARITY
        with patch_vision(model, VJEPA2_FIX):
            assert (run() - want).abs().max().item() > 10 * PARITY
    check_one_patch_per_tree(model, encoder, lambda m: patch_vision(m, 'rope_mixed'), lambda m: patch_vision(m))


def test_patched_vjepa2_deep_copies_and_pickles():
    def run(model):
        with torch.no_grad():
            return model(**vjepa2_inputs()).last_hidden_state

    check_deepcopy(build_vjepa2(), lambda m: patch_vision(m, 'rope_mixed+peg'), run)
    check_deepcopy(build_vjepa2(), lambda m: patch_vision(m), run)
    check_pickle(build_vjepa2(), lambda m: patch_vision(m), run)


def test_vjepa2_tables_stay_float32_in_a_bfloat16_model(vjepa2_model):
    """The own map's frequencies and cos / sin tables stay float32 after ``.to(torch.bfloat16)`` (the host
    computes them in the activations' dtype)."""
    model = copy.deepcopy(vjepa2_model)
    handle = patch_vision(model)
    pos = vispe.positions.grid(4, 6, 6)
    want = handle.encoding.prepare(pos).state
    model.to(torch.bfloat16)
    got = handle.encoding.prepare(pos).state
    assert handle.encoding.omega.dtype == torch.float32
    for a, b in zip(got, want):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    with torch.no_grad():
        out = model(pixel_values_videos=vjepa2_inputs()['pixel_values_videos'].bfloat16()).last_hidden_state
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    handle.remove()


def test_vjepa2_refusals(vjepa2_model):
    model = copy.deepcopy(vjepa2_model)
    with pytest.raises(ValueError, match=r"pe=None cannot apply: .*'scale'"):
        patch_vision(model, scale=2.0)
    assert not hasattr(model.encoder, 'vispe_pe')  # nothing patched half-way
    with patch_vision(model):
        with pytest.raises(ValueError, match=r'3 frames of 32x32 are not divisible by the tubelet 2x8x8'):
            model(**vjepa2_inputs((3, 32, 32)))
        with pytest.raises(ValueError, match=r'4 frames of 36x32 are not divisible by the tubelet 2x8x8'):
            model(**vjepa2_inputs((4, 36, 32)))
        with pytest.raises(ValueError, match=r'pixel_values_videos must be a \(B, frames, C, H, W\) tensor'):
            model(pixel_values_videos=torch.randn(2, 3, 32, 32))


@pytest.mark.parametrize('kind', list(VIDEO_FAMILIES))
def test_gradient_checkpointing_gives_the_gradients_of_a_plain_backward(request, kind):
    """These towers do not pass keyword arguments down, and transformers recomputes a checkpointed layer's
    forward in backward, after the tower's forward has ended: the layer keeps its forward for it."""
    fixture, inputs, call = VIDEO_FAMILIES[kind]
    grads = []
    for checkpointed in (False, True):
        model = copy.deepcopy(request.getfixturevalue(fixture)).train()
        if checkpointed:
            model.gradient_checkpointing_enable()
        torch.manual_seed(0)
        with patch_vision(model, 'rope_axial+peg'):
            model(**inputs(), **call).last_hidden_state.sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any('vispe_pe' in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6, msg=name)
