"""Token positions: where each token is, independent of how an encoding uses it.

A `Positions` holds the coordinates of the non-prefix tokens of a sequence; prefix tokens (class,
register) come first in the token sequence and have no coordinates, each encoding decides what
they get (identity rotation, a dedicated bucket, the grid centre, ...).

Coordinate conventions (stated once, used by every encoding):

* a grid of shape ``(h, w)`` or ``(t, h, w)`` is flattened in row-major (raster) order, and its
  coordinate axes follow the grid axes: ``(row, col)`` or ``(t, row, col)``;
* ``grid(...)`` returns integer patch indices as floats; encodings that want another convention
  (normalised to the training grid, pixel centres, linspace) derive it with `grid_coordinates`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional, Sequence, Tuple

import torch

from .._tracing import is_tracing

__all__ = ['Positions', 'GridMode', 'grid', 'naflex_grid', 'points', 'grid_coordinates']

GridMode = Literal['index', 'normalized']


@dataclass(frozen=True, eq=False)
class Positions:
    """Coordinates of the tokens of a sequence.

    Attributes:
        coords: ``(N, D)`` or ``(B, N, D)`` float coordinates of the non-prefix tokens.
        num_prefix: number of prefix tokens (class / register tokens) before them.
        grid: shape of the token grid when the tokens form one (``(h, w)`` or ``(t, h, w)``),
            in which case ``coords`` are its integer indices in row-major order.
        train_grid: grid shape the model was trained at; ``normalized`` modes rescale to it.
        cameras: optional camera data for geometry-aware encodings.
        view_index: optional ``(N,)`` or ``(B, N)`` camera index of each token.
        key_padding_mask: optional ``(B, N)`` bool mask, True where a token is padding; a mask over the
            whole sequence ``(B, num_prefix + N)`` is taken too (its prefix columns, never padding, dropped).
        grids: per-sample grid shapes of a native-resolution (NaFlex) batch: sample ``b``'s first
            ``prod(grids[b])`` rows of ``coords`` ``(B, N, D)`` are the integer indices of its own grid
            in row-major order and the rest is padding (``key_padding_mask`` True, coordinates 0);
            ``grid`` is then None (the samples share no grid). Built by `naflex_grid`.
        selected_from: set by `select` (token dropping): the grid the kept tokens' coordinates are
            indices of, one shared ``(grid,)`` or one per sample (a NaFlex batch's ``grids``). The tokens
            are a point set then (no ``grid`` / ``grids`` layout), but conventions that rescale indices
            by their grid (normalised coordinates, LieRE's linspace, scaled RoPE frequencies) still
            see the full image's grid: `index_grid`, `index_grids`.
    """
    coords: torch.Tensor
    num_prefix: int = 0
    grid: Optional[Tuple[int, ...]] = None
    train_grid: Optional[Tuple[int, ...]] = None
    cameras: Any = None
    view_index: Optional[torch.Tensor] = None
    key_padding_mask: Optional[torch.Tensor] = None
    grids: Optional[Tuple[Tuple[int, ...], ...]] = None
    selected_from: Optional[Tuple[Tuple[int, ...], ...]] = None

    def _positioned_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """A key padding mask over the positioned tokens ``(B, N)``: given so, or over the whole sequence
        ``(B, num_prefix + N)`` (as attention sees it), whose prefix columns are dropped."""
        n, npre = self.coords.shape[-2], self.num_prefix
        if not torch.is_tensor(mask) or mask.dim() != 2 or mask.shape[-1] not in (n, n + npre):
            shape = tuple(mask.shape) if torch.is_tensor(mask) else type(mask).__name__
            whole = f' or (B, {n + npre}) with the {npre} prefix tokens first' if npre else ''
            raise ValueError(f'Positions.key_padding_mask must be (B, {n}) over the positioned tokens{whole}, '
                             f'True where a token is padding; got {shape}')
        if mask.dtype != torch.bool:
            raise ValueError(f'Positions.key_padding_mask must be a bool tensor (True = padding), got {mask.dtype}')
        if mask.shape[-1] == n:
            return mask
        if not is_tracing() and bool(mask[:, :npre].any()):
            raise ValueError('Positions.key_padding_mask marks prefix tokens as padding; prefix (class / register) '
                             'tokens are always attended')
        return mask[:, npre:]

    def __post_init__(self) -> None:
        if not torch.is_tensor(self.coords) or self.coords.dim() not in (2, 3):
            raise ValueError(
                f'Positions.coords must be a (N, D) or (B, N, D) tensor, got '
                f'{tuple(self.coords.shape) if torch.is_tensor(self.coords) else type(self.coords).__name__}')
        if not self.coords.is_floating_point():
            raise ValueError(f'Positions.coords must be a float tensor, got {self.coords.dtype}')
        if self.num_prefix < 0:
            raise ValueError(f'Positions.num_prefix must be >= 0, got {self.num_prefix}')
        if self.grid is not None and math.prod(self.grid) != self.coords.shape[-2]:
            raise ValueError(f'Positions.grid {self.grid} does not match {self.coords.shape[-2]} coordinates')
        if self.key_padding_mask is not None:
            object.__setattr__(self, 'key_padding_mask', self._positioned_mask(self.key_padding_mask))
        if self.grids is not None:
            if self.grid is not None or self.coords.dim() != 3 or len(self.grids) != self.coords.shape[0]:
                raise ValueError(f'Positions.grids needs batched coordinates (B, N, D) with one grid per sample '
                                 f'and grid=None; got {len(self.grids)} grids for coordinates '
                                 f'{tuple(self.coords.shape)}, grid={self.grid}')
            if any(len(g) != self.coords.shape[-1] or math.prod(g) > self.coords.shape[-2] for g in self.grids):
                raise ValueError(f'Positions.grids {self.grids} must have {self.coords.shape[-1]} axes each and at '
                                 f'most {self.coords.shape[-2]} tokens')
        if self.selected_from is not None and (
                (self.grid, self.grids) != (None, None) or any(len(g) != self.coords.shape[-1] for g in self.selected_from)
                or len(self.selected_from) not in (1, self.coords.shape[0] if self.batched else 1)):
            raise ValueError(f'Positions.selected_from {self.selected_from} needs grid=None, grids=None and one grid of '
                             f'{self.coords.shape[-1]} axes, or one per sample, for coordinates {tuple(self.coords.shape)}')

    @property
    def ndim(self) -> int:
        """Number of coordinate axes D."""
        return self.coords.shape[-1]

    @property
    def num_tokens(self) -> int:
        """Total sequence length, prefix tokens included."""
        return self.num_prefix + self.coords.shape[-2]

    @property
    def batched(self) -> bool:
        return self.coords.dim() == 3

    @property
    def device(self) -> torch.device:
        return self.coords.device

    @property
    def sample_grids(self) -> Optional[Tuple[Tuple[int, ...], ...]]:
        """Each sample's grid: ``grids`` in a NaFlex batch, else ``grid`` once (shared by every sample),
        None for point sets."""
        if self.grids is not None:
            return self.grids
        return (self.grid,) if self.grid is not None else None

    @property
    def index_grid(self) -> Optional[Tuple[int, ...]]:
        """The one grid every sample's coordinates are indices of: ``grid``, or the shared grid the tokens
        were selected from (`select`); None for a NaFlex batch (`index_grids`) and point sets."""
        if self.grid is not None:
            return self.grid
        return self.selected_from[0] if self.selected_from is not None and len(self.selected_from) == 1 else None

    @property
    def index_grids(self) -> Optional[Tuple[Tuple[int, ...], ...]]:
        """Per-sample grids the coordinates are indices of, where they differ between samples: a NaFlex
        batch's ``grids``, also after token selection; None otherwise (see `index_grid`)."""
        if self.grids is not None:
            return self.grids
        return self.selected_from if self.selected_from is not None and len(self.selected_from) > 1 else None

    def sample(self, index: int) -> 'Positions':
        """The positions of sample ``index`` alone, without padding (a NaFlex sample: its own grid)."""
        if self.grids is not None:
            return grid(*self.grids[index], num_prefix=self.num_prefix, train_grid=self.train_grid,
                        device=self.device, dtype=self.coords.dtype)
        if not self.batched:
            return self
        coords = self.coords[index]
        if self.key_padding_mask is not None:
            coords = coords[~self.key_padding_mask[index]]
        view_index = self.view_index
        if view_index is not None and view_index.dim() > 1:
            view_index = view_index[index]
            if self.key_padding_mask is not None:
                view_index = view_index[~self.key_padding_mask[index]]
        index_grids = self.index_grids
        selected = self.selected_from if index_grids is None else (index_grids[index],)
        return self.replace(coords=coords, key_padding_mask=None, view_index=view_index, selected_from=selected)

    def replace(self, **changes: Any) -> 'Positions':
        """A copy with some fields changed."""
        return replace(self, **changes)

    def select(self, keep: torch.Tensor) -> 'Positions':
        """Positions of a subset of the non-prefix tokens, per sample (``keep``: ``(B, K)`` indices).

        Used after token dropping: the result is batched and has no grid layout any more, its padding
        mask follows the kept tokens, and ``selected_from`` keeps the grid(s) the coordinates index.
        """
        coords = self.coords if self.batched else self.coords.expand(keep.shape[0], -1, -1)
        coords = coords.gather(1, keep.unsqueeze(-1).expand(-1, -1, coords.shape[-1]))
        mask = self.key_padding_mask.gather(1, keep) if self.key_padding_mask is not None else None
        grids = self.grids or ((self.grid,) if self.grid is not None else self.selected_from)
        return self.replace(coords=coords, grid=None, grids=None, key_padding_mask=mask, selected_from=grids)

    def same_as(self, other: 'Positions') -> bool:
        """True when ``other`` describes the same tokens (used to reuse cached encoding state)."""
        if other is self:
            return True
        if (self.num_prefix, self.grid, self.train_grid, self.grids, self.selected_from) != (
                other.num_prefix, other.grid, other.train_grid, other.grids, other.selected_from):
            return False
        if self.cameras is not other.cameras:
            return False
        pairs = [(self.view_index, other.view_index), (self.key_padding_mask, other.key_padding_mask)]
        # a grid's coordinates are its indices: equal grids have equal ones (no comparison, no device sync)
        if not (self.grid is not None and not self.batched and not other.batched
                and (self.coords.device, self.coords.dtype) == (other.coords.device, other.coords.dtype)):
            pairs.append((self.coords, other.coords))
        for a, b in pairs:
            if (a is None) != (b is None):
                return False
            if a is not None and a is not b and (
                    a.shape != b.shape or a.device != b.device or a.dtype != b.dtype or not torch.equal(a, b)):
                return False
        return True


def _build_grid_index(shape: Tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    axes = [torch.arange(n, device=device, dtype=dtype) for n in shape]
    return torch.stack(torch.meshgrid(*axes, indexing='ij'), dim=-1).reshape(-1, len(shape))


def grid(
        *shape: int,
        num_prefix: int = 0,
        train_grid: Optional[Sequence[int]] = None,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
) -> Positions:
    """Integer-index positions of a 2D ``grid(h, w)`` or 3D ``grid(t, h, w)`` of tokens.

    Args:
        shape: grid size per axis, e.g. ``(14, 14)`` or ``(8, 14, 14)``.
        num_prefix: prefix tokens preceding the grid in the sequence.
        train_grid: the grid size used in training (defaults to ``shape``).
        device: device of the coordinates.
        dtype: float dtype of the coordinates.
    """
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    shape = tuple(int(s) for s in shape)
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f'grid shape must be positive integers, got {shape}')
    train = tuple(int(s) for s in train_grid) if train_grid is not None else shape
    if len(train) != len(shape):
        raise ValueError(f'train_grid {train} must have as many axes as the grid {shape}')
    coords = _build_grid_index(shape, torch.device(device or 'cpu'), dtype)
    return Positions(coords=coords, num_prefix=num_prefix, grid=shape, train_grid=train)


def naflex_grid(
        grids: Sequence[Sequence[int]],
        num_tokens: Optional[int] = None,
        num_prefix: int = 0,
        train_grid: Optional[Sequence[int]] = None,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
) -> Positions:
    """Positions of a native-resolution (NaFlex) batch: sample ``b`` is a grid of shape ``grids[b]``,
    its tokens first in row-major order, padded with zero coordinates to ``num_tokens`` (default: the
    largest grid's token count); ``key_padding_mask`` marks the padding.

    Args:
        grids: one grid shape per sample, e.g. ``[(20, 30), (14, 14), (32, 16)]``.
        num_tokens: the padded token count (>= every grid's token count).
        num_prefix: prefix tokens before each sample's grid tokens.
        train_grid: the grid the model was trained at (``normalized`` modes rescale each sample to it).
        device: device of the coordinates.
        dtype: float dtype of the coordinates.
    """
    shapes = tuple(tuple(int(s) for s in g) for g in grids)
    if not shapes or any(not g or any(s <= 0 for s in g) for g in shapes) or len({len(g) for g in shapes}) != 1:
        raise ValueError(f'grids must be one or more shapes of positive integers with the same number of axes, '
                         f'got {shapes}')
    sizes = [math.prod(g) for g in shapes]
    n = max(sizes) if num_tokens is None else int(num_tokens)
    if n < max(sizes):
        raise ValueError(f'num_tokens={n} is smaller than the largest grid ({max(sizes)} tokens)')
    device = torch.device(device or 'cpu')
    coords = torch.zeros(len(shapes), n, len(shapes[0]), device=device, dtype=dtype)
    mask = torch.ones(len(shapes), n, dtype=torch.bool, device=device)
    for b, (g, size) in enumerate(zip(shapes, sizes)):
        coords[b, :size] = _build_grid_index(g, device, dtype)
        mask[b, :size] = False
    train = tuple(int(s) for s in train_grid) if train_grid is not None else None
    if train is not None and len(train) != len(shapes[0]):
        raise ValueError(f'train_grid {train} must have as many axes as the grids {shapes[0]}')
    return Positions(coords=coords, num_prefix=num_prefix, train_grid=train, key_padding_mask=mask, grids=shapes)


def points(coords: torch.Tensor, num_prefix: int = 0, **fields: Any) -> Positions:
    """Positions of an arbitrary point set (e.g. point-cloud or RGB-D tokens), ``(N, D)`` or ``(B, N, D)``."""
    coords = torch.as_tensor(coords)
    if not coords.is_floating_point():
        coords = coords.float()
    return Positions(coords=coords, num_prefix=num_prefix, **fields)


def grid_coordinates(pos: Positions, mode: GridMode = 'index') -> torch.Tensor:
    """Coordinates of ``pos`` in the given grid mode.

    ``index``: integer patch indices; a larger grid reaches larger coordinates (extrapolation).
    ``normalized``: indices rescaled per axis to the training grid, ``i * n_train / n``, so a larger
    grid covers the trained range more densely (interpolation); in a NaFlex batch each sample against
    its own grid. Point sets are returned unchanged.
    """
    if mode not in ('index', 'normalized'):
        raise ValueError(f"grid_mode must be one of ('index', 'normalized'), got {mode!r}")
    if mode == 'normalized' and pos.index_grids is not None and pos.train_grid is not None:
        # each sample against its own grid (padding rows stay 0)
        scale = torch.tensor([[t / g for t, g in zip(pos.train_grid, shape)] for shape in pos.index_grids],
                             device=pos.device, dtype=pos.coords.dtype)
        return pos.coords * scale.unsqueeze(1)
    grid = pos.index_grid
    if mode == 'index' or grid is None or pos.train_grid is None or grid == pos.train_grid:
        return pos.coords
    scale = torch.tensor([t / g for t, g in zip(pos.train_grid, grid)], device=pos.device, dtype=pos.coords.dtype)
    return pos.coords * scale
