"""Imports of optional packages: each names the extra of vispe that installs it.

The core install (``pip install vispe``) holds what `vispe` itself imports: torch and timm. The
downstream models, the training script and the adapters into other libraries need more; the
extras of ``pyproject.toml`` group those packages, and a missing one fails here with the extra to
install instead of a bare ``ModuleNotFoundError``.
"""
from __future__ import annotations

import importlib
import re
from types import ModuleType
from typing import Dict, Optional, Tuple

__all__ = ['EXTRAS', 'SUPPORTED', 'UnsupportedVersionError', 'require', 'missing_message', 'check_version',
           'version_tuple']

EXTRAS = {  # import name -> (distribution, extra)
    'scipy': ('scipy', 'detection'),
    'pycocotools': ('pycocotools', 'detection'),
    'matplotlib': ('matplotlib', 'train'),
    'yaml': ('pyyaml', 'train'),
    'tqdm': ('tqdm', 'train'),
    'PIL': ('pillow', 'train'),
    'torchvision': ('torchvision', 'train'),
    'tensorboard': ('tensorboard', 'tensorboard'),
    'sklearn': ('scikit-learn', 'digits'),
    'open_clip': ('open_clip_torch', 'open_clip'),
    'transformers': ('transformers', 'transformers'),
    'diffusers': ('diffusers', 'diffusers'),
}

SUPPORTED: Dict[str, Tuple[str, str]] = {  # import name -> (lowest tested, first unsupported)
    'timm': ('1.0.31', '1.1'),
    'transformers': ('5.25', '6'),
    'diffusers': ('0.42', '0.43'),
    'open_clip': ('3.3', '4'),
}
"""The versions of the libraries vispe hosts or adapts to, stated once: pyproject's ranges and every
version gate read this table (tests/test_dependency_floor.py checks that they agree)."""


class UnsupportedVersionError(ImportError):
    """An installed library outside the versions vispe supports (`SUPPORTED`); the message names the
    range and the install command."""


def version_tuple(text: str) -> Tuple[int, ...]:
    """``'5.25.0.dev0'`` -> ``(5, 25, 0)``: the numeric release part, local and pre-release tags dropped."""
    return tuple(int(p) for p in re.findall(r'\d+', text.split('+')[0])[:3])


def _install_hint(module: str) -> str:
    low, high = SUPPORTED[module]
    if module in EXTRAS:
        dist, extra = EXTRAS[module]
        return f'pip install "vispe[{extra}]" (or pip install "{dist}>={low},<{high}")'
    return f'pip install "{module}>={low},<{high}"'


def check_version(module: str, version: str, purpose: str) -> None:
    """Raise `UnsupportedVersionError` when ``version`` of ``module`` (a key of `SUPPORTED`) is outside
    the supported range; ``purpose`` says what needs it."""
    low, high = SUPPORTED[module]
    if not version_tuple(low) <= version_tuple(version) < version_tuple(high):
        raise UnsupportedVersionError(f'{purpose} supports {module} >= {low}, < {high}; {module} {version} is '
                                      f'installed: {_install_hint(module)}')


def missing_message(module: str, purpose: str) -> str:
    """The error text for the missing top-level package ``module``, needed for ``purpose``."""
    top = module.split('.')[0]
    dist, extra = EXTRAS[top]
    if top in SUPPORTED:
        low, high = SUPPORTED[top]
        dist_spec = f'"{dist}>={low},<{high}"'
    else:
        dist_spec = dist
    return f'{purpose} needs {dist}, which is not installed: pip install "vispe[{extra}]" (or pip install {dist_spec})'


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError naming the extra that installs it; a
    library with a supported range (`SUPPORTED`) is also version-checked (`check_version`)."""
    try:
        imported = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split('.')[0] != module.split('.')[0]:
            raise  # the package is there and something it imports is missing: its own error says what
        raise ModuleNotFoundError(missing_message(module, purpose), name=e.name) from e
    top = module.split('.')[0]
    if top in SUPPORTED:
        version: Optional[str] = getattr(importlib.import_module(top), '__version__', None)
        if version is not None:
            check_version(top, version, purpose)
    return imported
