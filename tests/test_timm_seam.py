"""The seam to timm: private names behind one module, the supported range checked, the entrypoint
wrapping an explicit, idempotent, reversible step."""
import ast
from pathlib import Path

import pytest
import timm

import vispe
from vispe import _timm

ROOT = Path(__file__).resolve().parents[1]


def _private_timm_imports(source: str) -> list:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('timm'):
            private_module = any(part.startswith('_') for part in node.module.split('.'))
            private_names = [a.name for a in node.names if a.name.startswith('_')]
            if private_module or private_names:
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.startswith('timm') and any(p.startswith('_') for p in a.name.split('.'))]
    return found


def test_only_the_timm_module_imports_timm_privates():
    importers = {str(p.relative_to(ROOT)) for p in (ROOT / 'vispe').rglob('*.py')
                 if _private_timm_imports(p.read_text())}
    assert importers == {'vispe/_timm.py'}


def test_the_private_import_check_sees_private_names():
    assert _private_timm_imports('from timm.models._registry import x')
    assert _private_timm_imports('from timm.layers.pos_embed_sincos import _apply_coord_augs')
    assert not _private_timm_imports('from timm.layers import trunc_normal_')


@pytest.mark.parametrize('version', ['1.0.20', '1.0.30', '1.1.0', '2.0'])
def test_timm_outside_the_supported_range_is_refused_with_the_range(version):
    with pytest.raises(ImportError, match=r'vispe supports timm >= 1\.0\.31, < 1\.1; timm ' + version.replace('.', r'\.')):
        _timm.check_version(version)


def test_the_installed_timm_is_in_the_declared_range():
    _timm.check_version()
    pyproject = (ROOT / 'pyproject.toml').read_text()
    low, high = _timm.SUPPORTED
    assert f'"timm>={low},<{high}"' in pyproject  # declared = checked


def _wrapped() -> dict:
    return {n: f for n, f in _timm.model_entrypoints().items() if hasattr(f, '_vispe_original')}


def test_entrypoint_wrapping_is_idempotent_and_reversible():
    before = _wrapped()
    assert 'vit_tiny_patch16_224' in before
    try:
        vispe.wrap_timm_entrypoints()
        assert _wrapped() == before  # the same wrapper objects: nothing wrapped twice
        vispe.unwrap_timm_entrypoints()
        assert not _wrapped()
        registry = _timm.model_entrypoints()
        for name, wrapper in before.items():
            assert registry[name] is wrapper._vispe_original
        with pytest.raises(TypeError, match='pe'):
            timm.create_model('vit_tiny_patch16_224', pe='rope_mixed')
    finally:
        vispe.wrap_timm_entrypoints()
    assert set(_wrapped()) == set(before)
    assert isinstance(timm.create_model('vit_tiny_patch16_224', pe='rope_mixed', depth=1), vispe.VisionTransformer)
