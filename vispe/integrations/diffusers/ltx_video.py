"""LTX-Video (``LTXVideoTransformer3DModel``).

LTX-Video's own rotary: ``rope`` (``LTXVideoRotaryPosEmbed(inner_dim, base 20 frames, 2048 x 2048 px)``)
places token ``i`` of axis ``a`` at the normalised coordinate ``c = i * s_a * p_a / base_a`` (``s_a``: the
pipeline's ``rope_interpolation_scale``, the VAE's compression in frames / pixels; without it ``c = i``;
``video_coords`` gives ``c * base_a`` directly) and rotates by ``f_k (2c - 1)`` with ``f_k = theta^(k / (F -
1)) pi / 2`` increasing, ``F = inner_dim // 6``, the three axes interleaved per frequency, over the whole
query width before the heads split (leftover channels unrotated, first). Only the video self-attention
(``attn1``) is rotated.

The scaling methods act on the frequencies per token, ``g_k = 2 f_k s_a p_a / base_a`` (``2 f_k`` without
``rope_interpolation_scale``), sorted from high to low as NTK and YaRN define them; the host's own
``rope_interpolation_scale`` remains what the pipeline passes. A call with ``video_coords`` (the
condition pipeline) has no token spacing to scale: with ``scaling`` it is refused.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch import nn

from ...attention import pe_attention
from ..base import UnsupportedModelError
from .host import Host
from .state import DiTState, TimestepSlot, prepare_state

__all__ = ['LTXVideoHost', 'LTXVideoRope', 'LTXVideoProcessor']


class LTXVideoRope(TimestepSlot):
    """LTX-Video's ``rope`` under a patch: ``(hidden_states, num_frames, height, width,
    rope_interpolation_scale, video_coords) -> (cos, sin)`` ``(B, N, inner_dim)`` (the host's rotary,
    frequency-scaled as configured) or, with a vispe encoding, a `DiTState`."""

    def __init__(self, dim: int, base: Tuple[int, int, int], patch: Tuple[int, int, int], theta: float, scaling,
                 encoding, train_grid) -> None:
        super().__init__()
        self.dim, self.base, self.patch, self.theta = dim, base, patch, theta
        self.scaling, self.train_grid, self.encoding = scaling, train_grid, encoding

    def _coords(self, batch: int, shape: Tuple[int, int, int], scale: Optional[Any], device: torch.device
                ) -> torch.Tensor:
        """``(B, N, 3)`` normalised coordinates, as the host computes them."""
        axes = [torch.arange(n, dtype=torch.float32, device=device) for n in shape]
        grid = torch.stack(torch.meshgrid(*axes, indexing='ij'), dim=0).unsqueeze(0).repeat(batch, 1, 1, 1, 1)
        if scale is not None:
            for a in range(3):
                grid[:, a:a + 1] = grid[:, a:a + 1] * scale[a] * self.patch[a] / self.base[a]
        return grid.flatten(2, 4).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, num_frames: Optional[int] = None, height: Optional[int] = None,
                width: Optional[int] = None, rope_interpolation_scale: Optional[Any] = None,
                video_coords: Optional[torch.Tensor] = None) -> Any:
        device, batch = hidden_states.device, hidden_states.size(0)
        if self.encoding is not None:
            if video_coords is not None:
                raise ValueError('patch_dit: a vispe encoding in LTX-Video positions the latent grid (num_frames, '
                                 'height, width); video_coords (the condition pipeline) are the LTX rotary\'s')
            return prepare_state(self.encoding, (num_frames, height, width), 0, self.train_grid, device, joint=False,
                                 image_only=True)
        if video_coords is None:
            grid = self._coords(batch, (num_frames, height, width), rope_interpolation_scale, device)
        else:
            grid = torch.stack([video_coords[:, a] / self.base[a] for a in range(3)], dim=-1)
        count = self.dim // 6
        freqs = self.theta ** torch.linspace(math.log(1.0, self.theta), math.log(self.theta, self.theta), count,
                                             device=device, dtype=torch.float32)
        freqs = freqs * math.pi / 2.0
        mags = None
        if self.scaling.active:
            if video_coords is not None:
                raise ValueError('patch_dit: LTX-Video called with video_coords has no token spacing to scale; '
                                 'scaling applies to calls with num_frames, height and width (LTXPipeline)')
            freqs, mags = self._scaled(freqs, (num_frames, height, width), rope_interpolation_scale)
        angles = freqs * (grid.unsqueeze(-1) * 2 - 1)  # (B, N, 3, F)
        cos, sin = angles.cos(), angles.sin()
        if mags is not None:  # YaRN's temperature, per axis
            cos, sin = cos * mags, sin * mags
        cos = cos.transpose(-1, -2).flatten(2).repeat_interleave(2, dim=-1)
        sin = sin.transpose(-1, -2).flatten(2).repeat_interleave(2, dim=-1)
        if self.dim % 6:
            cos = torch.cat([torch.ones_like(cos[:, :, :self.dim % 6]), cos], dim=-1)
            sin = torch.cat([torch.zeros_like(sin[:, :, :self.dim % 6]), sin], dim=-1)
        return cos, sin

    def _scaled(self, freqs: torch.Tensor, shape: Tuple[int, int, int], scale: Optional[Any]
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(3, F)`` frequencies of each axis scaled on their per-token values, and ``(3, 1)`` magnitudes."""
        options = self.scaling.at(self.noise_level)
        out, mags = [], []
        for a, name in enumerate(('t', 'h', 'w')):
            spacing = 2.0 * (float(scale[a]) * self.patch[a] / self.base[a] if scale is not None else 1.0)
            per_token, mag = self.scaling.axis_frequencies(options, name, (freqs * spacing).flip(0), float(shape[a]))
            out.append(per_token.flip(0) / spacing)
            mags.append(mag)
        return torch.stack(out), torch.tensor(mags, dtype=freqs.dtype, device=freqs.device)[:, None]

    def extra_repr(self) -> str:
        return f'dim={self.dim}, base={self.base}, theta={self.theta}, scaling=({self.scaling.describe()})'


