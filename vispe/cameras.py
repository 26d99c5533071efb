"""Pinhole cameras in the OpenCV convention, and Plücker ray maps.

Conventions (stated once, used by every camera-aware encoding):

* camera axes are OpenCV's: x to the right, y down, z forward (the viewing direction);
* ``K`` maps camera coordinates to pixels, ``(u, v, 1) ~ K (x, y, z)``, with ``u`` the column and
  ``v`` the row; pixel ``(u, v)`` covers ``[u, u + 1) x [v, v + 1)``, so its centre is
  ``(u + 1/2, v + 1/2)`` and the centre of patch ``(row, col)`` of size ``p`` is
  ``((col + 1/2) p, (row + 1/2) p)``;
* ``cam_to_world`` maps camera coordinates to world coordinates (its translation is the camera
  centre), ``world_to_cam`` is its inverse (the "view matrix" / extrinsics of OpenCV);
* a Plücker ray is ``[o x d, d]`` (LVSM / CameraCtrl order) with ``o`` the camera centre and
  ``d = normalize(R K^-1 (u, v, 1))`` the unit world direction through the pixel.
"""
from __future__ import annotations

from typing import Literal, Optional, Sequence, Tuple, Union

import torch

from ._tracing import is_tracing

__all__ = ['Cameras', 'plucker_rays', 'plucker_at', 'rigid_inverse', 'lift_intrinsics', 'RayOrder']

RayOrder = Literal['moment_first', 'direction_first']


def rigid_inverse(T: torch.Tensor) -> torch.Tensor:
    """Exact inverse of rigid ``(..., 4, 4)`` transforms: ``[R^T, -R^T t]``."""
    R, t = T[..., :3, :3], T[..., :3, 3:]
    Rt = R.transpose(-1, -2)
    top = torch.cat([Rt, -Rt @ t], dim=-1)
    return torch.cat([top, T[..., 3:, :]], dim=-2)


def lift_intrinsics(K: torch.Tensor) -> torch.Tensor:
    """``(..., 3, 3)`` -> ``(..., 4, 4)`` homogeneous matrix ``[[K, 0], [0, 1]]`` (PRoPE's ``lift``)."""
    out = torch.zeros(*K.shape[:-2], 4, 4, dtype=K.dtype, device=K.device)
    out[..., :3, :3] = K
    out[..., 3, 3] = 1.0
    return out


def _check_rigid(T: torch.Tensor, name: str, atol: float) -> None:
    if not torch.is_tensor(T) or T.dim() not in (3, 4) or T.shape[-2:] != (4, 4):
        shape = tuple(T.shape) if torch.is_tensor(T) else type(T).__name__
        raise ValueError(f'{name} must be a (V, 4, 4) or (B, V, 4, 4) tensor, got {shape}')
    if not T.is_floating_point():
        raise ValueError(f'{name} must be a float tensor, got {T.dtype}')
    if not torch.isfinite(T).all():
        raise ValueError(f'{name} contains non-finite values')
    Td = T.detach().double()
    R = Td[..., :3, :3]
    eye = torch.eye(3, dtype=R.dtype, device=R.device)
    ortho = (R.transpose(-1, -2) @ R - eye).abs().amax().item()
    det = torch.linalg.det(R)
    bottom = (Td[..., 3, :] - torch.tensor([0., 0., 0., 1.], dtype=Td.dtype, device=Td.device)).abs().amax().item()
    if ortho > atol or (det - 1).abs().amax().item() > atol or bottom > atol:
        raise ValueError(
            f'{name} must be rigid (rotation block orthonormal with determinant +1, last row [0, 0, 0, 1]): '
            f'max |R^T R - I| = {ortho:.3g}, determinants in [{det.min().item():.4g}, {det.max().item():.4g}], '
            f'max |last row - [0, 0, 0, 1]| = {bottom:.3g} (tolerance atol={atol:g})')


