"""Absolute baselines: no encoding, timm's learned table, and the fixed 2D sin-cos table."""
from __future__ import annotations

import math
from typing import Dict, Literal, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed, trunc_normal_
from torch import nn

from .._tracing import is_tracing
from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from ._checks import check_nonnegative, check_positive
from .base import PEContext, PositionalEncoding

__all__ = ['NoPE', 'LearnedPE', 'SinCosPE']


@register_pe('none', family='baseline')
class NoPE(PositionalEncoding):
    """No positional information (the NoPE baseline): attention is permutation-equivariant."""
    paper = 'NoPE baseline (Kazemnejad et al., NeurIPS 2023)'

    def __init__(self, ctx: PEContext) -> None:
        super().__init__(ctx)


def _pad_prefix_rows(table: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """Zero rows for prefix tokens in front of a ``(1, N, C)`` table."""
    if num_prefix == 0:
        return table
    return torch.cat([table.new_zeros(table.shape[0], num_prefix, table.shape[-1]), table], dim=1)


def _require_grid(name: str, pos: Positions) -> Tuple[int, ...]:
    if pos.grid is None:
        raise ValueError(f'encoding {name!r} needs grid positions (vispe.positions.grid), got a point set')
    return pos.grid


@register_pe('learned', family='baseline')
class LearnedPE(PositionalEncoding):
    """timm's learned absolute position table (Dosovitskiy et al., ICLR 2021).

    The parameter is ``pos_embed`` of shape ``(1, prefix + h * w, C)`` (prefix rows only when
    ``embed_prefix``, timm's ``no_embed_class=False``), initialised with a truncated normal of std
    0.02, so timm ViT checkpoints load unchanged. Other grids resample the table with timm's
    `resample_abs_pos_embed` (bicubic, antialiased: what timm does with ``dynamic_img_size``).

    Args:
        interpolation: resampling mode for other grids.
        antialias: antialias when downsampling the table (bicubic and bilinear only; nearest has none).
        init_std: std of the truncated-normal init (0: a zero table).
    """
    larger_input = 'resample'
    paper = 'Dosovitskiy et al., ICLR 2021 (ViT); timm layout'

    def __init__(
            self,
            ctx: PEContext,
            *,
            interpolation: Literal['bicubic', 'bilinear', 'nearest'] = 'bicubic',
            antialias: bool = True,
            init_std: float = 0.02,
    ) -> None:
        super().__init__(ctx)
        if ctx.grid_size is None:
            raise ValueError("encoding 'learned' needs the training grid: pass grid_size=(h, w) to create_pe")
        self.interpolation = interpolation
        self.antialias = antialias and interpolation != 'nearest'  # F.interpolate cannot antialias nearest
        self.num_table_prefix = ctx.num_prefix_tokens if ctx.embed_prefix else 0
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_table_prefix + math.prod(ctx.grid_size), ctx.dim))
        if check_nonnegative(self.name, 'init_std', init_std):
            trunc_normal_(self.pos_embed, std=init_std)

    def no_weight_decay(self) -> set:
        return {'pos_embed'}

    def _resample(self, table: torch.Tensor, new: Sequence[int], old: Sequence[int]) -> torch.Tensor:
        if tuple(new) == tuple(old):
            return table
        if len(new) == 2:
            return resample_abs_pos_embed(table, new_size=list(new), old_size=list(old),
                                          num_prefix_tokens=self.num_table_prefix,
                                          interpolation=self.interpolation, antialias=self.antialias)
        prefix, grid = table[:, :self.num_table_prefix], table[:, self.num_table_prefix:]
        grid = grid.reshape(1, *old, -1).movedim(-1, 1)
        mode = 'trilinear' if self.interpolation in ('bicubic', 'bilinear') else self.interpolation
        grid = F.interpolate(grid.float(), size=tuple(new), mode=mode).to(table.dtype)
        return torch.cat([prefix, grid.movedim(1, -1).reshape(1, -1, table.shape[-1])], dim=1)

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        old = self.ctx.grid_size
        with torch.no_grad():
            table = self._resample(self.pos_embed.data, grid_size, old)
        self.pos_embed = nn.Parameter(table, requires_grad=self.pos_embed.requires_grad)
        super().set_grid_size(grid_size)

    def embedding(self, pos: Positions) -> torch.Tensor:
        grid = _require_grid(self.name, pos)
        if len(grid) != len(self.ctx.grid_size):
            raise ValueError(f"encoding 'learned' was built for a {len(self.ctx.grid_size)}D grid, got grid {grid}")
        table = self._resample(self.pos_embed, grid, self.ctx.grid_size)
        missing = pos.num_prefix - self.num_table_prefix
        if missing < 0:
            table = table[:, -missing:]
        return _pad_prefix_rows(table, max(missing, 0))

    def embed(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        return x + self.embedding(pos)


@register_pe('sincos', family='baseline')
class SinCosPE(PositionalEncoding):
    """Fixed sin-cos table, 2D as in MAE (He et al., CVPR 2022), any number of axes.

    Convention (``layout='mae'``): the channels are split into one group per axis, in reverse grid
    order (x = column first, then y = row, then t); each group of ``G`` channels is
    ``[sin(p * w_k), cos(p * w_k)]`` with ``G/2`` frequencies ``w_k = 1 / 10000^(k / (G/2))``.
    ``layout='big_vision'`` uses ``w_k = 1 / 10000^(k / (G/2 - 1))`` (big_vision's
    ``posemb_sincos_2d``). Prefix tokens get zeros.

    Args:
        layout: frequency convention, ``'mae'`` or ``'big_vision'``.
        temperature: the base (10000).
        grid_mode: ``index`` (extrapolate) or ``normalized`` (rescaled to the training grid).
    """
    larger_input = 'extrapolate'
    paper = 'He et al., CVPR 2022 (MAE); Vaswani et al. 2017'

    def __init__(
            self,
            ctx: PEContext,
            *,
            layout: Literal['mae', 'big_vision'] = 'mae',
            temperature: float = 10000.0,
            grid_mode: GridMode = 'index',
    ) -> None:
        super().__init__(ctx)
        self.layout = layout
        self.temperature = check_positive(self.name, 'temperature', temperature)
        self.grid_mode = grid_mode
        self._tables: Dict[tuple, torch.Tensor] = {}

    def table(self, coords: torch.Tensor) -> torch.Tensor:
        """The ``(..., N, C)`` sin-cos features of ``(..., N, D)`` coordinates."""
        dim, axes = self.ctx.dim, coords.shape[-1]
        if dim % (2 * axes):
            raise ValueError(f"encoding 'sincos' needs dim divisible by {2 * axes} for {axes} axes, got dim={dim}")
        group = dim // axes
        half = group // 2
        denom = half - 1 if self.layout == 'big_vision' else half
        omega = 1.0 / self.temperature ** (torch.arange(half, dtype=torch.float32, device=coords.device)
                                           / max(denom, 1))
        parts = []
        for a in reversed(range(axes)):
            angle = coords[..., a:a + 1].float() * omega
            parts += [angle.sin(), angle.cos()]
        return torch.cat(parts, dim=-1)

    def embedding(self, pos: Positions) -> torch.Tensor:
        cacheable = pos.grid is not None and not is_tracing()  # nothing made while tracing (fake) is kept
        key = (pos.grid, pos.train_grid, pos.num_prefix, pos.device) if cacheable else None
        if key is not None and key in self._tables:
            return self._tables[key]
        emb = self.table(grid_coordinates(pos, self.grid_mode))
        emb = emb.unsqueeze(0) if emb.dim() == 2 else emb
        emb = _pad_prefix_rows(emb, pos.num_prefix)
        if key is not None:
            self._tables[key] = emb
        return emb

    def embed(self, x: torch.Tensor, pos: Positions) -> torch.Tensor:
        return x + self.embedding(pos).to(x.dtype)
