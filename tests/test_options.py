"""One option mechanism: the coercer behind spec strings, configs and direct construction, and
`format_pe_spec` as the inverse of `parse_pe_spec`."""
import re
from pathlib import Path
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, Tuple

import pytest

import vispe
from vispe.contract import PEContext, PositionalEncoding
from vispe.options import coerce, format_value, signature_options

CTX = dict(dim=32, num_heads=2, depth=2, grid_size=(4, 4))
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
DOC_PAGES = [README, *sorted((ROOT / 'docs').rglob('*.md'))]  # specs shown in the README and the docs


# ------------------------------------------------------------------ the coercer
@pytest.mark.parametrize('value, hint, expected', [
    ('yes', bool, True), ('Off', bool, False), (True, bool, True),
    ('12', int, 12), ('1e3', int, 1000), (2.0, int, 2), (7, int, 7),
    ('1e-3', float, 1e-3), (3, float, 3.0), ('inf', float, float('inf')),
    ('b', Literal['a', 'b'], 'b'), ('2', Literal[1, 2], 2), (False, Literal['on', 'off'], 'off'),
    ('none', Optional[int], None), ('4', Optional[int], 4), (None, Optional[float], None),
    ('none', Optional[str], 'none'),  # a string is a string where one is allowed
    ('0-3|7', Tuple[int, ...], (0, 1, 2, 3, 7)), ('[1, 2]', Tuple[int, ...], (1, 2)), ('[]', Tuple[int, ...], ()),
    ([0.5, 1], Tuple[float, float], (0.5, 1.0)), ([1, '2'], List[int], [1, 2]), ('5', Sequence[int], (5,)),
    ({'a': '1'}, Dict[str, int], {'a': 1}), (5, str, '5'), ('x', Any, 'x'),
])
def test_coerce_parses_text_and_data_values(value, hint, expected):
    out = coerce(value, hint, 'key')
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize('value, hint, message', [
    ('maybe', bool, "key: expected true or false, got 'maybe'"),
    ('big', int, "key: expected an integer, got 'big'"),
    (2.5, int, 'key: expected an integer, got 2.5'),
    (True, int, 'key: expected an integer, got True'),
    ('x', float, "key: expected float, got 'x'"),
    ('nan', float, "key: expected a number, got 'nan'"),
    ('c', Literal['a', 'b'], "key: 'c' is not allowed; allowed values: 'a', 'b'"),
    (True, Literal['auto', 'off'], "key: True is not allowed; allowed values: 'auto', 'off'"),
    (None, int, 'key: expected int, got None'),
    ([1], Tuple[float, float], 'key: expected 2 values, got [1]'),
    ('0-5000', Tuple[int, ...], "key: the range '0-5000' has 5001 items; a list holds at most 4096"),
    ('5-2', Tuple[int, ...], "key: the range '5-2' is empty"),
    (list(range(5000)), List[int], 'key: a list holds at most 4096 items, got 5000'),
    ([1], Mapping[str, int], 'key: expected a mapping, got [1]'),
    ([1], str, 'key: expected a string, got [1]'),
])
def test_coerce_names_the_key_and_what_is_allowed(value, hint, message):
    with pytest.raises(ValueError) as info:
        coerce(value, hint, 'key')
    assert message in str(info.value)


@pytest.mark.parametrize('value, hint', [
    ('false', bool), (1, bool), ('3', int), (True, int), ('1.5', float), ('b', Literal[1, 2]), ('0|1', Tuple[int, ...]),
    ({'a': 1}, Tuple[int, ...]), ('none', Optional[int]),
])
def test_python_arguments_are_checked_not_parsed(value, hint):
    """Direct construction passes values on unchanged, so text that would parse is refused."""
    with pytest.raises(ValueError, match='^key: '):
        coerce(value, hint, 'key', parse=False)


@pytest.mark.parametrize('value, hint', [
    (3, float), (True, bool), (None, Optional[int]), ([0, 1], Tuple[int, ...]), (range(3), Sequence[int]),
    ('b', Literal['a', 'b']), (2, Literal[1, 2]),
])
def test_python_arguments_of_the_hinted_type_pass_unchanged(value, hint):
    assert coerce(value, hint, 'key', parse=False) is value


def test_a_huge_python_sequence_is_not_walked():
    blocks = range(10 ** 12)  # walking it would take hours; the constructor sizes it
    assert coerce(blocks, Tuple[int, ...], 'key', parse=False) is blocks


