"""Wan 2.x (``WanTransformer3DModel``: Wan 2.1 and 2.2 text / image to video).

Wan's own rotary: ``rope`` (``WanRotaryPosEmbed(head_dim, patch_size, rope_max_seq_len)``) stores float64-
computed ``(cos, sin)`` tables of positions ``0 .. rope_max_seq_len - 1`` for time, rows and columns (time
gets ``head_dim - 4 (head_dim // 6)`` channels, rows and columns ``2 (head_dim // 6)`` each, pairs
interleaved) and slices them per forward. Past ``rope_max_seq_len`` latent frames (or rows) it fails with
a ``view`` error, and ``.to(torch.bfloat16)`` turns its tables bf16 although ``rope`` is listed in
``_keep_in_fp32_modules``. The patched module computes each forward's tables (float64 angles, float32
tables, whatever the model's dtype), so any length runs. Time, rows and columns are the scaled axes;
only the self-attention (``attn1``) of each block sees positions.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import nn

from ...attention import pe_attention
from ...contract import PositionalEncoding
from ..base import UnsupportedModelError
from .host import Host, axis_tables, interleaved_cos_sin
from .scaling import DiTScaling
from .state import DiTState, TimestepSlot, prepare_state

__all__ = ['WanHost', 'WanRope', 'WanProcessor']


class WanRope(TimestepSlot):
    """Wan's ``rope`` under a patch: ``hidden_states -> (cos, sin)`` ``(1, N, 1, head_dim)`` (the host's
    rotary, frequency-scaled as configured) or, with a vispe encoding, a `DiTState`."""

    def __init__(self, dims: Tuple[int, int, int], patch_size: Tuple[int, int, int], theta: float,
                 scaling: DiTScaling, encoding: Optional[PositionalEncoding], train_grid: Tuple[int, int, int]) -> None:
        super().__init__()
        self.dims, self.patch_size, self.theta = dims, patch_size, theta
        self.scaling, self.train_grid, self.encoding = scaling, train_grid, encoding

    def forward(self, hidden_states: torch.Tensor) -> Any:
        _, _, frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.patch_size
        shape = (frames // p_t, height // p_h, width // p_w)
        device = hidden_states.device
        if self.encoding is not None:
            return prepare_state(self.encoding, shape, 0, self.train_grid, device)
        options = self.scaling.at(self.noise_level) if self.scaling.active else None
        dtype = torch.float32 if torch.backends.mps.is_available() else torch.float64  # as the host builds its table
        axes = [torch.arange(n, device=device, dtype=dtype) for n in shape]
        lengths = dict(zip(('t', 'h', 'w'), map(float, shape)))
        cos, sin = interleaved_cos_sin(axis_tables(self.scaling, options, self.dims, self.theta, ('t', 'h', 'w'),
                                                   axes, lengths, dtype), shape)
        return cos[None, :, None], sin[None, :, None]

    def extra_repr(self) -> str:
        return f'dims={self.dims}, theta={self.theta}, scaling=({self.scaling.describe()})'


class WanProcessor:
    """Wan's self-attention processor with a vispe encoding: the host's projections and q/k norms (across
    heads), then `vispe.pe_attention` with the `DiTState` handed as ``rotary_emb``."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, rotary_emb: Optional[DiTState] = None) -> torch.Tensor:
        from diffusers.models.transformers.transformer_wan import _get_qkv_projections
        if encoder_hidden_states is not None:
            raise ValueError('the patched Wan self-attention takes no encoder_hidden_states')
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value))
        prepared = rotary_emb.prepared if rotary_emb is not None else None
        out = pe_attention(query, key, value, prepared, self.layer, attn_mask=attention_mask, x=hidden_states)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


class WanHost(Host):
    block_lists = ('blocks',)
    attention = 'attn1'
    processor = WanProcessor
    state_arg = ('rotary_emb', 3)
    label = 'Wan'
    classes = ('WanTransformer3DModel',)
    axes = ('t', 'h', 'w')
    video = True
    joint_text = False  # text enters by cross-attention (attn2), which sees no positions

    def check(self, transformer):
        rope = getattr(transformer, 'rope', None)
        if type(rope).__name__ != 'WanRotaryPosEmbed':
            raise UnsupportedModelError(f'patch_dit: this WanTransformer3DModel has a {type(rope).__name__} rope; '
                                        f'WanRotaryPosEmbed is supported')

    def train_grid(self, transformer):
        p_t, p_h, p_w = transformer.config.patch_size
        return (21 // p_t, 60 // p_h, 104 // p_w)  # 81 frames at 480 x 832: 4x time, 8x space VAE

    def pixels(self, transformer):
        p_t, p_h, p_w = transformer.config.patch_size
        return (lambda f: ((f - 1) // 4 + 1) // p_t, lambda px: px // (8 * p_h), lambda px: px // (8 * p_w))

    def make_rope(self, handle):
        own = handle.model.rope
        return WanRope((own.t_dim, own.h_dim, own.w_dim), tuple(own.patch_size), 10000.0, handle.scaling,
                       handle.encoding, handle.train_grid)
