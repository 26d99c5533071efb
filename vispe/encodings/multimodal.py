"""Multimodal RoPEs: position ids of text / image / video sequences and their rotary, for language models.

Every encoding of this family (``rope_1d`` here; ``mrope``, ``mrope_interleave``, ``mhrope``,
``vrope``, ``v2pe``, ``videorope``, ``hope``, ``circlerope`` in the modules beside it) reads the
segments of a `vispe.sequence` (`vispe.positions.MultimodalPositions`) and answers two questions:

* **ids**: how far a segment advances the running position (its *extent*: text by its length, a
  visual block by an encoding-specific amount; the next segment starts at ``start + extent``, per
  sequence an exclusive cumulative sum over segments), and the ids of its tokens. Within a *run* (a
  whole text segment, one row of a visual frame, or a whole visual block for 1D encodings) every id
  axis is an arithmetic progression ``v0 + slope * offset``, so the ids of all tokens come from
  per-run ``(v0, slope)`` with two cumulative sums (integer ids) or one gather (fractional ids): no
  Python loop over tokens, rows or images. Text gets the same running index on every axis, so pure
  text is ordinary 1D RoPE under every encoding. ``rope_delta = next position - L`` per sequence
  (``L`` the padded length): a decoding step at cache position ``c`` continues at ``c + rope_delta``
  on every axis (`decode_position_ids`, or ``vispe.sequence([Text(n)], offset=c + rope_delta)``).
* **rotary**: which id axis each rotary pair (or, for ``mhrope``, each head) reads, in the layout
  language-model code expects: rotate-half pairs ``(j, j + r/2)`` of the first ``r = rotary_dim``
  channels (Llama / Qwen2-VL / GPT-NeoX), angles ``float32(id) * inv_freq`` in float32 with Llama's
  ``inv_freq = 1 / theta ** (arange(0, r, 2) / r)``, so for pure text every encoding gives the cos /
  sin of 1D RoPE bit for bit.

As contract hooks: ``prepare`` builds the ids and the complex rotate-half table once per forward (kept
in eval while the sequence is the same), ``qk`` rotates q and k ``(B, H, N, hd)`` by it through
`vispe.rotary.rotate_qk` (float32, cast back once); `vispe.pe_attention` hosts them as every other
encoding. Code that computes its ids itself (transformers' Qwen-VL models, `vispe.integrations.patch_vlm`)
asks the encoding for ``cos_sin(ids)`` and applies them with `apply_rotary` (transformers'
``apply_rotary_pos_emb`` layout).

Rules that a host library fixes differently (transformers 5.x's M-RoPE time index and block extent)
enter the id builder as an `IdRule`; vispe's own is the published one (Qwen2.5-VL's paper, transformers
4.x), the host's lives in its adapter.
"""
from __future__ import annotations

from typing import ClassVar, Dict, Optional, Sequence, Tuple

import torch

from ..contract import PEContext
from ..positions import Positions
from ..positions.multimodal import TEXT, MultimodalPositions, SegmentTable
from ..registry import register_pe
from ..rotary import RotationPE, axial_frequencies, rotate_qk
from ._checks import check_positive

__all__ = ['MultimodalRoPE', 'RoPE1D', 'IdRule', 'decode_position_ids', 'apply_rotary', 'rotary_table',
           'MULTIMODAL_FAMILY']

Tensor = torch.Tensor
MULTIMODAL_FAMILY = 'multimodal'
"""The registry family of every multimodal encoding (`vispe.pe_info(name)['family']`)."""


