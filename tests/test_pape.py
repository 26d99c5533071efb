"""PaPE / PaPE-RI: the augmented q.k equals q.k * scale plus the bias of the spec, invariances, grids."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import vispe
from vispe.attention import pe_attention
from vispe.encodings.pape import pape_coordinates
from vispe.registry import create_pe

H, HD, C = 2, 8, 16


def _make(name, depth=2, grid=(3, 4), npre=1, **opts):
    torch.manual_seed(0)
    pe = create_pe({'name': name, **opts}, dim=C, num_heads=H, depth=depth, grid_size=grid,
                   num_prefix_tokens=npre).double()
    if name == 'pape_ri':  # larger scales than the init, so the bias is far from negligible
        with torch.no_grad():
            pe.position_scales.mul_(3.0)
    return pe


def _hand_coordinates(h, w, npre):
    """(col, row) from 1, class token at (0, 0): the released code's image convention, by hand."""
    rows = [[0.0, 0.0]] * npre + [[c + 1.0, r + 1.0] for r in range(h) for c in range(w)]
    return torch.tensor(rows, dtype=torch.float64)


def _pape_bias(pe, x, r_q, r_k, layer):
    """The spec's bias, parabola by parabola: -sum_m a_m (u_im - u_jm)^2 + sum_m b_m (u_im - u_jm)."""
    P, D = pe.parabolas, pe.num_axes
    w = pe.pos_proj[layer].view(H, P, D)
    u_q, u_k = torch.einsum('hpd,nd->hnp', w, r_q), torch.einsum('hpd,nd->hnp', w, r_k)
    ab = x @ pe.ab_proj[layer].t()
    B, N = x.shape[:2]
    a = F.softplus(ab[..., :H * P]).view(B, N, H, P).transpose(1, 2)
    b = ab[..., H * P:].view(B, N, H, P).transpose(1, 2)
    diff = u_q[:, :, None, :] - u_k[:, None, :, :]  # (H, Nq, Nk, P)
    return -(a[:, :, :, None] * diff.square()).sum(-1) + (b[:, :, :, None] * diff).sum(-1)


def _pape_ri_bias(pe, x, r_q, r_k, layer):
    a = F.softplus(x @ pe.a_proj[layer].t()).transpose(1, 2)  # (B, H, N)
    s = pe.position_scales[layer].view(H, 1, 1)
    dist2 = (r_q[:, None] - r_k[None]).square().sum(-1)  # (Nq, Nk)
    return -a[..., None] * s.square() * dist2


def _logits_with_augmentation(pe, pos, x, q, k, layer, pos_k=None):
    qa, ka = pe.prepare(pos, pos_k).qk(q, k, layer, x=x)
    assert qa.shape[-1] == ka.shape[-1] and qa.shape[-1] % 8 == 0
    return (qa @ ka.transpose(-1, -2)) * HD ** -0.5


@pytest.mark.parametrize('name,ref', [('pape', _pape_bias), ('pape_ri', _pape_ri_bias)])
def test_augmented_dot_product_equals_qk_times_scale_plus_the_explicit_bias(name, ref):
    pe = _make(name)
    h, w = 3, 4
    pos = vispe.grid(h, w, num_prefix=1, dtype=torch.float64)
    n = 1 + h * w
    x = torch.randn(2, n, C, dtype=torch.float64)
    q, k = torch.randn(2, 2, H, n, HD, dtype=torch.float64).unbind(0)
    r = _hand_coordinates(h, w, 1)
    for layer in (0, 1):
        expected = (q @ k.transpose(-1, -2)) * HD ** -0.5 + ref(pe, x, r, r, layer)
        torch.testing.assert_close(_logits_with_augmentation(pe, pos, x, q, k, layer), expected,
                                   atol=1e-9, rtol=1e-9)


def test_pape_bias_scale_qk_multiplies_the_bias_by_the_attention_scale():
    pe = _make('pape', bias_scale='qk')
    pos = vispe.grid(3, 4, num_prefix=1, dtype=torch.float64)
    x = torch.randn(1, 13, C, dtype=torch.float64)
    zero = torch.zeros(1, H, 13, HD, dtype=torch.float64)
    r = _hand_coordinates(3, 4, 1)
    got = _logits_with_augmentation(pe, pos, x, zero, zero, 0)
    torch.testing.assert_close(got, _pape_bias(pe, x, r, r, 0) * HD ** -0.5, atol=1e-9, rtol=1e-9)


def test_pape_cross_attention_uses_query_and_key_positions():
    pe = _make('pape', npre=0, grid=None, num_axes=2)
    pq = vispe.points(torch.randn(5, 2, dtype=torch.float64) * 3)
    pk = vispe.points(torch.randn(7, 2, dtype=torch.float64) * 3)
    x = torch.randn(2, 5, C, dtype=torch.float64)
    q = torch.randn(2, H, 5, HD, dtype=torch.float64)
    k = torch.randn(2, H, 7, HD, dtype=torch.float64)
    expected = (q @ k.transpose(-1, -2)) * HD ** -0.5 + _pape_bias(pe, x, pq.coords, pk.coords, 1)
    got = _logits_with_augmentation(pe, pq, x, q, k, 1, pos_k=pk)
    torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


