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
from functools import lru_cache
from typing import Any, Literal, Optional, Sequence, Tuple

import torch

from .._tracing import is_tracing

__all__ = ['Positions', 'GridMode', 'grid', 'points', 'grid_coordinates']

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
        key_padding_mask: optional ``(B, N)`` bool mask, True where a token is padding.
    """
    coords: torch.Tensor
    num_prefix: int = 0
    grid: Optional[Tuple[int, ...]] = None
    train_grid: Optional[Tuple[int, ...]] = None
    cameras: Any = None
    view_index: Optional[torch.Tensor] = None
    key_padding_mask: Optional[torch.Tensor] = None

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

    def replace(self, **changes: Any) -> 'Positions':
        """A copy with some fields changed."""
        return replace(self, **changes)

    def select(self, keep: torch.Tensor) -> 'Positions':
        """Positions of a subset of the non-prefix tokens, per sample (``keep``: ``(B, K)`` indices).

        Used after token dropping: the result is batched and has no grid any more.
        """
        coords = self.coords if self.batched else self.coords.expand(keep.shape[0], -1, -1)
        coords = coords.gather(1, keep.unsqueeze(-1).expand(-1, -1, coords.shape[-1]))
        return self.replace(coords=coords, grid=None)

    def same_as(self, other: 'Positions') -> bool:
        """True when ``other`` describes the same tokens (used to reuse cached encoding state)."""
        if other is self:
            return True
        if (self.num_prefix, self.grid, self.train_grid) != (other.num_prefix, other.grid, other.train_grid):
            return False
        if self.cameras is not other.cameras:
            return False
        for a, b in ((self.coords, other.coords), (self.view_index, other.view_index),
                     (self.key_padding_mask, other.key_padding_mask)):
            if (a is None) != (b is None):
                return False
            if a is not None and a is not b and (
                    a.shape != b.shape or a.device != b.device or a.dtype != b.dtype or not torch.equal(a, b)):
                return False
        return True


def _build_grid_index(shape: Tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    axes = [torch.arange(n, device=device, dtype=dtype) for n in shape]
    return torch.stack(torch.meshgrid(*axes, indexing='ij'), dim=-1).reshape(-1, len(shape))


@lru_cache(maxsize=64)
def _cached_grid_index(shape: Tuple[int, ...], device: torch.device, dtype: torch.dtype,
                       inference: bool) -> torch.Tensor:
    """`_build_grid_index`, once per key; ``inference`` (whether inference mode is on) only keys."""
    return _build_grid_index(shape, device, dtype)


def _grid_index(shape: Tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The grid's index coordinates, one tensor per (shape, device, dtype) while not traced.

    Reusing the same tensor lets the encodings' eval cache recognise the positions by identity
    (no device sync). Tensors made in inference mode are inference tensors, which autograd refuses
    to save, so they are cached apart; nothing made while tracing (fake tensors) is cached.
    """
    if is_tracing():
        return _build_grid_index(shape, device, dtype)
    return _cached_grid_index(shape, device, dtype, torch.is_inference_mode_enabled())


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
    coords = _grid_index(shape, torch.device(device or 'cpu'), dtype)
    return Positions(coords=coords, num_prefix=num_prefix, grid=shape, train_grid=train)


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
    grid covers the trained range more densely (interpolation). Point sets are returned unchanged.
    """
    if mode == 'index' or pos.grid is None or pos.train_grid is None or pos.grid == pos.train_grid:
        return pos.coords
    if mode != 'normalized':
        raise ValueError(f"grid_mode must be one of ('index', 'normalized'), got {mode!r}")
    scale = torch.tensor([t / g for t, g in zip(pos.train_grid, pos.grid)], device=pos.device,
                         dtype=pos.coords.dtype)
    return pos.coords * scale
