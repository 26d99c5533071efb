"""ImageFolder / ImageNet-layout data through timm's transforms, robust to unreadable files.

``root/<split>/<class>/<image>``: the torchvision layout that ImageNet, most ImageNet subsets and
timm's own scripts use. Transforms come from ``timm.data.create_transform`` (random-resized crop,
flip, colour jitter, RandAugment / 3-Augment, random erasing; resize + centre crop for eval).

Two properties the training loop relies on:

* an unreadable image (corrupt, truncated, not an image, a decompression bomb) is logged and
  skipped: the item is the next readable image of the folder list, and its third element is its
  own index (-1 for a readable one), so the loop can count each bad file once, however often it
  comes round, without ever changing the batch size (which DDP and mixup need constant);
* augmentation randomness is a function of ``(seed, epoch, index)`` only (`train.rng.seeded`), so
  the images of an epoch are the same whatever the number of workers, and a resumed run sees
  exactly the images the interrupted one would have.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from PIL import Image
from torch.utils.data import Dataset
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

from ..rng import seeded

__all__ = ['ImageFolderDataset', 'split_dir']

_logger = logging.getLogger(__name__)


def split_dir(root: str, split: str) -> Path:
    """``root/split``, with an error that says what was expected."""
    path = Path(root).expanduser() / split
    if not path.is_dir():
        raise ValueError(f'data.root: {str(path)!r} is not a folder; expected the ImageNet layout '
                         f'root/{split}/<class>/<image> (set data.root, data.train_split / data.val_split)')
    return path


class ImageFolderDataset(Dataset):
    """Images in ``root/<class>/<file>``; items ``(image, label, unreadable)``.

    ``unreadable`` is ``index`` when the file at ``index`` cannot be read (image and label are then
    those of the next readable file), else -1.

    Args:
        root: folder with one subfolder per class.
        transform: image transform (timm's ``create_transform``).
        seed: seed of the augmentation stream (items are seeded by ``(seed, epoch, index)``).
        class_to_idx: a fixed class mapping (so train and val share it); default: sorted folder names.
    """

    def __init__(self, root: Path, transform: Optional[Callable] = None, seed: int = 0,
                 class_to_idx: Optional[dict] = None) -> None:
        self.root = Path(root)
        if class_to_idx is None:
            _, class_to_idx = find_classes(str(self.root))
        self.class_to_idx = class_to_idx
        self.classes = sorted(class_to_idx, key=class_to_idx.get)
        self.samples: List[Tuple[str, int]] = make_dataset(str(self.root), class_to_idx, IMG_EXTENSIONS,
                                                           allow_empty=True)
        if not self.samples:
            raise ValueError(f'data.root: no images under {str(self.root)!r} '
                             f'(extensions {", ".join(IMG_EXTENSIONS)})')
        self.transform = transform
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the augmentation stream of ``epoch`` (call before creating the epoch's loader)."""
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.samples)

    @staticmethod
    def _load(path: str) -> Image.Image:
        with open(path, 'rb') as f:
            img = Image.open(f)
            return img.convert('RGB')  # forces the decode inside the try of the caller

    def __getitem__(self, index: int) -> Tuple[Any, int, int]:
        n = len(self.samples)
        for offset in range(n):
            i = (index + offset) % n
            path, target = self.samples[i]
            try:
                img = self._load(path)
            # Only PIL runs here, and a bad file makes it raise more than OSError / SyntaxError /
            # ValueError: DecompressionBombError (an Exception), struct.error, EOFError, ...
            except Exception as e:
                if offset == 0:  # a file passed over here is reported when its own index comes
                    _logger.warning('skipping unreadable image %s (%s: %s)', path, type(e).__name__, e)
                continue
            if self.transform is not None:
                with seeded(self.seed, self.epoch, i):
                    img = self.transform(img)
            return img, target, index if offset else -1
        raise RuntimeError(f'no readable image under {str(self.root)!r}')
