"""Multimodal position ids: M-RoPE, MRoPE-Interleave, MHRoPE, VRoPE, V2PE, VideoRoPE, HoPE, Circle-RoPE
(and plain 1D RoPE).

Every scheme answers the same two questions about a `SegmentTable`:

* how far a segment advances the running position (its *extent*): text advances by its length,
  a visual block by a scheme-specific amount, so the next segment starts at
  ``start + extent`` (per sequence, an exclusive cumulative sum over segments);
* the ids of its tokens. Within a *run* (a whole text segment, one row of a visual frame, or a
  whole visual block for 1D schemes) every axis is an arithmetic progression
  ``value = v0 + slope * offset``, so ids for all tokens come from per-run ``(v0, slope)``: two
  cumulative sums for integer ids, one gather for fractional ids; no Python loop over tokens, rows
  or images.

Text tokens get the same running index on every axis, so for pure text every scheme equals
ordinary 1D RoPE. ``rope_delta = next_position - L`` per sequence (``L`` the padded length):
a decoding step at cache position ``c`` has position ``c + rope_delta`` on every axis
(Qwen2-VL's convention, `decode_position_ids`).
"""
from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar, Dict, Literal, Optional, Sequence, Tuple, Type, Union

import torch

from .layout import (
    QWEN2_VL_TOKEN_IDS, TEXT, Layout, SegmentTable, VideoBlocks, _mask_from_lengths, normalise_layouts,
    table_from_layouts, table_from_token_ids,
)

__all__ = ['Scheme', 'RoPE1D', 'MRoPE', 'MRoPEInterleave', 'MHRoPE', 'VRoPE', 'V2PE', 'VideoRoPE', 'HoPE',
           'CircleRoPE', 'SCHEMES', 'RULES',
           'get_scheme', 'position_ids', 'decode_position_ids']

Tensor = torch.Tensor

# How the token-id form follows transformers' ``get_rope_index``: its 5.x rule (the default) or its 4.x one.
Rule = Literal['5.x', '4.x']
RULES = ('5.x', '4.x')


class Runs:
    """Per-run ``v0`` ``(A, R)``, ``slope`` ``(A, R)`` (or ``(A, 1)``), ``start`` and ``length`` ``(R,)``."""
    __slots__ = ('v0', 'slope', 'start', 'length')

    def __init__(self, v0: Tensor, slope: Tensor, start: Tensor, length: Tensor) -> None:
        self.v0, self.slope, self.start, self.length = v0, slope, start, length


