"""iRPE: image relative position encoding (Wu et al., ICCV 2021, "Rethinking and Improving Relative
Position Encoding for Vision Transformer").

A 2D offset between a query and a key is mapped to a bucket by a piecewise function (exact near
zero, logarithmic further away, clipped); each bucket owns a learned scalar (*bias* mode) or vector
(*contextual* mode). Buckets are computed once per token grid and cached; the per-pair work in
attention is a lookup, never an ``(N, N, hd)`` tensor for the logit terms.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, Optional, Tuple

import torch
from timm.layers import trunc_normal_
from torch import nn

from ..positions import Positions
from ..registry import register_pe
from ._checks import check_nonnegative
from ..contract import Capabilities, PEContext, PositionalEncoding

__all__ = ['IRPE', 'piecewise_index', 'irpe_bucket_ids', 'irpe_num_buckets', 'IRPEMethod']

IRPEMethod = Literal['euclidean', 'quantization', 'cross', 'product']
IRPEMode = Literal['bias', 'contextual']
IRPEOn = Literal['k', 'q', 'v', 'qk', 'kv', 'qv', 'qkv']

# ratio of the released DeiT models per mapping (product 50, cross 56, euclidean 20, quantization 51 buckets on 14x14)
DEFAULT_RATIO = {'product': 1.9, 'cross': 20.0, 'euclidean': 20.0, 'quantization': 33.0}


def piecewise_index(x: torch.Tensor, alpha: float, beta: float, gamma: float) -> torch.Tensor:
    """The iRPE piecewise index function (Eq. 18 of the paper), as integers.

    ``g(x) = round(x)`` for ``|x| <= alpha``; otherwise
    ``sign(x) * min(beta, round(alpha + ln(|x| / alpha) / ln(gamma / alpha) * (beta - alpha)))``,
    clipped against ``beta`` before the truncation to an integer (so the largest index is
    ``int(beta)``), exactly as the released code. Rounding is half-to-even (``torch.round``).
    """
    x = x.to(torch.float64)
    ax = x.abs()
    far = alpha + torch.log(ax.clamp_min(alpha) / alpha) / math.log(gamma / alpha) * (beta - alpha)
    far = torch.sign(x) * far.round().clamp(max=beta)
    return torch.where(ax <= alpha, x.round(), far).to(torch.long)  # .to(long) truncates toward zero


def _coefficients(ratio: float) -> Tuple[float, float, float]:
    return 1.0 * ratio, 2.0 * ratio, 8.0 * ratio


def irpe_num_buckets(method: str, ratio: float = 1.9) -> Tuple[int, int]:
    """``(number of tables, buckets per table)`` of a mapping, without the prefix-token bucket.

    Product: one table of ``(2B + 1)^2`` buckets; cross: a row and a column table of ``2B + 1``;
    Euclidean and quantization: one table of ``2B + 1`` (as in the released code, where only the
    upper half is reachable since distances are non-negative); ``B = int(2 * ratio)``.
    """
    b = int(_coefficients(ratio)[1])
    if method == 'product':
        return 1, (2 * b + 1) ** 2
    if method == 'cross':
        return 2, 2 * b + 1
    if method in ('euclidean', 'quantization'):
        return 1, 2 * b + 1
    raise ValueError(f"iRPE method must be one of ('euclidean', 'quantization', 'cross', 'product'), got {method!r}")


def _offset_buckets(diff: torch.Tensor, method: str, ratio: float) -> torch.Tensor:
    """Bucket ids ``(T, ...)`` of integer offsets ``diff`` ``(..., 2)`` = (row, col) of query minus key."""
    alpha, beta, gamma = _coefficients(ratio)
    b = int(beta)
    if method == 'product':
        r = piecewise_index(diff[..., 0], alpha, beta, gamma) + b
        c = piecewise_index(diff[..., 1], alpha, beta, gamma) + b
        return (r * (2 * b + 1) + c).unsqueeze(0)
    if method == 'cross':
        return torch.stack([piecewise_index(diff[..., 0], alpha, beta, gamma) + b,
                            piecewise_index(diff[..., 1], alpha, beta, gamma) + b])
    sq = diff.to(torch.float64).square().sum(-1)
    dist = sq.sqrt().round() if method == 'euclidean' else sq
    return (piecewise_index(dist, alpha, beta, gamma) + b).unsqueeze(0)


def irpe_bucket_ids(pos_q: Positions, pos_k: Optional[Positions] = None, method: str = 'product',
                    ratio: float = 1.9, prefix_bucket: Optional[bool] = None) -> torch.Tensor:
    """Bucket id of every (query, key) pair, ``(T, [B,] Nq_total, Nk_total)`` long.

    ``T`` is 2 for the cross method (row table, then column table, whose ids are offset by the row
    table's size so that both index one concatenated table) and 1 otherwise. Offsets are query minus
    key, on the (row, col) coordinates of the positions. Every pair that involves a prefix token
    (of either side) gets the extra bucket ``buckets per table`` of each table. ``prefix_bucket``
    says whether the tables have that bucket (default: whether there are prefix tokens).
    """
    pos_k = pos_q if pos_k is None else pos_k
    for name, p in (('pos_q', pos_q), ('pos_k', pos_k)):
        if p.ndim != 2:
            raise ValueError(f'iRPE needs 2D (row, col) positions, {name} has {p.ndim} coordinate axes')
    cq, ck = pos_q.coords, pos_k.coords
    if cq.dim() != ck.dim():
        cq, ck = torch.broadcast_tensors(cq if cq.dim() == 3 else cq.unsqueeze(0),
                                         ck if ck.dim() == 3 else ck.unsqueeze(0))
    diff = cq.unsqueeze(-2) - ck.unsqueeze(-3)  # (..., Nq, Nk, 2), query minus key
    ids = _offset_buckets(diff, method, ratio)
    tables, per_table = irpe_num_buckets(method, ratio)
    npq, npk = pos_q.num_prefix, pos_k.num_prefix
    if prefix_bucket is None:
        prefix_bucket = bool(npq or npk)
    elif (npq or npk) and not prefix_bucket:
        raise ValueError(f'the positions have {npq} / {npk} prefix tokens but prefix_bucket=False')
    size = per_table + int(prefix_bucket)
    if npq or npk:
        pad = ids.new_full((*ids.shape[:-2], npq + ids.shape[-2], npk + ids.shape[-1]), per_table)
        pad[..., npq:, npk:] = ids
        ids = pad
    if tables == 2:
        ids = ids + torch.arange(2, device=ids.device).view(2, *([1] * (ids.dim() - 1))) * size
    return ids.contiguous()


@dataclass
class _IRPEState:
    ids: torch.Tensor  # (T, [B,] Nq, Nk): buckets of query-minus-key offsets
    ids_t: Optional[torch.Tensor]  # (T, [B,] Nk, Nq): key-minus-query, for the Q term
    bias: Optional[torch.Tensor]  # (L, [B,] Hs, Nq, Nk) bias-mode logit terms of every layer


def _take(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table[..., ids]`` for a ``(L, Hs, U)`` table, as a gather (its backward is a fast scatter-add)."""
    lead = table.shape[:-1]
    out = table.gather(-1, ids.reshape(*([1] * len(lead)), -1).expand(*lead, -1))
    return out.view(*lead, *ids.shape)


def _expand_ids(ids: torch.Tensor, b: int, h: int) -> torch.Tensor:
    """``([B,] Nq, Nk)`` ids as a stride-0 ``(B, H, Nq, Nk)`` view."""
    ids = ids.unsqueeze(-3) if ids.dim() == 3 else ids
    return ids.expand(b, h, *ids.shape[-2:])


@register_pe('irpe', family='irpe')
class IRPE(PositionalEncoding):
    """iRPE (Wu et al., ICCV 2021), every mapping and mode, on any of q, k, v.

    Conventions (those of the released DeiT code, ``irpe.py``):

    * offsets are query minus key on (row, col) patch indices; mappings ``euclidean`` (piecewise
      index of the rounded distance), ``quantization`` (of the squared distance), ``cross``
      (separate row and column tables, summed) and ``product``
      (``(g(dr) + B) * (2B + 1) + g(dc) + B``); ``alpha, beta, gamma = ratio * (1, 2, 8)``;
    * on K: logit term ``q_i . r^K_ij / sqrt(hd)`` (contextual) or ``b^K_ij`` (bias, added in
      logit units as the released code does); on Q: ``k_j . r^Q_ji / sqrt(hd)`` with ``r^Q``
      indexed by the key-minus-query offset; on V: ``z_i = sum_j a_ij (v_j + r^V_ij)`` with the
      attention weights after dropout. V always has a vector per bucket (the paper defines no
      scalar form for V), so ``mode`` selects the form of the Q and K terms;
    * prefix (class / register) tokens: one extra bucket per table for every pair that involves one;
    * tables zero-initialised (``init_std=0``), one set per layer, shared by all heads or per head.

    Parameters (per layer ``L``, ``Hs = 1`` or ``H`` heads, ``U`` buckets of all tables):
    ``table_k`` / ``table_q`` ``(L, Hs, hd, U)`` (contextual) or ``(L, Hs, U)`` (bias), and
    ``table_v`` ``(L, Hs, U, hd)``: the released code's layouts, stacked over layers.

    Cost: bucket ids are computed once per grid (cached across forwards); bias mode gathers every
    layer's ``(Hs, N, N)`` term once per forward; contextual K/Q compute ``lut = q @ W`` of shape
    ``(B, H, N, U)`` and gather it with the ids; these terms go to SDPA as a float mask. On V the
    attention weights are summed per bucket (a scatter-add into ``(B, H, N, U)``) and multiplied by
    the table; this needs the explicit attention path.

    Learning: zero tables leave a fresh model position-blind, and training has to leave that plateau
    by itself, which can take long. On the embedded relation task with the quickstart's ViT and
    budget (300 steps) iRPE on K (the released setting), Q, QK, QKV and in bias mode stays at chance,
    as does the released code on the same task (27.6 %); both leave the plateau at a seed-dependent
    step (1,200-1,700, or not within 3,000). The gradients match finite differences: the method is
    slow here, nothing is broken. A K / Q term or a bias changes how much each key is attended to,
    the same for every key at an offset, and on that data all tokens but two are alike; a V table
    adds a position vector to what is read. Tables drawn away from zero (``init_std=1``) let the
    V term learn the task within the 300 steps (``on='v'`` or ``'qkv'``: 100 % for every seed
    tried); on K alone they do not.

    Args:
        method: bucket mapping.
        mode: ``contextual`` (vector per bucket, dotted with q or k) or ``bias`` (scalar per bucket).
        on: where it acts: any combination of ``q``, ``k``, ``v``.
        ratio: the ``alpha = ratio, beta = 2 ratio, gamma = 8 ratio`` of the piecewise function; default
            the released DeiT models' value for the method: product 1.9, cross 20, euclidean 20,
            quantization 33.
        shared_heads: one table for all heads (True) or one per head.
        init_std: 0 (default): zero tables, as released; > 0: timm's ``trunc_normal_`` of this std (as
            ``swin_rpb``); ``on='v', init_std=1`` learns position within a short run (see above).
    """
    shift_invariant = True
    larger_input = 'extrapolate'
    paper = 'Wu et al., ICCV 2021 (iRPE), arXiv:2107.14222'

    def __init__(
            self,
            ctx: PEContext,
            *,
            method: IRPEMethod = 'product',
            mode: IRPEMode = 'contextual',
            on: IRPEOn = 'k',
            ratio: Optional[float] = None,
            shared_heads: bool = True,
            init_std: float = 0.0,
    ) -> None:
        super().__init__(ctx)
        ratio = DEFAULT_RATIO[method] if ratio is None else ratio
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"option 'ratio' of encoding 'irpe' must be finite and > 0, got {ratio}")
        if ctx.grid_size is not None and len(ctx.grid_size) != 2:
            raise ValueError(f"encoding 'irpe' needs a 2D token grid, got grid_size={ctx.grid_size}")
        self.method, self.mode, self.on, self.ratio = method, mode, on, ratio
        self.shared_heads = shared_heads
        tables, per_table = irpe_num_buckets(method, ratio)
        self.has_prefix_bucket = ctx.num_prefix_tokens > 0
        self.num_tables = tables
        self.num_buckets = tables * (per_table + int(self.has_prefix_bucket))
        self.scale = ctx.head_dim ** -0.5
        hs = 1 if shared_heads else ctx.num_heads
        L, U, hd = ctx.depth, self.num_buckets, ctx.head_dim
        logit_shape = (L, hs, hd, U) if mode == 'contextual' else (L, hs, U)
        self.table_k = nn.Parameter(torch.zeros(logit_shape)) if 'k' in on else None
        self.table_q = nn.Parameter(torch.zeros(logit_shape)) if 'q' in on else None
        self.table_v = nn.Parameter(torch.zeros(L, hs, U, hd)) if 'v' in on else None
        if check_nonnegative(self.name, 'init_std', init_std):  # the released `initializer` hook (unused: zeros)
            for table in (self.table_k, self.table_q, self.table_v):
                if table is not None:
                    trunc_normal_(table, std=init_std)

    def _declare_capabilities(self) -> Capabilities:
        # the parts that are off run no hook, so SDPA stays where it can: without a V table no weights
        # term (no explicit path), without K / Q tables no bias (no mask)
        caps = super()._declare_capabilities()
        off = ({'weights_value'} if self.table_v is None else set()) | (
            {'bias'} if self.table_k is None and self.table_q is None else set())
        return replace(caps, hooks=caps.hooks - off)

    # ------------------------------------------------------------------ buckets
    def bucket_ids(self, pos_q: Positions, pos_k: Optional[Positions] = None) -> torch.Tensor:
        """``(T, [B,] Nq, Nk)`` bucket ids (see `irpe_bucket_ids`), cached per token grid."""
        pos_k = pos_q if pos_k is None else pos_k
        if (pos_q.num_prefix or pos_k.num_prefix) and not self.has_prefix_bucket:
            raise ValueError("encoding 'irpe' was built without prefix tokens (num_prefix_tokens=0) but the "
                             f'positions have {pos_q.num_prefix} / {pos_k.num_prefix} prefix tokens')
        def build() -> torch.Tensor:
            return irpe_bucket_ids(pos_q, pos_k, self.method, self.ratio, prefix_bucket=self.has_prefix_bucket)
        if pos_q.grid is None or pos_k.grid is None:
            return build()
        # grid positions are fixed by the grid shapes
        return self.tensor_cache.get(('buckets', pos_q.grid, pos_q.num_prefix, pos_k.grid, pos_k.num_prefix,
                                      pos_q.device), build)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> _IRPEState:
        ids = self.bucket_ids(pos_q, pos_k)
        ids_t = None
        if self.table_q is not None:  # key-minus-query buckets; for self-attention the same matrix
            ids_t = ids if pos_k is None else self.bucket_ids(pos_k, pos_q)
        bias = None
        if self.mode == 'bias':  # no dependence on q / k: every layer's term once per forward
            terms = []
            if self.table_k is not None:
                terms.append(sum(_take(self.table_k, i) for i in ids))  # (L, Hs, [B,] Nq, Nk)
            if self.table_q is not None:
                terms.append(sum(_take(self.table_q, i) for i in ids_t).transpose(-1, -2))
            if terms:
                bias = sum(terms[1:], terms[0])
                bias = bias.transpose(1, 2) if bias.dim() == 5 else bias  # (L, [B,] Hs, Nq, Nk)
        return _IRPEState(ids=ids, ids_t=ids_t, bias=bias)

    # ------------------------------------------------------------------ hooks
    @staticmethod
    def _lookup(lut: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``out[b, h, i, j] = sum_t lut[b, h, i, ids[t, i, j]]``."""
        b, h = lut.shape[:2]
        out = lut.gather(-1, _expand_ids(ids[0], b, h))
        for t in range(1, ids.shape[0]):
            out = out.add_(lut.gather(-1, _expand_ids(ids[t], b, h)))  # in place: no new (B, H, N, N) buffer
        return out

    def _lut(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """``x @ table * scale``: ``(B, H, N, hd) @ (Hs, hd, U) -> (B, H, N, U)``, contiguous (fast gathers)."""
        return x @ (table * self.scale).to(x.dtype)

    def bias(self, q, k, state, layer):
        total = None
        if self.mode == 'contextual':
            if self.table_k is not None:
                total = self._lookup(self._lut(q, self.table_k[layer]), state.ids)
            if self.table_q is not None:
                term = self._lookup(self._lut(k, self.table_q[layer]), state.ids_t).transpose(-1, -2)
                total = term if total is None else total.add_(term)  # the K term is ours: add in place
        if state.bias is not None:
            fixed = state.bias[layer].to(q.dtype)
            fixed = fixed.unsqueeze(0) if fixed.dim() == 3 else fixed  # 4D: a 3D mask is slow in CPU SDPA
            total = fixed if total is None else total.add_(fixed)
        return total

    def weights_value(self, attn, state, layer):
        b, h, nq, _ = attn.shape
        agg = attn.new_zeros(b, h, nq, self.num_buckets)  # attention weight of each bucket, per query
        for t in range(state.ids.shape[0]):
            agg.scatter_add_(-1, _expand_ids(state.ids[t], b, h), attn)
        return agg @ self.table_v[layer].to(attn.dtype)

    def extra_repr(self) -> str:
        return (f'method={self.method}, mode={self.mode}, on={self.on}, ratio={self.ratio}, '
                f'shared_heads={self.shared_heads}, buckets={self.num_buckets}')
