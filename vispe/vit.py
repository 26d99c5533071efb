"""timm's VisionTransformer with a swappable positional encoding (``pe=...``), registered in timm.

``import vispe`` registers, for each size in `VIT_SIZES`, ``vispe_vit_<size>_patch16_224`` and the
short alias ``vit_<size>`` (timm itself has no model of that name). Each points its pretrained
config at timm's own ViT weights, so ``pretrained=True`` (or ``pretrained_cfg_overlay=dict(file=...)``
offline) loads a timm checkpoint, keeps every shared weight and initialises the new encoding.

A vispe ViT is timm's ``VisionTransformer`` built as timm builds it (its own blocks and
attention), then given its encoding by `vispe.host.install_pe`, the path every converted zoo model
takes too; the forward is `vispe.host.PEHost`.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Dict, Tuple

from timm.layers import is_scriptable
from timm.models import generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer

from ._timm import build_model_with_cfg
from .host import NO_TORCHSCRIPT, PEHost, PatchEmbed, TubeletEmbed, install_pe
from .registry import PESpec
from .weights import checkpoint_filter_fn

__all__ = ['VisionTransformer', 'VIT_SIZES', 'checkpoint_filter_fn']


class VisionTransformer(PEHost, TimmVisionTransformer):
    """timm's ViT with the positional encoding as an argument (``pe``).

    Positions are built per forward from the token grid (``(h, w)``, or ``(t, h, w)`` for video)
    and prepared once (`vispe.PreparedPE`); the blocks take that one object: ``embed`` runs once,
    ``between_blocks`` after each block, and, through `PEAttention` (``attn(x, pe=prepared)``),
    ``qk``/``bias``/``value``/``output`` in every attention layer. Everything else (parameter names, heads, pooling,
    ``forward_intermediates``, gradient checkpointing, ``set_input_size``) is timm's.

    Built by timm's own ``VisionTransformer`` constructor, then given its encoding by
    `vispe.host.install_pe` (the path of every converted zoo model). timm's factory kwargs ``device``
    and ``dtype`` reach the encoding too: ``device='meta'`` builds
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
        kwargs.setdefault('embed_layer', PatchEmbed)
        super().__init__(pos_embed='none', dynamic_img_size=dynamic_img_size, **kwargs)
        self.video = video
        if video:
            if num_frames % tubelet:
                raise ValueError(f'num_frames={num_frames} must be divisible by tubelet={tubelet}')
            pe_old = self.patch_embed
            self.patch_embed = TubeletEmbed(tuple(pe_old.img_size), pe_old.patch_size[0], num_frames, tubelet,
                                            self.in_chans, self.embed_dim, bias=pe_old.proj.bias is not None, **dd)
        install_pe(self, pe, label='VisionTransformer', **dd)


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
