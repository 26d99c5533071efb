"""The encoding contract: one base class, a few hooks, composition, the per-forward object.

An encoding answers *how position enters the network*. It acts by overriding hooks and declares
once what it does (`Capabilities`); the host (the ViT, DETR, a user's model) asks those names.
Once per forward the host calls ``pe.prepare(pos_q, pos_k)``: the `PreparedPE` it returns knows the
encoding, the positions and the state built from them (shared by every layer) and offers the hooks
by name (``prepared.embed(x)``, ``prepared.qk(q, k, layer)``, ...), so blocks take that one object and
`vispe.pe_attention` applies every attention hook around SDPA. Encodings implement the hooks with
the state as an argument (``qk(q, k, state, layer)``); hosts call them through the prepared object.

Hook shapes: ``x`` tokens ``(B, N, C)`` (prefix tokens first); ``q, k, v`` ``(B, H, N, hd)``;
``bias`` returns an additive logit term ``(B | 1, H | 1, Nq, Nk)`` already in logit units (added
after ``q.k * scale``).
"""
from __future__ import annotations

import contextlib
import functools
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, FrozenSet, List, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch import nn

from ._cache import TensorCache
from ._compiled_state import compiled_eval_state, register as register_compiled
from ._dtypes import autocast_off
from ._tracing import is_tracing
from .options import check_arguments
from .positions import Positions

__all__ = ['PEContext', 'PositionalEncoding', 'ComposedPE', 'PreparedPE', 'Capabilities', 'TensorCache', 'HOOKS',
           'ATTENTION_HOOKS', 'resolve_num_axes', 'autocast_off', 'build_with_factory_kwargs']

HOOKS = ('embed', 'between_blocks', 'qk', 'bias', 'value', 'output', 'weights_value')
ATTENTION_HOOKS = frozenset({'qk', 'bias', 'value', 'output', 'weights_value'})
_PAIR_TERMS = frozenset({'bias', 'weights_value'})  # a term per query-key pair: no mask-free SDPA
STATE_CACHE_SIZE = 2  # eval states kept per encoding (position sets of one forward)


@dataclass(frozen=True)
class Capabilities:
    """What an encoding does, declared once per instance. Hosts and the attention dispatch ask these
    names instead of inspecting hooks or classes.

    Attributes:
        hooks: the hooks the encoding runs (its overridden hooks minus those its options switch off).
        additive: adds an embedding to the tokens (``embed`` / ``embedding``).
        between_blocks: acts on the tokens after each block.
        in_attention: acts inside attention (any of q/k maps, bias, value, output, weights terms).
        needs_query_positions: adds a term of its own per query-key pair (a logit bias, a weights
            term), a function of their offset that means nothing for queries without positions: a
            cross-attention host must give the queries real positions (DETR keeps such an encoding to
            encoder self-attention). Maps of q, k, v and the output take queries placed at the origin
            (a rotation there is the identity).
        needs_tokens: ``qk`` reads the attention's normed input tokens ``x``.
        needs_weights: adds a term computed from the attention weights (explicit softmax path only).
        changes_head_dim: ``qk`` returns wider q/k (and ``value`` pads v to the same width).
        requires: `Positions` fields beyond coordinates that it reads (e.g. ``'cameras'``).
        flash_kernels: the flash / memory-efficient kernels take what the encoding makes of q, k and v
            (an encoding says False for a head width they do not take).
        flash_eligible: attention can stay on SDPA without a mask (flash / memory-efficient kernels):
            ``flash_kernels`` and neither a bias nor a weights term.
    """
    hooks: FrozenSet[str]
    needs_tokens: bool = False
    changes_head_dim: bool = False
    requires: FrozenSet[str] = frozenset()
    flash_kernels: bool = True
    additive: bool = field(init=False)
    between_blocks: bool = field(init=False)
    in_attention: bool = field(init=False)
    needs_query_positions: bool = field(init=False)
    needs_weights: bool = field(init=False)
    flash_eligible: bool = field(init=False)

    def __post_init__(self) -> None:
        hooks = frozenset(self.hooks)
        unknown = hooks - set(HOOKS)
        if unknown:
            raise ValueError(f'unknown hooks {sorted(unknown)}; hooks are {HOOKS}')
        derived = dict(
            hooks=hooks, additive='embed' in hooks, between_blocks='between_blocks' in hooks,
            in_attention=bool(hooks & ATTENTION_HOOKS), needs_query_positions=bool(hooks & _PAIR_TERMS),
            needs_weights='weights_value' in hooks,
            flash_eligible=bool(self.flash_kernels) and not hooks & _PAIR_TERMS, requires=frozenset(self.requires))
        for name, value in derived.items():
            object.__setattr__(self, name, value)

    def __or__(self, other: 'Capabilities') -> 'Capabilities':
        """The capabilities of two encodings acting together."""
        return Capabilities(self.hooks | other.hooks, self.needs_tokens or other.needs_tokens,
                            self.changes_head_dim or other.changes_head_dim, self.requires | other.requires,
                            self.flash_kernels and other.flash_kernels)


