"""LookHere: attention heads with fixed, directed fields of view and a distance penalty.

Each head of each layer adds a fixed logit bias: minus a slope times the distance between the query's
and the key's patch where the key lies in the head's field of view, and the dtype's lowest value (the
key is masked) where it does not. Nothing is learned and the bias depends on positions only, so it is
built once per forward (`_prepare`) and either handed to SDPA as a float mask (``kernel='dense'``) or
evaluated per logit inside FlexAttention (``kernel='flex'``), which never materialises the ``N x N``
bias.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, List, Literal, Optional, Tuple

import torch

from .._dtypes import at_least_float32
from ..contract import PEContext, PositionalEncoding, resolve_num_axes
from ..options import short_repr
from ..positions import Positions
from ..registry import register_pe
from ._checks import check_positive
from .relative_bias import _pad_prefix

__all__ = ['LookHere', 'lookhere_heads', 'LOOKHERE_PRESETS']

# A field of view is an intersection of half-planes ``a * dy + b * dx >= 0`` of the offset (dy, dx) =
# key minus query in (row, col) patch units, rows counting downwards (the boundary lines belong to it).
_HALF_PLANES = {
    'up': ((-1, 0),), 'down': ((1, 0),), 'left': ((0, -1),), 'right': ((0, 1),),
    # 90-degree wedges around an axis, bounded by the two diagonals through the query
    'tri_up': ((-1, -1), (-1, 1)), 'tri_down': ((1, -1), (1, 1)),
    'tri_left': ((-1, -1), (1, -1)), 'tri_right': ((-1, 1), (1, 1)),
    # the union of two neighbouring wedges: the half-plane on one side of a diagonal
    'diag_up_right': ((-1, 1),), 'diag_up_left': ((-1, -1),),
    'diag_down_right': ((1, 1),), 'diag_down_left': ((1, -1),),
}
_HALVES = [('up',), ('down',), ('left',), ('right',)]
_CORNERS = [('up', 'left'), ('up', 'right'), ('down', 'left'), ('down', 'right')]
_TRIANGLES = [('tri_up',), ('tri_down',), ('tri_left',), ('tri_right',)]
# The released direction families (GreenCUBIC/lookhere ``create_lh_layer_tensor``): four fields of view
# each, given to consecutive heads in this order. ``none`` looks everywhere; the ``zero`` families carry
# no distance penalty (``zero``: no position at all).
_FAMILIES = {
    'none': [()] * 4,
    'zero': [()] * 4,
    'halves': _HALVES,
    'corners': _CORNERS,
    'triangles': _TRIANGLES,
    'diagonals': [('diag_up_right',), ('diag_up_left',), ('diag_down_right',), ('diag_down_left',)],
    'eighths1': [('tri_up', 'left'), ('tri_down', 'left'), ('tri_left', 'up'), ('tri_right', 'up')],
    'eighths2': [('tri_up', 'right'), ('tri_down', 'right'), ('tri_left', 'down'), ('tri_right', 'down')],
    'zerohalves': _HALVES,
    'zerocorners': _CORNERS,
    'zerotriangles': _TRIANGLES,
}
# The paper's three variants (a 180, 90 or 45 degree field of view) in the released shorthand
LOOKHERE_PRESETS = {'lh180': 'halves-none', 'lh90': 'triangles-none', 'lh45': 'eighths1-eighths2-none'}
_MAX_PLANES = 3  # an eighth: a wedge (2) cut by an axis (1)


def _undirected(family: str) -> bool:
    """Families whose heads take the released ``get_none_slopes`` (all but the directed ones)."""
    return 'zero' in family or family == 'none'


def _family_slopes(family: str, n: int) -> List[float]:
    """Slopes of ``n`` consecutive heads of one family, the released rule extended to any ``n``.

    Directed heads: ``2^-1`` for the first four (one per direction), ``2^-2`` for the next four, ...
    (``get_slopes``). Undirected heads: ``4^-1 .. 4^-4``, each repeated ``n // 4`` times
    (``get_none_slopes``; one each for fewer than eight heads).
    """
    if _undirected(family):
        repeat = max(1, n // 4)
        return [4.0 ** -(1 + i // repeat) for i in range(n)]
    return [2.0 ** -(1 + i // 4) for i in range(n)]


def lookhere_heads(directions: str, num_heads: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each head's field of view and slope, as the released ``create_lh_layer_tensor`` assigns them.

    ``directions`` is a preset (`LOOKHERE_PRESETS`) or the released shorthand: families joined by
    ``-`` (``'halves-none'``). Heads go to the families in blocks of four, round robin, each family's
    heads kept together in family order; within a family, head ``i`` takes its ``i % 4``-th field of view.
    This reproduces the release for every head count it handles (6 heads: 4 + 2; 12 heads: 8 + 4 for
    two families, 4 + 4 + 4 for three; 16 heads: 8 + 8, 8 + 4 + 4, 4 x 4) and extends it to any other.

    Returns:
        half-planes ``(H, 3, 2)`` (``(a, b)`` rows, zero rows pad), slopes ``(H,)`` (float64) and
        ``(H,)`` bool, True for heads without distance penalty (``zero`` families).
    """
    spec = LOOKHERE_PRESETS.get(directions, directions)
    families = spec.split('-') if isinstance(spec, str) else []
    unknown = [f for f in families if f not in _FAMILIES]
    if not families or unknown:
        raise ValueError(f"option 'directions' of encoding 'lookhere' must be one of {sorted(LOOKHERE_PRESETS)} or "
                         f"families from {sorted(_FAMILIES)} joined by '-', got {short_repr(directions)}")
    counts = [0] * len(families)
    for block in range(0, num_heads, 4):
        counts[(block // 4) % len(families)] += min(4, num_heads - block)
    names = [f for f, c in zip(families, counts) for _ in range(c)]
    fields = [_FAMILIES[f][i % 4] for f, c in zip(families, counts) for i in range(c)]
    slopes = [s for f, group in itertools.groupby(names) for s in _family_slopes(f, len(list(group)))]
    planes = torch.zeros(num_heads, _MAX_PLANES, 2)
    for h, field in enumerate(fields):
        rows = [p for region in field for p in _HALF_PLANES[region]]
        if rows:
            planes[h, :len(rows)] = torch.tensor(rows, dtype=planes.dtype)
    zero = torch.tensor([_undirected(n) and n != 'none' for n in names], dtype=torch.bool)
    return planes, torch.tensor(slopes, dtype=torch.float64), zero


def _distance(d2: torch.Tensor, distance: str) -> torch.Tensor:
    """The penalised distance from a squared Euclidean distance."""
    if distance == 'square':
        return d2
    d = d2.sqrt()
    return d.sqrt() if distance == 'sqrt' else d


@dataclass
class _Grid:
    """Self-attention over one ``(h, w)`` grid after ``prefix`` tokens (``kernel='flex'``): the tokens of a
    `Positions` with a grid are its row-major integer indices (`vispe.grid`), so FlexAttention computes
    each pair's offset from the two token indices. ``coords`` serve the dense fallback."""
    coords: torch.Tensor
    grid: Tuple[int, int]
    prefix: int


@dataclass
class _Dense:
    """The distance penalty ``(1 | B, H, Nq, Nk)`` of slope 1 per layer and where each head cannot look."""
    penalty: torch.Tensor
    blocked: torch.Tensor


@register_pe('lookhere', family='relative_bias')
class LookHere(PositionalEncoding):
    """LookHere (Fuller, Kyrollos, Yassin and Green, NeurIPS 2024, arXiv:2405.13985; GreenCUBIC/lookhere).

    A fixed logit bias per layer ``l`` and head ``h`` between patches ``i`` (query) and ``j`` (key):

        ``-g * s_l * m_h * ||p_j - p_i||``  where ``j`` lies in head ``h``'s field of view, else masked,

    with ``g`` = ``global_slope``, ``s_l`` linear in depth from ``layer_slopes[0]`` (first layer) to
    ``layer_slopes[1]`` (last), ``m_h`` the released head slopes (`lookhere_heads`) and masked entries at
    the attention dtype's lowest value (the release: bfloat16's largest value, negated). Positions are
    (row, col) patch indices, rows counting downwards, the distance Euclidean in patch units (``distance``
    also takes the released ``'sqrt'`` and ``'square'``); a field of view contains its boundary lines, so a
    patch always sees itself and its own row or column (halves). The bias depends on offsets only: a
    larger grid extrapolates, each head keeping its direction and penalty.

    ``directions``: ``'lh180'`` (half-planes up / down / left / right), ``'lh90'`` (90-degree wedges
    around the same four directions) and ``'lh45'`` (the eight 45-degree halves of those wedges) are the
    paper's three variants; in the released shorthand they are ``halves-none``, ``triangles-none`` and
    ``eighths1-eighths2-none``: the directed heads come first (two slopes per direction with 12 heads),
    then heads that look everywhere with a distance penalty only. Any other combination of the released
    families (``halves``, ``corners``, ``triangles``, ``diagonals``, ``eighths1``, ``eighths2``, ``none``,
    ``zero``, ``zerohalves``, ``zerocorners``, ``zerotriangles``) is accepted as a ``-``-joined string.
    The release builds its maps in float64 and stores them in bfloat16; here they are float32 (float64
    for float64 positions).

    Prefix (class / register) tokens have no position: every pair involving one gets bias 0 and is never
    masked, as the release's class token.

    Args:
        directions: a preset (``lh180``, ``lh90``, ``lh45``) or released families joined by ``-``.
        global_slope: ``g``, multiplies every penalty (the release also changes it at test time).
        layer_slopes: ``s_l`` at the first and the last layer, linear in between.
        distance: ``linear`` (Euclidean), ``sqrt`` or ``square`` of it.
        kernel: ``dense`` (an ``(H, N, N)`` float mask for SDPA) or ``flex`` (a FlexAttention
            ``score_mod`` computing each logit's bias from the two token indices of the grid; the same
            numbers, no ``N x N`` tensor; compiled on first use). Self-attention over one grid only:
            per-sample grids (NaFlex), kept tokens (token dropping) and cross-attention take the dense bias.
    """
    shift_invariant = True
    larger_input = 'extrapolate'
    paper = 'Fuller et al., NeurIPS 2024 (LookHere), arXiv:2405.13985'
    float32_buffers = frozenset({'half_planes', 'head_slopes', 'layer_scale'})

    def __init__(self, ctx: PEContext, *, directions: str = 'lh180', global_slope: float = 1.0,
                 layer_slopes: Tuple[float, float] = (1.5, 0.5),
                 distance: Literal['linear', 'sqrt', 'square'] = 'linear',
                 kernel: Literal['dense', 'flex'] = 'dense') -> None:
        super().__init__(ctx)
        if resolve_num_axes(ctx, None, 'lookhere') != 2:
            raise ValueError(f"encoding 'lookhere' needs 2D (row, col) positions, the host has {ctx.host_axes} axes")
        check_positive('lookhere', 'global_slope', global_slope)
        for value in layer_slopes:
            check_positive('lookhere', 'layer_slopes', value)
        self.directions, self.distance, self.kernel = directions, distance, kernel
        planes, slopes, zero = lookhere_heads(directions, ctx.num_heads)
        self.register_buffer('half_planes', planes, persistent=False)
        # the slope of each head, 0 where it has no distance penalty
        self.register_buffer('head_slopes', slopes.masked_fill(zero, 0).float(), persistent=False)
        layer = torch.linspace(layer_slopes[0], layer_slopes[1], max(ctx.depth, 1), dtype=torch.float64)
        self.register_buffer('layer_scale', (global_slope * layer).float(), persistent=False)

    def _coords(self, pos: Positions) -> torch.Tensor:
        if pos.ndim != 2:
            raise ValueError(f"encoding 'lookhere' needs 2D (row, col) positions, got {pos.ndim} axes")
        return at_least_float32(pos.coords)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]):
        pos_k = pos_q if pos_k is None else pos_k
        cq = self._coords(pos_q)
        ck = cq if pos_k is pos_q else self._coords(pos_k)
        if self.kernel == 'flex' and pos_k is pos_q and pos_q.grid is not None and not pos_q.batched:
            return _Grid(cq, tuple(pos_q.grid), pos_q.num_prefix)
        return self._dense(cq, ck, pos_q.num_prefix, pos_k.num_prefix)

    def _dense(self, cq: torch.Tensor, ck: torch.Tensor, prefix_q: int, prefix_k: int) -> _Dense:
        """Penalty and mask of query coordinates ``([B,] Nq, 2)`` and key coordinates ``([B,] Nk, 2)``."""
        offset = ck.unsqueeze(-3) - cq.unsqueeze(-2)  # ([B,] Nq, Nk, 2): key minus query, exact for indices
        planes = self.half_planes.to(offset.dtype)
        side = torch.einsum('hpc,...qkc->...hpqk', planes, offset)  # ([B,] H, 3, Nq, Nk)
        blocked = (side < 0).any(-3)
        dist = _distance(offset.square().sum(-1), self.distance).unsqueeze(-3)
        penalty = self.head_slopes.to(dist.dtype).view(-1, 1, 1) * dist  # ([B,] H, Nq, Nk)
        if penalty.dim() == 3:  # 4D keeps SDPA's fused CPU kernel
            penalty, blocked = penalty.unsqueeze(0), blocked.unsqueeze(0)
        return _Dense(_pad_prefix(penalty, prefix_q, prefix_k), _pad_prefix(blocked, prefix_q, prefix_k))

    def _layer_scale(self, layer: int) -> torch.Tensor:
        if not 0 <= layer < len(self.layer_scale):
            raise ValueError(f"encoding 'lookhere' was built for depth {len(self.layer_scale)}, got layer {layer}")
        return self.layer_scale[layer]

    def bias(self, q, k, state, layer):
        if isinstance(state, _Grid):  # kernel='flex' on a path FlexAttention does not take: the same bias
            state = self._dense(state.coords, state.coords, state.prefix, state.prefix)
        bias = (state.penalty * -self._layer_scale(layer).to(state.penalty.dtype)).to(q.dtype)
        return bias.masked_fill_(state.blocked, torch.finfo(q.dtype).min)  # a fresh tensor: filled in place

    def score_mod(self, state, layer: int, dtype: torch.dtype) -> Optional[Callable[..., torch.Tensor]]:
        if not isinstance(state, _Grid):
            return None
        scale = self._layer_scale(layer)
        if torch.compiler.is_compiling():
            # inductor's CPU FlexAttention kernel takes captured tensors that are graph inputs (the buffers),
            # not tensors computed in the graph (coordinates, products); the layer is a constant there
            slopes, scales, at = self.head_slopes, self.layer_scale, layer
        else:  # one compiled kernel serves every layer: its slopes are an input, not a constant
            slopes, at = self.head_slopes * scale, 0
            scales = slopes.new_ones(1)
        planes, distance = self.half_planes, self.distance
        width, prefix, lowest = state.grid[1], state.prefix, torch.finfo(dtype).min

        def score_mod(score, b, h, q_idx, kv_idx):
            qi, ki = q_idx - prefix, kv_idx - prefix
            qy, ky = qi // width, ki // width
            dy = (ky - qy).to(slopes.dtype)
            dx = ((ki - ky * width) - (qi - qy * width)).to(slopes.dtype)
            seen = planes[h, 0, 0] * dy + planes[h, 0, 1] * dx >= 0
            for p in range(1, _MAX_PLANES):
                seen = seen & (planes[h, p, 0] * dy + planes[h, p, 1] * dx >= 0)
            penalty = slopes[h] * scales[at] * _distance(dy * dy + dx * dx, distance)
            bias = torch.where(seen, -penalty, lowest)
            bias = torch.where((qi < 0) | (ki < 0), 0.0, bias)  # prefix tokens
            return score + bias.to(score.dtype)

        return score_mod

    def extra_repr(self) -> str:
        return f'directions={self.directions}, kernel={self.kernel}'
