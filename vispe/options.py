"""Typed options: one coercer for spec strings, config files and constructor arguments.

An option is declared once, as a typed keyword argument of a constructor; its type hint drives
everything else. `coerce` turns a value into the hinted type or raises a ``ValueError`` that names
the option (``where``) and what is allowed. It runs in two modes:

* ``parse=True``: the value comes from text or a data file (a spec string ``'theta=100'``, a YAML
  or JSON value), so strings are parsed (``'true'``, ``'0-5'``, ``'none'``, ``'1e-3'``), YAML's
  bare ``on`` / ``off`` booleans map to the words, lists become tuples where a tuple is hinted,
  and NaN is refused;
* ``parse=False``: the value is a Python argument (``IRPE(ctx, method='x')``) that the constructor
  receives as it is, so it is only checked: it must already have the hinted type (an ``int`` where a
  ``float`` is hinted, any sized iterable where a sequence is), nothing is converted, and the
  constructor checks values (ranges, NaN) itself.

Supported hints: ``bool``, ``int``, ``float``, ``str``, ``Literal``, ``Optional`` / ``Union``,
``Tuple[T, ...]`` / ``Tuple[A, B]``, ``List`` / ``Sequence``, ``Dict`` / ``Mapping``; anything else
(a class, ``Any``) is passed through. `format_value` writes a value back as spec text that
``coerce(..., parse=True)`` reads as the same value. `check_arguments` checks a call against a
constructor's signature (``PositionalEncoding.__new__`` runs it for every encoding).
"""
from __future__ import annotations

import collections.abc
import difflib
import functools
import inspect
import math
import numbers
import re
import types
import typing
from typing import Any, Callable, Dict, Iterable, List, Literal, Mapping, Tuple, Union


__all__ = ['short_repr', 'coerce', 'format_value', 'parse_list', 'did_you_mean', 'unknown_option', 'signature_options',
           'check_arguments', 'type_name', 'MAX_LIST_ITEMS']

MAX_LIST_ITEMS = 4096  # list options hold block indices: far beyond any depth
_TRUE = {'true', '1', 'yes', 'on'}
_FALSE = {'false', '0', 'no', 'off'}
_RANGE = re.compile(r'(\d{1,18})-(\d{1,18})')
_SEQUENCES = (list, tuple, collections.abc.Sequence)
_MAPPINGS = (dict, collections.abc.Mapping)


_MAX_REPR = 80


def short_repr(value: Any, limit: int = _MAX_REPR) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``'...'``, so a huge input is never echoed whole."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + '...'


def type_name(hint: Any) -> str:
    """``int``, ``none``, ``Tuple[float, float]``: a hint as an error message writes it."""
    if hint is type(None):
        return 'none'
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace('typing.', '')


def did_you_mean(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.5, sep: str = ', ',
                 prefix: str = '') -> str:
    """`` Did you mean 'a', 'b'?`` for the choices close to ``name`` (difflib), each quoted with
    ``prefix`` (a config section's dotted path), or ``''``."""
    close = difflib.get_close_matches(name, list(choices), n=n, cutoff=cutoff)
    return f' Did you mean {sep.join(repr(prefix + c) for c in close)}?' if close else ''


def unknown_option(key: str, options: Iterable[str], what: str) -> ValueError:
    """The error for a keyword that ``what`` (``"encoding 'irpe'"``) does not take."""
    options = list(options)
    return ValueError(f'unknown option {short_repr(key)} for {what}.{did_you_mean(str(key), options, n=2)} '
                      f'Valid options: {", ".join(options) or "none"}.')