class LTXVideoProcessor:
    """LTX-Video's self-attention processor with a vispe encoding: the host's projections and q/k norms
    (across heads), then `vispe.pe_attention` with the `DiTState` handed as ``image_rotary_emb``."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb: Optional[DiTState] = None
                 ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError('the patched LTX-Video self-attention takes neither encoder_hidden_states nor a mask')
        query, key = attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states))
        value = attn.to_v(hidden_states)
        query, key, value = (t.unflatten(2, (attn.heads, -1)).transpose(1, 2) for t in (query, key, value))
        prepared = image_rotary_emb.image if image_rotary_emb is not None else None
        out = pe_attention(query, key, value, prepared, self.layer, x=hidden_states)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


class LTXVideoHost(Host):
    attention = 'attn1'
    processor = LTXVideoProcessor
    label = 'LTX-Video'
    classes = ('LTXVideoTransformer3DModel',)
    axes = ('t', 'h', 'w')
    video = True
    joint_text = False  # text enters by cross-attention (attn2), which sees no positions

    def check(self, transformer):
        if type(getattr(transformer, 'rope', None)).__name__ != 'LTXVideoRotaryPosEmbed':
            raise UnsupportedModelError('patch_dit: this LTXVideoTransformer3DModel has no LTXVideoRotaryPosEmbed rope')

    def train_grid(self, transformer):
        cfg = transformer.config  # the pipeline's 161 frames at 512 x 704: 8x time, 32x space VAE
        return (21 // cfg.patch_size_t, 16 // cfg.patch_size, 22 // cfg.patch_size)

    def pixels(self, transformer):
        cfg = transformer.config
        return (lambda f: ((f - 1) // 8 + 1) // cfg.patch_size_t, lambda px: px // (32 * cfg.patch_size),
                lambda px: px // (32 * cfg.patch_size))

    def make_rope(self, handle):
        own = handle.model.rope
        return LTXVideoRope(own.dim, (own.base_num_frames, own.base_height, own.base_width),
                            (own.patch_size_t, own.patch_size, own.patch_size), own.theta, handle.scaling,
                            handle.encoding, handle.train_grid)
