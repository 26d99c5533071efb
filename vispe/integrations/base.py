"""The one mechanism every adapter into another library's models uses.

An adapter (`patch_detr`, `patch_vlm`, `patch_vision`, `patch_dit`, open_clip's `use_pe`) changes one
model instance, never the library's classes or module functions, and returns a `ModelPatch` handle.
The handle records every change and undoes it in reverse order (`ModelPatch.remove`), so the
instance is restored bit for bit:

* `ModelPatch.set` replaces an attribute or a submodule of one module instance (a bound ``forward``,
  a rotary module, an attention processor), remembering whether the name existed and its old value;
* `ModelPatch.add_hook` registers a forward (pre-)hook and remembers where, by hook id, so that a
  copied model removes its own copy of the hook;
* `ModelPatch.activate` marks every module of the patched tree, so that a second patch anywhere in
  that tree (the model, a parent holding it, a submodule of it) is refused with `AlreadyPatchedError`
  (`refuse_patched`) instead of stacking two encodings.

Copies and pickles. A patched model deep-copies into an independent patched model and pickles
(``torch.save(model)``): what an adapter installs must hold no closures over module instances. Replaced
forwards and hooks are bound methods of the handle or `functools.partial` objects over them and the
modules they act on, which `copy.deepcopy` and pickle follow consistently: the copy's forwards call the
copy's modules and the copy's handle.

The per-forward state (`vispe.PreparedPE`) reaches the attention layers through the call wherever the
host's call allows it: the keyword arguments that transformers threads from the model's forward to
every attention (a forward pre-hook adds vispe's per-forward object to them), the attention-processor
arguments of diffusers. Nothing of one forward is kept on the handle.

Library versions are checked by `vispe.extras.require` (one table, `vispe.extras.SUPPORTED`, one error
type, `vispe.extras.UnsupportedVersionError`, whose message names the extra that installs the range).
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterator, List, Optional, Tuple

from torch import nn

__all__ = ['ModelPatch', 'AlreadyPatchedError', 'UnsupportedModelError', 'refuse_patched', 'find_patch']

_HOOK_DICTS = {
    'forward': ('_forward_hooks', '_forward_hooks_with_kwargs', '_forward_hooks_always_called'),
    'forward_pre': ('_forward_pre_hooks', '_forward_pre_hooks_with_kwargs'),
}
MARKER = '_vispe_patch'
"""The instance attribute (in ``module.__dict__``, never a parameter or buffer) that names the handle of
the patch a module belongs to."""


class AlreadyPatchedError(RuntimeError):
    """A model (or a module inside it, or a module holding it) already carries a vispe patch."""


class UnsupportedModelError(TypeError):
    """A model class (or layout) that an adapter does not support; the message lists what it supports."""


def _named_patches(model: nn.Module) -> Iterator[Tuple[str, 'ModelPatch']]:
    for name, module in model.named_modules(remove_duplicate=False):
        handle = module.__dict__.get(MARKER)
        if handle is not None and handle.active:
            yield name, handle


def find_patch(model: nn.Module) -> Optional['ModelPatch']:
    """The active vispe patch on ``model`` or on any module inside it, or on a model holding it; None if none."""
    return next((h for _, h in _named_patches(model)), None)


def refuse_patched(model: nn.Module, adapter: str) -> None:
    """Raise `AlreadyPatchedError` when any module of ``model``'s tree belongs to an active patch: the
    model itself, one of its submodules (patched directly), or a model that holds it (its whole tree
    is marked)."""
    for name, handle in _named_patches(model):
        where = 'this model' if not name else f'its submodule {name!r}'
        raise AlreadyPatchedError(
            f'{adapter}: {where} is already patched ({handle!r}); one patch per model tree: call .remove() on '
            f'that handle first (a parent and a child patched separately would stack two encodings)')


class ModelPatch:
    """The record of one adapter's changes to one model instance; ``remove()`` (or leaving a ``with``
    block) undoes them.

    Attributes:
        model: the patched instance.
        replaced: ``(owner label, attribute)`` of everything replaced or hooked, for the record.
        adapter: the adapter's public name, for messages.
    """
    adapter: ClassVar[str] = 'vispe patch'

    def __init__(self, model: nn.Module) -> None:
        refuse_patched(model, self.adapter)
        self.model = model
        self.replaced: List[Tuple[str, str]] = []
        self._saved: List[Tuple[nn.Module, str, bool, Any]] = []
        self._hooks: List[Tuple[nn.Module, str, int]] = []
        self._marked: List[nn.Module] = []
        self._active = False

    @classmethod
    def of(cls, model: nn.Module) -> Optional['ModelPatch']:
        """The active handle of this adapter on ``model`` itself, if any."""
        handle = model.__dict__.get(MARKER)
        return handle if isinstance(handle, cls) and handle.active and handle.model is model else None

    # ------------------------------------------------------------------ recording changes
    def set(self, owner: nn.Module, name: str, value: Any, label: Optional[str] = None) -> None:
        """Replace ``owner.<name>`` (a submodule or a plain attribute, e.g. a bound ``forward``) on this
        instance only. ``value`` must survive deepcopy and pickle (no closures): a module, a bound method
        of the handle, or a `functools.partial` of one."""
        in_modules = name in owner._modules
        had = in_modules or name in owner.__dict__
        old = owner._modules[name] if in_modules else owner.__dict__.get(name)
        self._saved.append((owner, name, had, old))
        self.replaced.append((label or type(owner).__name__, name))
        if isinstance(value, nn.Module) or in_modules:
            owner._modules[name] = value
        else:
            object.__setattr__(owner, name, value)

    def add_hook(self, module: nn.Module, hook: Callable[..., Any], kind: str = 'forward', *,
                 with_kwargs: bool = False, always_call: bool = False, label: Optional[str] = None) -> None:
        """Register a ``'forward'`` or ``'forward_pre'`` hook on ``module`` (a bound method of the handle or
        a `functools.partial` of one), recorded by id so that a copy of the model removes its own.
        ``always_call``: a forward hook that runs also when the forward raises (to end a forward's state)."""
        if kind == 'forward':
            handle = module.register_forward_hook(hook, with_kwargs=with_kwargs, always_call=always_call)
        elif kind == 'forward_pre':
            handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
        else:
            raise ValueError(f"hook kind must be 'forward' or 'forward_pre', got {kind!r}")
        self._hooks.append((module, kind, handle.id))
        self.replaced.append((label or type(module).__name__, f'{kind} hook'))

    def activate(self) -> None:
        """Mark every module of the patched tree (a second patch anywhere in it is refused) and keep the
        handle on the model."""
        self._marked = list(self.model.modules())
        for module in self._marked:
            module.__dict__[MARKER] = self
        self._active = True

    # ------------------------------------------------------------------ undoing them
    def remove(self) -> None:
        """Restore the instance: the original modules and attributes, no hooks, no marks. Also undoes what
        an install that failed half-way had recorded (an adapter calls it then: nothing stays patched)."""
        if not (self._active or self._saved or self._hooks):
            return
        for module, kind, hook_id in reversed(self._hooks):
            for registry in _HOOK_DICTS[kind]:
                getattr(module, registry).pop(hook_id, None)
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
        for module in self._marked:
            if module.__dict__.get(MARKER) is self:
                del module.__dict__[MARKER]
        self._hooks, self._saved, self._marked = [], [], []
        self._active = False

    def replaces_forward(self, module: nn.Module) -> bool:
        """Whether this patch replaced ``module``'s ``forward`` (the module's own computation no longer runs:
        a checker of the model looks at the encoding the patch installed instead)."""
        return self._active and any(owner is module and name == 'forward' for owner, name, _, _ in self._saved)

    @property
    def active(self) -> bool:
        return self._active

    def __enter__(self) -> 'ModelPatch':
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def __repr__(self) -> str:
        return (f'{type(self).__name__}({type(self.model).__name__}, active={self._active}, '
                f'replaced={len(self.replaced)})')
