"""Name -> encoding class, spec strings, and errors that say what is allowed.

A spec is one of

* a name: ``'rope_axial'``;
* a name with options: ``'irpe:method=cross,mode=bias,on=qkv,shared_heads=false'``;
* a composition: ``'rope_mixed+learned'`` (each part may carry options);
* a dict ``{'name': 'rope_axial', 'theta': 100}`` or a list of such dicts / strings.

Options are the keyword arguments of the encoding's constructor; their type hints drive parsing
and type validation (`vispe.options.coerce`, the coercer the training configs use too), so an
encoding declares its options exactly once. The registry checks types, duplicate options and list
sizes; constructing a class directly runs the same type checks (``PositionalEncoding.__new__``) and
the constructors check values, so both paths give the same errors. `format_pe_spec` writes parts
back as a canonical spec string. Errors quote user input cut to 80 characters.
"""
from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Type, Union

import torch

from .options import short_repr
from .contract import ComposedPE, PEContext, PositionalEncoding, build_with_factory_kwargs
from .options import coerce, did_you_mean, format_value, signature_options, unknown_option

__all__ = ['register_pe', 'create_pe', 'list_pes', 'parse_pe_spec', 'format_pe_spec', 'pe_info', 'PESpec']

_CONTEXT_FIELDS = tuple(f.name for f in fields(PEContext))
PESpec = Union[str, Mapping[str, Any], Sequence[Union[str, Mapping[str, Any]]], None]


@dataclass(frozen=True)
class _Entry:
    name: str
    cls: Type[PositionalEncoding]
    family: str
    options: Dict[str, inspect.Parameter]
    hints: Dict[str, Any]


_REGISTRY: Dict[str, _Entry] = {}


