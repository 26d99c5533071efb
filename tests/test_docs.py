"""The documentation: every Python block of the README and of docs/ runs, the site builds with
``mkdocs build --strict``, and what the docs generate (encoding table, figures) matches the code.

A block that cannot run in a test says so on the line before its fence:

    <!-- docs-test: skip needs a download (pretrained=True) -->
    <!-- docs-test: raises ValueError -->       the block must raise it, with the message shown in
                                                 the ```text block that follows (``...``: text left out)

The blocks of one page share a namespace and run in order, as a reader would run them.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import List, NamedTuple, Optional

import pytest
import torch

import vispe
from vispe import registry

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / 'docs'
_FENCE = re.compile(r'^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$', re.M | re.S)
_DIRECTIVE = re.compile(r'<!-- docs-test: (?P<what>skip|raises) ?(?P<arg>.*?) -->\s*$')


class Block(NamedTuple):
    page: Path
    line: int  # line of the first code line in the page
    lang: str
    code: str
    directive: Optional[str]
    arg: str


def pages() -> List[Path]:
    return [ROOT / 'README.md'] + sorted(p for p in DOCS.rglob('*.md') if 'gen' not in p.relative_to(DOCS).parts)


def blocks(page: Path) -> List[Block]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        before = text[:m.start()].rstrip('\n').rsplit('\n', 1)[-1]
        d = _DIRECTIVE.search(before)
        indent = len(m.group('indent'))
        code = '\n'.join(line[indent:] for line in m.group('body').split('\n'))
        out.append(Block(page, text.count('\n', 0, m.start()) + 2, m.group('lang'), code,
                         d.group('what') if d else None, d.group('arg').strip() if d else ''))
    return out


def _label(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _run_page(page: Path) -> int:
    """Run the page's Python blocks in one namespace; returns how many ran."""
    torch.manual_seed(0)
    namespace: dict = {'__name__': '__docs__'}
    found = blocks(page)
    ran = 0
    registered = dict(registry._REGISTRY)  # a page may register an example encoding: not beyond the page
    try:
        for b in _python_blocks(found):
            _run_block(b, found, namespace)
            ran += 1
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(registered)
    return ran


def _python_blocks(found: List[Block]) -> List[Block]:
    return [b for b in found if b.lang == 'python' and b.directive != 'skip']


def _run_block(b: Block, found: List[Block], namespace: dict) -> None:
    page, i = b.page, found.index(b)
    code = compile('\n' * (b.line - 1) + b.code, _label(page), 'exec')
    if b.directive != 'raises':
        exec(code, namespace)
        return
    expected = next((n for n in found[i + 1:] if n.lang == 'text'), None)
    assert expected is not None, f'{_label(page)}:{b.line}: a raises block needs the message in a text block'
    with pytest.raises(BaseException) as info:
        exec(code, namespace)
    assert type(info.value).__name__ == b.arg, f'{_label(page)}:{b.line}: raised {info.value!r}'
    name, _, shown = expected.code.strip().partition(': ')
    said = str(info.value)
    assert name == b.arg and _shows(shown, said), \
        f'{_label(page)}:{b.line}: the page shows {expected.code.strip()!r}, the library says {said!r}'


def _shows(shown: str, said: str) -> bool:
    """The shown message is the library's, ``...`` standing for any text left out."""
    return re.fullmatch('.*?'.join(re.escape(part) for part in shown.split('...')), said, re.S) is not None



def test_every_skipped_block_says_why():
    for page in pages():
        for b in blocks(page):
            if b.directive == 'skip':
                assert b.arg, f'{_label(page)}:{b.line}: say why the block is skipped'
            if b.directive == 'raises':
                assert b.lang == 'python' and b.arg.isidentifier(), f'{_label(page)}:{b.line}: raises ExceptionName'


@pytest.mark.parametrize('page', pages(), ids=_label)
def test_the_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    _run_page(page)


# ---------------------------------------------------------------- README as a front page
README = ROOT / 'README.md'


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250, 'the README is a front page: move details to docs/'
    for page in re.findall(r'\]\((docs/[^)#]+)', text):
        assert (ROOT / page).is_file(), f'the README links to a missing page {page}'


def test_the_readme_test_command_is_what_ci_runs():
    ci = [line for line in (ROOT / '.ci' / 'run').read_text().splitlines() if line and not line.startswith(('#', 'set', 'cd'))]
    readme = README.read_text()
    assert ' && '.join(ci) in readme, f'the README must show the CI command: {" && ".join(ci)}'


def test_the_readme_encoding_table_is_the_generated_one():
    from vispe.__main__ import markdown_table
    text = README.read_text()
    start = text.index('<!-- encoding table: generated by `python -m vispe --markdown` -->')
    table = text[start:].split('\n', 1)[1].split('\n\n', 1)[0].strip()
    assert table == markdown_table(), 'regenerate the README table: python -m vispe --markdown'


# ---------------------------------------------------------------- the site
@pytest.fixture(scope='module')
def site(tmp_path_factory) -> Path:
    pytest.importorskip('mkdocs', reason='mkdocs is not installed (pip install -e ".[docs]")')
    pytest.importorskip('material', reason='mkdocs-material is not installed (pip install -e ".[docs]")')
    pytest.importorskip('mkdocstrings_handlers.python', reason='mkdocstrings[python] is not installed')
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    out = tmp_path_factory.mktemp('site')
    # in this process, as `mkdocs build --strict` runs it: any warning (broken link, missing reference
    # entry, unknown generator) aborts the build
    build(load_config(str(ROOT / 'mkdocs.yml'), strict=True, site_dir=str(out)))
    return out


def test_mkdocs_build_strict(site):
    assert (site / 'index.html').is_file() and (site / 'api' / 'vispe' / 'index.html').is_file()


def test_the_search_index_lists_every_registered_encoding(site):
    index = json.loads((site / 'search' / 'search_index.json').read_text())
    words = set(re.findall(r'[\w]+', ' '.join(doc['text'] + ' ' + doc['title'] for doc in index['docs'])))
    missing = [name for name in vispe.list_pes() if name not in words]
    assert not missing, f'registered encodings not found by the docs search: {missing}'


def test_every_registered_encoding_is_described_on_an_encodings_page():
    text = ' '.join(p.read_text() for p in (DOCS / 'encodings').glob('*.md') if p.name != 'index.md')
    missing = [name for name in vispe.list_pes() if not re.search(rf'`{name}[`:]', text)]
    assert not missing, f'write a page in docs/encodings/ for {missing}'


# ---------------------------------------------------------------- figures from data
def test_the_figures_are_made_from_the_results(tmp_path):
    """docs/figures/*.md are exactly what make_figures.py makes of benchmarks/results/ (never typed)."""
    subprocess.run([sys.executable, str(ROOT / 'benchmarks' / 'make_figures.py'), '--out', str(tmp_path),
                    '--no-plots'], check=True, cwd=ROOT)
    made = {p.name: p.read_text() for p in tmp_path.glob('*.md')}
    shipped = {p.name: p.read_text() for p in (DOCS / 'figures').glob('*.md')}
    assert made, 'no results in benchmarks/results/'
    assert made == shipped, 'run python benchmarks/make_figures.py'
