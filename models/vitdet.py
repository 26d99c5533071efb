"""ViTDet: a plain timm ViT / Eva with any vispe encoding as a torchvision detection backbone.

ViTDet (Li, Mao, Girshick, He, "Exploring Plain Vision Transformer Backbones for Object Detection",
ECCV 2022, https://arxiv.org/abs/2203.16527) keeps the ViT plain and builds the multi-scale maps a
detector wants from its last stride-16 map only (the *simple feature pyramid*): two stride-2
deconvolutions to stride 4, one to stride 8, the map itself at stride 16, a 2x2 max pooling to
stride 32, each followed by a 1x1 and a 3x3 convolution with LayerNorm; a max pooling of the last
level adds stride 64 (detectron2's ``LastLevelMaxPool``). Inside the ViT most blocks attend within
non-overlapping 14x14 windows and a few, evenly spaced, globally (ViT-B: blocks 2, 5, 8, 11).

`ViTDetBackbone` is that backbone for torchvision's ``FasterRCNN``, ``MaskRCNN`` and ``RetinaNet``:
``out_channels`` and a forward returning an ``OrderedDict`` of maps ``'0'..'3'`` (strides 4, 8, 16,
32) and ``'pool'`` (stride 64), torchvision's FPN keys. The ViT is any name ``timm.create_model``
takes (timm's ViT / DeiT / Eva zoo, vispe's own ``vit_base`` ...), built with ``pe=`` and
``dynamic_img_size=True`` and loaded as the zoo loads (``pretrained_file``: a local timm checkpoint,
never a download); its class / register tokens and head are dropped, as ViTDet drops them.

Conventions:

* positions: every token keeps its position on the image's whole token grid, in window blocks too.
  The encoding is prepared once on the grid ``(h, w)`` (integer indices, the checkpoint's grid as
  training grid); window blocks get it prepared for the tokens of each window
  (`vispe.PreparedPE.select`), so a relative encoding sees the true offsets and a normalising one the
  whole image's grid.
* windows: a window never extends beyond the grid (it is clipped to the grid where the grid is
  smaller); where the grid is not a multiple of the window, the tokens are zero-padded to one and
  the padded keys are masked, so no image token sees padding (ViTDet attends to the zero padding).
  A window block runs its whole block on the windows (norm, attention, MLP, residual act per token,
  so this equals partitioning around the attention alone), except that stochastic depth then drops
  whole windows rather than whole images.
* input: ``(B, 3, H, W)`` with ``H`` and ``W`` multiples of the patch size (torchvision's transform
  pads each batch to ``size_divisible``; `vitdet_detector` sets it to twice the patch size).
"""
from __future__ import annotations

import collections.abc
from collections import OrderedDict
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple

import timm
import torch
import torch.nn.functional as F
from timm.layers import LayerNorm2d
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN, RetinaNet
from torchvision.models.detection.image_list import ImageList
from torchvision.models.detection.transform import GeneralizedRCNNTransform

import vispe
from vispe.registry import PESpec

__all__ = ['ViTDetBackbone', 'SimpleFeaturePyramid', 'vitdet_detector', 'ImageSizesTransform', 'KeepSizeTransform',
           'global_block_indices', 'window_partition', 'window_unpartition']

DETECTORS = ('faster_rcnn', 'mask_rcnn', 'retinanet')
IMAGE_SIZES_ATTR = 'vispe_image_sizes'  # where `ImageSizesTransform` leaves the sizes on the batch tensor


