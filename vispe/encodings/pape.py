"""PaPE and PaPE-RI: parabolic position encoding ("Where to Attend: A Principled Vision-Centric
Position Encoding with Parabolas", arXiv:2602.01418, 2026; code: DTU-PAS/parabolic-position-encoding).

Both are logit biases that depend on the query token and on position differences. Neither
materialises an ``(N, N)`` bias: the bias is a quadratic form in the key position, so it is
folded into SDPA by appending channels to q (functions of the query token and position) and to k
(monomials of the key position); their dot product is exactly the bias. Because ``u = W_pos r`` is
linear in the D-dimensional position ``r``, the P parabolas collapse to a D x D form per query and
head, so PaPE needs ``1 + D + D(D+1)/2`` extra channels (6 for images) however many parabolas it
has, and PaPE-RI ``D + 2``. The channels are built in float32 (float64 if the inputs are); under
bf16 attention the folded bias is only as precise as bf16.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, List, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .._dtypes import at_least_float32
from ..options import short_repr
from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from ._checks import check_min_int
from ..contract import Capabilities, PEContext, PositionalEncoding, resolve_num_axes

__all__ = ['PaPE', 'PaPERI', 'pape_coordinates']

BiasScale = Literal['logit', 'qk']


MAX_START = 1e4


def pape_coordinates(pos: Positions, start: float = 1.0, grid_mode: GridMode = 'index') -> torch.Tensor:
    """PaPE's token coordinates ``([B,] N_total, D)`` (at least float32), prefix tokens included.

    Grid tokens: indices plus ``start`` (1: the first patch is at (1, 1)), in the released code's
    order: ``(col, row)`` for an image (its image classifier), ``(t, row, col)`` for video (its video
    classifier), in a NaFlex batch each sample's on its own grid; point sets: their coordinates as
    given. Prefix tokens sit at the origin.
    """
    if pos.index_grid is not None or pos.index_grids is not None:  # grid indices, also after token dropping
        coords = grid_coordinates(pos, grid_mode)
        coords = at_least_float32(coords.flip(-1) if pos.ndim == 2 else coords) + start
    else:
        coords = at_least_float32(pos.coords)
    if pos.num_prefix:
        coords = torch.cat([coords.new_zeros(*coords.shape[:-2], pos.num_prefix, coords.shape[-1]), coords], -2)
    return coords


@dataclass
class _ParabolicState:
    r_q: torch.Tensor  # ([B, 1,] Nq, D) centred query coordinates
    k_tail: torch.Tensor  # ([B, 1,] Nk, E + pad) key channels: monomials of the key position, scaled, zero-padded
    q_feat: Optional[torch.Tensor] = None  # PaPE-RI: ([B, 1,] Nq, E + pad) query channels per unit of a_h s_h^2
    u_q: Optional[torch.Tensor] = None  # PaPE: (L, [B,] H, Nq, P) parabola coordinates of the queries
    w_beta: Optional[torch.Tensor] = None  # PaPE: (L, H * D, C) b-projection folded through W_pos
    w_pair: Optional[torch.Tensor] = None  # PaPE: (L, H, P, K) products W_pd W_pe of the quadratic form


class _Parabolic(PositionalEncoding):
    """Shared mechanics: coordinates, the augmented q/k (pre-scaled so the extra channels add the
    bias in the requested units), and v padded to the augmented width so SDPA keeps its fused
    kernel (q, k and v of equal width), sliced back after attention."""
    shift_invariant = True
    larger_input = 'extrapolate'
    needs_tokens = True
    changes_head_dim = True

    def __init__(
            self,
            ctx: PEContext,
            *,
            num_axes: Optional[int] = None,
            start: float = 1.0,
            grid_mode: GridMode = 'index',
            bias_scale: BiasScale = 'logit',
            pad_to_multiple: int = 8,
    ) -> None:
        super().__init__(ctx)
        if num_axes is not None:
            check_min_int(self.name, 'num_axes', num_axes)
        num_axes = resolve_num_axes(ctx, num_axes, self.name)
        check_min_int(self.name, 'pad_to_multiple', pad_to_multiple)
        if pad_to_multiple > 256:  # the widest head the flash kernels take; more padding only costs
            raise ValueError(f"option 'pad_to_multiple' of encoding {self.name!r} must be at most 256, "
                             f'got {pad_to_multiple}')
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not abs(start) <= MAX_START:
            # the parabolas square the coordinates: they must stay far inside float32's range
            raise ValueError(f"option 'start' of encoding {self.name!r} must be a number in "
                             f'[-{MAX_START:g}, {MAX_START:g}], got {short_repr(start)}')
        for option, value, allowed in (('grid_mode', grid_mode, ('index', 'normalized')),
                                       ('bias_scale', bias_scale, ('logit', 'qk'))):
            if value not in allowed:
                raise ValueError(f'option {option!r} of encoding {self.name!r} must be one of {allowed}, '
                                 f'got {short_repr(value)}')
        self.num_axes = num_axes
        self.start = start
        self.grid_mode = grid_mode
        self.bias_scale = bias_scale
        self.pad_to_multiple = pad_to_multiple
        extra = self.extra_channels(num_axes)
        total = ctx.head_dim + extra
        self.num_extra = extra
        self.num_pad = -total % pad_to_multiple
        self.attn_scale = ctx.head_dim ** -0.5

    def extra_channels(self, num_axes: int) -> int:
        """Channels the bias adds to q and k (before padding) for D = ``num_axes``."""
        raise NotImplementedError

    def _declare_capabilities(self) -> Capabilities:
        # q, k and v share the padded width; CUDA's flash kernels take head dims up to 256 (checked
        # on an H200 with benchmarks/cuda_check.py)
        caps = super()._declare_capabilities()
        return replace(caps, flash_kernels=self.ctx.head_dim + self.num_extra + self.num_pad <= 256)

    def coordinates(self, pos_q: Positions, pos_k: Optional[Positions]) -> Tuple[torch.Tensor, torch.Tensor]:
        """Query and key coordinates, both shifted by the mean key grid position.

        The bias depends only on differences of coordinates (prefix tokens included), so the common
        shift changes nothing but keeps the expanded quadratic terms small (float32 cancellation).
        """
        pos_k_or_q = pos_q if pos_k is None else pos_k
        for p in (pos_q, pos_k_or_q):
            if p.ndim != self.num_axes:
                raise ValueError(f'encoding {self.name!r} was built for {self.num_axes} coordinate axes, '
                                 f'positions have {p.ndim}')
        r_q = pape_coordinates(pos_q, self.start, self.grid_mode)
        r_k = r_q if pos_k is None else pape_coordinates(pos_k, self.start, self.grid_mode)
        npk = pos_k_or_q.num_prefix
        grid_part = r_k[..., npk:, :] if r_k.shape[-2] > npk else r_k
        mask = pos_k_or_q.key_padding_mask
        if mask is not None and grid_part.shape[-2] == mask.shape[-1]:  # NaFlex: each sample's mean over its real tokens
            real = (~mask).unsqueeze(-1).to(r_k.dtype)
            center = (grid_part * real).sum(dim=-2, keepdim=True) / real.sum(dim=-2, keepdim=True).clamp_min(1)
        else:
            center = grid_part.mean(dim=-2, keepdim=True)
        if center.dim() == 3 and r_q.dim() == 2:
            r_q = r_q.unsqueeze(0)
        if center.dim() == 3 and r_k.dim() == 2:
            r_k = r_k.unsqueeze(0)
        return r_q - center, r_k - center

    def _key_tail(self, k_extra: torch.Tensor) -> torch.Tensor:
        """Key channels ready to concatenate: the bias unit folded in (SDPA multiplies every channel
        by the attention scale, so ``'logit'`` divides by it here, once per forward) and zero padding."""
        if self.bias_scale == 'logit':
            k_extra = k_extra / self.attn_scale
        k_extra = F.pad(k_extra, (0, self.num_pad))
        return k_extra.unsqueeze(-3) if k_extra.dim() == 3 else k_extra

    def _augment(self, q: torch.Tensor, k: torch.Tensor, q_extra: torch.Tensor,
                 state: _ParabolicState) -> Tuple[torch.Tensor, torch.Tensor]:
        b, h, nk = k.shape[:3]
        k_aug = torch.cat([k, state.k_tail.to(k.dtype).expand(b, h, nk, -1)], -1)
        pad = q_extra.new_zeros(1, 1, 1, k_aug.shape[-1] - q.shape[-1] - q_extra.shape[-1])
        q_aug = torch.cat([q, q_extra.to(q.dtype), pad.to(q.dtype).expand(*q.shape[:-1], -1)], -1)
        return q_aug, k_aug

    @staticmethod
    def _token_input(x: Optional[torch.Tensor], name: str) -> torch.Tensor:
        if x is None:
            raise ValueError(f'encoding {name!r} needs the attention input tokens: pass x= to pe_attention')
        return x

    def value(self, v, state, layer):
        return F.pad(v, (0, self.num_extra + self.num_pad))

    def output(self, o, state, layer):
        return o[..., :self.ctx.head_dim]


def _uniform_(t: torch.Tensor, fan_in: int) -> torch.Tensor:
    """nn.Linear's default init, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (what the released code uses)."""
    bound = 1.0 / math.sqrt(fan_in)
    return nn.init.uniform_(t, -bound, bound)


