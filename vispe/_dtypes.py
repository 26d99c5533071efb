"""The compute precision of position maths: at least float32, float64 kept; regions without autocast.

Phases, angles and quadratic coordinate terms lose their meaning in half precision (bf16 angles
break relative-position exactness at large positions; expanded squares cancel), so they are
computed in float32 whatever the activation dtype; float64 inputs stay float64 so that exactness
tests can compare against float64 references.
"""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

__all__ = ['compute_dtype', 'at_least_float32', 'autocast_off']


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """``float64`` for float64 (or complex128) tensors, ``float32`` for every other dtype."""
    return torch.float64 if t.dtype in (torch.float64, torch.complex128) else torch.float32


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or unchanged when it is float64 (a no-op for float32 tensors)."""
    return t if t.dtype == torch.float64 else t.float()


def autocast_off(device: torch.device) -> ContextManager:
    """A region without autocast on ``device`` (float32 phases, exponentials, camera geometry), or no
    change where autocast does not exist for the device type (meta tensors)."""
    # the availability check is a C call that torch.compile of the oldest supported torch (2.11) cannot trace
    # (a graph break under fullgraph; 2.14 traces it); a compiled graph runs on a real device, where autocast
    # exists
    if device.type != 'meta' and (torch.compiler.is_compiling() or torch.amp.is_autocast_available(device.type)):
        return torch.autocast(device_type=device.type, enabled=False)
    return contextlib.nullcontext()
