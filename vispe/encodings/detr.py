"""DETR's position encodings (Carion et al., ECCV 2020): the sine encoding and the learned row/column table.

Both are additive and expose `embedding(pos)`, because DETR does not add its encoding to the input
tokens once: it adds it to the inputs of the query and key projections of *every* attention layer
(encoder self-attention, and the keys of decoder cross-attention), never to the values. `embed`
(``x + embedding(pos)``) is provided too, so either one can serve as the input encoding of a ViT.

Both follow DETR's ``models/position_encoding.py``: the channels are split in two halves of
``dim / 2`` (``num_pos_feats``); the sine encoding puts y (rows) before x (columns), the learned
one puts the column table before the row table.
"""
from __future__ import annotations

import math
from typing import Hashable, Optional

import torch
from torch import nn

from ..positions import Positions
from ..registry import register_pe
from ._checks import check_positive
from .additive import AdditivePE
from ..contract import PEContext

__all__ = ['DetrSine', 'DetrLearned']


def _grid_mask(pos: Positions, name: str) -> torch.Tensor:
    """``(B | 1, h, w)`` bool, True on real (not padded) grid tokens."""
    if pos.grid is None or len(pos.grid) != 2:
        raise ValueError(f'encoding {name!r} needs 2D grid positions (vispe.positions.grid(h, w)), '
                         f'got grid={pos.grid}')
    h, w = pos.grid
    mask = pos.key_padding_mask  # (B, h * w): `Positions` drops the columns of prefix tokens
    if mask is None:
        return torch.ones(1, h, w, dtype=torch.bool, device=pos.device)
    return ~mask.reshape(-1, h, w)


