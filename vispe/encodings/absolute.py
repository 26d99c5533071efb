"""Absolute baselines: no encoding, timm's learned table, and the fixed 2D sin-cos table."""
from __future__ import annotations

import math
from typing import Dict, List, Literal, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed, trunc_normal_
from torch import nn

from .._tracing import is_tracing, static_equal
from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from ..rotary.frequencies import axial_frequencies
from ._checks import check_nonnegative, check_positive
from .additive import AdditivePE
from ..contract import PEContext, PositionalEncoding

__all__ = ['NoPE', 'LearnedPE', 'SinCosPE']


@register_pe('none', family='baseline')
class NoPE(PositionalEncoding):
    """No positional information (the NoPE baseline): attention is permutation-equivariant."""
    paper = 'NoPE baseline (Kazemnejad et al., NeurIPS 2023)'

    def __init__(self, ctx: PEContext) -> None:
        super().__init__(ctx)


def _require_grid(name: str, pos: Positions) -> Tuple[int, ...]:
    if pos.grid is None:
        raise ValueError(f'encoding {name!r} needs grid positions (vispe.positions.grid), got a point set')
    return pos.grid


def _axis_map(n_old: int, n_new: int, mode: str, antialias: bool, device: torch.device,
              align_corners: bool = False) -> torch.Tensor:
    """``(n_new, n_old)``: `F.interpolate` along one axis as a matrix, its columns the resampled unit
    vectors (laid along the width: an antialiased resampling of a one-pixel-wide input along the
    height is wrong in torch)."""
    eye = torch.eye(n_old, device=device).reshape(1, n_old, 1, n_old)
    corners = dict(align_corners=True) if align_corners else {}
    return F.interpolate(eye, size=(1, n_new), mode=mode, antialias=antialias, **corners).reshape(n_old, n_new).t()


def _separable_resample(table: torch.Tensor, new: Sequence[int], old: Sequence[int], num_prefix: int, mode: str,
                        antialias: bool, align_corners: bool = False) -> torch.Tensor:
    """timm's `resample_abs_pos_embed` as two matrix products (2D `F.interpolate` is separable), the
    form used while traced (torch has no symbolic-shape kernel for the backward of the antialiased
    resampling, so a train step compiled with ``dynamic=True`` would fail on it) and with
    ``align_corners``, which timm's function does not take."""
    prefix, grid = table[:, :num_prefix], table[:, num_prefix:].float().reshape(*old, -1)
    rows, cols = (_axis_map(o, n, mode, antialias, table.device, align_corners) for o, n in zip(old, new))
    grid = torch.einsum('ia,jb,abc->ijc', rows, cols, grid).reshape(1, -1, table.shape[-1])
    return torch.cat([prefix, grid.to(table.dtype)], dim=1)


def _weights_resample(table: torch.Tensor, new: Sequence[int], old: Sequence[int], num_prefix: int, mode: str,
                      antialias: bool, align_corners: bool = False) -> torch.Tensor:
    """The 2D resampling of `F.interpolate` as one ``(new, old)`` weight matrix over the table's grid rows,
    each weight the product of a row weight and a column weight (the form of transformers' SigLIP 2
    ``resize_positional_embeddings``, whose rounding it reproduces, and of the Qwen3-VL tower's
    `get_vision_interpolation_indices_and_weights`)."""
    prefix, rows_in = table[:, :num_prefix], table[:, num_prefix:].float().reshape(-1, table.shape[-1])
    rows, cols = (_axis_map(o, n, mode, antialias, table.device, align_corners) for o, n in zip(old, new))
    weights = (rows[:, None, :, None] * cols[None, :, None, :]).reshape(math.prod(new), math.prod(old))
    return torch.cat([prefix, (weights @ rows_in).unsqueeze(0).to(table.dtype)], dim=1)


