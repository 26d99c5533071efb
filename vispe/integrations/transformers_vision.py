"""Give one transformers vision encoder instance any vispe positional encoding: `patch_vision`.

``patch_vision(model, 'liere')`` makes a transformers ViT / DeiT, DINOv2 (with registers too), DINOv3-ViT,
SigLIP, SigLIP 2 (NaFlex), CLIP, Idefics3 / SmolVLM, InternVL, Pixtral or Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision
encoder, or the VideoMAE or V-JEPA 2 video encoder, or a model that holds one (an image or video classifier, a whole
``SiglipModel`` / ``CLIPModel`` / ``VJEPA2Model`` / VLM: LLaVA, PaliGemma, Idefics3 / SmolVLM, InternVL, Mistral3,
Qwen-VL; its vision tower is found), position its image tokens with a vispe encoding.
On that instance only (transformers' classes, modules and registries stay untouched) it:

* registers the encoding as ``<tower>.vispe_pe`` (its parameters train and save with the model's
  ``state_dict``);
* replaces the bound ``forward`` of ``<tower>.embeddings``: the family's patch embedding, mask token and
  prefix tokens (class, distillation, register tokens) as transformers builds them, then the encoding's
  additive part (none for a rotary encoding) in place of the host's table, then the embeddings' dropout
  (Qwen-VL: of ``<tower>.patch_embed``, transformers' patch embedding then the additive part);
* replaces the bound ``forward`` of every self-attention of the tower: the layer's own ``q_proj`` /
  ``k_proj`` / ``v_proj`` projections (Qwen-VL: ``qkv``), `vispe.pe_attention` with the encoding's attention-side hooks (q/k
  rotations, logit biases, value / output maps) and the host's mask, scale and dropout, then its output
  projection;
* adds a forward pre-hook on the tower that builds this forward's positions from its inputs, prepares the
  encoding once and hands it to every attention, and forward hooks on the layers for encodings that act
  between blocks (PEG);
* makes a module whose output the patched attention no longer reads return an empty tuple (DINOv3's
  ``rope_embeddings``, the Qwen towers' ``rotary_pos_emb``), so it is not computed, and the module of a table
  the encoding replaces return zero (Qwen3-VL's ``pos_embed``).

`VisionPatch.remove` undoes everything: module types, attributes and ``state_dict`` are then those of the
unpatched model. The host's own position weights stay in the model (unused while patched); the handle's
``report`` (`vispe.weights.LoadReport`) says which of them the encoding took over (``pe=None`` and the
``learned`` encoding take the host's table), which were left unused (``dropped``) and which of the
encoding's entries were initialised.

The seam. The per-forward `vispe.PreparedPE` reaches the attentions through the call: transformers 5.x
threads the tower's ``**kwargs`` through its encoder and layers to every attention, and the tower's
pre-hook adds ``vispe_prepared=`` to them; the replaced attentions read it from their keyword arguments.
The embeddings are called without those keyword arguments (``self.embeddings(pixel_values, ...)``), so for
the additive step the prepared encoding is held on the handle for the length of one forward (pushed by the
tower's pre-hook, popped by a forward hook that runs also when the forward raises), never between forwards.
Idefics3's and SmolVLM's towers call their encoder without ``**kwargs`` (transformers 5.25): there the
attentions read the prepared encoding of the running forward from the handle the same way.

Positions. Image families: the grid ``(H / p, W / p)`` of the ``pixel_values`` of this forward (any size the
patch divides; the host needs ``interpolate_pos_encoding=True`` for another size, the patched model
resamples its table as that option does, whatever it is given), the prefix tokens first, the training grid
``image_size / p``. SigLIP 2: each image of the batch at its own grid ``spatial_shapes[b]``, its ``h * w``
real patches first and the rest padding (``pixel_attention_mask``), so an image padded in a batch gets
the output it gets alone (the patched attention masks the padded keys). Idefics3 / SmolVLM: images padded on
one canvas (``patch_attention_mask``, each a top-left rectangle of patches); the tokens run packed, each
image's patches first at its own grid (`vispe.positions.pack_padded_grid`), from the embeddings to the
tower's output, which comes back in canvas order. Qwen-VL towers: the images and video frames of ``grid_thw``
run as one sequence, each frame its own attention segment (``cu_seqlens``), its tokens in merge-block order
(and in Qwen2.5-VL in window order); every attention packs its q, k and v into a batch of the frames' own grids
(of the windows in a windowed block, each token at its position on its frame), attends, and unpacks into the
host's order (`vispe.integrations._vision_packed`), so every image packed with others gets its output alone.
The training grid of Qwen2-VL / Qwen2.5-VL, which have no table, is `QWEN_REFERENCE_GRID`.

The model's own encodings as vispe specs (``pe=None``; the patched model then gives the unpatched one's
outputs, float32, within 1e-6): ViT, DeiT, DINOv2, SigLIP and CLIP ``learned`` with
``interpolation='bicubic', antialias=False`` (transformers' ``interpolate_pos_encoding``); DINOv2 with
registers ``learned`` bicubic with ``antialias=True`` (its register tokens get no position: zero rows);
SigLIP 2 ``learned`` with ``interpolation='bilinear', antialias=True`` (``resize_positional_embeddings``);
Idefics3 / SmolVLM ``learned`` with ``resample='buckets'`` (NaViT's fractional-position buckets);
DINOv3-ViT ``rope_timm`` with ``rope_type='dinov3'`` and the config's ``rope_theta`` and coordinate
augmentations (computed in float32 also after ``.to(torch.bfloat16)``, where transformers' own
``inv_freq`` buffer is rounded); the Qwen-VL towers ``rope_timm`` with ``rope_type='cat'``, ``rotate_half=True``
(integer indices, row then column), Qwen3-VL with ``learned`` beside it (``interpolation='bilinear'``,
``align_corners=True``, ``resample='weights'``: `get_vision_interpolation_indices_and_weights`); Pixtral
``rope_timm`` with ``axis_bands='alternating'``; InternVL ``learned`` as ViT; VideoMAE ``sincos`` with
``flatten=True`` and ``pairing='interleaved'`` (its 1D table over the tubelet index, at the configured clip; the
flat index continues at other clips). V-JEPA 2's q/k map is no rotation (`VJEPA2HostRope`: its sines and cosines
are tiled while its channels are paired, so the two channels of a pair turn by different frequencies), hence no
vispe spec: its own encoding is that map, computed by vispe in float32 at the input's true ``(t, h, w)`` grid (the
host numbers its tokens on the configured grid, right only at the configured frame size); the rotation it means
is ``rope_axial:theta=10000,axis_order=yx``. The V-JEPA 2 predictor (pretraining) keeps its own map.

How to add a family. A family is one `VisionFamily` row of `FAMILIES`: the tower classes it covers, where
the layers and their attention are, the names of the attention's output projection, scale and dropout, the
prefix tokens and the patch embedding of its embeddings module, its table (if any) and the options of
its own encoding (or ``own_map``, the class of a map that no vispe spec states), one positions function
``(family, tower, args, kwargs) -> Positions`` (`image_positions`, `naflex_positions`, `canvas_positions`,
`video_positions`, `vjepa2_positions`; `varlen_positions` returns the `VarlenLayout` of a packed tower),
whether its tower passes ``**kwargs`` down, and its token layout (``'batch'``, ``'canvas'``, ``'varlen'``). A
tower whose attention projects q, k and v with ``q_proj`` / ``k_proj`` / ``v_proj`` (or one fused ``qkv``) and
is called with the layer's ``**kwargs`` needs nothing else; a tower whose attention's call differs needs a
hook of its own beside `VisionPatch._attention` and `VisionPatch._packed_attention`.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .._dtypes import at_least_float32
from ..attention import pe_attention
from ..contract import PEContext, PositionalEncoding, PreparedPE
from ..extras import SUPPORTED, require
from ..positions import PaddedGrid, Positions, grid, naflex_grid, pack_padded_grid
from ..registry import PESpec, create_pe
from ..weights import LoadReport
from ._vision_packed import VarlenLayout, varlen_layout
from .base import ModelPatch, UnsupportedModelError, refuse_patched

__all__ = ['patch_vision', 'VisionPatch', 'VisionFamily', 'FAMILIES', 'SUPPORTED_TOWERS', 'image_positions',
           'naflex_positions', 'canvas_positions', 'varlen_positions', 'pixtral_positions', 'own_spec',
           'QWEN_REFERENCE_GRID', 'VJEPA2HostRope']

_logger = logging.getLogger(__name__)

Tensor = torch.Tensor
SUPPORTED_TRANSFORMERS = SUPPORTED['transformers']
PREPARED_KWARG = 'vispe_prepared'
"""The keyword argument by which the prepared encoding travels from the tower's call to its attentions."""
LAYOUT_KWARG = 'vispe_layout'
"""The keyword argument by which a packed tower's running forward (its layouts and, for windows, their
prepared encoding) travels with the prepared encoding."""


