"""Cameras, Plücker rays, multi-view positions and the Plücker embedding encoding."""
import math

import pytest
import torch

import vispe
from vispe.cameras import Cameras, plucker_rays
from conftest import random_intrinsics, random_poses

DT = torch.float64


def encodings_md_camera() -> Cameras:
    """ENCODINGS.md's case: 2x2 image, fx = fy = 2, cx = cy = 1, R = 90 degrees about y, o = (1, 2, 3)."""
    K = torch.tensor([[2., 0., 1.], [0., 2., 1.], [0., 0., 1.]], dtype=DT)
    c, s = math.cos(math.pi / 2), math.sin(math.pi / 2)
    T = torch.eye(4, dtype=DT)
    T[:3, :3] = torch.tensor([[c, 0, s], [0, 1, 0], [-s, 0, c]], dtype=DT)
    T[:3, 3] = torch.tensor([1., 2., 3.], dtype=DT)
    return Cameras(K[None], cam_to_world=T[None], image_size=(2, 2))


def test_plucker_rays_match_the_encodings_md_2x2_case():
    rays = plucker_rays(encodings_md_camera(), 2, 2)
    assert rays.shape == (1, 2, 2, 6)
    m, d = rays[0, 0, 0, :3], rays[0, 0, 0, 3:]
    torch.testing.assert_close(d, torch.tensor([0.942809, -0.235702, 0.235702], dtype=DT), atol=1e-6, rtol=0)
    torch.testing.assert_close(m, torch.tensor([1.178511, 2.592725, -2.121320], dtype=DT), atol=1e-6, rtol=0)
    swapped = plucker_rays(encodings_md_camera(), 2, 2, order='direction_first')
    torch.testing.assert_close(swapped[..., :3], rays[..., 3:])
    torch.testing.assert_close(swapped[..., 3:], rays[..., :3])


def test_plucker_directions_are_unit_and_orthogonal_to_moments():
    g = torch.Generator().manual_seed(0)
    cams = Cameras(random_intrinsics(3, g, skew=True), cam_to_world=random_poses(3, g), image_size=(24, 32))
    rays = plucker_rays(cams, 24, 32)
    m, d = rays[..., :3], rays[..., 3:]
    torch.testing.assert_close(d.norm(dim=-1), torch.ones(rays.shape[:-1], dtype=DT))
    assert (m * d).sum(-1).abs().max() < 1e-12
    # the moment is o x d for the camera centre o: every ray passes through its camera
    o = cams.centers[:, None, None, :].expand_as(d)
    torch.testing.assert_close(m, torch.linalg.cross(o, d, dim=-1))


def test_plucker_rays_reproject_to_their_pixel_centres():
    g = torch.Generator().manual_seed(1)
    cams = Cameras(random_intrinsics(2, g, skew=True), world_to_cam=random_poses(2, g), image_size=(24, 32))
    d = plucker_rays(cams, 24, 32)[..., 3:]
    points = cams.centers[:, None, None, :] + 2.5 * d  # a point on each ray, in front of the camera
    homog = torch.cat([points, torch.ones_like(points[..., :1])], -1)
    cam = torch.einsum('vij,vhwj->vhwi', cams.world_to_cam, homog)[..., :3]
    pix = torch.einsum('vij,vhwj->vhwi', cams.K, cam)
    uv = pix[..., :2] / pix[..., 2:]
    rows, cols = torch.meshgrid(torch.arange(24, dtype=DT), torch.arange(32, dtype=DT), indexing='ij')
    expected = torch.stack([cols + 0.5, rows + 0.5], -1).expand_as(uv)
    torch.testing.assert_close(uv, expected)
    assert (cam[..., 2] > 0).all()  # OpenCV: the camera looks along +z


