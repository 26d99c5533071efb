"""Native-resolution (NaFlex) batches: images of different sizes and aspect ratios in one batch.

NaFlex (NaViT, Dehghani et al. 2023, "Patch n' Pack"; SigLIP 2's NaFlex variant) keeps each image
at its own aspect ratio, resized to a token budget, and pads the token sequences to one length.
vispe uses timm's NaFlex input format (``timm.models.naflexvit``, ``timm.data.naflex_transforms``),
so a batch from timm's NaFlex loader runs through any vispe host unchanged:

* ``patches`` ``(B, N, P*P*C)``: each sample's patches in row-major order, each patch flattened in
  ``(ph, pw, C)`` order (channels fastest), zeros for padding;
* ``patch_coord`` ``(B, N, 2)`` int64: each patch's ``(row, col)`` in its own grid, 0 for padding;
* ``patch_valid`` ``(B, N)`` bool: True for a real patch, False for padding.

Sample ``b`` of such a batch is an ``(h_b, w_b)`` grid whose ``h_b * w_b`` patches come first; its
`Positions` (`naflex_positions`) carry the per-sample grids and the padding mask, and hosts mask
the padded keys in every attention layer and in pooling, so each sample's output equals the same
image run alone.
"""
from __future__ import annotations

import numbers
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ._timm import get_image_size_for_seq, patchify_image
from .positions import Positions, naflex_grid

__all__ = ['naflex_size', 'naflex_batch', 'naflex_positions', 'embed_patches']


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f'{name} must be a positive integer, got {value!r}')
    return int(value)


def naflex_size(image_size: Tuple[int, int], patch_size: int, max_tokens: int) -> Tuple[int, int]:
    """The size ``(H', W')`` timm's NaFlex resize gives an image of ``image_size = (H, W)``: the
    largest multiples of ``patch_size`` at the image's aspect ratio (each side rounded up to a whole
    patch) with at most ``max_tokens`` patches, ``(H'/p) * (W'/p) <= max_tokens``.

    This is timm's `get_image_size_for_seq` (the size its ``ResizeKeepRatioToSequence`` starts from).
    """
    if not isinstance(image_size, (tuple, list)) or len(image_size) != 2:
        raise ValueError(f'image_size must be (height, width), got {image_size!r}')
    h, w = (_positive_int('image_size', s) for s in image_size)
    p = _positive_int('patch_size', patch_size)
    n = _positive_int('max_tokens', max_tokens)
    _, (th, tw) = get_image_size_for_seq((h, w), p, n, divisible_by_patch=True)
    return int(th), int(tw)


def naflex_batch(images: Sequence[torch.Tensor], patch_size: int, max_tokens: Optional[int] = None,
                 resize: bool = True) -> Dict[str, torch.Tensor]:
    """Images ``(C, H, W)`` of any sizes as one NaFlex batch in timm's format (module docstring).

    Args:
        images: float images ``(C, H, W)``, all with the same channels, dtype and device.
        patch_size: the model's (square) patch size.
        max_tokens: the token budget: with ``resize=True`` each image is resized to `naflex_size`
            under it, and the batch is padded to ``max_tokens`` tokens (as timm's NaFlex collator pads
            to its ``max_seq_len``); None pads to the largest image's token count.
        resize: resize each image to `naflex_size` (bilinear, antialiased; needs ``max_tokens``);
            False takes every image at its own size, which the patch size must divide.

    Returns:
        ``{'patches', 'patch_coord', 'patch_valid'}`` on the images' device.
    """
    p = _positive_int('patch_size', patch_size)
    n_max = None if max_tokens is None else _positive_int('max_tokens', max_tokens)
    if resize and n_max is None:
        raise ValueError('resize=True needs max_tokens (the token budget each image is resized to); '
                         'pass max_tokens=..., or resize=False for images already sized to the patch size')
    images = list(images)
    if not images:
        raise ValueError('images must hold at least one (C, H, W) image')
    first = images[0]
    for i, img in enumerate(images):
        if not torch.is_tensor(img) or img.dim() != 3 or not img.is_floating_point():
            raise ValueError(f'images[{i}] must be a float (C, H, W) tensor, got '
                             f'{tuple(img.shape) if torch.is_tensor(img) else type(img).__name__}'
                             f'{" " + str(img.dtype) if torch.is_tensor(img) else ""}')
        if (img.shape[0], img.dtype, img.device) != (first.shape[0], first.dtype, first.device):
            raise ValueError(f'images[{i}] is {img.shape[0]} channels {img.dtype} on {img.device}, but images[0] '
                             f'is {first.shape[0]} channels {first.dtype} on {first.device}; they must agree')

    samples = []
    for i, img in enumerate(images):
        h, w = img.shape[-2:]
        if resize:
            size = naflex_size((h, w), p, n_max)
            if size != (h, w):
                img = F.interpolate(img[None], size=size, mode='bilinear', align_corners=False, antialias=True)[0]
        elif h % p or w % p:
            raise ValueError(f'images[{i}] is {h}x{w}, which patch_size={p} does not divide; '
                             f'use resize=True or crop it to a multiple of {p}')
        samples.append(patchify_image(img, (p, p), pad=False, include_info=True))

    counts = [s[0].shape[0] for s in samples]
    n = max(counts) if n_max is None else n_max
    if max(counts) > n:
        raise ValueError(f'max_tokens={n} is smaller than the largest image ({max(counts)} patches of {p}x{p}); '
                         f'raise max_tokens or use resize=True')
    B, dim = len(samples), samples[0][0].shape[1]
    patches = first.new_zeros(B, n, dim)
    coord = torch.zeros(B, n, 2, dtype=torch.int64, device=first.device)
    valid = torch.zeros(B, n, dtype=torch.bool, device=first.device)
    for b, (pt, co, va) in enumerate(samples):
        patches[b, :pt.shape[0]] = pt
        coord[b, :pt.shape[0]] = co
        valid[b, :pt.shape[0]] = va
    return {'patches': patches, 'patch_coord': coord, 'patch_valid': valid}


