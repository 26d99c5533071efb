"""PRoPE: projective camera encoding (Li et al., 2025)."""
import pytest
import torch

import vispe
from vispe.attention import pe_attention
from vispe.cameras import Cameras
from conftest import random_intrinsics, random_poses

DT = torch.float64
H_IMG, W_IMG = 16, 24  # pixels; a 2 x 3 grid of 8-pixel patches
GRID = (2, 3)


def random_cameras(views: int, g: torch.Generator, batch: int = 0, intrinsics: bool = True) -> Cameras:
    n = views * max(batch, 1)
    K = random_intrinsics(n, g, (H_IMG, W_IMG), skew=True)  # skew: the inverse must be a true inverse
    shape = (batch, views) if batch else (views,)
    return Cameras(K.reshape(*shape, 3, 3) if intrinsics else None,
                   cam_to_world=random_poses(n, g).reshape(*shape, 4, 4), image_size=(H_IMG, W_IMG))


def qkv(n: int, hd: int = 16, seed: int = 0, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 2, n, hd, dtype=DT, generator=g) for _ in range(3))


def prope(spec: str = 'prope', hd: int = 16) -> vispe.PositionalEncoding:
    return vispe.create_pe(spec, dim=2 * hd, num_heads=2, depth=1).double()


def split_rotation(m: int, position: float, sign: float) -> torch.Tensor:
    """The official split-layout RoPE on ``m`` channels as a dense matrix: pairs (j, j + m/2), base 100."""
    nf = m // 2
    R = torch.zeros(m, m, dtype=DT)
    for j in range(nf):
        a = torch.tensor(sign * position * 100.0 ** (-j / nf), dtype=DT)
        R[j, j], R[j, j + nf], R[j + nf, j], R[j + nf, j + nf] = a.cos(), -a.sin(), a.sin(), a.cos()
    return R


