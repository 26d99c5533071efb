"""timm's VisionTransformer with a swappable positional encoding (``pe=...``), registered in timm.

``import vispe`` registers, for each size in `VIT_SIZES`, ``vispe_vit_<size>_patch16_224`` and the
short alias ``vit_<size>`` (timm itself has no model of that name). Each points its pretrained
config at timm's own ViT weights, so ``pretrained=True`` (or ``pretrained_cfg_overlay=dict(file=...)``
offline) loads a timm checkpoint, keeps every shared weight and initialises the new encoding.

The forward is `vispe.host.PEHost`, shared with the models `vispe.convert` makes of timm's own
``VisionTransformer`` and ``Eva``.
"""
from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from timm.layers import PatchDropoutWithIndices, is_scriptable
from timm.models import generate_default_cfgs, register_model
from timm.models._builder import build_model_with_cfg
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from timm.models.eva import Eva
from timm.models.eva import checkpoint_filter_fn as timm_eva_checkpoint_filter_fn
from timm.models.vision_transformer import checkpoint_filter_fn as timm_checkpoint_filter_fn

from .attention import PEAttention
from .encodings.base import PEContext, PositionalEncoding
from .host import NO_TORCHSCRIPT, PEBlock, PEHost, PatchEmbed, TubeletEmbed
from .registry import PESpec, create_pe

__all__ = ['VisionTransformer', 'LoadReport', 'adopt_pos_embed', 'VIT_SIZES', 'checkpoint_filter_fn',
           'load_timm_checkpoint']

_logger = logging.getLogger(__name__)


class VisionTransformer(PEHost, TimmVisionTransformer):
    """timm's ViT with the positional encoding as an argument (``pe``).

    Positions are built per forward from the token grid (``(h, w)``, or ``(t, h, w)`` for video)
    and handed to every hook of the encoding: ``embed`` once, ``between_blocks`` after each block,
    and, through `PEAttention`, ``qk``/``bias``/``value``/``output`` in every attention layer, with
    the state from one ``prepare`` per forward. Everything else (parameter names, heads, pooling,
    ``forward_intermediates``, gradient checkpointing, ``set_input_size``) is timm's.

    timm's factory kwargs ``device`` and ``dtype`` reach the encoding too: ``device='meta'`` builds
    the whole model without memory, and ``to_empty(device=...)`` followed by `init_weights`
    initialises it, the encoding as its constructor does. TorchScript is not supported
    (``scriptable=True`` raises); torch.compile, torch.export and torch.fx feature extraction are.

    Args:
        pe: encoding spec (``'rope_mixed'``, ``'irpe+learned'``, ``{'name': 'rope_axial', 'theta': 100}``).
        dynamic_img_size: accept any input size the patch size divides (default on).
        video: take ``(B, C, T, H, W)`` clips with a tubelet embedding.
        num_frames: frames of the training clip (video only).
        tubelet: frames per tubelet (video only).
        kwargs: timm `VisionTransformer` arguments (``pos_embed`` is replaced by ``pe``).
    """

    def __init__(
            self,
            pe: PESpec = 'learned',
            dynamic_img_size: bool = True,
            video: bool = False,
            num_frames: int = 8,
            tubelet: int = 2,
            **kwargs: Any,
    ) -> None:
        if 'pos_embed' in kwargs:
            raise ValueError("argument pos_embed is replaced by pe= in vispe models (e.g. pe='learned' or pe='none')")
        if is_scriptable():
            raise ValueError(f'scriptable=True: {NO_TORCHSCRIPT}')
        checks = [('num_heads', kwargs.get('num_heads', 12))] + ([('num_frames', num_frames), ('tubelet', tubelet)]
                                                                 if video else [])
        for arg, value in checks:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f'{arg} must be a positive integer, got {value!r}')
        dd = {'device': kwargs.get('device'), 'dtype': kwargs.get('dtype')}
        patch_drop_rate = kwargs.pop('patch_drop_rate', 0.0)
        kwargs.setdefault('embed_layer', PatchEmbed)
        super().__init__(pos_embed='none', dynamic_img_size=dynamic_img_size, block_fn=PEBlock,
                         attn_layer=PEAttention, **kwargs)
        for i, blk in enumerate(self.blocks):
            blk.attn.layer_index = i
        self.video = video
        if video:
            if num_frames % tubelet:
                raise ValueError(f'num_frames={num_frames} must be divisible by tubelet={tubelet}')
            pe_old = self.patch_embed
            self.patch_embed = TubeletEmbed(tuple(pe_old.img_size), pe_old.patch_size[0], num_frames, tubelet,
                                            self.in_chans, self.embed_dim, bias=pe_old.proj.bias is not None, **dd)
        self.patch_drop = PatchDropoutWithIndices(patch_drop_rate, num_prefix_tokens=self.num_prefix_tokens) \
            if patch_drop_rate > 0 else None
        head_dim = self.blocks[0].attn.head_dim if len(self.blocks) else self.embed_dim
        self.pe_context = PEContext(
            dim=self.embed_dim, num_heads=self.blocks[0].attn.num_heads if len(self.blocks) else 1,
            head_dim=head_dim, depth=len(self.blocks), grid_size=tuple(self.patch_embed.grid_size),
            num_prefix_tokens=self.num_prefix_tokens, embed_prefix=not self.no_embed_class)
        self.pe = create_pe(pe, self.pe_context, **dd)
        if self.pe.capabilities.requires:
            raise ValueError(f'pe={pe!r} needs {sorted(self.pe.capabilities.requires)} in its positions, which an '
                             'image ViT does not supply (use a camera-aware host)')
        if self.patch_drop is not None and 'between_blocks' in self.pe.hooks:
            raise ValueError(f'patch_drop_rate > 0 cannot be combined with pe={pe!r}: it needs the full token grid')

    # ------------------------------------------------------------------ timm contract
    def init_weights(self, mode: str = '', needs_reset: bool = True) -> None:
        """timm's `init_weights`, then the encoding's own initialisation (`reset_parameters`), which
        replaces the generic ViT init of any layer inside the encoding."""
        super().init_weights(mode, needs_reset)
        pe = getattr(self, 'pe', None)  # timm's constructor initialises before the encoding exists
        if pe is not None:
            pe.reset_parameters()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        return {'cls_token', 'reg_token', 'dist_token'} | {f'pe.{n}' for n in self.pe.no_weight_decay()}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^cls_token|reg_token|pe\.|patch_embed|norm_pre',
                    blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))])