class IdRule:
    """How the M-RoPE family turns a video's time into ids and how far a visual block advances the running
    position: vispe's rule, the published one (Qwen2.5-VL; transformers 4.x). A host library that computes
    them otherwise supplies a subclass (`vispe.integrations.transformers_vlm` for transformers 5.x)."""

    def time_index(self, t: Tensor, seconds: Tensor, tokens_per_second: Optional[float],
                   seconds_dtype: torch.dtype) -> Tensor:
        """Temporal index of frame ``t``: ``floor(t * second_per_grid * tokens_per_second)`` for timed
        videos (multiply first, then floor: truncating the interval first collapses frames), else ``t``."""
        return time_index(t, seconds, tokens_per_second)

    def mrope_extent(self, seg: Dict[str, Tensor], t_last: Tensor) -> Tensor:
        """The advance of an M-RoPE visual block: its largest id over every axis, + 1 (``t_last``: the
        temporal index of its last frame)."""
        return torch.maximum(torch.maximum(t_last, seg['H'] - 1), seg['W'] - 1) + 1


def time_index(t: Tensor, seconds: Tensor, tokens_per_second: Optional[float]) -> Tensor:
    """Qwen2.5-VL's temporal index ``floor(t * second_per_grid * tokens_per_second)`` where ``seconds`` is
    given (not NaN), ``t`` elsewhere and when ``tokens_per_second`` is None."""
    if tokens_per_second is None:
        return t
    timed = ~torch.isnan(seconds)
    scaled = torch.floor(t.double() * torch.nan_to_num(seconds) * tokens_per_second).long()
    return torch.where(timed, scaled, t)


_PUBLISHED = IdRule()


class Runs:
    """Per-run ``v0`` ``(A, R)``, ``slope`` ``(A, R)`` (or ``(A, 1)``), ``start`` and ``length`` ``(R,)``."""
    __slots__ = ('v0', 'slope', 'start', 'length')

    def __init__(self, v0: Tensor, slope: Tensor, start: Tensor, length: Tensor) -> None:
        self.v0, self.slope, self.start, self.length = v0, slope, start, length


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


def stack_axes(*rows: Tensor) -> Tensor:
    return torch.stack(rows, 0)


def draw_strides(n: Tensor, fixed: float, choices: Sequence[float], random: bool,
                 generator: Optional[torch.Generator], dtype: torch.dtype) -> Tensor:
    """One stride per visual segment (``n``: the segments' sizes): drawn uniformly from ``choices``
    (with ``generator``) when ``random``, else ``fixed`` (V2PE's per-image and HoPE's per-block strides)."""
    if random:
        choice = torch.randint(len(choices), (n.numel(),), generator=generator)
        return torch.tensor(choices, dtype=dtype)[choice].to(n.device)
    return torch.full(n.shape, fixed, dtype=dtype, device=n.device)