@pytest.mark.parametrize('value, hint', [
    (True, bool), (False, bool), (0, int), (-3, int), (0.1, float), (1e-5, float), (-2.5e300, float),
    (float('inf'), float), (None, Optional[float]), ((0, 2, 4), Tuple[int, ...]), ((), Tuple[int, ...]),
    ((-1, 3), Tuple[int, ...]), ('normalized', Literal['index', 'normalized']), ((1.5, 1e-3), Tuple[float, ...]),
])
def test_format_value_reads_back_as_the_same_value(value, hint):
    text = format_value(value, 'key', hint)
    assert coerce(text, hint, 'key') == value


@pytest.mark.parametrize('value', ['a,b', 'a+b', '', 'x=y', 'a b'])
def test_a_string_the_spec_syntax_cannot_hold_is_refused(value):
    with pytest.raises(ValueError, match="key: the string .* cannot be written in a spec string"):
        format_value(value, 'key')


def test_a_value_that_would_read_back_otherwise_is_refused():
    assert format_value('none', 'key', Literal['none', 'linear']) == 'none'
    with pytest.raises(ValueError, match="key: 'none' cannot be written in a spec string .*reads back as None"):
        format_value('none', 'key', Optional[Literal['none', 'linear']])


# ------------------------------------------------------------------ both construction paths
def _hints(name: str) -> Dict[str, Any]:
    return signature_options(vispe.pe_info(name)['cls'])[1]


def _literal_options():
    return [pytest.param(name, key, id=f'{name}.{key}') for name in vispe.list_pes()
            for key, hint in _hints(name).items()
            if Literal in (getattr(hint, '__origin__', None), *(getattr(a, '__origin__', None)
                                                              for a in getattr(hint, '__args__', ())))]


def _error(build) -> str:
    with pytest.raises(ValueError) as info:
        build()
    return str(info.value)


@pytest.mark.parametrize('name, key', _literal_options())
def test_direct_construction_refuses_a_bad_choice_as_the_spec_does(name, key):
    cls = vispe.pe_info(name)['cls']
    spec = _error(lambda: vispe.create_pe(f'{name}:{key}=bogus', **CTX))
    direct = _error(lambda: cls(PEContext(**CTX), **{key: 'bogus'}))
    assert spec == direct
    assert f"option '{key}' of encoding '{name}': 'bogus' is not allowed; allowed values: " in direct


@pytest.mark.parametrize('name', vispe.list_pes())
def test_direct_construction_refuses_bad_types_and_unknown_options_as_the_spec_does(name):
    cls = vispe.pe_info(name)['cls']
    for key, hint in _hints(name).items():
        if hint in (bool, int, float):
            assert _error(lambda: vispe.create_pe(f'{name}:{key}=bogus', **CTX)) == \
                _error(lambda: cls(PEContext(**CTX), **{key: 'bogus'}))
    spec = _error(lambda: vispe.create_pe(f'{name}:bogus_option=1', **CTX))
    assert spec == _error(lambda: cls(PEContext(**CTX), bogus_option=1))
    assert spec.startswith(f"unknown option 'bogus_option' for encoding '{name}'") and 'ctx' not in spec


def test_direct_construction_suggests_the_closest_option():
    cls = vispe.pe_info('irpe')['cls']
    with pytest.raises(ValueError, match=r"unknown option 'methd' for encoding 'irpe'. Did you mean 'method'\?"):
        cls(PEContext(**CTX), methd='cross')


@pytest.mark.parametrize('name', vispe.list_pes())
def test_every_encoding_builds_with_its_defaults_on_both_paths(name):
    cls = vispe.pe_info(name)['cls']
    # mhrope's default gives the axes t, h, w whole heads: a host of 3 heads or more
    ctx = dict(CTX, num_heads=4) if name == 'mhrope' else CTX
    assert type(vispe.create_pe(name, **ctx)) is cls
    assert type(cls(PEContext(**ctx))) is cls


# ------------------------------------------------------------------ format_pe_spec
def _other_value(hint: Any, default: Any) -> Any:
    """A value of ``hint`` other than ``default``."""
    origin, args = getattr(hint, '__origin__', None), getattr(hint, '__args__', ())
    if origin is Literal:
        return next(a for a in args if a != default)
    if type(None) in args:  # Optional[X]
        inner = next(a for a in args if a is not type(None))
        return _other_value(inner, None) if default is None else None
    if hint is bool:
        return not default
    if hint is int:
        return 1 if default is None else default + 1
    if hint is float:
        return 0.25 if default is None else default * 2 + 0.5
    if origin is tuple:
        return (0, 1) if default != (0, 1) else (1,)
    if hint is str:  # free text (LookHere's direction families): parsing does not validate it
        return 'other' if default != 'other' else 'text'
    raise AssertionError(f'no test value for {hint}')


def _option_cases():
    for name in vispe.list_pes():
        hints, defaults = _hints(name), vispe.pe_info(name)['options']
        yield pytest.param(name, dict(defaults), id=f'{name}-defaults')
        for key, default in defaults.items():
            yield pytest.param(name, {key: _other_value(hints[key], default)}, id=f'{name}-{key}')


