"""scikit-learn's bundled handwritten digits, written once as an image folder (no download).

``sklearn.datasets.load_digits`` ships 1,797 grey 8 x 8 images of the digits 0-9 (the UCI optical
recognition data, 17 grey levels) inside the scikit-learn package. `write_digits` writes them as
PNG files in the ImageNet layout, ``root/{train,val}/<digit>/<index>.png``, so that the ordinary
folder pipeline (`ImageFolderDataset` and timm's transforms, which upsample them to the model's
input size) reads them like any other image folder.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image

from vispe.extras import require

__all__ = ['write_digits', 'DIGITS_VAL_SIZE']

_logger = logging.getLogger(__name__)

DIGITS_VAL_SIZE = 397  # 1,797 images: 1,400 for training, 397 for validation


def write_digits(root: Union[str, Path], val_size: int = DIGITS_VAL_SIZE, seed: int = 0) -> Path:
    """Write the digits as ``root/{train,val}/<digit>/<index>.png`` unless ``root`` exists.

    The split is a fixed random permutation of the 1,797 images (``seed``), ``val_size`` of them
    for validation. Files are 8 x 8 greyscale PNGs, the 0-16 grey levels scaled to 0-255 (no
    resampling: the transforms upsample them). The folder is filled under a temporary name and
    renamed into place, so processes that start together (DDP ranks) never read a half-written
    folder, and an interrupted write leaves no ``root`` behind.
    """
    root = Path(root).expanduser()
    if root.exists():
        return root
    load_digits = require('sklearn.datasets', 'the digits data set').load_digits
    digits = load_digits()
    n = len(digits.target)
    if not 0 < val_size < n:
        raise ValueError(f'val_size must be between 1 and {n - 1}, got {val_size}')
    order = np.random.default_rng(seed).permutation(n)
    pixels = np.rint(digits.images * (255.0 / 16.0)).astype(np.uint8)
    tmp = root.parent / f'.{root.name}.tmp-{os.getpid()}'
    shutil.rmtree(tmp, ignore_errors=True)
    for rank, i in enumerate(order):
        split = 'val' if rank < val_size else 'train'
        folder = tmp / split / str(digits.target[i])
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels[i]).save(folder / f'{i:04d}.png')
    try:
        tmp.rename(root)
    except OSError:  # another process renamed its copy first: keep that one
        shutil.rmtree(tmp, ignore_errors=True)
        if not root.is_dir():
            raise
    else:
        _logger.info('wrote the scikit-learn digits to %s (%d train, %d val images)', root, n - val_size, val_size)
    return root