def _check_intrinsics(K: torch.Tensor, atol: float) -> None:
    if not torch.is_tensor(K) or K.dim() not in (3, 4) or K.shape[-2:] != (3, 3):
        shape = tuple(K.shape) if torch.is_tensor(K) else type(K).__name__
        raise ValueError(f'K must be a (V, 3, 3) or (B, V, 3, 3) tensor, got {shape}')
    if not K.is_floating_point():
        raise ValueError(f'K must be a float tensor, got {K.dtype}')
    if not torch.isfinite(K).all():
        raise ValueError('K contains non-finite values')
    Kd = K.detach().double()
    last = (Kd[..., 2, :] - torch.tensor([0., 0., 1.], dtype=Kd.dtype, device=Kd.device)).abs().amax().item()
    lower = Kd[..., 1:, 0].abs().amax().item()
    if last > atol or lower > atol:
        raise ValueError(f'K must be upper-triangular pinhole intrinsics [[fx, s, cx], [0, fy, cy], [0, 0, 1]], '
                         f'got max |last row - [0, 0, 1]| = {last:.3g}, max |K[1, 0]| = {lower:.3g}')
    focal = torch.minimum(Kd[..., 0, 0].abs(), Kd[..., 1, 1].abs()).min().item()
    if focal <= atol:
        raise ValueError(f'K is singular: focal lengths must be non-zero, smallest |fx|, |fy| is {focal:.3g}')


