"""Import arrows point one way: ``train -> models -> vispe``, and inside vispe from the hosts down to
the positions. Read from the source with ``ast`` (lazy imports inside functions count too), so an
arrow against the flow fails here before it becomes an import cycle."""
import ast
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Inside vispe: a module may import its own package and any module of a lower layer, nothing above.
# The first matching prefix gives a module's layer.
VISPE_LAYERS: List[Tuple[str, ...]] = [
    ('vispe._dtypes', 'vispe._tracing', 'vispe.options', 'vispe._timm', 'vispe.extras'),  # no vispe imports
    ('vispe._cache',),  # tensors reused across forwards, never while traced
    # the rotation kernels: pure tensor maths below the contract (vispe.rotary.base, the rotation encodings'
    # base class, sits above it with the registry)
    ('vispe.rotary.kernels', 'vispe.rotary.autograd', 'vispe.rotary.expm', 'vispe.rotary.fused', 'vispe.rotary.trust',
     'vispe.rotary.frequencies'),
    ('vispe.cameras',),
    ('vispe.positions',),
    ('vispe._compiled_state',),  # the contract's cache of costly states for compiled eval
    ('vispe.contract',),  # what an encoding is: the hooks, PEContext, PreparedPE
    ('vispe.registry', 'vispe.rotary'),
    ('vispe.encodings',),
    ('vispe.checks',),  # position properties as checks: used by the tests and by vispe.doctor
    ('vispe.attention', 'vispe.cross_attention', 'vispe.weights', 'vispe.naflex'),
    ('vispe.layers',),  # PE-aware timm attention and blocks
    ('vispe.host',),
    ('vispe.vit',),
    ('vispe.zoo', 'vispe.released'),  # checkpoints released with papers, loaded into vispe ViTs
    ('vispe.integrations', 'vispe.doctor'),  # adapters into other libraries' models; the check of any model
    ('vispe.multimodal',),  # deprecated names of the multimodal encodings, over encodings and the transformers adapter
    ('vispe', 'vispe.__main__'),
]
PACKAGES = {'vispe': 'vispe', 'vispe_models': 'models', 'vispe_train': 'train'}
PACKAGE_ORDER = ['vispe', 'vispe_models', 'vispe_train']  # train -> models -> vispe


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    package = next(p for p, folder in PACKAGES.items() if rel.parts[0] == folder)
    parts = [package, *rel.with_suffix('').parts[1:]]
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imports_of(source: str, module: str, is_package: bool) -> Iterator[str]:
    """Absolute names of the vispe / vispe_models / vispe_train modules that ``source`` imports."""
    base = module.split('.') if is_package else module.split('.')[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                prefix = base[:len(base) - node.level + 1]
                target = '.'.join(prefix + ([node.module] if node.module else []))
            else:
                target = node.module or ''
            # `from . import encodings` imports a submodule: name it
            names = [target] if node.module else [f'{target}.{alias.name}' for alias in node.names]
        else:
            continue
        for name in names:
            if name.split('.')[0] in PACKAGES:
                yield name


def _vispe_layer(module: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(VISPE_LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + '.')) and len(prefix) > best:
                best, rank = len(prefix), i
    if rank is None:
        raise AssertionError(f'{module} has no layer in VISPE_LAYERS: add it where it belongs')
    return rank


def _top_package(module: str) -> str:
    parts = module.split('.')
    return '.'.join(parts[:2]) if len(parts) > 1 else parts[0]


def arrow_against_flow(importer: str, imported: str) -> bool:
    """True when ``importer -> imported`` points up a layer (or from vispe into models / train)."""
    pkg_a, pkg_b = importer.split('.')[0], imported.split('.')[0]
    if pkg_a != pkg_b:
        return PACKAGE_ORDER.index(pkg_b) > PACKAGE_ORDER.index(pkg_a)
    if pkg_a != 'vispe' or imported == 'vispe':
        return False  # models and train are flat; `import vispe` from inside is the public API
    if _top_package(importer) == _top_package(imported) and importer != 'vispe':
        return False  # within one package (vispe.rotary.base -> vispe.rotary.kernels)
    return _vispe_layer(imported) > _vispe_layer(importer)


def _all_edges() -> Dict[str, List[str]]:
    edges = {}
    for folder in PACKAGES.values():
        for path in sorted((ROOT / folder).rglob('*.py')):
            module = _module_name(path)
            edges[module] = sorted(set(imports_of(path.read_text(), module, path.name == '__init__.py')))
    return edges


def test_every_import_follows_the_flow():
    wrong = [f'{a} -> {b}' for a, targets in _all_edges().items() for b in targets if arrow_against_flow(a, b)]
    assert not wrong, 'imports against the flow (hosts -> encodings -> contract -> positions):\n' + '\n'.join(wrong)


def test_contract_registry_and_rotary_import_no_encoding():
    edges = _all_edges()
    for module, targets in edges.items():
        if module.startswith(('vispe.contract', 'vispe.registry', 'vispe.rotary', 'vispe.positions')):
            assert not [t for t in targets if t.startswith('vispe.encodings')], module


@pytest.mark.parametrize('importer, source, imported', [
    ('vispe.contract', 'from .encodings import rope', 'vispe.encodings'),
    ('vispe.rotary.base', 'from ..encodings.base import X', 'vispe.encodings.base'),
    ('vispe.positions.core', 'def f():\n    from ..zoo import convert', 'vispe.zoo'),
    ('vispe.host', 'import vispe_models.detr', 'vispe_models.detr'),
    ('vispe_models.detr', 'from vispe_train import config', 'vispe_train'),
])
def test_the_check_catches_an_arrow_against_the_flow(importer, source, imported):
    found = list(imports_of(source, importer, is_package=False))
    assert found == [imported]
    assert arrow_against_flow(importer, imported)


@pytest.mark.parametrize('importer, imported', [
    ('vispe.encodings.rope', 'vispe.rotary.kernels'), ('vispe.zoo', 'vispe.host'),
    ('vispe_train.engine', 'vispe_models.detr'), ('vispe_models.detr', 'vispe.positions'),
    ('vispe.rotary.base', 'vispe.rotary.kernels'),
])
def test_arrows_with_the_flow_pass(importer, imported):
    assert not arrow_against_flow(importer, imported)
