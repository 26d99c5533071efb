"""What a positional encoding promises, written once as a check of the property.

Each function here compares two things the property says must agree (or must differ) and returns a
`CheckResult`: what was compared, the number measured, the limit it was held to, and whether it
passed. vispe's own tests call these functions on vispe's encodings, and `vispe.doctor` calls the same
functions on any model's position code, so a property means the same thing in both places.

The checks take tensors or small callables, never models: finding the position code of a model and
calling it is `vispe.doctor`'s job. Conventions: ``coords`` are ``(N, D)`` token coordinates;
``logits`` are ``(..., N, N)`` query-key products; ids are ``(A, N)`` (one row per id axis).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

__all__ = ['CheckResult', 'PASSED', 'FAILED', 'NOT_APPLICABLE', 'CHECKS', 'not_applicable', 'shift_invariance',
           'offset_invariance', 'moves_output', 'float32_tables', 'geometric_frequencies', 'matches_reference',
           'padded_equals_alone', 'resample_mode', 'ids_cover_tokens', 'ids_follow_grid', 'time_ids_monotone',
           'head_split']

PASSED, FAILED, NOT_APPLICABLE = 'passed', 'failed', 'n/a'

CHECKS: Dict[str, str] = {
    'relative_logits': 'rotary logits depend only on relative position where the encoding claims shift invariance',
    'float32_tables': 'frequency tables and angles are float32 (or wider) whatever the module dtype',
    'grid_change': 'positions change when the grid changes at an equal token count ((2, 8) vs (4, 4))',
    'padded_alone': 'a padded or packed image gets the output it gets alone',
    'ids_cover': 'position ids cover every token, follow the token grid and are monotone in time',
    'head_split': 'rotary sections / head splits sum to the head dim',
    'moves_output': 'the encoding moves the output (a position path that is not dead)',
    'resample_mode': 'a learned table is resampled by the mode the model declares',
}
"""The property of each check, by name: the names `CheckResult.check` takes."""


@dataclass(frozen=True)
class CheckResult:
    """The outcome of one check of one property on one subject.

    Attributes:
        check: the property's name (a key of `CHECKS`).
        status: ``'passed'``, ``'failed'`` or ``'n/a'``.
        compared: what was compared with what, in words.
        measured: the number measured (None when not applicable).
        limit: what ``measured`` was held to (an upper bound, or a lower bound for checks that want a
            difference: ``at_least``).
        subject: where the check looked (a module path, an encoding name).
        reason: why the check does not apply, or a detail of the finding.
        at_least: True when ``measured`` must reach ``limit`` (a difference wanted), False when it must
            stay within it.
    """
    check: str
    status: str
    compared: str = ''
    measured: Optional[float] = None
    limit: Optional[float] = None
    subject: str = ''
    reason: str = ''
    at_least: bool = False

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f'check must be one of {sorted(CHECKS)}, got {self.check!r}')
        if self.status not in (PASSED, FAILED, NOT_APPLICABLE):
            raise ValueError(f"status must be 'passed', 'failed' or 'n/a', got {self.status!r}")

    @property
    def passed(self) -> bool:
        return self.status == PASSED

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def applicable(self) -> bool:
        return self.status != NOT_APPLICABLE

    def evidence(self) -> str:
        """The number measured against its limit, in words (``'' `` when not applicable)."""
        if self.measured is None:
            return ''
        if self.limit is None:
            return f'{self.measured:.3g}'
        return f'{self.measured:.3g} ({">=" if self.at_least else "<="} {self.limit:.3g} wanted)'

    def __str__(self) -> str:
        where = f' [{self.subject}]' if self.subject else ''
        if not self.applicable:
            return f'{self.status:7s} {self.check}{where}: {self.reason}'
        detail = f'; {self.reason}' if self.reason else ''
        return f'{self.status:7s} {self.check}{where}: {self.compared}: {self.evidence()}{detail}'


def not_applicable(check: str, subject: str, reason: str) -> CheckResult:
    """A check that does not apply to ``subject``, with the reason."""
    return CheckResult(check, NOT_APPLICABLE, subject=subject, reason=reason)


def _verdict(check: str, ok: bool, compared: str, measured: float, limit: float, subject: str,
             reason: str = '', at_least: bool = False) -> CheckResult:
    return CheckResult(check, PASSED if ok else FAILED, compared, float(measured), float(limit), subject, reason,
                       at_least)


def _gap(a: torch.Tensor, b: torch.Tensor) -> Tuple[float, float]:
    """Largest absolute difference of ``a`` and ``b`` and the largest magnitude of ``b`` (its scale), in float64;
    a non-finite value anywhere is an infinite gap."""
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        raise ValueError(f'compared tensors must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}')
    if a.numel() == 0:
        return 0.0, 0.0
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return math.inf, float(b.nan_to_num(0, 0, 0).abs().max())
    return float((a - b).abs().max()), float(b.abs().max())


# ------------------------------------------------------------------ relative position
def shift_invariance(logits: Callable[[torch.Tensor], torch.Tensor], coords: torch.Tensor, shift: torch.Tensor, *,
                     atol: float = 0.0, rtol: float = 1e-4, subject: str = '') -> CheckResult:
    """A relative encoding's logits do not change when every coordinate moves by one ``shift``.

    Args:
        logits: coordinates ``(N, D)`` -> the logits that count (e.g. those between positioned tokens).
        coords: the token coordinates; ``shift``: ``(D,)``, added to every row.
        atol, rtol: the logits may differ by ``atol + rtol * max|logits|``.
    """
    a = logits(coords)
    b = logits(coords + shift)
    gap, scale = _gap(b, a)
    limit = atol + rtol * scale
    return _verdict('relative_logits', gap <= limit, f'logits at coordinates and at coordinates + '
                    f'{[round(float(s), 3) for s in shift.flatten()]}: largest difference', gap, limit, subject)


def offset_invariance(logits: torch.Tensor, coords: torch.Tensor, *, atol: float = 0.0, rtol: float = 1e-4,
                      subject: str = '') -> CheckResult:
    """Logits of one query vector and one key vector placed at every token (``logits[..., i, j]`` between
    the query at ``coords[i]`` and the key at ``coords[j]``) depend only on ``coords[j] - coords[i]``
    where the encoding is relative: each pair is compared with the pair moved by one step along each
    axis. For position code that computes its own grid (no coordinates to shift), with ``coords`` the
    integer grid indices of its tokens in any order.
    """
    coords = coords.detach().round().long()
    index = {tuple(c): i for i, c in enumerate(coords.tolist())}
    gap, scale, pairs = 0.0, float(logits.detach().double().abs().max()) if logits.numel() else 0.0, 0
    for axis in range(coords.shape[-1]):
        step = torch.zeros(coords.shape[-1], dtype=torch.long)
        step[axis] = 1
        moved = [index.get(tuple(c)) for c in (coords + step).tolist()]
        src = torch.tensor([i for i, m in enumerate(moved) if m is not None], dtype=torch.long)
        if src.numel() < 2:
            continue
        dst = torch.tensor([moved[i] for i in src.tolist()], dtype=torch.long)
        a = logits[..., src[:, None], src[None, :]]
        b = logits[..., dst[:, None], dst[None, :]]
        g, _ = _gap(b, a)
        gap, pairs = max(gap, g), pairs + src.numel() ** 2
    if not pairs:
        return not_applicable('relative_logits', subject, 'fewer than two tokens have a neighbour one step away')
    limit = atol + rtol * scale
    return _verdict('relative_logits', gap <= limit, f'logits of {pairs} token pairs against the same pairs moved one '
                    f'step along each axis: largest difference', gap, limit, subject)


def moves_output(a: torch.Tensor, b: torch.Tensor, *, at_least: float = 1e-3, relative: bool = True,
                 check: str = 'moves_output', what: str = 'outputs', subject: str = '') -> CheckResult:
    """Two outputs that must differ because their positions differ (a dead position path gives equal ones).

    Args:
        a, b: the outputs at the two position sets.
        at_least: the smallest difference wanted: of ``max|a - b| / max|a|`` with ``relative``, else of
            ``max|a - b|``.
        check: the property the difference stands for (``'moves_output'``, ``'grid_change'``).
        what: what ``a`` and ``b`` are, in words.
    """
    gap, scale = _gap(a, b)
    measured = gap / scale if relative and scale > 0 else gap
    kind = 'relative difference' if relative else 'largest difference'
    return _verdict(check, measured >= at_least, f'{what}: {kind}', measured, at_least, subject, at_least=True)


# ------------------------------------------------------------------ precision
def float32_tables(tensors: Mapping[str, torch.Tensor], *, subject: str = '') -> CheckResult:
    """Tensors that position computations read (frequency tables, angles) are float32 or wider."""
    floating = {n: t for n, t in tensors.items() if torch.is_tensor(t) and (t.is_floating_point() or t.is_complex())}
    if not floating:
        return not_applicable('float32_tables', subject, 'no floating-point position tables')
    narrow = {n: t.dtype for n, t in floating.items()
              if (t.real if t.is_complex() else t).dtype not in (torch.float32, torch.float64)}
    names = ', '.join(f'{n} ({str(d).replace("torch.", "")})' for n, d in narrow.items())
    return _verdict('float32_tables', not narrow, f'dtypes of {len(floating)} position tables: '
                    f'tables below float32', len(narrow), 0, subject, reason=f'narrow: {names}' if narrow else '')


def geometric_frequencies(freqs: torch.Tensor, *, rtol: float = 1e-5, subject: str = '') -> CheckResult:
    """A fixed RoPE frequency table ``theta^(-2i/d)`` is a geometric progression to float32 precision: its
    values rounded to a narrower type (a ``.to(bfloat16)`` and back) depart from it by ~1e-3.

    Not applicable to tables that are no geometric progression at all (more than 1 % away: learned or
    linear frequencies) or have fewer than three entries."""
    f = freqs.detach().double().flatten()
    if f.numel() < 3 or not bool((f > 0).all()):
        return not_applicable('float32_tables', subject, 'fewer than three positive frequencies')
    logf = f.log()
    i = torch.arange(f.numel(), dtype=torch.float64)
    fit = logf[0] + (logf[-1] - logf[0]) * i / (f.numel() - 1)
    dev = float((logf - fit).abs().max())  # relative deviation of each frequency from the progression
    if dev > 1e-2:
        return not_applicable('float32_tables', subject, 'the frequencies are not a geometric progression')
    return _verdict('float32_tables', dev <= rtol, f'{f.numel()} frequencies against the geometric progression '
                    'through the first and last: largest relative deviation', dev, rtol, subject)


def matches_reference(value: torch.Tensor, reference: torch.Tensor, *, check: str, compared: str, atol: float = 0.0,
                      rtol: float = 1e-5, subject: str = '') -> CheckResult:
    """``value`` equals ``reference`` within ``atol + rtol * max|reference|`` (a computation against an
    independent one: tables in the module's dtype against float64, a batch against each sample alone)."""
    gap, scale = _gap(value, reference)
    limit = atol + rtol * scale
    return _verdict(check, gap <= limit, f'{compared}: largest difference', gap, limit, subject)


def padded_equals_alone(together: Sequence[torch.Tensor], alone: Sequence[torch.Tensor], *, atol: float = 1e-5,
                        rtol: float = 1e-4, subject: str = '') -> CheckResult:
    """Each sample's real tokens in a padded or packed batch equal what the sample gives alone.

    Args:
        together: per sample, its real tokens' outputs cut from the batch.
        alone: per sample, its outputs run alone (same shapes)."""
    if len(together) != len(alone) or not together:
        raise ValueError(f'together and alone must hold one tensor per sample, got {len(together)} and {len(alone)}')
    gap, scale = 0.0, 0.0
    for t, a in zip(together, alone):
        g, s = _gap(t, a)
        gap, scale = max(gap, g), max(scale, s)
    limit = atol + rtol * scale
    return _verdict('padded_alone', gap <= limit, f'{len(alone)} samples in one batch against each alone: largest '
                    'difference', gap, limit, subject)


# ------------------------------------------------------------------ learned tables
_MODES = (('bicubic', False), ('bicubic', True), ('bilinear', False), ('bilinear', True), ('nearest', False),
          ('area', False))


def _resize(table: torch.Tensor, size: Tuple[int, int], mode: str, antialias: bool) -> torch.Tensor:
    x = table.detach().double().permute(2, 0, 1)[None]
    kw = dict(align_corners=False) if mode in ('bicubic', 'bilinear') else {}
    if antialias:
        kw['antialias'] = True
    return F.interpolate(x, size=size, mode=mode, **kw)[0].permute(1, 2, 0)


def resample_mode(resized: torch.Tensor, table: torch.Tensor, declared: str, *, rtol: float = 1e-3,
                  subject: str = '') -> CheckResult:
    """A learned table ``(h, w, C)`` that the model resized to ``resized`` ``(h', w', C)`` equals the table
    resized by the declared mode (``F.interpolate``, ``align_corners=False``, with or without antialias).

    The result names the mode that fits best, so a mismatch says what the model does instead."""
    if declared not in {m for m, _ in _MODES}:
        raise ValueError(f'declared must be one of {sorted({m for m, _ in _MODES})}, got {declared!r}')
    size = tuple(resized.shape[:2])
    if size == tuple(table.shape[:2]):
        return not_applicable('resample_mode', subject, 'the resized grid equals the table\'s grid')
    errors = {}
    for mode, aa in _MODES:
        gap, scale = _gap(resized, _resize(table, size, mode, aa))
        errors[(mode, aa)] = gap / scale if scale else gap
    best = min(errors, key=errors.get)
    own = min(e for (m, _), e in errors.items() if m == declared)
    name = f'{best[0]}{" (antialias)" if best[1] else ""}'
    return _verdict('resample_mode', own <= rtol, f'table resized {tuple(table.shape[:2])} -> {size} by the model '
                    f'against {declared}: largest relative difference', own, rtol, subject, reason=f'best fit: {name}')


# ------------------------------------------------------------------ position ids
def ids_cover_tokens(ids: torch.Tensor, num_tokens: int, *, distinct: Iterable[Sequence[int]] = (),
                     subject: str = '') -> CheckResult:
    """Ids ``(A, N)`` give every one of ``num_tokens`` tokens a finite id, and the tokens of each group in
    ``distinct`` (the token indices of one image or one frame) distinct ids."""
    if ids.dim() != 2 or ids.shape[1] != num_tokens:
        return _verdict('ids_cover', False, f'id columns against {num_tokens} tokens', ids.shape[-1], num_tokens,
                        subject, reason=f'ids of shape {tuple(ids.shape)}')
    bad = int((~torch.isfinite(ids.double())).any(0).sum())
    clashes = 0
    for group in distinct:
        cols = ids[:, list(group)].double().T
        clashes += len(group) - int(torch.unique(cols, dim=0).shape[0])
    return _verdict('ids_cover', bad == 0 and clashes == 0, f'{num_tokens} tokens: tokens without a finite id plus '
                    'tokens of one image or frame sharing an id', bad + clashes, 0, subject)


def ids_follow_grid(ids: torch.Tensor, grid: Tuple[int, int], *, subject: str = '') -> CheckResult:
    """The (row, column) ids ``(2, h * w)`` of an image's tokens in raster order follow its token grid: the row
    id is constant along a row and the column id along a column, and both take ``h`` and ``w`` values (ids
    built for another grid, a collapse to one running index, or ids of unpacked latents fail)."""
    h, w = grid
    if ids.shape != (2, h * w):
        return _verdict('ids_cover', False, f'(row, column) ids against a {h}x{w} token grid', ids.shape[-1], h * w,
                        subject, reason=f'ids of shape {tuple(ids.shape)}')
    rows, cols = ids.double().reshape(2, h, w)
    wrong = float((rows - rows[:, :1]).abs().max() + (cols - cols[:1]).abs().max())
    wrong += abs(torch.unique(rows[:, 0]).numel() - h) + abs(torch.unique(cols[0]).numel() - w)
    return _verdict('ids_cover', wrong == 0, f'row ids along rows and column ids along columns of a {h}x{w} grid: '
                    'largest departure plus missing distinct values', wrong, 0, subject)


def time_ids_monotone(frame_ids: torch.Tensor, *, strict: bool = True, subject: str = '') -> CheckResult:
    """Time ids ``(T, n)`` of the ``n`` tokens of each of ``T`` frames: one time per frame, and frames in
    order (``strict``: each later than the one before, for frames at least one id step apart; a still image
    is one frame, ``T == 1``, which holds one time)."""
    f = frame_ids.double()
    spread = float((f - f[:, :1]).abs().max()) if f.numel() else 0.0
    steps = f[1:, 0] - f[:-1, 0]
    back = float((-steps).clamp(min=0).max()) if steps.numel() else 0.0
    still = int((steps == 0).sum()) if strict and steps.numel() else 0
    measured = spread + back + still
    what = 'one frame' if f.shape[0] == 1 else f'{f.shape[0]} frames'
    return _verdict('ids_cover', measured == 0, f'time ids of {what}: spread within a frame plus steps back in '
                    f'time{" plus frames at the time of the one before" if strict else ""}', measured, 0, subject)


def head_split(sections: Sequence[int], head_dim: int, *, per_pair: bool = True, subject: str = '') -> CheckResult:
    """Rotary sections (channel pairs per axis with ``per_pair``, else channels) sum to the head dim."""
    channels = sum(int(s) for s in sections) * (2 if per_pair else 1)
    unit = 'pairs' if per_pair else 'channels'
    return _verdict('head_split', channels == head_dim, f'sections {list(sections)} ({unit}) against head dim '
                    f'{head_dim}: channels not covered or over', abs(channels - head_dim), 0, subject)
