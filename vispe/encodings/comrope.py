"""ComRoPE (Yu et al., CVPR 2025, "ComRoPE: Scalable and Robust Rotary Position Embedding
Parameterized by Trainable Commuting Angle Matrices").

``R(p) = exp(sum_d p_d A_d)`` with block-diagonal skew-symmetric generators that commute, so
``R(p)^T R(p') = R(p' - p)``: exactly shift-invariant for any block size. Two parametrisations:
ComRoPE-AP (axis partition: each block is driven by one axis) and ComRoPE-LD (linear dependence:
every axis scales one base matrix per block). Reference code: ``model.py`` of Longin-Yu/ComRoPE.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, List, Literal, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..positions import Positions
from ..registry import register_pe
from ..rotary import RotationPE
from ..rotary.base import LazyRotations, heads_and_layers, require_divisible, token_grid
from ..rotary.expm import Rotations, expm_skew, layerwise_exp, skew
from ..rotary.kernels import pad_identity
from ._checks import check_nonnegative
from ..contract import Capabilities, PEContext, resolve_num_axes

__all__ = ['ComRoPEAP', 'ComRoPELD']

Normalize = Literal['grid', 'train']
Prefix = Literal['centre', 'identity']
TimeScale = Literal['patches', 'frames']


class _ComRoPE(RotationPE):
    """Shared positions, class-token placement, jitter, the optional absolute table and rotation
    building of both variants.

    Subclasses give the per-axis generators (`axis_generators`) and how a grid's rotations factor
    over the axes (`grid_rotation`), which replaces the ``N`` per-token exponentials by exponentials
    of the few distinct per-axis coordinates when blocks are larger than 2.
    """
    larger_input = 'interpolate'
    paper = 'Yu et al., CVPR 2025 (ComRoPE), arXiv:2506.03737'
    cache_compiled_state = True  # eval rotations are exponentials: costly to rebuild in every compiled forward

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
            time_scale: TimeScale = 'patches',
            ape: bool = False,
    ) -> None:
        super().__init__(ctx)  # Literal options were checked against their values before construction
        check_nonnegative(self.name, 'jitter', jitter)
        check_nonnegative(self.name, 'init_std', init_std)
        self.block = block
        self.rotation_kind = 'pair' if block == 2 else 'block'
        self.num_blocks = require_divisible(self.name, ctx.head_dim, block)
        self.normalize = normalize
        self.jitter = jitter
        self.prefix = prefix
        self.time_scale = time_scale
        layers, heads = heads_and_layers(ctx, per_layer)
        self.generators = nn.Parameter(torch.randn(layers, heads, self.num_blocks, block, block) * init_std)
        self.pos_embed: Optional[nn.Parameter] = None
        if ape:
            if ctx.grid_size is None or len(ctx.grid_size) not in (2, 3):
                raise ValueError(f'option ape of encoding {self.name!r} needs the training grid (h, w) or (t, h, w): '
                                 f'pass grid_size to create_pe, got grid_size={ctx.grid_size}')
            self.pos_embed = nn.Parameter(torch.randn(1, math.prod(ctx.grid_size), ctx.dim))
        self._init_axes(ctx, num_axes)

    def _init_axes(self, ctx: PEContext, num_axes: Optional[int]) -> None:
        """Fix or check the number of coordinate axes D (and build any per-axis parameters)."""
        raise NotImplementedError

    def _declare_capabilities(self) -> Capabilities:
        caps = super()._declare_capabilities()
        return caps if self.pos_embed is not None else dataclasses.replace(caps, hooks=caps.hooks - {'embed'})

    def no_weight_decay(self) -> set:
        return {name for name, _ in self.named_parameters()}

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        """A new training grid: the absolute table is resampled to it (``align_corners=True``, like its
        sampling, so the corner entries stay put), as timm resamples ``pos_embed``."""
        grid_size = tuple(grid_size)
        if self.pos_embed is not None and grid_size != self.ctx.grid_size:
            if len(grid_size) != len(self.ctx.grid_size):
                raise ValueError(f'option ape of encoding {self.name!r}: the table is {len(self.ctx.grid_size)}D, '
                                 f'got grid_size={grid_size}')
            with torch.no_grad():
                table = self.pos_embed.reshape(1, *self.ctx.grid_size, -1).movedim(-1, 1)
                mode = 'bilinear' if len(grid_size) == 2 else 'trilinear'
                table = F.interpolate(table.float(), size=grid_size, mode=mode, align_corners=True)
                table = table.movedim(1, -1).reshape(1, -1, table.shape[1]).to(self.pos_embed.dtype)
            self.pos_embed = nn.Parameter(table, requires_grad=self.pos_embed.requires_grad)
        super().set_grid_size(grid_size)

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
        return self.training and self.jitter > 0 and (pos.index_grids is not None or token_grid(pos) is not None)

    def per_grid(self) -> bool:
        return True  # a grid alone takes the factorised path (block > 2): rounding of its own

    def _grid_scale(self, pos: Positions, grid: Tuple[int, ...]) -> Tuple[List[float], List[float]]:
        """Per grid axis the divisor ``n`` of ``i + 0.5`` and the prefix tokens' coordinate (the centre).

        ``time_scale='patches'`` measures the frame axis of a ``(t, h, w)`` grid in spatial patches, as
        the original: frame indices are divided like the rows, and the class token's frame coordinate
        is the rows' centre (the original's ``cls_position`` 0.5 on every axis).
        """
        denom = list(grid if self.normalize == 'grid' else (pos.train_grid or grid))
        if len(denom) != pos.ndim:
            raise ValueError(f'encoding {self.name!r}: grid {grid} does not match {pos.ndim} coordinate axes')
        middle = list(grid)
        if len(grid) == 3 and self.time_scale == 'patches':
            denom[0], middle[0] = denom[1], grid[1]
        return [float(d) for d in denom], [m / 2 / d for m, d in zip(middle, denom)]

    def coordinates(self, pos: Positions, batch: Optional[int] = None) -> Tuple[torch.Tensor, int]:
        """Coordinates ``([B,] N', D)`` of the rotated rows and the number of identity rows before them.

        Grids: ``(i + 0.5 + jitter) / n`` per axis (jitter only when ``batch`` is given, i.e. in
        training; ``n`` of the frame axis per ``time_scale``; in a NaFlex batch each sample's own);
        point sets as given. Prefix tokens at the centre (grid centre, or the points' mean) or identity.
        """
        dtype = self.compute_dtype()
        grid = token_grid(pos)
        coords = pos.coords.to(dtype)
        scales = None
        if pos.index_grids is not None:  # NaFlex: each sample against its own grid, (B, 1, D)
            per_sample = [self._grid_scale(pos, g) for g in pos.index_grids]
            scales = [[s] for s, _ in per_sample], [[m] for _, m in per_sample]
        elif grid is not None:
            scales = self._grid_scale(pos, grid)
        if scales is not None:
            denom = torch.tensor(scales[0], dtype=dtype, device=pos.device)
            offset = 0.5
            if batch is not None:
                coords = coords.expand(batch, *coords.shape[-2:]) if not pos.batched else coords
                noise = (torch.randn(coords.shape, dtype=dtype, device=pos.device) * 0.5 * self.jitter).clamp(-0.5, 0.5)
                if pos.ndim == 3:  # (t, h, w): the original never jitters the frame axis
                    noise[..., 0] = 0
                offset = offset + noise
            coords = (coords + offset) / denom
            centre = torch.tensor(scales[1], dtype=dtype, device=pos.device)
        else:
            centre = coords.mean(dim=-2, keepdim=True)
        if self.prefix == 'identity' or pos.num_prefix == 0:
            return coords, pos.num_prefix
        centre = centre.expand(*coords.shape[:-2], pos.num_prefix, coords.shape[-1])
        return torch.cat([centre, coords], dim=-2), 0

    # ----------------------------------------------------------------- absolute table
    def _sample_table(self, coords: torch.Tensor, pad: int) -> torch.Tensor:
        """The table at coordinates ``([B,] N', D)``, zero rows for ``pad`` identity prefix tokens first:
        ``(1 | B, pad + N', C)``. As the release: ``grid_sample`` (bilinear, ``align_corners=True``,
        border padding) at ``2 p - 1``, so ``p = 0`` and ``p = 1`` are the first and last entries."""
        grid = self.ctx.grid_size
        if coords.shape[-1] != len(grid):
            raise ValueError(f'option ape of encoding {self.name!r}: the table has {len(grid)} axes, positions have '
                             f'{coords.shape[-1]}')
        pts = coords if coords.dim() == 3 else coords.unsqueeze(0)  # (B', N', D)
        b, n = pts.shape[:2]
        table = self.pos_embed.to(pts.dtype).reshape(1, *grid, -1).movedim(-1, 1)  # (1, C, *grid)
        # grid_sample reads the last axis first: (col, row[, t]) in [-1, 1]
        loc = (pts.flip(-1) * 2 - 1).reshape(b, *([1] * (len(grid) - 1)), n, len(grid))
        out = F.grid_sample(table.expand(b, *table.shape[1:]), loc, mode='bilinear', padding_mode='border',
                            align_corners=True)
        emb = out.reshape(b, -1, n).transpose(1, 2)
        return torch.cat([emb.new_zeros(b, pad, emb.shape[-1]), emb], dim=1) if pad else emb

    def embedding(self, pos: Positions) -> torch.Tensor:
        """The absolute table (option ``ape``) at the tokens' unjittered positions, ``(1 | B, N_total, C)``."""
        if self.pos_embed is None:
            raise NotImplementedError(f'encoding {self.name!r} has an additive part only with ape=true')
        return self._sample_table(*self.coordinates(pos))

    def embed(self, x: torch.Tensor, pos: Positions, state: Any = None) -> torch.Tensor:
        if self.pos_embed is None:
            return x
        if self.per_sample(pos) and isinstance(state, LazyRotations):
            # the forward's jitter, drawn once in its state: the rotations take these positions too
            coords, pad = self._jittered_coordinates(pos, x.shape[0], state)
        else:
            coords, pad = self.coordinates(pos, x.shape[0] if self.per_sample(pos) else None)
        return x + self._sample_table(coords, pad).to(x.dtype)

    def _jittered_coordinates(self, pos: Positions, batch: int, draws: LazyRotations) -> Tuple[torch.Tensor, int]:
        """This forward's jittered coordinates of ``pos``, drawn once and kept in its state ``draws``."""
        return draws.draw(('jittered', id(pos), batch), lambda: self.coordinates(pos, batch))

    # ----------------------------------------------------------------- rotations
    def rotation(self, pos: Positions, batch: Optional[int] = None, draws: Optional[LazyRotations] = None
                 ) -> Rotations:
        gen = self.axis_generators(pos.ndim)
        grid = token_grid(pos)
        if self.block > 2 and batch is None and grid is not None and not pos.batched:
            return self._grid_rotation(pos, grid, gen)
        if batch is None:
            coords, pad = self.coordinates(pos)
        elif draws is None:
            coords, pad = self.coordinates(pos, batch)
        else:
            coords, pad = self._jittered_coordinates(pos, batch, draws)
        return layerwise_exp(gen, coords, pad, cache=self.tensor_cache)

    def _grid_rotation(self, pos: Positions, grid: Tuple[int, ...], gen: torch.Tensor) -> torch.Tensor:
        """Per-axis values ``(i + 0.5) / n`` (plus the centre for prefix tokens) and each token's index."""
        dtype, device = gen.dtype, gen.device
        denom, middle = self._grid_scale(pos, grid)
        size = max(grid) + 1
        values = torch.stack([
            torch.cat([(torch.arange(n, dtype=dtype, device=device) + 0.5) / d,
                       torch.full((size - n,), c, dtype=dtype, device=device)])
            for n, d, c in zip(grid, denom, middle)], dim=-1)  # (V, D); slot n_a holds the centre of axis a
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
        return (f'block={self.block}, blocks={self.num_blocks}, jitter={self.jitter}, prefix={self.prefix}, '
                f'time_scale={self.time_scale}, ape={self.pos_embed is not None}')


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

    Video ``(t, h, w)`` grids: the original divides the frame index by the patches per side, like
    the rows, ``t = (f + 0.5) / n`` (``time_scale='patches'``; its grids are square, vispe takes the
    rows ``h``), so a longer clip extends the time axis beyond 1 (extrapolation) and the class token
    sits at 0.5 on every axis; ``time_scale='frames'`` divides by the number of frames instead
    (time interpolates in ``[0, 1]``).

    Absolute table (``ape``): the released models also add a learned absolute table to the tokens
    (the original's ``keep_ape=False``, an inverted flag: False keeps the table); ``ape=True`` matches
    the release, the default ``ape=False`` is rotation only. It is an option of this encoding rather
    than the composition ``comrope_ap+learned`` because the release reads the table at the
    rotation's own (jittered) coordinates, which a separate additive encoding never sees. ``pos_embed`` ``(1, prod(grid), C)`` (the
    training grid, row-major like timm's; ``set_input_size`` resamples it) from ``N(0, 1)``, sampled
    as the release with ``grid_sample`` (bilinear, ``align_corners=True``, border padding) at
    ``2 p - 1`` of each token's coordinates ``p``: those of the rotation, with the same jitter in
    training (except after patch dropout, where the rotations draw their own); the class token at
    the centre (zeros with ``prefix='identity'``). With ``align_corners=True`` a patch centre
    ``(i + 0.5) / n`` falls between table entries, at ``(i + 0.5) (n - 1) / n``. The release hands
    ``grid_sample`` ``(0, row, col)`` (images) or ``(t, row, col)`` (video) as ``(x, y, z)``: its
    image table is read at the middle column for every token (the column lands on the table's frame
    axis, of size 1) and its video table with frame and column axes swapped; vispe reads each table
    axis with its own coordinate. A released image table converts exactly: every column takes the
    value the release reads (the middle column, or the mean of the two middle ones for even ``n``);
    a video table by swapping its frame and column axes (when frames = patches per side).

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
        time_scale: frame axis of a video grid divided by the patch rows (``patches``, the original)
            or by the number of frames (``frames``).
        ape: add the learned absolute table of the released models.
    """

    def _init_axes(self, ctx: PEContext, num_axes: Optional[int]) -> None:
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
    fixed at construction (the host grid's, else ``num_axes``, else 2). Positions (video frames per
    ``time_scale``), jitter, prefix tokens, the absolute table of the released models (``ape``) and
    cost as in `ComRoPEAP`; on a grid with ``b > 2`` the rotation factors exactly into per-axis
    exponentials ``prod_i exp(p_i theta_ij B_j)`` of the ``n_i`` distinct values.

    Args:
        block: block size b (2 in the original code).
        per_layer: separate parameters in every attention layer.
        normalize: ``grid`` (divide by the current grid size) or ``train`` (by the training grid).
        jitter: training-time position perturbation intensity (0 disables).
        prefix: ``centre`` (rotated as a token at the grid centre) or ``identity``.
        init_std: std of the normal init of ``P``.
        num_axes: coordinate axes D (default: the host grid's, else 2).
        time_scale: frame axis of a video grid divided by the patch rows (``patches``, the original)
            or by the number of frames (``frames``).
        ape: add the learned absolute table of the released models (``ape=True`` matches the release).
    """

    def _init_axes(self, ctx: PEContext, num_axes: Optional[int]) -> None:
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