def test_patch_centre_rays_are_the_rays_of_the_central_pixel():
    g = torch.Generator().manual_seed(2)
    cams = Cameras(random_intrinsics(2, g), cam_to_world=random_poses(2, g), image_size=(24, 33))
    per_pixel = plucker_rays(cams, 24, 33)
    per_patch = plucker_rays(cams, 24, 33, patch=3)  # odd patch: its centre is a pixel centre
    assert per_patch.shape == (2, 8, 11, 6)
    torch.testing.assert_close(per_patch, per_pixel[:, 1::3, 1::3])


def test_batched_cameras_equal_per_sample_cameras():
    g = torch.Generator().manual_seed(3)
    K, T = random_intrinsics(6, g).reshape(2, 3, 3, 3), random_poses(6, g).reshape(2, 3, 4, 4)
    batched = plucker_rays(Cameras(K, cam_to_world=T), 8, 8, patch=4)
    for b in range(2):
        torch.testing.assert_close(batched[b], plucker_rays(Cameras(K[b], cam_to_world=T[b]), 8, 8, patch=4))


def test_camera_pose_conversions_are_inverse_and_give_the_centres():
    g = torch.Generator().manual_seed(4)
    w2c = random_poses(4, g)
    cams = Cameras(world_to_cam=w2c)
    torch.testing.assert_close(cams.cam_to_world, torch.linalg.inv(w2c))
    R, t = w2c[:, :3, :3], w2c[:, :3, 3]
    torch.testing.assert_close(cams.centers, -(R.transpose(-1, -2) @ t[..., None])[..., 0])
    G = random_poses(1, g)[0]
    moved = cams.transform(G)
    torch.testing.assert_close(moved.cam_to_world, G @ cams.cam_to_world)
    # relative poses are unchanged by a change of world frame
    torch.testing.assert_close(moved.world_to_cam[0] @ moved.cam_to_world[1],
                               cams.world_to_cam[0] @ cams.cam_to_world[1])


def test_normalized_intrinsics_follow_prope_convention():
    K = torch.tensor([[[40., 0., 15.], [0., 30., 12.], [0., 0., 1.]]], dtype=DT)
    cams = Cameras(K, cam_to_world=torch.eye(4, dtype=DT)[None], image_size=(24, 32))
    expected = torch.tensor([[[40 / 32, 0, 15 / 32 - 0.5], [0, 30 / 24, 12 / 24 - 0.5], [0, 0, 1]]], dtype=DT)
    torch.testing.assert_close(cams.normalized_K(), expected)


