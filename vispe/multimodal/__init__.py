"""Deprecated: the multimodal position ids are encodings now; this module keeps the old names for one release.

=====================================================  =====================================================
old (`vispe.multimodal`)                               new
=====================================================  =====================================================
``mm.Text`` / ``mm.Image`` / ``mm.Video``, a layout    ``vispe.Text`` / ``vispe.Image`` / ``vispe.Video``,
                                                       ``vispe.sequence(layout)``
``mm.position_ids(layout, scheme='videorope',          ``pe = vispe.create_pe('videorope:delta=2', ...)``;
delta=2)``                                             ``pe.position_ids(vispe.sequence(layout))``
``mm.position_ids(input_ids, image_grid_thw=...)``     ``vispe.integrations.transformers_vlm.rope_index(pe,
                                                       input_ids, image_grid_thw=...)``
``mm.MultimodalRotary(hd, scheme='mrope')(ids)``       ``pe.cos_sin(ids)`` (or ``pe.prepare(positions)`` and
                                                       ``pe_attention``)
``mm.apply_rotary``, ``mm.decode_position_ids``        `vispe.encodings.multimodal`
scheme ``'rope'``                                      encoding ``'rope_1d'``
=====================================================  =====================================================
"""
from __future__ import annotations

import warnings
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..contract import PEContext
from ..encodings.circlerope import CircleRoPE
from ..encodings.mrope import MHRoPE, MRoPE, MRoPEInterleave, default_head_sections, default_sections
from ..encodings.multimodal import MultimodalRoPE, RoPE1D, apply_rotary, decode_position_ids, rotary_table
from ..encodings.v2pe import V2PE
from ..encodings.videorope import HoPE, VideoRoPE
from ..encodings.vrope import VRoPE
from ..integrations._qwen_ids import QWEN2_VL_TOKEN_IDS, RULES, rope_index
from ..positions.multimodal import IMAGE, TEXT, VIDEO, Image, SegmentTable, Text, Video, padding_mask, sequence

warnings.warn('vispe.multimodal is deprecated and will be removed in the next release: the schemes are registered '
              "encodings ('mrope', 'videorope:delta=2', ...), layouts are vispe.sequence([vispe.Text(n), ...]); "
              'see the table in vispe.multimodal\'s docstring', DeprecationWarning, stacklevel=2)

__all__ = [
    'Text', 'Image', 'Video', 'SegmentTable', 'padding_mask', 'TEXT', 'IMAGE', 'VIDEO', 'QWEN2_VL_TOKEN_IDS',
    'Scheme', 'RoPE1D', 'MRoPE', 'MRoPEInterleave', 'MHRoPE', 'VRoPE', 'V2PE', 'VideoRoPE', 'HoPE', 'CircleRoPE',
    'SCHEMES', 'RULES',
    'get_scheme', 'position_ids', 'decode_position_ids',
    'MultimodalRotary', 'apply_rotary', 'rotary_table', 'default_sections', 'default_head_sections',
]

Scheme = MultimodalRoPE
SCHEMES = {'rope': RoPE1D, 'mrope': MRoPE, 'mrope_interleave': MRoPEInterleave, 'mhrope': MHRoPE, 'vrope': VRoPE,
           'v2pe': V2PE, 'videorope': VideoRoPE, 'hope': HoPE, 'circlerope': CircleRoPE}
"""Old scheme names -> the encoding classes (``'rope'`` is the encoding ``'rope_1d'``)."""


def _context(head_dim: int = 64, num_heads: int = 8) -> PEContext:
    return PEContext(dim=head_dim * num_heads, num_heads=num_heads, head_dim=head_dim)


def _class(scheme: str):
    if scheme not in SCHEMES:
        raise ValueError(f'scheme must be one of {tuple(SCHEMES)}, got {scheme!r}')
    return SCHEMES[scheme]


def _circlerope_options(options: dict) -> dict:
    """Circle-RoPE's old option values: ``radius='auto'`` / ``'auto-k'`` and ``move_to_positive='auto'`` / a
    number, which the encoding spells ``auto_radius=k`` and ``move_to_positive=True, positive_offset=x``."""
    options = dict(options)
    radius = options.get('radius')
    if isinstance(radius, str):
        scale = radius[len('auto-'):] if radius.startswith('auto-') else '1' if radius == 'auto' else None
        try:
            options['auto_radius'] = float(scale)
        except (TypeError, ValueError):
            raise ValueError(f"option 'radius' of encoding 'circlerope' must be a number, 'auto' or 'auto-<k>' "
                             f'(the encoding\'s auto_radius=k), got {radius!r}') from None
        del options['radius']
    move = options.get('move_to_positive')
    if move == 'auto':
        options['move_to_positive'] = True
    elif isinstance(move, (int, float)) and not isinstance(move, bool):
        options.update(move_to_positive=True, positive_offset=float(move))
    return options


