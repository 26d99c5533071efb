"""Value checks for encoding options, shared by the constructors (which run whether an encoding
is built from a spec string or directly) and by the registry's error messages.

Every check raises ``ValueError: option 'theta' of encoding 'rope_axial' must be ..., got ...``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

from ..options import short_repr

__all__ = ['check_positive', 'check_nonnegative', 'check_min_int']


def _where(encoding: str, option: str) -> str:
    return f'option {option!r} of encoding {encoding!r}'


def _finite(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def check_positive(encoding: str, option: str, value: float) -> float:
    """``value`` if it is a finite number > 0 (not NaN, inf, zero or negative)."""
    if not (_finite(value) and value > 0):
        raise ValueError(f'{_where(encoding, option)} must be a finite number > 0, got {short_repr(value)}')
    return value


def check_nonnegative(encoding: str, option: str, value: float) -> float:
    """``value`` if it is a finite number >= 0 (e.g. a std, where 0 is a constant init)."""
    if not (_finite(value) and value >= 0):
        raise ValueError(f'{_where(encoding, option)} must be a finite number >= 0, got {short_repr(value)}')
    return value


def check_min_int(encoding: str, option: str, value: int, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f'{_where(encoding, option)} must be an integer >= {minimum}, got {short_repr(value)}')
    return value
