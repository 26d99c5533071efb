"""Whether the fused rotation kernels are trusted, per kernel kind, activation dtype and device.

Under the fused setting ``'auto'`` (`autograd.FUSED`) a fused kernel serves a kind (``table``,
``half_table``, ``pair``, ``block``, ``matrix``) on a device only after it has agreed with the
reference kernels there: the first launch of each variant (the rotation's dtype and block size, and
the gradients the call will take) is checked against the reference on that call's first sample
(`autograd` runs the comparison). A check that raises, or differs by more than the dtype's
`TOLERANCE`, marks the kind as fallen back for that dtype and device: one warning, and the reference
kernels from then on. A later launch of a trusted kind that raises (a shape whose kernel fails to
compile) falls back the same way. `fused_report` says which path each kind took.

One lock serialises the checks, so that threads launching the same kind at once check it once and
warn at most once; once a verdict exists it is read without the lock.
"""
from __future__ import annotations

import logging
import threading
import warnings
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Set, Tuple

import torch

__all__ = ['FusedCheck', 'TOLERANCE', 'fused_report']

logger = logging.getLogger(__name__)

KINDS = ('table', 'half_table', 'pair', 'block', 'matrix')
"""The kinds the fused kernels serve."""

TOLERANCE: Dict[torch.dtype, float] = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
"""Largest relative difference (``max |fused - reference| / max |reference|``, over the output and the
gradients) a check accepts: about four units in the last place of the dtype (the kernels and the
reference each round once to it; a parameter gradient adds a reduction over the batch in float32);
a wrong kernel (a sign, a transposed block, a missed token) is off by order one."""

Key = Tuple[str, torch.dtype, str]  # kind, activation dtype, device


class FusedCheck(NamedTuple):
    """What the fused kernel of one ``kind`` runs as for one activation ``dtype`` on one ``device``
    (both None for a kind not tried): ``status`` ``'trusted'``, ``'fell back'`` or ``'not tried'``, and
    ``detail``: the checks it passed and their largest difference, or why it fell back."""
    kind: str
    dtype: Optional[torch.dtype]
    device: Optional[str]
    status: str
    detail: str


_LOCK = threading.RLock()
_VERDICTS: Dict[Key, FusedCheck] = {}
_PASSED: Set[Tuple[Key, Hashable]] = set()  # variants checked and found in agreement
_LARGEST: Dict[Key, float] = {}  # largest difference over a key's passed checks


def trusted(key: Key, variant: Hashable, check: Callable[[], float], may_check: bool = True) -> bool:
    """Whether ``key``'s fused kernel may run this ``variant``: True once ``check()`` (the largest relative
    difference from the reference) has passed for it, False once the key has fallen back; otherwise
    ``check`` runs now (with ``may_check``; without, e.g. while a CUDA graph is captured, False). Out of
    memory during a check gives False with no verdict (the next launch checks again)."""
    verdict = _VERDICTS.get(key)
    if verdict is not None and verdict.status == 'fell back':
        return False
    if (key, variant) in _PASSED:
        return True
    if not may_check:
        return False
    with _LOCK:
        verdict = _VERDICTS.get(key)  # another thread may have checked while this one waited
        if verdict is not None and verdict.status == 'fell back':
            return False
        if (key, variant) in _PASSED:
            return True
        try:
            difference = check()
        except torch.OutOfMemoryError:
            return False
        except Exception as error:  # a kernel that fails to compile or launch: whatever it raises
            _fall_back(key, _raised(error))
            return False
        tolerance = TOLERANCE[key[1]]
        if not difference <= tolerance:  # NaN included
            _fall_back(key, f'differs from the reference kernels by {difference:.2e} (tolerance {tolerance:.0e})')
            return False
        _PASSED.add((key, variant))
        _LARGEST[key] = max(_LARGEST.get(key, 0.0), difference)
        checks = sum(k == key for k, _ in _PASSED)
        _VERDICTS[key] = FusedCheck(*key, 'trusted', f'agrees with the reference kernels in {checks} check'
                                    f'{"s" if checks > 1 else ""} (largest difference {_LARGEST[key]:.1e}, '
                                    f'tolerance {tolerance:.0e})')
        logger.info('fused rotation kernel %r trusted for %s on %s (difference %.1e)', key[0], key[1], key[2],
                    difference)
        return True


def failed(key: Key, error: BaseException) -> None:
    """A launch of ``key``'s fused kernel raised ``error`` after its checks: the kind falls back."""
    with _LOCK:
        verdict = _VERDICTS.get(key)
        if verdict is None or verdict.status != 'fell back':
            _fall_back(key, _raised(error))


def _raised(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f'raised {type(error).__name__}' + (f': {lines[0][:200]}' if lines else '')


def _fall_back(key: Key, reason: str) -> None:
    kind, dtype, device = key
    _VERDICTS[key] = FusedCheck(kind, dtype, device, 'fell back', reason)
    warnings.warn(
        f"vispe: the fused Triton rotation kernel {kind!r} for {dtype} on {device} {reason}; rotations of this "
        f"kind run vispe's reference kernels from now on in this process (same results, more kernel launches). "
        f"VISPE_FUSED=off or vispe.rotary.set_fused('off') skips the fused kernels and this check; 'on' raises "
        f"instead. vispe.rotary.fused_report() lists what each kind runs.", RuntimeWarning, stacklevel=2)


def fused_report() -> List[FusedCheck]:
    """What each fused kernel kind runs as in this process: one `FusedCheck` per kind, dtype and device
    checked under ``'auto'`` (``'trusted'``, or ``'fell back'`` with the reason), and one ``'not tried'``
    for each kind that no launch has needed (or that ran only under ``'on'``, which checks nothing).

    Example:
        >>> for check in vispe.rotary.fused_report():
        ...     print(check.kind, check.dtype, check.device, check.status, check.detail)
    """
    with _LOCK:
        found = sorted(_VERDICTS.values(), key=lambda c: (KINDS.index(c.kind), str(c.dtype), c.device))
    tried = {c.kind for c in found}
    return found + [FusedCheck(kind, None, None, 'not tried', 'no launch under auto has needed it')
                    for kind in KINDS if kind not in tried]
