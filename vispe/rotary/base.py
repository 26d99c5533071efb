"""`RotationPE`: the one base of the rotary encodings (RoPE, LieRE, ComRoPE, STRING, GTA, PRoPE).

A rotary encoding maps q and k (GTA and PRoPE also v and the attention output) by per-position
rotations that depend on positions and parameters only. The base builds them once per forward for
every layer (`prepare`, cached in eval by `PositionalEncoding`) as a `RotationState`: the kind of
rotation (a name in `autograd.KINDS`) and per-layer rotations of the queries and of the keys, the
same objects in self-attention, so that q and k are rotated in one call. Subclasses say how to
build one token set's rotations (`rotation`); the ``qk`` hook applies them through
`autograd.rotate_qk`, whose backward keeps only the rotated output.

Rotations that depend on the batch (training-time position jitter) are built on the first ``qk``
call of a forward, once the batch size is known (`LazyRotations`), and then shared by every layer.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Tuple, Union

import torch

from .._dtypes import compute_dtype
from ..encodings.base import PEContext, PositionalEncoding
from ..positions import Positions
from .autograd import angle_tables, rotate_qk
from .expm import Rotations

__all__ = ['RotationPE', 'RotationState', 'LazyRotations', 'check_axes', 'check_head_dim', 'heads_and_layers',
           'require_divisible', 'token_grid']

Layers = Tuple[Any, ...]  # one entry per layer (or one shared by all): a tensor, or a tuple for multi-parameter kinds


class RotationState(NamedTuple):
    """One forward's rotations: ``kind`` (how they are applied) and per-layer rotations of the
    queries and of the keys (``k is q`` in self-attention)."""
    kind: str
    q: Layers
    k: Layers

    def layer(self, layer: int) -> Tuple[Any, Any]:
        """The rotations of q and k in attention layer ``layer`` (entry 0 when shared by all layers)."""
        return self.q[layer if len(self.q) > 1 else 0], self.k[layer if len(self.k) > 1 else 0]


class LazyRotations:
    """Rotations whose shape depends on the batch (per-sample jitter): built on the first ``qk`` call
    of a forward, from the batch size it sees, then shared by every later layer of that forward."""

    def __init__(self, build: Callable[[int], RotationState]) -> None:
        self._build = build
        self._state: Optional[RotationState] = None

    def get(self, batch: int) -> RotationState:
        if self._state is None:
            self._state = self._build(batch)
        return self._state


class RotationPE(PositionalEncoding):
    """Base of the encodings that rotate q and k by per-position rotations shared by the batch.

    Subclasses implement `rotation(pos, batch)`: the rotations of one token set (prefix rows
    included) as a tensor ``(L', [B,] H', N_total, ...)`` or a sequence of its ``L'`` layer slices
    (per-layer tensors: indexing a layer of one tensor would make its backward build a full-size
    gradient for every layer); ``batch`` is given only when `per_sample` is true. ``rotation_kind``
    names how they are applied (`autograd.KINDS`), ``rotation_block`` the FFT block of kind
    ``fourier``. Angles (kinds ``pair``, ``fourier``) become their complex tables in eval.
    """
    shift_invariant = True
    rotation_kind: str = 'block'
    rotation_block: int = 0

    def per_sample(self, pos: Positions) -> bool:
        """True when this forward's rotations of ``pos`` differ between samples (training-time jitter)."""
        return False

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> Rotations:
        raise NotImplementedError

    def compute_dtype(self) -> torch.dtype:
        """float32 for float32 / half parameters, float64 for float64 ones (exactness tests)."""
        p = next(self.parameters(), None)
        return compute_dtype(p) if p is not None else torch.float32

    def _layers(self, pos: Positions, batch: Optional[int]) -> Layers:
        rot = self.rotation(pos, batch)
        layers = rot.unbind(0) if torch.is_tensor(rot) else tuple(rot)
        return angle_tables(layers) if self.rotation_kind in ('pair', 'fourier') else layers

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> Union[RotationState, LazyRotations]:
        def build(batch: Optional[int]) -> RotationState:
            rq = self._layers(pos_q, batch)
            return RotationState(self.rotation_kind, rq, rq if pos_k is None else self._layers(pos_k, batch))

        if self.per_sample(pos_q) or (pos_k is not None and self.per_sample(pos_k)):
            return LazyRotations(build)
        return build(None)

    @staticmethod
    def layer_state(state: Union[RotationState, LazyRotations], batch: int) -> RotationState:
        """This forward's `RotationState` (built now for a batch of ``batch`` if it is lazy)."""
        return state.get(batch) if isinstance(state, LazyRotations) else state

    def qk(self, q, k, state, layer, x=None):
        state = self.layer_state(state, q.shape[0])
        rq, rk = state.layer(layer)
        return rotate_qk(q, k, rq, rk, state.kind, self.rotation_block)


def heads_and_layers(ctx: PEContext, per_layer: bool, per_head: bool = True) -> Tuple[int, int]:
    """Leading dims ``(L', H')`` of per-layer / per-head parameters."""
    return (ctx.depth if per_layer else 1), (ctx.num_heads if per_head else 1)


def require_divisible(name: str, head_dim: int, block: int, option: str = 'block') -> int:
    """``head_dim // block``, or a clear error naming the option when ``block`` does not divide it."""
    if block < 1:
        raise ValueError(f'option {option} of encoding {name!r} must be >= 1, got {block}')
    if head_dim % block:
        raise ValueError(f'encoding {name!r} needs head_dim divisible by {option}={block}, got head_dim={head_dim}')
    return head_dim // block


def check_head_dim(name: str, head_dim: int, multiple: int, why: str) -> None:
    """Raise a clear error when an encoding cannot use ``head_dim``."""
    if head_dim % multiple:
        raise ValueError(f'encoding {name!r} needs head_dim divisible by {multiple} ({why}), got head_dim={head_dim}')


def token_grid(pos: Positions) -> Optional[Tuple[int, ...]]:
    """The grid the (non-prefix) coordinates index: ``pos.grid``; after token selection (patch dropout
    keeps integer indices but drops the grid) the training grid; None for point sets."""
    if pos.grid is not None:
        return pos.grid
    return pos.train_grid


def check_axes(name: str, coords: torch.Tensor, num_axes: int) -> None:
    """Raise a clear error when positions have another number of axes than the encoding was built for."""
    if coords.shape[-1] != num_axes:
        raise ValueError(f'encoding {name!r} was built for {num_axes} coordinate axes (option num_axes), '
                         f'positions have {coords.shape[-1]}')
