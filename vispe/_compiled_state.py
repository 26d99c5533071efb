"""An encoding's eval-mode state kept across the runs of a torch.compile graph.

Eager vispe builds an encoding's state (rotations, tables) once in eval mode and reuses it while
the positions and parameters are unchanged (`PositionalEncoding.prepared_state`). A compiled graph
keeps no tensors between its runs, so it would rebuild the state in every forward: for LieRE's
exponentials that is most of an eval forward. Encodings whose state is costly to build
(``cache_compiled_state``) therefore take it, in a compiled eval forward, from one opaque operator,
``vispe::cached_state``: at run time it asks the encoding's eager cache (which builds on a miss,
with eager's code and numbers) and returns copies, since a graph may write into the buffers its
operators return (reuse, in-place updates) and never may into the cache. The operator's inputs are
the encoding's parameters and buffers and the positions' tensors, so the graph orders it after
them, and the positions' sizes as (possibly symbolic) ints, so one dynamic-shape graph serves every
size; traced (fake tensors) it builds the state for its shapes. While a CUDA graph is captured, or
when the graph runs with other parameters than the encoding's own (``functional_call``), it builds
without the cache. torch.export (whose programs outlive the process) and camera positions keep the
build in the graph.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .positions import Positions

__all__ = ['register', 'compiled_eval_state']

# every live encoding by id, so that the operator (which takes tensors and strings) finds its owner
_LIVE: 'weakref.WeakValueDictionary[int, torch.nn.Module]' = weakref.WeakValueDictionary()
_STATIC_FIELDS = tuple(f.name for f in dataclasses.fields(Positions)
                       if f.name not in ('coords', 'view_index', 'key_padding_mask', 'cameras'))


def register(encoding: torch.nn.Module) -> None:
    """Make ``encoding`` findable by the operator (called when it is created or copied)."""
    _LIVE[id(encoding)] = encoding


def _flat(value: Any) -> List[int]:
    """A static `Positions` field as ints (sizes may be symbolic under dynamic shapes, which the
    operator takes as such): None ``[0]``, an int ``[1, v]``, a tuple ``[2, len, items...]``."""
    if value is None:
        return [0]
    if isinstance(value, int):
        return [1, value]
    return [2, len(value)] + [i for item in value for i in _flat(item)]


def _unflat(ints: Sequence[int], at: int) -> Tuple[Any, int]:
    tag = ints[at]
    if tag == 0:
        return None, at + 1
    if tag == 1:
        return ints[at + 1], at + 2
    items, at = [], at + 2
    for _ in range(ints[at - 1]):
        item, at = _unflat(ints, at)
        items.append(item)
    return tuple(items), at


def _static(pos: Optional[Positions]) -> List[int]:
    """The static fields of ``pos`` (none: ``[]``) as ints for the operator."""
    return [] if pos is None else [i for name in _STATIC_FIELDS for i in _flat(getattr(pos, name))]


def _tensors(pos: Optional[Positions]) -> List[Optional[torch.Tensor]]:
    return [] if pos is None else [pos.coords, pos.view_index, pos.key_padding_mask]


def _positions(tensors: Sequence[Optional[torch.Tensor]], ints: Sequence[int]) -> Optional[Positions]:
    if not tensors:
        return None
    fields, at = {}, 0
    for name in _STATIC_FIELDS:
        fields[name], at = _unflat(ints, at)
    coords, view_index, mask = tensors
    return Positions(coords, view_index=view_index, key_padding_mask=mask, **fields)


class _Prepare(torch.nn.Module):
    """Calls an encoding's state builder, so that `functional_call` can swap its tensors."""

    def __init__(self, encoding: torch.nn.Module) -> None:
        super().__init__()
        self.encoding = encoding

    def forward(self, pos_q: Positions, pos_k: Optional[Positions]) -> Any:
        return self.encoding._full_precision_prepare(pos_q, pos_k)


def _named_tensors(encoding: torch.nn.Module) -> List[Tuple[str, torch.Tensor]]:
    return list(encoding.named_parameters()) + list(encoding.named_buffers())


def _unique_leaves(state: Any) -> Tuple[List[Any], Any, List[int]]:
    """The state's leaves, its structure, and for each leaf the index of its tensor among the
    distinct tensors (-1: not a tensor); a tensor used twice (``k is q``) is returned once."""
    leaves, spec = tree_flatten(state)
    index, slots = [], []
    for leaf in leaves:
        if not torch.is_tensor(leaf):
            slots.append(-1)
            continue
        slot = next((j for j, t in enumerate(index) if t is leaf), None)
        if slot is None:
            slot = len(index)
            index.append(leaf)
        slots.append(slot)
    return leaves, spec, slots


