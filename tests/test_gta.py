"""GTA on the image grid and multi-view GTA."""
import pytest
import timm
import torch

import vispe
from vispe.attention import pe_attention
from vispe.cameras import Cameras
from conftest import random_intrinsics, random_poses

DT = torch.float64


def hand_gta_rotate(x: torch.Tensor, coords: torch.Tensor, num_prefix: int, inverse: bool = False) -> torch.Tensor:
    """GTA's make_SO2mats by hand: pair 2f by row * w_f, pair 2f + 1 by col * w_f, w_f = 10000^(-f/F)."""
    hd = x.shape[-1]
    F = hd // 4
    w = 10000.0 ** (-torch.arange(F, dtype=DT) / F)
    ang = torch.stack([coords[:, 0:1] * w, coords[:, 1:2] * w], -1).reshape(-1, 2 * F)  # (N, hd/2)
    ang = torch.cat([torch.zeros(num_prefix, 2 * F, dtype=DT), ang])
    ang = -ang if inverse else ang
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x0 * ang.cos() - x1 * ang.sin()
    out[..., 1::2] = x0 * ang.sin() + x1 * ang.cos()
    return out


def explicit_attention(q, k, v):
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


def qkv(n: int, hd: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, hd, dtype=DT, generator=g) for _ in range(3))


def gta(spec: str = 'gta', hd: int = 16, **ctx) -> vispe.PositionalEncoding:
    return vispe.create_pe(spec, dim=2 * hd, num_heads=2, **ctx).double()


def test_gta_without_value_transform_equals_hand_written_rope():
    pos = vispe.grid(3, 4, num_prefix=1, dtype=DT)
    q, k, v = qkv(pos.num_tokens)
    pe = gta('gta:value_transform=false')
    out = pe_attention(q, k, v, pe.prepare(pos))
    c = pos.coords
    expected = explicit_attention(hand_gta_rotate(q, c, 1), hand_gta_rotate(k, c, 1), v)
    torch.testing.assert_close(out, expected)


def test_gta_equals_hand_written_gta_with_value_and_output_maps():
    pos = vispe.grid(3, 4, num_prefix=1, dtype=DT)
    q, k, v = qkv(pos.num_tokens, seed=1)
    pe = gta()
    c = pos.coords
    o = explicit_attention(hand_gta_rotate(q, c, 1), hand_gta_rotate(k, c, 1), hand_gta_rotate(v, c, 1))
    torch.testing.assert_close(pe_attention(q, k, v, pe.prepare(pos)), hand_gta_rotate(o, c, 1, inverse=True))


def test_gta_qk_equals_vispe_rope_axial_up_to_a_channel_permutation():
    # same frequency set (theta = 10000); GTA interleaves (row, col) pairs, rope_axial puts x (col) pairs first
    hd = 16
    F = hd // 4
    pos = vispe.grid(4, 5, dtype=DT)
    q, k, _ = qkv(pos.num_tokens, hd)
    g = gta('gta:value_transform=false', hd)
    r = vispe.create_pe('rope_axial:theta=10000', dim=2 * hd, num_heads=2, grid_size=(4, 5)).double()
    gq, gk = g.prepare(pos).qk(q, k, 0)
    pair = [F + f if a == 0 else f for f in range(F) for a in range(2)]  # GTA pair -> rope_axial pair
    perm = torch.tensor([2 * p + i for p in pair for i in range(2)])
    inv = torch.argsort(perm)
    rq, rk = r.prepare(pos).qk(q[..., inv], k[..., inv], 0)
    torch.testing.assert_close(gq @ gk.transpose(-1, -2), rq.float().double() @ rk.float().double().transpose(-1, -2),
                               atol=1e-4, rtol=1e-4)  # rope_axial's table is float32


