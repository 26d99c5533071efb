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

from ..extras import require
from ..registry import PESpec

__all__ = ['use_pe', 'OpenClipPE', 'SUPPORTED']

SUPPORTED = ('3.3', '4')  # open_clip_torch: lowest tested, first unsupported


def _version(text: str) -> tuple:
    import re
    return tuple(int(p) for p in re.findall(r'\d+', text.split('+')[0])[:3])


def _open_clip():
    open_clip = require('open_clip', 'vispe.integrations.open_clip')
    low, high = SUPPORTED
    if not _version(low) <= _version(open_clip.__version__) < _version(high):
        raise ImportError(f'vispe.integrations.open_clip supports open_clip_torch >= {low}, < {high}; '
                          f'{open_clip.__version__} is installed')
    return open_clip


class OpenClipPE:
    """What `use_pe` did to one CLIP model: ``tower`` is the vispe image trunk now in place;
    ``remove()`` puts the original timm trunk back (the same module object, untouched)."""

    def __init__(self, visual: nn.Module, original: nn.Module) -> None:
        self.visual, self.original, self.tower = visual, original, visual.trunk

    def remove(self) -> None:
        if self.visual.trunk is not self.tower:
            raise RuntimeError('the image trunk was replaced since use_pe; remove() would discard that change')
        self.visual.trunk = self.original


def _make_dynamic(trunk: nn.Module) -> None:
    """timm's ``dynamic_img_size=True`` on a built model: the patch embedding keeps the token grid
    (channels last) and takes any size, so each forward's positions come from the image's own grid."""
    from timm.layers import Format
    patch = trunk.patch_embed
    patch.strict_img_size = False
    patch.flatten = False
    patch.output_fmt = Format.NHWC
    trunk.dynamic_img_size = True


def use_pe(model: nn.Module, pe: PESpec, *, dynamic_img_size: bool = True, **options: Any) -> OpenClipPE:
    """Give the timm image tower of an open_clip model the encoding ``pe``.

    Args:
        model: an open_clip ``CLIP`` / ``CustomTextCLIP`` whose ``visual`` is open_clip's ``TimmModel``
            (a ``timm_model_name`` config) around a timm ``VisionTransformer`` or ``Eva``.
        pe: encoding spec (``'rope_mixed'``, ``'liere'``, ``vispe.timm_pe_spec(model.visual.trunk)`` for the
            tower's own encoding, ...).
        dynamic_img_size: let the tower take any image size the patch divides (default on; open_clip's
            preprocessing still resizes to ``model.visual.image_size`` unless given another size).
        options: options of a single encoding, as in `vispe.convert`.

    Returns:
        An `OpenClipPE` handle: ``.tower`` (the vispe trunk) and ``.remove()``.

    Raises:
        TypeError: ``model`` is not an open_clip model with a timm image tower (open_clip's own
            ``VisionTransformer`` towers are not timm models: build the model from a config with
            ``timm_model_name``).
        ValueError: a trunk vispe cannot host, or an encoding that cannot apply to it (`vispe.convert`).
    """
    open_clip = _open_clip()
    from ..zoo import convert
    visual = getattr(model, 'visual', None)
    if not isinstance(visual, open_clip.timm_model.TimmModel):
        raise TypeError(f'use_pe takes an open_clip model whose image tower is a timm model (open_clip TimmModel, '
                        f'built from a config with vision_cfg.timm_model_name); got visual='
                        f'{type(visual).__name__ if visual is not None else None}')
    original = visual.trunk
    trunk = convert(copy.deepcopy(original), pe, **options)
    if dynamic_img_size:
        _make_dynamic(trunk)
    visual.trunk = trunk
    return OpenClipPE(visual, original)
