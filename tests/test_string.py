"""Cayley- and Circulant-STRING: exact translation invariance, P before RoPE, FFT == matrix exponential."""
import pytest
import timm
import torch

import vispe
from vispe import checks
from conftest import TINY, assert_tiny_vit_trains_and_runs_larger, random_qk, rotated_logits

VARIANTS = ['string_cayley', 'string_circulant']


def _pe(name, axes=2, depth=2, heads=2, head_dim=16, **kw):
    return vispe.create_pe(name, dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=(4,) * axes,
                           num_prefix_tokens=1, **kw).double()


def _cayley(axes=2, **kw):
    pe = _pe('string_cayley', axes, **kw)
    with torch.no_grad():
        pe.skew.normal_(0, 0.3)  # a non-trivial P
    return pe


def _make(name, axes=2, **kw):
    return _cayley(axes, **kw) if name == 'string_cayley' else _pe(name, axes, **kw)


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('axes', [2, 3])
def test_string_is_shift_invariant(name, axes):
    pe = _make(name, axes)
    coords = torch.rand(9, axes, dtype=torch.float64) * 6
    shift = torch.randn(axes, dtype=torch.float64) * 5
    q, k = random_qk(10)

    def patch_logits(c):
        return rotated_logits(pe, vispe.points(c, num_prefix=1), q, k)[..., 1:, 1:]
    assert checks.shift_invariance(patch_logits, coords, shift, atol=1e-10, rtol=0).passed
    assert checks.moves_output(patch_logits(coords), patch_logits(coords * 1.5), at_least=1e-3, relative=False).passed


@pytest.mark.parametrize('name', VARIANTS)
def test_string_rotation_is_orthogonal(name):
    pe = _make(name)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, _ = random_qk(17)
    q2, k2 = pe.prepare(pos).qk(q, q, layer=1)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close((q2 * k2).sum(-1), (q * q).sum(-1))


def test_cayley_p_is_the_cayley_transform_and_orthogonal():
    pe = _cayley()
    p = pe.orthogonal()
    assert p.shape == (2, 2, 16, 16)  # (layers, heads, hd, hd)
    iu = torch.triu_indices(16, 16, 1)
    t = torch.zeros(2, 2, 16, 16, dtype=torch.float64)
    t[..., iu[0], iu[1]] = pe.skew.detach()
    s = t - t.transpose(-1, -2)
    eye = torch.eye(16, dtype=torch.float64)
    torch.testing.assert_close(p, (eye - s) @ torch.linalg.inv(eye + s))
    torch.testing.assert_close(p.transpose(-1, -2) @ p, eye.expand_as(p))


def test_cayley_applies_p_before_rope():
    """R(r) = RoPE(r) P: P changes the logits between patches; P after RoPE would cancel."""
    pe = _cayley()
    plain = _pe('string_cayley')  # S = 0: P = I
    with torch.no_grad():
        plain.rope.freqs.copy_(pe.rope.freqs)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, k = random_qk(17)
    with_p = rotated_logits(pe, pos, q, k)
    without = rotated_logits(plain, pos, q, k)
    assert (with_p - without)[..., 1:, 1:].abs().max() > 1e-2
    # the reverse order P RoPE(r) leaves q^T R_i^T R_j k unchanged: P^T P = I
    p = pe.orthogonal()[1]
    qr, kr = plain.prepare(pos).qk(q, k, layer=1)
    after = (qr @ p.transpose(-1, -2)) @ (kr @ p.transpose(-1, -2)).transpose(-2, -1)
    torch.testing.assert_close(after, without)
    # and P RoPE-mixes q: with_p equals RoPE applied to P q
    torch.testing.assert_close(with_p, rotated_logits(plain, pos, q @ p.transpose(-1, -2), k @ p.transpose(-1, -2)))


def test_cayley_with_zero_skew_is_rope_mixed():
    pe = _pe('string_cayley')
    rope = vispe.create_pe('rope_mixed', dim=32, num_heads=2, depth=2, grid_size=(4, 4)).double()
    with torch.no_grad():
        rope.freqs.copy_(pe.rope.freqs)
    pos = vispe.grid(4, 4, num_prefix=1, dtype=torch.float64)
    q, k = random_qk(17)
    torch.testing.assert_close(rotated_logits(pe, pos, q, k), rotated_logits(rope, pos, q, k), rtol=0, atol=1e-12)


def test_cayley_folds_p_into_the_projections():
    torch.manual_seed(1)
    model = timm.create_model('vit_tiny', pe='string_cayley:skew_init_std=0.2', **TINY).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        assert model.pe.fold_into(model) == TINY['depth']
        after = model(x)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    assert model.pe.prepare(model.positions((4, 4), x.device)).state.kind == 'pair'  # only the RoPE part remains
    reloaded = timm.create_model('vit_tiny', pe='string_cayley', **TINY).eval()
    reloaded.load_state_dict(model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x), before, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match='already folded'):
        model.pe.fold_into(model)
    normed = timm.create_model('vit_tiny', pe='string_cayley', qk_norm=True, **TINY)
    with pytest.raises(ValueError, match='q_norm'):
        normed.pe.fold_into(normed)