# ---------------------------------------------------------------------- pretrained weights
@dataclass
class LoadReport:
    """What loading a timm checkpoint into a vispe ViT did, key by key."""
    dropped: List[str]
    initialized: List[str]
    resampled: List[str]

    def __str__(self) -> str:
        return (f'dropped {self.dropped or "nothing"}; initialised {self.initialized or "nothing"}; '
                f'resampled {self.resampled or "nothing"}')


def adopt_pos_embed(pe: PositionalEncoding, table: torch.Tensor, num_prefix_tokens: int,
                    grid: Optional[Sequence[int]] = None, embed_prefix: bool = True, prefix: str = 'pe.'
                    ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """A checkpoint's timm ``pos_embed`` handed to ``pe.adopt_pos_embed``: the state-dict entries it
    fills (names prefixed with ``prefix``) and those among them that were resampled.

    The table's prefix rows are read from its size: ``num_prefix_tokens`` rows when the rest form
    ``grid`` (or a square grid), none when the table itself does (timm's ``no_embed_class``); where
    both fit, ``embed_prefix`` (the model's ``not no_embed_class``) decides.
    """
    rows = table.shape[1]
    candidates = [(num_prefix_tokens, rows - num_prefix_tokens), (0, rows)] if num_prefix_tokens else [(0, rows)]
    if not embed_prefix:
        candidates.reverse()
    for npre, n in candidates:
        if grid is not None and math.prod(grid) == n:
            shape = tuple(grid)
        elif grid is None and n > 0 and math.isqrt(n) ** 2 == n:
            shape = (math.isqrt(n),) * 2
        else:
            continue
        entries, resampled = pe.adopt_pos_embed(table, npre, shape)
        return {prefix + k: v for k, v in entries.items()}, [prefix + k for k in resampled]
    raise ValueError(f'checkpoint pos_embed has {rows} rows: neither {num_prefix_tokens} prefix rows plus '
                     f'{"a square grid" if grid is None else f"the grid {tuple(grid)}"} nor the grid alone')


class _RopeWeights:
    """A timm rope module's learned frequencies read from a state dict (what `adopt_timm_rope` reads)."""

    def __init__(self, entries: Dict[str, torch.Tensor]) -> None:
        self.freqs = entries['rope.freqs']


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: VisionTransformer) -> Dict[str, torch.Tensor]:
    """Adapt a timm ViT / Eva state dict to a vispe host (vispe's ViT, a converted timm model) with any
    encoding, and validate it.

    timm's own filter for the model's family converts the formats it knows (patch-embed resampling,
    CLIP / DINOv2 / EVA layouts); a learned rope's frequencies go to the encoding that takes them;
    then ``pos_embed`` moves into the learned encoding (resampled to its grid) or is dropped, and the
    encoding's parameters are marked as initialised. The classifier (``head.*``) is kept where the
    model has one of the same shape, else dropped (a headless ``num_classes=0`` backbone, another
    number of classes), and a model classifier the checkpoint does not fill is marked as
    initialised. Other keys that the model lacks, or model weights the checkpoint lacks outside the
    encoding and the classifier, raise: that is a different architecture. The report is logged and
    stored as ``model.pretrained_report``.
    """
    sd = (timm_eva_checkpoint_filter_fn if isinstance(model, Eva) else timm_checkpoint_filter_fn)(state_dict, model)
    dropped, resampled = [], []
    rope = {k: sd.pop(k) for k in [k for k in sd if k.startswith('rope.')]}
    if rope:  # an Eva's rope: a learned one (RoPE-Mixed) hands its frequencies to the encoding
        taken = model.pe.adopt_timm_rope(_RopeWeights(rope)) if 'rope.freqs' in rope else {}
        sd.update({f'pe.{k}': v for k, v in taken.items()})
        if not taken:
            dropped += sorted(rope)
    table = sd.pop('pos_embed', None)
    if table is not None:
        entries, resampled = adopt_pos_embed(model.pe, table, model.num_prefix_tokens,
                                             embed_prefix=not model.no_embed_class)
        sd.update(entries)
        if not entries:
            dropped.append('pos_embed')
    model_sd = model.state_dict()
    model_keys = set(model_sd)
    for key in sorted(k for k in sd if k.startswith('head.')):
        if key not in model_sd or sd[key].shape != model_sd[key].shape:
            dropped.append(key)
            del sd[key]
    unexpected = sorted(k for k in sd if k not in model_keys)
    missing = sorted(k for k in model_keys - set(sd) if not k.startswith('pe.') and not k.startswith('head.'))
    if unexpected or missing:
        raise ValueError(
            'checkpoint does not match this architecture (other depth, width or layout?): '
            f'unexpected keys {unexpected[:8]}{"..." if len(unexpected) > 8 else ""}, '
            f'missing keys {missing[:8]}{"..." if len(missing) > 8 else ""}')
    initialized = sorted(k for k in model_keys if k.startswith(('pe.', 'head.')) and k not in sd)
    report = LoadReport(dropped=dropped, initialized=initialized, resampled=resampled)
    model.pretrained_report = report
    _logger.info('vispe: loaded timm checkpoint into pe=%s: %s', model.pe.name, report)
    return sd