def dense_reference(q, k, v, cams: Cameras, num_prefix: int):
    """PRoPE from the paper's formulas with one dense (hd x hd) matrix per token and explicit softmax."""
    hd = q.shape[-1]
    H, W = cams.image_size
    K = cams.K
    Kn = torch.zeros_like(K)  # normalised intrinsics, written out
    Kn[..., 0, 0], Kn[..., 0, 1], Kn[..., 0, 2] = K[..., 0, 0] / W, K[..., 0, 1] / W, K[..., 0, 2] / W - 0.5
    Kn[..., 1, 1], Kn[..., 1, 2], Kn[..., 2, 2] = K[..., 1, 1] / H, K[..., 1, 2] / H - 0.5, 1.0
    lift = torch.zeros(*K.shape[:-2], 4, 4, dtype=DT)
    lift[..., :3, :3], lift[..., 3, 3] = Kn, 1.0
    P = lift @ torch.linalg.inv(cams.cam_to_world)
    mats = {'q': [], 'kv': [], 'o': []}
    for _ in range(num_prefix):
        for key in mats:
            mats[key].append(torch.eye(hd, dtype=DT))
    for view in range(cams.num_views):
        for row in range(GRID[0]):
            for col in range(GRID[1]):
                Pv = P[view]
                for key, proj, sign in (('q', Pv.T, -1.0), ('kv', torch.linalg.inv(Pv), -1.0), ('o', Pv, 1.0)):
                    mats[key].append(torch.block_diag(*[proj] * (hd // 8),
                                                      split_rotation(hd // 4, col, sign),
                                                      split_rotation(hd // 4, row, sign)))
    Dq, Dkv, Do = (torch.stack(mats[key]) for key in ('q', 'kv', 'o'))
    qt = torch.einsum('nij,bhnj->bhni', Dq, q)
    kt = torch.einsum('nij,bhnj->bhni', Dkv, k)
    vt = torch.einsum('nij,bhnj->bhni', Dkv, v)
    a = (qt @ kt.transpose(-1, -2) * hd ** -0.5).softmax(-1)
    return torch.einsum('nij,bhnj->bhni', Do, a @ vt)


def test_prope_equals_the_dense_reference_of_the_paper():
    g = torch.Generator().manual_seed(0)
    cams = random_cameras(3, g)
    pos = vispe.positions.multiview(cams, GRID, num_prefix=1, dtype=DT)
    q, k, v = qkv(pos.num_tokens)
    pe = prope()
    torch.testing.assert_close(pe_attention(q, k, v, pe.prepare(pos)), dense_reference(q, k, v, cams, 1))


@pytest.mark.parametrize('batch', [0, 2])
def test_prope_is_invariant_to_a_global_rigid_transform_of_the_cameras(batch):
    g = torch.Generator().manual_seed(1)
    cams = random_cameras(4, g, batch=batch)
    G = random_poses(1, g, scale=20.0)[0]
    q, k, v = qkv(4 * 6, seed=1)
    pe = prope()
    outs = [pe_attention(q, k, v, pe.prepare(vispe.positions.multiview(c, GRID, dtype=DT)))
            for c in (cams, cams.transform(G))]
    torch.testing.assert_close(outs[0], outs[1])
    # cameras do matter: moving one camera relative to the others changes the output
    c2w = cams.cam_to_world.clone()
    c2w[..., 0, :3, 3] += 1.0
    moved = Cameras(cams.K, cam_to_world=c2w, image_size=cams.image_size)
    other = pe_attention(q, k, v, pe.prepare(vispe.positions.multiview(moved, GRID, dtype=DT)))
    assert not torch.allclose(outs[0], other)


def test_prope_is_invariant_to_a_common_shift_of_the_patch_indices():
    g = torch.Generator().manual_seed(2)
    pos = vispe.positions.multiview(random_cameras(2, g), GRID, dtype=DT)
    shifted = pos.replace(coords=pos.coords + torch.tensor([3.0, -5.0], dtype=DT))
    q, k, v = qkv(pos.num_tokens, seed=2)
    pe = prope()
    torch.testing.assert_close(pe_attention(q, k, v, pe.prepare(pos)),
                               pe_attention(q, k, v, pe.prepare(shifted)))


@pytest.mark.parametrize('spec', ['prope', 'prope:intrinsics=false'])
def test_prope_without_intrinsics_equals_gta_se3_part(spec):
    # PRoPE with P = world_to_cam is GTA's SE(3) representation; compare on the first half of the
    # head dim (PRoPE's projective half, GTA's SE(3) group when se3_dims = hd / 2 comes first)
    hd = 16
    g = torch.Generator().manual_seed(3)
    cams = random_cameras(3, g, intrinsics=spec != 'prope')
    pos = vispe.positions.multiview(cams, GRID, num_prefix=1, dtype=DT)
    q, k, v = qkv(pos.num_tokens, hd, seed=3)
    q[..., hd // 2:] = 0  # logits from the camera channels only
    k[..., hd // 2:] = 0
    gta = vispe.create_pe(f'gta_multiview:se3_dims={hd // 2},so2_dims={hd // 2},translation_scale=1,'
                          f'learn_translation_scale=false', dim=2 * hd, num_heads=2).double()
    pe = prope(spec, hd)
    a = pe_attention(q, k, v, pe.prepare(pos))
    b = pe_attention(q, k, v, gta.prepare(pos))
    torch.testing.assert_close(a[..., :hd // 2], b[..., :hd // 2])


def test_prope_output_map_inverts_the_value_map_with_intrinsics():
    g = torch.Generator().manual_seed(4)
    pos = vispe.positions.multiview(random_cameras(2, g, batch=2), GRID, num_prefix=1, dtype=DT)
    pe = prope()
    state = pe.prepare(pos)
    _, _, v = qkv(pos.num_tokens, seed=4)
    torch.testing.assert_close(state.output(state.value(v, 0), 0), v)
    assert pe.flash_eligible  # only q/k/v/output maps: SDPA keeps its fused kernels


def test_prope_attention_layer_trains_on_multiview_tokens():
    g = torch.Generator().manual_seed(5)
    cams = random_cameras(2, g, batch=2).to(torch.float32)
    pos = vispe.positions.multiview(cams, GRID)
    pe = vispe.create_pe('prope', dim=32, num_heads=2)
    attn = vispe.PEAttention(32, num_heads=2)
    x = torch.randn(2, pos.num_tokens, 32, requires_grad=True)
    attn(x, pe=pe.prepare(pos)).sum().backward()
    assert torch.isfinite(x.grad).all() and attn.qkv.weight.grad.abs().sum() > 0


def test_prope_needs_image_size_for_intrinsics_and_head_dim_multiple_of_8():
    cams = Cameras(torch.eye(3)[None].repeat(2, 1, 1), cam_to_world=torch.eye(4).repeat(2, 1, 1))
    with pytest.raises(ValueError, match='image_size'):
        prope().prepare(vispe.positions.multiview(cams, GRID))
    with pytest.raises(ValueError, match='divisible by 8'):
        vispe.create_pe('prope', dim=24, num_heads=2)
