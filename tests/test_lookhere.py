"""LookHere (Fuller et al., NeurIPS 2024): fixed directed distance-penalty biases.

References: hand computations of the paper's bias ``-g * s_l * m_h * ||p_j - p_i||`` inside a head's
field of view (masked outside), fields of view re-derived from their angles (a 180, 90 or 45 degree
sector pointed at a direction, boundary rays included), the release's slope rules worked by hand, and
the properties the method promises (relative, so a larger grid extrapolates; a head never attends
outside its direction; the class token unmasked). The comparison with the released code itself (every
direction family, non-square grids, 4 to 16 heads: identical masks, values to float32 rounding) runs
outside the repository (docs/encodings/lookhere.md, "Fidelity").
"""
import math

import pytest
import timm
import torch

import vispe
from conftest import TINY, naflex_max_error
from test_compile import _eval_matches_eager, _images, _train_step_matches_eager
from vispe.encodings.lookhere import lookhere_heads
from vispe.registry import create_pe

LOWEST = torch.finfo(torch.float32).min


def _pe(spec='lookhere', heads=4, depth=3, grid=(4, 4), num_prefix=1, **options):
    return create_pe(spec, dim=16 * heads, num_heads=heads, depth=depth, grid_size=grid, num_prefix_tokens=num_prefix,
                     **options).eval()


def _bias(pe, pos, layer=0, pos_k=None):
    """The dense bias ``(H, Nq, Nk)`` (or ``(B, H, Nq, Nk)``) of ``layer``."""
    q = torch.zeros(1, pe.ctx.num_heads, 1, 1)
    state = pe.prepare(pos, pos_k).state
    b = pe.bias(q, q, state, layer)
    return b[0] if b.shape[0] == 1 and not pos.batched else b


# ------------------------------------------------------------------ the formula, by hand
def test_bias_values_by_hand_on_a_3x3_grid():
    """Four heads of ``lh180`` (up, down, left, right; slope 1/2 each, the release's ``get_slopes(4)``),
    global slope 2, layer slopes 1.5 -> 0.5 over 3 layers (1.5, 1.0, 0.5). Query: the centre patch
    (1, 1) = token 4."""
    pe = _pe(heads=4, depth=3, grid=(3, 3), num_prefix=0, global_slope=2.0)
    pos = vispe.grid(3, 3)
    b0, b2 = _bias(pe, pos, 0), _bias(pe, pos, 2)
    up, down, left, right = 0, 1, 2, 3
    # key (0, 2) = token 2: up and to the right, distance sqrt(2)
    assert b0[up, 4, 2].item() == pytest.approx(-2 * 1.5 * 0.5 * math.sqrt(2))
    assert b2[right, 4, 2].item() == pytest.approx(-2 * 0.5 * 0.5 * math.sqrt(2))
    assert b0[down, 4, 2].item() == LOWEST and b0[left, 4, 2].item() == LOWEST
    # key (1, 0) = token 3: same row, to the left: seen by up, down (boundary row) and left
    for h in (up, down, left):
        assert b0[h, 4, 3].item() == pytest.approx(-2 * 1.5 * 0.5 * 1)
    assert b0[right, 4, 3].item() == LOWEST
    # the query itself: distance 0, seen by every head
    assert (b0[:, 4, 4] == 0).all()


def test_release_slopes_and_head_order_by_hand():
    """12 heads of ``lh180`` = ``halves-none``: 8 halves heads (up, down, left, right twice; slopes
    2^-1 then 2^-2) and 4 undirected heads with ALiBi-like slopes 4^-1 .. 4^-4 (``get_none_slopes(4)``)."""
    planes, slopes, zero = lookhere_heads('lh180', 12)
    assert slopes.tolist() == [0.5] * 4 + [0.25] * 4 + [0.25, 0.0625, 0.015625, 0.00390625]
    assert not zero.any()
    up, down, left, right = [(-1, 0)], [(1, 0)], [(0, -1)], [(0, 1)]
    for h, rows in enumerate((up, down, left, right) * 2):
        assert planes[h, :1].tolist() == [list(r) for r in rows] and not planes[h, 1:].any()
    assert not planes[8:].any()  # undirected
    # 16 heads of three families: 8 + 4 + 4 (the release's table); 6 heads of two: 4 + 2
    _, s16, _ = lookhere_heads('eighths1-eighths2-none', 16)
    assert s16.tolist() == [0.5] * 4 + [0.25] * 4 + [0.5] * 4 + [0.25, 0.0625, 0.015625, 0.00390625]
    _, s6, z6 = lookhere_heads('halves-zero', 6)
    assert s6.tolist() == [0.5] * 4 + [0.25, 0.0625] and z6.tolist() == [False] * 4 + [True] * 2