@pytest.mark.parametrize('bad, what', [
    (torch.diag(torch.tensor([2., 1., 1., 1.])), 'rigid'),  # a scale is not a rotation
    (torch.diag(torch.tensor([-1., 1., 1., 1.])), 'determinant'),  # a reflection
    (torch.tensor([[1., 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]), 'last row'),
])
def test_cameras_reject_non_rigid_poses(bad, what):
    with pytest.raises(ValueError, match='cam_to_world') as err:
        Cameras(cam_to_world=bad[None])
    assert what in str(err.value)
    with pytest.raises(ValueError, match='world_to_cam'):
        Cameras(world_to_cam=bad[None])


def test_cameras_reject_singular_or_malformed_intrinsics():
    pose = torch.eye(4)[None]
    with pytest.raises(ValueError, match='singular'):
        Cameras(torch.tensor([[[0., 0, 1], [0, 2, 1], [0, 0, 1]]]), cam_to_world=pose)
    with pytest.raises(ValueError, match='last row'):
        Cameras(torch.tensor([[[2., 0, 1], [0, 2, 1], [0, 1, 1]]]), cam_to_world=pose)
    with pytest.raises(ValueError, match='same views'):
        Cameras(torch.eye(3).repeat(2, 1, 1), cam_to_world=pose)
    with pytest.raises(ValueError, match='exactly one'):
        Cameras(cam_to_world=pose, world_to_cam=pose)
    with pytest.raises(ValueError, match='image_size'):
        Cameras(torch.eye(3)[None], cam_to_world=pose).normalized_K()


def test_multiview_positions_layout():
    cams = Cameras(cam_to_world=torch.eye(4).repeat(3, 1, 1))
    pos = vispe.positions.multiview(cams, grid=(2, 4), num_prefix=1)
    assert pos.coords.shape == (24, 2) and pos.num_tokens == 25 and pos.train_grid == (2, 4)
    assert pos.view_index.tolist() == [v for v in range(3) for _ in range(8)]
    # token v * h * w + r * w + c is patch (r, c) of view v
    assert pos.coords[8 + 1 * 4 + 3].tolist() == [1.0, 3.0]
    assert pos.cameras is cams
    with pytest.raises(ValueError, match='grid'):
        vispe.positions.multiview(Cameras(cam_to_world=torch.eye(4)[None], image_size=(30, 30)), grid=(4, 4))


def _plucker_setup(num_prefix: int = 1):
    g = torch.Generator().manual_seed(5)
    cams = Cameras(random_intrinsics(2, g, size=(8, 12)), cam_to_world=random_poses(2, g), image_size=(8, 12))
    return cams, vispe.positions.multiview(cams, grid=(2, 3), num_prefix=num_prefix, dtype=DT)


def test_plucker_encoding_adds_projected_patch_centre_rays():
    cams, pos = _plucker_setup()
    pe = vispe.create_pe('plucker:sampling=center,patch_size=4', dim=16).double()
    x = torch.randn(2, pos.num_tokens, 16, dtype=DT)
    rays = plucker_rays(cams, 8, 12, patch=4).reshape(12, 6)  # views then row-major patches
    expected = x + torch.cat([torch.zeros(1, 16, dtype=DT), pe.proj(rays)])
    torch.testing.assert_close(pe.embed(x, pos), expected)


def test_plucker_encoding_patchifies_pixel_rays_row_major():
    cams, pos = _plucker_setup(num_prefix=0)
    pe = vispe.create_pe('plucker:patch_size=4', dim=8).double()
    feats = pe.ray_features(pos)
    assert feats.shape == (12, 6 * 16)
    pixel = plucker_rays(cams, 8, 12)  # (V, 8, 12, 6)
    v, r, c = 1, 1, 2  # token 1 * 6 + 1 * 3 + 2
    torch.testing.assert_close(feats[v * 6 + r * 3 + c], pixel[v, 4 * r:4 * r + 4, 4 * c:4 * c + 4].reshape(-1))


def test_plucker_concat_mode_starts_as_add_and_checks_patch_size():
    cams, pos = _plucker_setup()
    add = vispe.create_pe('plucker:patch_size=4', dim=16).double()
    cat = vispe.create_pe('plucker:patch_size=4,mode=concat', dim=16).double()
    cat.proj.load_state_dict(add.proj.state_dict())
    x = torch.randn(2, pos.num_tokens, 16, dtype=DT)
    torch.testing.assert_close(cat.embed(x, pos), add.embed(x, pos))
    with pytest.raises(ValueError, match='image_size'):
        vispe.create_pe('plucker:patch_size=8', dim=16).double().embed(x, pos)
    with pytest.raises(ValueError, match='multiview'):
        add.embed(x[:, :7], vispe.grid(2, 3, num_prefix=1))


def test_plucker_rays_keep_float32_geometry_under_autocast():
    """Under bf16 autocast the ray geometry stays in the cameras' float32 (a bf16 matmul there mixed
    dtypes in the cross product and would lose the rays' precision)."""
    cams = encodings_md_camera().to(torch.float32)
    uv = torch.rand(5, 2) * 2
    view_index = torch.zeros(5, dtype=torch.long)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        rays = vispe.cameras.plucker_at(cams, view_index, uv)
    assert rays.dtype == torch.float32
    torch.testing.assert_close(rays, vispe.cameras.plucker_at(cams, view_index, uv))