class MultimodalRoPE(RotationPE):
    """Base of the multimodal encodings: ids from a sequence's segments, then rotate-half rotary.

    Subclasses set ``axes`` (one character per id axis) and implement `visual_extent` and either
    `visual_rows` (runs = rows of each frame) or `visual_block` (one run per block, ``row_runs = False``),
    and `allocate_pairs` (the id axis of each rotary pair; -1: not rotated). ``video_blocks`` is how the
    token ids of the model family an encoding comes from lay a video out (one block per ``'video'`` or
    per ``'frame'``), the default of host adapters that read token ids.

    Args:
        theta: frequency base (1e6, Qwen2-VL's; Qwen3-VL uses 5e6).
        rotary_dim: rotated channels (partial rotary, GPT-NeoX); default the head dim.
    """
    axes: ClassVar[str] = 'p'
    row_runs: ClassVar[bool] = True
    video_blocks: ClassVar[str] = 'video'
    requires = frozenset({'segments'})
    larger_input = 'extrapolate'
    rotation_kind = 'half_table'

    def __init__(self, ctx: PEContext, *, theta: float = 1e6, rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx)
        self.theta = check_positive(self.name, 'theta', theta)
        hd = ctx.head_dim
        rotary_dim = hd if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= hd:
            raise ValueError(f'option rotary_dim of encoding {self.name!r} must be even and in (0, head_dim={hd}], '
                             f'got {rotary_dim}')
        self.rotary_dim = rotary_dim

    def axis_buffers(self) -> Dict[str, Tensor]:
        """The non-persistent buffers of the axis allocation: ``pair_axes`` (`allocate_pairs`)."""
        return {'pair_axes': self.allocate_pairs()}

    def register_axes(self) -> None:
        """Register `axis_buffers` (each subclass's constructor calls it once its options are set)."""
        for name, value in self.axis_buffers().items():
            self.register_buffer(name, value, persistent=False)

    def init_non_persistent_buffers(self) -> None:
        device = self.pair_axes.device
        for name, value in self.axis_buffers().items():
            setattr(self, name, value.to(device))
        self.clear_cache()

    def inv_freq(self, device: Optional[torch.device] = None) -> Tensor:
        """Llama's / Qwen2-VL's frequencies ``1 / theta ** (arange(0, r, 2) / r)``, in float32 whatever the
        module's dtype (a table cast to bfloat16 with the model would round them)."""
        device = torch.device(device) if device is not None else self.pair_axes.device
        return self.tensor_cache.get(('inv_freq', device), lambda: axial_frequencies(
            self.num_pairs, self.theta, step=2.0, dim=self.rotary_dim, device=device))

    @property
    def num_pairs(self) -> int:
        return self.rotary_dim // 2

    @property
    def num_axes(self) -> int:
        return len(self.axes)

    @property
    def float_ids(self) -> bool:
        """True when ids are fractional (float64), else int64."""
        return False

    @property
    def id_dtype(self) -> torch.dtype:
        return torch.float64 if self.float_ids else torch.long

    # ------------------------------------------------------------------ ids, per encoding
    def visual_extent(self, seg: Dict[str, Tensor]) -> Tensor:
        """How far each visual segment advances the running position."""
        raise NotImplementedError

    def visual_rows(self, row: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """``(v0, slope)`` of each row run: ``(A, R)`` and ``(A, R)`` or ``(A, 1)``."""
        raise NotImplementedError

    def visual_block(self, seg: Dict[str, Tensor]) -> Tuple[Tensor, Tensor]:
        """``(v0, slope)`` of each visual block taken as one run (1D encodings)."""
        raise NotImplementedError

    def draw(self, seg: Dict[str, Tensor], training: bool, generator: Optional[torch.Generator]) -> None:
        """Add per-call random choices to the visual segments' fields (V2PE's training strides)."""

    # ------------------------------------------------------------------ ids
    def build(self, table: SegmentTable, training: bool = False, generator: Optional[torch.Generator] = None,
              rule: Optional[IdRule] = None, offset: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
        """Ids ``(A, N)`` of the flattened real tokens of ``table`` and the next position ``(B,)`` of each
        sequence; sequence ``b`` starts at ``offset[b]`` (default 0)."""
        dev, dt, A = table.device, self.id_dtype, self.num_axes
        S = table.kind.numel()
        is_vis = table.kind != TEXT
        T, H, W = table.grid.unbind(1)
        extent = table.num_tokens.to(dt).clone()
        vis = torch.nonzero(is_vis).squeeze(1)
        seg_v = {'T': T[vis], 'H': H[vis], 'W': W[vis], 'n': table.num_tokens[vis],
                 'seconds': table.seconds[vis], 'token_start': table.token_start[vis], 'rule': rule or _PUBLISHED,
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
        if offset is not None:
            base = base - self._offset(offset, dt)
        start = excl - base[table.batch] if S else excl
        nxt = torch.zeros(B, dtype=dt, device=dev) if offset is None else self._offset(offset, dt).clone()
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
        return expand(v0, slope, rstart, rlen, table.total_tokens), nxt

    def _offset(self, offset: Tensor, dtype: torch.dtype) -> Tensor:
        if not dtype.is_floating_point and not bool((offset == offset.round()).all()):
            raise ValueError(f'encoding {self.name!r} has integer ids: the sequence offset must be whole numbers, '
                             f'got {offset.tolist()}')
        return offset.to(dtype)

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
        Wr = seg['W'][sid]
        row = {k: (v[sid] if torch.is_tensor(v) else v) for k, v in seg.items()}
        row.update(t=r // seg['H'][sid], h=r % seg['H'][sid])
        v0, slope = self.visual_rows(row)
        return Runs(v0, slope, seg['token_start'][sid] + r * Wr, Wr)

    def position_ids(self, pos: Positions, *, training: Optional[bool] = None,
                     generator: Optional[torch.Generator] = None, pad_value: int = 1) -> Tuple[Tensor, Tensor]:
        """Ids and ``rope_delta`` of a `vispe.sequence`: ``(A, N)`` and a 0-dim delta for one sequence,
        ``(A, B, L)`` (padding at ``pad_value``) and ``(B, 1)`` for a batch. ``training`` (default: the
        module's mode) draws V2PE's and HoPE's random strides, with ``generator``."""
        pos = _multimodal(pos, self.name)
        training = self.training if training is None else training
        flat, nxt = self.build(pos.segments, training, generator, offset=pos.offset)
        if not pos.batched:
            return flat, nxt[0] - flat.shape[-1]
        B, L = pos.coords.shape[:2]
        ids = torch.full((self.num_axes, B, L), pad_value, dtype=flat.dtype, device=flat.device)
        ids[:, ~pos.key_padding_mask] = flat
        return ids, (nxt - L)[:, None]

    # ------------------------------------------------------------------ rotary
    def allocate_pairs(self) -> Tensor:
        """``(rotary_dim / 2,)`` the id axis each rotary pair reads (-1: not rotated)."""
        return torch.zeros(self.num_pairs, dtype=torch.long)

    @property
    def pair_layout(self) -> Optional[str]:
        """The axis each rotary pair reads, one character per pair (``'tttthhhhwwww'``; ``'-'``: not
        rotated); None where whole heads are assigned instead (``mhrope``)."""
        return ''.join('-' if a < 0 else self.axes[a] for a in self.pair_axes.tolist())

    @property
    def head_layout(self) -> Optional[str]:
        """The axis each head reads, for encodings that assign heads (``mhrope``); None otherwise."""
        return None

    def angles(self, ids: Tensor) -> Tensor:
        """float32 angles ``([B,] N, P)`` of ids ``(A, [B,] N)`` (head-wise encodings: ``(B or 1, H, N, P)``)."""
        A = self.num_axes
        if not torch.is_tensor(ids) or ids.dim() not in (2, 3) or ids.shape[0] != A:
            shape = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
            raise ValueError(f'encoding {self.name!r} takes ids of shape ({A}, N) or ({A}, B, N), got {shape}')
        pos = ids.float()
        f = self.inv_freq(pos.device)
        axes = self.pair_axes
        if A == 1:
            return pos[0][..., None] * f
        if bool((axes < 0).any()):  # pairs that are not rotated: angle 0
            return pos[axes.clamp(min=0)].movedim(0, -1) * (f * (axes >= 0).to(f.dtype))
        return pos[axes].movedim(0, -1) * f

    def cos_sin(self, ids: Tensor, dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
        """``cos, sin`` of ids with the rotate-half duplication, last dim ``rotary_dim`` (float32 or
        ``dtype``): what language-model code's rotary module returns."""
        ang = self.angles(ids)
        cos, sin = ang.cos(), ang.sin()
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def table(self, ids: Tensor) -> Tensor:
        """Complex table ``([B,] [H,] N, P)`` for `vispe.rotary.apply_pair_rotation(..., 'half')`."""
        ang = self.angles(ids)
        return torch.complex(ang.cos(), ang.sin())

    def rotation(self, pos: Positions, batch: Optional[int] = None, draws=None) -> Tensor:
        ids, _ = self.position_ids(pos)
        rot = self.table(ids)  # ([B,] N, P), head-wise (B | 1, H, N, P)
        if rot.dim() == 3 and self.head_layout is None:  # (B, 1, N, P): broadcast over heads
            rot = rot.unsqueeze(-3)
        return rot.unsqueeze(0)  # one table for every layer

    def qk(self, q, k, state, layer, x=None):
        rot, _ = self.layer_state(state, q.shape[0]).layer(layer)
        if self.head_layout is None:
            return rotate_qk(q, k, rot, rot, 'half_table')
        hk, hq = rot.shape[-3], q.shape[-3]  # head-wise tables are the key/value heads'
        if k.shape[-3] != hk or hq % hk:
            raise ValueError(f'encoding {self.name!r} was built for {hk} (key/value) heads; k has {k.shape[-3]} '
                             f'and q {hq} heads (q heads must be a multiple of k heads)')
        rq = rot if hq == hk else rot.repeat_interleave(hq // hk, dim=-3)  # key/value head j serves q heads j*g..
        return rotate_qk(q, k, rq, rot, 'half_table')

    def extra_repr(self) -> str:
        return f'{self.name}, head_dim={self.ctx.head_dim}, rotary_dim={self.rotary_dim}, theta={self.theta}'


def _multimodal(pos: Positions, name: str) -> MultimodalPositions:
    if not isinstance(pos, MultimodalPositions):
        raise ValueError(f'encoding {name!r} reads the segments of a multimodal sequence: build its positions with '
                         f'vispe.sequence([vispe.Text(n), vispe.Image(grid=...), ...]), got {type(pos).__name__}')
    return pos


@register_pe('rope_1d', family=MULTIMODAL_FAMILY)
class RoPE1D(MultimodalRoPE):
    """Plain 1D RoPE over a multimodal sequence (Su et al. 2021): every token, visual or not, advances the
    position by one; one id axis, every pair reads it.

    The baseline of the multimodal encodings ("vanilla RoPE" in the Multimodal-RoPEs study).

    Args:
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'p'
    paper = 'Su et al., RoFormer, arXiv:2104.09864'
    row_runs = False

    def __init__(self, ctx: PEContext, *, theta: float = 1e6, rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        self.register_axes()

    def visual_extent(self, seg):
        return seg['n']

    def visual_block(self, seg):
        return seg['start'][None], torch.ones(1, 1, dtype=torch.long, device=seg['n'].device)


def decode_position_ids(rope_delta: Tensor, cache_position, length: int = 1, num_axes: int = 3) -> Tensor:
    """Ids ``(A, B, length)`` of the next ``length`` tokens at cache position ``cache_position``.

    Every axis gets ``cache_position + i + rope_delta``, as text continues after any segment.
    ``cache_position`` (an int or ``(B,)``, >= 0) is, for a ``rope_delta`` of vispe's convention (and
    transformers 4.x's), the padded length of what is already in the cache; for transformers 5.x's, the
    number of real tokens of each sequence so far.
    """
    for value, what in ((length, 'length'), (num_axes, 'num_axes')):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f'decode_position_ids: {what} must be a positive integer, got {value!r}')
    rope_delta = torch.as_tensor(rope_delta)
    delta = rope_delta.reshape(-1, 1)
    cache = torch.as_tensor(cache_position, device=delta.device)
    if cache.is_floating_point() or cache.is_complex() or cache.dtype == torch.bool:
        raise ValueError(f'decode_position_ids: cache_position must be an integer or a (B,) integer tensor, '
                         f'got dtype {cache.dtype}')
    if bool((cache < 0).any()):
        raise ValueError(f'decode_position_ids: cache_position must be >= 0 (the tokens already in the cache), '
                         f'got {cache.tolist()}')
    cache = cache.reshape(-1, 1)
    if cache.shape[0] not in (1, delta.shape[0]):
        raise ValueError(f'decode_position_ids: cache_position has {cache.shape[0]} values for '
                         f'{delta.shape[0]} sequences')
    pos = cache + torch.arange(length, device=delta.device) + delta
    return pos.unsqueeze(0).expand(num_axes, -1, -1)


def rotary_table(cos: Tensor, sin: Tensor, x: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """The complex table of ``cos, sin`` (rotate-half layout) shaped to broadcast against ``x``.

    ``cos`` ``(B, N, r)`` is unsqueezed at ``unsqueeze_dim`` (the heads axis of ``x``, as in
    transformers' ``apply_rotary_pos_emb``); head-wise ``(B, H_kv, N, r)`` is moved to that axis
    and repeated for grouped-query heads (key/value head ``j`` serves query heads
    ``j * g .. (j+1) * g - 1``, transformers' ``repeat_kv``); ``(N, r)`` broadcasts as is.
    """
    if cos.shape != sin.shape:
        raise ValueError(f'cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}')
    if cos.dim() < 2:
        raise ValueError(f'cos / sin must be (N, r), (B, N, r) or head-wise (B, H, N, r), got {tuple(cos.shape)}')
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f'cos/sin last dim {r} must be even and at most the head dim {x.shape[-1]}')
    token_axis = -2 if unsqueeze_dim == 1 or unsqueeze_dim == x.dim() - 3 else -3
    n, nx = cos.shape[-2], x.shape[token_axis]
    if n != nx:
        raise ValueError(f'cos / sin are for {n} tokens but q / k have {nx} (token axis {token_axis} of shape '
                         f'{tuple(x.shape)} with unsqueeze_dim={unsqueeze_dim}): compute them from the ids of '
                         'the tokens being rotated')
    P = r // 2
    rot = torch.complex(cos[..., :P].float(), sin[..., :P].float())
    if rot.dim() == x.dim() - 1:
        return rot.unsqueeze(unsqueeze_dim)
    if rot.dim() == x.dim():  # head-wise (B, H, N, P)
        if unsqueeze_dim != 1:
            rot = rot.movedim(1, unsqueeze_dim)
        hk, hq = rot.shape[unsqueeze_dim], x.shape[unsqueeze_dim]
        if hk != hq:
            if hq % hk:
                raise ValueError(f'head-wise cos/sin has {hk} heads, which does not divide the {hq} heads of x')
            rot = rot.repeat_interleave(hq // hk, dim=unsqueeze_dim)
        return rot
    return rot


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1) -> Tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` by ``cos, sin`` of `MultimodalRoPE.cos_sin` (drop-in for transformers'
    ``apply_rotary_pos_emb``).

    ``q, k``: ``(B, H, N, hd)`` (``unsqueeze_dim=1``) or ``(B, N, H, hd)`` (``unsqueeze_dim=2``); ``q`` and
    ``k`` may have different head counts (GQA), not different token counts. The first ``cos.shape[-1]``
    channels are rotated in pairs ``(j, j + r/2)``, the rest pass through (partial rotary).

    Numerics: the rotation is computed in float32 and rounded once to ``q``'s dtype. For float32 inputs
    that is bit for bit transformers' ``q * cos + rotate_half(q) * sin`` (tested against transformers).
    For bfloat16 / float16 inputs it is not: transformers casts cos / sin to the activation dtype and
    rounds every product and the sum there, so its results differ in the last bits (vispe's are the
    float32 result rounded once, closer to exact).
    """
    if unsqueeze_dim not in (1, 2):
        raise ValueError(f'unsqueeze_dim must be 1 ((B, H, N, hd) q / k) or 2 ((B, N, H, hd)), got {unsqueeze_dim!r}')
    for name, t in (('q', q), ('k', k)):
        if t.dim() != 4:
            raise ValueError(f'{name} must be (B, H, N, hd) or (B, N, H, hd), got shape {tuple(t.shape)}')
    rq = rotary_table(cos, sin, q, unsqueeze_dim)
    rk = rq if k.shape[unsqueeze_dim] == q.shape[unsqueeze_dim] and k.shape == q.shape else \
        rotary_table(cos, sin, k, unsqueeze_dim)
    return rotate_qk(q, k, rq, rk, 'half_table')
