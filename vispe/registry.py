"""Name -> encoding class, spec strings, and errors that say what is allowed.

A spec is one of

* a name: ``'rope_axial'``;
* a name with options: ``'irpe:method=cross,mode=bias,on=qkv,shared_heads=false'``;
* a composition: ``'rope_mixed+learned'`` (each part may carry options);
* a dict ``{'name': 'rope_axial', 'theta': 100}`` or a list of such dicts / strings.

Options are the keyword arguments of the encoding's constructor; their type hints drive parsing
and type validation, so an encoding declares its options exactly once. The registry checks types,
duplicate options and list sizes; the constructors check values (so direct construction is checked
too). Errors quote user input cut to 80 characters.
"""
from __future__ import annotations

import difflib
import inspect
import math
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Type, Union

from .encodings._checks import short_repr
from .encodings.base import ComposedPE, PEContext, PositionalEncoding, build_with_factory_kwargs

__all__ = ['register_pe', 'create_pe', 'list_pes', 'parse_pe_spec', 'pe_info', 'PESpec']

_CONTEXT_FIELDS = ('dim', 'num_heads', 'head_dim', 'depth', 'grid_size', 'num_prefix_tokens', 'embed_prefix')
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

    The constructor must be ``__init__(self, ctx: PEContext, *, option: type = default, ...)``.
    """
    def wrap(cls: Type[PositionalEncoding]) -> Type[PositionalEncoding]:
        if name in _REGISTRY and _REGISTRY[name].cls is not cls:
            raise ValueError(f'encoding name {name!r} is already registered by {_REGISTRY[name].cls.__name__}')
        if '+' in name or ':' in name or ',' in name:
            raise ValueError(f'encoding name {name!r} may not contain "+", ":" or ","')
        sig = inspect.signature(cls.__init__)
        params = list(sig.parameters.values())[2:]  # self, ctx
        options = {p.name: p for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        hints = typing.get_type_hints(cls.__init__)
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
        close = difflib.get_close_matches(name, _REGISTRY.keys(), n=3, cutoff=0.5)
        hint = f' Did you mean {", ".join(repr(c) for c in close)}?' if close else ''
        raise ValueError(f'unknown encoding {short_repr(name)} (argument pe).{hint} '
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


def parse_pe_spec(spec: PESpec) -> List[Tuple[str, Dict[str, Any]]]:
    """Normalise any spec form to a list of ``(name, raw options)``."""
    if spec is None or spec == '':
        return [('none', {})]
    if isinstance(spec, Mapping):
        spec = dict(spec)
        if 'name' not in spec:
            raise ValueError(f"a dict encoding spec needs a 'name' key, got keys {short_repr(sorted(spec))} "
                             '(argument pe)')
        name = spec.pop('name')
        parsed = parse_pe_spec(name)
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
    if isinstance(spec, Sequence):
        return [item for s in spec for item in parse_pe_spec(s)]
    raise TypeError(f'pe must be a str, dict or list of them, got {type(spec).__name__}')


_TRUE = {'true', '1', 'yes', 'on'}
_FALSE = {'false', '0', 'no', 'off'}


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a (possibly string) option value to the annotated type, or raise naming the option."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    if origin is Union:
        if value is None or (isinstance(value, str) and value.lower() == 'none'):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(errors[0] if len(errors) == 1 else f'{where}: {short_repr(value)} matches none of {hint}')
    if origin is Literal:
        for a in args:
            if value == a or (isinstance(value, str) and str(a) == value):
                return a
        raise ValueError(f'{where}: {short_repr(value)} is not allowed; allowed values: '
                         f'{", ".join(repr(a) for a in args)}')
    if origin in (tuple, list, Sequence, typing.Sequence) or hint in (tuple, list):
        elem = args[0] if args else Any
        if isinstance(value, str):
            items = _parse_list(value, where)
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            items = [value]
        if len(items) > _MAX_LIST_ITEMS:
            raise ValueError(f'{where}: a list holds at most {_MAX_LIST_ITEMS} items, got {len(items)}')
        return tuple(_coerce(v, elem, where) for v in items)
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError(f'{where}: expected true or false, got {short_repr(value)}')
    if hint in (int, float):
        if isinstance(value, bool):
            raise ValueError(f'{where}: expected {hint.__name__}, got {short_repr(value)}')
        try:
            out = hint(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f'{where}: expected {hint.__name__}, got {short_repr(value)}') from None
        if hint is int and isinstance(value, float) and value != out:
            raise ValueError(f'{where}: expected int, got {short_repr(value)}')
        if hint is float and math.isnan(out):
            raise ValueError(f'{where}: expected a number, got {short_repr(value)}')
        return out
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f'{where}: expected a string, got {short_repr(value)}')
        return value
    return value


_MAX_LIST_ITEMS = 4096  # list options hold block indices: far beyond any depth
_RANGE = re.compile(r'(\d{1,18})-(\d{1,18})')


def _parse_list(text: str, where: str) -> List[str]:
    """``'0-5'`` -> 0..5, ``'0|2|4'`` -> [0, 2, 4], ``'[1, 2]'`` -> [1, 2]; ranges and items mix.

    A range is sized before it is expanded: an empty range (``'5-2'``) or more than
    ``_MAX_LIST_ITEMS`` items in all is an error, so ``'0-1000000000'`` costs nothing.
    """
    text = text.strip().strip('[]()')
    items: List[str] = []
    for piece in filter(None, (p.strip() for p in text.replace(';', '|').replace(' ', '|').split('|'))):
        for sub in filter(None, (s.strip() for s in piece.split(','))):
            match = _RANGE.fullmatch(sub)
            if match is None:
                items.append(sub)
                continue
            lo, hi = int(match[1]), int(match[2])
            if hi < lo:
                raise ValueError(f'{where}: the range {short_repr(sub)} is empty (write it low-high, low <= high)')
            if len(items) + hi - lo + 1 > _MAX_LIST_ITEMS:
                raise ValueError(f'{where}: the range {short_repr(sub)} has {hi - lo + 1} items; a list holds '
                                 f'at most {_MAX_LIST_ITEMS}')
            items.extend(str(i) for i in range(lo, hi + 1))
    return items


def _build_one(name: str, raw: Dict[str, Any], ctx: PEContext) -> PositionalEncoding:
    entry = _lookup(name)
    kwargs = {}
    for key, value in raw.items():
        if key not in entry.options:
            close = difflib.get_close_matches(key, entry.options.keys(), n=2, cutoff=0.5)
            hint = f' Did you mean {", ".join(repr(c) for c in close)}?' if close else ''
            valid = ', '.join(entry.options) or 'none'
            raise ValueError(f'unknown option {short_repr(key)} for encoding {name!r}.{hint} '
                             f'Valid options: {valid}.')
        kwargs[key] = _coerce(value, entry.hints.get(key, Any), f'option {key!r} of encoding {name!r}')
    return entry.cls(ctx, **kwargs)


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

    def build() -> PositionalEncoding:
        encodings = [_build_one(name, raw, ctx) for name, raw in parts]
        return encodings[0] if len(encodings) == 1 else ComposedPE(ctx, encodings)
    return build_with_factory_kwargs(build, device=device, dtype=dtype)