def naflex_positions(patch_coord: torch.Tensor, patch_valid: torch.Tensor, num_prefix: int = 0,
                     train_grid: Optional[Sequence[int]] = None) -> Positions:
    """The `Positions` of a NaFlex batch: each sample's grid read from its coordinates (the largest
    ``(row, col)`` of its real patches, plus one), padding from ``patch_valid``.

    The layout is checked (one host sync): every sample's real patches must be its whole grid in
    row-major order followed only by padding, as `naflex_batch` and timm's NaFlex collator make
    them; another layout (a truncated grid, shuffled or dropped patches) raises a ValueError.

    Args:
        patch_coord: ``(B, N, 2)`` integer ``(row, col)`` of each patch.
        patch_valid: ``(B, N)`` bool, True for real patches.
        num_prefix: prefix tokens (class, registers) before each sample's patches.
        train_grid: the grid the model was trained at (``normalized`` modes rescale to it).
    """
    if not torch.is_tensor(patch_coord) or patch_coord.dim() != 3 or patch_coord.shape[-1] != 2:
        raise ValueError(f'patch_coord must be a (B, N, 2) tensor of (row, col), got '
                         f'{tuple(patch_coord.shape) if torch.is_tensor(patch_coord) else type(patch_coord).__name__}')
    if not torch.is_tensor(patch_valid) or patch_valid.shape != patch_coord.shape[:2]:
        raise ValueError(f'patch_valid must be a (B, N) tensor like patch_coord {tuple(patch_coord.shape[:2])}, got '
                         f'{tuple(patch_valid.shape) if torch.is_tensor(patch_valid) else type(patch_valid).__name__}')
    valid = patch_valid.bool()
    coord = patch_coord.long().masked_fill(~valid[..., None], 0)
    B, N = valid.shape
    if B == 0:
        raise ValueError('a NaFlex batch needs at least one sample')
    counts, extent = valid.sum(1), coord.amax(1) + 1  # one transfer below for every sample's grid
    stats = torch.cat([counts[:, None], extent], 1).tolist()
    grids = []
    for b, (count, h, w) in enumerate(stats):
        if count == 0 or count != h * w:
            raise ValueError(f'sample {b} of the NaFlex batch has {count} real patches, which is not a whole grid '
                             f'(its coordinates reach {h}x{w}); every sample needs its whole grid')
        grids.append((h, w))
    pos = naflex_grid(grids, num_tokens=N, num_prefix=num_prefix, train_grid=train_grid, device=coord.device)
    if not (torch.equal(valid, ~pos.key_padding_mask) and torch.equal(coord, pos.coords.long())):
        raise ValueError('the NaFlex batch must hold each sample\'s patches in row-major order (coordinates '
                         '(0, 0), (0, 1), ...), followed only by padding, as vispe.naflex_batch and timm\'s '
                         'NaFlex collator make it')
    return pos


def embed_patches(patch_embed: nn.Module, patches: torch.Tensor) -> torch.Tensor:
    """A timm ``PatchEmbed`` applied to flattened patches ``(B, N, ph*pw*C)`` in ``(ph, pw, C)`` order:
    its convolution (kernel = stride = patch size) is a linear map of each patch, with the kernel
    reshaped to the same order, followed by the module's own norm. Equal to the convolution on the
    image, patch by patch."""
    proj = getattr(patch_embed, 'proj', None)
    if not isinstance(proj, nn.Conv2d) or proj.kernel_size != proj.stride or proj.padding != (0, 0) \
            or proj.dilation != (1, 1) or proj.groups != 1:
        raise ValueError(f'NaFlex batches need a patch embedding whose proj is a Conv2d with kernel = stride '
                         f'(timm\'s PatchEmbed), got {type(patch_embed).__name__} with proj {proj!r}')
    D, C, ph, pw = proj.weight.shape
    if patches.dim() != 3 or patches.shape[-1] != ph * pw * C:
        raise ValueError(f'patches must be (B, N, {ph * pw * C}) for {ph}x{pw} patches of {C} channels, got '
                         f'{tuple(patches.shape)}')
    weight = proj.weight.permute(0, 2, 3, 1).reshape(D, ph * pw * C)
    return patch_embed.norm(F.linear(patches, weight, proj.bias))
