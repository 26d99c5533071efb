"""Padded image batches as per-sample grids: each image's tokens at the positions of its own grid.

Detectors batch images of different sizes by padding them at the bottom and right to one canvas
(DETR's ``NestedTensor``, transformers' ``pixel_mask``); the feature map is then an ``(H, W)`` canvas in
which image ``b`` fills the top-left ``h_b x w_b`` rectangle. An encoding that sees the canvas as one
shared grid gives an image another output inside a batch than alone wherever it depends on the grid
size (normalised coordinates, a resampled table, LieRE's linspace) or on neighbours (PEG's convolution).

`pack_padded_grid` turns such a batch into the NaFlex layout every encoding already handles exactly
(`naflex_grid`: each sample's own grid first, in row-major order, then padding), and back. Token order
only matters to the positions: attention is permutation-equivariant, so a host packs the tokens, runs
its layers with the packed positions, and unpacks wherever it needs the canvas again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .core import Positions, naflex_grid

__all__ = ['PaddedGrid', 'pack_padded_grid', 'unpadded_extents']


def unpadded_extents(mask: torch.Tensor) -> Tuple[Tuple[int, int], ...]:
    """Each image's ``(h, w)`` in a padded ``(B, H, W)`` canvas mask (True on padding).

    Raises ValueError unless every image is a non-empty top-left rectangle of False (padding at the
    bottom and right only, as DETR and transformers pad).
    """
    if not torch.is_tensor(mask) or mask.dim() != 3 or mask.dtype != torch.bool:
        got = f'{tuple(mask.shape)} {mask.dtype}' if torch.is_tensor(mask) else type(mask).__name__
        raise ValueError(f'the padding mask must be a (B, H, W) bool tensor, True on padding; got {got}')
    real = ~mask
    heights = real.any(2).sum(1)
    widths = real.any(1).sum(1)
    rows = torch.arange(mask.shape[1], device=mask.device)
    cols = torch.arange(mask.shape[2], device=mask.device)
    rectangle = (rows[None, :, None] < heights[:, None, None]) & (cols[None, None, :] < widths[:, None, None])
    if not torch.equal(rectangle, real):
        raise ValueError('the padding mask must mark padding at the bottom and right of each image only (its real '
                         'pixels a top-left rectangle), as DETR and transformers pad a batch')
    extents = tuple(zip(heights.tolist(), widths.tolist()))
    empty = [b for b, (h, w) in enumerate(extents) if h == 0 or w == 0]
    if empty:
        raise ValueError(f'images {empty} of the batch are all padding (the padding mask is True everywhere); '
                         f'every image needs at least one real token')
    return extents


@dataclass(frozen=True, eq=False)
class PaddedGrid:
    """A padded canvas batch in the NaFlex layout.

    Attributes:
        positions: NaFlex positions (`naflex_grid`) of the packed tokens: each sample's own grid, then
            padding, ``H * W`` tokens in all.
        index: ``(B, H * W)`` canvas index of each packed token.
        inverse: ``(B, H * W)`` packed index of each canvas token.
    """
    positions: Positions
    index: torch.Tensor
    inverse: torch.Tensor

    @staticmethod
    def _gather(x: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
        if x.shape[dim] != index.shape[1]:
            raise ValueError(f'expected {index.shape[1]} tokens along dim {dim}, got {tuple(x.shape)}')
        shape = [1] * x.dim()
        shape[0], shape[dim] = index.shape
        return x.gather(dim, index.view(shape).expand(*x.shape[:dim], -1, *x.shape[dim + 1:]))

    def pack(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Canvas-ordered tokens (``H * W`` along ``dim``, batch first) in the packed order."""
        return self._gather(x, self.index, dim)

    def unpack(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Packed tokens back in canvas order."""
        return self._gather(x, self.inverse, dim)


def pack_padded_grid(pos: Positions) -> Optional[PaddedGrid]:
    """The NaFlex layout of a padded canvas batch, or None when there is nothing to repack.

    ``pos`` is a `grid` ``(H, W)`` with a ``(B, H * W)`` ``key_padding_mask`` (True on padding) whose
    images are top-left rectangles. Without a mask, or when no token is padding, the shared grid is
    already every image's own grid: None (the host keeps its fast path).

    Raises:
        TypeError: ``pos`` is not a `Positions` (e.g. the mask tensor itself).
        ValueError: a mask whose images are not top-left rectangles, or an image that is all padding.
    """
    if not isinstance(pos, Positions):
        raise TypeError(f'pack_padded_grid takes the Positions of a padded canvas (vispe.grid(H, W) with a (B, H * W) '
                        f'key_padding_mask, True on padding), got {type(pos).__name__}; for a (B, H, W) mask use '
                        f'vispe.grid(H, W).replace(key_padding_mask=mask.flatten(1))')
    pad = pos.key_padding_mask
    if pad is None or pos.grid is None or not bool(pad.any()):
        return None
    if len(pos.grid) != 2:
        raise ValueError(f'a padded canvas is a 2D grid (H, W); got grid {pos.grid}')
    extents = unpadded_extents(pad.view(pad.shape[0], *pos.grid))
    # a stable sort of the padding flags puts each image's real tokens first in raster order, which for a
    # top-left rectangle is the raster order of its own grid
    index = torch.sort(pad.to(torch.uint8), dim=1, stable=True).indices
    inverse = torch.argsort(index, dim=1)
    packed = naflex_grid(extents, num_tokens=pad.shape[1], num_prefix=pos.num_prefix, train_grid=pos.train_grid,
                         device=pos.device, dtype=pos.coords.dtype)
    return PaddedGrid(packed, index, inverse)