def _rotation(theta):
    c, s = math.cos(theta), math.sin(theta)
    return torch.tensor([[c, -s], [s, c]], dtype=torch.float64)


def test_pape_ri_logits_are_invariant_to_rotating_all_positions():
    pe = _make('pape_ri', grid=None, num_axes=2)
    pts = torch.randn(9, 2, dtype=torch.float64) * 4
    x = torch.randn(2, 10, C, dtype=torch.float64)
    q, k = torch.randn(2, 2, H, 10, HD, dtype=torch.float64).unbind(0)
    base = _logits_with_augmentation(pe, vispe.points(pts, num_prefix=1), x, q, k, 0)
    rotated = _logits_with_augmentation(pe, vispe.points(pts @ _rotation(0.7).t(), num_prefix=1), x, q, k, 0)
    torch.testing.assert_close(rotated, base, atol=1e-9, rtol=1e-9)
    assert (base - (q @ k.transpose(-1, -2)) * HD ** -0.5).abs().max() > 0.1  # the bias is not negligible


def test_pape_is_not_rotation_invariant_but_pape_ri_and_pape_are_shift_invariant():
    pts = torch.randn(8, 2, dtype=torch.float64) * 4
    x = torch.randn(1, 8, C, dtype=torch.float64)
    q, k = torch.randn(2, 1, H, 8, HD, dtype=torch.float64).unbind(0)
    for name in ('pape', 'pape_ri'):
        pe = _make(name, grid=None, npre=0, num_axes=2)
        base = _logits_with_augmentation(pe, vispe.points(pts), x, q, k, 0)
        shifted = _logits_with_augmentation(pe, vispe.points(pts + torch.tensor([5.0, -3.0])), x, q, k, 0)
        torch.testing.assert_close(shifted, base, atol=1e-9, rtol=1e-9)
    pe = _make('pape', grid=None, npre=0, num_axes=2)
    rotated = _logits_with_augmentation(pe, vispe.points(pts @ _rotation(0.7).t()), x, q, k, 0)
    assert (rotated - _logits_with_augmentation(pe, vispe.points(pts), x, q, k, 0)).abs().max() > 1e-3


def test_pape_grid_is_rebuilt_for_other_resolutions():
    for h, w in ((3, 4), (5, 2)):
        coords = pape_coordinates(vispe.grid(h, w, num_prefix=1, dtype=torch.float64))
        torch.testing.assert_close(coords, _hand_coordinates(h, w, 1))
    pe = _make('pape')  # trained on 3 x 4, evaluated on 5 x 6
    pos = vispe.grid(5, 6, num_prefix=1, train_grid=(3, 4), dtype=torch.float64)
    n = 31
    x = torch.randn(1, n, C, dtype=torch.float64)
    q, k = torch.randn(2, 1, H, n, HD, dtype=torch.float64).unbind(0)
    r = _hand_coordinates(5, 6, 1)
    expected = (q @ k.transpose(-1, -2)) * HD ** -0.5 + _pape_bias(pe, x, r, r, 0)
    torch.testing.assert_close(_logits_with_augmentation(pe, pos, x, q, k, 0), expected, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize('name,ref', [('pape', _pape_bias), ('pape_ri', _pape_ri_bias)])
def test_pape_attention_output_equals_softmax_attention_with_the_explicit_bias(name, ref):
    pe = _make(name)
    pos = vispe.grid(3, 4, num_prefix=1, dtype=torch.float64)
    x = torch.randn(2, 13, C, dtype=torch.float64)
    q, k, v = torch.randn(3, 2, H, 13, HD, dtype=torch.float64).unbind(0)
    state = pe.prepare(pos)
    r = _hand_coordinates(3, 4, 1)
    logits = (q @ k.transpose(-1, -2)) * HD ** -0.5 + ref(pe, x, r, r, 1)
    expected = logits.softmax(-1) @ v
    for explicit in (False, True):
        got = pe_attention(q, k, v, state, 1, x=x, scale=HD ** -0.5, force_explicit=explicit)
        assert got.shape == v.shape
        torch.testing.assert_close(got, expected, atol=1e-9, rtol=1e-9)


def test_pape_float32_matches_float64_at_a_224_grid():
    pe64 = _make('pape', grid=(14, 14))
    pe32 = _make('pape', grid=(14, 14)).float()
    pos = vispe.grid(14, 14, num_prefix=1)
    x = torch.randn(1, 197, C, dtype=torch.float64)
    q, k = torch.randn(2, 1, H, 197, HD, dtype=torch.float64).unbind(0)
    ref = _logits_with_augmentation(pe64, vispe.grid(14, 14, num_prefix=1, dtype=torch.float64), x, q, k, 0)
    got = _logits_with_augmentation(pe32, pos, x.float(), q.float(), k.float(), 0)
    torch.testing.assert_close(got.double(), ref, atol=2e-3, rtol=1e-4)


def test_pape_needs_the_attention_input_tokens():
    pe = _make('pape')
    q = torch.randn(1, H, 13, HD, dtype=torch.float64)
    with pytest.raises(ValueError, match='needs the attention input tokens'):
        pe.prepare(vispe.grid(3, 4, num_prefix=1, dtype=torch.float64)).qk(q, q, 0)


@pytest.mark.parametrize('spec', ['pape', 'pape_ri'])
def test_pape_in_a_vit_trains_and_runs_at_other_resolutions(spec):
    model = timm.create_model('vit_tiny', pe=spec, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=3)
    assert model.pe.needs_tokens and model.pe.changes_head_dim and model.pe.flash_eligible  # padded width 24 <= 256
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    grads = [p.grad for p in model.pe.parameters()]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 64)).shape == (1, 3)


