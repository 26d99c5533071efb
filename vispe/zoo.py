"""timm's ViT zoo with any vispe encoding: `convert` and ``timm.create_model(..., pe=...)``.

`convert` turns an already-built timm ``VisionTransformer`` (DeiT's distilled one included) or ``Eva``
(any of the entrypoints of ``timm.models.vision_transformer``, ``deit`` and ``eva``, or e.g. open_clip's
timm tower ``.trunk``) into a PE host in place: every attention module and block becomes its PE-aware subclass
(the same parameters, buffers and names, so the model's weights stay exactly where they were), the
model's ``pos_embed`` (and Eva's ``rope``) is replaced by the encoding ``model.pe``, and the
checkpoint's table is handed to the encoding (``adopt_pos_embed``; a timm rope's learned
frequencies to the encoding's ``adopt_timm_rope``). ``model.pretrained_report`` says what was
dropped, initialised and resampled.

``import vispe`` wraps each entrypoint of these timm modules so that it accepts ``pe=``
(`wrap_timm_entrypoints`, idempotent; `unwrap_timm_entrypoints` restores timm's registry): without it
the original entrypoint runs untouched (same class, outputs, state dict, pretrained configs, timm's
fixed input size); with it timm builds (and loads) the model through its own entrypoint, loader and
checkpoint filters, then `convert` runs. With ``pe=`` the model is built with
``dynamic_img_size=True`` unless the call says otherwise, so it takes any input size the patch
divides, as vispe's own ViTs do (at the built size its outputs are those of the fixed-size model);
a model whose ``img_size`` the patch does not divide keeps timm's fixed size, whose patch
embedding crops the remainder. ``timm_pe_spec(model)`` is the spec of the model's own encoding (``learned``,
``rope_timm:...`` or both), with which the converted model computes timm's own outputs.

The blocks and attention modules kept are those of `vispe.layers`; the conversion itself is
`vispe.host.install_pe`, the path of vispe's own ViTs too. DeiT's ``VisionTransformerDistilled``
keeps its distillation token as the second prefix token and its two heads
(`PEVisionTransformerDistilled`).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

import timm
import torch
from timm.layers import Format
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import nn

from ._timm import (
    FeatureGetterNet, RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed, RotaryEmbeddingMRope,
    load_pretrained, model_entrypoints, pretrained_cfg_for_features,
)
from .host import PEHost, install_pe
from .registry import PESpec, format_pe_spec
from .vit import VisionTransformer
from .weights import LoadReport, checkpoint_filter_fn

__all__ = ['convert', 'timm_pe_spec', 'checkpoint_filter_fn', 'wrap_timm_entrypoints', 'unwrap_timm_entrypoints',
           'ZOO_MODULES', 'PEEva', 'PEVisionTransformerDistilled']

_logger = logging.getLogger(__name__)

ZOO_MODULES = ('vision_transformer', 'deit', 'eva')


# ---------------------------------------------------------------------- hosts
class PEEva(PEHost, Eva):
    """timm's `Eva` (EVA, EVA-02, PE, RoPE-ViT ports, DINOv3, ...) as a vispe host: its ``pos_embed``
    and ``rope`` replaced by ``self.pe``; everything else (heads, pooling, norms) is timm's."""

    def _pool_keeps_prefix(self, attn_pool: bool) -> bool:
        """Eva's MAP head reads every token, its global pooling none of the prefix tokens."""
        return attn_pool


