"""`RotationPE`: the one base of the rotary encodings (RoPE, LieRE, ComRoPE, STRING, GTA, PRoPE).

A rotary encoding maps q and k (GTA and PRoPE also v and the attention output) by per-position
rotations that depend on positions and parameters only. The base builds them once per forward for
every layer (`prepare`, cached in eval by `PositionalEncoding`) as a `RotationState`: the kind of
rotation (a name in `autograd.KINDS`) and per-layer rotations of the queries and of the keys, the
same objects in self-attention, so that q and k are rotated in one call. Subclasses say how to
build one token set's rotations (`rotation`); the ``qk`` hook applies them through
`autograd.rotate_qk`, whose backward keeps only the rotated output.

Rotations that depend on the batch (training-time position jitter) are built on the first ``qk``
call of a forward, once the batch size is known (`LazyRotations`), and then shared by every layer;
what they draw (the jittered positions) is kept there too, so that another hook of the same forward
(ComRoPE's absolute table, in ``embed``) reads the same draw: it travels in the prepared state, never
in the module.

Native-resolution (NaFlex) batches (`Positions.grids`: one grid per sample, padded): when every
sample has the same grid, the rotations are that grid's, shared by the batch as in a plain batch,
with identity rows for the padding tokens; with several grids, per-sample rotations
``(L', B, H', N, ...)``, either from per-sample coordinates (the subclass's `rotation` of the whole
batch) or, where a grid's rotations depend on more than each token's coordinates (a grid-wide
squaring count, a factorised grid path: `RotationPE.per_grid`), built for each distinct grid as
for that grid alone and gathered per sample. Padding tokens get the identity; the host masks them
as keys.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, NamedTuple, Optional, Tuple, Union

import torch

from .._dtypes import compute_dtype
from ..contract import PEContext, PositionalEncoding
from ..positions import Positions
from .autograd import angle_tables, rotate_qk
from .expm import Rotations
from .kernels import pad_identity

__all__ = ['RotationPE', 'RotationState', 'LazyRotations', 'check_axes', 'check_head_dim', 'heads_and_layers',
           'require_divisible', 'shared_sample_grid', 'token_grid', 'pad_tokens']

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
    of a forward, from the batch size it sees, then shared by every later layer of that forward; and
    the values drawn for them (`draw`), shared with the forward's other hooks."""

    def __init__(self, build: Callable[[int, 'LazyRotations'], RotationState]) -> None:
        self._build = build
        self._state: Optional[RotationState] = None
        self._draws: Dict[Hashable, Any] = {}

    def get(self, batch: int) -> RotationState:
        if self._state is None:
            self._state = self._build(batch, self)
        return self._state

    def draw(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """``make()``'s value for ``key``, drawn once in this forward."""
        if key not in self._draws:
            self._draws[key] = make()
        return self._draws[key]


class RotationPE(PositionalEncoding):
    """Base of the encodings that rotate q and k by per-position rotations shared by the batch.

    Subclasses implement `rotation(pos, batch)`: the rotations of one token set (prefix rows
    included) as a tensor ``(L', [B,] H', N_total, ...)`` or a sequence of its ``L'`` layer slices
    (per-layer tensors: indexing a layer of one tensor would make its backward build a full-size
    gradient for every layer); ``batch`` is given only when `per_sample` is true. ``rotation_kind``
    names how they are applied (`autograd.KINDS`), ``rotation_block`` the FFT block of kind
    ``fourier``. Angles (kinds ``pair``, ``fourier``) become their complex tables in eval. `rotation`
    handles NaFlex batches (per-sample coordinates) unless `per_grid` says otherwise.
    """
    shift_invariant = True
    rotation_kind: str = 'block'
    rotation_block: int = 0

    def per_sample(self, pos: Positions) -> bool:
        """True when this forward's rotations of ``pos`` differ between samples (training-time jitter)."""
        return False

    def rotation(self, pos: Positions, batch: Optional[int] = None, draws: Optional[LazyRotations] = None
                 ) -> Rotations:
        """The rotations of ``pos``; per sample for a batch of ``batch`` (when `per_sample`), their random
        parts drawn through ``draws`` (this forward's `LazyRotations`)."""
        raise NotImplementedError

    def per_grid(self) -> bool:
        """True when a NaFlex batch of several grids gets each distinct grid's rotations built as for that
        grid alone (then gathered per sample) rather than `rotation` of the whole batch: for rotations
        whose rounding depends on the other samples (a squaring count, a product's blocking)."""
        return False

    def compute_dtype(self) -> torch.dtype:
        """float32 for float32 / half parameters, float64 for float64 ones (exactness tests)."""
        p = next(self.parameters(), None)
        return compute_dtype(p) if p is not None else torch.float32

    def _layers(self, pos: Positions, batch: Optional[int], draws: Optional[LazyRotations] = None) -> Layers:
        if pos.grids is not None and batch is None:
            shared = shared_sample_grid(pos)
            if shared is not None:  # one grid: its rotations, shared by the batch, padding rows identity
                layers = pad_tokens(self._rotation_layers(shared, None), pos.num_tokens, self.rotation_kind)
                return self._angle_tables(layers)
            if self.per_grid():
                return self._angle_tables(self._per_grid_layers(pos))
        return self._angle_tables(self._rotation_layers(pos, batch, draws))

    def _rotation_layers(self, pos: Positions, batch: Optional[int], draws: Optional[LazyRotations] = None
                         ) -> Layers:
        rot = self.rotation(pos, batch) if draws is None else self.rotation(pos, batch, draws)
        return rot.unbind(0) if torch.is_tensor(rot) else tuple(rot)

    def _angle_tables(self, layers: Layers) -> Layers:
        return angle_tables(layers) if self.rotation_kind in ('pair', 'fourier') else layers

    def _per_grid_layers(self, pos: Positions) -> Layers:
        """Per-sample rotations ``(B, H', N_total, ...)`` per layer of a NaFlex batch: each distinct
        grid's rotations built as for that grid alone, padded with identity rows and gathered per sample
        (block kinds laid out position-major, as q and k lie in attention)."""
        first = {}  # grid -> its group number
        group = [first.setdefault(g, len(first)) for g in pos.grids]
        samples = {g: pos.sample(pos.grids.index(g)) for g in first}
        per_grid = [self._rotation_layers(samples[g], None) for g in first]
        index = torch.tensor(group, device=pos.device)
        block = self.rotation_kind in ('block', 'matrix')
        token_axis = -4 if block else -2
        layers = []
        for parts in zip(*per_grid):
            parts = pad_tokens(parts, pos.num_tokens, self.rotation_kind)
            # ([H',] N, ...) -> (H', N, ...): a head axis to broadcast over, the batch goes before it
            parts = [p if p.dim() > -token_axis else p.unsqueeze(0) for p in parts]
            if block:  # (G, N, H', nb, b, b) -> (B, H', N, nb, b, b), position-major
                layers.append(torch.stack([p.movedim(-4, 0) for p in parts]).index_select(0, index).movedim(1, -4))
            else:
                layers.append(torch.stack(parts).index_select(0, index))
        return tuple(layers)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> Union[RotationState, LazyRotations]:
        def build(batch: Optional[int], draws: Optional[LazyRotations] = None) -> RotationState:
            rq = self._layers(pos_q, batch, draws)
            return RotationState(self.rotation_kind, rq, rq if pos_k is None else self._layers(pos_k, batch, draws))

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


def shared_sample_grid(pos: Positions) -> Optional[Positions]:
    """In a NaFlex batch whose samples all have the same grid: that grid's positions alone (every sample
    then has the same rotations, only the padding differs); else None."""
    if pos.grids is None or any(g != pos.grids[0] for g in pos.grids):
        return None
    return pos.sample(0)


def pad_tokens(layers: Layers, num_tokens: int, kind: str) -> Layers:
    """Per-layer rotations of ``N_total`` tokens with identity rows appended up to ``num_tokens`` (the
    padding tokens of a NaFlex batch)."""
    axis = -4 if kind in ('block', 'matrix') else -2
    return tuple(pad_identity(r, 0, kind, after=num_tokens - r.shape[axis]) for r in layers)


def token_grid(pos: Positions) -> Optional[Tuple[int, ...]]:
    """The grid the (non-prefix) coordinates index: `Positions.index_grid` (also after token selection),
    else the training grid; None for point sets without one. A NaFlex batch has one grid per sample
    instead (`Positions.index_grids`): callers handle those first."""
    return pos.index_grid or pos.train_grid


def check_axes(name: str, coords: torch.Tensor, num_axes: int) -> None:
    """Raise a clear error when positions have another number of axes than the encoding was built for."""
    if coords.shape[-1] != num_axes:
        raise ValueError(f'encoding {name!r} was built for {num_axes} coordinate axes (option num_axes), '
                         f'positions have {coords.shape[-1]}')
