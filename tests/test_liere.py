"""LieRE: exponentials of learned generators, the paper's conventions, and where shift invariance holds."""
import math

import pytest
import timm
import torch

import vispe
from vispe import checks
from vispe.rotary import apply_pair_rotation, apply_rotation, rotate_qk
from vispe.rotary.expm import expm_skew, linear_exp
from vispe.rotary.kernels import apply_block_rotation, fourier_rotation
from conftest import TINY, assert_tiny_vit_trains_and_runs_larger, random_qk, rotated_logits


def _pe(axes=2, depth=2, heads=2, head_dim=16, **kw):
    return vispe.create_pe('liere', dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=(4,) * axes,
                           num_prefix_tokens=1, **kw).double()


@pytest.mark.parametrize('b', [3, 4, 8])
def test_expm_skew_matches_torch_matrix_exp(b):
    a = torch.randn(3, 5, b, b, dtype=torch.float64) * 4
    a = a - a.transpose(-1, -2)
    torch.testing.assert_close(expm_skew(a), torch.linalg.matrix_exp(a), rtol=0, atol=1e-11)
    a32 = a.float().requires_grad_()
    a64 = a.clone().requires_grad_()
    weight = torch.randn(3, 5, b, b, dtype=torch.float64)
    (expm_skew(a32) * weight).sum().backward()
    (torch.linalg.matrix_exp(a64) * weight).sum().backward()
    torch.testing.assert_close(expm_skew(a.float()).double(), torch.linalg.matrix_exp(a), rtol=0, atol=2e-5)
    torch.testing.assert_close(a32.grad.double(), a64.grad, rtol=1e-4, atol=2e-4)


def test_expm_skew_of_2x2_blocks_is_a_plane_rotation():
    t = torch.tensor([0.3, -2.0, 7.0], dtype=torch.float64)
    a = torch.zeros(3, 2, 2, dtype=torch.float64)
    a[:, 1, 0], a[:, 0, 1] = t, -t
    expected = torch.stack([torch.stack([t.cos(), -t.sin()], -1), torch.stack([t.sin(), t.cos()], -1)], -2)
    torch.testing.assert_close(expm_skew(a), expected)


def _rotation_case(kind):
    """Parameters of a rotation of ``kind`` for ``x`` ``(B=2, H=3, N=5, hd=8)`` and its formula."""
    angle = torch.randn(3, 5, 4, dtype=torch.float64)
    if kind in ('table', 'yarn_table'):  # RoPE's complex table; YaRN scales it by a temperature != 1
        magnitude = 1.0 if kind == 'table' else 1.2
        return 'table', (torch.polar(torch.full_like(angle, magnitude), angle),), apply_pair_rotation
    if kind == 'pair':
        return kind, (angle,), lambda v, a: apply_pair_rotation(v, torch.polar(torch.ones_like(a), a))
    if kind == 'block':
        a = torch.randn(5, 3, 2, 4, 4, dtype=torch.float64)  # position-major, as LieRE / ComRoPE lay them out
        return kind, (torch.linalg.matrix_exp(a - a.transpose(-1, -2)).transpose(0, 1),), apply_block_rotation
    if kind == 'fourier':  # two circulant blocks of 4: 3 real-FFT bins each, DC and Nyquist unrotated
        table = torch.randn(3, 5, 6, dtype=torch.float64) * torch.tensor([0.0, 1.0, 0.0]).repeat(2)
        return kind, (table,), lambda v, a: fourier_rotation(v, torch.polar(torch.ones_like(a), a), 4)
    s = torch.randn(3, 8, 8, dtype=torch.float64)  # RoPE(r) P x with a dense orthogonal P per head
    mix = torch.linalg.matrix_exp(s - s.transpose(-1, -2))
    if kind == 'mixed_table':  # the angles given as their complex table
        return 'mixed_pair', (mix, torch.polar(torch.ones_like(angle), angle)), \
            lambda v, p, t: apply_pair_rotation(v @ p.transpose(-1, -2), t)

    def direct(v, p, a):
        return apply_pair_rotation(v @ p.transpose(-1, -2), torch.polar(torch.ones_like(a), a))
    return kind, (mix, angle), direct


KINDS = ['pair', 'table', 'yarn_table', 'block', 'fourier', 'mixed_pair', 'mixed_table']