def _bucket_index(n_new: int, n_old: int, device: torch.device) -> torch.Tensor:
    """NaViT's fractional-position buckets along one axis: token ``i`` of ``n_new`` takes row
    ``bucketize(i / n_new, [1/n_old, 2/n_old, ...], right=True)`` of ``n_old``, in float32 as transformers'
    Idefics3 / SmolVLM vision embeddings compute it (so its rounding at bucket edges is theirs)."""
    boundaries = torch.arange(1 / n_old, 1.0, 1 / n_old, device=device)
    step = 1.0 / torch.tensor(n_new, device=device)
    fraction = (torch.arange(n_new, device=device, dtype=torch.float32) * step).clamp(max=1.0 - 1e-6)
    return torch.bucketize(fraction, boundaries, right=True)


def _bucket_resample(table: torch.Tensor, new: Sequence[int], old: Sequence[int], num_prefix: int) -> torch.Tensor:
    """The table at NaViT's fractional buckets (`_bucket_index` per axis): each new row one of the old rows."""
    prefix, grid = table[:, :num_prefix], table[:, num_prefix:].reshape(*old, -1)
    rows, cols = (_bucket_index(n, o, table.device) for n, o in zip(new, old))
    return torch.cat([prefix, grid[rows][:, cols].reshape(1, -1, table.shape[-1])], dim=1)