def load_timm_checkpoint(model: VisionTransformer, checkpoint: Union[str, Dict[str, torch.Tensor]]) -> LoadReport:
    """Load a timm ViT checkpoint (path or state dict) into ``model``; returns what was dropped / initialised.

    The classifier is kept when its shape matches and left initialised (and reported) otherwise;
    see `checkpoint_filter_fn`.
    """
    if isinstance(checkpoint, str):
        from timm.models import load_state_dict
        checkpoint = load_state_dict(checkpoint)
    # the filter checked that the model's keys absent here are exactly the report's initialised ones
    model.load_state_dict(checkpoint_filter_fn(dict(checkpoint), model), strict=False)
    return model.pretrained_report


# ---------------------------------------------------------------------- registration
@dataclass(frozen=True)
class _Size:
    embed_dim: int
    depth: int
    num_heads: int
    timm_weights: str  # timm's matching ViT-*/16 224 weights (name.tag)


VIT_SIZES: Dict[str, _Size] = {
    'tiny': _Size(192, 12, 3, 'vit_tiny_patch16_224.augreg_in21k_ft_in1k'),
    'small': _Size(384, 12, 6, 'vit_small_patch16_224.augreg_in21k_ft_in1k'),
    'base': _Size(768, 12, 12, 'vit_base_patch16_224.augreg2_in21k_ft_in1k'),
    'large': _Size(1024, 24, 16, 'vit_large_patch16_224.augreg_in21k_ft_in1k'),
}


def _cfg(timm_weights: str) -> Dict[str, Any]:
    return dict(
        hf_hub_id=f'timm/{timm_weights}', num_classes=1000, input_size=(3, 224, 224), pool_size=None,
        crop_pct=0.9, interpolation='bicubic', fixed_input_size=False, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
        first_conv='patch_embed.proj', classifier='head', license='apache-2.0')


def _names(size: str) -> Tuple[str, str]:
    return f'vispe_vit_{size}_patch16_224', f'vit_{size}'


default_cfgs = generate_default_cfgs({
    f'{name}.{spec.timm_weights.split(".", 1)[1]}': _cfg(spec.timm_weights)
    for size, spec in VIT_SIZES.items() for name in _names(size)
})


def _create(variant: str, pretrained: bool, **kwargs: Any) -> VisionTransformer:
    return build_model_with_cfg(VisionTransformer, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
                                pretrained_strict=False, feature_cfg=dict(out_indices=3, feature_cls='getter'),
                                **kwargs)


def _entrypoint(name: str, spec: _Size):
    def create(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
        args = dict(patch_size=16, embed_dim=spec.embed_dim, depth=spec.depth, num_heads=spec.num_heads)
        return _create(name, pretrained, **dict(args, **kwargs))
    create.__name__ = create.__qualname__ = name
    create.__module__ = __name__
    create.__doc__ = (f'ViT-{spec.embed_dim}d x {spec.depth} (patch 16, 224) with a swappable encoding '
                      f'(pe=...); pretrained weights: timm {spec.timm_weights}.')
    return register_model(create)


for _size, _spec in VIT_SIZES.items():
    for _name in _names(_size):
        globals()[_name] = _entrypoint(_name, _spec)
