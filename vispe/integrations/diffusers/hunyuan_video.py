"""HunyuanVideo (``HunyuanVideoTransformer3DModel``).

HunyuanVideo's own rotary: ``rope`` (``HunyuanVideoRotaryPosEmbed(patch_size, patch_size_t, rope_axes_dim,
theta=256)``) turns the latent grid into ``(cos, sin)`` ``(N, head_dim)``: time, rows and columns with their
``rope_axes_dim`` channels, angles in float32, pairs interleaved. The processors apply them to the video
tokens of the joint ``[video, text]`` sequence (text last, unrotated; padded text masked). Time, rows and
columns are the scaled axes; RIFLEx was shown on this model (its temporal table: base 256, 16 channels).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ...attention import pe_attention
from ..base import UnsupportedModelError
from .host import Host, axis_tables, interleaved_cos_sin
from .state import DiTState, TimestepSlot, prepare_state

__all__ = ['HunyuanVideoHost', 'HunyuanVideoRope', 'HunyuanVideoProcessor']


class HunyuanVideoRope(TimestepSlot):
    """HunyuanVideo's ``rope`` under a patch: ``hidden_states -> (cos, sin)`` (the host's rotary,
    frequency-scaled as configured) or, with a vispe encoding, a `DiTState`."""

    def __init__(self, patch_size: int, patch_size_t: int, rope_dim, theta: float, scaling, encoding,
                 train_grid) -> None:
        super().__init__()
        self.patch_size, self.patch_size_t, self.rope_dim, self.theta = patch_size, patch_size_t, tuple(rope_dim), theta
        self.scaling, self.train_grid, self.encoding = scaling, train_grid, encoding

    def forward(self, hidden_states: torch.Tensor) -> Any:
        _, _, frames, height, width = hidden_states.shape
        shape = (frames // self.patch_size_t, height // self.patch_size, width // self.patch_size)
        device = hidden_states.device
        if self.encoding is not None:
            return prepare_state(self.encoding, shape, 0, self.train_grid, device, joint=False)  # text: per attention
        options = self.scaling.at(self.noise_level) if self.scaling.active else None
        axes = [torch.arange(n, device=device, dtype=torch.float32) for n in shape]
        lengths = dict(zip(('t', 'h', 'w'), map(float, shape)))
        return interleaved_cos_sin(axis_tables(self.scaling, options, self.rope_dim, self.theta, ('t', 'h', 'w'),
                                               axes, lengths, torch.float32), shape)

    def extra_repr(self) -> str:
        return f'rope_dim={self.rope_dim}, theta={self.theta}, scaling=({self.scaling.describe()})'


class HunyuanVideoProcessor:
    """HunyuanVideo's joint attention processor with a vispe encoding: the host's projections and q/k
    norms (single-stream blocks project the text with the video's weights), then `vispe.pe_attention` over
    ``[text, video]`` (text first, as prefix tokens; the host's text mask moved with it), outputs back in the
    host's ``(video, text)`` order."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb: Optional[DiTState] = None) -> Any:
        if encoder_hidden_states is None:
            raise ValueError('the patched HunyuanVideo attention takes the text stream (encoder_hidden_states)')
        joint = attn.add_q_proj is not None  # double-stream: the text has its own projections and norms

        def heads(proj: nn.Module, x: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
            t = proj(x).unflatten(2, (attn.heads, -1))
            return norm(t) if norm is not None else t

        text_len = encoder_hidden_states.shape[1]
        q = torch.cat([heads(attn.add_q_proj if joint else attn.to_q, encoder_hidden_states,
                             attn.norm_added_q if joint else attn.norm_q),
                       heads(attn.to_q, hidden_states, attn.norm_q)], dim=1)
        k = torch.cat([heads(attn.add_k_proj if joint else attn.to_k, encoder_hidden_states,
                             attn.norm_added_k if joint else attn.norm_k),
                       heads(attn.to_k, hidden_states, attn.norm_k)], dim=1)
        v = torch.cat([heads(attn.add_v_proj if joint else attn.to_v, encoder_hidden_states, None),
                       heads(attn.to_v, hidden_states, None)], dim=1)
        if attention_mask is not None:  # the host's (B, 1, 1, N) over [video, text]
            attention_mask = torch.cat([attention_mask[..., -text_len:], attention_mask[..., :-text_len]], dim=-1)
        prepared = image_rotary_emb.joint(text_len) if image_rotary_emb is not None else None
        out = pe_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), prepared, self.layer,
                           x=torch.cat([encoder_hidden_states, hidden_states], dim=1), attn_mask=attention_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(q.dtype)
        text, video = out[:, :text_len], out[:, text_len:]
        if getattr(attn, 'to_out', None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))
        if getattr(attn, 'to_add_out', None) is not None:
            text = attn.to_add_out(text)
        return video, text


class HunyuanVideoHost(Host):
    block_lists = ('transformer_blocks', 'single_transformer_blocks')
    processor = HunyuanVideoProcessor
    state_arg = ('image_rotary_emb', 4)
    label = 'HunyuanVideo'
    classes = ('HunyuanVideoTransformer3DModel',)
    axes = ('t', 'h', 'w')
    video = True

    def check(self, transformer):
        if type(getattr(transformer, 'rope', None)).__name__ != 'HunyuanVideoRotaryPosEmbed':
            raise UnsupportedModelError('patch_dit: this HunyuanVideoTransformer3DModel has no '
                                        'HunyuanVideoRotaryPosEmbed rope')

    def train_grid(self, transformer):
        cfg = transformer.config  # 129 frames at 720 x 1280: 4x time, 8x space VAE
        return (33 // cfg.patch_size_t, 90 // cfg.patch_size, 160 // cfg.patch_size)

    def pixels(self, transformer):
        cfg = transformer.config
        return (lambda f: ((f - 1) // 4 + 1) // cfg.patch_size_t, lambda px: px // (8 * cfg.patch_size),
                lambda px: px // (8 * cfg.patch_size))

    def make_rope(self, handle):
        own = handle.model.rope
        return HunyuanVideoRope(own.patch_size, own.patch_size_t, own.rope_dim, own.theta, handle.scaling,
                                handle.encoding, handle.train_grid)
