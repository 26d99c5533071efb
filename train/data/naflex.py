"""NaFlex data: images at their native aspect ratio, resized to a token budget, batched as timm's NaFlex dicts.

The path of timm's NaFlex loader (``timm.data.naflex_transforms``, ``NaFlexCollator``): each image
keeps its aspect ratio and is resized to the largest multiple of the patch size whose grid has at
most ``max_tokens`` patches (`vispe.naflex_size`, timm's ``get_image_size_for_seq``); the collate
cuts every image into patches and pads all of them to ``max_tokens`` tokens (`vispe.naflex_batch`),
so every batch has one shape whatever its images. Image folders get the size from timm's own
transforms (``create_transform(naflex=True)``: ``RandomResizedCropToSequence`` for training,
``ResizeToSequence`` for evaluation); the synthetic scenes are rendered at it directly
(`NaFlexScenes`), since they are drawn analytically at any size.
"""
from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

import torch
from torch.utils.data import Dataset

from vispe.naflex import naflex_batch, naflex_size

from .synthetic import SpatialShapes

__all__ = ['NaFlexScenes', 'NaFlexCollate']


class NaFlexScenes(Dataset):
    """`SpatialShapes` scenes, each rendered at the `naflex_size` of its own aspect ratio under a token
    budget; items ``(image (3, H, W), label, -1)`` with ``H`` and ``W`` multiples of ``patch_size``.

    Args:
        scenes: the scenes (``aspect`` set for varied aspect ratios; square scenes give square grids).
        patch_size: the model's patch size.
        max_tokens: patches per image at most.
    """

    def __init__(self, scenes: SpatialShapes, patch_size: int, max_tokens: int) -> None:
        self.scenes = scenes
        self.patch_size = patch_size
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.scenes)

    def size_of(self, index: int) -> Tuple[int, int]:
        """``(H, W)`` scene ``index`` is rendered at."""
        return naflex_size(self.scenes.shape(index), self.patch_size, self.max_tokens)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, int, int]:
        img, label = self.scenes.image(index, self.size_of(index))
        return img, label, -1


class NaFlexCollate:
    """Items ``(image (C, H, W), label, unreadable)`` -> ``(batch, labels, unreadable)``, ``batch`` the
    NaFlex dict (``patches`` ``(B, max_tokens, P*P*C)``, ``patch_coord``, ``patch_valid``) of
    `vispe.naflex_batch`. Images must come sized already (multiples of the patch, at most
    ``max_tokens`` patches): a resize here would run in the loader's main process, not in its workers.

    Args:
        patch_size: the model's patch size.
        max_tokens: the token budget; every batch is padded to it.
    """

    def __init__(self, patch_size: int, max_tokens: int) -> None:
        self.patch_size = patch_size
        self.max_tokens = max_tokens

    def __call__(self, items: Sequence[Tuple[torch.Tensor, Any, int]]) -> Tuple[Dict[str, torch.Tensor],
                                                                                 torch.Tensor, torch.Tensor]:
        images, labels, unreadable = zip(*items)
        batch = naflex_batch(images, self.patch_size, self.max_tokens, resize=False)
        return batch, torch.as_tensor(labels), torch.as_tensor(unreadable)

    def __repr__(self) -> str:
        return f'{type(self).__name__}(patch_size={self.patch_size}, max_tokens={self.max_tokens})'
