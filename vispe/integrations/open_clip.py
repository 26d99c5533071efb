"""open_clip: any vispe encoding in the image tower of an open_clip CLIP model.

open_clip builds a timm image tower (``vision_cfg.timm_model_name``) with
``timm.create_model(timm_model_name, ...)``: it passes the name and its own pooling / head
arguments, never ``pe``. So a config naming a vispe ViT (``timm_model_name='vit_tiny'``) builds it
with the default encoding, ``pe='learned'``, at a fixed size. The two ways that do give the tower an
encoding are this adapter (`use_pe`: build the CLIP model as open_clip does, then convert its timm
trunk) and a config whose ``timm_model_name`` is a ``local-dir:`` export of a vispe model
(`vispe.weights.save_for_hf`), which carries its encoding.

`use_pe` patches one model instance: it converts a copy of ``model.visual.trunk`` (a timm
``VisionTransformer`` / ``Eva``) with `vispe.convert` (every weight kept, the table handed to the
encoding), makes it take any input size the patch divides (timm's ``dynamic_img_size``), and puts
it in place of the trunk; the returned handle's ``remove()`` puts the original trunk back.
"""
from __future__ import annotations

import copy
from typing import Any

from torch import nn

from ..extras import SUPPORTED as _SUPPORTED, require
from ..registry import PESpec
from .base import ModelPatch, UnsupportedModelError, refuse_patched

__all__ = ['use_pe', 'OpenClipPE', 'SUPPORTED']

SUPPORTED = _SUPPORTED['open_clip']  # open_clip_torch: lowest tested, first unsupported


class OpenClipPE(ModelPatch):
    """What `use_pe` did to one CLIP model: ``tower`` is the vispe image trunk now in place;
    ``remove()`` puts the original timm trunk back (the same module object, untouched)."""
    adapter = 'use_pe'

    def __init__(self, model: nn.Module, visual: nn.Module, tower: nn.Module) -> None:
        super().__init__(model)
        self.visual, self.tower = visual, tower
        self.set(visual, 'trunk', tower, 'visual')
        self.activate()

    def remove(self) -> None:
        if self.active and self.visual.trunk is not self.tower:
            raise RuntimeError('the image trunk was replaced since use_pe; remove() would discard that change')
        super().remove()


def _make_dynamic(trunk: nn.Module) -> None:
    """timm's ``dynamic_img_size=True`` on a built model: the patch embedding keeps the token grid
    (channels last) and takes any size, so each forward's positions come from the image's own grid."""
    from timm.layers import Format
    patch = trunk.patch_embed
    patch.strict_img_size = False
    patch.flatten = False
    patch.output_fmt = Format.NHWC
    trunk.dynamic_img_size = True


def use_pe(model: nn.Module, pe: PESpec = None, *, dynamic_img_size: bool = True, **options: Any) -> OpenClipPE:
    """Give the timm image tower of an open_clip model the encoding ``pe``.

    Args:
        model: an open_clip ``CLIP`` / ``CustomTextCLIP`` whose ``visual`` is open_clip's ``TimmModel``
            (a ``timm_model_name`` config) around a timm ``VisionTransformer`` or ``Eva``.
        pe: encoding spec (``'rope_mixed'``, ``'liere'``, ...); None: the tower's own encoding
            (``vispe.timm_pe_spec(model.visual.trunk)``), computed by vispe; ``'none'``: no encoding.
        dynamic_img_size: let the tower take any image size the patch divides (default on; open_clip's
            preprocessing still resizes to ``model.visual.image_size`` unless given another size).
        options: options of a single encoding, as in `vispe.convert`.

    Returns:
        An `OpenClipPE` handle: ``.tower`` (the vispe trunk) and ``.remove()``.

    Raises:
        vispe.integrations.UnsupportedModelError: ``model`` is not an open_clip model with a timm image
            tower (open_clip's own ``VisionTransformer`` towers are not timm models: build the model from
            a config with ``timm_model_name``); a TypeError.
        vispe.integrations.AlreadyPatchedError: the model (or a module of it) is already patched.
        vispe.extras.UnsupportedVersionError: an open_clip_torch outside the supported range.
        ValueError: a trunk vispe cannot host, or an encoding that cannot apply to it (`vispe.convert`).
    """
    open_clip = require('open_clip', 'vispe.integrations.open_clip')
    from ..zoo import convert
    visual = getattr(model, 'visual', None)
    if not isinstance(visual, open_clip.timm_model.TimmModel):
        raise UnsupportedModelError(f'use_pe takes an open_clip model whose image tower is a timm model (open_clip TimmModel, '
                        f'built from a config with vision_cfg.timm_model_name); got visual='
                        f'{type(visual).__name__ if visual is not None else None}')
    refuse_patched(model, 'use_pe')
    trunk = convert(copy.deepcopy(visual.trunk), pe, **options)
    if dynamic_img_size:
        _make_dynamic(trunk)
    return OpenClipPE(model, visual, trunk)
