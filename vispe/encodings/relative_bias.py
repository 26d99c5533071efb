"""Content-independent relative logit biases: 2D ALiBi and the Swin relative position bias table.

Neither depends on q or k, so the ``(H, N, N)`` bias of every layer is built once per forward in
`_prepare` (and cached in eval) and handed to SDPA as a float mask in each attention.
"""
from __future__ import annotations

import math
from typing import List, Literal, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from torch import nn

from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from ._checks import check_nonnegative
from .._dtypes import at_least_float32
from .._tracing import static_equal
from ..contract import PEContext, PositionalEncoding

__all__ = ['ALiBi2D', 'SwinRelativeBias', 'alibi_slopes', 'swin_relative_position_index']


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's head slopes (Press et al., ICLR 2022, the released ``get_slopes``).

    For a power of two ``H``: the geometric sequence ``2^(-8/H * (h + 1))``. Otherwise the slopes of
    the closest smaller power of two ``n``, followed by every other slope of ``2n`` heads (the odd
    ones), up to ``H`` slopes in total.
    """
    if num_heads < 1:
        raise ValueError(f'num_heads must be >= 1, got {num_heads}')

    def power_of_2(n: int) -> List[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    n = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_2(n)
    if n < num_heads:
        slopes += power_of_2(2 * n)[0::2][:num_heads - n]
    return torch.tensor(slopes, dtype=torch.float32)


def _pad_prefix(bias: torch.Tensor, npq: int, npk: int, values: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Bias ``(..., H, Nq, Nk)`` with prefix rows / columns in front.

    ``values`` ``(..., H, 3)``: (prefix query -> grid key, grid query -> prefix key, prefix -> prefix);
    zeros when None.
    """
    if not (npq or npk):
        return bias
    *lead, nq, nk = bias.shape
    out = bias.new_zeros(*lead, npq + nq, npk + nk)
    out[..., npq:, npk:] = bias
    if values is not None:
        out[..., :npq, npk:] = values[..., 0, None, None]
        out[..., npq:, :npk] = values[..., 1, None, None]
        out[..., :npq, :npk] = values[..., 2, None, None]
    return out


@register_pe('alibi2d', family='relative_bias')
class ALiBi2D(PositionalEncoding):
    """2D ALiBi: logit bias ``- m_h * ||p_i - p_j||`` (Euclidean distance between patches).

    ALiBi (Press et al., ICLR 2022) with the 1D token distance replaced by the Euclidean distance
    of the patch coordinates, as in its 2D uses for vision (e.g. CROMA, Fuller et al., NeurIPS 2023).
    Slopes ``m_h`` are ALiBi's standard geometric ones (`alibi_slopes`), fixed. Distances are in
    patch units (``grid_mode='index'``, a larger input extrapolates) or rescaled to the training
    grid (``'normalized'``). Works for any number of coordinate axes (video, point sets).

    Prefix tokens have no location: every pair that involves one gets bias 0 (no distance penalty),
    so the class token attends to, and is attended by, all patches alike.

    Args:
        grid_mode: ``index`` or ``normalized``.
    """
    shift_invariant = True
    larger_input = 'extrapolate'
    paper = 'Press et al., ICLR 2022 (ALiBi), 2D Euclidean form'
    float32_buffers = frozenset({'slopes'})

    def __init__(self, ctx: PEContext, *, grid_mode: GridMode = 'index') -> None:
        super().__init__(ctx)
        self.grid_mode = grid_mode
        self.register_buffer('slopes', alibi_slopes(ctx.num_heads), persistent=False)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> torch.Tensor:
        pos_k = pos_q if pos_k is None else pos_k
        cq = at_least_float32(grid_coordinates(pos_q, self.grid_mode))
        ck = cq if pos_k is pos_q else at_least_float32(grid_coordinates(pos_k, self.grid_mode))
        dist = (cq.unsqueeze(-2) - ck.unsqueeze(-3)).norm(dim=-1)  # ([B,] Nq, Nk), exact (no cdist mm trick)
        dist = dist.unsqueeze(-3) if dist.dim() == 3 else dist.view(1, 1, *dist.shape)
        bias = -self.slopes.view(-1, 1, 1) * dist  # (1 | B, H, Nq, Nk): 4D keeps SDPA's fused CPU kernel
        return _pad_prefix(bias, pos_q.num_prefix, pos_k.num_prefix)

    def bias(self, q, k, state, layer):
        return state.to(q.dtype)