def _pair(value: Any) -> Tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (tuple, list)) else (int(value), int(value))


def _argument(args: Sequence[Any], kwargs: Dict[str, Any], index: int, name: str) -> Any:
    """A call's argument ``name``, given by keyword or at position ``index``; None when absent."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


# ----------------------------------------------------------------------------------------- positions per forward
def image_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                    ) -> Positions:
    """The positions of an image tower's forward: the grid of ``pixel_values`` ``(B, C, H, W)``, prefix first.

    Raises:
        ValueError: no ``pixel_values``, another layout, or a size the patch does not divide.
    """
    pixels = _argument(args, kwargs, 0, 'pixel_values')
    if not torch.is_tensor(pixels) or pixels.dim() != 4:
        shape = tuple(pixels.shape) if torch.is_tensor(pixels) else type(pixels).__name__
        raise ValueError(f'patch_vision ({family.label}): pixel_values must be a (B, C, H, W) tensor, got {shape}')
    ph, pw = _pair(tower.config.patch_size)
    h, w = pixels.shape[-2:]
    if h % ph or w % pw:
        raise ValueError(f'patch_vision ({family.label}): input size {h}x{w} is not divisible by the patch size '
                         f'{ph}x{pw}; use a size that is a multiple of {ph}x{pw} (the unpatched model would crop '
                         f'the remainder)')
    return grid(h // ph, w // pw, num_prefix=family.num_prefix(tower.config), train_grid=family.native_grid(tower.config),
                device=pixels.device)


def naflex_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                     ) -> Positions:
    """The positions of a SigLIP 2 forward: image ``b`` at its own grid ``spatial_shapes[b]``, its ``h * w``
    real patches first, the rest of the ``max_num_patches`` padding (``pixel_attention_mask`` 0).

    Raises:
        ValueError: missing ``spatial_shapes`` / ``pixel_attention_mask``, or a mask that is not the
            first ``h * w`` patches of each image.
    """
    pixels = _argument(args, kwargs, 0, 'pixel_values')
    real = _argument(args, kwargs, 1, 'pixel_attention_mask')
    shapes = _argument(args, kwargs, 2, 'spatial_shapes')
    if not torch.is_tensor(pixels) or pixels.dim() != 3:
        raise ValueError(f'patch_vision ({family.label}): pixel_values must be patches (B, max_num_patches, C*p*p)')
    if not torch.is_tensor(shapes) or shapes.shape != (pixels.shape[0], 2):
        raise ValueError(f'patch_vision ({family.label}): spatial_shapes must be a (B, 2) tensor of each image\'s '
                         f'(rows, columns) of patches')
    grids = tuple((int(h), int(w)) for h, w in shapes.tolist())
    n = pixels.shape[1]
    if any(h < 1 or w < 1 or h * w > n for h, w in grids):
        raise ValueError(f'patch_vision ({family.label}): spatial_shapes {list(grids)} must be positive and hold '
                         f'at most max_num_patches={n} patches each')
    pos = naflex_grid(grids, num_tokens=n, train_grid=family.native_grid(tower.config), device=pixels.device)
    if real is not None:
        if tuple(real.shape) != (pixels.shape[0], n) or not torch.equal(real.bool(), ~pos.key_padding_mask):
            raise ValueError(f'patch_vision ({family.label}): pixel_attention_mask must be 1 on the first h*w '
                             f'patches of each image (spatial_shapes) and 0 on the rest, the layout of '
                             f'transformers\' SigLIP 2 processor')
    return pos


def canvas_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                     ) -> Positions:
    """The positions of an Idefics3 / SmolVLM tower's forward: the canvas grid of ``pixel_values`` with each
    image's real patches (``patch_attention_mask`` ``(B, h, w)``, True on real patches, a top-left rectangle)
    and the rest padding; the handle packs the tokens so that each image is at its own grid.

    Raises:
        ValueError: a size the patch does not divide, or a mask of another shape.
    """
    pos = image_positions(family, tower, args, kwargs)
    real = _argument(args, kwargs, 1, 'patch_attention_mask')
    if real is None:
        return pos
    batch = _argument(args, kwargs, 0, 'pixel_values').shape[0]
    if not torch.is_tensor(real) or tuple(real.shape) != (batch, *pos.grid):
        raise ValueError(f'patch_vision ({family.label}): patch_attention_mask must be (B, {pos.grid[0]}, '
                         f'{pos.grid[1]}) for these pixel_values, got '
                         f'{tuple(real.shape) if torch.is_tensor(real) else type(real).__name__}')
    return pos.replace(key_padding_mask=~real.bool().flatten(1))


def _frame_bounds(grids: Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """``cu_seqlens`` of frames as segments (`transformers.vision_utils.get_vision_cu_seqlens`' default)."""
    lengths = torch.tensor([h * w for t, h, w in grids for _ in range(t)], device=device)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)


def varlen_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                     ) -> VarlenLayout:
    """The layout of a Qwen-VL tower's forward: the images and video frames of ``grid_thw`` ``(K, 3)`` packed
    along ``hidden_states`` ``(N, C * t * p * p)``, each frame its own segment at its own grid, tokens in
    merge-block order (and, for Qwen2.5-VL, in its window order), as `vispe.integrations._vision_packed`
    lays them out.

    Raises:
        ValueError: ``grid_thw`` not ``(K, 3)`` positive integers, a grid the spatial merge does not divide,
            ``hidden_states`` of another length than the grids, or precomputed ``cu_seqlens`` /
            ``position_ids`` of another layout.
    """
    from transformers import vision_utils
    config = tower.config
    pixels = _argument(args, kwargs, 0, 'hidden_states')
    thw = _argument(args, kwargs, 1, 'grid_thw')
    merge = int(config.spatial_merge_size)
    if not torch.is_tensor(thw) or thw.dim() != 2 or thw.shape[-1] != 3 or thw.is_floating_point():
        got = f'{tuple(thw.shape)} {thw.dtype}' if torch.is_tensor(thw) else type(thw).__name__
        raise ValueError(f'patch_vision ({family.label}): grid_thw must be a (num_images, 3) integer tensor of '
                         f'(frames, rows, columns) of patches, got {got}')
    grids = thw.tolist()
    bad = [g for g in grids if min(g) < 1 or g[1] % merge or g[2] % merge]
    if bad:
        raise ValueError(f'patch_vision ({family.label}): grid_thw rows {bad} must be positive with rows and '
                         f'columns divisible by spatial_merge_size={merge}')
    total = sum(t * h * w for t, h, w in grids)
    if not torch.is_tensor(pixels) or pixels.dim() != 2 or pixels.shape[0] != total:
        got = tuple(pixels.shape) if torch.is_tensor(pixels) else type(pixels).__name__
        raise ValueError(f'patch_vision ({family.label}): hidden_states must be the ({total}, C * t * p * p) '
                         f'patches of grid_thw {grids}, got {got}')
    given = kwargs.get('cu_seqlens')
    if given is not None and not torch.equal(given.cpu().long(), _frame_bounds(grids, torch.device('cpu')).long()):
        raise ValueError(f'patch_vision ({family.label}): precomputed cu_seqlens must make each frame of grid_thw '
                         f'a segment (transformers\' default); the patched tower attends within frames')
    ids = kwargs.get('position_ids')
    if ids is not None and not torch.equal(ids.cpu(), vision_utils.get_vision_position_ids(thw.cpu(), merge)):
        raise ValueError(f'patch_vision ({family.label}): precomputed position_ids must be those of grid_thw in '
                         f'merge-block order (transformers\' get_vision_position_ids); the patched tower builds '
                         f'its positions from grid_thw')
    window_index = window_bounds = None
    if family.windows:
        window_index, window_bounds = vision_utils.get_vision_window_index(
            thw, merge, config.window_size, config.patch_size, kwargs=dict(kwargs))
    return varlen_layout(thw, merge, family.native_grid(config), window_index=window_index,
                         window_bounds=window_bounds)