def _pairs(d: int) -> List[Tuple[int, int]]:
    return [(i, j) for i in range(d) for j in range(i, d)]


@register_pe('pape', family='pape')
class PaPE(_Parabolic):
    """PaPE (2026): per layer, head and query a sum of P parabolas over projected positions.

    With ``u = W_pos r`` (``D -> H * P``, no bias) and, from the normed token ``x_i`` that entered
    the attention, ``a = softplus(W_a x_i)`` and ``b = W_b x_i`` (``C -> H * P`` each, no bias), the
    logit bias of query i and key j in head h is
    ``- sum_m a_m (u_im - u_jm)^2 + sum_m b_m (u_im - u_jm)``.

    Conventions (the released code, DTU-PAS/parabolic-position-encoding: ``pape/nn/positions/pape.py``
    of the release snapshot, the same code as ``pape_naive.py`` of revision 96fc92b, which adds a
    Triton ``pape_efficient.py``; ``pape/nn/image_classifier.py`` and ``video_classifier.py``):
    positions are integer patch indices starting at 1, ``(col, row)`` for images and
    ``(t, row, col)`` for video (the released classifiers' orders, so released ``W_pos`` columns
    load as they are), with the class token at the origin, built per forward (so any resolution
    works: the grid is rebuilt); one set of parameters per layer; nn.Linear's default init. The
    released code passes the augmented channels through SDPA's ``1/sqrt(hd)`` like q.k
    (``bias_scale='qk'``); vispe's default adds the bias in logit units (``'logit'``, the formula
    above); the two differ by a constant absorbed by ``W_pos`` and ``W_b``.

    Parameters: ``pos_proj`` ``(L, H * P, D)`` and ``ab_proj`` ``(L, 2 * H * P, C)`` (rows: a, then b),
    nn.Linear weight layouts stacked over layers (the released ``position`` and ``ab`` layers).

    Args:
        parabolas: P, parabolas per head (50).
        num_axes: coordinate axes D (default: the host grid's, else 2).
        start: coordinate of the first patch (1).
        grid_mode: ``index`` (extrapolate) or ``normalized`` (rescaled to the training grid).
        bias_scale: ``'logit'`` (bias added to the scaled logits) or ``'qk'`` (scaled like q.k).
        pad_to_multiple: pad the augmented head width to a multiple of this (8, as the released code).
    """
    paper = 'PaPE (2026), arXiv:2602.01418'
    float32_buffers = frozenset({'_pair_weight'})

    def __init__(self, ctx: PEContext, *, parabolas: int = 50, **options: Any) -> None:
        check_min_int(self.name, 'parabolas', parabolas)
        super().__init__(ctx, **options)
        self.parabolas = parabolas
        L, H, P, D, C = ctx.depth, ctx.num_heads, parabolas, self.num_axes, ctx.dim
        self.pos_proj = nn.Parameter(_uniform_(torch.empty(L, H * P, D), D))
        self.ab_proj = nn.Parameter(_uniform_(torch.empty(L, 2 * H * P, C), C))
        pairs = _pairs(D)
        self.register_buffer('_pair_index', torch.tensor(pairs, dtype=torch.long).reshape(-1, 2), persistent=False)
        self.register_buffer('_pair_weight', torch.tensor([1.0 if i == j else 2.0 for i, j in pairs]),
                             persistent=False)

    def extra_channels(self, num_axes: int) -> int:
        return 1 + num_axes + len(_pairs(num_axes))  # [1, r_j, monomials r_jd r_je]

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> _ParabolicState:
        L, H, P, D = self.ctx.depth, self.ctx.num_heads, self.parabolas, self.num_axes
        r_q, r_k = self.coordinates(pos_q, pos_k)
        w = at_least_float32(self.pos_proj).view(L, H, P, D)
        r_q, r_k = r_q.to(w.dtype), r_k.to(w.dtype)
        u_q = torch.einsum('lhpd,...nd->l...hnp', w, r_q)
        w_b = at_least_float32(self.ab_proj[:, H * P:]).view(L, H, P, -1)
        w_beta = torch.einsum('lhpc,lhpd->lhdc', w_b, w).reshape(L, H * D, -1)
        i, j = self._pair_index.unbind(-1)
        w_pair = w[..., i] * w[..., j]
        monomials = r_k[..., i] * r_k[..., j] * self._pair_weight
        k_tail = self._key_tail(torch.cat([torch.ones_like(r_k[..., :1]), r_k, monomials], dim=-1))
        r_q = r_q.unsqueeze(-3) if r_q.dim() == 3 else r_q
        return _ParabolicState(r_q=r_q, k_tail=k_tail, u_q=u_q, w_beta=w_beta, w_pair=w_pair)

    def qk(self, q, k, state, layer, x=None):
        x = self._token_input(x, self.name)
        B, N, _ = x.shape
        H, P, D = self.ctx.num_heads, self.parabolas, self.num_axes
        a = F.softplus(at_least_float32(F.linear(x, self.ab_proj[layer, :H * P].to(x.dtype))))
        a = a.view(B, N, H, P).transpose(1, 2)  # (B, H, N, P)
        xf = at_least_float32(x)
        beta = F.linear(xf, state.w_beta[layer].to(xf.dtype)).view(B, N, H, D).transpose(1, 2)  # W^T b per head
        u, r = state.u_q[layer], state.r_q
        au = a * u
        w = at_least_float32(self.pos_proj[layer]).view(H, P, D)
        # bias_ij = -(r_i - r_j)^T A_i (r_i - r_j) + beta_i . (r_i - r_j),  A_i = W^T diag(a_i) W
        const = (beta * r).sum(-1, keepdim=True) - (au * u).sum(-1, keepdim=True)
        linear = 2 * (au @ w) - beta  # coefficient of r_j
        quad = -(a @ state.w_pair[layer])  # coefficients of the monomials r_jd r_je
        return self._augment(q, k, torch.cat([const, linear, quad], -1), state)

    def extra_repr(self) -> str:
        return f'parabolas={self.parabolas}, num_axes={self.num_axes}, bias_scale={self.bias_scale}'


