"""ComRoPE (Yu et al., CVPR 2025, "ComRoPE: Scalable and Robust Rotary Position Embedding
Parameterized by Trainable Commuting Angle Matrices").

``R(p) = exp(sum_d p_d A_d)`` with block-diagonal skew-symmetric generators that commute, so
``R(p)^T R(p') = R(p' - p)``: exactly shift-invariant for any block size. Two parametrisations:
ComRoPE-AP (axis partition: each block is driven by one axis) and ComRoPE-LD (linear dependence:
every axis scales one base matrix per block).
"""
from __future__ import annotations

from typing import List, Literal, Optional, Tuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..positions import Positions
from ..registry import register_pe
from ._lie import (
    Rotations, RotationPE, expm_skew, heads_and_layers, layerwise_exp, pad_identity, require_divisible,
    skew, token_grid,
)
from .base import PEContext, resolve_num_axes

__all__ = ['ComRoPEAP', 'ComRoPELD']

Normalize = Literal['grid', 'train']
Prefix = Literal['centre', 'identity']


class _ComRoPE(RotationPE):
    """Shared positions, class-token placement, jitter and rotation building of both variants.

    Subclasses give the per-axis generators (`axis_generators`) and how a grid's rotations factor
    over the axes (`grid_rotation`), which replaces the ``N`` per-token exponentials by exponentials
    of the few distinct per-axis coordinates when blocks are larger than 2.
    """
    larger_input = 'interpolate'
    paper = 'Yu et al., CVPR 2025 (ComRoPE), arXiv:2506.03737'

    def __init__(self, ctx: PEContext, block: int, per_layer: bool, normalize: Normalize, jitter: float,
                 prefix: Prefix, init_std: float) -> None:
        super().__init__(ctx)
        if normalize not in ('grid', 'train'):
            raise ValueError(f"option normalize of encoding {self.name!r} must be one of ('grid', 'train'), "
                             f"got {normalize!r}")
        if prefix not in ('centre', 'identity'):
            raise ValueError(f"option prefix of encoding {self.name!r} must be one of ('centre', 'identity'), "
                             f"got {prefix!r}")
        if jitter < 0:
            raise ValueError(f'option jitter of encoding {self.name!r} must be >= 0, got {jitter}')
        self.block = block
        self.rotation_kind = 'pair' if block == 2 else 'block'
        self.num_blocks = require_divisible(self.name, ctx.head_dim, block)
        self.normalize = normalize
        self.jitter = jitter
        self.prefix = prefix
        layers, heads = heads_and_layers(ctx, per_layer)
        self.generators = nn.Parameter(torch.randn(layers, heads, self.num_blocks, block, block) * init_std)

    def no_weight_decay(self) -> set:
        return {name for name, _ in self.named_parameters()}

    # ----------------------------------------------------------------- generators
    def axis_generators(self, num_axes: int) -> torch.Tensor:
        """Skew-symmetric blocks ``(D, L', H, nb, b, b)`` (commuting across axes within a block)."""
        raise NotImplementedError

    def grid_rotation(self, gen: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rotations ``(L', H, N, nb, b, b)`` of grid tokens from the exponentials at the per-axis values
        ``values`` ``(V, D)``; ``index`` ``(N, D)`` picks each token's value per axis."""
        raise NotImplementedError

    # ----------------------------------------------------------------- positions
    def per_sample(self, pos: Positions) -> bool:
        return self.training and self.jitter > 0 and token_grid(pos) is not None

    def _grid_scale(self, pos: Positions, grid: Tuple[int, ...]) -> List[float]:
        denom = grid if self.normalize == 'grid' else (pos.train_grid or grid)
        if len(denom) != pos.ndim:
            raise ValueError(f'encoding {self.name!r}: grid {grid} does not match {pos.ndim} coordinate axes')
        return [float(n) for n in denom]

    def coordinates(self, pos: Positions, batch: Optional[int] = None) -> Tuple[torch.Tensor, int]:
        """Coordinates ``([B,] N', D)`` of the rotated rows and the number of identity rows before them.

        Grids: ``(i + 0.5 + jitter) / n`` per axis (jitter only when ``batch`` is given, i.e. in
        training); point sets as given. Prefix tokens at the centre (grid centre, or the points'
        mean) or identity.
        """
        dtype = self.compute_dtype()
        grid = token_grid(pos)
        coords = pos.coords.to(dtype)
        if grid is not None:
            denom = torch.tensor(self._grid_scale(pos, grid), dtype=dtype, device=pos.device)
            offset = 0.5
            if batch is not None:
                coords = coords.expand(batch, *coords.shape[-2:]) if not pos.batched else coords
                noise = (torch.randn(coords.shape, dtype=dtype, device=pos.device) * 0.5 * self.jitter).clamp(-0.5, 0.5)
                if pos.ndim == 3:  # (t, h, w): the original never jitters the frame axis
                    noise[..., 0] = 0
                offset = offset + noise
            coords = (coords + offset) / denom
            centre = torch.tensor(grid, dtype=dtype, device=pos.device) / 2 / denom
        else:
            centre = coords.mean(dim=-2, keepdim=True)
        if self.prefix == 'identity' or pos.num_prefix == 0:
            return coords, pos.num_prefix
        centre = centre.expand(*coords.shape[:-2], pos.num_prefix, coords.shape[-1])
        return torch.cat([centre, coords], dim=-2), 0

    # ----------------------------------------------------------------- rotations
    def rotation(self, pos: Positions, batch: Optional[int] = None) -> Rotations:
        gen = self.axis_generators(pos.ndim)
        grid = token_grid(pos)
        if self.block > 2 and batch is None and grid is not None and not pos.batched:
            return self._grid_rotation(pos, grid, gen)
        coords, pad = self.coordinates(pos, batch)
        return layerwise_exp(gen, coords, pad)

    def _grid_rotation(self, pos: Positions, grid: Tuple[int, ...], gen: torch.Tensor) -> torch.Tensor:
        """Per-axis values ``(i + 0.5) / n`` (plus the centre for prefix tokens) and each token's index."""
        dtype, device = gen.dtype, gen.device
        denom = self._grid_scale(pos, grid)
        size = max(grid) + 1
        values = torch.stack([
            torch.cat([(torch.arange(n, dtype=dtype, device=device) + 0.5) / d,
                       torch.full((size - n,), n / 2 / d, dtype=dtype, device=device)])
            for n, d in zip(grid, denom)], dim=-1)  # (V, D); slot n_a holds the centre of axis a
        index = pos.coords.round().long()
        pad = pos.num_prefix
        if self.prefix == 'centre' and pad:
            index = torch.cat([torch.tensor(grid, device=device).expand(pad, -1), index])
            pad = 0
        if torch.is_grad_enabled() and gen.requires_grad:  # recomputed in backward: keeps no intermediates
            rot = checkpoint(self.grid_rotation, gen, values, index, use_reentrant=False)
        else:
            rot = self.grid_rotation(gen, values, index)
        return pad_identity(rot, pad, 'block')

    def extra_repr(self) -> str:
        return f'block={self.block}, blocks={self.num_blocks}, jitter={self.jitter}, prefix={self.prefix}'


@register_pe('comrope_ap')
class ComRoPEAP(_ComRoPE):
    """ComRoPE-AP (Yu et al., CVPR 2025): axis-partitioned commuting generators.

    Block ``j`` of the head dim (``b x b``, consecutive channels) rotates with axis ``j mod D`` only:
    ``B_ij = P_j - P_j^T`` if ``j = i (mod D)``, else 0. Blocks of different axes act on disjoint
    channels and commute, so ``R(p) = exp(sum_i p_i A_i)`` is exactly shift-invariant for any block
    size; ``b = 2`` is a 2D RoPE with one learned frequency per pair.

    Conventions (the original code): parameters ``generators`` ``P`` of shape ``(L', H, hd / b, b, b)``
    (per layer and head) drawn from ``N(0, init_std^2)`` (``init_std`` 1); the number of axes D is read
    from the positions (every axis needs at least one block); positions ``(i + 0.5) / n`` per grid
    axis, so a larger input is interpolated into ``[0, 1]`` (``normalize='train'`` divides by the
    training grid instead and extrapolates); during training each sample's grid positions are
    jittered by ``clamp(N(0, 1) * 0.5 * jitter, -0.5, 0.5)`` patches (not the frame axis of a 3D
    grid); prefix tokens sit at the grid centre (0.5, ...) and are rotated (``prefix='identity'``:
    not rotated). Point sets are used as given (no jitter; prefix at their mean).

    Cost: rotations are built once per forward for all layers and heads; ``b = 2`` in closed form
    (cos / sin, pair kernel); ``b > 2`` on a grid exponentiates only the ``n_a`` distinct values of
    each axis and gathers; jitter makes rotations per sample but still block-diagonal
    (``(B, H, N, hd/b, b, b)``), never a dense ``(B, N, H, hd, hd)`` tensor.

    Args:
        block: block size b (2 in the original code).
        per_layer: separate parameters in every attention layer (the original: each layer its own).
        normalize: ``grid`` (divide by the current grid size) or ``train`` (by the training grid).
        jitter: training-time position perturbation intensity (0 disables).
        prefix: ``centre`` (rotated as a token at the grid centre) or ``identity``.
        init_std: std of the normal init of ``P``.
        num_axes: fixes D (checked against the positions); default: read from the positions.
    """

    def __init__(
            self,
            ctx: PEContext,
            *,
            block: int = 2,
            per_layer: bool = True,
            normalize: Normalize = 'grid',
            jitter: float = 1.0,
            prefix: Prefix = 'centre',
            init_std: float = 1.0,
            num_axes: Optional[int] = None,
    ) -> None:
        super().__init__(ctx, block, per_layer, normalize, jitter, prefix, init_std)
        self.num_axes = num_axes
        if num_axes is not None or ctx.grid_size is not None:  # else D is only known from the positions
            self._check_axes(resolve_num_axes(ctx, num_axes, self.name))

    def _check_axes(self, num_axes: int) -> None:
        if self.num_blocks < num_axes:
            raise ValueError(f"encoding 'comrope_ap' gives each of the {num_axes} axes at least one block: needs "
                             f"head_dim / block >= {num_axes}, got {self.num_blocks} blocks")

    def axis_generators(self, num_axes: int) -> torch.Tensor:
        if self.num_axes is not None and num_axes != self.num_axes:
            raise ValueError(f"encoding 'comrope_ap' was built for {self.num_axes} coordinate axes (option num_axes), "
                             f'positions have {num_axes}')
        self._check_axes(num_axes)
        base = skew(self.generators.to(self.compute_dtype()))  # (L', H, nb, b, b)
        axis_of_block = torch.arange(self.num_blocks, device=base.device) % num_axes
        mask = (axis_of_block == torch.arange(num_axes, device=base.device)[:, None]).to(base.dtype)  # (D, nb)
        return base * mask[:, None, None, :, None, None]

    def grid_rotation(self, gen, values, index):
        num_axes = values.shape[-1]
        blocks = torch.arange(self.num_blocks, device=gen.device)
        axis = blocks % num_axes
        base = gen.sum(0)  # each block has exactly one non-zero axis generator
        # (L', H, V, nb, b, b)
        exps = expm_skew(values[:, axis][None, None, :, :, None, None] * base[:, :, None])
        return exps[:, :, index[:, axis], blocks]


@register_pe('comrope_ld')
class ComRoPELD(_ComRoPE):
    """ComRoPE-LD (Yu et al., CVPR 2025): linearly dependent commuting generators.

    Block ``j`` of axis ``i`` is ``theta_ij (P_j - P_j^T)``: one base matrix per block and head and
    one scalar per axis and block, shared by the heads. Multiples of one matrix commute, so
    ``R(p) = exp(sum_i p_i A_i)`` is exactly shift-invariant; with ``b = 2`` it is a 2D RoPE whose
    frequency pairs are ``theta_ij`` times a learned per-head magnitude.

    Conventions (the original code): ``generators`` ``P`` ``(L', H, hd / b, b, b)`` from
    ``N(0, init_std^2)`` (1); ``axis_scales`` ``theta`` ``(L', D, hd / b)`` from ``N(0, 1)``; D is
    fixed at construction (the host grid's, else ``num_axes``, else 2). Positions, jitter, prefix
    tokens and cost as in `ComRoPEAP`; on a grid with ``b > 2`` the rotation factors exactly into
    per-axis exponentials ``prod_i exp(p_i theta_ij B_j)`` of the ``n_i`` distinct values.

    Args:
        block: block size b (2 in the original code).
        per_layer: separate parameters in every attention layer.
        normalize: ``grid`` (divide by the current grid size) or ``train`` (by the training grid).
        jitter: training-time position perturbation intensity (0 disables).
        prefix: ``centre`` (rotated as a token at the grid centre) or ``identity``.
        init_std: std of the normal init of ``P``.
        num_axes: coordinate axes D (default: the host grid's, else 2).
    """

    def __init__(
            self,
            ctx: PEContext,
            *,
            block: int = 2,
            per_layer: bool = True,
            normalize: Normalize = 'grid',
            jitter: float = 1.0,
            prefix: Prefix = 'centre',
            init_std: float = 1.0,
            num_axes: Optional[int] = None,
    ) -> None:
        super().__init__(ctx, block, per_layer, normalize, jitter, prefix, init_std)
        self.num_axes = resolve_num_axes(ctx, num_axes, self.name)
        layers = self.generators.shape[0]
        self.axis_scales = nn.Parameter(torch.randn(layers, self.num_axes, self.num_blocks))

    def axis_generators(self, num_axes: int) -> torch.Tensor:
        if num_axes != self.num_axes:
            raise ValueError(f"encoding 'comrope_ld' was built for {self.num_axes} coordinate axes (option num_axes), "
                             f'positions have {num_axes}')
        dtype = self.compute_dtype()
        base = skew(self.generators.to(dtype))  # (L', H, nb, b, b)
        scales = self.axis_scales.to(dtype).transpose(0, 1)  # (D, L', nb)
        return base * scales[:, :, None, :, None, None]

    def grid_rotation(self, gen, values, index):
        blocks = torch.arange(self.num_blocks, device=gen.device)
        # exp(sum_i p_i A_i) = prod_i exp(p_i A_i) for commuting A_i: D small batches of exponentials
        # (D, L', H, V, nb, b, b)
        exps = expm_skew(values.T[:, None, None, :, None, None, None] * gen[:, :, :, None])
        rot = exps[0][:, :, index[:, 0, None], blocks]
        for axis in range(1, values.shape[-1]):
            rot = rot @ exps[axis][:, :, index[:, axis, None], blocks]
        return rot
