"""Plücker ray embeddings: camera conditioning as an absolute per-token input (LVSM, CameraCtrl)."""
from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from ..cameras import RayOrder, plucker_at
from ..positions import Positions
from ..positions.multiview import view_grid
from ..registry import register_pe
from ._checks import check_min_int
from .additive import AdditivePE
from ..contract import PEContext

__all__ = ['PluckerPE']


@register_pe('plucker', family='plucker')
class PluckerPE(AdditivePE):
    """Plücker ray embedding (Jin et al., 2025, LVSM; He et al., 2024, CameraCtrl; Plücker coordinates
    of the pixel rays, Sitzmann et al., 2021, LFN).

    Each pixel's ray is the 6-vector ``[o x d, d]`` (``order='direction_first'``: ``[d, o x d]``),
    ``o`` the camera centre and ``d`` the unit world direction through the pixel centre (OpenCV
    axes, see `vispe.cameras`). With ``sampling='pixels'`` (LVSM) the rays of the ``p x p`` pixels of
    a patch are patchified in ``(row, col, channel)`` order into ``6 p^2`` features; with
    ``sampling='center'`` the patch gets the one ray through its centre. A linear map projects the
    features to the token width and the result is added to the tokens (``mode='add'``), or tokens
    and features are concatenated and projected back to the token width (``mode='concat'``, the
    LVSM input layer; the fusion starts as the identity on the tokens plus the ray projection).
    Prefix tokens get no ray. Needs positions from `vispe.positions.multiview` with intrinsics.

    Args:
        mode: ``'add'`` or ``'concat'`` (concatenate, then project back to the token width).
        order: ``'moment_first'`` (``[o x d, d]``) or ``'direction_first'``.
        sampling: ``'pixels'`` (every pixel of the patch) or ``'center'`` (the patch centre).
        patch_size: patch size in pixels (must match ``Cameras.image_size / grid`` when that is known).
        bias: bias of the projection.
    """
    requires = frozenset({'cameras', 'view_index'})
    larger_input = 'interpolate'
    paper = 'Jin et al., ICLR 2025 (LVSM), arXiv:2410.17242; He et al., 2024 (CameraCtrl), arXiv:2404.02101'

    def __init__(
            self,
            ctx: PEContext,
            *,
            mode: Literal['add', 'concat'] = 'add',
            order: RayOrder = 'moment_first',
            sampling: Literal['pixels', 'center'] = 'pixels',
            patch_size: int = 16,
            bias: bool = True,
    ) -> None:
        super().__init__(ctx)
        self.mode = mode
        self.order = order
        self.sampling = sampling
        self.patch_size = check_min_int(self.name, 'patch_size', patch_size)
        self.num_features = 6 * (patch_size ** 2 if sampling == 'pixels' else 1)
        self.proj = nn.Linear(self.num_features, ctx.dim, bias=bias)
        if mode == 'concat':
            self.fuse = nn.Linear(ctx.dim + ctx.dim, ctx.dim, bias=False)
            with torch.no_grad():  # start as 'add': [I | I] on [tokens, projected rays]
                eye = torch.eye(ctx.dim)
                self.fuse.weight.copy_(torch.cat([eye, eye], dim=1))

    def ray_features(self, pos: Positions) -> torch.Tensor:
        """``([B,] N, F)`` Plücker features of the non-prefix tokens (float32 or the cameras' dtype)."""
        h, w = view_grid(pos, self.name)
        cams = pos.cameras
        p = self.patch_size
        if cams.image_size is not None and tuple(cams.image_size) != (h * p, w * p):
            raise ValueError(f"encoding 'plucker': patch_size={p} on a {h}x{w} grid covers {h * p}x{w * p} pixels, "
                             f'but the cameras\' image_size is {cams.image_size}')
        coords = pos.coords.to(device=cams.device, dtype=cams.dtype)
        corner = coords.flip(-1) * p  # (u, v) = (col, row) * p: the patch's top-left pixel corner
        if self.sampling == 'center':
            uv = corner + 0.5 * p
        else:
            offs = torch.arange(p, device=cams.device, dtype=cams.dtype) + 0.5
            dv, du = torch.meshgrid(offs, offs, indexing='ij')  # row-major pixels inside the patch
            uv = corner.unsqueeze(-2) + torch.stack([du, dv], -1).reshape(p * p, 2)
        rays = plucker_at(cams, pos.view_index, uv, self.order)
        return rays.flatten(-2) if self.sampling == 'pixels' else rays

    def _rows(self, pos: Positions) -> torch.Tensor:
        return self.encode(self.ray_features(pos))

    def encode(self, rays: torch.Tensor) -> torch.Tensor:
        """The projection ``(..., dim)`` of Plücker features ``(..., num_features)`` (`ray_features`'
        layout): rays are this encoding's coordinates."""
        if rays.shape[-1] != self.num_features:
            raise ValueError(f"encoding 'plucker' (sampling={self.sampling!r}, patch_size={self.patch_size}) "
                             f'encodes {self.num_features} ray features, got {rays.shape[-1]}')
        return self.proj(rays.to(self.proj.weight.dtype))

    def embedding(self, pos: Positions) -> torch.Tensor:
        if self.mode != 'add':
            raise NotImplementedError("encoding 'plucker' with mode='concat' is not additive; use embed(x, pos)")
        return super().embedding(pos)

    def embed(self, x: torch.Tensor, pos: Positions, state: Any = None) -> torch.Tensor:
        if self.mode == 'add':
            return super().embed(x, pos)
        emb = self._build(pos).to(x.dtype)
        return self.fuse(torch.cat([x, emb.expand(x.shape[0], -1, -1)], dim=-1))