# ------------------------------------------------------------------ fields of view from their angles
def _sector(dy, dx, centre, width):
    """Whether offset (dy, dx) (rows down) lies in the sector of ``width`` degrees around ``centre``
    (degrees, counter-clockwise from +x with y up), boundary rays included; the origin lies in every one."""
    if dy == 0 and dx == 0:
        return True
    angle = math.degrees(math.atan2(-dy, dx))
    off = (angle - centre + 180) % 360 - 180
    return abs(off) <= width / 2 + 1e-9


# the paper's variants: (preset, [(centre, width) of each directed head in order])
SECTORS = {
    'lh180': [(90, 180), (270, 180), (180, 180), (0, 180)],
    'lh90': [(90, 90), (270, 90), (180, 90), (0, 90)],
    # eighths: each 90-degree wedge's half on the left (first four) or the right (next four) side,
    # for the up / down wedges, and the up (first four) or down (next four) side for left / right
    'lh45': [(112.5, 45), (247.5, 45), (157.5, 45), (22.5, 45),
             (67.5, 45), (292.5, 45), (202.5, 45), (337.5, 45)],
}


@pytest.mark.parametrize('preset', sorted(SECTORS))
def test_each_head_sees_exactly_its_sector(preset):
    sectors = SECTORS[preset] * (8 // len(SECTORS[preset]))  # 12 heads: 8 directed, then 4 undirected
    pe = _pe(heads=12, depth=1, grid=(5, 6), num_prefix=0, directions=preset)
    pos = vispe.grid(5, 6)
    b = _bias(pe, pos)
    coords = pos.coords.tolist()
    for h, (centre, width) in enumerate(sectors):
        for i, (yi, xi) in enumerate(coords):
            for j, (yj, xj) in enumerate(coords):
                seen = _sector(yj - yi, xj - xi, centre, width)
                assert (b[h, i, j].item() != LOWEST) == seen, (preset, h, (yi, xi), (yj, xj))
    assert (b[len(sectors):] != LOWEST).all()  # the undirected heads see everything


def test_a_head_never_attends_outside_its_direction():
    """Attention weights (softmax of random logits plus the bias) are exactly 0 outside each head's field
    of view and sum to 1 inside; the class token is attended by every head."""
    pe = _pe(heads=12, depth=2, grid=(5, 5), directions='lh45')
    pos = vispe.grid(5, 5, num_prefix=1)
    b = _bias(pe, pos, layer=1)
    logits = 3 * torch.randn(12, 26, 26) + b
    attn = logits.softmax(-1)
    assert (attn[b == LOWEST] == 0).all()
    assert (attn[:, :, 0] > 0).all()


# ------------------------------------------------------------------ properties
def test_the_bias_depends_only_on_offsets():
    pe = _pe(heads=12, grid=(4, 5), directions='lh90')
    pos = vispe.grid(4, 5, num_prefix=1)
    shifted = pos.replace(coords=pos.coords + torch.tensor([3.0, -7.0]), grid=None)
    for layer in range(3):
        assert torch.equal(_bias(pe, pos, layer), _bias(pe, shifted, layer))


def test_a_larger_grid_extrapolates_each_offset_keeps_its_bias():
    """At 8x8 (trained at 4x4) every pair of the top-left 4x4 block has the training grid's bias."""
    pe = _pe(heads=12, grid=(4, 4))
    small, large = _bias(pe, vispe.grid(4, 4, num_prefix=1)), _bias(pe, vispe.grid(8, 8, num_prefix=1))
    rows = [0] + [1 + 8 * r + c for r in range(4) for c in range(4)]
    assert torch.equal(large[:, rows][:, :, rows], small)


def test_prefix_tokens_are_unbiased_and_unmasked():
    pe = _pe(heads=4, grid=(3, 3), num_prefix=2)
    b = _bias(pe, vispe.grid(3, 3, num_prefix=2))
    assert (b[:, :2, :] == 0).all() and (b[:, :, :2] == 0).all()


def test_layer_slopes_scale_the_penalty_linearly_in_depth():
    pe = _pe(heads=4, depth=5, layer_slopes=(2.0, 0.4))
    pos = vispe.grid(4, 4, num_prefix=1)
    first = _bias(pe, pos, 0)
    seen = first != LOWEST
    for layer, s in enumerate(torch.linspace(2.0, 0.4, 5).tolist()):
        b = _bias(pe, pos, layer)
        torch.testing.assert_close(b[seen], first[seen] * s / 2.0)
        assert (b[~seen] == LOWEST).all()


def test_masked_entries_take_the_attention_dtype_lowest_value():
    pe = _pe(heads=4)
    state = pe.prepare(vispe.grid(4, 4, num_prefix=1)).state
    q = torch.zeros(1, 4, 1, 1, dtype=torch.bfloat16)
    b = pe.bias(q, q, state, 0)
    assert b.dtype == torch.bfloat16 and b.min().item() == torch.finfo(torch.bfloat16).min
    assert torch.isfinite(b).all()


def test_sqrt_and_square_distances():
    pos = vispe.grid(3, 3)
    for distance, f in (('sqrt', math.sqrt), ('square', lambda d: d * d)):
        b = _bias(_pe(heads=4, depth=1, grid=(3, 3), num_prefix=0, distance=distance, layer_slopes=(1.0, 1.0)), pos)
        # head 0 (up, slope 1/2), query (2, 2) = token 8, key (0, 1) = token 1: distance sqrt(5)
        assert b[0, 8, 1].item() == pytest.approx(-0.5 * f(math.sqrt(5)))


# ------------------------------------------------------------------ FlexAttention equals the dense bias
def _attention(spec, pos, mask=None, layer=1, **kw):
    pe = _pe(spec, heads=4, grid=(4, 4))
    torch.manual_seed(0)
    B = len(pos.grids) if pos.grids else 2
    q, k, v = (torch.randn(B, 4, pos.num_tokens, 16) for _ in range(3))
    with torch.no_grad():
        return vispe.pe_attention(q, k, v, pe.prepare(pos), layer, attn_mask=mask, **kw)


def test_flex_kernel_equals_the_dense_bias():
    pos = vispe.grid(5, 6, num_prefix=1)
    dense = _attention('lookhere:directions=lh45', pos)
    torch.testing.assert_close(_attention('lookhere:directions=lh45,kernel=flex', pos), dense, atol=2e-6, rtol=0)
    # the explicit path (force_explicit) of a flex encoding takes its dense bias
    torch.testing.assert_close(_attention('lookhere:directions=lh45,kernel=flex', pos, force_explicit=True), dense,
                               atol=2e-6, rtol=0)


@pytest.mark.slow  # a FlexAttention compilation per mask kind (~15 s on CPU)
def test_flex_kernel_folds_the_host_mask_in():
    pos = vispe.grid(5, 6, num_prefix=1)
    keep = torch.rand(2, 1, 1, pos.num_tokens, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True  # the class token
    for mask in (keep, torch.zeros(keep.shape).masked_fill(~keep, -1e4)):  # bool and additive
        torch.testing.assert_close(_attention('lookhere:kernel=flex', pos, mask), _attention('lookhere', pos, mask),
                                   atol=2e-6, rtol=0)


def test_flex_kernel_takes_the_dense_bias_where_offsets_are_not_one_grid():
    """A NaFlex batch (per-sample grids) and kept tokens (token dropping) give FlexAttention no single
    grid to read offsets from: the dense bias applies, with the same numbers as kernel='dense'."""
    pos = vispe.positions.naflex_grid([(5, 6), (3, 4), (2, 7)], num_prefix=1, train_grid=(4, 4))
    pe = _pe('lookhere:kernel=flex')
    assert pe.score_mod(pe.prepare(pos).state, 0, torch.float32) is None
    real = torch.cat([torch.zeros(3, 1, dtype=torch.bool), pos.key_padding_mask], 1)
    mask = ~real[:, None, None, :]
    torch.testing.assert_close(_attention('lookhere:kernel=flex', pos, mask), _attention('lookhere', pos, mask),
                               atol=2e-6, rtol=0)


@pytest.mark.slow  # FlexAttention compiled for each layer's score_mod (~30 s on CPU)
def test_flex_kernel_in_a_vit_equals_the_dense_vit():
    torch.manual_seed(0)
    dense = timm.create_model('vit_tiny', pe='lookhere', **TINY).eval()
    flex = timm.create_model('vit_tiny', pe='lookhere:kernel=flex', **TINY).eval()
    flex.load_state_dict(dense.state_dict())
    x = torch.randn(2, 3, 48, 40)
    with torch.no_grad():
        torch.testing.assert_close(flex(x), dense(x), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ hosts: compile, NaFlex, composition
def _vit(spec):
    torch.manual_seed(0)
    return timm.create_model('vit_tiny', pe=spec, **TINY)


@pytest.mark.parametrize('spec', ['lookhere', pytest.param('lookhere:kernel=flex', marks=pytest.mark.slow)])
def test_compiled_eval_equals_eager(spec):
    assert _eval_matches_eager(lambda: _vit(spec), [_images()]) == 1


# ~30 s each on the CPU (test_compile's slow run compiles every encoding too); on the CPU a train step of
# kernel='flex' takes the dense bias (FlexAttention has no CPU backward)
@pytest.mark.slow
@pytest.mark.parametrize('spec', ['lookhere', 'lookhere:kernel=flex'])
def test_compiled_train_step_equals_eager(spec):
    assert _train_step_matches_eager(lambda: _vit(spec), [_images()]) == 1


@pytest.mark.parametrize('spec', ['lookhere', 'lookhere:directions=lh45'])
def test_each_sample_of_a_naflex_batch_gets_what_it_gets_alone(spec):
    pe = _pe(spec, heads=4, depth=2, grid=(4, 4))
    for grids, num_tokens in ([(3, 5), (4, 4), (2, 6)], None), ([(1, 7), (6, 1), (4, 4)], 40):
        assert naflex_max_error(pe, grids, num_tokens=num_tokens) <= 1e-5


@pytest.mark.parametrize('spec', ['lookhere+irpe', 'lookhere+peg', 'lookhere+learned'])
def test_compositions_train(spec):
    model = _vit(spec).train()
    x = torch.randn(4, 3, 32, 32)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2, 3]))
    loss.backward()
    assert torch.isfinite(loss)
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(p.grad.abs().sum() > 0 for p in model.pe.parameters())  # the composed encoding's own tables


# ------------------------------------------------------------------ options
@pytest.mark.parametrize('options, message', [
    (dict(directions='sideways'), "option 'directions' of encoding 'lookhere' must be one of"),
    (dict(directions='halves-center'), "option 'directions' of encoding 'lookhere' must be one of"),
    (dict(global_slope=0.0), "option 'global_slope' of encoding 'lookhere' must be a finite number > 0"),
    (dict(layer_slopes=(1.0, -1.0)), "option 'layer_slopes' of encoding 'lookhere' must be a finite number > 0"),
    (dict(kernel='sparse'), "allowed values: 'dense', 'flex'"),
])
def test_bad_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        _pe(**options)


def test_video_positions_are_refused():
    with pytest.raises(ValueError, match="encoding 'lookhere' needs 2D"):
        create_pe('lookhere', dim=32, num_heads=2, grid_size=(2, 3, 3))
    pe = _pe()
    with pytest.raises(ValueError, match="encoding 'lookhere' needs 2D"):
        pe.prepare(vispe.grid(2, 3, 3))
