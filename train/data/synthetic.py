"""The embedded dataset: scenes whose label is a question about *where* things are.

Nothing is downloaded or stored: scene ``i`` is drawn from ``numpy.random.default_rng([seed,
split, i])`` and rasterised on request, at any resolution, so the same scene can be shown at 32,
48 or 64 pixels (the resolution-extrapolation test). Rasterisation is analytic: a pixel's colour
is the object's coverage estimated from its signed distance to the pixel centre, so edges are
anti-aliased in the same way at every size.
"""
from __future__ import annotations

import logging
from typing import Literal, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = ['SpatialShapes', 'SyntheticTask']

_logger = logging.getLogger(__name__)

SyntheticTask = Literal['relation', 'quadrant']

_RED = np.array([0.90, 0.15, 0.10])
_BLUE = np.array([0.10, 0.25, 0.90])
_SPLITS = {'train': 0, 'val': 1}
_EDGE = 0.02  # gap between an object and its cell border (fraction of the canvas): room for anti-aliasing


class SpatialShapes(Dataset):
    """A red square and a blue circle on a grey canvas; the label asks where they are.

    Each object sits inside its own cell of a ``cells x cells`` grid over the canvas (jittered
    within the cell, never crossing its border). With the default 4 cells and a patch-8 ViT at
    32 px, cells are patches: no patch ever holds parts of both objects, so the bag of patch tokens
    a model without positional information (``pe='none'``) sees has the same distribution for
    every label, and such a model stays at chance (25 %) by construction.

    Tasks (``task``):

    * ``relation`` (default): ``2 * [square left of circle] + [square above circle]``; the objects
      are in different cell rows and columns, so the answer is never ambiguous. It depends only on
      the relative position, which relative encodings (RoPE) express directly.
    * ``quadrant``: the quadrant of the square (``2 * [right half] + [bottom half]``): absolute
      position, which relative encodings can only infer from the image border.

    Object half-sizes are drawn from ``object_size`` (fractions of the canvas), the background grey
    per scene. Items are ``(image, label, -1)``: a normalised ``(3, S, S)`` float tensor, the class
    index, and -1 for "not an unreadable input" (the image-folder dataset puts the index of an
    unreadable file in that slot).

    Args:
        size: number of scenes.
        img_size: side of the rendered square image in pixels.
        seed: seed of the scene stream.
        split: ``'train'`` or ``'val'`` (disjoint streams for the same seed).
        task: the question, see above.
        cells: side of the grid of cells objects are placed in (even, >= 2).
        object_size: range of object half-sizes, fractions of the canvas side (below half a cell).
        mean: per-channel mean subtracted after rendering in [0, 1].
        std: per-channel std divided by after subtracting the mean.
    """

    def __init__(
            self,
            size: int,
            img_size: int,
            *,
            seed: int = 0,
            split: Literal['train', 'val'] = 'train',
            task: SyntheticTask = 'relation',
            cells: int = 4,
            object_size: Tuple[float, float] = (0.05, 0.09),
            mean: Tuple[float, float, float] = (0.5, 0.5, 0.5),
            std: Tuple[float, float, float] = (0.5, 0.5, 0.5),
    ) -> None:
        if size < 1:
            raise ValueError(f'size must be >= 1, got {size}')
        if img_size < 4:
            raise ValueError(f'img_size must be >= 4 pixels, got {img_size}')
        if split not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        if task not in ('relation', 'quadrant'):
            raise ValueError(f"task must be 'relation' or 'quadrant', got {task!r}")
        if cells < 2 or cells % 2:
            raise ValueError(f'cells must be an even number >= 2 (quadrants are unions of cells), got {cells}')
        lo, hi = object_size
        if not 0 < lo <= hi < 0.5 / cells - _EDGE:
            raise ValueError(f'object_size must satisfy 0 < low <= high < {0.5 / cells - _EDGE:g} (within half a '
                             f'cell of a {cells}x{cells} grid), got {object_size}')
        self.size = size
        self.img_size = img_size
        self.seed = seed
        self.split = split
        self.task = task
        self.cells = cells
        self.object_size = (float(lo), float(hi))
        self.mean = np.asarray(mean, dtype=np.float32)
        self.std = np.asarray(std, dtype=np.float32)

    num_classes = 4

    def __len__(self) -> int:
        return self.size

    def scene(self, index: int) -> dict:
        """Scene ``index``: centres ``(x, y)`` of square and circle, half-sizes, background, label."""
        if not 0 <= index < self.size:
            raise IndexError(f'scene index {index} out of range for {self.size} scenes')
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], index])
        half_sq, radius = rng.uniform(*self.object_size, size=2)
        background = rng.uniform(0.35, 0.65)
        n = self.cells
        if self.task == 'relation':  # different rows and columns: the relation is never ambiguous
            cols, rows = rng.choice(n, size=2, replace=False), rng.choice(n, size=2, replace=False)
        else:  # any two distinct cells
            flat = rng.choice(n * n, size=2, replace=False)
            cols, rows = flat % n, flat // n
        cell = 1.0 / n
        slack = np.array([cell / 2 - half_sq, cell / 2 - radius]) - _EDGE  # jitter that keeps objects in their cells
        square, circle = ((np.stack([cols, rows], axis=1) + 0.5) * cell
                          + rng.uniform(-1, 1, size=(2, 2)) * slack[:, None])
        if self.task == 'relation':
            label = 2 * int(square[0] < circle[0]) + int(square[1] < circle[1])
        else:
            label = 2 * int(square[0] > 0.5) + int(square[1] > 0.5)
        return dict(square=square, circle=circle, half_square=half_sq, radius=radius,
                    background=background, label=label)

    def render(self, index: int, img_size: int) -> np.ndarray:
        """Scene ``index`` as an ``(S, S, 3)`` float image in [0, 1] (rows = y, top first)."""
        return self._draw(self.scene(index), img_size)

    @staticmethod
    def _draw(s: dict, img_size: int) -> np.ndarray:
        c = (np.arange(img_size, dtype=np.float64) + 0.5) / img_size  # pixel centres
        x, y = c[None, :], c[:, None]
        d_square = np.maximum(np.abs(x - s['square'][0]), np.abs(y - s['square'][1])) - s['half_square']
        d_circle = np.hypot(x - s['circle'][0], y - s['circle'][1]) - s['radius']
        # coverage from the signed distance in pixel units: resolution-consistent anti-aliasing
        a_square = np.clip(0.5 - d_square * img_size, 0.0, 1.0)[..., None]
        a_circle = np.clip(0.5 - d_circle * img_size, 0.0, 1.0)[..., None]
        img = np.full((img_size, img_size, 3), s['background'])
        img = img * (1 - a_square) + _RED * a_square
        return img * (1 - a_circle) + _BLUE * a_circle

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int, int]:
        scene = self.scene(index)
        img = (self._draw(scene, self.img_size).astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), scene['label'], -1

    def at_size(self, img_size: int) -> 'SpatialShapes':
        """The same scenes rendered at another resolution."""
        return SpatialShapes(self.size, img_size, seed=self.seed, split=self.split, task=self.task,
                             cells=self.cells, object_size=self.object_size,
                             mean=tuple(self.mean.tolist()), std=tuple(self.std.tolist()))
