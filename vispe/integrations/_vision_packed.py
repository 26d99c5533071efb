"""Packed token sequences of transformers' Qwen-VL vision towers as padded batches of their own grids.

The Qwen2-VL, Qwen2.5-VL and Qwen3-VL towers run every image (and every frame of a video) of a call as one
sequence of tokens ``(N, C)`` without a batch axis, the images one after the other, and attend within
segments of it (``cu_seqlens``, `transformers.vision_utils.get_vision_cu_seqlens`: one segment per frame).
Inside an image the tokens are not in raster order: the 2 x 2 (``spatial_merge_size``) patches that the
merger later joins into one language token come one after the other (the merge-block order of
`transformers.vision_utils.get_vision_position_ids`), and Qwen2.5-VL reorders these blocks once more into
windows (`transformers.vision_utils.get_vision_window_index`).

`PackedTokens` lays such a sequence out as the batch every vispe encoding already handles exactly: segment
``s`` is row ``s`` of a ``(S, n, C)`` batch, its tokens in raster order of its own grid first, then padding
(`vispe.positions.naflex_grid`). Attention is permutation-equivariant, so an attention layer packs its
q, k and v, attends with the encoding prepared on these positions, and unpacks its output into the host's
order; the positions thus follow the host's token order through the packing. Windows (Qwen2.5-VL) are
rows of another packing: each window's tokens in the host's order with their positions on the whole
frame's grid (a point set selected from it, `vispe.positions.Positions.selected_from`), so a relative
encoding sees the true offsets and a normalising one the frame's size.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..positions import Positions, grid, naflex_grid

__all__ = ['PackedTokens', 'VarlenLayout', 'merge_block_coords', 'varlen_layout']

Tensor = torch.Tensor


@dataclass(frozen=True, eq=False)
class PackedTokens:
    """A packed sequence of ``N`` tokens as a padded batch ``(S, n)``.

    Attributes:
        positions: the positions of the batch rows (a shared `grid`, NaFlex grids, or point sets of windows).
        index: ``(S, n)`` sequence index of the token in each slot (padding slots repeat a real token of
            their row: masked as keys, dropped as queries).
        inverse: ``(N,)`` flat slot (``s * n + j``) of each token of the sequence.
    """
    positions: Positions
    index: Tensor
    inverse: Tensor

    def pack(self, x: Tensor) -> Tensor:
        """Tokens ``(N, ...)`` of the sequence as the batch ``(S, n, ...)``."""
        return x.index_select(0, self.index.flatten()).view(*self.index.shape, *x.shape[1:])

    def unpack(self, x: Tensor) -> Tensor:
        """The batch ``(S, n, ...)`` back as the sequence ``(N, ...)`` in the host's order."""
        return x.flatten(0, 1).index_select(0, self.inverse)


@dataclass(frozen=True, eq=False)
class VarlenLayout:
    """The layouts of one forward of a packed tower: its frames (one row per ``cu_seqlens`` segment) and,
    for a windowed tower, its windows."""
    frames: PackedTokens
    windows: Optional[PackedTokens] = None


def merge_block_coords(h: int, w: int, merge: int, device: torch.device) -> Tuple[Tensor, Tensor]:
    """Row and column ``(h * w,)`` of each token of an ``h x w`` frame in merge-block order: the blocks of
    ``merge x merge`` patches in raster order, each block's patches in raster order (the order of
    `transformers.vision_utils.get_vision_position_ids`)."""
    rows = torch.arange(h, device=device)[:, None].expand(h, w)
    cols = torch.arange(w, device=device)[None, :].expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    return rows.reshape(shape).transpose(1, 2).flatten(), cols.reshape(shape).transpose(1, 2).flatten()


def _segments(grids: Sequence[Tuple[int, int]], segment: Tensor, slot: Tensor, train_grid: Tuple[int, int],
              coords: Tensor) -> PackedTokens:
    """Frames ``grids[s]``; token ``k`` in ``segment[k]`` at raster ``slot[k]`` of that frame."""
    n = max(h * w for h, w in grids)
    device = segment.device
    flat = segment * n + slot
    index = torch.zeros(len(grids) * n, dtype=torch.long, device=device)
    index[flat] = torch.arange(segment.numel(), device=device)
    if len(set(grids)) == 1:  # one grid for every frame: shared positions, no padding
        pos = grid(*grids[0], train_grid=train_grid, device=device, dtype=coords.dtype)
    else:
        pos = naflex_grid(grids, num_tokens=n, train_grid=train_grid, device=device, dtype=coords.dtype)
        starts = index.view(len(grids), n)[:, :1]  # padding slots: the row's first token
        real = ~pos.key_padding_mask
        index = torch.where(real, index.view(len(grids), n), starts).flatten()
    return PackedTokens(pos, index.view(len(grids), n), flat)


def _windows(bounds: Tensor, segment: Tensor, coords: Tensor, grids: Sequence[Tuple[int, int]]) -> PackedTokens:
    """Windows ``[bounds[i], bounds[i + 1])`` of the sequence as rows, tokens in the host's order, each with
    its position on its frame's grid (``coords`` ``(N, 2)``)."""
    device = coords.device
    starts, lengths = bounds[:-1].long(), (bounds[1:] - bounds[:-1]).long()
    n = int(lengths.max())
    slot = torch.arange(n, device=device)
    pad = slot[None, :] >= lengths[:, None]
    index = torch.where(pad, starts[:, None], starts[:, None] + slot[None, :])
    token = torch.arange(coords.shape[0], device=device)
    window = torch.searchsorted(bounds[1:].long(), token, right=True)
    inverse = window * n + token - starts[window]
    frames = tuple(grids[s] for s in segment[starts].tolist())
    selected = frames[:1] if len(set(frames)) == 1 else frames
    pos = Positions(coords=coords[index], key_padding_mask=pad if bool(pad.any()) else None, selected_from=selected)
    return PackedTokens(pos, index, inverse)


def varlen_layout(grid_thw: Tensor, merge: int, train_grid: Tuple[int, int], *, window_index: Optional[Tensor] = None,
                  window_bounds: Optional[Tensor] = None, dtype: torch.dtype = torch.float32) -> VarlenLayout:
    """The layout of a packed tower's tokens for ``grid_thw`` ``(K, 3)``: entry ``(t, h, w)`` is ``t`` frames of
    ``h x w`` patches, each its own attention segment, tokens in merge-block order; with ``window_index``
    (merge blocks in the host's windowed order) and ``window_bounds`` (its ``cu_window_seqlens``) the tokens
    are in that order and the windows form a second layout. Grids must be validated by the caller."""
    device = grid_thw.device
    grids: List[Tuple[int, int]] = []
    segment, slot, coords = [], [], []
    for t, h, w in grid_thw.tolist():
        rows, cols = merge_block_coords(h, w, merge, device)
        first = len(grids)
        grids += [(h, w)] * t
        segment.append(torch.arange(first, first + t, device=device).repeat_interleave(h * w))
        slot.append((rows * w + cols).repeat(t))
        coords.append(torch.stack([rows, cols], -1).repeat(t, 1))
    segment, slot, coords = torch.cat(segment), torch.cat(slot), torch.cat(coords).to(dtype)
    if window_index is not None:
        unit = merge * merge
        order = (window_index.to(device)[:, None] * unit + torch.arange(unit, device=device)).flatten()
        segment, slot, coords = segment[order], slot[order], coords[order]
    frames = _segments(grids, segment, slot, train_grid, coords)
    windows = _windows(window_bounds.to(device), segment, coords, grids) if window_bounds is not None else None
    return VarlenLayout(frames, windows)