def pixtral_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                      ) -> VarlenLayout:
    """The layout of a Pixtral tower's forward: image ``b`` the top-left ``image_sizes[b]`` of its
    ``pixel_values`` ``(B, C, H, W)`` (all of it without ``image_sizes``), its patches in raster order, the
    images one after the other along one sequence, each its own attention segment.

    Raises:
        ValueError: pixel_values not ``(B, C, H, W)``, ``image_sizes`` not one ``(height, width)`` per image
            within the canvas, or a size the patch does not divide.
    """
    pixels = _argument(args, kwargs, 0, 'pixel_values')
    sizes = _argument(args, kwargs, 1, 'image_sizes')
    if not torch.is_tensor(pixels) or pixels.dim() != 4:
        shape = tuple(pixels.shape) if torch.is_tensor(pixels) else type(pixels).__name__
        raise ValueError(f'patch_vision ({family.label}): pixel_values must be a (B, C, H, W) tensor, got {shape}')
    batch, canvas = pixels.shape[0], tuple(pixels.shape[-2:])
    sizes = [canvas] * batch if sizes is None else [tuple(int(v) for v in s) for s in
                                                     (sizes.tolist() if torch.is_tensor(sizes) else sizes)]
    p = int(tower.config.patch_size)
    if len(sizes) != batch or any(len(s) != 2 or not (0 < s[0] <= canvas[0] and 0 < s[1] <= canvas[1]) for s in sizes):
        raise ValueError(f'patch_vision ({family.label}): image_sizes must give each of the {batch} images its '
                         f'(height, width) within the {canvas[0]}x{canvas[1]} pixel_values, got {sizes}')
    bad = [s for s in sizes if s[0] % p or s[1] % p]
    if bad:
        raise ValueError(f'patch_vision ({family.label}): image sizes {bad} are not divisible by the patch size '
                         f'{p}x{p}; use sizes that are multiples of {p} (the unpatched model would crop the remainder)')
    thw = torch.tensor([(1, h // p, w // p) for h, w in sizes], device=pixels.device)
    return varlen_layout(thw, 1, family.native_grid(tower.config))


def _tubelet_grid(family: 'VisionFamily', pixels: Tensor, frames: int, tubelet: Tuple[int, int, int],
                  train_grid: Tuple[int, int, int]) -> Positions:
    """The grid ``(frames / tubelet, H / p, W / p)`` of the video ``pixels`` ``(B, T, C, H, W)`` whose tubelets
    span ``frames`` frames (``T``, or the frames the host makes of a shorter clip).

    Raises:
        ValueError: a size the tubelet does not divide.
    """
    size = (frames, *pixels.shape[-2:])
    if any(n % t for n, t in zip(size, tubelet)):
        raise ValueError(f'patch_vision ({family.label}): {size[0]} frames of {size[1]}x{size[2]} are not divisible '
                         f'by the tubelet {tubelet[0]}x{tubelet[1]}x{tubelet[2]} (frames x height x width); use '
                         f'multiples of it')
    return grid(*(n // t for n, t in zip(size, tubelet)), train_grid=train_grid, device=pixels.device)


def _video_pixels(family: 'VisionFamily', args: Sequence[Any], kwargs: Dict[str, Any], name: str) -> Tensor:
    """The video argument ``name`` of a tower's call, ``(B, T, C, H, W)``; else a ValueError naming it."""
    pixels = _argument(args, kwargs, 0, name)
    if not torch.is_tensor(pixels) or pixels.dim() != 5:
        shape = tuple(pixels.shape) if torch.is_tensor(pixels) else type(pixels).__name__
        raise ValueError(f'patch_vision ({family.label}): {name} must be a (B, frames, C, H, W) tensor, got {shape}')
    return pixels


def video_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                    ) -> Positions:
    """The positions of a VideoMAE forward: the grid ``(T / tubelet, H / p, W / p)`` of ``pixel_values``
    ``(B, T, C, H, W)``, the configured clip as training grid.

    Raises:
        ValueError: pixel_values of another layout, or a size the tubelet does not divide.
    """
    pixels = _video_pixels(family, args, kwargs, 'pixel_values')
    config = tower.config
    return _tubelet_grid(family, pixels, pixels.shape[1],
                         (int(config.tubelet_size), *_pair(config.patch_size)), family.native_grid(config))


def vjepa2_positions(family: 'VisionFamily', tower: nn.Module, args: Sequence[Any], kwargs: Dict[str, Any]
                     ) -> Positions:
    """The positions of a V-JEPA 2 encoder's forward: the true grid ``(T / tubelet, H / p, W / p)`` of
    ``pixel_values_videos`` ``(B, T, C, H, W)`` at any size the tubelet divides (the host reads its positions
    from the configured grid instead, right only at the configured size), the configured clip as training
    grid. A clip shorter than the tubelet is repeated ``tubelet`` times by the host (an image: one tubelet).

    Raises:
        ValueError: pixel_values_videos of another layout, or a size the tubelet does not divide.
    """
    pixels = _video_pixels(family, args, kwargs, 'pixel_values_videos')
    config = tower.config
    tubelet = int(config.tubelet_size)
    frames = pixels.shape[1] * (tubelet if pixels.shape[1] < tubelet else 1)
    return _tubelet_grid(family, pixels, frames,
                         (tubelet, int(config.patch_size), int(config.patch_size)), family.native_grid(config))


def _kept_tokens(family: 'VisionFamily', masked: Any, num_tokens: int) -> Tensor:
    """``(B, K)`` indices of the tokens ``bool_masked_pos`` keeps, in order (as the host gathers them)."""
    if not torch.is_tensor(masked) or masked.dim() != 2 or masked.shape[1] != num_tokens:
        shape = tuple(masked.shape) if torch.is_tensor(masked) else type(masked).__name__
        raise ValueError(f'patch_vision ({family.label}): bool_masked_pos must be (B, {num_tokens}), True on the '
                         f'masked tokens, got {shape}')
    kept = ~masked.bool()
    counts = kept.sum(1)
    if bool((counts != counts[0]).any()):
        raise ValueError(f'patch_vision ({family.label}): bool_masked_pos must mask as many tokens in every sample '
                         f'(the host stacks the kept ones), got {counts.tolist()} kept')
    return kept.nonzero()[:, 1].view(masked.shape[0], -1)


def _native_video_grid(config: Any) -> Tuple[int, int, int]:
    (h, w), (ph, pw) = _pair(config.image_size), _pair(config.patch_size)
    return int(config.num_frames) // int(config.tubelet_size), h // ph, w // pw


# ----------------------------------------------------------------------------------------- the family table
def _native_image_grid(config: Any) -> Tuple[int, int]:
    (h, w), (ph, pw) = _pair(config.image_size), _pair(config.patch_size)
    return h // ph, w // pw


def _native_patch_grid(config: Any) -> Tuple[int, int]:
    side = math.isqrt(config.num_patches)
    return side, side


@dataclass(frozen=True)
class VisionFamily:
    """What differs between the supported vision towers: a row of `FAMILIES`.

    Attributes:
        label: the family's name in messages and docs.
        towers: class names of the tower (the module holding ``embeddings`` and the layers).
        layers: dotted path from the tower to its list of layers.
        attention: the attention module's attribute on a layer.
        out_proj, scale, dropout: the attention's output projection (None: the host applies it after the
            module), logit scale and dropout attributes.
        prefix: the embeddings' prefix-token parameters, in sequence order (``register_tokens`` counts
            ``config.num_register_tokens`` tokens, the others one each).
        patch: the embeddings' patch-embedding module (a conv whose output is flattened, or a linear map
            of already-patchified pixels); None where the patch replaces no embeddings forward of its own
            (``'varlen'``: the embeddings module runs as transformers defines it).
        table: dotted path from the tower to the learned position table (a ``(1, N, C)`` parameter or an
            ``nn.Embedding``), None without one; ``table_prefix``: its rows for prefix tokens.
        own: the options of the model's own encoding (``'learned'``'s resampling), or a function of the
            config giving its spec.
        positions: ``(family, tower, args, kwargs) -> Positions`` for one forward of the tower.
        native_grid: ``config -> (h, w)``, the training grid.
        unused: tower submodules whose output the patched attention no longer reads (made to return an empty
            tuple, which a host that iterates over it takes too).
        threads_kwargs: the tower's forward passes its ``**kwargs`` down to the attentions (transformers'
            rule); False (Idefics3, SmolVLM call their encoder without them): the attentions read the
            prepared encoding of the running forward from the handle.
        layout: how the tower's tokens lie: ``'batch'`` (``(B, N, C)``, one grid or NaFlex grids per
            image), ``'canvas'`` (images padded on a shared canvas, ``patch_attention_mask``: the tokens run
            packed, each image's grid first, `vispe.positions.pack_padded_grid`, from the embeddings to the
            tower's output, which is put back in canvas order; the attentions mask the padded keys
            themselves) or ``'varlen'`` (one sequence ``(N, C)`` of images and frames attended in segments,
            ``cu_seqlens``: each attention packs its q, k, v into a batch of the frames' own grids,
            `vispe.integrations._vision_packed`, and unpacks its output into the host's order).
        embeddings: the module whose forward the patch replaces to add the encoding's additive part: an
            embeddings module holding ``prefix`` and ``patch`` (``'batch'``, ``'canvas'``), or the patch
            embedding itself, run as transformers defines it (``'varlen'``).
        qkv: the attention's fused q/k/v projection (Qwen-VL's ``qkv``), None for ``q_proj`` / ``k_proj`` /
            ``v_proj``.
        width, heads: the config's attribute names of the tower's width and number of heads.
        windows: the tower attends in windows (Qwen2.5-VL, `transformers.vision_utils.get_vision_window_index`)
            except in the blocks of ``config.fullatt_block_indexes``.
        zeroed: tower submodules computing the host's table, made to return zero (the encoding adds its own).
        returns_weights: the attention returns ``(output, weights)`` (transformers' rule; Qwen-VL's returns
            the output alone).
        qk_norm: the attention's q and k norms over the projections' whole width (InternVL), None without.
        out_dropout: the attention's dropout after its output projection, None without.
        projections: the attention's q, k and v projections (without a fused ``qkv``); ``head_dim``: its
            attribute holding the head width.
        embeddings_forward: the handle's method that replaces the embeddings' forward (``'_embeddings'``,
            ``'_packed_embeddings'``, ``'_tubelet_embeddings'``).
        drops_masked: ``bool_masked_pos`` drops the masked tokens (VideoMAE's pretraining): the attentions get
            the encoding prepared for the kept tokens (`vispe.PreparedPE.select`), the embeddings the whole grid.
        own_map: ``(ctx, **options) -> encoding``, the model's own map where no vispe spec states it (V-JEPA 2's
            q/k map, which is no rotation: `VJEPA2HostRope`); built for ``pe=None`` in place of ``own``'s spec.
    """
    label: str
    towers: Tuple[str, ...]
    layers: str
    attention: str
    out_proj: Optional[str]
    scale: str
    dropout: str
    prefix: Tuple[str, ...]
    patch: Optional[str]
    table: Optional[str]
    table_prefix: int
    own: Any
    positions: Callable[..., Positions] = image_positions
    native_grid: Callable[[Any], Tuple[int, int]] = _native_image_grid
    unused: Tuple[str, ...] = ()
    threads_kwargs: bool = True
    layout: str = 'batch'
    embeddings: str = 'embeddings'
    qkv: Optional[str] = None
    width: str = 'hidden_size'
    heads: str = 'num_attention_heads'
    windows: bool = False
    zeroed: Tuple[str, ...] = ()
    returns_weights: bool = True
    qk_norm: Optional[Tuple[str, str]] = None
    out_dropout: Optional[str] = None
    projections: Tuple[str, str, str] = ('q_proj', 'k_proj', 'v_proj')
    head_dim: str = 'head_dim'
    embeddings_forward: str = '_embeddings'
    drops_masked: bool = False
    own_map: Optional[Callable[..., PositionalEncoding]] = None

    def num_prefix(self, config: Any) -> int:
        return sum(int(config.num_register_tokens) if p == 'register_tokens' else 1 for p in self.prefix)


def _dinov3_spec(config: Any) -> Dict[str, Any]:
    """DINOv3-ViT's rope (``DINOv3ViTRopePositionEmbedding``) as ``rope_timm``: patch-centre coordinates in
    ``[-1, 1]`` per axis, periods ``rope_theta^(4k / hd)``, rotate-half pairs, (row, column) halves, its
    training-time shift / jitter / rescale augmentations."""
    spec: Dict[str, Any] = dict(name='rope_timm', rope_type='dinov3', temperature=float(config.rope_theta),
                                grid_indexing='ij', rotate_half=True, normalize_coords='separate')
    for ours, theirs in (('shift_coords', 'pos_embed_shift'), ('jitter_coords', 'pos_embed_jitter'),
                         ('rescale_coords', 'pos_embed_rescale')):
        if getattr(config, theirs, None) is not None:
            spec[ours] = float(getattr(config, theirs))
    return spec


def _qwen_rope_spec(config: Any) -> Dict[str, Any]:
    """The Qwen-VL towers' 2D rope (``Qwen2VLVisionRotaryEmbedding``, the same in Qwen2.5-VL and Qwen3-VL) as
    ``rope_timm``: integer (row, column) patch indices, ``hd / 4`` frequencies ``rope_theta^(-4k / hd)`` per
    axis, the row's first, rotate-half pairs ``(j, j + hd / 2)`` (angles computed in float32)."""
    return dict(name='rope_timm', rope_type='cat', temperature=float(config.rope_parameters['rope_theta']),
                grid_indexing='ij', rotate_half=True)


def _qwen3_spec(config: Any) -> List[Dict[str, Any]]:
    """Qwen3-VL's tower: its rope (`_qwen_rope_spec`) and its learned square table, resampled to each frame's
    grid with bilinear taps and aligned corners (`transformers.vision_utils.get_vision_interpolation_indices_and_weights`),
    as one weight matrix (``learned``'s ``resample='weights'``)."""
    return [_qwen_rope_spec(config), dict(name='learned', interpolation='bilinear', antialias=False,
                                          align_corners=True, resample='weights')]


def _native_table_grid(config: Any) -> Tuple[int, int]:
    side = math.isqrt(config.num_position_embeddings)
    return side, side


def _internvl_spec(config: Any) -> PESpec:
    """InternVL's vision table, resampled as ViT's (bicubic, no antialias); ``'none'`` for a tower built without
    one (``use_absolute_position_embeddings=False``)."""
    return dict(name='learned', **_BICUBIC) if config.use_absolute_position_embeddings else 'none'


def _videomae_spec(config: Any) -> Dict[str, Any]:
    """VideoMAE's ``get_sinusoid_encoding_table`` as ``sincos``: the Transformer's 1D table (interleaved sines
    and cosines, ``10000^(-2k / C)``) over each tubelet's row-major index."""
    return dict(name='sincos', flatten=True, pairing='interleaved')


class VJEPA2HostRope(PositionalEncoding):
    """V-JEPA 2's own q/k map (transformers' ``VJEPA2RopeAttention.apply_rotary_embeddings``, the original
    code's ``rotate_queries_or_keys``), computed by vispe on the true ``(t, h, w)`` grid of the input: the
    model's own encoding (``pe=None``) of `patch_vision`'s V-JEPA 2 family, and no registered encoding,
    because it is no rotation.

    Each axis (frame, row, column, in that order) owns ``d = 2 * floor(hd / 6)`` channels of a head; the
    channels after ``3 d`` pass through. Within an axis' group, with ``w_j = theta^(-j / (d / 2))`` and the
    integer position ``p`` on that axis, channel ``c`` gets the angle ``a_c = p * w_(c mod d/2)`` (the
    sines and cosines of the ``d / 2`` frequencies tiled twice, ``repeat``), and the channels are paired
    ``(2j, 2j + 1)``::

        out[2j]     = x[2j]     cos(a_2j)     - x[2j + 1] sin(a_2j)
        out[2j + 1] = x[2j + 1] cos(a_2j+1)   + x[2j]     sin(a_2j+1)

    The two channels of a pair turn by different angles (pair ``j`` takes frequencies ``2j`` and
    ``2j + 1`` modulo ``d / 2``), so the map is not orthogonal: it changes the norm of q and k, and a logit
    changes when every position is shifted by the same offset (``shift_invariant = False``). The rotation it
    means, one frequency ``w_j`` for pair ``j`` of each axis' group, is vispe's
    ``rope_axial:theta=10000,axis_order=yx``. Angles and tables are float32 whatever the model's dtype
    (the host computes its frequencies in the activations' dtype).

    Args:
        theta: frequency base (10000 in V-JEPA 2).
    """
    name = 'vjepa2_host_rope'
    shift_invariant = False
    larger_input = 'extrapolate'
    paper = ('Assran et al. 2025, V-JEPA 2, arXiv:2506.09985; transformers\' VJEPA2RopeAttention '
             '(models/vjepa2/modeling_vjepa2.py, rotate_queries_or_keys)')
    float32_buffers = frozenset({'omega'})
    omega: Tensor

    def __init__(self, ctx: PEContext, *, theta: float = 10000.0) -> None:
        super().__init__(ctx)
        if not theta > 0:
            raise ValueError(f'option theta of encoding {self.name!r} must be > 0, got {theta}')
        self.theta = float(theta)
        self.axis_width = 2 * ((ctx.head_dim // 3) // 2)
        if self.axis_width == 0:
            raise ValueError(f'encoding {self.name!r} needs head_dim >= 6 (two channels per axis), '
                             f'got head_dim={ctx.head_dim}')
        # in the host's order of operations, so that the float32 frequencies are the host's bit for bit
        half = self.axis_width // 2
        omega = torch.arange(half, dtype=torch.float32)
        omega /= half
        self.register_buffer('omega', 1.0 / self.theta ** omega, persistent=False)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> Tuple[Tensor, Tensor]:
        if pos_k is not None and not pos_k.same_as(pos_q):
            raise ValueError(f'encoding {self.name!r} maps self-attention only (one set of positions)')
        coords = pos_q.coords
        if coords.shape[-1] != 3:
            raise ValueError(f'encoding {self.name!r} takes (t, h, w) video positions, got {coords.shape[-1]} axes')
        # (..., N, 3, d/2) angles; each axis' d/2 sines and cosines tiled twice over its d channels
        angles = at_least_float32(coords).unsqueeze(-1) * self.omega
        cos, sin = (torch.cat([t, t], -1).flatten(-2) for t in (angles.cos(), angles.sin()))
        if pos_q.num_prefix:  # prefix tokens pass through
            pad = (0, 0, pos_q.num_prefix, 0)
            cos, sin = nn.functional.pad(cos, pad, value=1.0), nn.functional.pad(sin, pad)
        if cos.dim() == 3:  # per sample: broadcast over heads
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def qk(self, q, k, state, layer, x=None):
        cos, sin = state
        return _vjepa2_map(q, cos, sin), _vjepa2_map(k, cos, sin)


def _vjepa2_map(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`VJEPA2HostRope`'s map of q or k ``(B, H, N, hd)`` with its tables ``(..., N, 3 d)``, in float32 (float64
    kept); the channels after ``3 d`` pass through."""
    width = cos.shape[-1]
    head = at_least_float32(x[..., :width])
    pairs = head.unflatten(-1, (-1, 2))
    turned = torch.stack((-pairs[..., 1], pairs[..., 0]), -1).flatten(-2)
    out = (head * cos) + (turned * sin)  # the host's order of operations
    return torch.cat([out.to(x.dtype), x[..., width:]], -1)


def _native_vjepa2_grid(config: Any) -> Tuple[int, int, int]:
    side = int(config.crop_size) // int(config.patch_size)
    return int(config.frames_per_clip) // int(config.tubelet_size), side, side


def _pixtral_spec(config: Any) -> Dict[str, Any]:
    """Pixtral's rope (``PixtralVisionRotaryEmbedding``) as ``rope_timm``: integer (row, column) patch indices,
    the row on the even and the column on the odd entries of ``rope_theta^(-2j / hd)``, rotate-half pairs."""
    return dict(name='rope_timm', rope_type='cat', temperature=float(config.rope_parameters['rope_theta']),
                grid_indexing='ij', rotate_half=True, axis_bands='alternating')


QWEN_REFERENCE_GRID = (16, 16)
"""The training grid given to encodings in Qwen2-VL and Qwen2.5-VL towers, which have no table of their own
(a ``learned`` table's size; what ``normalized`` coordinates rescale to): 224 pixels at patch 14."""


def _qwen_reference_grid(config: Any) -> Tuple[int, int]:
    return QWEN_REFERENCE_GRID


_BICUBIC = dict(interpolation='bicubic', antialias=False)  # transformers' interpolate_pos_encoding
FAMILIES: Tuple[VisionFamily, ...] = (
    VisionFamily('ViT', ('ViTModel',), 'layers', 'attention', 'o_proj', 'scaling', 'attention_dropout',
                 ('cls_token',), 'patch_embeddings', 'embeddings.position_embeddings', 1, _BICUBIC),
    VisionFamily('DeiT', ('DeiTModel',), 'layers', 'attention', 'o_proj', 'scaling', 'attention_dropout',
                 ('cls_token', 'distillation_token'), 'patch_embeddings', 'embeddings.position_embeddings', 2,
                 _BICUBIC),
    VisionFamily('DINOv2', ('Dinov2Model',), 'encoder.layer', 'attention', 'o_proj', 'scaling',
                 'attention_dropout', ('cls_token',), 'patch_embeddings', 'embeddings.position_embeddings', 1,
                 _BICUBIC),
    # its registers join after the table is added: they get zero rows
    VisionFamily('DINOv2 with registers', ('Dinov2WithRegistersModel',), 'encoder.layer', 'attention', 'o_proj',
                 'scaling', 'attention_dropout', ('cls_token', 'register_tokens'), 'patch_embeddings',
                 'embeddings.position_embeddings', 1, dict(interpolation='bicubic', antialias=True, init_std=0.0)),
    VisionFamily('SigLIP', ('SiglipVisionModel',), 'encoder.layers', 'self_attn', 'out_proj', 'scale', 'dropout',
                 (), 'patch_embedding', 'embeddings.position_embedding', 0, _BICUBIC),
    VisionFamily('CLIP', ('CLIPVisionModel',), 'encoder.layers', 'self_attn', 'out_proj', 'scale', 'dropout',
                 ('class_embedding',), 'patch_embedding', 'embeddings.position_embedding', 1, _BICUBIC),
    VisionFamily('SigLIP 2', ('Siglip2VisionModel',), 'encoder.layers', 'self_attn', 'out_proj', 'scale', 'dropout',
                 (), 'patch_embedding', 'embeddings.position_embedding', 0,
                 dict(interpolation='bilinear', antialias=True, resample='weights'), naflex_positions, _native_patch_grid),
    # NaViT buckets over a padded canvas; the tower calls its encoder without **kwargs
    VisionFamily('Idefics3 / SmolVLM vision', ('Idefics3VisionTransformer', 'SmolVLMVisionTransformer'),
                 'encoder.layers', 'self_attn', 'out_proj', 'scale', 'dropout', (), 'patch_embedding',
                 'embeddings.position_embedding', 0, dict(resample='buckets'), canvas_positions,
                 threads_kwargs=False, layout='canvas'),
    VisionFamily('DINOv3-ViT', ('DINOv3ViTModel',), 'model.layer', 'attention', 'o_proj', 'scaling', 'dropout',
                 ('cls_token', 'register_tokens'), 'patch_embeddings', None, 0, _dinov3_spec,
                 unused=('rope_embeddings',)),
    # one sequence of images and frames attended in segments (cu_seqlens), merge-block token order, fused qkv
    VisionFamily('Qwen2-VL vision', ('Qwen2VisionTransformerPretrainedModel',), 'blocks', 'attn', 'proj', 'scaling',
                 'attention_dropout', (), None, None, 0, _qwen_rope_spec, varlen_positions,
                 _qwen_reference_grid, unused=('rotary_pos_emb',), layout='varlen', embeddings='patch_embed',
                 embeddings_forward='_packed_embeddings', qkv='qkv',
                 width='embed_dim', heads='num_heads', returns_weights=False),
    VisionFamily('Qwen2.5-VL vision', ('Qwen2_5_VisionTransformerPretrainedModel',), 'blocks', 'attn', 'proj',
                 'scaling', 'attention_dropout', (), None, None, 0, _qwen_rope_spec, varlen_positions,
                 _qwen_reference_grid, unused=('rotary_pos_emb',), layout='varlen', embeddings='patch_embed',
                 embeddings_forward='_packed_embeddings', qkv='qkv',
                 heads='num_heads', windows=True, returns_weights=False),
    # q/k norms over the whole width, a dropout after the output projection; its encoder takes no **kwargs
    VisionFamily('InternVL vision', ('InternVLVisionModel',), 'encoder.layer', 'attention', 'projection_layer', 'scale',
                 'attention_dropout', ('cls_token',), 'patch_embeddings', 'embeddings.position_embeddings', 1,
                 _internvl_spec, threads_kwargs=False, qk_norm=('q_norm', 'k_norm'), out_dropout='projection_dropout'),
    # its own 2D rope; images of their own sizes along one sequence, a block-diagonal mask
    VisionFamily('Pixtral vision', ('PixtralVisionModel',), 'transformer.layers', 'attention', 'o_proj', 'scaling',
                 'dropout', (), None, None, 0, _pixtral_spec, pixtral_positions, unused=('patch_positional_embedding',),
                 layout='varlen', embeddings='ln_pre', embeddings_forward='_packed_embeddings'),
    # tubelets of a video; a fixed 1D sin-cos table over the token index; masked tokens dropped in pretraining
    VisionFamily('VideoMAE', ('VideoMAEModel',), 'encoder.layer', 'attention.attention', None, 'scaling',
                 'dropout_prob', (), 'patch_embeddings', None, 0, _videomae_spec, video_positions,
                 _native_video_grid, threads_kwargs=False, projections=('query', 'key', 'value'),
                 head_dim='attention_head_size', embeddings_forward='_tubelet_embeddings', drops_masked=True),
    # tubelets of a video; its own q/k map (no rotation, `VJEPA2HostRope`) at the input's true grid; the
    # layers call their attention without **kwargs
    VisionFamily('V-JEPA 2', ('VJEPA2Encoder',), 'layer', 'attention', 'proj', 'scaling', 'dropout_prob', (),
                 'patch_embeddings', None, 0, None, vjepa2_positions, _native_vjepa2_grid, threads_kwargs=False,
                 projections=('query', 'key', 'value'), head_dim='attention_head_size',
                 embeddings_forward='_video_embeddings', own_map=VJEPA2HostRope),
    # the rope and a learned table, resampled by bilinear taps with aligned corners; deepstack mergers
    VisionFamily('Qwen3-VL vision', ('Qwen3VLVisionModel', 'Qwen3VLMoeVisionModel'), 'blocks', 'attn', 'proj',
                 'scaling', 'attention_dropout', (), None, 'pos_embed', 0, _qwen3_spec, varlen_positions,
                 _native_table_grid, unused=('rotary_pos_emb',), layout='varlen', embeddings='patch_embed',
                 embeddings_forward='_packed_embeddings', qkv='qkv',
                 heads='num_heads', zeroed=('pos_embed',), returns_weights=False),
)
SUPPORTED_TOWERS = tuple(t for f in FAMILIES for t in f.towers)
_BY_TOWER = {t: f for f in FAMILIES for t in f.towers}


def own_spec(family: VisionFamily, config: Any) -> Optional[PESpec]:
    """The vispe spec of a tower's own encoding (``pe=None``); None where no spec states it (``own_map``)."""
    if family.own_map is not None:
        return None
    if callable(family.own):
        return family.own(config)
    return dict(name='learned', **family.own)


def _path(root: nn.Module, dotted: str) -> Any:
    for name in dotted.split('.'):
        root = getattr(root, name)
    return root


def _is_transformers(module: nn.Module) -> bool:
    return type(module).__module__.startswith('transformers.')


def find_tower(model: nn.Module) -> Tuple[nn.Module, str, VisionFamily]:
    """The one supported vision tower in ``model`` (the model itself or a submodule): (tower, its name, family).

    Raises:
        UnsupportedModelError: no supported tower, or several (patch the one you mean).
    """
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ in _BY_TOWER and _is_transformers(m)]
    if not found:
        raise UnsupportedModelError(
            f'patch_vision supports transformers vision encoders {", ".join(SUPPORTED_TOWERS)} and models holding '
            f'one (their image classifiers, SiglipModel, CLIPModel, ...); got {type(model).__name__}, which holds none')
    if len(found) > 1:
        names = ', '.join(repr(n) or 'the model' for n, _ in found)
        raise UnsupportedModelError(f'patch_vision: {type(model).__name__} holds several vision towers ({names}); '
                                    f'patch the one you mean')
    name, tower = found[0]
    return tower, name, _BY_TOWER[type(tower).__name__]


def _check_layout(tower: nn.Module, family: VisionFamily) -> List[nn.Module]:
    """The tower's layers, after checking that they have what the patch uses (else the error names it)."""
    why = f'not the transformers >= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]} {family.label} layout'
    try:
        layers = list(_path(tower, family.layers))
        embeddings = _path(tower, family.embeddings)
        for name in family.unused + family.zeroed:
            _path(tower, name)
    except AttributeError as e:
        raise UnsupportedModelError(f'patch_vision: {type(tower).__name__} has no {e.name!r}: {why}') from None
    for name in family.prefix + ((family.patch,) if family.patch else ()):
        if not hasattr(embeddings, name):
            raise UnsupportedModelError(f'patch_vision: {type(embeddings).__name__} has no {name!r}: {why}')
    projections = ((family.qkv,) if family.qkv else family.projections) + tuple(family.qk_norm or ()) + (
        (family.out_dropout,) if family.out_dropout else ()) + ((family.out_proj,) if family.out_proj else ())
    for i, layer in enumerate(layers):
        try:
            attn = _path(layer, family.attention)
        except AttributeError:
            attn = None
        missing = [a for a in projections + (family.head_dim, family.scale, family.dropout)
                   if not hasattr(attn, a)]
        if missing:
            raise UnsupportedModelError(f'patch_vision: layer {i} of {type(tower).__name__} has no '
                                        f'{family.attention}.{missing[0]}: {why}')
    return layers


# ----------------------------------------------------------------------------------------- the handle
@dataclass
class _Forward:
    """One running forward: the prepared encoding and, for a padded canvas, its packed layout; for a packed
    tower (``'varlen'``) its layouts and the encoding prepared for its windows (None without windows or
    without attention hooks); where masked tokens are dropped, the encoding prepared for the whole grid, which
    the embeddings take (``prepared`` is then for the kept tokens)."""
    prepared: PreparedPE
    packed: Optional[PaddedGrid] = None
    layout: Optional[VarlenLayout] = None
    windows: Optional[PreparedPE] = None
    embedded: Optional[PreparedPE] = None


class VisionPatch(ModelPatch):
    """What `patch_vision` did to one model instance; ``remove()`` (or leaving a ``with`` block) undoes it.

    Attributes:
        tower: the patched vision encoder; ``tower_name``: its name in the model (``''``: the model itself).
        family: the `VisionFamily`; ``encoding``: the vispe encoding (also ``<tower>.vispe_pe``).
        spec: the encoding's spec (``pe=None`` resolved to the model's own, `own_spec`).
        report: what the encoding took from the host's position weights (`vispe.weights.LoadReport`).
        replaced: ``(owner, attribute)`` of everything replaced or hooked, for the record.
    """
    adapter = 'patch_vision'

    def __init__(self, model: nn.Module, tower: nn.Module, tower_name: str, family: VisionFamily,
                 encoding: PositionalEncoding, spec: PESpec, report: LoadReport) -> None:
        super().__init__(model)
        self.tower, self.tower_name, self.family, self.encoding = tower, tower_name, family, encoding
        self.spec, self.report = spec, report
        self._full_layers = frozenset(getattr(tower.config, 'fullatt_block_indexes', None) or ())
        self._forwards: List[_Forward] = []  # the forward running, for the embeddings (and unthreaded attentions)
        # gradient checkpointing in a tower that does not pass its keyword arguments down: each checkpointed
        # layer's forward, kept until the next forward begins, for its recomputation in backward (transformers
        # checkpoints the layer's forward, inside its hooks, after the tower's forward has ended)
        self._checkpointed: Dict[int, _Forward] = {}

    # ------------------------------------------------------------------ one forward
    def _begin(self, tower: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
               ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The tower's forward pre-hook: this forward's positions, the encoding prepared once for them and
        added to the call's keyword arguments, which transformers threads to every attention."""
        self._checkpointed = {}
        pos = self.family.positions(self.family, tower, args, kwargs)
        if isinstance(pos, VarlenLayout):  # a packed tower: the frames' positions, and its windows' if any
            windows = pos.windows
            prepared = self.encoding.prepare(pos.frames.positions)
            in_windows = (self.encoding.prepare(windows.positions)
                          if windows is not None and self.encoding.capabilities.in_attention else None)
            current = _Forward(prepared, layout=pos, windows=in_windows)
            self._forwards.append(current)
            return args, {**kwargs, PREPARED_KWARG: prepared, LAYOUT_KWARG: current}
        packed = pack_padded_grid(pos) if self.family.layout == 'canvas' and pos.key_padding_mask is not None else None
        prepared = self.encoding.prepare(packed.positions if packed is not None else pos)
        masked = _argument(args, kwargs, 1, 'bool_masked_pos') if self.family.drops_masked else None
        if masked is not None:  # the attentions see the kept tokens, the embeddings the whole grid
            kept = _kept_tokens(self.family, masked, pos.coords.shape[-2])
            current = _Forward(prepared.select(kept), embedded=prepared)
        else:
            current = _Forward(prepared, packed)
        self._forwards.append(current)
        return args, {**kwargs, PREPARED_KWARG: current.prepared}

    def _layer_begin(self, index: int, layer: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Forward pre-hook of layer ``index`` of a tower that does not thread keyword arguments: a checkpointed
        layer keeps this forward for the recomputation of its attentions in backward."""
        if self._forwards and getattr(layer, 'gradient_checkpointing', False) and torch.is_grad_enabled():
            self._checkpointed[index] = self._forwards[-1]

    def _end(self, tower: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> Any:
        """The tower's forward hook (also when the forward raises): packed tokens back in canvas order;
        nothing of this forward stays."""
        packed = self._forwards.pop().packed if self._forwards else None
        if packed is None or output is None:
            return None
        output.last_hidden_state = packed.unpack(output.last_hidden_state)
        if getattr(output, 'hidden_states', None) is not None:
            output.hidden_states = tuple(packed.unpack(h) for h in output.hidden_states)
        return output

    def _current(self) -> _Forward:
        if not self._forwards:
            raise RuntimeError(f'patch_vision: the patched embeddings of {self.family.label} run inside the patched '
                               f"tower's forward, which prepares the encoding; call the tower (or the model)")
        return self._forwards[-1]

    def _prepared(self, kwargs: Dict[str, Any], what: str, layer: Optional[int] = None) -> PreparedPE:
        """The prepared encoding of this forward: from the call's keyword arguments, or, for a family whose
        tower does not pass them down, from the running forward (or, recomputed by gradient checkpointing in
        backward, the forward that layer ``layer`` kept)."""
        prepared = kwargs.get(PREPARED_KWARG)
        if prepared is not None:
            return prepared
        if not self.family.threads_kwargs:
            if self._forwards:
                return self._forwards[-1].prepared
            if layer in self._checkpointed:
                return self._checkpointed[layer].prepared
        raise RuntimeError(f'patch_vision: {what} of the patched {self.family.label} was called without '
                           f'{PREPARED_KWARG}=: it runs inside the patched tower\'s forward, which prepares the '
                           f'encoding and passes it down with the layers\' keyword arguments')

    def _embeddings(self, embeddings: nn.Module, pixel_values: Tensor, *args: Any,
                    bool_masked_pos: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        """The forward of ``<tower>.embeddings``: patch embedding, mask token, prefix tokens (as transformers
        builds them), the encoding's additive part, dropout."""
        patch = getattr(embeddings, self.family.patch)
        weight = getattr(patch, 'weight', None)
        x = patch(pixel_values.to(weight.dtype) if weight is not None else pixel_values)
        if x.dim() == 4:  # a conv's (B, C, h, w)
            x = x.flatten(2).transpose(1, 2)
        if bool_masked_pos is not None:
            x = torch.where(bool_masked_pos.unsqueeze(-1), embeddings.mask_token.reshape(1, 1, -1).to(x.dtype), x)
        current = self._current()
        if current.packed is not None:  # each image's patches first, in the layout of its positions
            x = current.packed.pack(x)
        b = x.shape[0]
        prefix = [getattr(embeddings, p).reshape(1, -1, x.shape[-1]).to(x.dtype).expand(b, -1, -1)
                  for p in self.family.prefix]
        if prefix:
            x = torch.cat(prefix + [x], dim=1)
        x = current.prepared.embed(x)
        dropout = getattr(embeddings, 'dropout', None)
        return dropout(x) if isinstance(dropout, nn.Module) else x

    def _tubelet_embeddings(self, embeddings: nn.Module, pixel_values: Tensor,
                            bool_masked_pos: Optional[Tensor] = None, *args: Any, **kwargs: Any) -> Tensor:
        """The forward of a video tower's embeddings (VideoMAE): the tubelet projection of ``(B, T, C, H, W)``
        pixels as transformers defines it (at any size the tubelet divides: its own forward refuses all but
        the configured one), the encoding's additive part in place of the host's table, then the masked
        tokens dropped."""
        patch = getattr(embeddings, self.family.patch)
        x = patch.projection(pixel_values.permute(0, 2, 1, 3, 4).to(patch.projection.weight.dtype))
        x = x.flatten(2).transpose(1, 2)
        current = self._current()
        x = (current.embedded or current.prepared).embed(x)
        if bool_masked_pos is not None:
            x = x[~bool_masked_pos].reshape(x.shape[0], -1, x.shape[-1])
        return x

    def _video_embeddings(self, embeddings: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        """The forward of a video tower's embeddings that hold no table (V-JEPA 2): transformers' own (its
        tubelet projection), then the encoding's additive part."""
        x = type(embeddings).forward(embeddings, *args, **kwargs)
        return self._current().prepared.embed(x)

    def _attention(self, module: nn.Module, layer: int, hidden_states: Tensor, attention_mask: Optional[Tensor] = None,
                   *args: Any, **kwargs: Any) -> Tuple[Tensor, None]:
        """The forward of one self-attention ``module`` of the tower (its q/k/v projections, `vispe.pe_attention`
        with the prepared encoding from the call's keyword arguments, its output projection)."""
        prepared = self._prepared(kwargs, f'attention {layer}', layer)
        b, n, _ = hidden_states.shape
        fam = self.family
        if fam.layout == 'canvas':  # the host's mask is in canvas order; the tokens run packed
            attention_mask = None
        q, k, v = (getattr(module, proj)(hidden_states) for proj in fam.projections)
        if fam.qk_norm:  # over the whole width, before the heads are split (InternVL)
            q, k = getattr(module, fam.qk_norm[0])(q), getattr(module, fam.qk_norm[1])(k)
        head_dim = getattr(module, fam.head_dim)
        q, k, v = (t.view(b, n, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        o = pe_attention(q, k, v, prepared, layer, x=hidden_states, attn_mask=_mask(attention_mask, prepared),
                         scale=getattr(module, fam.scale),
                         dropout_p=getattr(module, fam.dropout) if module.training else 0.0)
        o = o.transpose(1, 2).reshape(b, n, -1)
        if fam.out_proj:  # else the host applies it after this module (VideoMAE)
            o = getattr(module, fam.out_proj)(o)
        return (getattr(module, fam.out_dropout)(o) if fam.out_dropout else o), None

    def _running(self, kwargs: Dict[str, Any], what: str) -> _Forward:
        """The running forward of a packed tower, from the call's keyword arguments."""
        current = kwargs.get(LAYOUT_KWARG)
        if current is None:
            raise RuntimeError(f'patch_vision: {what} of the patched {self.family.label} was called without '
                               f'{LAYOUT_KWARG}=: it runs inside the patched tower\'s forward, which lays out its '
                               f'packed images and passes them down with the layers\' keyword arguments')
        return current

    def _packed_embeddings(self, module: nn.Module, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        """The forward of a packed tower's patch embedding: transformers' own, then the encoding's additive
        part on the frames' batch."""
        x = type(module).forward(module, hidden_states, *args, **kwargs)
        if not self.encoding.capabilities.additive:
            return x
        current = self._current()
        frames = current.layout.frames
        return frames.unpack(current.prepared.embed(frames.pack(x.flatten(0, -2)))).view_as(x)

    def _packed_attention(self, module: nn.Module, layer: int, hidden_states: Tensor, *args: Any,
                          **kwargs: Any) -> Any:
        """The forward of one attention of a packed tower (Qwen-VL, Pixtral): its q/k/v projections, q, k and v
        packed into the batch of its segments (frames, or windows in a windowed block), `vispe.pe_attention`
        with the encoding prepared for them and a mask of the padded keys, the output unpacked into the
        host's order, its output projection. The host's segments (``cu_seqlens``, a block-diagonal mask)
        and rotary tables are not read: the layout of this forward gives the same segments."""
        prepared: Optional[PreparedPE] = self._prepared(kwargs, f'attention {layer}', layer)
        current = self._running(kwargs, f'attention {layer}')
        fam = self.family
        packing = current.layout.frames
        if current.layout.windows is not None and layer not in self._full_layers:
            packing, prepared = current.layout.windows, current.windows
        x = hidden_states.flatten(0, -2)  # (N, C): Qwen-VL's sequence, Pixtral's batch of one
        if fam.qkv:
            tokens = packing.pack(getattr(module, fam.qkv)(x))  # (S, n, 3C)
            s, n, _ = tokens.shape
            q, k, v = tokens.view(s, n, 3, -1, getattr(module, fam.head_dim)).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (packing.pack(getattr(module, proj)(x)) for proj in fam.projections)
            s, n, _ = q.shape
            q, k, v = (t.view(s, n, -1, getattr(module, fam.head_dim)).transpose(1, 2) for t in (q, k, v))
        needs_x = prepared is not None and prepared.capabilities.needs_tokens
        pad = packing.positions.key_padding_mask
        o = pe_attention(q, k, v, prepared, layer, x=packing.pack(x) if needs_x else None,
                         attn_mask=None if pad is None else ~pad[:, None, None, :],
                         scale=getattr(module, fam.scale),
                         dropout_p=getattr(module, fam.dropout) if module.training else 0.0)
        o = getattr(module, fam.out_proj)(packing.unpack(o.transpose(1, 2).reshape(s, n, -1))).view_as(hidden_states)
        return (o, None) if fam.returns_weights else o

    def _between_blocks(self, index: int, layer: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                        output: Any) -> Any:
        """A layer's forward hook: the encoding's between-blocks map (PEG) after block ``index``."""
        prepared = self._prepared(kwargs, f'layer {index}')
        if self.family.layout == 'varlen':  # on the frames' batch
            frames = self._running(kwargs, f'layer {index}').layout.frames
            return frames.unpack(prepared.between_blocks(frames.pack(output.flatten(0, -2)), index)).view_as(output)
        if isinstance(output, tuple):
            return (prepared.between_blocks(output[0], index),) + output[1:]
        return prepared.between_blocks(output, index)

    def _skipped(self, *args: Any, **kwargs: Any) -> Tuple[()]:
        """The forward of a module whose output the patched attention no longer reads: an empty tuple (Qwen2.5-VL
        iterates over its rotary tables before the blocks)."""
        return ()

    def _zero(self, module: nn.Module, *args: Any, **kwargs: Any) -> Tensor:
        """The forward of a host's table module whose rows the encoding replaces: a zero scalar, which the host's
        weighted sum and addition carry through exactly."""
        return next(module.parameters()).new_zeros(())

    # ------------------------------------------------------------------ install / remove
    def _install(self, layers: List[nn.Module]) -> None:
        tower, fam, caps = self.tower, self.family, self.encoding.capabilities
        partial = functools.partial  # forwards and hooks: the handle's methods, never closures (copies, pickles)
        self.set(tower, 'vispe_pe', self.encoding)
        self.add_hook(tower, self._begin, 'forward_pre', with_kwargs=True)
        self.add_hook(tower, self._end, with_kwargs=True, always_call=True)
        packed = fam.layout == 'varlen'
        embeddings = _path(tower, fam.embeddings)
        forward = getattr(self, fam.embeddings_forward)
        self.set(embeddings, 'forward', partial(forward, embeddings), fam.embeddings)
        for name in fam.unused:
            self.set(_path(tower, name), 'forward', self._skipped, name)
        for name in fam.zeroed:
            zeroed = _path(tower, name)
            self.set(zeroed, 'forward', partial(self._zero, zeroed), name)
        attention = self._packed_attention if packed else self._attention
        for i, layer in enumerate(layers):
            attn = _path(layer, fam.attention)
            self.set(attn, 'forward', partial(attention, attn, i), f'{fam.layers}.{i}.{fam.attention}')
            if caps.between_blocks:
                self.add_hook(layer, partial(self._between_blocks, i), with_kwargs=True, label=f'{fam.layers}.{i}')
            if not fam.threads_kwargs:
                self.add_hook(layer, partial(self._layer_begin, i), 'forward_pre', with_kwargs=True,
                              label=f'{fam.layers}.{i}')
        self.activate()

    def remove(self) -> None:
        """Restore the instance: the original modules and attributes, no hooks, no ``vispe_pe``."""
        super().remove()
        self._forwards, self._checkpointed = [], {}

    def __repr__(self) -> str:
        return (f'VisionPatch({type(self.model).__name__}, family={self.family.label!r}, '
                f'encoding={self.encoding.name!r}, active={self._active}, replaced={len(self.replaced)})')


def _mask(attention_mask: Any, prepared: PreparedPE) -> Optional[Tensor]:
    """The attention mask: the host's (a 4D bool or additive mask, as transformers builds it), else the padded
    keys of this forward's positions (True = attend), else None."""
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 4:
        return attention_mask
    pad = prepared.keys.key_padding_mask
    if pad is None:
        return None
    npre = prepared.keys.num_prefix
    if npre:
        pad = torch.cat([pad.new_zeros(pad.shape[0], npre), pad], 1)
    return ~pad[:, None, None, :]


# ----------------------------------------------------------------------------------------- weights
def _host_table(tower: nn.Module, family: VisionFamily) -> Optional[Tensor]:
    """The host's learned table as timm's ``(1, prefix + N, C)``, or None."""
    if family.table is None:
        return None
    table = _path(tower, family.table)
    if table is None:  # a tower built without its table (InternVL's use_absolute_position_embeddings=False)
        return None
    table = table.weight if isinstance(table, nn.Embedding) else table
    return table.detach().reshape(1, -1, table.shape[-1])


def _adopt(encoding: PositionalEncoding, tower: nn.Module, family: VisionFamily, grid_size: Tuple[int, int]
           ) -> LoadReport:
    """Hand the host's table to the encoding (``adopt_pos_embed``) and report what was taken."""
    table = _host_table(tower, family)
    taken: Dict[str, Tensor] = {}
    resampled: List[str] = []
    if table is not None:
        taken, resampled = encoding.adopt_pos_embed(table.float(), family.table_prefix, grid_size)
        if taken:
            with torch.no_grad():
                _, unexpected = encoding.load_state_dict(taken, strict=False)
            if unexpected:
                raise ValueError(f'patch_vision: the encoding has no entries {unexpected} that it adopted')
    dropped = [family.table] if table is not None and not taken else []
    initialized = sorted(f'vispe_pe.{k}' for k in encoding.state_dict() if k not in taken)
    return LoadReport(dropped=dropped, initialized=initialized, resampled=[f'vispe_pe.{k}' for k in resampled])


# ----------------------------------------------------------------------------------------- entry point
def patch_vision(model: nn.Module, pe: Optional[PESpec] = None, **options: Any) -> VisionPatch:
    """Make the vision tower of one transformers model instance use a vispe encoding; returns the `VisionPatch`.

    Args:
        model: a transformers vision encoder (``ViTModel``, ``DeiTModel``, ``Dinov2Model``,
            ``Dinov2WithRegistersModel``, ``DINOv3ViTModel``, ``SiglipVisionModel``, ``Siglip2VisionModel``,
            ``CLIPVisionModel``, ``Idefics3VisionTransformer``, ``SmolVLMVisionTransformer``, ``InternVLVisionModel``,
            ``PixtralVisionModel``, the vision towers of Qwen2-VL, Qwen2.5-VL and Qwen3-VL, ``VideoMAEModel``,
            V-JEPA 2's ``VJEPA2Encoder``) or a model holding exactly one (``ViTForImageClassification``,
            ``SiglipModel``, ``CLIPModel``, ``Idefics3Model``, ``LlavaForConditionalGeneration``,
            ``PaliGemmaForConditionalGeneration``, ``InternVLModel``, ``Qwen2VLForConditionalGeneration``,
            ``VJEPA2Model``, ``VJEPA2ForVideoClassification``, ...).
        pe: any vispe encoding spec (``'rope_mixed'``, ``'liere'``, ``'irpe+learned'``, ...); None: the
            model's own encoding, computed by vispe (module docstring); ``'none'``: no encoding (NoPE).
        options: options of the encoding (override the spec's).

    Raises:
        vispe.integrations.UnsupportedModelError: no supported tower in ``model``, several, or a layout
            this transformers version does not have (a TypeError).
        vispe.extras.UnsupportedVersionError: unsupported transformers version (an ImportError).
        vispe.integrations.AlreadyPatchedError: the model, a module inside it or a model holding it is
            already patched (a RuntimeError).
        ValueError: an encoding the tower cannot take (one that needs cameras), naming it.
    """
    require('transformers', 'patch_vision')
    tower, tower_name, family = find_tower(model)
    refuse_patched(model, 'patch_vision')
    layers = _check_layout(tower, family)
    config = tower.config
    if pe is None:
        pe = own_spec(family, config)  # None still where the family's own map is no vispe spec (V-JEPA 2)
    first = _path(layers[0], family.attention) if layers else None
    heads, width = int(getattr(config, family.heads)), int(getattr(config, family.width))
    head_dim = getattr(first, family.head_dim) if first is not None else width // heads
    grid_size = family.native_grid(config)
    ctx = PEContext(dim=width, num_heads=heads, head_dim=head_dim, depth=len(layers), grid_size=grid_size,
                    num_prefix_tokens=family.num_prefix(config))
    ref = next(iter(tower.parameters()))
    try:
        if pe is None:
            encoding = family.own_map(ctx, **options).to(ref.device)
        else:
            encoding = create_pe(pe, ctx, device=ref.device, **options)
    except ValueError as e:
        raise ValueError(f'patch_vision ({family.label}): pe={pe!r} cannot apply: {e}') from e
    if encoding.capabilities.requires:
        raise ValueError(f'patch_vision ({family.label}): pe={pe!r} reads {sorted(encoding.capabilities.requires)} from '
                         f'its positions, which an image encoder does not supply')
    report = _adopt(encoding, tower, family, grid_size)
    if ref.dtype != torch.float32:  # the model's dtype, as `nn.Module.to` would give it
        encoding.to(dtype=ref.dtype)
    encoding.train(tower.training)  # registered into a model that may already be in eval mode
    handle = VisionPatch(model, tower, tower_name, family, encoding, pe, report)
    handle._install(layers)
    _logger.info('vispe: patched %s (%s) with pe=%s: %s', type(model).__name__, family.label, encoding.name, report)
    return handle
