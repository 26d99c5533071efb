"""RoPE-axial and RoPE-mixed: the properties RoPE-ViT promises, and agreement with timm's ports."""
import math

import pytest
import timm
import torch

import vispe
from vispe import checks
from vispe.rotary import apply_pair_rotation, axial_frequencies, rotation_table, scale_frequencies
from conftest import TINY, random_qk


def _logits(pe, pos, q, k):
    state = pe.prepare(pos)
    q2, k2 = state.qk(q, k, layer=1)
    return q2 @ k2.transpose(-2, -1)


def _pe(name, axes, **kw):
    grid = (4,) * axes
    return vispe.create_pe(name, dim=64, num_heads=2, depth=2, grid_size=grid, num_prefix_tokens=1, **kw).double()


@pytest.mark.parametrize('name', ['rope_axial', 'rope_mixed'])
@pytest.mark.parametrize('axes', [2, 3])
def test_rope_logits_are_shift_invariant(name, axes):
    pe = _pe(name, axes)
    coords = torch.rand(10, axes, dtype=torch.float64) * 7
    shift = torch.randn(axes, dtype=torch.float64) * 5
    q, k = torch.randn(2, 2, 11, 32, dtype=torch.float64), torch.randn(2, 2, 11, 32, dtype=torch.float64)

    def patch_logits(c):  # between patch tokens; the unrotated class token sees absolute positions (as in RoPE-ViT)
        return _logits(pe, vispe.points(c, num_prefix=1), q, k)[..., 1:, 1:]
    assert checks.shift_invariance(patch_logits, coords, shift, atol=1e-10, rtol=0).passed
    # and the logits do depend on relative positions
    assert checks.moves_output(patch_logits(coords), patch_logits(coords * 1.5), at_least=1e-3, relative=False).passed


@pytest.mark.parametrize('name', ['rope_axial', 'rope_mixed'])
def test_rope_rotation_is_orthogonal(name):
    pe = _pe(name, 2)
    pos = vispe.grid(4, 4, num_prefix=1)
    q = torch.randn(3, 2, 17, 32, dtype=torch.float64)
    q2, k2 = pe.prepare(pos).qk(q, q, layer=0)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))
    # inner products between tokens at the same position are preserved too (R^T R = I)
    torch.testing.assert_close((q2 * k2).sum(-1), (q * q).sum(-1))


@pytest.mark.parametrize('name', ['rope_axial', 'rope_mixed'])
def test_rope_leaves_prefix_tokens_untouched(name):
    pe = _pe(name, 2)
    q = torch.randn(2, 2, 17, 32, dtype=torch.float64)
    q2, _ = pe.prepare(vispe.grid(4, 4, num_prefix=1)).qk(q, q, layer=0)
    torch.testing.assert_close(q2[:, :, 0], q[:, :, 0], rtol=0, atol=0)
    assert (q2[:, :, 2:] - q[:, :, 2:]).abs().max() > 1e-3