def register_pe(name: str, family: Optional[str] = None) -> Callable[[Type[PositionalEncoding]], Type]:
    """Class decorator: register an encoding under ``name``.

    The constructor must be ``__init__(self, ctx: PEContext, *, option: type = default, ...)``; one
    ending in ``**options`` passed to its parent's constructor also takes the parent's options.
    """
    def wrap(cls: Type[PositionalEncoding]) -> Type[PositionalEncoding]:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f'encoding name {name!r} is already registered by {_REGISTRY[name].cls.__name__}')
        if '+' in name or ':' in name or ',' in name:
            raise ValueError(f'encoding name {name!r} may not contain "+", ":" or ","')
        params, hints, _ = signature_options(cls)
        options = {p.name: p for p in list(params.values())[2:]  # self, ctx
                   if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        fam = family or cls.__module__.rsplit('.', 1)[-1]
        _REGISTRY[name] = _Entry(name, cls, fam, options, hints)
        cls.name = name
        return cls
    return wrap


def list_pes(pattern: str = '') -> List[str]:
    """Registered encoding names, sorted; ``pattern`` filters by substring."""
    return sorted(n for n in _REGISTRY if pattern in n)


def pe_info(name: str) -> Dict[str, Any]:
    """Registry facts about one encoding: family, class, options with defaults, description."""
    entry = _lookup(name)
    cls = entry.cls
    return dict(
        name=name, family=entry.family, cls=cls,
        options={k: (None if p.default is inspect.Parameter.empty else p.default) for k, p in entry.options.items()},
        shift_invariant=cls.shift_invariant, larger_input=cls.larger_input, paper=cls.paper,
    )


def _lookup(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise ValueError(f'unknown encoding {short_repr(name)} (argument pe).{did_you_mean(name, _REGISTRY)} '
                         f'Available: {", ".join(list_pes())}.')
    return _REGISTRY[name]


def _split_top(text: str, sep: str) -> List[str]:
    """Split on ``sep`` outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += ch in '([{'
        depth -= ch in ')]}'
        if ch == sep and depth == 0:
            parts.append(''.join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append(''.join(cur))
    return parts


def parse_pe_spec(spec: PESpec, *, typed: bool = False) -> List[Tuple[str, Dict[str, Any]]]:
    """Normalise any spec form to a list of ``(name, options)``.

    Options are as written (strings from a spec string) unless ``typed``: then every name is
    checked and every option coerced to its constructor type as `create_pe` passes it, so a bad
    name, key or value raises here, naming it, without building anything.
    """
    parts = _parse(spec)
    return [(name, _coerce_options(name, raw)) for name, raw in parts] if typed else parts


def format_pe_spec(parts: Union[PESpec, Sequence[Tuple[str, Mapping[str, Any]]]]) -> str:
    """The canonical spec string of ``parts`` (the output of `parse_pe_spec`, or any spec): the inverse of
    the parser, ``parse_pe_spec(format_pe_spec(p), typed=True) == parse_pe_spec(p, typed=True)``.

    Options are coerced to their types, then written in the constructor's order: ``true`` /
    ``false``, ``none``, floats as Python writes them (``0.1``, ``1e-05``), lists as ``0|2|4``.

    Example:
        >>> format_pe_spec({'name': 'rope_axial', 'theta': 100, 'grid_mode': 'normalized'})
        'rope_axial:theta=100.0,grid_mode=normalized'
    """
    is_parts = isinstance(parts, (list, tuple)) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], Mapping) for p in parts)
    out = []
    for name, options in (parts if is_parts else _parse(parts)):
        typed = _coerce_options(name, options)
        entry = _REGISTRY[name]
        order = list(entry.options)
        items = [f'{k}={format_value(typed[k], f"option {k!r} of encoding {name!r}", entry.hints.get(k, Any))}'
                 for k in sorted(typed, key=order.index)]
        out.append(f'{name}:{",".join(items)}' if items else name)
    return '+'.join(out)


def _parse(spec: PESpec) -> List[Tuple[str, Dict[str, Any]]]:
    if spec is None or spec == '':
        return [('none', {})]
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if 'name' not in spec:
            raise ValueError(f"a dict encoding spec needs a 'name' key, got keys {short_repr(sorted(spec))} "
                             '(argument pe)')
        name = spec.pop('name')
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"the 'name' of a dict encoding spec must be an encoding name or spec string, got "
                             f"{short_repr(name)} (argument pe). Available: {', '.join(list_pes())}.")
        parsed = _parse(name)
        if len(parsed) > 1:
            if spec:
                raise ValueError('options in a dict spec apply to one encoding; use a list of dicts to compose')
            return parsed
        twice = [k for k in spec if k in parsed[0][1]]
        if twice:
            raise ValueError(f'option {short_repr(twice[0])} is given twice in encoding spec '
                             f'{short_repr(name)} + {short_repr(spec)} (argument pe)')
        return [(parsed[0][0], {**parsed[0][1], **spec})]
    if isinstance(spec, str):
        out = []
        for part in _split_top(spec.strip(), '+'):
            part = part.strip()
            name, _, rest = part.partition(':')
            opts: Dict[str, Any] = {}
            if rest.strip():
                for item in _split_top(rest, ','):
                    key, eq, value = item.partition('=')
                    key = key.strip()
                    if not eq:
                        raise ValueError(f'bad option {short_repr(item)} in encoding spec {short_repr(spec)}: '
                                         'expected key=value (argument pe)')
                    if key in opts:
                        raise ValueError(f'option {short_repr(key)} is given twice in encoding spec '
                                         f'{short_repr(spec)} (argument pe)')
                    opts[key] = value.strip()
            out.append((name.strip(), opts))
        return out
    if isinstance(spec, (bytes, bytearray)):  # a Sequence, but of ints: name the type the user passed
        raise TypeError(f'pe must be a str, dict or list of them, got {type(spec).__name__} {short_repr(spec)}; '
                        f'decode it first (spec.decode())')
    if isinstance(spec, Sequence):
        if not spec:
            raise ValueError("an empty list is no encoding spec (argument pe); use 'none' for no encoding")
        return [item for s in spec for item in _parse(s)]
    raise TypeError(f'pe must be a str, dict or list of them, got {type(spec).__name__}')


def _coerce_options(name: str, raw: Mapping[str, Any]) -> Dict[str, Any]:
    """The options of encoding ``name`` as its constructor takes them (`vispe.options.coerce`)."""
    entry = _lookup(name)
    out = {}
    for key, value in raw.items():
        new = entry.cls.renamed_options.get(key)
        if new is not None:  # a spec saved before the rename (a config, a checkpoint's model args) still loads
            warnings.warn(f'option {key!r} of encoding {name!r} is now called {new!r}; {key!r} is read as {new!r} '
                          f'until vispe 0.3', DeprecationWarning, stacklevel=3)
            if new in raw:
                raise ValueError(f'encoding {name!r} got both {key!r} and its new name {new!r}; give {new!r} only')
            key = new
        if key not in entry.options:
            raise unknown_option(key, entry.options, f'encoding {name!r}')
        out[key] = coerce(value, entry.hints.get(key, Any), f'option {key!r} of encoding {name!r}')
    return out


def create_pe(spec: PESpec = 'none', ctx: Optional[PEContext] = None, *, device=None, dtype=None,
              **kwargs: Any) -> PositionalEncoding:
    """Build an encoding (or a composition) from a spec.

    Args:
        spec: name, ``'name:key=value,...'``, ``'a+b'``, dict or list (see module docstring).
        ctx: host description; or give its fields as keywords (``dim``, ``num_heads``, ``head_dim``,
            ``depth``, ``grid_size``, ``num_prefix_tokens``, ``embed_prefix``).
        device, dtype: timm's factory kwargs for the encoding's parameters and buffers
            (``device='meta'``: built without memory; see `build_with_factory_kwargs`).
        kwargs: context fields, then options that override the spec's (single encoding only).

    Example:
        >>> pe = create_pe('rope_mixed', dim=384, num_heads=6, depth=12, grid_size=(14, 14))
    """
    ctx_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _CONTEXT_FIELDS}
    if ctx is None:
        if 'dim' not in ctx_kwargs:
            raise ValueError('create_pe needs the host width: pass dim=... (and num_heads, depth, grid_size) '
                             'or ctx=PEContext(...)')
        ctx = PEContext(**ctx_kwargs)
    elif ctx_kwargs:
        ctx = PEContext(**{**ctx.__dict__, **ctx_kwargs})
    parts = parse_pe_spec(spec)
    if kwargs:
        if len(parts) != 1:
            raise ValueError(f'extra options {sorted(kwargs)} are ambiguous for the composed spec {short_repr(spec)}')
        parts = [(parts[0][0], {**parts[0][1], **kwargs})]

    typed = [(name, _coerce_options(name, raw)) for name, raw in parts]

    def build() -> PositionalEncoding:
        encodings = [_lookup(name).cls(ctx, **options) for name, options in typed]
        return encodings[0] if len(encodings) == 1 else ComposedPE(ctx, encodings)
    target = torch.device(device) if device is not None else torch.get_default_device()
    if target.type != 'meta':
        _check_size(build, typed, target, dtype)
    return build_with_factory_kwargs(build, device=device, dtype=dtype)


def _memory_bytes(device: torch.device) -> Optional[int]:
    """Memory an encoding built on ``device`` can take: the device's total on a GPU, the available
    memory of this machine on the CPU (Linux), None where it cannot be read."""
    if device.type == 'cuda':
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != 'cpu':
        return None
    try:
        with open('/proc/meminfo') as f:
            info = dict(line.split(':', 1) for line in f)
        return int(info['MemAvailable'].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def _check_size(build: Callable[[], PositionalEncoding], parts: Sequence[Tuple[str, Dict[str, Any]]],
                device: torch.device, dtype: Optional[torch.dtype]) -> None:
    """Refuse, before allocating, an encoding whose parameters and buffers could not be built on
    ``device``: sizes from options have no upper bound of their own. Counted on a meta-device twin;
    building takes about twice the final size (a tensor and its initialised copy)."""
    try:
        with torch.device('meta'):
            twin = build()
    except (RuntimeError, OverflowError, TypeError) as e:  # sizes beyond what a tensor can have
        given = ', '.join(f'{k}={v}' for _, options in parts for k, v in options.items()) or 'its defaults'
        raise ValueError(f'encoding {short_repr(format_pe_spec(parts))} cannot be built with {given}: '
                         f'{str(e).splitlines()[0][:120]}') from e
    width = torch.finfo(dtype).bits // 8 if dtype is not None and dtype.is_floating_point else None
    nbytes = sum(t.numel() * (width if width and t.is_floating_point() else t.element_size())
                 for t in (*twin.parameters(), *twin.buffers()))
    limit = _memory_bytes(device)
    if limit is None or 2 * nbytes <= limit:
        return
    sizes = {k: v for _, options in parts for k, v in options.items()
             if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    given = ', '.join(f'{k}={v}' for k, v in sizes.items()) or 'no size option'
    names = ', '.join(sizes) or 'the host context (dim, depth, grid_size)'
    raise ValueError(f'encoding {short_repr(format_pe_spec(parts))} would hold {nbytes / 1e9:.1f} GB of parameters '
                     f'and buffers ({given}), more than {device.type} memory can build ({limit / 1e9:.1f} GB '
                     f'available, about twice the size needed); reduce {names}')