@dataclass(frozen=True)
class PEContext:
    """What an encoding needs to know about its host to build its parameters.

    Attributes:
        dim: token width C.
        num_heads: attention heads H.
        head_dim: per-head width (defaults to ``dim // num_heads``).
        depth: number of attention layers L (per-layer parameters are allocated for each).
        grid_size: training token grid (``(h, w)`` or ``(t, h, w)``), when the host has one.
        num_prefix_tokens: class / register tokens before the grid tokens.
        embed_prefix: whether absolute tables have entries for prefix tokens (timm's
            ``not no_embed_class``).
        num_axes: coordinate axes of the positions the host supplies, when it has no grid (3 for
            NeRF's points); default: the grid's axes, else 2.
        coordinate_map: the host uses the encoding as a map ``encode(coords) -> features`` and has no
            tokens to add them to, so nothing is projected to the token width ``dim``.
    """
    dim: int
    num_heads: int = 1
    head_dim: Optional[int] = None
    depth: int = 1
    grid_size: Optional[Tuple[int, ...]] = None
    num_prefix_tokens: int = 0
    embed_prefix: bool = True
    num_axes: Optional[int] = None
    coordinate_map: bool = False

    def __post_init__(self) -> None:
        for name, least in (('dim', 1), ('num_heads', 1), ('head_dim', 1), ('depth', 0), ('num_prefix_tokens', 0),
                            ('num_axes', 1)):
            value = getattr(self, name)
            if value is None and name in ('head_dim', 'num_axes'):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise ValueError(f'PEContext.{name} must be an integer >= {least}, got {value!r}')
        if self.head_dim is None:
            if self.dim % self.num_heads:
                raise ValueError(f'dim={self.dim} is not divisible by num_heads={self.num_heads}; pass head_dim')
            object.__setattr__(self, 'head_dim', self.dim // self.num_heads)
        if self.grid_size is not None:
            grid = tuple(self.grid_size)
            if not grid or any(isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1 for g in grid):
                raise ValueError(f'PEContext.grid_size must be positive integers, one per axis, got {grid!r}')
            object.__setattr__(self, 'grid_size', tuple(int(g) for g in grid))

    @property
    def host_axes(self) -> Optional[int]:
        """The coordinate axes of the positions the host supplies, where it fixes them: ``num_axes``, else
        its grid's; None when only the positions will tell."""
        if self.num_axes is not None:
            return self.num_axes
        return len(self.grid_size) if self.grid_size else None


def resolve_num_axes(ctx: PEContext, num_axes: Optional[int], name: str, option: str = 'num_axes') -> int:
    """Coordinate axes D: the option, else the host's (``ctx.num_axes``), else its grid's, else 2. An
    option that contradicts the host's axes is refused when the encoding is built, not at its first
    forward."""
    host = ctx.host_axes
    if num_axes is not None:
        if num_axes < 1:
            raise ValueError(f'option {option} of encoding {name!r} must be >= 1, got {num_axes}')
        if host is not None and num_axes != host:
            where = f'num_axes={ctx.num_axes}' if ctx.num_axes is not None else f'grid {ctx.grid_size}'
            raise ValueError(f'option {option}={num_axes} of encoding {name!r} does not match the host, whose '
                             f'positions have {host} coordinate axes ({where}); leave {option} out to follow the host')
        return num_axes
    return 2 if host is None else host


class PositionalEncoding(nn.Module):
    """Base class of every vispe encoding.

    Subclasses override the hooks they use (the others are identities) and describe themselves
    with class attributes, which the registry and the encoding table (python -m vispe) read:

    * ``shift_invariant``: True if attention logits depend only on position differences, False if
      not, None when the notion does not apply (absolute encodings);
    * ``larger_input``: ``'extrapolate'``, ``'interpolate'``, ``'resample'`` or ``'n/a'``;
    * ``paper``: the reference, ``needs_tokens``: ``qk`` wants the normed attention input,
      ``changes_head_dim``: ``qk`` returns wider q/k (and ``value`` pads v to the same width);
    * ``requires``: `Positions` fields beyond coordinates that the encoding reads (e.g.
      ``'cameras'``); a plain image ViT supplies none of them;
    * ``float32_buffers``: names (dotted for submodules) of fixed buffers that positions multiply
      (frequency tables, slopes, projections): they stay float32 (float64 stays float64) when the module
      is cast to half precision (`_apply`), so the angles and biases built from them keep float32's
      precision; learned parameters follow the module's dtype (autocast keeps them float32).

    State that depends only on positions and parameters is built in `_prepare` once per forward
    and shared by all layers; `prepare` wraps it in a `PreparedPE` and caches it in eval mode under
    ``no_grad`` while the positions and the parameters and buffers (the same tensors, unchanged) are
    the same (inference-mode state apart), for the two most recent position sets (a host may prepare
    two per forward: ViTDet's whole grid and its windows). Traced, nothing is cached; but a compiled eval forward of an
    encoding with ``cache_compiled_state`` (a state costly to build) takes it from this cache when the
    graph runs (`vispe._compiled_state`). Tensors an encoding reuses across forwards (tables per grid, bucket
    ids) go through its `tensor_cache`; both caches are cleared together by `clear_cache` (mode,
    device, dtype or grid changes, re-initialisation).

    Initialisation has one definition, the constructor: `reset_parameters` (called by the ViT's
    ``init_weights``, e.g. after building on the meta device and ``to_empty``) builds a fresh twin
    from the arguments this encoding was constructed with and copies its tensors in, so every
    parameter and buffer gets exactly what construction gives it (the same values for the same
    random state). `init_non_persistent_buffers` does this for the buffers that checkpoints do
    not hold, leaving parameters and the random state alone.
    """
    shift_invariant: ClassVar[Optional[bool]] = None
    larger_input: ClassVar[str] = 'n/a'
    paper: ClassVar[str] = ''
    needs_tokens: ClassVar[bool] = False
    changes_head_dim: ClassVar[bool] = False
    requires: ClassVar[FrozenSet[str]] = frozenset()
    name: ClassVar[str] = ''
    cache_compiled_state: ClassVar[bool] = False
    renamed_options: ClassVar[Dict[str, str]] = {}  # old option name -> new, read with a DeprecationWarning by specs
    float32_buffers: ClassVar[FrozenSet[str]] = frozenset()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in HOOKS:
            if hook in cls.__dict__:
                setattr(cls, hook, _honour_capabilities(hook, cls.__dict__[hook]))

    def __new__(cls, *args: Any, **kwargs: Any) -> 'PositionalEncoding':
        # options are checked against the constructor's typed signature (signature cached per class),
        # so `IRPE(ctx, method='x')` fails as `create_pe('irpe:method=x')` does, before any work
        check_arguments(cls, args[1:], kwargs, f'encoding {cls.name or cls.__name__!r}', skip=2)
        self = super().__new__(cls)
        # the constructor's arguments, from which `reset_parameters` builds a fresh twin
        object.__setattr__(self, '_init_args', (args, kwargs))
        register_compiled(self)
        return self

    def __init__(self, ctx: PEContext) -> None:
        super().__init__()
        self.ctx = ctx
        self._state_cache: List[Tuple[Positions, Optional[Positions], tuple, Any]] = []  # most recent last
        self.tensor_cache = TensorCache()

    # ----------------------------------------------------------------- description
    @property
    def capabilities(self) -> Capabilities:
        """What this encoding does (`Capabilities`): declared once, on first read (hosts read it when
        they are built), and fixed from then on, as the options it depends on are."""
        caps = self.__dict__.get('_capabilities')
        if caps is None:
            caps = self._declare_capabilities()
            self.__dict__['_capabilities'] = caps
        return caps

    def _declare_capabilities(self) -> Capabilities:
        """The hooks this class overrides and its class-level declarations. An encoding whose options
        switch a part off (or make q, k, v the flash kernels do not take) overrides this, e.g. with
        ``dataclasses.replace(super()._declare_capabilities(), hooks=...)`` (``flash_kernels=False``)."""
        implemented = frozenset(h for h in HOOKS if getattr(type(self), h) is not getattr(PositionalEncoding, h))
        return Capabilities(implemented, needs_tokens=self.needs_tokens, changes_head_dim=self.changes_head_dim,
                            requires=self.requires)

    @property
    def hooks(self) -> FrozenSet[str]:
        """Names of the hooks this encoding runs (``capabilities.hooks``)."""
        return self.capabilities.hooks

    @property
    def flash_eligible(self) -> bool:
        """True when attention can stay on SDPA without a mask (``capabilities.flash_eligible``)."""
        return self.capabilities.flash_eligible

    def no_weight_decay(self) -> set:
        """Names (relative to this module) of parameters that must not be weight-decayed."""
        return set()

    def adopt_pos_embed(self, table: torch.Tensor, num_prefix: int, grid: Tuple[int, ...]
                        ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
        """Take over a checkpoint's absolute position table (timm's ``pos_embed``).

        ``table`` is ``(1, num_prefix + prod(grid), C)``: ``num_prefix`` rows for prefix tokens first,
        then the rows of ``grid`` in row-major order. Returns the state-dict entries (names relative to
        this encoding) the table fills, adapted to this encoding's grid, and the names among them
        that were resampled. The default takes nothing: the host reports the table as dropped.
        """
        return {}, []

    def adopt_timm_rope(self, rope: nn.Module) -> Dict[str, torch.Tensor]:
        """Take over a timm rope module's learned weights (e.g. RoPE-Mixed's ``freqs``): the state-dict
        entries (names relative to this encoding) it fills. The default takes nothing."""
        return {}

    # ----------------------------------------------------------------- state
    def prepare(self, pos_q: Positions, pos_k: Optional[Positions] = None) -> 'PreparedPE':
        """This encoding prepared for one forward over tokens at ``pos_q`` (queries) and ``pos_k`` (keys;
        default: self-attention, the queries'): the `PreparedPE` every hook of the forward goes through."""
        return PreparedPE(self, pos_q, pos_k, self.prepared_state(pos_q, pos_k))

    def prepared_state(self, pos_q: Positions, pos_k: Optional[Positions] = None) -> Any:
        """`_prepare`'s state for these positions, cached in eval mode under ``no_grad`` (not while
        traced; inference-mode state apart) while the positions and parameters are unchanged, for the
        `STATE_CACHE_SIZE` most recently used position sets."""
        eval_no_grad = not self.training and not torch.is_grad_enabled()
        if eval_no_grad and self.cache_compiled_state and torch.compiler.is_compiling() \
                and not torch.compiler.is_exporting():
            return compiled_eval_state(self, pos_q, pos_k)
        if not eval_no_grad or is_tracing():
            return self._full_precision_prepare(pos_q, pos_k)
        # the tensors themselves (kept, so their ids stay theirs) and their versions: in-place updates and
        # tensors swapped in (`torch.func.functional_call`) both rebuild
        tensors = tuple(self.parameters()) + tuple(self.buffers())
        versions = (tensors, tuple(t._version for t in tensors), torch.is_inference_mode_enabled())
        for i, (cq, ck, cv, state) in enumerate(self._state_cache):
            if _same_tensors(cv, versions) and cq.same_as(pos_q) and (
                    (ck is None and pos_k is None) or (ck is not None and pos_k is not None and ck.same_as(pos_k))):
                self._state_cache.append(self._state_cache.pop(i))
                return state
        state = self._full_precision_prepare(pos_q, pos_k)
        # a few entries, most recently used kept: hosts that prepare two position sets per forward (ViTDet's
        # global and windowed blocks) would otherwise evict one with the other and rebuild both every time
        self._state_cache = (self._state_cache + [(pos_q, pos_k, versions, state)])[-STATE_CACHE_SIZE:]
        return state

    def _full_precision_prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> Any:
        # state is built from positions and parameters in their own precision: under autocast the
        # matrix products here (rotation exponentials, camera geometry) would otherwise run in bf16
        with autocast_off(pos_q.coords.device):
            return self._prepare(pos_q, pos_k)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> Any:
        return None

    def clear_cache(self) -> None:
        """Forget the cached state and tensors (they depend on the mode, device, dtype, grid and values)."""
        self._state_cache = []
        self.tensor_cache.clear()

    def train(self, mode: bool = True) -> 'PositionalEncoding':
        self.clear_cache()
        return super().train(mode)

    def _apply(self, fn, recurse=True):
        self.clear_cache()
        tables = [(owner, leaf, owner._buffers[leaf]) for owner, leaf in map(self._buffer_owner, self.float32_buffers)
                  if owner is not None and owner._buffers.get(leaf) is not None]
        module = super()._apply(fn, recurse)
        # a fixed table cast to bf16 turns a position p into a phase off by up to p * 2^-9 of its own: keep
        # the table as it was, on the new device
        for owner, leaf, before in tables:
            after = owner._buffers[leaf]
            if after.dtype in (torch.float16, torch.bfloat16) and after.dtype != before.dtype:
                owner._buffers[leaf] = before.to(after.device)
        return module

    def _buffer_owner(self, name: str) -> Tuple[Optional[nn.Module], str]:
        """The module holding buffer ``name`` of `float32_buffers` (None where an option leaves it out)."""
        prefix, _, leaf = name.rpartition('.')
        try:
            return (self.get_submodule(prefix) if prefix else self), leaf
        except AttributeError:
            return None, leaf

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        """Adapt grid-shaped parameters to a new training grid (``set_input_size``)."""
        self.ctx = PEContext(**{**self.ctx.__dict__, 'grid_size': tuple(grid_size)})
        self.clear_cache()

    # ----------------------------------------------------------------- initialisation
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Initialise every parameter and buffer as construction does (timm's ``reset_parameters``)."""
        fresh = self._twin()
        self._copy_from(dict(fresh.named_parameters()) | dict(fresh.named_buffers()))

    @torch.no_grad()
    def init_non_persistent_buffers(self) -> None:
        """Recompute the buffers that are not saved in checkpoints (e.g. after ``to_empty`` and loading
        a state dict); parameters, saved buffers and the random state stay as they are."""
        with torch.random.fork_rng(devices=[]):
            fresh = self._twin()
        self._copy_from({
            f'{prefix}.{name}' if prefix else name: buf
            for prefix, module in fresh.named_modules() for name, buf in module.named_buffers(recurse=False)
            if name in module._non_persistent_buffers_set})

    def _twin(self) -> 'PositionalEncoding':
        """A newly constructed encoding with this one's class, arguments and current context, on the
        meta device if this one is there, else on the CPU (its values are copied over)."""
        args, kwargs = self._init_args
        if args:
            args = (self.ctx,) + tuple(args[1:])
        else:
            kwargs = {**kwargs, 'ctx': self.ctx}
        meta = any(t.is_meta for t in self.parameters()) or any(t.is_meta for t in self.buffers())
        with torch.device('meta' if meta else 'cpu'):
            return type(self)(*args, **kwargs)

    def _copy_from(self, tensors: Dict[str, torch.Tensor]) -> None:
        own = dict(self.named_parameters()) | dict(self.named_buffers())
        for name, value in tensors.items():
            _copy_into(own[name], value)
        self.clear_cache()

    # ----------------------------------------------------------------- hooks
    def embedding(self, pos: Positions) -> torch.Tensor:
        """Additive embedding ``(N_total, C)`` or ``(B, N_total, C)`` for the tokens of ``pos``."""
        raise NotImplementedError(f'{type(self).__name__} is not an additive encoding')

    def embed(self, x: torch.Tensor, pos: Positions, state: Any = None) -> torch.Tensor:
        """Once, on the token sequence: ``x + embedding(pos)``. ``state`` is this forward's prepared
        state (None when called directly): an encoding whose table follows its rotations' positions
        (ComRoPE's absolute table at the training jitter) reads them there."""
        return x

    def between_blocks(self, x: torch.Tensor, pos: Positions, index: int) -> torch.Tensor:
        """After block ``index``."""
        return x

    def qk(self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int,
           x: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Each attention: map q and k (``x`` is the attention's input, for token-conditioned maps)."""
        return q, k

    def bias(self, q: torch.Tensor, k: torch.Tensor, state: Any, layer: int) -> Optional[torch.Tensor]:
        """Each attention: an additive logit term in logit units."""
        return None

    def score_mod(self, state: Any, layer: int, dtype: torch.dtype) -> Optional[Callable[..., torch.Tensor]]:
        """The logit bias of layer ``layer`` as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``
        (the bias added to the scaled logit ``score``, masked entries at ``dtype``'s lowest value), or None
        (the default): `vispe.pe_attention` then adds the dense `bias`. An encoding offers it where it can
        compute one logit's bias from its prepared state without the ``N x N`` tensor; it must equal
        `bias`."""
        return None

    def value(self, v: torch.Tensor, state: Any, layer: int) -> torch.Tensor:
        """Each attention: map v before attention."""
        return v

    def output(self, o: torch.Tensor, state: Any, layer: int) -> torch.Tensor:
        """Each attention: map the per-head output ``(B, H, Nq, hd)`` before the heads merge."""
        return o

    def weights_value(self, attn: torch.Tensor, state: Any, layer: int) -> Optional[torch.Tensor]:
        """Each attention, explicit path only: a term added to the output from the weights ``attn``
        (None where the encoding's options switch this term off)."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        return self.name


def _copy_into(target: torch.Tensor, value: torch.Tensor) -> None:
    """``target.copy_(value)`` for a full (unsharded) ``value``, also where ``target`` is a distributed
    tensor (a parameter that FSDP2's ``fully_shard`` or tensor parallelism has sharded): ``value`` is laid
    out as ``target`` (rank 0's copy, scattered over the mesh), so every rank's shard is the
    corresponding slice of one construction, and sharded and unsharded builds hold the same tensor."""
    if _is_dtensor(target):
        from torch.distributed.tensor import distribute_tensor
        value = distribute_tensor(value.to(target.dtype), target.device_mesh, target.placements)
    target.copy_(value)


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


# what a hook that an encoding's options switch off returns: its input unchanged, or no term
_IDENTITY: Dict[str, Callable[..., Any]] = {
    'embed': lambda x, *rest, **kw: x,
    'between_blocks': lambda x, *rest, **kw: x,
    'qk': lambda q, k, *rest, **kw: (q, k),
    'bias': lambda *args, **kw: None,
    'value': lambda v, *rest, **kw: v,
    'output': lambda o, *rest, **kw: o,
    'weights_value': lambda *args, **kw: None,
}


def _honour_capabilities(hook: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a subclass's hook) that does nothing when the encoding's options switch the hook off
    (it is missing from ``capabilities.hooks``), however it is reached: through attention, a
    composition or a direct call. The one place that makes declared capabilities binding."""
    identity = _IDENTITY[hook]

    @functools.wraps(fn)
    def hook_method(self: 'PositionalEncoding', *args: Any, **kwargs: Any) -> Any:
        if hook not in self.capabilities.hooks:
            return identity(*args, **kwargs)
        return fn(self, *args, **kwargs)
    return hook_method


M = TypeVar('M', bound=nn.Module)


def build_with_factory_kwargs(build: Callable[[], M], device: Optional[Union[str, torch.device]] = None,
                              dtype: Optional[torch.dtype] = None) -> M:
    """``build()`` with timm's factory kwargs: on the meta device it is built there directly (nothing
    is allocated; ``reset_parameters`` initialises it after ``to_empty``); otherwise it is built, then
    moved to ``device`` and its floating-point tensors cast to ``dtype``, as `nn.Module.to` does.
    Encodings compute their angles, phases and exponentials in float32 whatever their dtype."""
    device = torch.device(device) if device is not None else None
    with device if device is not None and device.type == 'meta' else contextlib.nullcontext():
        module = build()
    return module.to(device=device, dtype=dtype) if device is not None or dtype is not None else module


class ComposedPE(PositionalEncoding):
    """Several encodings acting together (``'rope_mixed+learned'``): every hook of each one runs.

    Embeddings add, q/k and value maps chain in order, biases add, output maps chain in reverse
    order (so a value transform and its output inverse nest correctly). An encoding that widens q,
    k and v (``changes_head_dim``: PaPE appends its position channels) maps them after the others,
    whose maps and biases are defined on the head width, and biases read the original channels.
    """

    def __init__(self, ctx: PEContext, encodings: Sequence[PositionalEncoding]) -> None:
        super().__init__(ctx)
        self.encodings = nn.ModuleList(encodings)
        self.name = '+'.join(e.name for e in encodings)
        # the execution order of the q/k and value maps (output maps run it backwards); the module
        # list keeps the spec's order, which names the parameters
        self._order = sorted(range(len(encodings)), key=lambda i: encodings[i].capabilities.changes_head_dim)

    def _declare_capabilities(self) -> Capabilities:
        caps = Capabilities(frozenset())
        for e in self.encodings:
            caps = caps | e.capabilities
        return caps

    def reset_parameters(self) -> None:
        for e in self.encodings:
            e.reset_parameters()

    def init_non_persistent_buffers(self) -> None:
        for e in self.encodings:
            e.init_non_persistent_buffers()

    def no_weight_decay(self) -> set:
        return {f'encodings.{i}.{n}' for i, e in enumerate(self.encodings) for n in e.no_weight_decay()}

    def adopt_pos_embed(self, table, num_prefix, grid):
        entries: Dict[str, torch.Tensor] = {}
        resampled: List[str] = []
        for i, e in enumerate(self.encodings):
            own, res = e.adopt_pos_embed(table, num_prefix, grid)
            entries.update({f'encodings.{i}.{k}': v for k, v in own.items()})
            resampled += [f'encodings.{i}.{k}' for k in res]
        return entries, resampled

    def adopt_timm_rope(self, rope):
        return {f'encodings.{i}.{k}': v for i, e in enumerate(self.encodings) for k, v in e.adopt_timm_rope(rope).items()}

    def prepared_state(self, pos_q: Positions, pos_k: Optional[Positions] = None) -> List[Any]:
        return [e.prepared_state(pos_q, pos_k) for e in self.encodings]

    def clear_cache(self) -> None:
        super().clear_cache()
        for e in self.encodings:
            e.clear_cache()

    def set_grid_size(self, grid_size: Sequence[int]) -> None:
        super().set_grid_size(grid_size)
        for e in self.encodings:
            e.set_grid_size(grid_size)

    def embedding(self, pos: Positions) -> torch.Tensor:
        parts = [e.embedding(pos) for e in self.encodings if e.capabilities.additive]
        if not parts:
            raise NotImplementedError(f'{self.name} has no additive encoding')
        return sum(parts[1:], parts[0])

    def embed(self, x: torch.Tensor, pos: Positions, state: Any = None) -> torch.Tensor:
        for i, e in enumerate(self.encodings):
            x = e.embed(x, pos, None if state is None else state[i])
        return x

    def between_blocks(self, x: torch.Tensor, pos: Positions, index: int) -> torch.Tensor:
        for e in self.encodings:
            x = e.between_blocks(x, pos, index)
        return x

    def qk(self, q, k, state, layer, x=None):
        for i in self._order:
            q, k = self.encodings[i].qk(q, k, state[i], layer, x=x)
        return q, k

    def bias(self, q, k, state, layer):
        hd = self.ctx.head_dim
        q, k = q[..., :hd], k[..., :hd]  # a widening encoding appends its channels after these
        total = None
        for e, s in zip(self.encodings, state):
            b = e.bias(q, k, s, layer)
            if b is not None:
                total = b if total is None else total + b
        return total

    def value(self, v, state, layer):
        for i in self._order:
            v = self.encodings[i].value(v, state[i], layer)
        return v

    def output(self, o, state, layer):
        for i in reversed(self._order):
            o = self.encodings[i].output(o, state[i], layer)
        return o

    def weights_value(self, attn, state, layer):
        terms = [e.weights_value(attn, s, layer) for e, s in zip(self.encodings, state)
                 if e.capabilities.needs_weights]
        return sum(terms[1:], terms[0])


class PreparedPE:
    """An encoding prepared for one forward: what `PositionalEncoding.prepare` returns.

    It knows the encoding, the positions of the queries and of the keys, and the state built from
    them once for every layer, and offers the hooks by name, so a host hands its blocks this one
    object. Hooks the encoding's capabilities leave out are skipped by `vispe.pe_attention` (and are
    the identity when called here).

    Attributes:
        encoding: the `PositionalEncoding` (or composition).
        pos_q: positions of the queries (of every token in self-attention).
        pos_k: positions of the keys, or None in self-attention.
        state: what the encoding's ``_prepare`` built (shared by all layers; cached in eval).
    """

    def __init__(self, encoding: PositionalEncoding, pos_q: Positions, pos_k: Optional[Positions], state: Any
                 ) -> None:
        self.encoding = encoding
        self.pos_q = pos_q
        self.pos_k = pos_k
        self.state = state

    @property
    def capabilities(self) -> Capabilities:
        return self.encoding.capabilities

    @property
    def keys(self) -> Positions:
        """The positions of the keys (the queries' in self-attention)."""
        return self.pos_q if self.pos_k is None else self.pos_k

    def check_tokens(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """A clear error when q or k ``(..., N, hd)`` has another token count than its positions, or q
        another head dim than k (a broadcast or size error inside a hook otherwise)."""
        if q.shape[-1] != k.shape[-1]:
            raise ValueError(f'q and k must have one head dim, got q {tuple(q.shape)} (head dim {q.shape[-1]}) and '
                             f'k {tuple(k.shape)} (head dim {k.shape[-1]}); encoding {self.encoding.name!r} maps '
                             f'both with the same tables')
        for name, t, pos in (('q', q, self.pos_q), ('k', k, self.keys)):
            if t.shape[-2] != pos.num_tokens:
                raise ValueError(
                    f'encoding {self.encoding.name!r} was prepared for positions of {pos.num_tokens} tokens '
                    f'({pos.num_prefix} prefix + {pos.coords.shape[-2]} positioned) but {name} has {t.shape[-2]} '
                    f'(q: {q.shape[-2]}, k: {k.shape[-2]}); prepare it for the tokens attention sees, prefix '
                    'tokens included (num_prefix=...)')

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens ``(B, N, C)`` with the encoding's embedding (once, before the blocks)."""
        return self.encoding.embed(x, self.pos_q, self.state)

    def between_blocks(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """The tokens after block ``index``."""
        return self.encoding.between_blocks(x, self.pos_q, index)

    def qk(self, q: torch.Tensor, k: torch.Tensor, layer: int, x: Optional[torch.Tensor] = None
           ) -> Tuple[torch.Tensor, torch.Tensor]:
        """q and k mapped in attention layer ``layer`` (``x``: the attention's input, for encodings that
        declare ``needs_tokens``)."""
        return self.encoding.qk(q, k, self.state, layer, x=x)

    def bias(self, q: torch.Tensor, k: torch.Tensor, layer: int) -> Optional[torch.Tensor]:
        """The additive logit term of layer ``layer`` (None: no term)."""
        return self.encoding.bias(q, k, self.state, layer)

    def score_mod(self, layer: int, dtype: torch.dtype) -> Optional[Callable[..., torch.Tensor]]:
        """The bias of layer ``layer`` as a FlexAttention ``score_mod``, or None (the dense `bias` applies)."""
        return self.encoding.score_mod(self.state, layer, dtype)

    def value(self, v: torch.Tensor, layer: int) -> torch.Tensor:
        return self.encoding.value(v, self.state, layer)

    def output(self, o: torch.Tensor, layer: int) -> torch.Tensor:
        return self.encoding.output(o, self.state, layer)

    def weights_value(self, attn: torch.Tensor, layer: int) -> Optional[torch.Tensor]:
        return self.encoding.weights_value(attn, self.state, layer)

    def select(self, keep: torch.Tensor) -> 'PreparedPE':
        """Prepared anew for the tokens kept by token dropping (``keep`` ``(B, K)`` indices of the
        positioned tokens, `Positions.select`), in self-attention."""
        if self.pos_k is not None:
            raise ValueError('select keeps tokens of self-attention; prepare cross-attention for its kept tokens')
        return self.encoding.prepare(self.pos_q.select(keep))

    def __repr__(self) -> str:
        return (f'PreparedPE({self.encoding.name or type(self.encoding).__name__}, {self.pos_q.num_tokens} '
                f'queries' + ('' if self.pos_k is None else f', {self.pos_k.num_tokens} keys') + ')')


def _same_tensors(a: tuple, b: tuple) -> bool:
    """Whether two (tensors, versions, inference mode) keys of the eval cache name the same tensors unchanged."""
    return (len(a[0]) == len(b[0]) and all(x is y for x, y in zip(a[0], b[0]))) and a[1:] == b[1:]