@pytest.mark.parametrize('value_transform', [True, False])
def test_gta_logits_and_outputs_are_invariant_to_a_translation_of_the_grid(value_transform):
    pe = gta(f'gta:value_transform={value_transform}')
    base = vispe.grid(3, 4, dtype=DT)
    moved = vispe.points(base.coords + torch.tensor([7.0, -3.0], dtype=DT))
    q, k, v = qkv(base.num_tokens, seed=2)
    outs, logits = [], []
    for pos in (base, moved):
        state = pe.prepare(pos)
        qq, kk = state.qk(q, k, 0)
        logits.append(qq @ kk.transpose(-1, -2))
        outs.append(pe_attention(q, k, v, state))
    torch.testing.assert_close(logits[0], logits[1])
    torch.testing.assert_close(outs[0], outs[1])
    assert not torch.allclose(outs[0], pe_attention(q, k, v))  # positions do matter


def test_gta_output_map_inverts_the_value_map():
    pe = gta()
    pos = vispe.grid(3, 3, num_prefix=2, dtype=DT)
    state = pe.prepare(pos)
    _, _, v = qkv(pos.num_tokens, seed=3)
    torch.testing.assert_close(state.output(state.value(v, 0), 0), v)


def test_gta_vit_has_no_parameters_and_trains():
    model = timm.create_model('vit_tiny', pe='gta', img_size=32, patch_size=8, depth=2, embed_dim=32,
                              num_heads=2, num_classes=3)
    assert not list(model.pe.parameters()) and model.pe.flash_eligible
    assert {'qk', 'value', 'output'} <= model.pe.hooks
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0


def multiview_setup(batched: bool = False, num_views: int = 3, grid=(2, 3), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (2, num_views) if batched else (num_views,)
    n = 2 * num_views if batched else num_views
    K = random_intrinsics(n, g, size=(8 * grid[0], 8 * grid[1])).reshape(*shape, 3, 3)
    T = random_poses(n, g).reshape(*shape, 4, 4)
    return Cameras(K, cam_to_world=T, image_size=(8 * grid[0], 8 * grid[1])), g


@pytest.mark.parametrize('batched', [False, True])
def test_gta_multiview_is_invariant_to_a_global_rigid_transform_of_the_cameras(batched):
    cams, g = multiview_setup(batched)
    pe = vispe.create_pe('gta_multiview', dim=32, num_heads=2, depth=2).double()
    with torch.no_grad():
        pe.translation_scale.copy_(torch.tensor([0.5, 1.3]))  # two layers, two scales
    G = random_poses(1, g, scale=20.0)[0]
    q, k, v = qkv(cams.num_views * 6, seed=4)
    for layer in (0, 1):
        outs = [pe_attention(q, k, v, pe.prepare(vispe.positions.multiview(c, (2, 3), dtype=DT)), layer)
                for c in (cams, cams.transform(G))]
        torch.testing.assert_close(outs[0], outs[1])


def test_gta_multiview_learns_its_translation_scale_and_inverts_its_value_map():
    cams, _ = multiview_setup()
    pe = vispe.create_pe('gta_multiview', dim=48, num_heads=2, depth=2).double()
    assert (pe.identity_dims, pe.se3_dims, pe.so2_dims) == (0, 12, 12)
    assert pe.no_weight_decay() == {'translation_scale'}
    pos = vispe.positions.multiview(cams, (2, 3), num_prefix=1, dtype=DT)
    q, k, v = qkv(pos.num_tokens, hd=24, seed=5)
    state = pe.prepare(pos)
    torch.testing.assert_close(state.output(state.value(v, 1), 1), v)
    pe_attention(q, k, v, state, 1).square().sum().backward()
    assert pe.translation_scale.grad[1] != 0 and pe.translation_scale.grad[0] == 0
    fixed = vispe.create_pe('gta_multiview:learn_translation_scale=false', dim=48, num_heads=2)
    assert not list(fixed.parameters())


def test_gta_multiview_rejects_bad_splits_and_missing_cameras():
    with pytest.raises(ValueError, match='multiples of 4'):
        vispe.create_pe('gta_multiview:se3_dims=6', dim=32, num_heads=2)
    pe = vispe.create_pe('gta_multiview', dim=32, num_heads=2)
    with pytest.raises(ValueError, match='multiview'):
        pe.prepare(vispe.grid(2, 3))
