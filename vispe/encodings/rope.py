"""RoPE for vision (Heo et al., ECCV 2024, "Rotary Position Embedding for Vision Transformer").

Both variants rotate consecutive channel pairs ``(2j, 2j + 1)`` of q and k by angles that are
linear in the token coordinates, so ``q_i^T R(p_i)^T R(p_j) k_j`` depends on ``p_j - p_i`` only
(exactly shift-invariant between patch tokens). Prefix tokens are not rotated, so their logits
with patch tokens see absolute position, as in RoPE-ViT. Coordinate axes are assigned to pairs in
reverse grid order (x = column first, then y = row, then t), as RoPE-ViT does for 2D.

The same axial mechanism in the other channel layout of the field (rotate-half pairs inside each
axis' channel group, axes in grid order) is the RoPE2D of the 3D-vision models: see `rope2d`.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Optional, Tuple

import torch
from torch import nn

from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from ..rotary import RotationPE, axial_frequencies, rotate_qk, rotation_table, scale_frequencies
from ..rotary.frequencies import FREQUENCY_SCALING, FrequencyScaling, mixed_axis_angles, scale_axis_frequencies
from .._dtypes import compute_dtype
from ..rotary.kernels import PairLayout, pad_identity
from ._checks import check_nonnegative, check_positive
from ..contract import PEContext, resolve_num_axes

__all__ = ['RopeAxial', 'RopeMixed', 'MixedAnglePE', 'PairRotaryPE', 'AxisOrder']

AxisOrder = Literal['xy', 'yx']


class PairRotaryPE(RotationPE):
    """RoPE's rotations: complex tables (kind ``table``) of angles linear in the token coordinates.

    Subclasses implement `angles(coords, pos)` returning ``(..., N, P)`` angles (and a magnitude
    broadcastable to them) and `rotation`, the table shared by every layer or one per layer.
    """
    rotation_kind = 'table'

    def __init__(self, ctx: PEContext, grid_mode: GridMode) -> None:
        super().__init__(ctx)
        if ctx.head_dim % 2:
            raise ValueError(f'encoding {self.name!r} needs an even head_dim, got head_dim={ctx.head_dim}')
        self.grid_mode = grid_mode

    def angles(self, coords: torch.Tensor, pos: Positions) -> Tuple[torch.Tensor, Any]:
        raise NotImplementedError

    def coordinates(self, pos: Positions) -> torch.Tensor:
        """Token coordinates ``(..., N, D)``, x (column) first, in ``grid_mode``."""
        return grid_coordinates(pos, self.grid_mode).flip(-1)

    def table(self, pos: Positions) -> torch.Tensor:
        """Complex rotation table, `angles`' shape with ``N_total`` rows, prefix tokens = identity."""
        coords = self.coordinates(pos)
        coords = coords.to(compute_dtype(coords))
        theta, magnitude = self.angles(coords, pos)
        return pad_identity(rotation_table(theta, magnitude), pos.num_prefix, 'table')


def _check_scaling(name: str, scaling: str, allowed: Tuple[str, ...]) -> str:
    if scaling not in allowed:
        raise ValueError(f'option scaling of encoding {name!r} must be one of {allowed}, got {scaling!r}')
    return scaling


def _check_factor(name: str, scaling_factor: Optional[float]) -> Optional[float]:
    return None if scaling_factor is None else check_positive(name, 'scaling_factor', scaling_factor)


def _axis_factor(grid: Optional[Tuple[int, ...]], train_grid: Optional[Tuple[int, ...]], axis: int,
                 fixed: Optional[float]) -> Tuple[float, float]:
    """(scaling factor, training length) of coordinate axis ``axis`` (in reversed order) at ``grid``."""
    if grid is None or train_grid is None:
        return (fixed or 1.0), 1.0
    g, t = grid[::-1][axis], train_grid[::-1][axis]
    return (fixed if fixed is not None else g / t), float(t)


def _sample_scaled(pos: Positions, scaling: str) -> bool:
    """Whether frequencies are scaled per sample: a NaFlex batch (each sample against its own grid)
    with a scaling method."""
    return pos.index_grids is not None and scaling != 'none'