def coerce(value: Any, hint: Any, where: str, *, parse: bool = True) -> Any:
    """``value`` as type ``hint``, or a ``ValueError`` naming ``where`` and what is allowed (see the module)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union or origin is types.UnionType:
        return _coerce_union(value, hint, args, where, parse)
    if value is None:
        raise ValueError(f'{where}: expected {type_name(hint)}, got None')
    if origin is Literal:
        return _coerce_literal(value, args, where, parse)
    if origin in (tuple, list, collections.abc.Sequence) or hint in (tuple, list):
        return _coerce_sequence(value, hint, origin, args, where, parse)
    if origin in (dict, collections.abc.Mapping) or hint is dict:
        if not isinstance(value, _MAPPINGS):
            raise ValueError(f'{where}: expected a mapping, got {short_repr(value)}')
        vt = args[1] if args else Any
        return {k: coerce(v, vt, f'{where}.{k}', parse=parse) for k, v in value.items()} if parse else value
    if hint is bool:
        return _coerce_bool(value, where, parse)
    if hint is int:
        return _coerce_int(value, where, parse)
    if hint is float:
        return _coerce_float(value, where, parse)
    if hint is str:
        if isinstance(value, str):
            return value
        if parse and isinstance(value, (int, float)) and not isinstance(value, bool):  # YAML: name: 123
            return str(value)
        raise ValueError(f'{where}: expected a string, got {short_repr(value)}')
    return value


def _coerce_union(value: Any, hint: Any, args: tuple, where: str, parse: bool) -> Any:
    if type(None) in args and (value is None or (  # 'none' is a string where a string is allowed
            parse and isinstance(value, str) and value.lower() == 'none' and str not in args)):
        return None
    errors = []
    for a in args:
        if a is type(None):
            continue
        try:
            return coerce(value, a, where, parse=parse)
        except ValueError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise ValueError(errors[0])
    raise ValueError(f'{where}: {short_repr(value)} is not a {" or ".join(type_name(a) for a in args)}')


def _coerce_literal(value: Any, args: tuple, where: str, parse: bool) -> Any:
    for a in args:
        if value == a and isinstance(value, bool) == isinstance(a, bool):
            return a
    if parse:
        if isinstance(value, str):
            for a in args:
                if str(a) == value:
                    return a
        if isinstance(value, bool) and ('on' if value else 'off') in args:  # YAML reads a bare on / off as a bool
            return 'on' if value else 'off'
    raise ValueError(f'{where}: {short_repr(value)} is not allowed; allowed values: {", ".join(map(repr, args))}')


def _coerce_sequence(value: Any, hint: Any, origin: Any, args: tuple, where: str, parse: bool) -> Any:
    if parse and isinstance(value, str):
        items: Any = parse_list(value, where)
    elif isinstance(value, (str, bytes)) or isinstance(value, _MAPPINGS) or not (
            isinstance(value, collections.abc.Sized) and isinstance(value, collections.abc.Iterable)):
        if not parse:
            raise ValueError(f'{where}: expected a list of {type_name(args[0]) if args else "values"}, '
                             f'got {short_repr(value)}')
        items = [value]  # a scalar where a list is hinted: a list of one
    else:
        items = value
    if len(items) > MAX_LIST_ITEMS:  # sized before anything walks it: range(10**9) costs nothing
        if not parse:
            return value  # not walked; the constructor sizes its lists against what it can use
        raise ValueError(f'{where}: a list holds at most {MAX_LIST_ITEMS} items, got {len(items)}')
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(items) != len(args):
            raise ValueError(f'{where}: expected {len(args)} values, got {short_repr(value)}')
        elems = list(args)
    else:
        elems = [args[0] if args else Any] * len(items)
    out = [coerce(v, a, where, parse=parse) for v, a in zip(items, elems)]
    if not parse:
        return value
    return out if origin is list or hint is list else tuple(out)


def _coerce_bool(value: Any, where: str, parse: bool) -> bool:
    if isinstance(value, bool):
        return value
    if parse and isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ValueError(f'{where}: expected true or false, got {short_repr(value)}')


def _coerce_int(value: Any, where: str, parse: bool) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value) if parse else value
    if parse and isinstance(value, (str, float)) and not isinstance(value, bool):
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        try:
            number = float(value)  # '1e3' (YAML 1.1 reads it as a string), 2.0
        except (ValueError, OverflowError):
            number = math.nan
        if math.isfinite(number) and number.is_integer():
            return int(number)
    raise ValueError(f'{where}: expected an integer, got {short_repr(value)}')


def _coerce_float(value: Any, where: str, parse: bool) -> Any:
    if isinstance(value, bool) or not (isinstance(value, numbers.Real) or (parse and isinstance(value, str))):
        raise ValueError(f'{where}: expected float, got {short_repr(value)}')
    if not parse:
        return value  # the constructor checks the value (finite, positive, ...) and names it
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f'{where}: expected float, got {short_repr(value)}') from None
    if math.isnan(out):
        raise ValueError(f'{where}: expected a number, got {short_repr(value)}')
    return out


def parse_list(text: str, where: str) -> List[str]:
    """``'0-5'`` -> 0..5, ``'0|2|4'`` -> [0, 2, 4], ``'[1, 2]'`` -> [1, 2]; ranges and items mix.

    A range is sized before it is expanded: an empty range (``'5-2'``) or more than
    `MAX_LIST_ITEMS` items in all is an error, so ``'0-1000000000'`` costs nothing.
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
            if len(items) + hi - lo + 1 > MAX_LIST_ITEMS:
                raise ValueError(f'{where}: the range {short_repr(sub)} has {hi - lo + 1} items; a list holds '
                                 f'at most {MAX_LIST_ITEMS}')
            items.extend(str(i) for i in range(lo, hi + 1))
    return items