def _circulant(c):
    """C[i, j] = c[(i - j) mod d], column j is c rolled by j (built here without the encoding's code)."""
    return torch.stack([torch.roll(c, j, dims=-1) for j in range(c.shape[-1])], dim=-1)


@pytest.mark.parametrize('block', [None, 8, 5])
@pytest.mark.parametrize('axes', [2, 3])
def test_circulant_fft_path_equals_dense_matrix_exp(block, axes):
    head_dim = 15 if block == 5 else 16
    pe = _pe('string_circulant', axes, head_dim=head_dim, block=block)
    coords = torch.randn(6, axes, dtype=torch.float64) * 3
    q, k = random_qk(6, head_dim=head_dim)
    q2, k2 = pe.prepare(vispe.points(coords)).qk(q, k, layer=1)
    c = pe.coeffs.detach()[:, 1]  # layer 1: (D, H, blocks, block)
    gens = _circulant(c) - _circulant(c).transpose(-1, -2)  # L_k = C_k - C_k^T
    rot = torch.linalg.matrix_exp(torch.einsum('nd,dhjab->hnjab', coords, gens).contiguous())  # (H, N, nb, b, b)
    nb, b = rot.shape[-3], rot.shape[-1]
    expected_q = (rot @ q.reshape(2, 2, 6, nb, b, 1)).reshape(q.shape)
    expected_k = (rot @ k.reshape(2, 2, 6, nb, b, 1)).reshape(k.shape)
    torch.testing.assert_close(q2, expected_q, rtol=0, atol=1e-10)
    torch.testing.assert_close(k2, expected_k, rtol=0, atol=1e-10)
    torch.testing.assert_close(pe.generator_matrices()[:, 1], gens)


def test_circulant_generators_commute():
    gens = _pe('string_circulant', 3).generator_matrices()  # (D, L, H, nb, d, d)
    for i in range(3):
        for j in range(3):
            torch.testing.assert_close(gens[i] @ gens[j], gens[j] @ gens[i], rtol=0, atol=1e-12)


@pytest.mark.parametrize('name', VARIANTS)
def test_string_prefix_tokens(name):
    pe = _make(name)
    q, k = random_qk(17)
    q2, _ = pe.prepare(vispe.grid(4, 4, num_prefix=1)).qk(q, k, layer=0)
    if name == 'string_circulant':  # identity (up to the FFT round trip)
        torch.testing.assert_close(q2[:, :, 0], q[:, :, 0], rtol=0, atol=1e-12)
    else:  # R = RoPE(0) P = P for the class token (a token at the origin, so folding is exact)
        expected = (q[:, :, :1] @ pe.orthogonal()[0].transpose(-1, -2))[:, :, 0]
        torch.testing.assert_close(q2[:, :, 0], expected)


@pytest.mark.parametrize('name', VARIANTS)
def test_every_string_layer_receives_gradient_in_a_tiny_vit(name):
    model = timm.create_model('vit_tiny', pe=name, **TINY)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    for pname, p in model.pe.named_parameters():
        layer_dim = 1 if pname in ('coeffs', 'rope.freqs') else 0
        for layer in range(TINY['depth']):
            assert p.grad.select(layer_dim, layer).abs().sum() > 0, f'{pname} of layer {layer} got no gradient'


@pytest.mark.parametrize('spec', ['string_cayley', 'string_circulant', 'string_circulant:block=8',
                                  'string_cayley:grid_mode=normalized,skew_init_std=0.1'])
def test_string_tiny_vit_forward_backward(spec):
    assert_tiny_vit_trains_and_runs_larger(spec)


@pytest.mark.parametrize('name', VARIANTS)
def test_string_on_video_grids_and_rgbd_points(name):
    model = timm.create_model('vit_tiny', pe=name, video=True, num_frames=4, tubelet=2, **TINY)
    model(torch.randn(2, 3, 4, 32, 32)).sum().backward()
    pe = _make(name, axes=3)
    q, k = random_qk(9)
    xyz = torch.randn(2, 8, 3, dtype=torch.float64)
    q2, _ = pe.prepare(vispe.points(xyz, num_prefix=1)).qk(q, k, 0)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))


def test_string_rejects_bad_options():
    with pytest.raises(ValueError, match='block'):
        vispe.create_pe('string_circulant:block=5', dim=32, num_heads=2)
    with pytest.raises(ValueError, match='divisible by 4'):
        vispe.create_pe('string_cayley', dim=12, num_heads=2)
    with pytest.raises(ValueError, match='grid_mode'):
        vispe.create_pe('string_cayley:grid_mode=pixel', dim=32, num_heads=2)
    pe = _pe('string_circulant')
    with pytest.raises(ValueError, match='num_axes'):
        pe.prepare(vispe.points(torch.rand(4, 3, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize('name', VARIANTS)
def test_string_works_under_torch_compile(name):
    torch._dynamo.reset()
    model = timm.create_model('vit_tiny', pe=name, **TINY)
    compiled = torch.compile(model)
    x = torch.randn(2, 3, 32, 32)
    compiled(x).sum().backward()
    assert all(p.grad is not None for p in model.pe.parameters())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)
