"""Learnable Fourier features (Li et al., NeurIPS 2021, "Learnable Fourier Features for
Multi-Dimensional Spatial Positional Encoding").

`LearnableFourierFeatures` is a plain module mapping coordinates ``(..., G, M)`` to features
``(..., D)``, usable wherever coordinates exist (ViT patches, DETR, a NeRF MLP's inputs);
`LearnableFourierPE` (``'fourier_learnable'``) adds it to a ViT's tokens.
"""
from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from .additive import AdditivePE
from ..contract import PEContext, autocast_off, resolve_num_axes

__all__ = ['LearnableFourierFeatures', 'LearnableFourierPE', 'WrInit']

WrInit = Literal['inv_gamma', 'inv_gamma_sq']


class LearnableFourierFeatures(nn.Module):
    """Algorithm 1 of Li et al. (2021): ``F = [cos(X W_r^T), sin(X W_r^T)] / sqrt(|F|)``, ``Y = MLP(F)``.

    Input ``X`` of shape ``(..., G, M)``: G groups of M-dimensional positions (groups are encoded
    independently by the same ``W_r`` and MLP). ``W_r`` is ``(|F| / 2, M)`` without bias; the MLP is
    Linear(|F|, hidden) -> GELU -> Linear(hidden, D / G); the G group outputs are concatenated to
    ``(..., D)``. Parameter names ``Wr`` and ``mlp`` follow the public PyTorch port, so its state
    dicts load.

    ``W_r`` init: the paper draws it from ``N(0, gamma^-2)``, i.e. standard deviation ``1 / gamma``
    (``wr_init='inv_gamma'``, the default); the widely used public port uses standard deviation
    ``gamma^-2`` (``wr_init='inv_gamma_sq'``). The MLP keeps PyTorch's default init.

    Args:
        pos_dim: M, coordinates per group.
        dim: D, output width (divisible by ``groups``).
        groups: G.
        fourier_dim: |F|, number of Fourier features (even; default ``dim``).
        hidden_dim: MLP hidden width (32).
        gamma: the ``W_r`` init scale (10).
        wr_init: ``'inv_gamma'`` (std ``1/gamma``) or ``'inv_gamma_sq'`` (std ``1/gamma^2``).
    """

    def __init__(
            self,
            pos_dim: int,
            dim: int,
            *,
            groups: int = 1,
            fourier_dim: Optional[int] = None,
            hidden_dim: int = 32,
            gamma: float = 10.0,
            wr_init: WrInit = 'inv_gamma',
    ) -> None:
        super().__init__()
        fourier_dim = dim if fourier_dim is None else fourier_dim
        if pos_dim < 1 or groups < 1 or hidden_dim < 1:
            raise ValueError(f'pos_dim, groups and hidden_dim must be >= 1, got {pos_dim}, {groups}, {hidden_dim}')
        if dim % groups:
            raise ValueError(f'dim={dim} must be divisible by groups={groups}')
        if fourier_dim < 2 or fourier_dim % 2:
            raise ValueError(f'fourier_dim must be a positive even number, got {fourier_dim}')
        if gamma <= 0:
            raise ValueError(f'gamma must be > 0, got {gamma}')
        if wr_init not in ('inv_gamma', 'inv_gamma_sq'):
            raise ValueError(f"wr_init must be one of ('inv_gamma', 'inv_gamma_sq'), got {wr_init!r}")
        self.pos_dim, self.dim, self.groups, self.fourier_dim = pos_dim, dim, groups, fourier_dim
        self.Wr = nn.Linear(pos_dim, fourier_dim // 2, bias=False)
        self.mlp = nn.Sequential(nn.Linear(fourier_dim, hidden_dim), nn.GELU(), nn.Linear(hidden_dim, dim // groups))
        std = 1.0 / gamma if wr_init == 'inv_gamma' else gamma ** -2
        nn.init.normal_(self.Wr.weight, mean=0.0, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2:] != (self.groups, self.pos_dim):
            raise ValueError(f'LearnableFourierFeatures expects coordinates (..., G={self.groups}, '
                             f'M={self.pos_dim}), got shape {tuple(x.shape)}')
        # phases in float32 even under autocast: bf16 phases lose the high frequencies
        with autocast_off(x.device):
            proj = F.linear(x.float(), self.Wr.weight.float())
        feats = torch.cat([proj.cos(), proj.sin()], dim=-1).to(self.Wr.weight.dtype) / math.sqrt(self.fourier_dim)
        return self.mlp(feats).flatten(-2)


@register_pe('fourier_learnable', family='fourier')
class LearnableFourierPE(AdditivePE):
    """Learnable Fourier features added to the tokens (Li et al., NeurIPS 2021).

    The D coordinates of each token (``(row, col)`` patch indices for a 2D grid, ``(t, row, col)``
    for video, any point coordinates) are split into ``groups`` groups of ``D / groups`` and encoded
    by `LearnableFourierFeatures`; prefix tokens get zeros. ``grid_mode='index'`` (integer indices,
    a larger input extrapolates) or ``'normalized'`` (rescaled to the training grid, interpolates).
    Defaults ``|F| = C``, hidden 32, gamma 10: the configuration of the public port's example.

    Args:
        groups: G (default 1: all coordinates in one group).
        fourier_dim: |F| (default: the token width).
        hidden_dim: MLP hidden width (32).
        gamma: ``W_r`` init scale (10).
        wr_init: ``'inv_gamma'`` (std ``1/gamma``, the paper) or ``'inv_gamma_sq'`` (the public port).
        num_axes: coordinate axes D (default: the host grid's, else 2).
        grid_mode: ``index`` or ``normalized``.
    """
    larger_input = 'extrapolate'
    paper = 'Li et al., NeurIPS 2021 (learnable Fourier features), arXiv:2106.02795'

    def __init__(
            self,
            ctx: PEContext,
            *,
            groups: int = 1,
            fourier_dim: Optional[int] = None,
            hidden_dim: int = 32,
            gamma: float = 10.0,
            wr_init: WrInit = 'inv_gamma',
            num_axes: Optional[int] = None,
            grid_mode: GridMode = 'index',
    ) -> None:
        super().__init__(ctx)
        self.num_axes = resolve_num_axes(ctx, num_axes, self.name)
        allowed = [g for g in range(1, self.num_axes + 1) if self.num_axes % g == 0]
        if groups not in allowed:
            raise ValueError(f"option 'groups' of encoding 'fourier_learnable' must divide the {self.num_axes} "
                             f'coordinate axes (allowed: {", ".join(map(str, allowed))}), got groups={groups}')
        self.grid_mode = grid_mode
        self.features = LearnableFourierFeatures(
            self.num_axes // groups, ctx.dim, groups=groups, fourier_dim=fourier_dim, hidden_dim=hidden_dim,
            gamma=gamma, wr_init=wr_init)

    def _rows(self, pos: Positions) -> torch.Tensor:
        if pos.ndim != self.num_axes:
            raise ValueError(f"encoding 'fourier_learnable' was built for {self.num_axes} coordinate axes, "
                             f'positions have {pos.ndim}')
        return self.encode(grid_coordinates(pos, self.grid_mode))

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """The features ``(..., dim)`` of coordinates ``(..., num_axes)``, split into the groups."""
        if coords.shape[-1] != self.num_axes:
            raise ValueError(f"encoding 'fourier_learnable' was built for {self.num_axes} coordinate axes, "
                             f'got {coords.shape[-1]}D coordinates')
        g = self.features.groups
        return self.features(coords.reshape(*coords.shape[:-1], g, self.num_axes // g))