@register_pe('learned', family='baseline')
class LearnedPE(AdditivePE):
    """timm's learned absolute position table (Dosovitskiy et al., ICLR 2021).

    The parameter is ``pos_embed`` of shape ``(1, prefix + h * w, C)`` (prefix rows only when
    ``embed_prefix``, timm's ``no_embed_class=False``), initialised with a truncated normal of std
    0.02, so timm ViT checkpoints load unchanged. Other grids resample the table with timm's
    `resample_abs_pos_embed` (bicubic, antialiased: what timm does with ``dynamic_img_size``); in a
    NaFlex batch each sample gets the table resampled to its own grid (once per distinct grid).

    Args:
        interpolation: resampling mode for other grids.
        antialias: antialias when downsampling the table (bicubic and bilinear only; nearest has none).
        init_std: std of the truncated-normal init (0: a zero table).
        resample: how a 2D table is resampled: ``'interpolate'`` (timm's `resample_abs_pos_embed`),
            ``'weights'`` (the same resampling as one weight matrix over the rows, transformers' SigLIP 2
            form; equal up to float rounding, and to the rounding of that host) or ``'buckets'`` (NaViT's
            fractional-position buckets, as Idefics3 / SmolVLM: each token takes the row of the bucket its
            fractional position ``i / n`` falls in; ``interpolation`` is then unused).
        align_corners: `F.interpolate`'s ``align_corners`` for a bilinear or bicubic resampling: the corner
            rows of the table stay at the corners of any grid (Qwen3-VL's tower; timm and most hosts: False).
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
            resample: Literal['interpolate', 'weights', 'buckets'] = 'interpolate',
            align_corners: bool = False,
    ) -> None:
        super().__init__(ctx)
        if ctx.grid_size is None:
            raise ValueError("encoding 'learned' needs the training grid: pass grid_size=(h, w) to create_pe")
        if align_corners and interpolation == 'nearest':
            raise ValueError("option 'align_corners' of encoding 'learned' needs interpolation='bicubic' or "
                             "'bilinear' (nearest has no corners to align)")
        self.interpolation = interpolation
        self.antialias = antialias and interpolation != 'nearest'  # F.interpolate cannot antialias nearest
        self.resample = resample
        self.align_corners = bool(align_corners)
        self.num_table_prefix = ctx.num_prefix_tokens if ctx.embed_prefix else 0
        self.pos_embed = nn.Parameter(torch.zeros(1, self.num_table_prefix + math.prod(ctx.grid_size), ctx.dim))
        if check_nonnegative(self.name, 'init_std', init_std):
            trunc_normal_(self.pos_embed, std=init_std)

    def no_weight_decay(self) -> set:
        return {'pos_embed'}

    def _resample(self, table: torch.Tensor, new: Sequence[int], old: Sequence[int]) -> torch.Tensor:
        if len(new) == 2 and self.resample == 'buckets':  # even at the same size: the buckets' own rounding
            return _bucket_resample(table, new, old, self.num_table_prefix)
        if static_equal(new, old):  # symbolic sizes resample (the identity when equal) rather than specialize
            return table
        if len(new) == 2 and self.resample == 'weights':
            return _weights_resample(table, new, old, self.num_table_prefix, self.interpolation, self.antialias,
                                     self.align_corners)
        if len(new) == 2 and (is_tracing() or self.align_corners):
            return _separable_resample(table, new, old, self.num_table_prefix, self.interpolation, self.antialias,
                                       self.align_corners)
        if len(new) == 2:
            return resample_abs_pos_embed(table, new_size=list(new), old_size=list(old),
                                          num_prefix_tokens=self.num_table_prefix,
                                          interpolation=self.interpolation, antialias=self.antialias)
        prefix, grid = table[:, :self.num_table_prefix], table[:, self.num_table_prefix:]
        grid = grid.reshape(1, *old, -1).movedim(-1, 1)
        mode = 'trilinear' if self.interpolation in ('bicubic', 'bilinear') else self.interpolation
        corners = dict(align_corners=True) if self.align_corners and mode == 'trilinear' else {}
        grid = F.interpolate(grid.float(), size=tuple(new), mode=mode, **corners).to(table.dtype)
        return torch.cat([prefix, grid.movedim(1, -1).reshape(1, -1, table.shape[-1])], dim=1)

    def adopt_pos_embed(self, table: torch.Tensor, num_prefix: int, grid: Tuple[int, ...]
                        ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
        """Take over timm's ``pos_embed`` ``(1, num_prefix + prod(grid), C)`` as this table.

        Prefix rows: the first ``num_table_prefix`` of the checkpoint's rows are kept (timm orders them
        class token, then registers) and the rest dropped; rows this table has beyond the checkpoint's
        keep their initialisation. The grid rows are resampled from ``grid`` (any shape, e.g.
        non-square) to this encoding's grid as `embedding` resamples them (timm's
        `resample_abs_pos_embed` with this encoding's ``interpolation`` and ``antialias`` in 2D).
        Returns ``({'pos_embed': table}, ['pos_embed'] if resampled else [])``.
        """
        grid = tuple(int(g) for g in grid)
        if table.dim() != 3 or table.shape[0] != 1 or table.shape[1] != num_prefix + math.prod(grid):
            raise ValueError(f'pos_embed must be (1, num_prefix + prod(grid), C) = (1, {num_prefix + math.prod(grid)}, '
                             f'C) for num_prefix={num_prefix} and grid={grid}, got {tuple(table.shape)}')
        if table.shape[-1] != self.ctx.dim:
            raise ValueError(f"encoding 'learned' has dim={self.ctx.dim}, the checkpoint's pos_embed has "
                             f'{table.shape[-1]} channels')
        if len(grid) != len(self.ctx.grid_size):
            raise ValueError(f"encoding 'learned' has a {len(self.ctx.grid_size)}D grid {self.ctx.grid_size}, "
                             f'the checkpoint\'s pos_embed a {len(grid)}D grid {grid}')
        own = self.num_table_prefix
        prefix = table[:, :min(num_prefix, own)]
        if num_prefix < own:  # rows the checkpoint lacks (e.g. registers) keep their initialisation
            prefix = torch.cat([prefix, self.pos_embed.detach()[:, num_prefix:own].to(table)], dim=1)
        table = torch.cat([prefix, table[:, num_prefix:]], dim=1)
        resampled = grid != tuple(self.ctx.grid_size)
        return {'pos_embed': self._resample(table, self.ctx.grid_size, grid)}, ['pos_embed'] if resampled else []

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        old = self.ctx.grid_size
        with torch.no_grad():
            table = self._resample(self.pos_embed.data, grid_size, old)
        self.pos_embed = nn.Parameter(table, requires_grad=self.pos_embed.requires_grad)
        super().set_grid_size(grid_size)

    def _grid_table(self, grid: Tuple[int, ...], num_prefix: int) -> torch.Tensor:
        """The table resampled to ``grid``, with the prefix rows of the first ``num_prefix`` tokens."""
        if len(grid) != len(self.ctx.grid_size):
            raise ValueError(f"encoding 'learned' was built for a {len(self.ctx.grid_size)}D grid, got grid {grid}")
        table = self._resample(self.pos_embed, grid, self.ctx.grid_size)
        surplus = self.num_table_prefix - num_prefix  # table rows for prefix tokens the sequence lacks
        return table[:, surplus:] if surplus > 0 else table

    def _rows(self, pos: Positions) -> torch.Tensor:
        if pos.grids is None:
            return self._grid_table(_require_grid(self.name, pos), pos.num_prefix)
        # NaFlex: one resampling per distinct grid (as timm's NaFlexVit), each sample's rows padded
        n = pos.coords.shape[-2]
        tables = {g: F.pad(self._grid_table(g, pos.num_prefix), (0, 0, 0, n - math.prod(g)))
                  for g in dict.fromkeys(pos.grids)}
        return torch.cat([tables[g] for g in pos.grids])

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """The table sampled at continuous grid coordinates ``(..., D)`` (``(row, col)`` or ``(t, row,
        col)`` patch indices): linear interpolation between the rows of the training grid (cubic for
        a 2D ``'bicubic'`` table, nearest for ``'nearest'``), equal to the rows themselves at integer
        indices; coordinates outside the grid take the border rows."""
        grid = self.ctx.grid_size
        if coords.shape[-1] != len(grid):
            raise ValueError(f"encoding 'learned' has a {len(grid)}D grid {grid}, got {coords.shape[-1]}D coordinates")
        table = self.pos_embed[:, self.num_table_prefix:].reshape(1, *grid, -1).movedim(-1, 1)
        size = torch.tensor(grid, dtype=torch.float32, device=coords.device)
        # grid_sample takes (x, y[, z]) = reversed axes in [-1, 1], the corner rows at +-1
        unit = 2 * coords.reshape(-1, len(grid)).float() / (size - 1).clamp(min=1) - 1
        where = unit.flip(-1).reshape(1, -1, *(1,) * (len(grid) - 1), len(grid))
        mode = self.interpolation if self.interpolation == 'nearest' or len(grid) == 2 else 'bilinear'
        feats = F.grid_sample(table.float(), where, mode=mode, padding_mode='border', align_corners=True)
        return feats.reshape(self.ctx.dim, -1).t().to(self.pos_embed.dtype).reshape(*coords.shape[:-1], -1)


@register_pe('sincos', family='baseline')
class SinCosPE(AdditivePE):
    """Fixed sin-cos table, 2D as in MAE (He et al., CVPR 2022), any number of axes.

    Convention (``layout='mae'``): the channels are split into one group per axis, in reverse grid
    order (x = column first, then y = row, then t); each group of ``G`` channels is
    ``[sin(p * w_k), cos(p * w_k)]`` with ``G/2`` frequencies ``w_k = 1 / 10000^(k / (G/2))``.
    ``layout='big_vision'`` uses ``w_k = 1 / 10000^(k / (G/2 - 1))`` (big_vision's
    ``posemb_sincos_2d``). ``axis_order='grid'`` puts the groups in grid order instead (y = row first,
    then x): with ``layout='mae'`` that is the ``[sin_h | cos_h | sin_w | cos_w]`` table of RT-DETR's
    hybrid encoder (Zhao et al., CVPR 2024) as transformers builds it. ``pairing='interleaved'`` orders a
    group ``[sin(p w_0), cos(p w_0), sin(p w_1), ...]`` (the Transformer's table, Vaswani et al. 2017).
    ``flatten=True`` encodes one coordinate, each token's row-major index in its grid (``t * h * w + ...``),
    computed in float64 (such indices reach the thousands, where float32 angles lose 1e-4): with
    ``pairing='interleaved'`` the 1D table VideoMAE adds to its tubelets (Tong et al., NeurIPS 2022). Prefix
    tokens get zeros.

    Args:
        layout: frequency convention, ``'mae'`` or ``'big_vision'``.
        temperature: the base (10000).
        grid_mode: ``index`` (extrapolate) or ``normalized`` (rescaled to the training grid); unused with
            ``flatten``.
        axis_order: ``reversed`` (x first, MAE) or ``grid`` (y first, RT-DETR).
        pairing: ``halves`` (all sines, then all cosines, per group) or ``interleaved``.
        flatten: encode the row-major index of each token in its grid instead of its coordinates.
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
            axis_order: Literal['reversed', 'grid'] = 'reversed',
            pairing: Literal['halves', 'interleaved'] = 'halves',
            flatten: bool = False,
    ) -> None:
        super().__init__(ctx)
        self.layout = layout
        self.temperature = check_positive(self.name, 'temperature', temperature)
        self.grid_mode = grid_mode
        self.axis_order = axis_order
        self.pairing = pairing
        self.flatten = bool(flatten)

    def table(self, coords: torch.Tensor) -> torch.Tensor:
        """The ``(..., N, C)`` sin-cos features of ``(..., N, D)`` coordinates (float64 coordinates are
        computed in float64, the features returned in float32)."""
        dim, axes = self.ctx.dim, coords.shape[-1]
        if dim % (2 * axes):
            raise ValueError(f"encoding 'sincos' needs dim divisible by {2 * axes} for {axes} axes, got dim={dim}")
        group = dim // axes
        half = group // 2
        denom = half - 1 if self.layout == 'big_vision' else half
        dtype = torch.float64 if coords.dtype == torch.float64 else torch.float32
        omega = axial_frequencies(half, self.temperature, step=1.0, dim=max(denom, 1), device=coords.device,
                                  dtype=dtype)
        parts = []
        for a in (reversed(range(axes)) if self.axis_order == 'reversed' else range(axes)):
            angle = coords[..., a:a + 1].to(dtype) * omega
            if self.pairing == 'interleaved':
                parts.append(torch.stack([angle.sin(), angle.cos()], -1).flatten(-2))
            else:
                parts += [angle.sin(), angle.cos()]
        return torch.cat(parts, dim=-1).float()

    def _flat_index(self, pos: Positions) -> torch.Tensor:
        """``(..., N, 1)`` float64 row-major index of each token in its grid (each sample's own in a NaFlex
        batch; the grid the tokens were selected from after token dropping)."""
        grids = pos.index_grids or ((pos.index_grid,) if pos.index_grid is not None else None)
        if grids is None:
            raise ValueError("encoding 'sincos' with flatten=True needs grid positions (vispe.positions.grid), "
                             'got a point set')
        strides = torch.tensor([[math.prod(g[a + 1:]) for a in range(len(g))] for g in grids],
                               dtype=torch.float64, device=pos.device)
        coords = pos.coords.to(torch.float64)
        index = coords @ strides[0] if len(grids) == 1 else (coords * strides[:, None, :]).sum(-1)
        return index.unsqueeze(-1)

    def _rows(self, pos: Positions) -> torch.Tensor:
        if self.flatten:
            return self.table(self._flat_index(pos))
        return self.table(grid_coordinates(pos, self.grid_mode))

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """The sin-cos features of continuous coordinates ``(..., D)`` (`table`; with ``flatten`` the
        coordinates are the flat indices themselves, ``(..., 1)``)."""
        return self.table(coords)