def _distinct_tensors(state: Any) -> List[torch.Tensor]:
    leaves, _, slots = _unique_leaves(state)
    return [leaves[slots.index(j)] for j in range(max(slots, default=-1) + 1)]


def _build(encoding: torch.nn.Module, tensors: Sequence[torch.Tensor], pos_q: Positions,
           pos_k: Optional[Positions]) -> Any:
    names = [name for name, _ in _named_tensors(encoding)]
    swapped = {f'encoding.{name}': t for name, t in zip(names, tensors)}
    return torch.func.functional_call(_Prepare(encoding), swapped, (pos_q, pos_k), strict=True)


def _owner(owner: int) -> torch.nn.Module:
    encoding = _LIVE.get(owner)
    if encoding is None:
        raise RuntimeError('vispe::cached_state: the encoding this compiled graph was traced with no longer '
                           'exists; compile the model again')
    return encoding


# dtype codes of the operator's output layouts
_DTYPES = tuple(dict.fromkeys(v for v in vars(torch).values() if isinstance(v, torch.dtype)))


def _layouts(tensors: Sequence[torch.Tensor]) -> List[int]:
    """Each tensor's dims, sizes, strides and dtype code as ints (symbolic under dynamic shapes)."""
    return [i for t in tensors for i in (t.dim(), *t.shape, *t.stride(), _DTYPES.index(t.dtype))]


def _empty(layouts: Sequence[int], device: torch.device) -> List[torch.Tensor]:
    out, at = [], 0
    while at < len(layouts):
        n = layouts[at]
        shape, stride = layouts[at + 1:at + 1 + n], layouts[at + 1 + n:at + 1 + 2 * n]
        out.append(torch.empty_strided(shape, stride, dtype=_DTYPES[layouts[at + 1 + 2 * n]], device=device))
        at += 2 + 2 * n
    return out


@torch.library.custom_op('vispe::cached_state', mutates_args=())
def _cached_state(tensors: List[torch.Tensor], q: List[Optional[torch.Tensor]], q_static: List[int],
                  k: List[Optional[torch.Tensor]], k_static: List[int], layouts: List[int],
                  owner: int) -> List[torch.Tensor]:
    encoding = _owner(owner)
    pos_q, pos_k = _positions(q, q_static), _positions(k, k_static)
    own = [t for _, t in _named_tensors(encoding)]
    capturing = q[0].is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing or len(own) != len(tensors) or any(a.data_ptr() != b.data_ptr() for a, b in zip(own, tensors)):
        state = _build(encoding, tensors, pos_q, pos_k)
    else:
        state = encoding.prepared_state(pos_q, pos_k)
    # copies in the layouts the graph was traced with (which its kernels assume)
    out = _empty(layouts, q[0].device)
    for target, source in zip(out, _distinct_tensors(state), strict=True):
        target.copy_(source)
    return out


@_cached_state.register_fake
def _(tensors, q, q_static, k, k_static, layouts, owner):
    return _empty(layouts, q[0].device)


def compiled_eval_state(encoding: torch.nn.Module, pos_q: Positions, pos_k: Optional[Positions]) -> Any:
    """``encoding``'s state for these positions in a compiled eval forward: from the eager cache through
    ``vispe::cached_state`` (positions without cameras, a state of tensors and constants), else built in
    the graph."""
    traced = encoding._full_precision_prepare(pos_q, pos_k)  # its structure; its tensors are dead code then
    leaves, spec, slots = _unique_leaves(traced)
    constant = all(torch.is_tensor(x) or x is None or isinstance(x, (str, int, float, bool)) for x in leaves)
    cameras = pos_q.cameras is not None or (pos_k is not None and pos_k.cameras is not None)
    if cameras or not constant or max(slots, default=-1) < 0:
        return traced
    tensors = [t for _, t in _named_tensors(encoding)]
    cached = torch.ops.vispe.cached_state(tensors, _tensors(pos_q), _static(pos_q), _tensors(pos_k), _static(pos_k),
                                          _layouts(_distinct_tensors(traced)), id(encoding))
    return tree_unflatten([leaf if s < 0 else cached[s] for leaf, s in zip(leaves, slots)], spec)