@pytest.mark.parametrize('kind', KINDS)
def test_apply_rotation_matches_autograd_and_keeps_only_its_output(kind):
    """The training path recovers x = R^-1 (R x) in backward instead of saving x: same gradients."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    kind, params, direct = _rotation_case(kind)
    params = tuple(p.requires_grad_() for p in params)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = apply_rotation(x, kind, *params, block=4)
    assert sum(saved) <= out.numel() + sum(p.numel() for p in params)
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), (x, *params))
    expected = torch.autograd.grad((direct(x, *params) * weight).sum(), (x, *params))
    torch.testing.assert_close(out, direct(x, *params))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize('kind', KINDS)
def test_apply_rotation_backward_takes_an_expanded_gradient(kind):
    """``out.sum()`` hands backward a stride-0 gradient (no complex view of it exists): the same
    gradients as the formula's."""
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    kind, params, direct = _rotation_case(kind)
    params = tuple(p.requires_grad_() for p in params)
    got = torch.autograd.grad(apply_rotation(x, kind, *params, block=4).sum(), (x, *params))
    expected = torch.autograd.grad(direct(x, *params).sum(), (x, *params))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize('kind', ['pair', 'table', 'block', 'fourier', 'mixed_pair'])
def test_inference_rotates_q_and_k_of_a_fused_projection(kind):
    """Without autograd, q and k sliced from one qkv projection are read as one view of it (no
    stacked copy for the kinds that allow it): the formula's values, in the projection's memory
    order (token-major, so that attention's output needs no relayout)."""
    qkv = torch.randn(2, 5, 3, 3, 8, dtype=torch.float64)  # (B, N, q/k/v, H, hd)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    kind, params, direct = _rotation_case(kind)
    with torch.no_grad():
        q2, k2 = rotate_qk(q, k, params, params, kind, block=4)
    torch.testing.assert_close(q2, direct(q, *params))
    torch.testing.assert_close(k2, direct(k, *params))
    assert q2.stride(2) > q2.stride(1), 'tokens outside heads, as in the projection'