class Scheme:
    """Base of the position-id schemes: extents per segment, ``(v0, slope)`` per run.

    Subclasses set ``name``, ``axes`` (one character per id axis) and implement `visual_extent`
    and either `visual_rows` (runs = rows of each frame) or `visual_block` (one run per block).
    ``video_blocks`` is how the token ids of the model family the scheme comes from lay out a
    video (see `layout.VideoBlocks`): the default of `position_ids` on token ids.
    """
    name: ClassVar[str] = ''
    axes: ClassVar[str] = 'p'
    paper: ClassVar[str] = ''
    row_runs: ClassVar[bool] = True
    video_blocks: ClassVar[VideoBlocks] = 'video'
    next_from_max: ClassVar[bool] = False

    @property
    def float_ids(self) -> bool:
        """True when ids are fractional (float64), else int64."""
        return False

    @property
    def num_axes(self) -> int:
        return len(self.axes)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float64 if self.float_ids else torch.long

    # ------------------------------------------------------------------ per scheme
    def visual_extent(self, seg: Dict[str, Tensor]) -> Tensor:
        """How far each visual segment advances the running position."""
        raise NotImplementedError

    def visual_rows(self, row: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """``(v0, slope)`` of each row run: ``(A, R)`` and ``(A, R)`` or ``(A, 1)``."""
        raise NotImplementedError

    def visual_block(self, seg: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """``(v0, slope)`` of each visual block taken as one run (1D schemes)."""
        raise NotImplementedError

    def draw(self, seg: Dict[str, Tensor], training: bool, generator: Optional[torch.Generator]) -> None:
        """Add per-call random choices to the visual segments' fields (V2PE's training strides)."""

    # ------------------------------------------------------------------ helpers
    def _time_index(self, t: Tensor, seconds: Tensor, tokens_per_second: Optional[float],
                    hf5: bool = False, seconds_dtype: torch.dtype = torch.float64) -> Tensor:
        """Temporal index of frame ``t``: Qwen2.5-VL ``floor(t * second_per_grid * tokens_per_second)``
        (multiply first, then floor) for timed videos, else ``t`` (Qwen2-VL).

        ``hf5`` (transformers 5.x's rule): ``(t * (tokens_per_second * second_per_grid)).long()`` in the
        dtype the caller gave ``second_per_grid_ts`` in, untimed videos counting 1 s per temporal patch.
        """
        if tokens_per_second is None:
            return t
        if hf5:
            interval = torch.nan_to_num(seconds, nan=1.0).to(seconds_dtype) * tokens_per_second
            return (t * interval).long()
        timed = ~torch.isnan(seconds)
        scaled = torch.floor(t.double() * torch.nan_to_num(seconds) * tokens_per_second).long()
        return torch.where(timed, scaled, t)

    def build(self, table: SegmentTable, training: bool = False,
              generator: Optional[torch.Generator] = None, hf5: bool = False) -> Tuple[Tensor, Tensor]:
        """Ids ``(A, N)`` of the flattened real tokens and the next position ``(B,)`` of each sequence.

        ``hf5``: transformers 5.x's ``get_rope_index`` rule where it differs (see `position_ids`).
        """
        dev, dt, A = table.device, self.dtype, self.num_axes
        S = table.kind.numel()
        is_vis = table.kind != TEXT
        T, H, W = table.grid.unbind(1)
        extent = table.num_tokens.to(dt).clone()
        vis = torch.nonzero(is_vis).squeeze(1)
        seg_v = {'T': T[vis], 'H': H[vis], 'W': W[vis], 'n': table.num_tokens[vis],
                 'seconds': table.seconds[vis], 'token_start': table.token_start[vis], 'hf5': hf5,
                 'seconds_dtype': table.seconds_dtype}
        self.draw(seg_v, training, generator)
        if vis.numel():
            extent[vis] = self.visual_extent(seg_v).to(dt)
        # start of each segment: exclusive cumsum of extents, restarted at every sequence
        csum = torch.cumsum(extent, 0)
        excl = csum - extent
        B = table.batch_size
        first = torch.full((B,), S, dtype=torch.long, device=dev)
        if S:
            first.scatter_reduce_(0, table.batch, torch.arange(S, device=dev), reduce='amin')
        base = torch.zeros(B, dtype=dt, device=dev)
        has = first < S
        base[has] = excl[first[has]]
        start = excl - base[table.batch] if S else excl
        nxt = torch.zeros(B, dtype=dt, device=dev)
        if S:
            nxt.scatter_reduce_(0, table.batch, csum - base[table.batch], reduce='amax', include_self=False)
        seg_v['start'] = start[vis]

        runs = [self._text_runs(table, start, ~is_vis)]
        if vis.numel():
            runs.append(self._visual_runs(seg_v))
        v0 = torch.cat([r.v0.to(dt).expand(A, r.start.numel()) for r in runs], 1)
        slope = torch.cat([r.slope.to(dt).expand(A, r.start.numel()) for r in runs], 1)
        rstart = torch.cat([r.start for r in runs])
        rlen = torch.cat([r.length for r in runs])
        order = torch.argsort(rstart)
        v0, slope, rstart, rlen = v0[:, order], slope[:, order], rstart[order], rlen[order]
        keep = rlen > 0
        if not bool(keep.all()):
            v0, slope, rstart, rlen = v0[:, keep], slope[:, keep], rstart[keep], rlen[keep]
        expand = _expand_float if self.float_ids else _expand_int
        ids = expand(v0, slope, rstart, rlen, table.total_tokens)
        return ids, nxt

    def _text_runs(self, table: SegmentTable, start: Tensor, text: Tensor) -> Runs:
        s = start[text]
        return Runs(s[None], torch.ones(1, 1, dtype=s.dtype, device=s.device), table.token_start[text],
                    table.num_tokens[text])

    def _visual_runs(self, seg: Dict[str, Tensor]) -> Runs:
        if not self.row_runs:
            v0, slope = self.visual_block(seg)
            return Runs(v0, slope, seg['token_start'], seg['n'])
        rows = seg['T'] * seg['H']
        R = int(rows.sum())
        sid = torch.repeat_interleave(torch.arange(rows.numel(), device=rows.device), rows, output_size=R)
        r = torch.arange(R, device=rows.device) - (torch.cumsum(rows, 0) - rows)[sid]
        Hr, Wr = seg['H'][sid], seg['W'][sid]
        row = {k: (v[sid] if torch.is_tensor(v) else v) for k, v in seg.items()}
        row.update(t=r // Hr, h=r % Hr)
        v0, slope = self.visual_rows(row)
        return Runs(v0, slope, seg['token_start'][sid] + r * Wr, Wr)

    def __repr__(self) -> str:
        opts = ', '.join(f'{k}={v!r}' for k, v in vars(self).items() if not k.startswith('_'))
        return f'{type(self).__name__}({opts})'


def _expand_int(v0: Tensor, slope: Tensor, start: Tensor, length: Tensor, N: int) -> Tensor:
    """Exact int64 ids ``(A, N)`` of consecutive runs by two cumulative sums (no per-token gather).

    The per-token slope is the cumsum of slope changes at run starts; the ids are the cumsum of the
    slopes, with each run start's increment replaced by the jump from the previous run's last id.
    """
    A = v0.shape[0]
    prev_slope = torch.zeros_like(slope)
    prev_slope[:, 1:] = slope[:, :-1]
    prev_end = torch.zeros_like(v0)
    prev_end[:, 1:] = v0[:, :-1] + slope[:, :-1] * (length[:-1] - 1)
    inc = torch.zeros(A, N, dtype=v0.dtype, device=v0.device)
    inc[:, start] = slope - prev_slope
    inc.cumsum_(1)
    inc[:, start] = v0 - prev_end
    return inc.cumsum_(1)


def _expand_float(v0: Tensor, slope: Tensor, start: Tensor, length: Tensor, N: int) -> Tensor:
    """float64 ids ``(A, N)`` as ``v0 + slope * offset`` per token (no accumulated rounding)."""
    A = v0.shape[0]
    run = torch.repeat_interleave(torch.arange(start.numel(), device=start.device), length, output_size=N)
    # (R, 2A) rows gathered along dim 0: the fast gather layout
    tab = torch.cat([v0 - slope * start.to(v0.dtype), slope]).t().contiguous()
    g = tab.index_select(0, run)
    idx = torch.arange(N, device=v0.device, dtype=v0.dtype)
    return torch.addcmul(g[:, :A], g[:, A:], idx[:, None]).t().contiguous()


def _stack(*rows: Tensor) -> Tensor:
    return torch.stack(rows, 0)


class RoPE1D(Scheme):
    """Plain 1D RoPE (Su et al. 2021): every token, visual or not, advances the position by one.

    The baseline of the multimodal schemes ("vanilla RoPE" in the Multimodal-RoPEs study).
    """
    name = 'rope'
    axes = 'p'
    paper = 'Su et al., RoFormer, arXiv:2104.09864'
    row_runs = False

    def visual_extent(self, seg):
        return seg['n']

    def visual_block(self, seg):
        return seg['start'][None], torch.ones(1, 1, dtype=torch.long, device=seg['n'].device)


class MRoPE(Scheme):
    """M-RoPE (Qwen2-VL, Wang et al. 2024) with Qwen2.5-VL's absolute time.

    A visual block starting at ``s`` gives merged token ``(t, h, w)`` the ids
    ``(s + tau(t), s + h, s + w)``; the next segment starts at ``max over all three axes + 1``.
    ``tau(t) = floor(t * second_per_grid_t * tokens_per_second)`` for timed videos (Qwen2.5-VL;
    multiply first, then floor: truncating ``second_per_grid_t`` to an integer first, as some
    library versions do, collapses frames), ``tau(t) = t`` for images and untimed videos (Qwen2-VL).

    Args:
        tokens_per_second: Qwen2.5-VL's temporal ids per second (2); None ignores timing (Qwen2-VL).
    """
    name = 'mrope'
    axes = 'thw'
    paper = 'Wang et al., Qwen2-VL, arXiv:2409.12191; Bai et al., Qwen2.5-VL, arXiv:2502.13923'
    next_from_max = True  # transformers 5.x: rope_delta from the largest id of the sequence

    def __init__(self, *, tokens_per_second: Optional[float] = 2.0) -> None:
        if tokens_per_second is not None and not tokens_per_second > 0:
            raise ValueError(f'tokens_per_second must be > 0 or None, got {tokens_per_second!r}')
        self.tokens_per_second = tokens_per_second

    def visual_extent(self, seg):
        if seg['hf5']:  # transformers 5.x: the block advances by max(H, W), whatever its time span
            return torch.maximum(seg['H'], seg['W'])
        t_last = self._time_index(seg['T'] - 1, seg['seconds'], self.tokens_per_second)
        return torch.maximum(torch.maximum(t_last, seg['H'] - 1), seg['W'] - 1) + 1

    def _tau(self, row):
        return self._time_index(row['t'], row['seconds'], self.tokens_per_second, row['hf5'], row['seconds_dtype'])

    def visual_rows(self, row):
        s = row['start']
        one = torch.tensor([[0], [0], [1]], device=s.device)
        return _stack(s + self._tau(row), s + row['h'], s), one


class MRoPEInterleave(MRoPE):
    """MRoPE-Interleave (Huang et al. 2025, "Revisiting Multimodal Positional Encoding"; Qwen3-VL).

    Ids as M-RoPE; the rotary pairs cycle ``t, h, w`` (sections ``[24, 20, 20]`` for hd 128, see
    `MultimodalRotary`). ``spatial_reset``: visual ``h, w`` start at 0 and only ``t`` carries the
    offset ``s`` (the block still advances the running position as in M-RoPE, i.e. the reference
    code's vision-end rule). Qwen3-VL itself uses no reset and splits videos into single-frame
    blocks separated by timestamp text: on token ids, each ``video_grid_thw`` row ``(T, H, W)`` stands
    for T blocks ``(1, H, W)`` (``video_blocks = 'frame'``, as Qwen3-VL's and the Multimodal-RoPEs
    reference ``get_rope_index``); as a layout, give one ``Video`` per frame.

    Args:
        spatial_reset: visual h, w ids without the offset (the paper's variant); False = Qwen3-VL.
        tokens_per_second: temporal ids per second for timed videos (None: frame index).
    """
    name = 'mrope_interleave'
    paper = 'Huang et al., arXiv:2510.23095 (MRoPE-I); Qwen3-VL'
    video_blocks = 'frame'

    def __init__(self, *, spatial_reset: bool = False, tokens_per_second: Optional[float] = 2.0) -> None:
        super().__init__(tokens_per_second=tokens_per_second)
        self.spatial_reset = bool(spatial_reset)

    def visual_rows(self, row):
        if not self.spatial_reset:
            return super().visual_rows(row)
        s = row['start']
        one = torch.tensor([[0], [0], [1]], device=s.device)
        return _stack(s + self._tau(row), row['h'], torch.zeros_like(s)), one


class MHRoPE(MRoPEInterleave):
    """MHRoPE (Huang et al. 2025): the MRoPE-I ids; whole heads (not frequency sections) per axis.

    The head assignment lives in `MultimodalRotary` (``head_sections``). Token ids lay out videos one
    block per frame, as for MRoPE-I (the reference code shares its ``get_rope_index``).
    """
    name = 'mhrope'
    paper = 'Huang et al., arXiv:2510.23095 (MHRoPE)'


class VRoPE(Scheme):
    """VRoPE (Liu et al., EMNLP 2025): symmetric diagonal indices, frames along the text axis.

    For ``T`` frames of ``H x W`` merged tokens: ``span = H + W - 1``, four indices
    ``u0 = h + w``, ``u1 = h + (W-1-w)``, ``u2 = (H-1-h) + w``, ``u3 = (H-1-h) + (W-1-w)``; token
    ``(t, h, w)`` has id ``s + t * span + u_k`` on axis ``k``; rotary pair ``i`` uses axis
    ``i mod 4``. The next segment starts at ``s + T * span``. Follows the authors' ``vrope.py``.
    """
    name = 'vrope'
    axes = 'abcd'
    paper = 'Liu et al., VRoPE, arXiv:2502.11664'

    def visual_extent(self, seg):
        return seg['T'] * (seg['H'] + seg['W'] - 1)

    def visual_rows(self, row):
        H, W, h = row['H'], row['W'], row['h']
        base = row['start'] + row['t'] * (H + W - 1)
        v0 = _stack(base + h, base + h + W - 1, base + H - 1 - h, base + H - 1 - h + W - 1)
        slope = torch.tensor([[1], [-1], [1], [-1]], device=h.device)
        return v0, slope


def _draw_strides(n: Tensor, fixed: float, choices: Sequence[float], random: bool,
                  generator: Optional[torch.Generator], dtype: torch.dtype) -> Tensor:
    """One stride per visual segment (``n``: the segments' sizes): drawn uniformly from ``choices``
    (with ``generator``) when ``random``, else ``fixed`` (V2PE's per-image and HoPE's per-block
    strides)."""
    if random:
        choice = torch.randint(len(choices), (n.numel(),), generator=generator)
        return torch.tensor(choices, dtype=dtype)[choice].to(n.device)
    return torch.full(n.shape, fixed, dtype=dtype, device=n.device)


class V2PE(Scheme):
    """V2PE (Ge et al. 2024, InternVL): 1D ids with a fractional step for visual tokens.

    After the token at position ``p`` (integer), the ``n`` visual tokens of a block sit at
    ``p + k * delta`` (``k = 1..n``), ``delta = stride / tokens_per_tile`` (InternVL: 256 tokens per
    tile); the next text token is at ``ceil(p + n * delta) + 1``. Training draws ``stride`` per
    block from ``strides`` ({1, 2, 4, ..., 256}); inference uses the fixed ``stride`` (64 in the
    V2PE evaluation scripts). ``stride = tokens_per_tile`` reproduces ordinary 1D RoPE. Ids are
    float64 (exact for the power-of-two steps); rotary must accept float positions.

    Args:
        stride: inference stride (``delta = stride / tokens_per_tile``).
        tokens_per_tile: tokens per tile (256); None makes ``delta = stride / n`` per block (the
            Multimodal-RoPEs port's convention: the whole block spans ``stride`` positions).
        strides: the training choices.
        random_in_training: draw the stride per block when ``training=True``.
    """
    name = 'v2pe'
    axes = 'p'
    paper = 'Ge et al., V2PE, arXiv:2412.09616'
    row_runs = False

    def __init__(self, *, stride: int = 64, tokens_per_tile: Optional[int] = 256,
                 strides: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256),
                 random_in_training: bool = True) -> None:
        for v, what in [(stride, 'stride')] + [(s, 'strides entries') for s in strides]:
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f'V2PE {what} must be positive integers, got {v!r}')
        if tokens_per_tile is not None and (not isinstance(tokens_per_tile, int) or tokens_per_tile <= 0):
            raise ValueError(f'V2PE tokens_per_tile must be a positive integer or None, got {tokens_per_tile!r}')
        if not strides:
            raise ValueError('V2PE strides must not be empty')
        self.stride = stride
        self.tokens_per_tile = tokens_per_tile
        self.strides = tuple(strides)
        self.random_in_training = bool(random_in_training)

    @property
    def float_ids(self) -> bool:
        return True

    def draw(self, seg, training, generator):
        seg['stride'] = _draw_strides(seg['n'], self.stride, self.strides, training and self.random_in_training,
                                      generator, torch.long)

    def _denominator(self, n: Tensor) -> Tensor:
        return n if self.tokens_per_tile is None else torch.full_like(n, self.tokens_per_tile)

    def visual_extent(self, seg):
        num = seg['n'] * seg['stride']
        den = self._denominator(seg['n'])
        return (num + den - 1) // den  # ceil(n * delta) in integers: exact

    def visual_block(self, seg):
        delta = seg['stride'].double() / self._denominator(seg['n']).double()
        return (seg['start'].double() - 1 + delta)[None], delta[None]


class VideoRoPE(Scheme):
    """VideoRoPE (Wei et al., ICML 2025): diagonal layout, adjustable temporal spacing.

    Token ``(t, h, w)`` of a block at ``s``: ``t' = s + delta * tau(t)``,
    ``h' = t' + h - (H-1)//2``, ``w' = t' + w - (W-1)//2`` (frame centred on the diagonal); the
    next segment starts at ``max(t') + 1`` (the temporal axis, as in the authors' code). Rotary:
    high-frequency pairs interleave ``h, w``, the low-frequency pairs carry ``t`` (see
    `MultimodalRotary`). Ids are int64 when ``delta`` is integral, else float64.

    Args:
        delta: temporal spacing (2).
        tokens_per_second: Qwen2.5-VL timing for timed videos; None (the original, built on Qwen2-VL)
            uses the frame index.
    """
    name = 'videorope'
    axes = 'thw'
    paper = 'Wei et al., VideoRoPE, arXiv:2502.05173'

    def __init__(self, *, delta: float = 2.0, tokens_per_second: Optional[float] = None) -> None:
        if not delta > 0:
            raise ValueError(f'VideoRoPE delta must be > 0, got {delta!r}')
        if tokens_per_second is not None and not tokens_per_second > 0:
            raise ValueError(f'tokens_per_second must be > 0 or None, got {tokens_per_second!r}')
        self.delta = delta
        self.tokens_per_second = tokens_per_second

    @property
    def float_ids(self) -> bool:
        return not float(self.delta).is_integer()

    def _scaled(self, tau: Tensor) -> Tensor:
        return tau * self.delta if self.float_ids else tau * int(self.delta)

    def visual_extent(self, seg):
        tau = self._time_index(seg['T'] - 1, seg['seconds'], self.tokens_per_second)
        return self._scaled(tau) + 1

    def visual_rows(self, row):
        tau = self._time_index(row['t'], row['seconds'], self.tokens_per_second)
        t = row['start'].to(self.dtype) + self._scaled(tau)
        one = torch.tensor([[0], [0], [1]], device=t.device)
        return _stack(t, t + row['h'] - (row['H'] - 1) // 2, t - (row['W'] - 1) // 2), one


class HoPE(VideoRoPE):
    """HoPE (Li et al., NeurIPS 2025, arXiv:2505.20444), as the Multimodal-RoPEs reference implements it.

    Ids: VideoRoPE's diagonal layout, ``t' = s + stride * t``, ``h' = t' + h - (H-1)//2``,
    ``w' = t' + w - (W-1)//2``, with HoPE's *dynamic temporal scaling*: during training each visual
    block draws its ``stride`` from ``temporal_strides`` (the reference draws one per block);
    otherwise the fixed ``temporal_stride``. The next segment starts at ``max(t') + 1``. Ids are
    float64 (the strides are fractional). Rotary (`MultimodalRotary`): the reference's VideoRoPE
    allocation (pair ``0`` and the pairs from ``2 * sections[1]`` on carry ``t``; ``h`` odd and ``w``
    even pairs below) with the temporal pairs not rotated (NoPE, HoPE's lowest frequencies). The
    reference splits videos into one block per frame (Qwen3-VL), so ``video_blocks = 'frame'``.

    Args:
        temporal_stride: stride outside training (1: no scaling).
        temporal_strides: the training choices (``[0.5, 0.75, 1, 1.25, 1.5]``, the reference's).
        random_in_training: draw the stride per block when ``training=True``.
    """
    name = 'hope'
    axes = 'thw'
    paper = 'Li et al., HoPE, arXiv:2505.20444'
    video_blocks = 'frame'

    def __init__(self, *, temporal_stride: float = 1.0,
                 temporal_strides: Sequence[float] = (0.5, 0.75, 1.0, 1.25, 1.5),
                 random_in_training: bool = True) -> None:
        for v, what in [(temporal_stride, 'temporal_stride')] + [(x, 'temporal_strides entries')
                                                                  for x in temporal_strides]:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f'HoPE {what} must be positive numbers, got {v!r}')
        if not temporal_strides:
            raise ValueError('HoPE temporal_strides must not be empty')
        self.temporal_stride = float(temporal_stride)
        self.temporal_strides = tuple(float(x) for x in temporal_strides)
        self.random_in_training = bool(random_in_training)

    @property
    def float_ids(self) -> bool:
        return True

    def draw(self, seg, training, generator):
        seg['stride'] = _draw_strides(seg['n'], self.temporal_stride, self.temporal_strides,
                                      training and self.random_in_training, generator, torch.float64)

    def visual_extent(self, seg):
        return (seg['T'] - 1).double() * seg['stride'] + 1

    def visual_rows(self, row):
        t = row['start'].double() + row['t'].double() * row['stride']
        one = torch.tensor([[0], [0], [1]], device=t.device)
        return _stack(t, t + row['h'] - (row['H'] - 1) // 2, t - (row['W'] - 1) // 2), one


class CircleRoPE(Scheme):
    """Circle-RoPE (Wang et al. 2025, arXiv:2505.16416), as the Multimodal-RoPEs reference implements it.

    Each frame's ``H x W`` tokens are mapped onto a circle in the plane orthogonal to the text
    direction ``(1, 1, 1)``, so every image token is equidistant from the text axis: grid coordinates
    ``(w, h)`` (centred when ``move_to_origin``) get the angle
    ``alpha * normalised atan2(h, w) + (1 - alpha) * 2 pi k / (H W)`` (``k`` the raster index) and the
    point ``radius * (cos, sin)``, expressed in the orthonormal basis ``u = (-1, 1, 0)/sqrt 2``,
    ``v = (1, 1, 1)/sqrt 3 x u`` of that plane (ids ``(t, h, w)`` = components ``(z, y, x)``);
    ``dff_rate`` mixes in the un-mapped grid projected the same way, ``move_to_positive`` shifts the
    block by its smallest coordinate (plus an offset). Frame ``f`` of a video is the first frame's
    ring moved by ``f * temporal_stride`` on every axis (the reference's video extension). The block
    sits at ``s +`` those coordinates and the next segment starts at ``max over all axes + 1``.
    Computed in float32 as the reference, returned as float64. Rotary: M-RoPE's chunked sections.

    Args:
        radius: circle radius, or ``'auto'`` / ``'auto-k'`` (``k`` times the largest coordinate).
        alpha: weight of the normalised original angle against the raster-index angle, in [0, 1].
        temporal_stride: spacing of a video's rings.
        move_to_origin: centre the grid before mapping.
        move_to_positive: False, ``'auto'`` (shift by the smallest coordinate) or an extra offset.
        dff_rate: weight in [0, 1] of the un-mapped coordinates (0: the circle only; the reference's
            documented example passes ``True``, i.e. 1).
        method: ``'circle'`` or ``'no_circle'`` (the grid projected onto the plane, no circle).
    """
    name = 'circlerope'
    axes = 'thw'
    paper = 'Wang et al., Circle-RoPE, arXiv:2505.16416'
    video_blocks = 'frame'
    row_runs = False

    def __init__(self, *, radius: Union[float, str] = 10.0, alpha: float = 0.5, temporal_stride: float = 1.0,
                 move_to_origin: bool = True, move_to_positive: Union[bool, float, str] = False,
                 dff_rate: float = 0.0, method: Literal['circle', 'no_circle'] = 'circle') -> None:
        if isinstance(radius, str):
            scale = radius[len('auto-'):] if radius.startswith('auto-') else '1' if radius == 'auto' else None
            try:
                self._radius_scale = float(scale) if scale is not None else None
            except ValueError:
                self._radius_scale = None
            if self._radius_scale is None:
                raise ValueError(f"CircleRoPE radius must be a number, 'auto' or 'auto-<k>', got {radius!r}")
        elif isinstance(radius, bool) or not isinstance(radius, (int, float)):
            raise ValueError(f"CircleRoPE radius must be a number, 'auto' or 'auto-<k>', got {radius!r}")
        else:
            self._radius_scale = None
        if not 0 <= float(alpha) <= 1:
            raise ValueError(f'CircleRoPE alpha must be in [0, 1], got {alpha!r}')
        if not 0 <= float(dff_rate) <= 1:
            raise ValueError(f'CircleRoPE dff_rate must be in [0, 1], got {dff_rate!r}')
        if method not in ('circle', 'no_circle'):
            raise ValueError(f"CircleRoPE method must be one of ('circle', 'no_circle'), got {method!r}")
        if not temporal_stride > 0:
            raise ValueError(f'CircleRoPE temporal_stride must be > 0, got {temporal_stride!r}')
        if not (move_to_positive is False or move_to_positive == 'auto'
                or (isinstance(move_to_positive, (int, float)) and not isinstance(move_to_positive, bool))):
            raise ValueError(f"CircleRoPE move_to_positive must be False, 'auto' or a number, got {move_to_positive!r}")
        self.radius, self.alpha, self.temporal_stride = radius, float(alpha), float(temporal_stride)
        self.move_to_origin, self.move_to_positive = bool(move_to_origin), move_to_positive
        self.dff_rate, self.method = float(dff_rate), method

    @property
    def float_ids(self) -> bool:
        return True

    def _rings(self, seg: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """float32 ids ``(3, M)`` of the first frame of every block relative to its start, the block of
        each of those ``M`` tokens, and each block's largest id (all axes, all frames)."""
        T, H, W = seg['T'], seg['H'], seg['W']
        dev, f32 = T.device, torch.float32
        hw = H * W
        K, M = hw.numel(), int(hw.sum())
        blk = torch.repeat_interleave(torch.arange(K, device=dev), hw, output_size=M)
        k = torch.arange(M, device=dev) - (torch.cumsum(hw, 0) - hw)[blk]
        Wb = W[blk]
        x, y = (k % Wb).to(f32), (k // Wb).to(f32)
        t_last = (T - 1).to(f32) * self.temporal_stride
        z = torch.zeros_like(x)
        hi = torch.stack([(W - 1).to(f32), (H - 1).to(f32), t_last])  # per-axis max of the block's grid
        if self.move_to_origin:
            centre = hi / 2.0
            x, y, z = x - centre[0][blk], y - centre[1][blk], z - centre[2][blk]
            hi = hi - centre
        u = torch.tensor([-1.0, 1.0, 0.0], dtype=f32, device=dev)
        u = u / torch.linalg.vector_norm(u)
        n = torch.ones(3, dtype=f32, device=dev)
        n = n / torch.linalg.vector_norm(n)
        v = torch.linalg.cross(n, u)
        v = v / torch.linalg.vector_norm(v)
        flat_x, flat_y = x[None] * u[:, None], y[None] * v[:, None]
        plane = flat_x + flat_y  # the grid itself in the plane orthogonal to (1, 1, 1): (3, M)
        if self.method == 'circle':
            if self._radius_scale is not None:
                radius = (hi.amax(0).abs() * self._radius_scale)[blk]
            else:
                radius = torch.full_like(x, float(self.radius))
            theta = torch.atan2(y, x)
            lo_t = torch.full((K,), math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, theta, 'amin')
            hi_t = torch.full((K,), -math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, theta, 'amax')
            span = (hi_t - lo_t)[blk]
            norm = torch.where(span > 0, (theta - lo_t[blk]) / span * (2 * math.pi), theta)
            index = k.to(f32) / hw[blk].to(f32) * (2 * math.pi)
            ang = self.alpha * norm + (1 - self.alpha) * index
            cx, cy = radius * torch.cos(ang), radius * torch.sin(ang)
            coords = cx[None] * u[:, None] + cy[None] * v[:, None]
        else:
            coords = plane
        if self.dff_rate:
            coords = (1 - self.dff_rate) * coords + self.dff_rate * plane
        if self.move_to_positive is not False:
            offset = 0.0 if self.move_to_positive == 'auto' else float(self.move_to_positive)
            lo = torch.full((K,), math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, coords.amin(0), 'amin')
            coords = coords + lo.abs()[blk] + offset
        ids = coords.flip(0)  # (t, h, w) = components (z, y, x)
        top = torch.full((K,), -math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, ids.amax(0), 'amax')
        return ids, blk, top + t_last

    def visual_extent(self, seg):
        ids, blk, top = self._rings(seg)
        seg['ring'], seg['ring_block'] = ids, blk
        return top.double() + 1

    def _visual_runs(self, seg):
        ring, blk = seg['ring'], seg['ring_block']
        T, hw = seg['T'], seg['H'] * seg['W']
        dev = ring.device
        # one run per token: frame f of block b is its ring moved by f * temporal_stride on every axis
        reps = T[blk]
        tok = torch.repeat_interleave(torch.arange(ring.shape[1], device=dev), reps)
        first = torch.cumsum(reps, 0) - reps
        frame = torch.arange(tok.numel(), device=dev) - torch.repeat_interleave(first, reps)
        b = blk[tok]
        k = tok - (torch.cumsum(hw, 0) - hw)[b]
        v0 = ring[:, tok].double() + (frame.double() * self.temporal_stride + seg['start'][b].double())[None]
        start = seg['token_start'][b] + frame * hw[b] + k
        return Runs(v0, torch.zeros(1, 1, dtype=torch.float64, device=dev), start, torch.ones_like(start))


SCHEMES: Dict[str, Type[Scheme]] = {c.name: c for c in (RoPE1D, MRoPE, MRoPEInterleave, MHRoPE, VRoPE, V2PE,
                                                         VideoRoPE, HoPE, CircleRoPE)}


def get_scheme(scheme: Union[str, Scheme], **options: Any) -> Scheme:
    """A scheme instance from its name and options (or the instance itself)."""
    if isinstance(scheme, Scheme):
        if options:
            raise ValueError(f'options {sorted(options)} given with a Scheme instance; set them on the instance')
        return scheme
    if scheme not in SCHEMES:
        raise ValueError(f'scheme must be one of {tuple(SCHEMES)}, got {scheme!r}')
    try:
        return SCHEMES[scheme](**options)
    except TypeError as e:
        allowed = [p for p in inspect.signature(SCHEMES[scheme].__init__).parameters if p != 'self']
        raise ValueError(f'scheme {scheme!r} accepts options {allowed}, got {sorted(options)}') from e


def position_ids(
        inputs: Union[Layout, Sequence[Layout], Tensor],
        *,
        scheme: Union[str, Scheme] = 'mrope',
        image_grid_thw: Optional[Tensor] = None,
        video_grid_thw: Optional[Tensor] = None,
        second_per_grid_ts: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        image_token_id: int = QWEN2_VL_TOKEN_IDS['image_token_id'],
        video_token_id: int = QWEN2_VL_TOKEN_IDS['video_token_id'],
        vision_start_token_id: int = QWEN2_VL_TOKEN_IDS['vision_start_token_id'],
        spatial_merge_size: int = 2,
        video_blocks: Optional[VideoBlocks] = None,
        mm_token_type_ids: Optional[Tensor] = None,
        rule: Rule = '5.x',
        padding_side: Literal['right', 'left'] = 'right',
        training: bool = False,
        generator: Optional[torch.Generator] = None,
        pad_value: Optional[int] = None,
        device: Optional[torch.device] = None,
        **options: Any,
) -> Tuple[Tensor, Tensor]:
    """Position ids and ``rope_delta`` of a multimodal sequence or batch.

    Two interfaces:

    * a layout ``[mm.Text(12), mm.Image(grid=(1, 28, 28)), ...]`` -> ids ``(A, N)`` and a 0-dim
      ``rope_delta``; a list of layouts -> ids ``(A, B, L)`` padded on ``padding_side`` (mask:
      `padding_mask`) and ``rope_delta`` ``(B, 1)``;
    * token ids ``(B, L)`` in the Qwen2-VL convention with ``image_grid_thw`` / ``video_grid_thw``
      (patch grids before the merge), optional ``second_per_grid_ts`` and ``attention_mask``
      (left or right padding) -> ids ``(A, B, L)`` and ``rope_delta`` ``(B, 1)``, as
      ``get_rope_index`` returns them. ``video_grid_thw`` is what the model family's processor
      returns, one row per video; ``video_blocks`` says how the token ids hold it.

    ``A`` is the scheme's number of axes (3 for the M-RoPE family, VideoRoPE, HoPE and Circle-RoPE, 4
    for VRoPE, 1 for V2PE and 1D RoPE).

    Token ids follow transformers' ``get_rope_index`` of the installed major version, ``rule='5.x'``
    (the default; transformers 5.0 to 5.25 at least), or of 4.x with ``rule='4.x'``. They differ in:

    ========================  =================================================  ==========================
    (M-RoPE family)           5.x                                                4.x
    ========================  =================================================  ==========================
    text after a visual block ``s + max(H, W)`` (merged grid; time ignored)      max over all axes + 1
    ``rope_delta``            ``max id + 1 - real tokens`` (decode: ``(number    ``next - L`` (decode:
                              of real tokens so far) + rope_delta``)             ``cache_position + delta``)
    padding ids               0                                                  1
    timed video (Qwen2.5-VL)  ``(t * (tokens_per_second * second_per_grid)).     ``floor`` of the product
                              long()`` in ``second_per_grid_ts``' dtype;         in float64; untimed: ``t``
                              untimed: 1 s per temporal patch
    visual blocks             runs of one type in ``mm_token_type_ids`` when     ``vision_start`` + image /
                              given, else ``vision_start`` + image/video token   video token
    ========================  =================================================  ==========================

    For the other schemes the rule sets the padding ids and the ``rope_delta`` convention only. A
    layout (rather than token ids) is vispe's own convention, the 4.x one: pads ``pad_value`` (1),
    ``rope_delta = next_position - L``: decoding token at cache position ``c`` gets ``c + rope_delta``.

    Args:
        inputs: a layout, a list of layouts, or ``(B, L)`` token ids.
        scheme: a name in `SCHEMES` or a `Scheme` instance; ``options`` go to its constructor.
        video_blocks: token ids only: ``'video'``, one vision-start block per ``video_grid_thw`` row
            (Qwen2-VL, Qwen2.5-VL); ``'frame'``, one block per temporal patch, so a row ``(T, H, W)``
            covers T blocks ``(1, H, W)`` (Qwen3-VL's processor, timestamp text between the frames);
            None: the scheme's ``video_blocks`` (``'frame'`` for ``mrope_interleave`` and ``mhrope``,
            ``'video'`` for the others).
        mm_token_type_ids: token ids only: ``(B, L)`` modality of each token (0 text, 1 image, 2 video).
        rule: token ids only: ``'5.x'`` or ``'4.x'``, whose ``get_rope_index`` to follow (table above).
        pad_value: ids of padding tokens; default 0 under the 5.x rule, else 1.
        training: V2PE and HoPE draw random strides when True.
        generator: random generator for V2PE's training strides.
        device: device of layout-built ids.
    """
    sch = get_scheme(scheme, **options)
    if rule not in RULES:
        raise ValueError(f'rule must be one of {RULES}, got {rule!r}')
    if torch.is_tensor(inputs):
        if inputs.dtype not in (torch.long, torch.int32, torch.int16):
            raise ValueError(f'token ids must be an integer tensor, got {inputs.dtype}')
        hf5 = rule == '5.x'
        table = table_from_token_ids(inputs, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                                     image_token_id, video_token_id, vision_start_token_id, spatial_merge_size,
                                     sch.video_blocks if video_blocks is None else video_blocks,
                                     mm_token_type_ids)
        flat, nxt = sch.build(table, training, generator, hf5=hf5)
        B, L = inputs.shape
        pad = (0 if hf5 else 1) if pad_value is None else pad_value
        if attention_mask is None:
            ids = flat.reshape(sch.num_axes, B, L)
        else:
            ids = torch.full((sch.num_axes, B, L), pad, dtype=flat.dtype, device=flat.device)
            ids[:, attention_mask.to(flat.device) != 0] = flat
        if not hf5:
            return ids, (nxt - L)[:, None]
        if sch.next_from_max and flat.numel():  # transformers 5.x: the largest id of the sequence + 1
            seq = torch.repeat_interleave(torch.arange(B, device=flat.device), table.lengths,
                                          output_size=flat.shape[1])
            nxt = torch.zeros(B, dtype=flat.dtype, device=flat.device).scatter_reduce(
                0, seq, flat.amax(0), 'amax', include_self=False) + 1
        return ids, (nxt - table.lengths.to(nxt.dtype))[:, None]
    if padding_side not in ('right', 'left'):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    pad_value = 1 if pad_value is None else pad_value
    layouts, batched = normalise_layouts(inputs)
    table = table_from_layouts(layouts, device)
    flat, nxt = sch.build(table, training, generator)
    if not batched:
        return flat, nxt[0] - flat.shape[-1]
    mask = _mask_from_lengths(table.lengths, padding_side).bool()
    L = mask.shape[1]
    ids = torch.full((sch.num_axes, len(layouts), L), pad_value, dtype=flat.dtype, device=flat.device)
    ids[:, mask] = flat
    return ids, (nxt - L)[:, None]


def decode_position_ids(rope_delta: Tensor, cache_position: Union[int, Tensor], length: int = 1,
                        num_axes: int = 3) -> Tensor:
    """Ids ``(A, B, length)`` of the next ``length`` tokens at cache position ``cache_position``.

    Every axis gets ``cache_position + i + rope_delta``, as text continues after any segment.
    ``cache_position`` is, for a ``rope_delta`` of the 4.x rule (and of layouts), the padded length of
    what is already in the cache; for the 5.x rule, the number of real tokens of each sequence so far
    (an int or ``(B,)``).
    """
    rope_delta = torch.as_tensor(rope_delta)
    delta = rope_delta.reshape(-1, 1)
    cache = torch.as_tensor(cache_position, device=delta.device).reshape(-1, 1)
    pos = cache + torch.arange(length, device=delta.device) + delta
    return pos.unsqueeze(0).expand(num_axes, -1, -1)
