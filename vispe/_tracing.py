"""Whether the running code is being traced, which decides whether vispe may cache tensors.

While torch.compile or torch.export (dynamo or make_fx, with fake tensors), torch.jit.trace or a
fake-tensor mode runs a forward, the tensors it creates are not real (or become graph constants):
a cache filled then would hand FakeTensors to later plain forwards, in any model of the process.
vispe therefore builds everything afresh while tracing and caches only in plain execution.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = ['is_tracing', 'static_equal']

_TRACING_MODES = (torch._C._TorchDispatchModeKey.FAKE, torch._C._TorchDispatchModeKey.PROXY)


def is_tracing() -> bool:
    """True under torch.compile / torch.export, torch.jit.trace, make_fx or an active FakeTensorMode."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return True
    return any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_MODES)


def static_equal(a: Sequence[int], b: Sequence[int]) -> bool:
    """``tuple(a) == tuple(b)`` where that is known without a guard: plain ints compare; symbolic
    sizes (torch.compile with dynamic shapes) give False, as a comparison would specialize the graph
    to that size and recompile it there. A caller takes its general path then, which must also be
    right for equal sizes."""
    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))