@pytest.mark.parametrize('name, options', _option_cases())
def test_format_is_the_inverse_of_parse(name, options):
    parts = [(name, options)]
    typed = vispe.parse_pe_spec({'name': name, **options}, typed=True)
    text = vispe.format_pe_spec(parts)
    assert vispe.parse_pe_spec(text, typed=True) == typed
    assert vispe.format_pe_spec(vispe.parse_pe_spec(text)) == text  # canonical: a fixed point


@pytest.mark.parametrize('spellings', [
    ['rope_axial:theta=100', 'rope_axial: theta = 1e2', {'name': 'rope_axial', 'theta': 100},
     {'name': 'rope_axial', 'theta': '100.0'}],
    ['peg:blocks=0|1|2', 'peg:blocks=0-2', 'peg:blocks=[0, 1, 2]', {'name': 'peg', 'blocks': [0, 1, 2]}],
    ['irpe:shared_heads=false,method=cross', 'irpe:method=cross,shared_heads=0',
     {'name': 'irpe', 'shared_heads': False, 'method': 'cross'}],
    ['rope_mixed+learned', ['rope_mixed', {'name': 'learned'}], 'rope_mixed + learned'],
    ['', None, 'none'],
])
def test_every_spelling_of_a_spec_formats_alike(spellings):
    texts = {vispe.format_pe_spec(s) for s in spellings}
    assert len(texts) == 1
    text = texts.pop()
    for s in spellings:
        assert vispe.parse_pe_spec(text, typed=True) == vispe.parse_pe_spec(s, typed=True)


def test_format_writes_options_in_the_constructors_order():
    assert vispe.format_pe_spec({'name': 'irpe', 'shared_heads': False, 'method': 'cross'}) == \
        'irpe:method=cross,shared_heads=false'
    assert vispe.format_pe_spec('rope_axial:grid_mode=normalized,theta=50+learned') == \
        'rope_axial:theta=50.0,grid_mode=normalized+learned'


def test_format_refuses_what_parse_refuses():
    with pytest.raises(ValueError, match="unknown encoding 'ropee'"):
        vispe.format_pe_spec('ropee')
    with pytest.raises(ValueError, match="option 'theta' of encoding 'rope_axial': expected float"):
        vispe.format_pe_spec({'name': 'rope_axial', 'theta': 'big'})


def _readme_specs() -> List[str]:
    text = ' '.join(page.read_text() for page in DOC_PAGES if page.is_file())
    return sorted(set(re.findall(r"""\bpe=['"]([^'"]+)['"]""", text)))


@pytest.mark.skipif(not README.is_file(), reason='README not shipped')
def test_every_readme_spec_parses_and_round_trips():
    specs = _readme_specs()
    assert specs
    for spec in specs:
        typed = vispe.parse_pe_spec(spec, typed=True)
        assert vispe.parse_pe_spec(vispe.format_pe_spec(spec), typed=True) == typed, spec


def test_paired_encodings_share_one_signature():
    # ComRoPE-AP / -LD and PaPE / PaPE-RI declare their shared options once, in the parent
    assert vispe.pe_info('comrope_ap')['options'] == vispe.pe_info('comrope_ld')['options']
    pape, pape_ri = vispe.pe_info('pape')['options'], vispe.pe_info('pape_ri')['options']
    assert {k: v for k, v in pape.items() if k != 'parabolas'} == pape_ri
    with pytest.raises(ValueError, match="unknown option 'parabolas' for encoding 'pape_ri'"):
        vispe.create_pe('pape_ri:parabolas=3', dim=32, num_heads=2)
    with pytest.raises(ValueError, match="option 'bias_scale' of encoding 'pape'"):
        vispe.create_pe({'name': 'pape', 'bias_scale': 'nope'}, dim=32, num_heads=2)


def test_a_constructor_ending_in_options_takes_its_parents_options():
    class Parent(PositionalEncoding):
        def __init__(self, ctx: PEContext, *, scale: float = 1.0) -> None:
            super().__init__(ctx)
            self.scale = scale

    class Child(Parent):
        def __init__(self, ctx: PEContext, *, width: int = 2, **options: Any) -> None:
            super().__init__(ctx, **options)
            self.width = width

    params, hints, var_kw = signature_options(Child)
    assert list(params)[2:] == ['width', 'scale'] and not var_kw
    assert hints['scale'] is float and hints['width'] is int
    child = Child(PEContext(dim=8), width=3, scale=2.0)
    assert (child.width, child.scale) == (3, 2.0)
    with pytest.raises(ValueError, match="unknown option 'scael'.*Did you mean 'scale'"):
        Child(PEContext(dim=8), scael=2.0)