@pytest.mark.parametrize('name', ['pape', 'pape_ri'])
def test_pape_gradients_match_finite_differences(name):
    pe = _make(name, parabolas=3) if name == 'pape' else _make(name)
    pos = vispe.grid(2, 2, num_prefix=1, dtype=torch.float64)
    x, q, k, v = (torch.randn(1, 5, C, dtype=torch.float64, requires_grad=True),
                  *torch.randn(3, 1, H, 5, HD, dtype=torch.float64, requires_grad=True).unbind(0))
    names = [n for n, _ in pe.named_parameters()]

    class Host(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.pe = pe

        def forward(self, x, q, k, v):
            return pe_attention(q, k, v, self.pe.prepare(pos), 1, x=x, scale=HD ** -0.5)

    host = Host()

    def attention(x, q, k, v, *params):
        return torch.func.functional_call(host, {f'pe.{n}': p for n, p in zip(names, params)}, (x, q, k, v))

    params = [p.detach().clone().requires_grad_(True) for _, p in pe.named_parameters()]
    assert torch.autograd.gradcheck(attention, (x, q, k, v, *params), fast_mode=True)


def test_pape_video_coordinates_follow_the_released_t_row_col_order():
    """The released video classifier stacks (t, row, col), each from 1 (class token at the origin); images
    keep the image classifier's (col, row)."""
    coords = pape_coordinates(vispe.grid(2, 3, 4, num_prefix=1, dtype=torch.float64))
    hand = [[0.0, 0.0, 0.0]] + [[t + 1.0, r + 1.0, c + 1.0] for t in range(2) for r in range(3) for c in range(4)]
    torch.testing.assert_close(coords, torch.tensor(hand, dtype=torch.float64))
    # W_pos column 0 takes the time axis: a W_pos that reads only column 0 sees only t
    pe = _make('pape', grid=(2, 3, 4), parabolas=1)
    with torch.no_grad():
        pe.pos_proj.zero_()
        pe.pos_proj[..., 0] = 1.0
    state = pe.prepare(vispe.grid(2, 3, 4, num_prefix=1, dtype=torch.float64)).state
    u = state.u_q[0, 0, :, 0]  # layer 0, head 0, every token, the one parabola
    centre = torch.tensor([1.5, 2.0, 2.5], dtype=torch.float64)  # the mean key grid position, subtracted
    torch.testing.assert_close(u, torch.tensor(hand, dtype=torch.float64)[:, 0] - centre[0])
    assert u[1:13].unique().numel() == 1 and u[13:].unique().numel() == 1  # constant within a frame


@pytest.mark.parametrize('option,value', [
    ('parabolas', math.inf), ('parabolas', 0), ('parabolas', -3), ('parabolas', 2.5), ('parabolas', math.nan),
    ('pad_to_multiple', math.inf), ('pad_to_multiple', 0), ('num_axes', math.inf), ('num_axes', 0),
    ('start', math.inf), ('start', math.nan), ('grid_mode', 'linspace'), ('bias_scale', 'none'),
])
def test_pape_rejects_non_finite_and_non_positive_options(option, value):
    from vispe.contract import PEContext
    from vispe.encodings.pape import PaPE, PaPERI
    for cls in (PaPE, PaPERI):
        if option == 'parabolas' and cls is PaPERI:
            continue
        with pytest.raises(ValueError, match=f"option '{option}' of encoding '{cls.name}'"):
            cls(PEContext(dim=C, num_heads=H, grid_size=(3, 4)), **{option: value})
    with pytest.raises(ValueError, match=f"option '{option}'"):  # the spec path says the same
        create_pe({'name': 'pape', option: value}, dim=C, num_heads=H, grid_size=(3, 4))
