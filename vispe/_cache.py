"""`TensorCache`: tensors an encoding (or a kernel) reuses across forwards, never filled while traced."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Hashable, TypeVar

import torch

from ._tracing import is_tracing

__all__ = ['TensorCache']

T = TypeVar('T')


class TensorCache:
    """Tensors an encoding reuses across forwards (a table per grid, bucket ids), least recently used
    first out. Keys also carry whether inference mode is on (inference tensors cannot be saved for
    backward); nothing is cached while traced (fake tensors). Owned by `PositionalEncoding` (its
    ``tensor_cache``), cleared with its state cache."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: 'OrderedDict[Any, Any]' = OrderedDict()

    def get(self, key: Hashable, build: Callable[[], T]) -> T:
        """The cached value of ``key``, built by ``build()`` when missing."""
        if is_tracing():
            return build()
        key = (key, torch.is_inference_mode_enabled())
        value = self._entries.get(key)
        if value is None:
            value = build()
            self._entries[key] = value
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return value

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