def test_rope_axial_matches_paper_layout_by_hand():
    """RoPE-ViT: pairs (2j, 2j+1); first hd/4 pairs rotate by x * 100^(-4j/hd), next hd/4 by y."""
    hd = 8
    pe = vispe.create_pe('rope_axial', dim=hd, num_heads=1, grid_size=(3, 3))
    pos = vispe.grid(3, 3)
    row, col = 1, 2
    token = row * 3 + col
    q = torch.randn(1, 1, 9, hd)
    out, _ = pe.prepare(pos).qk(q, q, layer=0)
    freqs = [100 ** (-4 * j / hd) for j in range(hd // 4)]
    angles = [col * f for f in freqs] + [row * f for f in freqs]
    expect = []
    for j, a in enumerate(angles):
        x0, x1 = q[0, 0, token, 2 * j].item(), q[0, 0, token, 2 * j + 1].item()
        expect += [x0 * math.cos(a) - x1 * math.sin(a), x0 * math.sin(a) + x1 * math.cos(a)]
    torch.testing.assert_close(out[0, 0, token], torch.tensor(expect), rtol=1e-5, atol=1e-6)


def test_rope_mixed_init_follows_paper():
    pe = vispe.create_pe('rope_mixed', dim=64, num_heads=4, depth=3, grid_size=(4, 4))
    f = pe.freqs  # (2, L, H, hd/2)
    assert f.shape == (2, 3, 4, 8)
    mags = f.norm(dim=0)
    expect = 1 / 10 ** (4 * torch.arange(4) / 16)
    torch.testing.assert_close(mags[..., :4], expect.expand(3, 4, 4))
    torch.testing.assert_close(mags[..., 4:], expect.expand(3, 4, 4))
    # second half of the pairs points along alpha + pi/2: orthogonal to the first half
    dot = (f[..., :4] * f[..., 4:]).sum(0)
    torch.testing.assert_close(dot, torch.zeros_like(dot), atol=1e-6, rtol=0)
    assert 'freqs' in pe.no_weight_decay()


@pytest.mark.parametrize('timm_name,pe', [('vit_base_patch16_rope_224', 'rope_axial'),
                                           ('vit_base_patch16_rope_mixed_224', 'rope_mixed')])
def test_rope_vit_equals_timm_port(timm_name, pe):
    """timm's Eva ports of RoPE-ViT (rope_grid_indexing='xy': x first, as RoPE-ViT) are an independent
    implementation: with the same weights (timm's gamma_1/2 are our ls1/ls2.gamma, rope.freqs is pe.freqs)
    the logits agree at the training size and at a non-square larger size."""
    kw = dict(TINY, dynamic_img_size=True)
    ref = timm.create_model(timm_name, **kw).eval()
    for name, p in ref.named_parameters():
        if 'gamma' in name or 'head' in name:
            torch.nn.init.normal_(p)
    sd = {k.replace('gamma_1', 'ls1.gamma').replace('gamma_2', 'ls2.gamma').replace('rope.freqs', 'pe.freqs'): v
          for k, v in ref.state_dict().items()}
    model = timm.create_model('vit_tiny', pe=pe, init_values=1e-5, **TINY).eval()
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        for size in [(32, 32), (48, 64)]:
            x = torch.randn(2, 3, *size)
            torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_ntk_scaling_matches_base_change():
    """NTK-aware scaling = RoPE with base theta * s^(d/(d-2)) (bloc97's definition)."""
    d, theta, s = 16, 100.0, 3.0
    base = axial_frequencies(d // 2, theta, step=2.0, dim=d)
    scaled, mag = scale_frequencies(base, s, 'ntk', train_length=14)
    expect = axial_frequencies(d // 2, theta * s ** (d / (d - 2)), step=2.0, dim=d)
    torch.testing.assert_close(scaled, expect)
    assert mag == 1.0


def test_yarn_keeps_high_and_interpolates_low_frequencies():
    base = axial_frequencies(8, 10000.0, step=2.0, dim=16)
    s, length = 4.0, 1024
    scaled, mag = scale_frequencies(base, s, 'yarn', train_length=length)
    turns = length * base / (2 * math.pi)
    keep, interp = turns > 32, turns < 1
    assert keep.any() and interp.any()
    torch.testing.assert_close(scaled[keep], base[keep])
    torch.testing.assert_close(scaled[interp], base[interp] / s)
    assert mag == pytest.approx(0.1 * math.log(s) + 1)


def test_linear_scaling_equals_normalized_grid():
    """Position interpolation with factor n/n_train is the same map as the normalized grid mode."""
    a = vispe.create_pe('rope_axial:scaling=linear', dim=32, num_heads=1, grid_size=(4, 4))
    b = vispe.create_pe('rope_axial:grid_mode=normalized', dim=32, num_heads=1, grid_size=(4, 4))
    pos = vispe.grid(8, 6, train_grid=(4, 4))
    torch.testing.assert_close(a.prepare(pos).state.q, b.prepare(pos).state.q)


def test_half_layout_matches_rotate_half_formula():
    """Rotate-half layout (LLM code): out = x * cos + rotate_half(x) * sin with duplicated cos/sin."""
    x = torch.randn(2, 5, 8)
    angles = torch.rand(5, 4) * 6
    out = apply_pair_rotation(x, rotation_table(angles), layout='half')
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rot_half = torch.cat([-x[..., 4:], x[..., :4]], -1)
    torch.testing.assert_close(out, x * cos + rot_half * sin)


def test_rope_in_bf16_matches_float32_within_bf16_precision():
    pe = vispe.create_pe('rope_axial', dim=64, num_heads=1, grid_size=(14, 14))
    pos = vispe.grid(14, 14)
    q = torch.randn(1, 1, 196, 64)
    ref, _ = pe.prepare(pos).qk(q, q, 0)
    out, _ = pe.prepare(pos).qk(q.bfloat16(), q.bfloat16(), 0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def _saved_bytes(model, x):
    """Bytes of the distinct storages a training forward saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            storages[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x)
    return sum(storages.values())


@pytest.mark.parametrize('pe', ['rope_axial', 'rope_mixed', 'liere', 'comrope_ap:block=4,jitter=0', 'string_cayley',
                                'string_circulant'])
def test_rotation_saves_nothing_per_sample_beyond_no_encoding(pe):
    """What a rotary encoding adds to the activations saved for backward (its rotation tables) does not
    grow with the batch: only the rotated q and k are kept (attention keeps them anyway), v's own copy
    lets the fused qkv projection go, and the rotated q keeps attention's memory layout, so the
    projection after attention saves no relaid copy of its output."""
    def extra(batch):
        x = torch.randn(batch, 3, 32, 32)
        torch.manual_seed(0)
        with_pe = _saved_bytes(timm.create_model('vit_tiny', pe=pe, **TINY).train(), x)
        return with_pe - _saved_bytes(timm.create_model('vit_tiny', pe='none', **TINY).train(), x)
    assert extra(2) == extra(6)


@pytest.mark.parametrize('spec', ['string_cayley', 'string_circulant', 'liere:block=2', 'comrope_ld:jitter=0'])
def test_eval_state_holds_complex_tables_and_rotates_like_training(spec):
    """Eval (no gradient, cached state) keeps cos/sin tables instead of angles, so they are not
    rebuilt in every layer of every forward; the rotated q and k equal the training path's."""
    name, _, opts = spec.partition(':')
    kw = dict(o.split('=') for o in opts.split(',') if o)
    kw = {k: (int(v) if v.isdigit() else v) for k, v in kw.items()}
    pe = vispe.create_pe(name, dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1, **kw).double()
    pos = vispe.grid(4, 4, num_prefix=1)
    q, k = random_qk(pos.num_tokens)
    pe.train()
    expected = pe.prepare(pos).qk(q, k, layer=1)
    pe.eval()
    with torch.no_grad():
        state = pe.prepare(pos)
        got = state.qk(q, k, layer=1)
    assert any(t.is_complex() for t in torch.utils._pytree.tree_leaves(state.state) if torch.is_tensor(t))
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


@pytest.mark.parametrize('spec', ['rope_axial', 'rope_mixed'])
def test_self_attention_rotates_q_and_k_in_one_call(spec, monkeypatch):
    """One table for q and k: one stacked rotation per layer (one fused launch on a GPU), not two."""
    import timm
    from vispe.rotary import autograd
    sizes, rotate = [], autograd._rotate
    monkeypatch.setattr(autograd, '_rotate', lambda inputs, *a: sizes.append(len(inputs)) or rotate(inputs, *a))
    model = timm.create_model('vit_tiny', pe=spec, embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8)
    model(torch.randn(1, 3, 32, 32)).sum().backward()
    assert sizes == [2, 2]