_SPEC_SYNTAX = re.compile(r'[\s,+:=|;\[\](){}]')


def format_value(value: Any, where: str, hint: Any = Any) -> str:
    """A coerced option value as spec text that ``coerce(text, hint)`` reads back as the same value:
    ``true``, ``none``, ``0.1``, ``1e-05``, ``0|2|4`` (``[]`` when empty). A value that would not
    read back (a string holding spec syntax, ``'none'`` where ``None`` is allowed too) is an error
    naming ``where``."""
    text = _format(value, where)
    if hint is not Any and coerce(text, hint, where) != value:
        raise ValueError(f'{where}: {short_repr(value)} cannot be written in a spec string (it reads back as '
                         f'{short_repr(coerce(text, hint, where))})')
    return text


def _format(value: Any, where: str) -> str:
    if value is None:
        return 'none'
    if isinstance(value, bool):
        return 'true' if value else 'false'
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        return repr(float(value))  # the shortest text that reads back as the same float
    if isinstance(value, str):
        if not value or _SPEC_SYNTAX.search(value):
            raise ValueError(f'{where}: the string {short_repr(value)} cannot be written in a spec string')
        return value
    if isinstance(value, _SEQUENCES) and not isinstance(value, _MAPPINGS):
        items = [_format(v, where) for v in value]
        if any(_SPEC_SYNTAX.search(t) for t in items):
            raise ValueError(f'{where}: {short_repr(value)} cannot be written in a spec string (nested lists)')
        return '|'.join(items) if items else '[]'
    raise ValueError(f'{where}: {short_repr(value)} cannot be written in a spec string')


# ---------------------------------------------------------------------- signatures
@functools.lru_cache(maxsize=None)
def signature_options(func: Callable) -> Tuple[Dict[str, inspect.Parameter], Dict[str, Any], bool]:
    """``(parameters by name, type hints, takes **kwargs)`` of ``func``, computed once per function.

    For a class, the parameters of its ``__init__``; where that ends in ``**kwargs`` passed on to the
    parent's constructor, the parent's options follow (``self`` and the leading ``ctx`` once), so a
    subclass names only the options it adds and shares the rest of its parent's signature.

    Hints that cannot be resolved (a forward reference to a name the module lacks) leave that
    function's arguments unchecked rather than failing its callers.
    """
    if isinstance(func, type):
        return _class_options(func)
    params = dict(inspect.signature(func).parameters)
    try:
        hints = typing.get_type_hints(func)
    except (NameError, TypeError):
        hints = {}
    hints.pop('return', None)
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
    return params, hints, var_kw


def _class_options(cls: type) -> Tuple[Dict[str, inspect.Parameter], Dict[str, Any], bool]:
    inits = [c.__dict__['__init__'] for c in cls.__mro__ if '__init__' in c.__dict__]
    params, hints, var_kw = dict(signature_options(inits[0])[0]), {}, False
    for i, init in enumerate(inits):
        own, own_hints, var_kw = signature_options(init)
        for name, p in list(own.items())[2 if i else 0:]:  # self and ctx come from the leaf
            if p.kind is not p.VAR_KEYWORD:
                params.setdefault(name, p)
        for name, hint in own_hints.items():
            hints.setdefault(name, hint)
        if not var_kw:
            break
    params = {n: p for n, p in params.items() if p.kind is not p.VAR_KEYWORD or var_kw}
    return params, hints, var_kw


def check_arguments(func: Callable, args: tuple, kwargs: Mapping[str, Any], what: str, skip: int = 1) -> None:
    """Check a call of ``func`` against its signature without calling it.

    ``args`` are the positional arguments after the ``skip`` leading parameters (``self``, and an
    encoding's ``ctx``), which are not options. Unknown keywords are refused with the closest valid
    ones; every given argument is checked against its hint with ``coerce(..., parse=False)`` (errors
    read ``option 'method' of <what>: ...``). Missing or surplus arguments are left to the call.
    """
    params, hints, var_kw = signature_options(func)
    named = list(params.values())[skip:]
    options = [p.name for p in named if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    given: List[Tuple[str, Any]] = []
    for p, value in zip(named, args):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        given.append((p.name, value))
    for key, value in kwargs.items():
        if key not in params or params[key].kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if not var_kw:
                raise unknown_option(key, options, what)
            continue
        given.append((key, value))
    for key, value in given:
        if key in hints:
            coerce(value, hints[key], f'option {key!r} of {what}', parse=False)
