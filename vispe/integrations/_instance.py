"""What every adapter does to the one model instance it patches, and how it is undone.

An adapter replaces attributes and submodules of that instance's modules and adds hooks to them, never
to their classes; `InstancePatch` records each replacement (whether the name existed, its old value)
and each hook, and `remove` undoes them in reverse order, so the instance is restored bit for bit.
"""
from __future__ import annotations

from typing import Any, List, Tuple

from torch import nn

__all__ = ['InstancePatch']


class InstancePatch:
    """The record of one adapter's changes to one model instance; ``remove()`` (or leaving a ``with``
    block) undoes them. The handle is kept on the model as ``model.<marker>`` while active, so a second
    patch of the same instance can be refused.

    Attributes:
        model: the patched instance.
        replaced: ``(owner label, attribute)`` of everything replaced or hooked, for the record.
    """
    marker = '_vispe_patch'

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.replaced: List[Tuple[str, str]] = []
        self._saved: List[Tuple[nn.Module, str, bool, Any]] = []
        self._hooks: List[Any] = []
        self._active = False

    @classmethod
    def of(cls, model: nn.Module) -> 'InstancePatch | None':
        """The active handle of this kind on ``model``, if any."""
        return model.__dict__.get(cls.marker)

    def _set(self, owner: nn.Module, name: str, value: Any, label: str) -> None:
        """Replace ``owner.<name>`` (a submodule or a plain attribute, e.g. a bound ``forward``) on this
        instance only."""
        in_modules = name in owner._modules
        had = in_modules or name in owner.__dict__
        old = owner._modules[name] if in_modules else owner.__dict__.get(name)
        self._saved.append((owner, name, had, old))
        self.replaced.append((label, name))
        if isinstance(value, nn.Module):
            owner._modules[name] = value
        else:
            object.__setattr__(owner, name, value)

    def _hook(self, handle: Any, label: str, kind: str = 'hook') -> None:
        """Keep a hook's removable handle."""
        self._hooks.append(handle)
        self.replaced.append((label, kind))

    def _activate(self) -> None:
        self._active = True
        object.__setattr__(self.model, self.marker, self)

    def remove(self) -> None:
        """Restore the instance: the original modules and attributes, no hooks."""
        if not self._active:
            return
        for h in self._hooks:
            h.remove()
        for owner, name, had, old in reversed(self._saved):
            if name in owner._modules:
                if had:
                    owner._modules[name] = old
                else:
                    del owner._modules[name]
            elif had:
                object.__setattr__(owner, name, old)
            else:
                del owner.__dict__[name]
        self._hooks, self._saved = [], []
        self._active = False
        if self.model.__dict__.get(self.marker) is self:
            del self.model.__dict__[self.marker]

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> 'InstancePatch':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()