@register_pe('pape_ri', family='pape')
class PaPERI(_Parabolic):
    """PaPE-RI (2026), the rotation-invariant variant: bias ``- a_h s_h^2 ||r_i - r_j||^2``.

    ``a = softplus(W_a x_i)`` (``C -> H``, no bias) from the normed query token; ``s_h`` a fixed
    (not learned) per-head scale drawn from ``U(-sqrt(1/D), sqrt(1/D))`` per layer, stored as the
    buffer ``position_scales`` ``(L, H)``. Positions, prefix tokens, ``bias_scale`` and padding as
    in `PaPE`. Depends only on distances, so invariant to any rotation and shift of all positions.

    Parameters: ``a_proj`` ``(L, H, C)``.

    Args:
        num_axes: coordinate axes D (default: the host grid's, else 2).
        start: coordinate of the first patch (1).
        grid_mode: ``index`` or ``normalized``.
        bias_scale: ``'logit'`` or ``'qk'`` (see `PaPE`).
        pad_to_multiple: pad the augmented head width to a multiple of this (8).
    """
    paper = 'PaPE-RI (2026), arXiv:2602.01418'
    float32_buffers = frozenset({'position_scales'})

    def __init__(self, ctx: PEContext, **options: Any) -> None:
        super().__init__(ctx, **options)
        L, H = ctx.depth, ctx.num_heads
        bound = math.sqrt(1.0 / self.num_axes)
        self.register_buffer('position_scales', (2 * torch.rand(L, H) - 1) * bound)
        self.a_proj = nn.Parameter(_uniform_(torch.empty(L, H, ctx.dim), ctx.dim))

    def extra_channels(self, num_axes: int) -> int:
        return num_axes + 2  # [1, r_j, ||r_j||^2]

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> _ParabolicState:
        r_q, r_k = self.coordinates(pos_q, pos_k)
        # -a s^2 ||r_i - r_j||^2 = a s^2 * ([-||r_i||^2, 2 r_i, -1] . [1, r_j, ||r_j||^2])
        q_feat = torch.cat([-r_q.square().sum(-1, keepdim=True), 2 * r_q, -torch.ones_like(r_q[..., :1])], -1)
        k_tail = self._key_tail(torch.cat([torch.ones_like(r_k[..., :1]), r_k, r_k.square().sum(-1, keepdim=True)], -1))
        q_feat = q_feat.unsqueeze(-3) if q_feat.dim() == 3 else q_feat
        return _ParabolicState(r_q=r_q, k_tail=k_tail, q_feat=q_feat)

    def qk(self, q, k, state, layer, x=None):
        x = self._token_input(x, self.name)
        a = F.softplus(at_least_float32(F.linear(x, self.a_proj[layer].to(x.dtype))))  # (B, N, H)
        a = (a * at_least_float32(self.position_scales[layer]).square()).transpose(1, 2).unsqueeze(-1)  # a_h s_h^2
        return self._augment(q, k, a * state.q_feat, state)

    def extra_repr(self) -> str:
        return f'num_axes={self.num_axes}, bias_scale={self.bias_scale}'
