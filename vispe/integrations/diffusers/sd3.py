"""Stable Diffusion 3 / 3.5 (``SD3Transformer2DModel``).

SD3's own encoding is additive: ``pos_embed`` (a ``PatchEmbed``) stores a ``pos_embed_max_size``-square
2D sin-cos table (MAE's layout: the column's ``[sin | cos]`` channels, then the row's; frequencies
``1 / 10000^(k / (C/4))`` in float64) whose row / column ``r`` sits at coordinate ``r * base / M``
(``base = sample_size // patch_size``, ``M = pos_embed_max_size``), and adds its centred crop (top row
``(M - h) // 2``) to the patch tokens. A grid beyond ``M`` is refused ("Height (..) cannot be greater than
`pos_embed_max_size`"): that is the host's own limit, not the formula's. The patched ``pos_embed`` computes
the same table for each forward's grid in float32 (the host's buffer follows the model to bf16): within
``M`` the host's crop, beyond it the same formula continued past the stored rows (the crop's top row
negative), so larger grids run; the scaling methods act on its frequencies (per axis, on the token
spacing; YaRN's temperature has no logit to act on in an additive table and is not applied).

With a vispe encoding: the additive part (if any) replaces the table; attention hooks run in vispe
processors over ``[text, image]`` (text first, as prefix tokens), the prepared encoding reaching them
through ``joint_attention_kwargs`` (the transformer's forward pre-hook adds it as ``vispe_state``), the
host's own channel to every processor; SD3.5's image-only ``attn2`` takes the image-only preparation.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from ...attention import pe_attention
from ...contract import PEContext, PositionalEncoding
from ...positions import grid
from ...rotary.frequencies import axial_frequencies
from ..base import UnsupportedModelError
from .host import Host
from .scaling import DiTScaling
from .state import DiTState, TimestepSlot, argument, prepare_state, with_argument

__all__ = ['SD3Host', 'SD3Table', 'SD3Processor']


class SD3Table(TimestepSlot):
    """SD3's position table under a patch (registered as ``transformer.vispe_pe``): the additive embedding
    ``(1, h * w, C)`` of an ``h x w`` token grid, float32: the host's sin-cos formula (scaled as configured)
    or the vispe encoding's embedding (zeros for an encoding without one)."""

    def __init__(self, dim: int, max_size: int, base_size: int, interpolation_scale: float, scaling: DiTScaling,
                 encoding: Optional[PositionalEncoding], train_grid: Tuple[int, int]) -> None:
        super().__init__()
        self.dim, self.max_size, self.base_size = dim, max_size, base_size
        self.interpolation_scale = interpolation_scale
        self.scaling, self.train_grid, self.encoding = scaling, train_grid, encoding

    def _axis(self, n: int, name: str, options: Any, device: torch.device) -> torch.Tensor:
        """``(n, C/2)`` ``[sin | cos]`` of the ``n`` rows (columns) of a centred crop, float64."""
        half = self.dim // 4
        omega = axial_frequencies(half, 10000.0, step=1.0, dim=half, dtype=torch.float64, device=device)
        index = torch.arange(n, device=device, dtype=torch.float32) + (self.max_size - n) // 2
        if options is None:  # the host's coordinates, bit for bit: index / (M / base) / interpolation_scale
            angles = torch.outer(index / (self.max_size / self.base_size) / self.interpolation_scale, omega)
        else:  # per-token frequencies, scaled on the token spacing
            spacing = self.base_size / self.max_size / self.interpolation_scale
            freqs, _ = self.scaling.axis_frequencies(options, name, omega * spacing, float(n))
            angles = torch.outer(index.double(), freqs)
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    def forward(self, h: int, w: int, device: torch.device) -> torch.Tensor:
        if self.encoding is not None:
            if not self.encoding.capabilities.additive:
                return torch.zeros(1, h * w, self.dim, device=device)
            return self.encoding.embedding(grid(h, w, train_grid=self.train_grid, device=device)).float().reshape(
                1, h * w, -1)
        options = self.scaling.at(self.noise_level) if self.scaling.active else None
        cols, rows = self._axis(w, 'w', options, device), self._axis(h, 'h', options, device)
        table = torch.cat([cols[None, :, :].expand(h, w, -1), rows[:, None, :].expand(h, w, -1)], dim=-1)
        return table.reshape(1, h * w, -1).float()

    def patch_embed(self, embed: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        """The forward of SD3's ``PatchEmbed`` ``embed``: its projection, then this table (any grid)."""
        height, width = latent.shape[-2:]
        h, w = height // embed.patch_size, width // embed.patch_size
        latent = embed.proj(latent)
        if embed.flatten:
            latent = latent.flatten(2).transpose(1, 2)
        if embed.layer_norm:
            latent = embed.norm(latent)
        return (latent + self(h, w, latent.device)).to(latent.dtype)

    def extra_repr(self) -> str:
        return f'max_size={self.max_size}, base_size={self.base_size}, scaling=({self.scaling.describe()})'


class SD3Processor:
    """SD3's joint attention processor with a vispe encoding: the host's projections and q/k norms, then
    `vispe.pe_attention` over ``[text, image]`` (``'joint'``) or the image tokens alone (``'image'``: SD3.5's
    ``attn2``), with the `DiTState` handed as ``vispe_state``."""

    def __init__(self, layer: int, kind: str) -> None:
        self.layer, self.kind = layer, kind

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, vispe_state: Optional[DiTState] = None) -> Any:
        b, heads = hidden_states.shape[0], attn.heads

        def split(proj: nn.Module, x: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
            t = proj(x).view(b, -1, heads, attn.inner_dim // heads).transpose(1, 2)
            return norm(t) if norm is not None else t

        q, k, v = split(attn.to_q, hidden_states, attn.norm_q), split(attn.to_k, hidden_states, attn.norm_k), \
            split(attn.to_v, hidden_states, None)
        x = hidden_states
        if encoder_hidden_states is not None:
            q = torch.cat([split(attn.add_q_proj, encoder_hidden_states, attn.norm_added_q), q], dim=2)
            k = torch.cat([split(attn.add_k_proj, encoder_hidden_states, attn.norm_added_k), k], dim=2)
            v = torch.cat([split(attn.add_v_proj, encoder_hidden_states, None), v], dim=2)
            x = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        prepared = None
        if vispe_state is not None:
            prepared = vispe_state.prepared if self.kind == 'joint' else vispe_state.image
        out = pe_attention(q, k, v, prepared, self.layer, x=x, attn_mask=attention_mask)
        out = out.transpose(1, 2).reshape(b, -1, attn.inner_dim).to(q.dtype)
        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            text, out = out[:, :text_len], out[:, text_len:]
            if not attn.context_pre_only:
                text = attn.to_add_out(text)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, text) if encoder_hidden_states is not None else out


class SD3Host(Host):
    label = 'SD3'
    classes = ('SD3Transformer2DModel',)
    axes = ('h', 'w')

    def check(self, transformer):
        embed = getattr(transformer, 'pos_embed', None)
        if type(embed).__name__ != 'PatchEmbed' or embed.pos_embed_max_size is None or embed.pos_embed is None:
            raise UnsupportedModelError('patch_dit: SD3 with a PatchEmbed pos_embed that stores a pos_embed_max_size '
                                        'sin-cos table is supported (the released SD3 / SD3.5 models)')

    def train_grid(self, transformer):
        base = transformer.pos_embed.base_size
        return (base, base)

    def pixels(self, transformer):
        p = transformer.config.patch_size
        return (lambda px: px // (8 * p), lambda px: px // (8 * p))

    def context(self, transformer, train_grid):
        cfg = transformer.config
        depth = len(transformer.transformer_blocks) + sum(
            getattr(b, 'attn2', None) is not None for b in transformer.transformer_blocks)
        return PEContext(dim=cfg.num_attention_heads * cfg.attention_head_dim, num_heads=cfg.num_attention_heads,
                         head_dim=cfg.attention_head_dim, depth=depth, grid_size=train_grid)

    def install(self, handle):
        model = handle.model
        embed = model.pos_embed
        table = SD3Table(embed.pos_embed.shape[-1], embed.pos_embed_max_size, embed.base_size,
                         embed.interpolation_scale, handle.scaling, handle.encoding, handle.train_grid)
        handle.set(model, 'vispe_pe', table, 'vispe_pe')
        handle.set(embed, 'forward', functools.partial(table.patch_embed, embed), 'pos_embed.forward')
        handle.rope = table
        if handle.encoding is None or not handle.encoding.capabilities.in_attention:
            return
        blocks = list(model.transformer_blocks)
        offset = len(blocks)
        for i, block in enumerate(blocks):
            handle.set(block.attn, 'processor', SD3Processor(i, 'joint'), f'transformer_blocks.{i}.attn.processor')
            if getattr(block, 'attn2', None) is not None:
                handle.set(block.attn2, 'processor', SD3Processor(offset, 'image'),
                           f'transformer_blocks.{i}.attn2.processor')
                offset += 1
        index = list(inspect.signature(type(model).forward).parameters)[1:].index('joint_attention_kwargs')
        dual = any(getattr(b, 'attn2', None) is not None for b in blocks)
        handle.add_hook(model, functools.partial(_inject_state, handle.encoding, handle.train_grid,
                                                 model.config.patch_size, index, dual), 'forward_pre',
                        with_kwargs=True, label='SD3Transformer2DModel')


def _inject_state(encoding: PositionalEncoding, train_grid: Tuple[int, int], patch: int, index: int, dual: bool,
                  module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]
                  ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """SD3's forward pre-hook: the encoding prepared for this forward's grid and text, handed to every
    processor in ``joint_attention_kwargs['vispe_state']`` (``index``: that argument's position; ``dual``:
    SD3.5's image-only attentions need their own preparation)."""
    hidden = argument(args, kwargs, 'hidden_states', 0)
    text = argument(args, kwargs, 'encoder_hidden_states', 1)
    h, w = hidden.shape[-2] // patch, hidden.shape[-1] // patch
    state = prepare_state(encoding, (h, w), text.shape[1], train_grid, hidden.device, joint=True, image_only=dual)
    extra = argument(args, kwargs, 'joint_attention_kwargs', index)
    return with_argument(args, kwargs, 'joint_attention_kwargs', index, {**(extra or {}), 'vispe_state': state})