class PEVisionTransformerDistilled(VisionTransformer, VisionTransformerDistilled):
    """DeiT's `VisionTransformerDistilled` (Touvron et al. 2021, https://arxiv.org/abs/2012.12877) as a
    vispe host: the distillation token is the second prefix token (class, distillation, as timm orders
    them), and the two heads, ``distilled_training`` and the train / eval outputs are timm's."""

    def _prefix_tokens(self) -> List[Optional[torch.Tensor]]:
        return [self.cls_token, self.dist_token]

    def forward_head(self, x: Union[torch.Tensor, Dict[str, torch.Tensor]], pre_logits: bool = False,
                     patch_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's distilled head; it reads the two prefix tokens only, so a NaFlex batch's padding
        (``patch_valid``) cannot reach it."""
        if isinstance(x, dict):
            x = x['patches']
        return VisionTransformerDistilled.forward_head(self, x, pre_logits)


_HOSTS: Dict[Type[nn.Module], Type[nn.Module]] = {
    TimmVisionTransformer: VisionTransformer, VisionTransformerDistilled: PEVisionTransformerDistilled, Eva: PEEva,
}


def _model_name(model: nn.Module, name: Optional[str]) -> str:
    if name:
        return name
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    return cfg.get('architecture') or type(model).__name__


def _check_convertible(model: nn.Module, label: str) -> None:
    if getattr(model, 'pe', None) is not None and isinstance(model, PEHost):
        raise ValueError(f'{label} is already a vispe host (pe={model.pe.name!r}); build it anew to change pe')
    if type(model) not in _HOSTS:
        hint = ('; for native-resolution batches build the model without use_naflex and give it '
                'vispe.naflex_batch(...)' if type(model).__name__ == 'NaFlexVit' else '')
        raise ValueError(f'{label}: vispe.convert takes timm VisionTransformer or Eva models, got '
                         f'{type(model).__module__}.{type(model).__name__}{hint}')
    if isinstance(model, VisionTransformerDistilled) and model.reg_token is not None:
        raise ValueError(f'{label}: a VisionTransformerDistilled with register tokens (reg_tokens='
                         f'{model.reg_token.shape[1]}): timm leaves them out of its sequence; use reg_tokens=0')


def _rope_spec(rope: nn.Module, label: str) -> Dict[str, Any]:
    """The `rope_timm` options equal to a timm rope module."""
    augment = {k: getattr(rope, k) for k in ('shift_coords', 'jitter_coords', 'rescale_coords')
               if getattr(rope, k, None) is not None}
    if type(rope) is RotaryEmbeddingCat:
        if rope.grid_type != 'index' or rope.in_pixels:
            raise ValueError(f'{label}: its rope uses pixel-frequency bands (grid_type={rope.grid_type!r}); '
                             "encoding 'rope_timm' follows the index-grid convention of timm's ViT models")
        spec = dict(rope_type='cat', temperature=float(rope.temperature), grid_indexing=rope.grid_indexing,
                    grid_offset=float(rope.grid_offset), rotate_half=bool(rope.rotate_half))
        if rope.ref_feat_shape is not None:
            spec['ref_feat_shape'] = [int(s) for s in rope.ref_feat_shape]
    elif type(rope) is RotaryEmbeddingMixed:
        spec = dict(rope_type='mixed', temperature=float(rope.temperature), grid_indexing=rope.grid_indexing)
    elif type(rope) is RotaryEmbeddingDinoV3:
        spec = dict(rope_type='dinov3', grid_indexing=rope.grid_indexing, grid_offset=float(rope.grid_offset),
                    rotate_half=bool(rope.rotate_half), normalize_coords=rope.normalize_coords)
        if rope.min_period is not None and rope.max_period is not None:
            spec.update(min_period=float(rope.min_period), max_period=float(rope.max_period))
        else:
            spec['temperature'] = float(rope.temperature)
    elif type(rope) is RotaryEmbeddingMRope:
        spec = dict(rope_type='mrope', temperature=float(rope.temperature), rotate_half=True,
                    mrope_section=[int(s) for s in rope.mrope_section])
    else:
        raise ValueError(f'{label}: unknown timm rope module {type(rope).__name__}')
    return dict(name='rope_timm', **spec, **augment)


def timm_pe_spec(model: nn.Module) -> PESpec:
    """The vispe spec of a timm ViT / Eva model's own encoding: ``'learned'`` for its ``pos_embed``, a
    ``rope_timm`` dict for its rope, both for EVA-02 (a list), ``'none'`` for neither. Converted with
    it (`convert`), the model computes timm's own outputs."""
    label = _model_name(model, None)
    parts: List[Any] = []
    if getattr(model, 'pos_embed', None) is not None:
        parts.append('learned')
    rope = getattr(model, 'rope', None)
    if rope is not None:
        parts.append(_rope_spec(rope, label))
    if not parts:
        return 'none'
    return parts[0] if len(parts) == 1 else parts


def convert(model: nn.Module, pe: PESpec, *, name: Optional[str] = None,
            loaded_grid: Optional[Tuple[int, ...]] = None, **options: Any) -> nn.Module:
    """Make a built timm ``VisionTransformer`` (DeiT's distilled one too) or ``Eva`` a vispe host with
    encoding ``pe``, in place.

    Every weight of the model stays (same names); its ``pos_embed`` is handed to the encoding
    (``adopt_pos_embed``: a ``learned`` table takes it, resampled to its grid) and its rope
    module is replaced (a ``rope_timm`` encoding with ``rope_type='mixed'`` takes its learned
    frequencies). ``model.pretrained_report`` lists what was dropped (a table or rope weights no
    encoding took), initialised (encoding weights not taken from the model) and resampled.

    Args:
        model: the timm model (on any device, the meta device included).
        pe: encoding spec (``'rope_mixed'``, ``'irpe+learned'``, ...); None: the model's own encoding
            (`timm_pe_spec`), computed by vispe (outputs equal timm's); ``'none'``: no encoding (NoPE).
        name: the model's name for error messages (default: its pretrained config's architecture).
        loaded_grid: the token grid of the checkpoint the model's table was loaded from; when it is
            not the model's, timm's loader resampled the table, and the report says so.
        options: options of a single encoding, overriding the spec's.

    Returns:
        The same model object, now a `vispe.VisionTransformer`, `PEVisionTransformerDistilled` or `PEEva`.

    Raises:
        ValueError: a model vispe cannot host (another class, NaFlexVit) or an encoding that cannot
            apply to it (one that needs cameras, other head widths, one acting on v or the output of a
            differential attention), naming the model and the reason.
    """
    label = _model_name(model, name)
    _check_convertible(model, label)
    if pe is None:
        pe = timm_pe_spec(model)
    report = install_pe(model, pe, label=label, loaded_grid=loaded_grid, **options)
    model.__class__ = _HOSTS[type(model)]
    model.pretrained_report = report
    _logger.info('vispe: converted %s to pe=%s: %s', label, model.pe.name, report)
    return model


# ---------------------------------------------------------------------- timm entrypoints
def _checkpoint_grid(model: nn.Module) -> Optional[Tuple[int, ...]]:
    """The token grid of the checkpoint timm loaded (its pretrained config's input size over the
    patch size), whose ``pos_embed`` timm's own filter resampled to the model's grid if they differ."""
    size = (getattr(model, 'pretrained_cfg', None) or {}).get('input_size')
    patch = tuple(model.patch_embed.patch_size)
    return tuple(s // p for s, p in zip(size[-2:], patch)) if size else None


def _load_export(fn: Callable[..., nn.Module], pe: PESpec, saved: PESpec, kwargs: Dict[str, Any],
                 default_dynamic: bool) -> nn.Module:
    """A checkpoint that `save_for_hf` wrote from a converted model (its ``model_args`` carry ``pe``): its
    state dict is the converted model's (the encoding's entries, no ``pos_embed``), so the whole model is
    built, converted, and loaded by timm's own loader (file or hub, classifier and input-channel
    adaptation); with ``features_only`` it is then wrapped as timm wraps ViTs, in its feature getter,
    since the pruning that wrapper does would otherwise come before the encoding's per-layer weights load."""
    if format_pe_spec(pe) != format_pe_spec(saved):
        raise ValueError(f'{fn.__name__}: the checkpoint was saved with pe={saved!r} and holds that encoding\'s '
                         f'weights; load it with pe={saved!r} (or without pe), not pe={pe!r}')
    features = kwargs.pop('features_only', False)
    feature_cfg = dict(kwargs.pop('feature_cfg', None) or {}, out_indices=kwargs.pop('out_indices', 3))
    model = fn(pretrained=False, **kwargs)
    convert(model, pe, name=fn.__name__)
    if default_dynamic:
        _fixed_if_patch_does_not_divide(model)
    load_pretrained(model, num_classes=0 if features else model.num_classes, in_chans=kwargs.get('in_chans', 3))
    model.pretrained_report = LoadReport([], [], [])  # every entry came from the checkpoint
    if not features:
        return model
    wrapped = FeatureGetterNet(model, **feature_cfg)
    wrapped.pretrained_cfg = wrapped.default_cfg = pretrained_cfg_for_features(model.pretrained_cfg)
    return wrapped


def _fixed_if_patch_does_not_divide(model: nn.Module) -> None:
    """Back to timm's fixed input size (as the model would be built without ``dynamic_img_size``) when
    the patch does not divide the model's ``img_size``: timm's fixed-size patch embedding crops that
    remainder, which a dynamic model refuses, so the model keeps timm's outputs at its own size."""
    embed = model.patch_embed
    if embed.img_size is None or not any(s % p for s, p in zip(embed.img_size, embed.patch_size)):
        return
    model.dynamic_img_size = False
    embed.strict_img_size, embed.flatten, embed.output_fmt = True, True, Format.NCHW


def _wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``fn`` accepting ``pe=`` (``dynamic_img_size`` then defaults to True); without it, ``fn`` itself runs."""
    @functools.wraps(fn)
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        if 'pe' not in kwargs:
            return fn(pretrained=pretrained, **kwargs)
        pe = kwargs.pop('pe')
        default_dynamic = 'dynamic_img_size' not in kwargs
        # with an encoding the model takes any input size the patch divides, as vispe's own ViTs
        # (`dynamic_img_size=False` keeps timm's fixed size); at the built size the outputs are the same
        kwargs.setdefault('dynamic_img_size', True)
        # timm passes a local-dir / hub checkpoint's saved model_args on as pretrained_model_args
        saved = (kwargs.get('pretrained_model_args') or {}).get('pe')
        if pretrained and saved is not None:
            return _load_export(fn, pe, saved, kwargs, default_dynamic)
        model = fn(pretrained=pretrained, **kwargs)
        # features_only=True: timm wraps the model, which serves forward_intermediates to the wrapper
        host = model.model if isinstance(model, FeatureGetterNet) else model
        convert(host, pe, name=fn.__name__, loaded_grid=_checkpoint_grid(host) if pretrained else None)
        if default_dynamic:
            _fixed_if_patch_does_not_divide(host)
        return model
    entrypoint._vispe_original = fn
    return entrypoint


def wrap_timm_entrypoints() -> None:
    """Let every entrypoint of timm's ViT modules (`ZOO_MODULES`) take ``pe=`` (``import vispe`` does
    this; calling it again changes nothing). Without ``pe=`` an entrypoint runs as timm's own; the
    wrapper keeps each function's name, module and docstring in timm's registry."""
    registry = model_entrypoints()
    for module in ZOO_MODULES:
        for name in timm.list_models(module=module):
            fn = registry[name]
            if not hasattr(fn, '_vispe_original'):
                registry[name] = _wrap(fn)


def unwrap_timm_entrypoints() -> None:
    """Put timm's own entrypoints back in its registry (``pe=`` is then unknown to them)."""
    registry = model_entrypoints()
    for name, fn in list(registry.items()):
        original = getattr(fn, '_vispe_original', None)
        if original is not None:
            registry[name] = original


wrap_timm_entrypoints()