@pytest.mark.parametrize('width', [16, 12])  # all channels in blocks / the last 4 passing through
@pytest.mark.parametrize('rot_layout', ['position_major', 'contiguous'])
def test_rotate_qk_on_a_fused_projection_matches_autograd(width, rot_layout):
    """q and k as attention gets them (views of one qkv projection), rotated as one stack by shared
    block rotations: values and the gradients of q, k and the rotations equal autograd's."""
    batch, tokens, heads, hd, b = 2, 5, 3, 16, 4
    qkv = torch.randn(batch, tokens, 3, heads, hd, dtype=torch.float64, requires_grad=True)
    q, k, _ = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, hd) views, timm's Attention
    a = torch.randn(tokens, heads, width // b, b, b, dtype=torch.float64)
    rot = torch.linalg.matrix_exp(a - a.transpose(-1, -2))  # (N, H, nb, b, b) in memory
    rot = rot.transpose(0, 1) if rot_layout == 'position_major' else rot.transpose(0, 1).contiguous()
    rot.requires_grad_()
    q2, k2 = rotate_qk(q, k, rot, rot, 'block')
    wq, wk = torch.randn_like(q2), torch.randn_like(k2)
    got = torch.autograd.grad((q2 * wq).sum() + (k2 * wk).sum(), (qkv, rot))

    def direct(x):
        return torch.cat([apply_block_rotation(x[..., :width], rot), x[..., width:]], -1)
    torch.testing.assert_close(q2, direct(q))
    torch.testing.assert_close(k2, direct(k))
    expected = torch.autograd.grad((direct(q) * wq).sum() + (direct(k) * wk).sum(), (qkv, rot))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize('block', [3, 8])
def test_liere_rotation_is_matrix_exp_of_summed_generators(block):
    """R(p) = matrix_exp(sum_d p_d A_d) per block, A_d = T - T^T from the strict upper triangle."""
    pe = _pe(block=block)
    coords = torch.rand(5, 2, dtype=torch.float64)
    rot = torch.stack(list(pe.rotation(vispe.points(coords))))  # per layer in training: (L, H, N, blocks, block, block)
    raw = pe.generators.detach()
    iu = torch.triu_indices(block, block, 1)
    t = torch.zeros(*raw.shape[:-1], block, block, dtype=torch.float64)
    t[..., iu[0], iu[1]] = raw
    gens = t - t.transpose(-1, -2)  # (D, L, H, blocks, block, block)
    expected = torch.linalg.matrix_exp(torch.einsum('nd,dlhjab->lhnjab', coords, gens).contiguous())
    torch.testing.assert_close(rot, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize('coords_shape', [(6, 2), (6, 3), (2, 6, 2)])  # grid-like, 3 axes, per sample
@pytest.mark.parametrize('scale', [0.05, 3.0])  # no squaring at all / several
@pytest.mark.parametrize('num_prefix', [0, 2])
def test_linear_exp_values_and_gradients_match_matrix_exp(coords_shape, scale, num_prefix):
    """The block exponential's own backward (recomputed Taylor part, squarings undone one by one)
    against autograd through torch.linalg.matrix_exp, for the generators and the coordinates."""
    axes = coords_shape[-1]
    t = torch.randn(axes, 2, 3, 2, 4, 4, dtype=torch.float64) * scale  # (D, L, H, blocks, b, b)
    gen = (t - t.transpose(-1, -2)).requires_grad_()
    coords = torch.rand(coords_shape, dtype=torch.float64, requires_grad=True)
    got = linear_exp(gen, coords, num_prefix=num_prefix)
    lead = 'b' if len(coords_shape) == 3 else ''
    exponent = torch.einsum(f'{lead}nd,dlhjxy->l{lead}hnjxy', coords, gen)
    expected = torch.linalg.matrix_exp(exponent.contiguous())
    eye = torch.eye(4, dtype=torch.float64).expand(*expected.shape[:-4], num_prefix, *expected.shape[-3:])
    expected = torch.cat([eye, expected], dim=-4)
    weight = torch.randn_like(expected)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    for g, e in zip(torch.autograd.grad((got * weight).sum(), (gen, coords)),
                    torch.autograd.grad((expected * weight).sum(), (gen, coords))):
        torch.testing.assert_close(g, e, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize('block', [2, 3, 8])
@pytest.mark.parametrize('axes', [2, 3])
def test_liere_rotation_is_orthogonal(block, axes):
    pe = _pe(axes, block=block)
    pos = vispe.grid(*(3,) * axes, num_prefix=1)
    q, _ = random_qk(pos.num_tokens)
    q2, k2 = pe.prepare(pos).qk(q, q, layer=1)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close((q2 * k2).sum(-1), (q * q).sum(-1))


@pytest.mark.parametrize('axes', [2, 3])
def test_liere_gd2_is_shift_invariant(axes):
    pe = _pe(axes, block=2)
    coords = torch.rand(9, axes, dtype=torch.float64) * 3
    shift = torch.randn(axes, dtype=torch.float64) * 5
    q, k = random_qk(10)

    def patch_logits(c):  # between patches; the class token is not rotated, so its logits see absolute positions
        return rotated_logits(pe, vispe.points(c, num_prefix=1), q, k)[..., 1:, 1:]
    assert checks.shift_invariance(patch_logits, coords, shift, atol=1e-10, rtol=0).passed


@pytest.mark.parametrize('axes', [2, 3])
def test_liere_gd8_is_not_shift_invariant(axes):
    """Dense 8x8 generators do not commute: a common shift of every position changes the logits."""
    pe = _pe(axes, block=8)
    coords = torch.rand(9, axes, dtype=torch.float64)
    q, k = random_qk(10)

    def patch_logits(c):
        return rotated_logits(pe, vispe.points(c, num_prefix=1), q, k)[..., 1:, 1:]
    shifted = checks.shift_invariance(patch_logits, coords, torch.full((axes,), 0.5, dtype=torch.float64), rtol=0)
    assert shifted.failed and shifted.measured > 1e-2
    assert not pe.shift_invariant and _pe(axes, block=2).shift_invariant


def test_liere_gd2_equals_rope_mixed_with_mapped_frequencies():
    """block = 2: block j rotates by sum_d p_d A_d[1, 0] = -sum_d p_d t_dj, a learned 2D RoPE frequency."""
    liere = _pe(block=2, positions='index')
    rope = vispe.create_pe('rope_mixed', dim=32, num_heads=2, depth=2, grid_size=(4, 4)).double()
    with torch.no_grad():
        # rope_mixed takes the column (x) first: its axis a is LieRE's axis D - 1 - a
        rope.freqs.copy_(-liere.generators[..., 0].flip(0))
    coords = torch.rand(7, 2, dtype=torch.float64) * 4
    q, k = random_qk(8)
    pos = vispe.points(coords, num_prefix=1)
    for layer in range(2):
        ql, kl = liere.prepare(pos).qk(q, k, layer=layer)
        qr, kr = rope.prepare(pos).qk(q, k, layer=layer)
        torch.testing.assert_close(ql, qr, rtol=0, atol=1e-12)
        torch.testing.assert_close(kl, kr, rtol=0, atol=1e-12)


def test_liere_positions_are_linspace_to_the_grid_ratio():
    """Per axis linspace(0, n / n_train, n): [0, 1] at the training size, beyond 1 when larger."""
    pe = _pe()
    at_train = pe.coordinates(vispe.grid(4, 4, train_grid=(4, 4)))
    r = torch.linspace(0, 1, 4, dtype=torch.float64)
    torch.testing.assert_close(at_train, torch.cartesian_prod(r, r))
    larger = pe.coordinates(vispe.grid(6, 3, train_grid=(4, 4)))
    expected = torch.cartesian_prod(torch.linspace(0, 1.5, 6, dtype=torch.float64),
                                    torch.linspace(0, 0.75, 3, dtype=torch.float64))
    torch.testing.assert_close(larger, expected)


def test_liere_class_token_is_not_rotated():
    pe = _pe()
    q, k = random_qk(17)
    q2, k2 = pe.prepare(vispe.grid(4, 4, num_prefix=1)).qk(q, k, layer=0)
    torch.testing.assert_close(q2[:, :, 0], q[:, :, 0], rtol=0, atol=0)
    assert (q2[:, :, 1:] - q[:, :, 1:]).abs().max() > 1e-3


def test_liere_channels_beyond_whole_blocks_pass_through():
    pe = _pe(block=3)  # head dim 16 = 5 blocks of 3 + 1 channel
    q, k = random_qk(17)
    q2, _ = pe.prepare(vispe.grid(4, 4, num_prefix=1)).qk(q, k, layer=0)
    torch.testing.assert_close(q2[..., 15], q[..., 15], rtol=0, atol=0)


def test_liere_layers_and_heads_use_their_own_generators():
    """The original ViT reuses layer 0's rotations everywhere (a slicing bug); vispe does not."""
    pe = _pe()
    assert pe.generators.shape == (2, 2, 2, 2, 28)  # (D, layers, heads, blocks, 8*7/2)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, k = random_qk(17)
    state = pe.prepare(pos)
    q0, _ = state.qk(q, k, layer=0)
    q1, _ = state.qk(q, k, layer=1)
    assert (q0 - q1).abs().max() > 1e-3
    shared = _pe(per_layer=False, per_head=False)
    assert shared.generators.shape == (2, 1, 1, 2, 28)
    q0, _ = shared.prepare(pos).qk(q, k, layer=0)
    q1, _ = shared.prepare(pos).qk(q, k, layer=1)
    torch.testing.assert_close(q0, q1, rtol=0, atol=0)
    torch.testing.assert_close(q0[:, 0].norm(dim=-1), q[:, 0].norm(dim=-1))


def test_liere_init_is_uniform_in_0_2pi():
    pe = vispe.create_pe('liere', dim=768, num_heads=12, depth=12, grid_size=(14, 14))
    g = pe.generators.detach()
    assert g.shape == (2, 12, 12, 8, 28)
    assert g.min() >= 0 and g.max() < 2 * math.pi
    assert abs(g.mean().item() - math.pi) < 0.05
    assert pe.no_weight_decay() == {'generators'}


def test_every_liere_layer_receives_gradient_in_a_tiny_vit():
    model = timm.create_model('vit_tiny', pe='liere', **TINY)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    grad = model.pe.generators.grad  # (D, L, H, blocks, 28)
    assert grad is not None
    for layer in range(TINY['depth']):
        assert grad[:, layer].abs().sum() > 0, f'layer {layer} generators got no gradient'


@pytest.mark.parametrize('spec', ['liere', 'liere:block=2', 'liere:block=4,per_layer=false,per_head=false'])
def test_liere_tiny_vit_forward_backward(spec):
    assert_tiny_vit_trains_and_runs_larger(spec)


def test_liere_video_and_point_positions():
    model = timm.create_model('vit_tiny', pe='liere', video=True, num_frames=4, tubelet=2, **TINY)
    assert model.pe.num_axes == 3
    assert model(torch.randn(1, 3, 4, 32, 32)).shape == (1, TINY['num_classes'])
    pe = _pe(axes=3)
    q, k = random_qk(6)
    q2, _ = pe.prepare(vispe.points(torch.rand(2, 5, 3, dtype=torch.float64), num_prefix=1)).qk(q, k, layer=0)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))


@pytest.mark.parametrize('option,value', [('block', '1'), ('block', '32'), ('positions', 'pixel')])
def test_liere_rejects_bad_options(option, value):
    with pytest.raises(ValueError, match=option):
        vispe.create_pe(f'liere:{option}={value}', dim=32, num_heads=2, grid_size=(4, 4))


def test_liere_rejects_positions_with_other_axes():
    pe = _pe()
    with pytest.raises(ValueError, match='num_axes'):
        pe.prepare(vispe.points(torch.rand(5, 3, dtype=torch.float64)))


@pytest.mark.slow
@pytest.mark.parametrize('backend', ['aot_eager', 'inductor'])
def test_liere_works_under_torch_compile(backend):
    torch._dynamo.reset()
    model = timm.create_model('vit_tiny', pe='liere', **TINY)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 32, 32)
    compiled(x).sum().backward()
    assert model.pe.generators.grad is not None
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize('name', ['liere', 'comrope_ap', 'comrope_ld', 'string_cayley', 'string_circulant'])
def test_cross_attention_rotates_queries_and_keys_by_their_own_positions(name):
    pe = vispe.create_pe(name, dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1).double().eval()
    pos_q = vispe.points(torch.rand(5, 2, dtype=torch.float64), num_prefix=1)
    pos_k = vispe.points(torch.rand(7, 2, dtype=torch.float64) * 3, num_prefix=1)
    q, k = torch.randn(2, 2, 6, 16, dtype=torch.float64), torch.randn(2, 2, 8, 16, dtype=torch.float64)
    q2, k2 = pe.prepare(pos_q, pos_k).qk(q, k, layer=1)
    q_self, _ = pe.prepare(pos_q).qk(q, q, layer=1)  # self-attention rotates q and k in one call
    _, k_self = pe.prepare(pos_k).qk(k, k, layer=1)
    torch.testing.assert_close(q2, q_self)
    torch.testing.assert_close(k2, k_self)