@register_pe('detr_sine', family='detr')
class DetrSine(AdditivePE):
    """DETR's ``PositionEmbeddingSine`` (Carion et al., ECCV 2020), exactly as DETR computes it.

    Positions are *cumulative counts of real pixels* over the padding mask, not the grid indices:
    ``y = not_mask.cumsum(rows)``, ``x = not_mask.cumsum(cols)`` (so they start at 1), and with
    ``normalize`` each is divided by its last value (+ ``eps``) and multiplied by ``scale``, so the
    unpadded part of every image spans ``(0, 2 pi]`` whatever its size. With ``F = dim / 2``
    features per axis, ``dim_t_k = temperature^(2 floor(k / 2) / F)`` and the features of one axis
    are ``stack(sin(p / dim_t[0::2]), cos(p / dim_t[1::2])).flatten()``: sin and cos interleaved
    channel by channel. The y features come first, then x. Padded tokens get whatever the
    cumulative counts give them, as in DETR (they are masked out as keys, so nothing reads them).
    Reads ``Positions.grid`` ``(h, w)`` and ``Positions.key_padding_mask`` ``(B, N)``
    (True = padding). Prefix tokens get zeros.

    Without padding the rows and columns are separable: the table is built from ``h + w`` per-axis
    features and cached per grid (bitwise equal to the cumulative-sum path, which padded batches take).
    In a NaFlex batch (``Positions.grids``) each sample is an unpadded image of its own grid, counted
    and normalised over that grid (its padding tokens follow it in the sequence).

    ``normalize=True`` is what DETR builds (``PositionEmbeddingSine(N_steps, normalize=True)``),
    although the class default there is False. Deformable DETR (Zhu et al., ICLR 2021) shifts the counts
    by half a pixel before normalising, ``(y - 0.5) / (extent + eps) * scale``: ``offset=-0.5``.

    Args:
        temperature: the base of the frequencies (10000).
        normalize: divide the cumulative positions by the image extent and multiply by ``scale``.
        scale: the range of normalised positions (``2 pi``).
        eps: added to the extent before dividing (1e-6; > 0, as a padded row's extent is 0).
        offset: added to the counts before normalising (0 as DETR; -0.5 as Deformable DETR); ignored
            without ``normalize``.
    """
    larger_input = 'interpolate'
    paper = 'Carion et al., ECCV 2020 (DETR), arXiv:2005.12872; PositionEmbeddingSine'

    def __init__(
            self,
            ctx: PEContext,
            *,
            temperature: float = 10000.0,
            normalize: bool = True,
            scale: float = 2 * math.pi,
            eps: float = 1e-6,
            offset: float = 0.0,
    ) -> None:
        super().__init__(ctx)
        if ctx.dim % 4:
            raise ValueError(f"encoding 'detr_sine' needs dim divisible by 4 (two axes of interleaved sin/cos), "
                             f"got dim={ctx.dim}")
        self.num_pos_feats = ctx.dim // 2
        self.temperature = check_positive(self.name, 'temperature', temperature)
        self.normalize = normalize
        self.scale = check_positive(self.name, 'scale', scale)
        self.eps = check_positive(self.name, 'eps', eps)
        if not math.isfinite(offset):
            raise ValueError(f"option 'offset' of encoding {self.name!r} must be a finite number, got {offset!r}")
        self.offset = float(offset)

    def features(self, p: torch.Tensor) -> torch.Tensor:
        """DETR's features of one axis: ``(...)`` positions -> ``(..., dim / 2)`` interleaved sin / cos."""
        dim_t = torch.arange(self.num_pos_feats, dtype=torch.float32, device=p.device)
        dim_t = self.temperature ** (2 * torch.div(dim_t, 2, rounding_mode='floor') / self.num_pos_feats)
        scaled = p[..., None] / dim_t
        return torch.stack((scaled[..., 0::2].sin(), scaled[..., 1::2].cos()), dim=-1).flatten(-2)

    def _normalized(self, counts: torch.Tensor, extent: torch.Tensor) -> torch.Tensor:
        if not self.normalize:
            return counts
        shifted = counts + self.offset if self.offset else counts  # 0: DETR's operations exactly
        return shifted / (extent + self.eps) * self.scale

    def _table_key(self, pos: Positions) -> Optional[Hashable]:
        # without padding (or in a NaFlex batch) the table depends on the grids alone; padded images
        # are built afresh
        mask = pos.key_padding_mask
        return super()._table_key(pos) if pos.grids is not None or mask is None or not bool(mask.any()) else None

    def _rows(self, pos: Positions) -> torch.Tensor:
        if pos.grids is not None:
            return self._naflex_rows(pos)
        not_mask = _grid_mask(pos, self.name)
        if pos.key_padding_mask is None or bool(not_mask.all()):
            # no padding: rows and columns are separable, h + w per-axis features
            h, w = pos.grid
            y = torch.arange(1, h + 1, dtype=torch.float32, device=pos.device)
            x = torch.arange(1, w + 1, dtype=torch.float32, device=pos.device)
            fy = self.features(self._normalized(y, y[-1:]))
            fx = self.features(self._normalized(x, x[-1:]))
            return torch.cat([fy[:, None].expand(-1, w, -1), fx[None].expand(h, -1, -1)], -1).reshape(h * w, -1)
        y_embed = not_mask.cumsum(1, dtype=torch.float32)
        x_embed = not_mask.cumsum(2, dtype=torch.float32)
        y_embed = self._normalized(y_embed, y_embed[:, -1:, :])
        x_embed = self._normalized(x_embed, x_embed[:, :, -1:])
        return torch.cat((self.features(y_embed), self.features(x_embed)), dim=3).flatten(1, 2)

    def _naflex_rows(self, pos: Positions) -> torch.Tensor:
        """``(B, N, dim)``: each sample counted and normalised over its own grid (a sample of a NaFlex
        batch is an image without padding), the operations of the unpadded path element by element."""
        if len(pos.grids[0]) != 2:
            raise ValueError(f"encoding 'detr_sine' needs 2D grids (h, w), got grids={pos.grids}")
        counts = pos.coords.float() + 1  # (row, col) indices -> cumulative counts of real tokens
        extent = torch.tensor(pos.grids, dtype=torch.float32, device=pos.device).unsqueeze(1)
        p = self._normalized(counts, extent)
        return torch.cat([self.features(p[..., 0]), self.features(p[..., 1])], dim=-1)

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """DETR's features of continuous ``(..., 2)`` (y, x) positions, already in the units `features`
        takes (with ``normalize``: scaled to ``(0, scale]``; no count or normalisation is applied), y
        features first: the sine embedding of query points, as Deformable and DAB-DETR build it."""
        if coords.shape[-1] != 2:
            raise ValueError(f"encoding 'detr_sine' encodes 2D (y, x) positions, got {coords.shape[-1]}D")
        coords = coords.float()
        return torch.cat([self.features(coords[..., 0]), self.features(coords[..., 1])], dim=-1)