class Cameras:
    """A set of pinhole cameras (OpenCV axes), one per view, optionally batched.

    Give the pose either as ``cam_to_world`` or as ``world_to_cam``; the other is computed as the
    exact rigid inverse. Poses are checked to be rigid and intrinsics to be invertible pinhole
    matrices; bad input raises a ValueError that names the argument.

    Args:
        K: intrinsics in pixels, ``(V, 3, 3)`` or ``(B, V, 3, 3)``; None for pose-only cameras
            (encodings then use the pose alone: PRoPE reduces to GTA's SE(3) form).
        cam_to_world: camera-to-world rigid transforms, ``(V, 4, 4)`` or ``(B, V, 4, 4)``.
        world_to_cam: world-to-camera rigid transforms (the alternative to ``cam_to_world``).
        image_size: ``(height, width)`` in pixels of the images ``K`` refers to (needed to
            normalise intrinsics, e.g. by PRoPE, and to sample rays per patch).
        atol: tolerance of the rigidity / intrinsics checks.

    Example:
        >>> cams = Cameras(K=K, cam_to_world=c2w, image_size=(256, 256))   # K: (V,3,3), c2w: (V,4,4)
        >>> cams.centers.shape, cams.world_to_cam.shape
    """

    def __init__(
            self,
            K: Optional[torch.Tensor] = None,
            *,
            cam_to_world: Optional[torch.Tensor] = None,
            world_to_cam: Optional[torch.Tensor] = None,
            image_size: Optional[Sequence[int]] = None,
            atol: float = 1e-4,
    ) -> None:
        if (cam_to_world is None) == (world_to_cam is None):
            raise ValueError('Cameras needs exactly one of cam_to_world=... or world_to_cam=...')
        name, pose = ('cam_to_world', cam_to_world) if cam_to_world is not None else ('world_to_cam', world_to_cam)
        _check_rigid(pose, name, atol)
        if cam_to_world is not None:
            self._c2w, self._w2c = cam_to_world, rigid_inverse(cam_to_world)
        else:
            self._c2w, self._w2c = rigid_inverse(world_to_cam), world_to_cam
        if K is not None:
            _check_intrinsics(K, atol)
            if K.shape[-3] != pose.shape[-3] or (K.dim() == 4 and pose.dim() == 4 and K.shape[0] != pose.shape[0]):
                raise ValueError(f'K {tuple(K.shape)} and {name} {tuple(pose.shape)} must describe the same views '
                                 f'(same V, and the same batch size when both are batched)')
            if K.dim() == 4 and pose.dim() == 3:
                raise ValueError(f'K is batched {tuple(K.shape)} but {name} is not {tuple(pose.shape)}; '
                                 f'give the poses a batch dim too')
            K = K.to(device=pose.device, dtype=pose.dtype)
            if pose.dim() == 4 and K.dim() == 3:  # one set of intrinsics for every sample
                K = K.expand(pose.shape[0], *K.shape)
        self.K = K
        if image_size is not None:
            image_size = tuple(int(s) for s in image_size)
            if len(image_size) != 2 or min(image_size) <= 0:
                raise ValueError(f'image_size must be (height, width) with positive sizes, got {image_size}')
        self.image_size: Optional[Tuple[int, int]] = image_size
        self.atol = atol

    # ------------------------------------------------------------------ description
    @property
    def cam_to_world(self) -> torch.Tensor:
        """``(..., V, 4, 4)`` camera-to-world transforms."""
        return self._c2w

    @property
    def world_to_cam(self) -> torch.Tensor:
        """``(..., V, 4, 4)`` world-to-camera transforms (extrinsics, view matrices)."""
        return self._w2c

    @property
    def rotation(self) -> torch.Tensor:
        """``(..., V, 3, 3)`` camera-to-world rotations (columns: camera axes in world coordinates)."""
        return self._c2w[..., :3, :3]

    @property
    def centers(self) -> torch.Tensor:
        """``(..., V, 3)`` camera centres in world coordinates."""
        return self._c2w[..., :3, 3]

    @property
    def num_views(self) -> int:
        return self._c2w.shape[-3]

    @property
    def batched(self) -> bool:
        return self._c2w.dim() == 4

    @property
    def device(self) -> torch.device:
        return self._c2w.device

    @property
    def dtype(self) -> torch.dtype:
        return self._c2w.dtype

    def __len__(self) -> int:
        return self.num_views

    def __repr__(self) -> str:
        batch = f'batch={self._c2w.shape[0]}, ' if self.batched else ''
        return (f'Cameras({batch}views={self.num_views}, intrinsics={self.K is not None}, '
                f'image_size={self.image_size}, dtype={self.dtype})')

    # ------------------------------------------------------------------ derived quantities
    def require_intrinsics(self, who: str) -> torch.Tensor:
        if self.K is None:
            raise ValueError(f'{who} needs camera intrinsics: build Cameras(K=..., ...)')
        return self.K

    @property
    def K_inv(self) -> torch.Tensor:
        """``(..., V, 3, 3)`` inverse intrinsics."""
        return torch.linalg.inv(self.require_intrinsics('K_inv'))

    def normalized_K(self) -> torch.Tensor:
        """Intrinsics of the image rescaled to ``[-1/2, 1/2]^2`` (PRoPE's convention).

        ``fx / W, fy / H, s / W`` on the first two rows, principal point ``cx / W - 1/2, cy / H - 1/2``.
        """
        K = self.require_intrinsics('normalized_K')
        if self.image_size is None:
            raise ValueError('normalising intrinsics needs the image size: build Cameras(..., image_size=(H, W))')
        H, W = self.image_size
        scale = torch.tensor([1.0 / W, 1.0 / H, 1.0], dtype=K.dtype, device=K.device)
        Kn = K * scale[:, None]
        Kn[..., 0, 2] -= 0.5
        Kn[..., 1, 2] -= 0.5
        return Kn

    def projection(self) -> torch.Tensor:
        """``(..., V, 4, 4)`` ``lift(K_normalised) @ world_to_cam`` (image <- world), PRoPE's ``P``."""
        return lift_intrinsics(self.normalized_K()) @ self._w2c

    # ------------------------------------------------------------------ new cameras
    def transform(self, G: torch.Tensor) -> 'Cameras':
        """The same rig seen from another world frame: ``cam_to_world' = G @ cam_to_world``.

        ``G`` is a rigid ``(4, 4)`` (or broadcastable) transform; relative poses are unchanged.
        """
        _check_rigid(G if G.dim() >= 3 else G[None], 'G', self.atol)
        return Cameras(self.K, cam_to_world=G.to(self.dtype) @ self._c2w, image_size=self.image_size,
                       atol=self.atol)

    def to(self, *args, **kwargs) -> 'Cameras':
        """Move / cast like `torch.Tensor.to` (float dtypes only)."""
        c2w = self._c2w.to(*args, **kwargs)
        out = Cameras.__new__(Cameras)
        out._c2w, out._w2c = c2w, self._w2c.to(*args, **kwargs)
        out.K = None if self.K is None else self.K.to(*args, **kwargs)
        out.image_size, out.atol = self.image_size, self.atol
        return out

    def view_matrices(self, view_index: torch.Tensor, which: Literal['cam_to_world', 'world_to_cam'] = 'cam_to_world'
                      ) -> torch.Tensor:
        """Per-token transforms: ``(N, 4, 4)``, or ``(B, N, 4, 4)`` when the cameras or ``view_index`` are batched."""
        if which not in ('cam_to_world', 'world_to_cam'):
            raise ValueError(f"which must be 'cam_to_world' or 'world_to_cam', got {which!r}")
        return self.gather(self._c2w if which == 'cam_to_world' else self._w2c, view_index)

    def gather(self, per_view: torch.Tensor, view_index: torch.Tensor) -> torch.Tensor:
        """Per-token values from per-view ones: ``(V, ...)`` (``(B, V, ...)`` for batched cameras) indexed by
        the token views ``view_index`` ``(N,)`` or ``(B, N)``. The range of ``view_index`` is checked
        in plain execution only: its values do not exist while traced (torch.compile, export)."""
        view_index = view_index.to(per_view.device).long()
        if view_index.numel() and not is_tracing() and (view_index.min() < 0 or view_index.max() >= self.num_views):
            raise ValueError(f'view_index must lie in [0, {self.num_views}) for {self.num_views} cameras, got '
                             f'values in [{view_index.min().item()}, {view_index.max().item()}]')
        if not self.batched:
            return per_view[view_index]
        if view_index.dim() == 1:
            return per_view[:, view_index]
        if view_index.shape[0] != per_view.shape[0]:
            raise ValueError(f'view_index batch {view_index.shape[0]} does not match the cameras batch '
                             f'{per_view.shape[0]}')
        rows = torch.arange(view_index.shape[0], device=per_view.device)[:, None]
        return per_view[rows, view_index]


