"""MkDocs hook: fills the generated parts of the docs from the code, so that they cannot drift.

A page asks for generated content with an HTML comment on a line of its own:

    <!-- gen:encoding-table -->                 every registered encoding (`python -m vispe --markdown`)
    <!-- gen:encoding-table rope_axial,liere --> the rows of those encodings only
    <!-- gen:options rope_axial -->              the encoding's options: type and default, from its signature
    <!-- gen:config-schema -->                   every key of the training config, from `vispe_train.schema`
                                                 and the tasks' section dataclasses

Read on GitHub the comments are invisible; the site shows the tables. The figures of measurements are
not made here but by ``benchmarks/make_figures.py`` from benchmark outputs (``docs/figures/``).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any, List

_ROOT = str(Path(__file__).resolve().parents[2])
_MARKER = re.compile(r'^<!-- gen:([a-z-]+)(?: ([^>]*?))? -->$', re.M)


def _type_name(hint: Any) -> str:
    if hint is inspect.Parameter.empty:
        return ''
    if isinstance(hint, type):
        return hint.__name__
    text = str(hint).replace('typing.', '')
    return re.sub(r"<class '([\w.]+)'>", lambda m: m.group(1).split('.')[-1], text)


def _cell(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else f"'{value}'"
    return '`' + text.replace('|', '\\|') + '`'


def encoding_table(names: str = '') -> str:
    from vispe.__main__ import markdown_table
    table = markdown_table()
    if not names:
        return table
    wanted = {n.strip() for n in names.split(',')}
    lines = table.splitlines()
    rows = [line for line in lines[2:] if line.split('`')[1] in wanted]
    missing = wanted - {line.split('`')[1] for line in rows}
    if missing:
        raise ValueError(f'gen:encoding-table: not registered: {sorted(missing)}')
    return '\n'.join(lines[:2] + rows)


def options_table(name: str) -> str:
    """The options of one registered encoding: the keyword arguments of its class, typed."""
    from vispe import registry
    entry = registry._lookup(name.strip())
    hints = typing.get_type_hints(entry.cls.__init__)
    lines = [f'Options of `{entry.name}` (keyword arguments of `{entry.cls.__module__}.{entry.cls.__qualname__}`; '
             f'spec `{entry.name}:key=value,...`):', '', '| option | type | default |', '|---|---|---|']
    for key, param in entry.options.items():
        default = '(required)' if param.default is inspect.Parameter.empty else _cell(param.default)
        lines.append(f'| `{key}` | {_type_name(hints.get(key, param.annotation))} | {default} |')
    if not entry.options:
        lines = [f'`{entry.name}` has no options.']
    return '\n'.join(lines)


def _section_rows(cls: type, prefix: str, out: List[str], nested: List[tuple]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints.get(f.name, f.type)
        if dataclasses.is_dataclass(hint):
            nested.append((hint, f'{prefix}{f.name}.'))
            continue
        if f.default is not dataclasses.MISSING:
            default = _cell(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = _cell(f.default_factory())
        else:
            default = '(required)'
        bounds = ', '.join(f'{k} {v}' for k, v in (('>=', f.metadata.get('min')), ('<=', f.metadata.get('max')))
                           if v is not None)
        text = f.metadata.get('help', '') + (f' ({bounds})' if bounds else '')
        out.append(f'| `{prefix}{f.name}` | {_type_name(hint).replace("|", chr(92) + "|")} | {default} | '
                   f'{text.replace("|", chr(92) + "|")} |')


def _section(cls: type, prefix: str, title: str) -> str:
    out = [f'### {title}', '', (inspect.getdoc(cls) or '').split('\n\n')[0], '',
           '| key | type | default | meaning |', '|---|---|---|---|']
    nested: List[tuple] = []
    _section_rows(cls, prefix, out, nested)
    text = '\n'.join(out)
    for sub, sub_prefix in nested:
        text += '\n\n' + _section(sub, sub_prefix, f'`{sub_prefix[:-1]}`')
    return text


def config_schema() -> str:
    """Every config key: the generic sections, then the ``model`` / ``data`` / ``loss`` sections of
    each registered task, read from the dataclasses the loader validates against."""
    from vispe_train import schema
    from vispe_train.tasks import get_task, list_tasks
    parts = [_section(schema.Config, '', 'Top level')]
    for name in ('optim', 'sched', 'train', 'log', 'extrapolate'):
        cls = typing.get_type_hints(schema.Config)[name]
        parts.append(_section(cls, f'{name}.', f'`{name}`'))
    for task in list_tasks():
        cls = get_task(task)
        parts.append(f'## Task `{task}`\n\n{(inspect.getdoc(cls) or "").splitlines()[0]}')
        for section in ('model', 'data', 'loss'):
            sec_cls = getattr(cls, f'{section.capitalize()}Config', None)
            if sec_cls is None or not dataclasses.fields(sec_cls):
                parts.append(f'### `{section}` ({task})\n\nNo keys: the section stays empty.')
                continue
            parts.append(_section(sec_cls, f'{section}.', f'`{section}` ({task})'))
    return '\n\n'.join(parts)


GENERATORS = {'encoding-table': encoding_table, 'options': options_table, 'config-schema': config_schema}


def render(markdown: str) -> str:
    """Replace every marker by its generated content (an unknown marker is an error)."""
    def fill(m: re.Match) -> str:
        if m.group(1) not in GENERATORS:
            raise ValueError(f'unknown docs generator {m.group(1)!r}; known: {sorted(GENERATORS)}')
        args = (m.group(2),) if m.group(2) else ()
        return GENERATORS[m.group(1)](*args)
    return _MARKER.sub(fill, markdown)


def on_config(config: Any, **kwargs: Any) -> Any:
    # the docs describe the checkout they are built from, whatever vispe is installed elsewhere
    # (mkdocs restores sys.path after loading a hook module, so this runs as an event)
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    return config


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return render(markdown)
