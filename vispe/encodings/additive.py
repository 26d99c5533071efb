"""The additive base: encodings that add an embedding to the tokens.

Learned and sin-cos tables, DETR's encodings, Fourier features, coordinate (NeRF) encodings and
Plücker rays differ only in how they compute the rows of the grid (or point) tokens. `AdditivePE`
owns everything else, once: prefix rows (zeros in front, `pad_prefix_rows`), the batch axis, the
dtype of the sum (``embed`` adds in the tokens' dtype), a small table cache, and the coordinate map
``encode(coords) -> (..., out_dim)`` that hosts without tokens (a NeRF MLP) use.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from ..positions import Positions, points
from ..contract import PositionalEncoding

__all__ = ['AdditivePE', 'pad_prefix_rows']


def pad_prefix_rows(table: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """``num_prefix`` zero rows in front of a ``(B, N, C)`` table (prefix tokens get no position)."""
    if num_prefix < 0:
        raise ValueError(f'num_prefix must be >= 0, got {num_prefix}')
    if num_prefix == 0:
        return table
    return torch.cat([table.new_zeros(table.shape[0], num_prefix, table.shape[-1]), table], dim=1)


class AdditivePE(PositionalEncoding):
    """Base of the additive encodings: ``embed(x, pos) = x + embedding(pos)``, in ``x``'s dtype.

    A subclass implements `_rows`: the embedding of the *last* tokens of ``pos``, ``([B,] n, C)``:
    all grid or point tokens, and the prefix tokens it has rows for (timm's learned table has a
    class-token row); the tokens before them get zeros. `embedding` returns ``(B | 1, N_total, C)``.
    In a NaFlex batch (``pos.grids``) the rows are ``(B, n, C)``: each sample's rows are those it
    gets alone (from its own grid), followed by rows for its padding tokens, which attention masks.

    Cache: `_table_key` names positions whose embedding is a function of the key alone (by default
    a grid or the grids of a NaFlex batch; DETR's sine encoding asks for a grid without padding);
    their embedding is kept in the encoding's `tensor_cache` keyed also by the device and the
    versions of the parameters and buffers, so an optimiser step or a loaded state dict is seen.
    Encodings with trainable parameters cache only where autograd is off; the cache keeps nothing
    while tracing and is emptied with the state cache (`clear_cache`: mode, device, dtype, grid).

    Every additive encoding is also a coordinate map: `encode` ``(..., D) -> (..., out_dim)`` gives
    the features of continuous coordinates, by default ``embedding(points(coords))``.
    """
    # ----------------------------------------------------------------- what subclasses implement
    def _rows(self, pos: Positions) -> torch.Tensor:
        """The embedding ``([B,] n, C)`` of the last ``n`` tokens of ``pos`` (``n >= pos.num_tokens -
        pos.num_prefix``)."""
        raise NotImplementedError

    def _table_key(self, pos: Positions) -> Optional[Hashable]:
        """What the embedding of ``pos`` depends on besides the module, or None when it cannot be
        cached. Default: the grid, or the tuple of grids of a NaFlex batch, when ``pos`` has one (its
        coordinates are then the grid indices, padded to the token count)."""
        if pos.sample_grids is None or pos.cameras is not None:  # point sets and rays carry their own values
            return None
        return pos.grid, pos.grids, pos.train_grid, pos.num_prefix, tuple(pos.coords.shape), pos.coords.dtype

    # ----------------------------------------------------------------- shared mechanics
    def _build(self, pos: Positions) -> torch.Tensor:
        """The uncached embedding ``(B | 1, N_total, C)``."""
        rows = self._rows(pos)
        rows = rows if rows.dim() == 3 else rows.unsqueeze(0)
        return pad_prefix_rows(rows, pos.num_tokens - rows.shape[1])

    def _cache_key(self, pos: Positions) -> Optional[Hashable]:
        key = self._table_key(pos)
        if key is None:
            return None
        tensors = list(self.parameters()) + list(self.buffers())
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return None  # a cached table would carry a finished autograd graph
        return ('embedding', key, pos.device, tuple((id(t), t._version) for t in tensors))

    def embedding(self, pos: Positions) -> torch.Tensor:
        """The additive embedding ``(B | 1, N_total, C)`` of the tokens of ``pos``; prefix tokens
        without a row of their own get zeros."""
        key = self._cache_key(pos)
        if key is None:
            return self._build(pos)
        return self.tensor_cache.get(key, lambda: self._build(pos))

    def embed(self, x: torch.Tensor, pos: Positions, state: Any = None) -> torch.Tensor:
        """``x + embedding(pos)``, in ``x``'s dtype."""
        return x + self.embedding(pos).to(x.dtype)

    @property
    def out_dim(self) -> int:
        """Width of `encode`'s features (the token width for table and Fourier encodings)."""
        return self.ctx.dim

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """Features ``(..., out_dim)`` of continuous coordinates ``(..., D)``: the embedding of the
        point set ``coords``."""
        flat = coords.reshape(-1, coords.shape[-1])
        return self.embedding(points(flat))[0].reshape(*coords.shape[:-1], -1)