def plucker_at(cams: Cameras, view_index: torch.Tensor, uv: torch.Tensor, order: RayOrder = 'moment_first'
               ) -> torch.Tensor:
    """Plücker rays ``(..., 6)`` through continuous pixel coordinates ``uv`` (``(..., 2)``, (u = column, v = row)).

    ``view_index`` selects each point's camera and broadcasts against ``uv.shape[:-1]`` from the left
    (``(N,)`` or ``(B, N)`` with extra trailing dims in ``uv`` for several pixels per token).
    """
    if order not in ('moment_first', 'direction_first'):
        raise ValueError(f"order must be 'moment_first' or 'direction_first', got {order!r}")
    with torch.autocast(device_type=uv.device.type, enabled=False):  # ray geometry in the cameras' precision
        return _plucker_at(cams, view_index, uv, order)


def _plucker_at(cams: Cameras, view_index: torch.Tensor, uv: torch.Tensor, order: RayOrder) -> torch.Tensor:
    # per view, d ~ R K^-1 (u, v, 1): one 3x3 matrix per camera, gathered per token
    M = cams.gather(cams.rotation @ cams.K_inv, view_index)
    o = cams.gather(cams.centers, view_index)
    extra = uv.dim() - 1 - view_index.dim()
    if extra < 0:
        raise ValueError(f'uv {tuple(uv.shape)} needs the dims of view_index {tuple(view_index.shape)} plus (..., 2)')
    M = M.reshape(*M.shape[:-2], *([1] * extra), 3, 3)
    o = o.reshape(*o.shape[:-1], *([1] * extra), 3)
    uv1 = torch.cat([uv.to(M.dtype), torch.ones_like(uv[..., :1], dtype=M.dtype)], dim=-1)
    d = (M @ uv1.unsqueeze(-1)).squeeze(-1)
    d = d / d.norm(dim=-1, keepdim=True)
    m = torch.linalg.cross(o.expand_as(d), d, dim=-1)
    return torch.cat([m, d] if order == 'moment_first' else [d, m], dim=-1)


def plucker_rays(
        cams: Cameras,
        height: int,
        width: int,
        patch: Optional[Union[int, Tuple[int, int]]] = None,
        order: RayOrder = 'moment_first',
) -> torch.Tensor:
    """Plücker ray map of every view: per pixel centre, or per patch centre when ``patch`` is given.

    Args:
        cams: the cameras (with intrinsics).
        height, width: image size in pixels.
        patch: patch size (int or ``(ph, pw)``); rays through patch centres ``((col + 1/2) pw, (row + 1/2) ph)``.
        order: ``'moment_first'`` -> ``[o x d, d]`` (LVSM / CameraCtrl), ``'direction_first'`` -> ``[d, o x d]``.

    Returns:
        ``(V, h, w, 6)`` or ``(B, V, h, w, 6)`` (channels last) with ``h = height / ph``, ``w = width / pw``.
    """
    cams.require_intrinsics('plucker_rays')
    ph, pw = (patch, patch) if isinstance(patch, int) else (patch or (1, 1))
    if ph < 1 or pw < 1:
        raise ValueError(f'patch must be a positive int or (ph, pw) of positive ints, got {patch!r}')
    if height % ph or width % pw:
        raise ValueError(f'patch {(ph, pw)} must divide the image size {(height, width)}')
    h, w = height // ph, width // pw
    rows = (torch.arange(h, dtype=cams.dtype, device=cams.device) + 0.5) * ph
    cols = (torch.arange(w, dtype=cams.dtype, device=cams.device) + 0.5) * pw
    vv, uu = torch.meshgrid(rows, cols, indexing='ij')
    uv = torch.stack([uu, vv], -1).reshape(1, h * w, 2)
    V = cams.num_views
    view_index = torch.arange(V, device=cams.device)
    rays = plucker_at(cams, view_index, uv.expand(V, -1, -1), order)  # (..., V, h*w, 6)
    return rays.reshape(*rays.shape[:-2], h, w, 6)
