"""The embedded dataset: scenes whose label is a question about *where* things are.

Nothing is downloaded or stored: scene ``i`` is drawn from ``numpy.random.default_rng([seed,
split, i])`` and rasterised on request, at any resolution, so the same scene can be shown at 32,
48 or 64 pixels (the resolution-extrapolation test), or at any height and width (native aspect
ratios, for NaFlex batches). Rasterisation is analytic: a pixel's colour is the object's coverage
estimated from its signed distance to the pixel centre, so edges are anti-aliased in the same way
at every size.
"""
from __future__ import annotations

import logging
import math
from typing import Literal, Optional, Tuple, Union

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
_ASPECT_STREAM = 1  # a scene's aspect ratio has its own stream: the scene is the same with or without one


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
    per scene. Items are ``(image, label, -1)``: a normalised ``(3, H, W)`` float tensor (``H = W =
    img_size`` for square scenes), the class index, and -1 for "not an unreadable input" (the
    image-folder dataset puts the index of an unreadable file in that slot).

    Native aspect ratios (``aspect``): scene ``i`` gets a width / height ratio drawn log-uniformly
    from ``aspect`` and is shown at about ``img_size**2`` pixels at that ratio (`shape`). Object
    centres and cells are fractions of each side, so the labels of both tasks are those of the
    square scene; sizes are fractions of the shorter side, so squares stay square, circles round,
    and every object stays inside its cell. Cells are patches only on square canvases.

    Args:
        size: number of scenes.
        img_size: side of the rendered square image in pixels.
        seed: seed of the scene stream.
        split: ``'train'`` or ``'val'`` (disjoint streams for the same seed).
        task: the question, see above.
        cells: side of the grid of cells objects are placed in (even, >= 2).
        object_size: range of object half-sizes, fractions of the canvas side (below half a cell).
        aspect: range ``(low, high)`` of width / height ratios of the scenes; None: square scenes.
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
            aspect: Optional[Tuple[float, float]] = None,
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
        if aspect is not None and not 0 < aspect[0] <= aspect[1]:
            raise ValueError(f'aspect must be (low, high) width / height ratios with 0 < low <= high, got {aspect}')
        self.size = size
        self.img_size = img_size
        self.seed = seed
        self.split = split
        self.task = task
        self.cells = cells
        self.object_size = (float(lo), float(hi))
        self.aspect = None if aspect is None else (float(aspect[0]), float(aspect[1]))
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

    def aspect_ratio(self, index: int) -> float:
        """Width / height of scene ``index``: 1 for square scenes, else drawn log-uniformly from ``aspect``."""
        if not 0 <= index < self.size:
            raise IndexError(f'scene index {index} out of range for {self.size} scenes')
        if self.aspect is None:
            return 1.0
        rng = np.random.default_rng([self.seed, _SPLITS[self.split], index, _ASPECT_STREAM])
        return float(np.exp(rng.uniform(np.log(self.aspect[0]), np.log(self.aspect[1]))))

    def shape(self, index: int) -> Tuple[int, int]:
        """``(H, W)`` of scene ``index`` as items show it: ``img_size`` square, or about ``img_size**2``
        pixels at its aspect ratio."""
        ratio = self.aspect_ratio(index)
        if ratio == 1.0:
            return self.img_size, self.img_size
        return max(1, round(self.img_size / math.sqrt(ratio))), max(1, round(self.img_size * math.sqrt(ratio)))

    def render(self, index: int, img_size: Union[int, Tuple[int, int]]) -> np.ndarray:
        """Scene ``index`` as an ``(H, W, 3)`` float image in [0, 1] (rows = y, top first); ``img_size``
        is ``S`` (square) or ``(H, W)``."""
        h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
        return self._draw(self.scene(index), h, w)

    @staticmethod
    def _draw(s: dict, h: int, w: int) -> np.ndarray:
        # lengths in units of the shorter side m (on a square canvas: the canvas side, fractions as drawn)
        m = min(h, w)
        x = ((np.arange(w, dtype=np.float64) + 0.5) / m)[None, :]  # pixel centres
        y = ((np.arange(h, dtype=np.float64) + 0.5) / m)[:, None]
        sx, sy = s['square'][0] * (w / m), s['square'][1] * (h / m)
        cx, cy = s['circle'][0] * (w / m), s['circle'][1] * (h / m)
        d_square = np.maximum(np.abs(x - sx), np.abs(y - sy)) - s['half_square']
        d_circle = np.hypot(x - cx, y - cy) - s['radius']
        # coverage from the signed distance in pixel units: resolution-consistent anti-aliasing
        a_square = np.clip(0.5 - d_square * m, 0.0, 1.0)[..., None]
        a_circle = np.clip(0.5 - d_circle * m, 0.0, 1.0)[..., None]
        img = np.full((h, w, 3), s['background'])
        img = img * (1 - a_square) + _RED * a_square
        return img * (1 - a_circle) + _BLUE * a_circle

    def image(self, index: int, img_size: Union[int, Tuple[int, int]]) -> Tuple[torch.Tensor, int]:
        """Scene ``index`` rendered at ``img_size`` (``S`` or ``(H, W)``), normalised ``(3, H, W)``, and its label."""
        h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
        scene = self.scene(index)
        img = (self._draw(scene, h, w).astype(np.float32) - self.mean) / self.std
        return torch.from_numpy(np.ascontiguousarray(img.transpose(2, 0, 1))), scene['label']

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int, int]:
        img, label = self.image(index, self.shape(index))
        return img, label, -1

    def at_size(self, img_size: int) -> 'SpatialShapes':
        """The same scenes rendered at another resolution."""
        return SpatialShapes(self.size, img_size, seed=self.seed, split=self.split, task=self.task,
                             cells=self.cells, object_size=self.object_size, aspect=self.aspect,
                             mean=tuple(self.mean.tolist()), std=tuple(self.std.tolist()))