def swin_relative_position_index(grid: Sequence[int], device: Optional[torch.device] = None) -> torch.Tensor:
    """Swin's ``relative_position_index`` ``(N, N)`` of an ``(h, w)`` grid: row-major over the
    query-minus-key offset ``(dr + h - 1) * (2w - 1) + (dc + w - 1)``."""
    h, w = grid
    coords = torch.stack(torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device),
                                        indexing='ij')).flatten(1)  # (2, N)
    rel = coords[:, :, None] - coords[:, None, :]
    return (rel[0] + h - 1) * (2 * w - 1) + (rel[1] + w - 1)


@register_pe('swin_rpb', family='relative_bias')
class SwinRelativeBias(PositionalEncoding):
    """Swin relative position bias (Liu et al., ICCV 2021) over the whole token grid.

    A learned table of ``(2h - 1)(2w - 1)`` scalars per head, indexed by the query-minus-key offset
    (Swin's ``relative_position_index``), one table per layer as in Swin (``per_layer=False``
    shares one). Init: truncated normal, std 0.02 (Swin). For a grid other than the training one
    the table is resized, by default bicubically (``align_corners=False``; timm's
    ``resize_rel_pos_bias_table_simple``, Swin's fine-tuning recipe), so a larger input
    interpolates offsets; ``set_grid_size`` resizes the parameter itself. ``interpolation``
    chooses the resampling (``bilinear`` stays within the table's range, where bicubic can
    overshoot between offsets; ``nearest`` repeats entries), as the learned table's option does.

    The tables are excluded from weight decay (Swin's ``no_weight_decay_keywords``).

    Token subsets of the training grid (patch dropout: integer coordinates without a grid) index the
    training table by their offsets. In a NaFlex batch (``Positions.grids``) each sample gets the
    bias of its own grid, as alone (the table resized to that grid).

    Prefix tokens: BEiT's convention, three extra learned scalars per head and table
    (prefix query -> patch key, patch query -> prefix key, prefix -> prefix), shared by all prefix
    tokens.

    Parameters: ``relative_position_bias_table`` ``(L | 1, (2h-1)(2w-1), H)`` (Swin's layout per
    layer) and ``prefix_bias`` ``(L | 1, 3, H)`` when the host has prefix tokens.

    Args:
        per_layer: one table per layer (True, Swin) or one shared by all layers.
        init_std: std of the truncated-normal init (0: zero tables).
        interpolation: resampling of the table for another grid (``bicubic``: Swin / timm).
    """
    shift_invariant = True
    larger_input = 'resample'
    paper = 'Liu et al., ICCV 2021 (Swin Transformer), arXiv:2103.14030'

    def __init__(self, ctx: PEContext, *, per_layer: bool = True, init_std: float = 0.02,
                 interpolation: Literal['bicubic', 'bilinear', 'nearest'] = 'bicubic') -> None:
        super().__init__(ctx)
        self.interpolation = interpolation  # checked against its Literal type by the registry
        if ctx.grid_size is None or len(ctx.grid_size) != 2:
            raise ValueError(f"encoding 'swin_rpb' needs the 2D training grid, got grid_size={ctx.grid_size}")
        self.per_layer = per_layer
        tables = ctx.depth if per_layer else 1
        h, w = ctx.grid_size
        self.relative_position_bias_table = nn.Parameter(torch.zeros(tables, (2 * h - 1) * (2 * w - 1), ctx.num_heads))
        self.prefix_bias = nn.Parameter(torch.zeros(tables, 3, ctx.num_heads)) if ctx.num_prefix_tokens else None
        if check_nonnegative(self.name, 'init_std', init_std):
            trunc_normal_(self.relative_position_bias_table, std=init_std)
            if self.prefix_bias is not None:
                trunc_normal_(self.prefix_bias, std=init_std)

    def no_weight_decay(self) -> set:
        return {'relative_position_bias_table', 'prefix_bias'} if self.prefix_bias is not None \
            else {'relative_position_bias_table'}

    @staticmethod
    def resize_table(table: torch.Tensor, old: Tuple[int, int], new: Tuple[int, int],
                     mode: str = 'bicubic') -> torch.Tensor:
        """Resize ``(T, (2h-1)(2w-1), H)`` tables from grid ``old`` to grid ``new`` (``mode``: bicubic,
        bilinear or nearest)."""
        if static_equal(old, new):  # symbolic sizes resize (the identity when equal) rather than specialize
            return table
        t, _, heads = table.shape
        src = (2 * old[0] - 1, 2 * old[1] - 1)
        dst = (2 * new[0] - 1, 2 * new[1] - 1)
        grid = table.permute(0, 2, 1).reshape(1, t * heads, *src)
        corners = {} if mode == 'nearest' else dict(align_corners=False)  # nearest takes no align_corners
        grid = F.interpolate(grid.float(), size=dst, mode=mode, **corners).to(table.dtype)
        return grid.reshape(t, heads, dst[0] * dst[1]).permute(0, 2, 1)

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        with torch.no_grad():
            table = self.resize_table(self.relative_position_bias_table.data, self.ctx.grid_size, tuple(grid_size),
                                      self.interpolation)
        self.relative_position_bias_table = nn.Parameter(table.contiguous(),
                                                         requires_grad=self.relative_position_bias_table.requires_grad)
        super().set_grid_size(grid_size)

    def _offset_index(self, pos: Positions) -> Tuple[torch.Tensor, Tuple[int, int]]:
        """Swin index ``([B,] N, N)`` of the grid tokens and the grid whose table it indexes.

        A full grid uses its own (resized) table; a subset of grid tokens (after patch dropout: integer
        coordinates, no grid) indexes the table of the grid it was selected from by its offsets (the
        training table for other integer coordinates).
        """
        if pos.grid is not None:
            if len(pos.grid) != 2:
                raise ValueError(f"encoding 'swin_rpb' needs a 2D token grid, got grid={pos.grid}")
            return swin_relative_position_index(pos.grid, device=pos.device), pos.grid
        h, w = pos.index_grid or self.ctx.grid_size
        c = pos.coords
        if pos.ndim != 2 or not torch.equal(c, c.round()):
            raise ValueError("encoding 'swin_rpb' needs a 2D token grid or integer (row, col) grid coordinates")
        d = (c.unsqueeze(-2) - c.unsqueeze(-3)).long()  # query minus key
        if (d[..., 0].abs() > h - 1).any() or (d[..., 1].abs() > w - 1).any():
            raise ValueError(f"encoding 'swin_rpb': token offsets exceed the {h}x{w} training grid's table")
        return (d[..., 0] + h - 1) * (2 * w - 1) + (d[..., 1] + w - 1), (h, w)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> torch.Tensor:
        if pos_k is not None and not pos_k.same_as(pos_q):
            raise ValueError("encoding 'swin_rpb' is a self-attention bias: queries and keys must share positions")
        if pos_q.num_prefix and self.prefix_bias is None:
            raise ValueError("encoding 'swin_rpb' was built without prefix tokens (num_prefix_tokens=0) but the "
                             f'positions have {pos_q.num_prefix}')
        if pos_q.grids is not None:
            return self._naflex_bias(pos_q)
        if pos_q.index_grids is not None:  # the kept tokens of a NaFlex batch: each sample on its grid's table
            return torch.cat([self._grid_bias(pos_q.replace(coords=pos_q.coords[b:b + 1], key_padding_mask=None,
                                                            selected_from=(g,)))
                              for b, g in enumerate(pos_q.index_grids)], 1)
        return self._grid_bias(pos_q)

    def _naflex_bias(self, pos: Positions) -> torch.Tensor:
        """``(T, B, H, N, N)``: each sample's bias on its own grid (its own resized table, once per
        distinct grid), zero on the rows and columns of its padding tokens."""
        n = pos.num_tokens
        biases = {}
        for b, g in enumerate(pos.grids):
            if g not in biases:
                one = self._grid_bias(pos.sample(b))  # (T, H, m, m)
                biases[g] = F.pad(one, (0, n - one.shape[-1], 0, n - one.shape[-2]))
        return torch.stack([biases[g] for g in pos.grids], 1)

    def _grid_bias(self, pos_q: Positions) -> torch.Tensor:
        """The bias ``(T, [B,] H, N, N)`` of a grid or of grid tokens (see `_offset_index`)."""
        index, grid = self._offset_index(pos_q)
        table = self.resize_table(self.relative_position_bias_table, self.ctx.grid_size, grid, self.interpolation)
        t, _, heads = table.shape
        table = table.transpose(1, 2)  # (T, H, R): a gather, whose backward is a fast scatter-add
        bias = table.gather(-1, index.reshape(1, 1, -1).expand(t, heads, -1)).view(t, heads, *index.shape)
        prefix = None if self.prefix_bias is None else self.prefix_bias.transpose(1, 2)  # (T, H, 3)
        if bias.dim() == 5:  # per-sample positions: (T, B, H, N, N)
            bias = bias.transpose(1, 2)
            prefix = None if prefix is None else prefix.unsqueeze(1)
        return _pad_prefix(bias, pos_q.num_prefix, pos_q.num_prefix, prefix)

    def bias(self, q, k, state, layer):
        i = layer if self.per_layer else 0
        bias = state[i] if state.dim() == 5 else state[i:i + 1]  # 4D keeps SDPA's fused CPU kernel
        return bias.to(q.dtype)