def get_scheme(scheme: Union[str, MultimodalRoPE], **options: Any) -> MultimodalRoPE:
    """The encoding of an old scheme name with its options (or the encoding itself), for its ids."""
    if isinstance(scheme, MultimodalRoPE):
        if options:
            raise ValueError(f'options {sorted(options)} given with an encoding instance; set them when building it')
        return scheme
    cls = _class(scheme)
    return cls(_context(), **(_circlerope_options(options) if cls is CircleRoPE else options))


def position_ids(inputs, *, scheme: Union[str, MultimodalRoPE] = 'mrope', image_grid_thw=None, video_grid_thw=None,
                 second_per_grid_ts=None, attention_mask=None,
                 image_token_id: int = QWEN2_VL_TOKEN_IDS['image_token_id'],
                 video_token_id: int = QWEN2_VL_TOKEN_IDS['video_token_id'],
                 vision_start_token_id: int = QWEN2_VL_TOKEN_IDS['vision_start_token_id'],
                 spatial_merge_size: int = 2, video_blocks: Optional[str] = None, mm_token_type_ids=None,
                 rule: str = '5.x', padding_side: str = 'right', training: bool = False,
                 generator: Optional[torch.Generator] = None, pad_value: Optional[int] = None,
                 device: Optional[torch.device] = None, **options: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ids and ``rope_delta`` of a layout, a list of layouts or Qwen-VL token ids (see the module table)."""
    pe = get_scheme(scheme, **options)
    if rule not in RULES:
        raise ValueError(f'rule must be one of {RULES}, got {rule!r}')
    if torch.is_tensor(inputs):
        return rope_index(pe, inputs, rule=rule, video_blocks=video_blocks, training=training, generator=generator,
                          pad_value=pad_value, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                          second_per_grid_ts=second_per_grid_ts, attention_mask=attention_mask,
                          mm_token_type_ids=mm_token_type_ids, image_token_id=image_token_id,
                          video_token_id=video_token_id, vision_start_token_id=vision_start_token_id,
                          spatial_merge_size=spatial_merge_size)
    pos = sequence(inputs, padding_side=padding_side, device=device)
    return pe.position_ids(pos, training=training, generator=generator, pad_value=1 if pad_value is None else pad_value)


class MultimodalRotary(nn.Module):
    """cos/sin of ids under a scheme's rotary allocation: the encoding's `cos_sin` (kept for one release)."""

    def __init__(self, head_dim: int, theta: float = 1e6, scheme: Union[str, MultimodalRoPE] = 'mrope',
                 sections: Optional[Sequence[int]] = None, rotary_dim: Optional[int] = None,
                 num_heads: Optional[int] = None, head_sections: Optional[Sequence[int]] = None,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        cls = type(scheme) if isinstance(scheme, MultimodalRoPE) else _class(scheme)
        if cls is MHRoPE and num_heads is None:
            raise ValueError('scheme mhrope assigns heads to axes: pass num_heads (key/value heads under GQA)')
        options = {k: tuple(v) for k, v in (('sections', sections), ('head_sections', head_sections)) if v is not None}
        self.encoding = cls(_context(head_dim, num_heads or 1), theta=float(theta), rotary_dim=rotary_dim, **options)
        if device is not None:
            self.encoding.to(device)
        self.scheme = next(k for k, v in SCHEMES.items() if v is cls)
        self.axes, self.head_dim, self.rotary_dim, self.theta = cls.axes, head_dim, self.encoding.rotary_dim, theta
        self.sections = getattr(self.encoding, 'sections', None) if cls is not MHRoPE else None
        self.head_sections = getattr(self.encoding, 'head_sections', None)
        self.mode = 'heads' if cls is MHRoPE else 'pairs'

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.encoding.inv_freq()

    @property
    def pair_layout(self) -> Optional[str]:
        return self.encoding.pair_layout

    @property
    def head_layout(self) -> Optional[str]:
        return self.encoding.head_layout

    def angles(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoding.angles(ids)

    def forward(self, ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.encoding.cos_sin(ids, dtype)

    def table(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoding.table(ids)