@register_pe('rope_axial', family='rope')
class RopeAxial(PairRotaryPE):
    """RoPE-Axial (Heo et al., ECCV 2024): fixed frequencies, one axis per group of pairs.

    The ``hd/2`` pairs are split evenly between the D coordinate axes (x first); axis ``a`` rotates
    its ``P_a`` pairs by ``p_a * f_k`` with ``f_k = 1 / theta^(k / P_a)`` (for 2D, ``1/theta^(4k/hd)``);
    leftover pairs (``hd/2`` not divisible by D) are not rotated. Integer patch indices by default,
    so a larger input extrapolates; ``grid_mode='normalized'`` interpolates instead.

    Frequency scaling for larger inputs, per axis with factor ``n / n_train`` (or ``scaling_factor``):
    ``linear`` (position interpolation), ``ntk`` (NTK-aware base), ``yarn`` (YaRN by parts),
    ``riflex`` (RIFLEx: only the intrinsic frequency of a longer axis lowered; for video, the time axis is
    the one that grows).

    Channel layout: ``layout='interleaved'`` (RoPE-ViT) rotates pairs ``(2j, 2j + 1)``, axis ``a`` taking
    pairs ``[a P_a, (a + 1) P_a)``; ``layout='half'`` gives axis ``a`` the channel group
    ``[2a P_a, 2(a + 1) P_a)`` and rotates rotate-half pairs inside it, ``(c + j, c + P_a + j)`` with
    ``c = 2a P_a``, by the same angles (CroCo's RoPE2D; for one axis, LLM code's rotate-half). The two
    layouts differ by a fixed channel permutation of q and k. ``axis_order='xy'`` gives the first
    channels to x (the column; RoPE-ViT), ``'yx'`` to y (the row; grid order, as CroCo and VGGT).

    Args:
        theta: frequency base (100 in RoPE-ViT).
        grid_mode: ``index`` or ``normalized``.
        scaling: frequency scaling for inputs larger than the training grid.
        scaling_factor: fixed factor instead of the per-axis ratio to the training grid.
        yarn_beta_fast: YaRN ramp end (turns over the training length), > ``yarn_beta_slow``.
        yarn_beta_slow: YaRN ramp start (>= 0).
        riflex_repetition: RIFLEx's ``N``, the length (in positions of a longer axis) after which the
            trained model repeats itself; its intrinsic frequency has the period nearest ``N``. None:
            the axis' training length.
        layout: ``interleaved`` or ``half`` (rotate-half pairs within each axis' channel group); with
            ``half`` the number of axes is the host's (its grid's, else 2).
        axis_order: ``xy`` (x first) or ``yx`` (grid order: y first, after t for video).
    """
    larger_input = 'extrapolate'
    paper = 'Heo et al., ECCV 2024 (RoPE-ViT), arXiv:2403.13298'

    def __init__(
            self,
            ctx: PEContext,
            *,
            theta: float = 100.0,
            grid_mode: GridMode = 'index',
            scaling: FrequencyScaling = 'none',
            scaling_factor: Optional[float] = None,
            yarn_beta_fast: float = 32.0,
            yarn_beta_slow: float = 1.0,
            riflex_repetition: Optional[float] = None,
            layout: PairLayout = 'interleaved',
            axis_order: AxisOrder = 'xy',
    ) -> None:
        super().__init__(ctx, grid_mode)
        if ctx.grid_size is not None and ctx.head_dim // 2 < len(ctx.grid_size):
            raise ValueError(f"encoding 'rope_axial' needs head_dim >= {2 * len(ctx.grid_size)} for a "
                             f"{len(ctx.grid_size)}D grid, got head_dim={ctx.head_dim}")
        self.theta = check_positive(self.name, 'theta', theta)
        self.scaling = _check_scaling(self.name, scaling, tuple(FREQUENCY_SCALING))
        self.scaling_factor = _check_factor(self.name, scaling_factor)
        slow = check_nonnegative(self.name, 'yarn_beta_slow', yarn_beta_slow)
        fast = check_nonnegative(self.name, 'yarn_beta_fast', yarn_beta_fast)
        if fast <= slow:
            raise ValueError(f"option 'yarn_beta_fast' of encoding {self.name!r} must be > yarn_beta_slow={slow}, "
                             f'got {fast}')
        self.yarn_betas = (fast, slow)
        self.riflex_repetition = (None if riflex_repetition is None else
                                  check_positive(self.name, 'riflex_repetition', riflex_repetition))
        self.layout, self.axis_order = layout, axis_order  # checked against their Literal types by the registry
        # rotate-half pairs stay inside each axis' channel group: qk must know the groups, hence the axes
        self.group_axes = resolve_num_axes(ctx, None, self.name) if layout == 'half' else None

    def axis_frequencies(self, num_axes: int) -> torch.Tensor:
        """``(P_a,)`` base frequencies of each axis (same for every axis)."""
        per_axis = self.ctx.head_dim // 2 // num_axes
        if per_axis == 0:
            raise ValueError(f"encoding 'rope_axial' needs head_dim >= {2 * num_axes} for {num_axes} axes, "
                             f"got head_dim={self.ctx.head_dim}")
        return axial_frequencies(per_axis, self.theta, step=2.0, dim=2 * per_axis)

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> torch.Tensor:
        rot = self.table(pos)  # ([B,] N_total, P)
        if pos.batched:  # (B, 1, N, P): broadcast over heads
            rot = rot.unsqueeze(-3)
        return rot.unsqueeze(0)  # one table for every layer

    def scaled_frequencies(self, base: torch.Tensor, num_axes: int, grid: Optional[Tuple[int, ...]],
                           train_grid: Optional[Tuple[int, ...]]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Frequencies and magnitudes ``(D, P_a)`` of each axis (x first) scaled for ``grid``."""
        freqs, mags = [], []
        for a in range(num_axes):
            factor, train_len = _axis_factor(grid, train_grid, a, self.scaling_factor)
            f, mag = scale_axis_frequencies(base, factor, self.scaling, train_len, *self.yarn_betas,
                                            riflex_repetition=self.riflex_repetition)
            freqs.append(f)
            mags.append(torch.full_like(f, mag))
        return torch.stack(freqs), torch.stack(mags)

    def angles(self, coords, pos):
        axes = coords.shape[-1]
        base = self.axis_frequencies(axes).to(device=coords.device, dtype=coords.dtype)
        if _sample_scaled(pos, self.scaling):  # (B, 1, D, P_a): each sample scaled for its own grid
            tables = [self.scaled_frequencies(base, axes, g, pos.train_grid or g) for g in pos.index_grids]
            freqs = torch.stack([f for f, _ in tables]).unsqueeze(1)
            mags = torch.stack([m for _, m in tables]).flatten(-2).unsqueeze(1)
        else:
            freqs, mags = self.scaled_frequencies(base, axes, pos.index_grid, pos.train_grid)
            mags = mags.flatten()
        theta = torch.cat([coords[..., a:a + 1] * freqs[..., a, :] for a in range(axes)], -1)
        if self.axis_order == 'yx':  # axis blocks of the pairs in grid order instead
            theta, mags = _reverse_axis_blocks(theta, axes), _reverse_axis_blocks(mags, axes)
        return theta, mags

    def table(self, pos: Positions) -> torch.Tensor:
        if self.group_axes is not None and pos.coords.shape[-1] != self.group_axes:
            raise ValueError(f"encoding {self.name!r} with layout='half' was built for {self.group_axes} coordinate "
                             f'axes (its host\'s), positions have {pos.coords.shape[-1]}')
        return super().table(pos)

    def qk(self, q, k, state, layer, x=None):
        if self.group_axes is None:
            return super().qk(q, k, state, layer, x)
        rq, rk = self.layer_state(state, q.shape[0]).layer(layer)
        return rotate_axis_groups(q, k, rq, rk, self.group_axes)


def _reverse_axis_blocks(t: torch.Tensor, axes: int) -> torch.Tensor:
    """``t`` (``(..., D * P_a)``, one block of pairs per axis) with its axis blocks in reverse order."""
    return t.unflatten(-1, (axes, -1)).flip(-2).flatten(-2)


def rotate_axis_groups(q: torch.Tensor, k: torch.Tensor, table_q: torch.Tensor, table_k: torch.Tensor,
                       num_axes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k ``(..., N, hd)`` in CroCo's RoPE2D layout: axis ``a`` owns channels
    ``[2a P, 2(a + 1) P)`` and rotates them as rotate-half pairs ``(c + j, c + P + j)`` by columns
    ``[a P, (a + 1) P)`` of the complex tables ``(..., N, num_axes * P)``; channels after the last group
    pass through. Each group is one `rotate_qk` call of kind ``half_table`` (fused kernels included)."""
    per_axis = table_q.shape[-1] // num_axes
    width = 2 * per_axis
    out_q, out_k = [], []
    for a in range(num_axes):
        cols, chans = slice(a * per_axis, (a + 1) * per_axis), slice(a * width, (a + 1) * width)
        tq = table_q[..., cols]
        tk = tq if table_k is table_q else table_k[..., cols]  # self-attention: one call for q and k
        rq, rk = rotate_qk(q[..., chans], k[..., chans], tq, tk, 'half_table')
        out_q.append(rq)
        out_k.append(rk)
    if num_axes * width < q.shape[-1]:
        out_q.append(q[..., num_axes * width:])
        out_k.append(k[..., num_axes * width:])
    return torch.cat(out_q, -1), torch.cat(out_k, -1)


class MixedAnglePE(PairRotaryPE):
    """Pairs rotated by angles ``sum_a p_a f_a`` (x first): one D-dimensional frequency vector per pair,
    in ``self.freqs`` of shape ``(D, L', H', hd/2)`` (``L' = 1`` / ``H' = 1``: shared by every layer /
    head). The angle is linear in position, hence exactly shift-invariant. RoPE-Mixed learns the
    vectors; the directional RoPEs (`vispe.encodings.directional_rope`) fix them. Subclasses set
    ``self.freqs`` (a parameter or a buffer) after calling this constructor.

    Args:
        grid_mode: ``index`` or ``normalized``.
        num_axes: coordinate axes D (default: the host grid's, else 2).
        scaling: ``none``, ``linear`` or ``yarn`` frequency scaling for larger inputs (per axis).
        scaling_factor: fixed factor instead of the per-axis ratio to the training grid.
    """
    freqs: torch.Tensor

    def __init__(self, ctx: PEContext, grid_mode: GridMode, num_axes: Optional[int] = None,
                 scaling: Literal['none', 'linear', 'yarn'] = 'none', scaling_factor: Optional[float] = None) -> None:
        super().__init__(ctx, grid_mode)
        self.num_axes = resolve_num_axes(ctx, num_axes, self.name)
        # NTK's base scaling assumes one geometric table, which mixed frequencies are not
        self.scaling = _check_scaling(self.name, scaling, ('none', 'linear', 'yarn'))
        self.scaling_factor = _check_factor(self.name, scaling_factor)

    def scaled_frequencies(self, axis: int, dtype: torch.dtype, grid: Optional[Tuple[int, ...]],
                           train_grid: Optional[Tuple[int, ...]]) -> Tuple[torch.Tensor, float]:
        """Frequencies ``(L', H', P)`` of coordinate axis ``axis`` (x first) scaled for ``grid``, and the
        magnitude."""
        factor, train_len = _axis_factor(grid, train_grid, axis, self.scaling_factor)
        return scale_frequencies(self.freqs[axis].to(dtype), factor, self.scaling, train_len)

    def angles(self, coords, pos):
        if coords.shape[-1] != self.num_axes:
            raise ValueError(f"encoding {self.name!r} was built for {self.num_axes} coordinate axes, "
                             f"positions have {coords.shape[-1]}")
        per_sample = _sample_scaled(pos, self.scaling)
        theta = 0
        mag = [1.0] * len(pos.index_grids) if per_sample else 1.0
        for a in range(self.num_axes):
            c = coords[..., a]
            if per_sample:  # each sample scaled for its own grid: (L', B, H', 1, P)
                scaled = [self.scaled_frequencies(a, coords.dtype, g, pos.train_grid or g) for g in pos.index_grids]
                f = torch.stack([freqs for freqs, _ in scaled], 1).unsqueeze(-2)
                mag = [max(m, s) for m, (_, s) in zip(mag, scaled)]
                theta = theta + c.unsqueeze(-1).unsqueeze(-3) * f
            else:
                freqs, m = self.scaled_frequencies(a, coords.dtype, pos.index_grid, pos.train_grid)
                mag = max(mag, m)
                theta = theta + mixed_axis_angles(c, freqs)
        if per_sample:  # (B, 1, 1, 1): broadcast against (L', B, H', N, P)
            mag = torch.tensor(mag, dtype=coords.dtype, device=coords.device).reshape(-1, 1, 1, 1)
        return theta, mag

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> torch.Tensor:
        return self.table(pos)  # (L', [B,] H', N_total, P): one table per layer, or one for all


@register_pe('rope_mixed', family='rope')
class RopeMixed(MixedAnglePE):
    """RoPE-Mixed (Heo et al., ECCV 2024): learned D-dimensional frequency per layer, head and pair.

    The angle of pair ``k`` is ``sum_a p_a f_a`` (x first), still linear in position, hence exactly
    shift-invariant. Parameter ``freqs`` has shape ``(D, L, H, hd/2)``. Init (the paper's, theta 10):
    per layer and head a random angle ``alpha ~ U[0, 2pi)``; magnitudes ``1/theta^(4k/hd)``,
    ``k < hd/4``; the first half of the pairs point along ``alpha``, the second half along
    ``alpha + pi/2``. For D != 2 each pair gets a random unit direction instead. The frequencies
    are excluded from weight decay.

    Args:
        theta: base of the initial magnitudes (10).
        num_axes: coordinate axes D (default: the host grid's, else 2).
        grid_mode: ``index`` or ``normalized``.
        scaling: ``linear`` or ``yarn`` frequency scaling for larger inputs (per axis).
        scaling_factor: fixed factor instead of the per-axis ratio to the training grid.
    """
    larger_input = 'extrapolate'
    paper = 'Heo et al., ECCV 2024 (RoPE-ViT), arXiv:2403.13298'

    def __init__(
            self,
            ctx: PEContext,
            *,
            theta: float = 10.0,
            num_axes: Optional[int] = None,
            grid_mode: GridMode = 'index',
            scaling: Literal['none', 'linear', 'yarn'] = 'none',
            scaling_factor: Optional[float] = None,
    ) -> None:
        super().__init__(ctx, grid_mode, num_axes, scaling, scaling_factor)
        if ctx.head_dim % 4:
            raise ValueError(f"encoding 'rope_mixed' needs head_dim divisible by 4 (two halves of pairs), "
                             f"got head_dim={ctx.head_dim}")
        self.theta = check_positive(self.name, 'theta', theta)
        self.freqs = nn.Parameter(self.init_freqs(self.num_axes, ctx.depth, ctx.num_heads, ctx.head_dim, theta))

    @staticmethod
    def init_freqs(num_axes: int, depth: int, num_heads: int, head_dim: int, theta: float) -> torch.Tensor:
        """The paper's random 2D init, ``(D, L, H, hd/2)``."""
        mag = axial_frequencies(head_dim // 4, theta, step=4.0, dim=head_dim)
        mag = torch.cat([mag, mag])
        if num_axes == 2:
            alpha = torch.rand(depth, num_heads, 1) * 2 * math.pi
            quarter = head_dim // 4
            angle = torch.cat([alpha.expand(-1, -1, quarter), (alpha + math.pi / 2).expand(-1, -1, quarter)], -1)
            direction = torch.stack([angle.cos(), angle.sin()])
        else:
            direction = torch.randn(num_axes, depth, num_heads, head_dim // 2)
            direction = direction / direction.norm(dim=0, keepdim=True)
        return direction * mag

    def no_weight_decay(self) -> set:
        return {'freqs'}