@pytest.mark.parametrize('name', ['liere', 'comrope_ap:block=4', 'string_cayley'])
def test_rotations_are_built_in_full_precision_under_autocast(name):
    """prepare() runs outside autocast: bf16 scaling-and-squaring would break orthogonality at ~1e-2."""
    pe = vispe.create_pe(name, dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1).eval()
    pos = vispe.grid((4, 4), num_prefix=1)
    with torch.autocast('cpu', dtype=torch.bfloat16), torch.no_grad():
        state = pe.prepare(pos)
    q = torch.randn(2, 2, 17, 16)
    q2, _ = state.qk(q, q, layer=1)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_liere_gd_spec_still_loads_as_block_with_a_deprecation_warning():
    """Specs saved before ``gd`` became ``block`` (configs, checkpoints' model args) build the same encoding."""
    ctx = vispe.PEContext(dim=32, num_heads=2, depth=1, grid_size=(4, 4))
    with pytest.warns(DeprecationWarning, match="'gd' of encoding 'liere' is now called 'block'"):
        old = vispe.create_pe('liere:gd=4', ctx)
    assert old.block == 4 and old.num_blocks == vispe.create_pe('liere:block=4', ctx).num_blocks
    with pytest.raises(ValueError, match="both 'gd' and its new name 'block'"):
        vispe.create_pe({'name': 'liere', 'gd': 4, 'block': 4}, ctx)