def global_block_indices(depth: int, num_global: int) -> List[int]:
    """ViTDet's global blocks: ``num_global`` evenly spaced, the last block last (depth 12, 4 global:
    2, 5, 8, 11; depth 24: 5, 11, 17, 23)."""
    if not 0 <= num_global <= depth:
        raise ValueError(f'num_global must be in 0..{depth} (the depth), got {num_global}')
    return [(i + 1) * depth // num_global - 1 for i in range(num_global)]


def window_partition(x: torch.Tensor, window: Tuple[int, int]) -> Tuple[torch.Tensor, Tuple[int, int]]:
    """``(B, H, W, ...)`` -> ``(B * nW, wh * ww, ...)``: non-overlapping windows in row-major order per
    image, the grid zero-padded at the bottom / right to a multiple of the window; also the padded size."""
    B, H, W = x.shape[:3]
    wh, ww = window
    ph, pw = -H % wh, -W % ww
    if ph or pw:
        pad = [0, 0] * (x.dim() - 3) + [0, pw, 0, ph]
        x = F.pad(x, pad)
    Hp, Wp = H + ph, W + pw
    x = x.reshape(B, Hp // wh, wh, Wp // ww, ww, *x.shape[3:]).transpose(2, 3)
    return x.reshape(B * (Hp // wh) * (Wp // ww), wh * ww, *x.shape[5:]), (Hp, Wp)


def window_unpartition(x: torch.Tensor, window: Tuple[int, int], padded: Tuple[int, int],
                       size: Tuple[int, int]) -> torch.Tensor:
    """The inverse of `window_partition`: ``(B * nW, wh * ww, C)`` -> ``(B, H * W, C)``, padding removed."""
    (wh, ww), (Hp, Wp), (H, W) = window, padded, size
    nh, nw = Hp // wh, Wp // ww
    x = x.reshape(x.shape[0] // (nh * nw), nh, nw, wh, ww, x.shape[-1]).transpose(2, 3).reshape(-1, Hp, Wp, x.shape[-1])
    return x[:, :H, :W].reshape(x.shape[0], H * W, x.shape[-1])


def _extent_mask(extents: Sequence[Tuple[int, int]], scale: float, like: torch.Tensor) -> torch.Tensor:
    """``(B, 1, H, W)`` mask (``like``'s dtype) that is 1 on each image's region ``int(h_b * scale) x
    int(w_b * scale)`` at the top left of ``like`` ``(B, C, H, W)``."""
    rows = torch.arange(like.shape[-2], device=like.device)
    cols = torch.arange(like.shape[-1], device=like.device)
    size = torch.tensor([[int(h * scale), int(w * scale)] for h, w in extents], device=like.device)
    inside = (rows[None, :, None] < size[:, 0, None, None]) & (cols[None, None, :] < size[:, 1, None, None])
    return inside[:, None].to(like.dtype)


class SimpleFeaturePyramid(nn.Module):
    """ViTDet's simple feature pyramid (Li et al. 2022, Sec. 3 and Fig. 2c): from one stride-16 map of
    width ``in_dim``, strides 4, 8, 16, 32 (deconvolutions 2x2/2 with LayerNorm and GELU between them,
    identity, max pooling 2x2/2), each projected by a 1x1 and a 3x3 convolution (no bias, each
    followed by a channel LayerNorm) to ``out_channels``; with ``top_block`` a stride-2 subsampling
    of the last level (detectron2's ``LastLevelMaxPool``) as ``'pool'``.

    Args:
        in_dim: width of the input map (the ViT's embedding width).
        out_channels: width of every output map.
        top_block: add the ``'pool'`` level (torchvision's FPN keys; its default anchors want 5 maps).
    """
    scale_factors = (4.0, 2.0, 1.0, 0.5)

    def __init__(self, in_dim: int, out_channels: int = 256, top_block: bool = True) -> None:
        super().__init__()
        self.top_block = top_block
        self.stages = nn.ModuleList()
        for scale in self.scale_factors:
            if scale == 4.0:
                layers: List[nn.Module] = [
                    nn.ConvTranspose2d(in_dim, in_dim // 2, 2, stride=2), LayerNorm2d(in_dim // 2), nn.GELU(),
                    nn.ConvTranspose2d(in_dim // 2, in_dim // 4, 2, stride=2)]
                width = in_dim // 4
            elif scale == 2.0:
                layers, width = [nn.ConvTranspose2d(in_dim, in_dim // 2, 2, stride=2)], in_dim // 2
            elif scale == 1.0:
                layers, width = [], in_dim
            else:
                layers, width = [nn.MaxPool2d(2, stride=2)], in_dim
            layers += [nn.Conv2d(width, out_channels, 1, bias=False), LayerNorm2d(out_channels),
                       nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False), LayerNorm2d(out_channels)]
            self.stages.append(nn.Sequential(*layers))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # detectron2's c2_xavier_fill, as ViTDet's pyramid convolutions
                nn.init.kaiming_uniform_(m.weight, a=1)

    def forward(self, x: torch.Tensor, extents: Optional[Sequence[Tuple[int, int]]] = None
                ) -> 'OrderedDict[str, torch.Tensor]':
        """``x`` ``(B, in_dim, h, w)`` at stride 16 -> ``{'0': stride 4, '1': 8, '2': 16, '3': 32[, 'pool': 64]}``.

        ``extents``: each image's ``(h_b, w_b)`` at the top left of a padded map; the rest of its map is
        zeroed before every 3x3 convolution (the only layer that mixes neighbouring positions, the
        pooling aside, which stays inside an even extent), so on its region each level equals the
        image's own maps alone: the zero padding a convolution sees at the image's border."""
        if extents is None:
            out = OrderedDict((str(i), stage(x)) for i, stage in enumerate(self.stages))
        else:
            out = OrderedDict()
            for i, (scale, stage) in enumerate(zip(self.scale_factors, self.stages)):
                y = x
                for layer in stage[:-2]:
                    y = layer(y)
                y = y * _extent_mask(extents, scale, y)
                out[str(i)] = stage[-1](stage[-2](y))
        if self.top_block:
            out['pool'] = F.max_pool2d(out['3'], kernel_size=1, stride=2)
        return out


def _build_trunk(model: str, pe: PESpec, pretrained_file: Optional[str],
                 kwargs: Dict[str, Any]) -> nn.Module:
    """The timm model ``model`` with encoding ``pe`` (None: its own), dynamic size, loaded from
    ``pretrained_file`` as the zoo loads, without head, final norm and prefix tokens."""
    for key in ('num_classes', 'global_pool', 'class_token', 'dynamic_img_size', 'pretrained_cfg_overlay'):
        if key in kwargs:
            raise ValueError(f'ViTDetBackbone sets {key} itself (the trunk has no head and takes any size); '
                             f'drop it from the model arguments')
    if kwargs.get('patch_drop_rate'):
        raise ValueError('ViTDetBackbone needs every token of the grid (patch_drop_rate must be 0)')
    load = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(pretrained_file))) if pretrained_file else {}
    args = dict(kwargs, num_classes=0, dynamic_img_size=True, **load)
    if pe is not None:
        args['pe'] = pe
    trunk = timm.create_model(model, **args)
    if not isinstance(getattr(trunk, 'pe', None), vispe.PositionalEncoding):  # pe=None on a zoo name: its own
        vispe.convert(trunk, vispe.timm_pe_spec(trunk), name=model)
    if getattr(trunk.patch_embed, 'tubelet', None) is not None:
        raise ValueError(f'{model}: a video model; ViTDetBackbone takes image models')
    # ViTDet's backbone ends at the last block: no final norm, no prefix tokens, no head; removing
    # them leaves no parameter without a gradient (DistributedDataParallel's requirement)
    for name in ('norm', 'fc_norm', 'head_drop', 'head'):
        if isinstance(getattr(trunk, name, None), nn.Module):
            setattr(trunk, name, nn.Identity())
    for name in ('cls_token', 'reg_token', 'dist_token', 'attn_pool'):
        if getattr(trunk, name, None) is not None:
            setattr(trunk, name, None)
    return trunk


class ViTDetBackbone(nn.Module):
    """A timm ViT / Eva with a vispe encoding, windowed as ViTDet, and its simple feature pyramid: a
    torchvision detection backbone (``out_channels``; forward ``(B, 3, H, W)`` -> ``OrderedDict`` of
    maps at strides 4, 8, 16, 32 and, with ``top_block``, 64, keyed ``'0'..'3'``, ``'pool'``).

    Args:
        model: a name ``timm.create_model`` takes (``'vit_base_patch16_224'``, ``'eva02_small_patch14_224'``,
            ``'vit_base'``, ...).
        pe: encoding spec (``'rope_mixed'``, ``'irpe+learned'``, ...); None: the model's own encoding
            (`vispe.timm_pe_spec`: a zoo model's learned table and / or rope).
        out_channels: width of the pyramid's maps.
        window_size: side of the attention windows in tokens (ViTDet: 14); None: every block global.
        global_blocks: indices of the blocks that attend globally (default: ``num_global`` evenly spaced).
        num_global: number of global blocks when ``global_blocks`` is not given (ViTDet: 4).
        top_block: add the stride-64 ``'pool'`` map.
        pretrained_file: a timm checkpoint of ``model`` (a ``.safetensors`` / ``.pth`` state dict) loaded
            by timm's loader and filters, as ``timm.create_model(..., pretrained_cfg_overlay=dict(file=...))``.
        model_kwargs: further arguments of the timm model (``depth``, ``embed_dim``, ``img_size`` (the
            training grid of the encoding), ``drop_path_rate``, ...).

    Raises:
        TypeError: ``global_blocks`` that is not a sequence of indices.
        ValueError: an unknown block index, a window size below 1, a video model, model arguments the
            backbone sets itself; in forward, an input that is not ``(B, 3, H, W)``, whose sides the patch
            size does not divide, or smaller than two patches per side (the stride-32 level pools 2 x 2
            tokens). An empty batch gives empty maps, as torchvision's backbones.
    """

    def __init__(self, model: str = 'vit_base_patch16_224', pe: PESpec = None, *, out_channels: int = 256,
                 window_size: Optional[int] = 14, global_blocks: Optional[Sequence[int]] = None, num_global: int = 4,
                 top_block: bool = True, pretrained_file: Optional[str] = None, **model_kwargs: Any) -> None:
        super().__init__()
        if window_size is not None and (isinstance(window_size, bool) or not isinstance(window_size, int)
                                        or window_size < 1):
            raise ValueError(f'window_size must be a positive integer (tokens) or None (all blocks global), '
                             f'got {window_size!r}')
        if not isinstance(out_channels, int) or out_channels < 1:
            raise ValueError(f'out_channels must be a positive integer, got {out_channels!r}')
        self.trunk = _build_trunk(model, pe, pretrained_file, model_kwargs)
        if global_blocks is not None and (isinstance(global_blocks, (str, bytes))
                                          or not isinstance(global_blocks, collections.abc.Iterable)):
            raise TypeError(f'global_blocks must be a sequence of block indices (ViT-B: [2, 5, 8, 11]) or None '
                            f'(num_global evenly spaced), got {global_blocks!r}')
        if isinstance(num_global, bool) or not isinstance(num_global, int) or num_global < 0:
            raise ValueError(f'num_global must be a non-negative integer (the number of global blocks), got '
                             f'{num_global!r}')
        depth = len(self.trunk.blocks)
        if global_blocks is None:
            global_blocks = global_block_indices(depth, min(num_global, depth)) if window_size else range(depth)
        global_blocks = list(global_blocks)
        bad = [i for i in global_blocks if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth]
        if bad:
            raise ValueError(f'global_blocks: {bad} are not block indices of the {depth}-block {model} (0..{depth - 1})')
        self.window_size = window_size
        self.global_blocks = frozenset(global_blocks) if window_size else frozenset(range(depth))
        self.patch_size = tuple(self.trunk.patch_embed.patch_size)
        self.embed_dim = self.trunk.embed_dim
        self.pyramid = SimpleFeaturePyramid(self.embed_dim, out_channels, top_block)
        self.out_channels = out_channels

    @property
    def pe(self) -> vispe.PositionalEncoding:
        """The trunk's encoding."""
        return self.trunk.pe

    def _check_input(self, x: torch.Tensor) -> Tuple[int, int]:
        if not torch.is_tensor(x) or x.dim() != 4:
            shape = tuple(x.shape) if torch.is_tensor(x) else type(x).__name__
            raise ValueError(f'ViTDetBackbone takes images (B, C, H, W), got {shape}')
        (h, w), (ph, pw) = x.shape[-2:], self.patch_size
        if h < 2 * ph or w < 2 * pw:  # the stride-32 level pools 2 x 2 tokens
            raise ValueError(f'input size {h}x{w} is smaller than the smallest ViTDetBackbone takes, two patches per '
                             f'side ({2 * ph}x{2 * pw}): the stride-32 level pools 2x2 tokens; pad images to a '
                             f'multiple of twice the patch size (torchvision detectors: size_divisible={2 * ph})')
        if h % ph or w % pw:
            raise ValueError(f'input size {h}x{w} is not divisible by the patch size {ph}x{pw}; pad images to a '
                             f'multiple of it (torchvision detectors: size_divisible={2 * ph})')
        return h // ph, w // pw

    def _token_extents(self, image_sizes: Optional[Sequence[Sequence[int]]], batch: int, grid: Tuple[int, int]
                       ) -> Optional[Tuple[Tuple[int, int], ...]]:
        """Each image's token grid ``(ceil(h / patch), ceil(w / patch))`` from its size in pixels; None
        when there are no sizes or every image fills the whole input."""
        if image_sizes is None:
            return None
        (ph, pw), canvas = self.patch_size, (grid[0] * self.patch_size[0], grid[1] * self.patch_size[1])
        sizes = list(image_sizes) if isinstance(image_sizes, collections.abc.Iterable) else None
        if sizes is None or len(sizes) != batch or not all(
                isinstance(hw, collections.abc.Sequence) and len(hw) == 2 and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in hw) for hw in sizes):
            raise ValueError(f'image_sizes must be one (h, w) of integer pixels per image of the batch ({batch}), '
                             f'got {image_sizes!r}')
        sizes = [(int(h), int(w)) for h, w in sizes]
        bad = [hw for hw in sizes if not (0 < hw[0] <= canvas[0] and 0 < hw[1] <= canvas[1])]
        if bad:
            raise ValueError(f'image_sizes {bad} do not fit the input {canvas[0]}x{canvas[1]} (each image at its top '
                             f'left, padded at the bottom and right)')
        extents = tuple((-(-h // ph), -(-w // pw)) for h, w in sizes)
        return None if all(e == grid for e in extents) else extents

    def _window_encoding(self, pe: vispe.PreparedPE, grid: Tuple[int, int], window: Tuple[int, int], batch: int,
                         packed: Optional[vispe.positions.PaddedGrid]
                         ) -> Tuple[vispe.PreparedPE, Optional[torch.Tensor]]:
        """The encoding prepared for the tokens of each window (their grid positions) and the mask of
        real keys ``(B * nW, 1, 1, wh * ww)`` (None when no window is padded). With ``packed`` (images of
        their own sizes in a padded batch, ``pe`` prepared on their own grids) a window's keys are the
        tokens of its image only."""
        device = pe.pos_q.coords.device
        index = torch.arange(grid[0] * grid[1], device=device).reshape(1, *grid)
        keep, _ = window_partition(index, window)  # padded slots index token 0: masked as keys, dropped as queries
        real, _ = window_partition(torch.ones(1, *grid, dtype=torch.bool, device=device), window)
        if packed is None:
            keep, real = keep.repeat(batch, 1), real.repeat(batch, 1)
            padded = not bool(real.all())
            pos = pe.pos_q.select(keep)
            if padded:
                pos = pos.replace(key_padding_mask=~real)
            return pe.encoding.prepare(pos), (real[:, None, None, :] if padded else None)
        num_windows, size = keep.shape
        # each window slot's token in the packed order of its image, then one row per (image, window)
        own = pe.pos_q.select(packed.inverse.gather(1, keep.reshape(1, -1).expand(batch, -1)))
        pad = own.key_padding_mask.reshape(batch * num_windows, size) | ~real.repeat(batch, 1)
        # a window outside its image holds padding only: its queries (dropped) attend to all its slots, so
        # that no softmax row is empty (NaN would reach the real tokens as masked values times 0)
        pad = pad & ~pad.all(1, keepdim=True)
        pos = own.replace(coords=own.coords.reshape(batch * num_windows, size, -1), key_padding_mask=pad,
                          selected_from=tuple(g for g in own.selected_from for _ in range(num_windows)))
        return pe.encoding.prepare(pos), ~pad[:, None, None, :]

    def forward_features(self, x: torch.Tensor, image_sizes: Optional[Sequence[Sequence[int]]] = None
                         ) -> torch.Tensor:
        """The last block's tokens as a map ``(B, C, H / patch, W / patch)`` (``image_sizes``: see `forward`)."""
        grid = self._check_input(x)
        return self._trunk(x, grid, self._token_extents(image_sizes, x.shape[0], grid))

    def _trunk(self, x: torch.Tensor, grid: Tuple[int, int], extents: Optional[Tuple[Tuple[int, int], ...]]
               ) -> torch.Tensor:
        if x.shape[0] == 0:  # no images: empty maps of the right shapes, as torchvision's backbones give
            return x.new_zeros(0, self.embed_dim, *grid)
        trunk = self.trunk
        tokens = trunk.patch_embed(x)  # (B, h, w, C): the trunk is built with dynamic_img_size
        B, C = tokens.shape[0], tokens.shape[-1]
        tokens = tokens.reshape(B, grid[0] * grid[1], C)
        pos = vispe.grid(*grid, train_grid=tuple(trunk.patch_embed.grid_size), device=x.device)
        packed, attn_mask = None, None
        if extents is not None:
            # each image on its own grid (the NaFlex layout: its tokens first, in its raster order), its
            # padding masked as keys everywhere; windows are cut from the canvas order
            pad = torch.ones(B, *grid, dtype=torch.bool, device=x.device)
            for b, (h, w) in enumerate(extents):
                pad[b, :h, :w] = False
            packed = vispe.positions.pack_padded_grid(pos.replace(key_padding_mask=pad.flatten(1)))
            pos, tokens = packed.positions, packed.pack(tokens)
            attn_mask = ~pos.key_padding_mask[:, None, None, :]
        pe = trunk.pe.prepare(pos)
        tokens = trunk.norm_pre(trunk.pos_drop(pe.embed(tokens)))
        windowed = None
        if len(self.global_blocks) < len(trunk.blocks):
            window = (min(self.window_size, grid[0]), min(self.window_size, grid[1]))
            windowed = (window, *self._window_encoding(pe, grid, window, B, packed))
        for i, block in enumerate(trunk.blocks):
            if i in self.global_blocks:
                tokens = block(tokens, pe=pe, attn_mask=attn_mask)
            else:
                window, window_pe, mask = windowed
                canvas = tokens if packed is None else packed.unpack(tokens)
                parts, padded = window_partition(canvas.reshape(B, *grid, C), window)
                canvas = window_unpartition(block(parts, pe=window_pe, attn_mask=mask), window, padded, grid)
                tokens = canvas if packed is None else packed.pack(canvas)
            tokens = pe.between_blocks(tokens, i)
        if packed is not None:
            tokens = packed.unpack(tokens)
        return tokens.transpose(1, 2).reshape(B, C, *grid)

    def forward(self, x: torch.Tensor, image_sizes: Optional[Sequence[Sequence[int]]] = None
                ) -> 'OrderedDict[str, torch.Tensor]':
        """Images ``(B, 3, H, W)`` -> the pyramid's maps (see the class docstring).

        ``image_sizes``: each image's ``(h, w)`` in pixels at the top left of a batch padded at the
        bottom and right (torchvision's ``ImageList.image_sizes``; default: the sizes `ImageSizesTransform`
        recorded on ``x``, else every image fills ``x``). Each image then runs on its own grid of
        ``ceil(h / patch) x ceil(w / patch)`` tokens (positions, windows, attention to its own tokens only)
        and on that region its maps equal those of the image alone cropped to whole patches."""
        if image_sizes is None:
            image_sizes = getattr(x, IMAGE_SIZES_ATTR, None)
        grid = self._check_input(x)
        extents = self._token_extents(image_sizes, x.shape[0], grid)
        return self.pyramid(self._trunk(x, grid, extents), extents)


class ImageSizesTransform(GeneralizedRCNNTransform):
    """torchvision's ``GeneralizedRCNNTransform`` that also tells a `ViTDetBackbone` each image's size.

    torchvision's detectors hand their backbone the padded batch tensor alone
    (``self.backbone(images.tensors)``); the sizes stay in the ``ImageList``. This transform records on
    that tensor (attribute ``vispe_image_sizes``, read by `ViTDetBackbone.forward`) the size each image
    is padded to when it is batched alone (its size rounded up to ``size_divisible``), so an image's
    positions, windows and attention are those it gets alone whatever it is batched with. Nothing of
    torchvision is changed: the detector instance gets this transform in place of its own.
    """

    @classmethod
    def replacing(cls, transform: GeneralizedRCNNTransform) -> 'ImageSizesTransform':
        """This transform with ``transform``'s settings (sizes, normalisation, ``size_divisible``)."""
        return cls(transform.min_size, transform.max_size, transform.image_mean, transform.image_std,
                   size_divisible=transform.size_divisible, fixed_size=transform.fixed_size,
                   _skip_resize=getattr(transform, '_skip_resize', False))

    def forward(self, images: List[torch.Tensor], targets: Optional[List[Dict[str, torch.Tensor]]] = None
                ) -> Tuple[ImageList, Optional[List[Dict[str, torch.Tensor]]]]:
        image_list, targets = super().forward(images, targets)
        d = self.size_divisible
        setattr(image_list.tensors, IMAGE_SIZES_ATTR,
                tuple((-(-h // d) * d, -(-w // d) * d) for h, w in image_list.image_sizes))
        return image_list, targets


class KeepSizeTransform(ImageSizesTransform):
    """torchvision's ``GeneralizedRCNNTransform`` without its resize: it normalises, and batches with
    padding to ``size_divisible``, images the data pipeline has already sized (e.g. DETR's multi-scale
    augmentation), so predictions come back in the input images' pixels. Like `ImageSizesTransform`,
    it tells the backbone each image's size."""

    def resize(self, image: torch.Tensor, target: Optional[Dict[str, torch.Tensor]] = None
               ) -> Tuple[torch.Tensor, Optional[Dict[str, torch.Tensor]]]:
        return image, target


def vitdet_detector(
        detector: Literal['faster_rcnn', 'mask_rcnn', 'retinanet'] = 'faster_rcnn',
        num_classes: int = 91,
        model: str = 'vit_base_patch16_224',
        pe: PESpec = None,
        out_channels: int = 256,
        window_size: Optional[int] = 14,
        num_global: int = 4,
        global_blocks: Optional[List[int]] = None,
        pretrained_file: Optional[str] = None,
        model_args: Optional[Dict[str, Any]] = None,
        keep_size: bool = False,
        min_size: int = 1024,
        max_size: int = 1024,
        detector_args: Optional[Dict[str, Any]] = None,
) -> nn.Module:
    """A torchvision detector on a `ViTDetBackbone`.

    Args:
        detector: ``'faster_rcnn'``, ``'mask_rcnn'`` or ``'retinanet'`` (torchvision's classes, their defaults).
        num_classes: classes including the background (torchvision's convention; COCO: 91).
        model: the timm name of the ViT.
        pe: encoding spec (None: the model's own).
        out_channels, window_size, num_global, global_blocks, pretrained_file: see `ViTDetBackbone`.
        model_args: further arguments of the timm model (``depth``, ``embed_dim``, ``img_size``,
            ``drop_path_rate``, ...).
        keep_size: keep each image's size (`KeepSizeTransform`) instead of torchvision's resize to
            ``min_size`` / ``max_size`` (ViTDet: 1024 on the longer side; its large-scale jitter is data
            augmentation).
        min_size, max_size: torchvision's resize targets (when ``keep_size`` is False).
        detector_args: further arguments of the torchvision detector (``box_detections_per_img``, ...).

    Raises:
        ValueError: an unknown ``detector``, and whatever `ViTDetBackbone` refuses.
    """
    classes = {'faster_rcnn': FasterRCNN, 'mask_rcnn': MaskRCNN, 'retinanet': RetinaNet}
    if detector not in classes:
        raise ValueError(f'detector must be one of {", ".join(map(repr, DETECTORS))}, got {detector!r}')
    backbone = ViTDetBackbone(model, pe, out_channels=out_channels, window_size=window_size, num_global=num_global,
                              global_blocks=global_blocks, pretrained_file=pretrained_file, **(model_args or {}))
    # images padded to twice the patch: whole tokens, and an even grid for the stride-32 level
    args = dict({'size_divisible': 2 * max(backbone.patch_size)}, **(detector_args or {}))
    net = classes[detector](backbone, num_classes=num_classes, min_size=min_size, max_size=max_size, **args)
    # each image's size reaches the backbone (positions and windows per image in a padded batch)
    net.transform = (KeepSizeTransform if keep_size else ImageSizesTransform).replacing(net.transform)
    return net
