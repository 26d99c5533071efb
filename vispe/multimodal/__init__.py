"""Multimodal position ids and rotary embeddings for vision-language models (the LLM side).

``from vispe import multimodal as mm``::

    layout = [mm.Text(12), mm.Image(grid=(1, 28, 28), merge=2), mm.Text(5),
              mm.Video(grid=(8, 28, 28), fps=2.0), mm.Text(40)]
    ids, rope_delta = mm.position_ids(layout, scheme='mrope')                  # (3, N)
    ids, rope_delta = mm.position_ids(input_ids, image_grid_thw=..., video_grid_thw=...,
                                      attention_mask=..., scheme='mrope_interleave')  # (3, B, L)
    rotary = mm.MultimodalRotary(head_dim=128, theta=1e6, scheme='mrope')
    cos, sin = rotary(ids)
    q, k = mm.apply_rotary(q, k, cos, sin)

Schemes: ``rope`` (1D baseline), ``mrope`` (Qwen2-VL, Qwen2.5-VL time), ``mrope_interleave``
(MRoPE-I / Qwen3-VL, optional spatial reset), ``mhrope`` (heads per axis), ``vrope``, ``v2pe``
(fractional visual steps), ``videorope``, ``hope`` (VideoRoPE layout with dynamic temporal scaling,
temporal pairs NoPE), ``circlerope`` (visual tokens on a circle orthogonal to the text axis).
Token ids follow transformers' ``get_rope_index``: its 5.x rule by default, ``rule='4.x'`` for 4.x.
"""
from .layout import IMAGE, QWEN2_VL_TOKEN_IDS, TEXT, VIDEO, Image, SegmentTable, Text, Video, padding_mask
from .ids import (
    RULES, SCHEMES, CircleRoPE, HoPE, MHRoPE, MRoPE, MRoPEInterleave, RoPE1D, Scheme, V2PE, VideoRoPE, VRoPE,
    decode_position_ids, get_scheme, position_ids,
)
from .rotary import MultimodalRotary, apply_rotary, default_head_sections, default_sections, rotary_table

__all__ = [
    'Text', 'Image', 'Video', 'SegmentTable', 'padding_mask', 'TEXT', 'IMAGE', 'VIDEO', 'QWEN2_VL_TOKEN_IDS',
    'Scheme', 'RoPE1D', 'MRoPE', 'MRoPEInterleave', 'MHRoPE', 'VRoPE', 'V2PE', 'VideoRoPE', 'HoPE', 'CircleRoPE',
    'SCHEMES', 'RULES',
    'get_scheme', 'position_ids', 'decode_position_ids',
    'MultimodalRotary', 'apply_rotary', 'rotary_table', 'default_sections', 'default_head_sections',
]