@register_pe('detr_learned', family='detr')
class DetrLearned(AdditivePE):
    """DETR's ``PositionEmbeddingLearned`` (Carion et al., ECCV 2020): learned row and column tables.

    Two ``nn.Embedding(num_embeddings, dim / 2)`` tables (``row_embed``, ``col_embed``, DETR's
    names and uniform ``[0, 1)`` init); the token at (row i, column j) gets
    ``concat(col_embed[j], row_embed[i])`` (column first, as DETR). It reads the integer grid
    coordinates of ``pos`` (row, col), so any grid up to ``num_embeddings`` per side works (larger
    inputs reach untrained rows, an extrapolation); the padding mask is ignored, as in DETR.
    Prefix tokens get zeros.

    Args:
        num_embeddings: rows and columns in each table (50).
    """
    larger_input = 'extrapolate'
    paper = 'Carion et al., ECCV 2020 (DETR), arXiv:2005.12872; PositionEmbeddingLearned'

    def __init__(self, ctx: PEContext, *, num_embeddings: int = 50) -> None:
        super().__init__(ctx)
        if ctx.dim % 2:
            raise ValueError(f"encoding 'detr_learned' needs an even dim (column and row halves), got dim={ctx.dim}")
        if num_embeddings <= 0:
            raise ValueError(f"option 'num_embeddings' of encoding 'detr_learned' must be positive, "
                             f"got {num_embeddings}")
        if ctx.grid_size is not None and max(ctx.grid_size) > num_embeddings:
            raise ValueError(f"option 'num_embeddings' of encoding 'detr_learned' is {num_embeddings}, fewer than the "
                             f'host grid {ctx.grid_size} has rows or columns; use at least {max(ctx.grid_size)}')
        self.num_embeddings = num_embeddings
        self.row_embed = nn.Embedding(num_embeddings, ctx.dim // 2)
        self.col_embed = nn.Embedding(num_embeddings, ctx.dim // 2)
        nn.init.uniform_(self.row_embed.weight)
        nn.init.uniform_(self.col_embed.weight)

    def _rows(self, pos: Positions) -> torch.Tensor:
        if pos.ndim != 2:
            raise ValueError(f"encoding 'detr_learned' needs 2D (row, col) positions, got {pos.ndim} axes")
        index = pos.coords.round().long()
        if pos.sample_grids is not None:  # integer indices by construction: the range is known without reading them
            lo, hi = 0, max(max(g) for g in pos.sample_grids) - 1
        else:
            if not torch.equal(index.to(pos.coords.dtype), pos.coords):
                raise ValueError("encoding 'detr_learned' needs integer grid coordinates (vispe.positions.grid)")
            lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= self.num_embeddings:
            raise ValueError(f"encoding 'detr_learned' has {self.num_embeddings} rows/columns (option "
                             f"'num_embeddings'), positions reach index {hi if hi >= 0 else lo}")
        return torch.cat([self.col_embed(index[..., 1]), self.row_embed(index[..., 0])], dim=-1)
