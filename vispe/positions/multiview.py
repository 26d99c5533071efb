"""Positions of multi-view image tokens: per-view patch coordinates plus the cameras that took them.

Layout: the views' token grids are concatenated view after view (view-major), each in row-major
order, after ``num_prefix`` prefix tokens: token ``num_prefix + v * h * w + r * w + c`` is patch
``(r, c)`` of view ``v``. This is the layout of the multi-view transformers that GTA and PRoPE were
written for (``(cameras, patches)`` flattened).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..cameras import Cameras
from .core import Positions

__all__ = ['multiview', 'view_grid']


def multiview(
        cams: Cameras,
        grid: Sequence[int],
        num_prefix: int = 0,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
) -> Positions:
    """Positions of ``V`` views of ``h x w`` patches each, taken by ``cams``.

    The result has ``coords`` ``(V * h * w, 2)`` = ``(row, col)`` patch indices within each view,
    ``view_index`` ``(V * h * w,)`` (the camera of each token), ``cameras=cams``, no single ``grid``
    (the tokens are several grids), and ``train_grid=(h, w)``: the per-view grid, from which
    encodings derive normalised image coordinates (GTA) and the pixel size of a patch (Plücker rays,
    with ``cams.image_size``). Camera-aware encodings (``gta_multiview``, ``prope``, ``plucker``)
    read the cameras from here; other encodings see ordinary 2D patch coordinates.

    Args:
        cams: one camera per view (`vispe.Cameras`, optionally batched).
        grid: per-view token grid ``(h, w)``.
        num_prefix: prefix tokens before the views' tokens.
        device: device of the coordinates (default: the cameras').
        dtype: float dtype of the coordinates.

    Example:
        >>> cams = vispe.Cameras(K=K, cam_to_world=c2w, image_size=(256, 256))   # 8 views
        >>> pos = vispe.positions.multiview(cams, grid=(16, 16))                  # 8 * 256 tokens
    """
    if not isinstance(cams, Cameras):
        raise ValueError(f'cams must be a vispe.Cameras, got {type(cams).__name__}')
    grid = tuple(int(g) for g in grid)
    if len(grid) != 2 or min(grid) <= 0:
        raise ValueError(f'grid must be the per-view token grid (h, w) with positive sizes, got {grid}')
    if cams.image_size is not None and (cams.image_size[0] % grid[0] or cams.image_size[1] % grid[1]):
        raise ValueError(f'grid {grid} must divide the cameras\' image_size {cams.image_size} (whole patches)')
    h, w = grid
    device = torch.device(device) if device is not None else cams.device
    rows, cols = torch.meshgrid(torch.arange(h, device=device, dtype=dtype),
                                torch.arange(w, device=device, dtype=dtype), indexing='ij')
    per_view = torch.stack([rows, cols], -1).reshape(h * w, 2)
    V = cams.num_views
    coords = per_view.repeat(V, 1)
    view_index = torch.arange(V, device=device).repeat_interleave(h * w)
    return Positions(coords=coords, num_prefix=num_prefix, grid=None, train_grid=grid, cameras=cams,
                     view_index=view_index)


def view_grid(pos: Positions, who: str) -> Tuple[int, int]:
    """The per-view grid ``(h, w)`` of multi-view positions; a clear error for anything else."""
    if not isinstance(pos.cameras, Cameras) or pos.view_index is None:
        raise ValueError(f'encoding {who!r} needs camera positions: build them with '
                         f'vispe.positions.multiview(vispe.Cameras(...), grid=(h, w))')
    if pos.train_grid is None or len(pos.train_grid) != 2:
        raise ValueError(f'encoding {who!r} needs the per-view grid (h, w) as Positions.train_grid '
                         f'(vispe.positions.multiview sets it), got {pos.train_grid}')
    if pos.coords.shape[-1] != 2:
        raise ValueError(f'encoding {who!r} needs (row, col) patch coordinates, got {pos.coords.shape[-1]} axes')
    return pos.train_grid
