"""RoPE2D of CroCo v2 / DUSt3R / MASt3R / VGGT (`rope2d`): rope_axial in the rotate-half-per-axis layout.

The reference is the formula of the papers, computed here by hand channel by channel: the head dim cut in
a y half and an x half of ``d`` channels each, channel ``j`` of a half paired with ``j + d/2`` and turned
by ``p * 100^(-2j / d)``; special tokens at position 0, VGGT's patches from 1.
"""
import math

import pytest
import timm
import torch

import vispe
from vispe.positions import grid
from conftest import TINY, naflex_max_error, random_qk, rotated_logits


def hand_rope2d(x: torch.Tensor, coords, base: float = 100.0) -> torch.Tensor:
    """The formula, one token and one pair at a time: ``x`` ``(..., N, hd)``, ``coords`` a list of N
    per-token coordinate tuples in channel-group order (``(y, x)``), None for an unrotated token."""
    out = x.clone()
    axes = len(next(c for c in coords if c is not None))
    d = x.shape[-1] // axes // 2 * 2  # channels per axis group (an even count)
    for n, c in enumerate(coords):
        if c is None:
            continue
        for a, p in enumerate(c):
            for j in range(d // 2):
                angle = p * base ** (-2 * j / d)
                i1, i2 = a * d + j, a * d + d // 2 + j
                u, v = x[..., n, i1], x[..., n, i2]
                out[..., n, i1] = u * math.cos(angle) - v * math.sin(angle)
                out[..., n, i2] = v * math.cos(angle) + u * math.sin(angle)
    return out


def _yx(h: int, w: int, offset: int = 0):
    return [(y + offset, x + offset) for y in range(h) for x in range(w)]


@pytest.mark.parametrize('prefix, offset', [(0, 0), (1, 1), (5, 1)])
def test_rope2d_equals_the_formula_with_special_tokens_at_zero(prefix, offset):
    """CroCo / DUSt3R (no special tokens: patches from 0) and VGGT (special tokens at 0, patches from 1)."""
    pe = vispe.create_pe('rope2d', dim=64, num_heads=2, grid_size=(3, 4), num_prefix_tokens=prefix).double()
    q, k = random_qk(prefix + 12, head_dim=32)
    q2, k2 = pe.prepare(grid(3, 4, num_prefix=prefix)).qk(q, k, 0)
    coords = [None] * prefix + _yx(3, 4, offset)
    torch.testing.assert_close(q2, hand_rope2d(q, coords), atol=1e-6, rtol=0)
    torch.testing.assert_close(k2, hand_rope2d(k, coords), atol=1e-6, rtol=0)


def test_patch_offset_option_overrides_vggts_rule():
    pe = vispe.create_pe('rope2d:patch_offset=3', dim=32, num_heads=2, grid_size=(2, 3))
    q, k = random_qk(6, head_dim=16)
    q2, _ = pe.double().prepare(grid(2, 3)).qk(q, k, 0)
    torch.testing.assert_close(q2, hand_rope2d(q, _yx(2, 3, 3)), atol=1e-6, rtol=0)


def test_half_layout_on_a_video_grid_rotates_each_axis_group_and_passes_the_rest():
    """rope_axial's half layout for (t, y, x): 3 groups of 2 * 5 channels (hd 32), the last 2 channels
    pass through, as in the interleaved layout."""
    pe = vispe.create_pe('rope_axial:layout=half,axis_order=yx', dim=64, num_heads=2, grid_size=(2, 2, 3)).double()
    q, k = random_qk(12, head_dim=32)
    q2, _ = pe.prepare(grid(2, 2, 3)).qk(q, k, 0)
    coords = [(t, y, x) for t in range(2) for y in range(2) for x in range(3)]
    expected = hand_rope2d(q[..., :30], coords, base=pe.theta)
    torch.testing.assert_close(q2, torch.cat([expected, q[..., 30:]], -1), atol=1e-6, rtol=0)


def test_rope2d_is_rope_axial_with_its_channels_permuted():
    """One mechanism: RoPE-ViT's interleaved, x-first table with base 100 gives the same rotation after a
    fixed channel permutation (axial channel i reads RoPE2D channel src[i])."""
    hd, d = 32, 16
    rope2d = vispe.create_pe('rope2d', dim=64, num_heads=2, grid_size=(4, 5)).double()
    axial = vispe.create_pe('rope_axial:theta=100', dim=64, num_heads=2, grid_size=(4, 5)).double()
    src = []
    for group in (1, 0):  # rope_axial's x pairs first; RoPE2D's x group is the second half
        for j in range(d // 2):
            src += [group * d + j, group * d + d // 2 + j]
    dst = torch.tensor(src).argsort()
    q, k = random_qk(20, head_dim=hd)
    pos = grid(4, 5, dtype=torch.float64)
    ours, _ = rope2d.prepare(pos).qk(q, k, 0)
    theirs, _ = axial.prepare(pos).qk(q[..., src], k[..., src], 0)
    torch.testing.assert_close(ours, theirs[..., dst], atol=1e-12, rtol=0)


def test_patch_logits_are_shift_invariant_and_norms_are_kept():
    pe = vispe.create_pe('rope2d', dim=64, num_heads=2).double()
    q, k = random_qk(12, head_dim=32)
    base = grid(3, 4, dtype=torch.float64)
    shifted = vispe.Positions(base.coords + torch.tensor([5.0, -2.0], dtype=base.coords.dtype))
    torch.testing.assert_close(rotated_logits(pe, base, q, k), rotated_logits(pe, shifted, q, k), atol=1e-9, rtol=0)
    q2, _ = pe.prepare(base).qk(q, k, 0)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1), atol=1e-12, rtol=0)


@pytest.mark.parametrize('spec, message', [
    ('rope2d:layout=diagonal', r"option 'layout' of encoding 'rope2d': 'diagonal' is not allowed; allowed values: "
                               r"'interleaved', 'half'"),
    ('rope2d:axis_order=zx', r"option 'axis_order' of encoding 'rope2d': 'zx' is not allowed; allowed values: 'xy', 'yx'"),
    ('rope2d:patch_offset=-1', r"option 'patch_offset' of encoding 'rope2d' must be a finite number >= 0"),
    ('rope2d:theta=0', r"option 'theta' of encoding 'rope2d' must be a finite number > 0"),
])
def test_bad_options_name_the_option(spec, message):
    with pytest.raises(ValueError, match=message):
        vispe.create_pe(spec, dim=64, num_heads=2, grid_size=(4, 4))


def test_half_layout_refuses_positions_with_other_axes_than_the_host():
    pe = vispe.create_pe('rope2d', dim=64, num_heads=2, grid_size=(4, 4))
    with pytest.raises(ValueError, match=r"layout='half' was built for 2 coordinate axes .* positions have 3"):
        pe.prepare(grid(2, 2, 2))


@pytest.mark.parametrize('case', [{}, {'grid_mode': 'normalized'}, {'scaling': 'yarn'}, {'patch_offset': 2.0}])
def test_naflex_samples_get_what_they_get_alone(case):
    pe = vispe.create_pe('rope2d', dim=32, num_heads=2, depth=2, grid_size=(4, 4), **case).eval()
    for grids, prefix, tokens in (([(3, 5), (4, 4), (1, 7), (6, 5)], 1, 34), ([(2, 3), (7, 6)], 4, None),
                                  ([(5, 2), (3, 3)], 0, None)):
        assert naflex_max_error(pe, grids, num_prefix=prefix, num_tokens=tokens) <= 1e-5


@pytest.mark.parametrize('other', ['irpe', 'peg'])
def test_compositions_train(other):
    model = timm.create_model('vit_tiny', pe=f'rope2d+{other}', **TINY)
    out = model(torch.randn(2, 3, 32, 32))
    out.square().mean().backward()
    assert torch.isfinite(out).all()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def _tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model('vit_tiny', pe='rope2d', **TINY)


def test_compiled_eval_and_train_step_equal_eager():
    torch._dynamo.reset()
    x = torch.randn(2, 3, 32, 32)
    model = _tiny_vit().eval()
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    eager, twin = _tiny_vit(), _tiny_vit()
    compiled = torch.compile(twin, fullgraph=True, backend='aot_eager')  # the backward traced too, no codegen
    expected, out = eager(x), compiled(x)
    expected.square().mean().backward()
    out.square().mean().backward()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    for (name, a), b in zip(eager.named_parameters(), twin.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5 * max(1.0, a.grad.abs().max().item()), rtol=1e-4,
                                       msg=name)
