"""Imports of optional packages: each names the extra of vispe that installs it.

The core install (``pip install vispe``) holds what `vispe` itself imports: torch and timm. The
downstream models, the training script and the adapters into other libraries need more; the
extras of ``pyproject.toml`` group those packages, and a missing one fails here with the extra to
install instead of a bare ``ModuleNotFoundError``.
"""
from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ['EXTRAS', 'require', 'missing_message']

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
    'transformers': ('transformers', 'vlm'),
}


def missing_message(module: str, purpose: str) -> str:
    """The error text for the missing top-level package ``module``, needed for ``purpose``."""
    dist, extra = EXTRAS[module.split('.')[0]]
    return f'{purpose} needs {dist}, which is not installed: pip install "vispe[{extra}]" (or pip install {dist})'


def require(module: str, purpose: str) -> ModuleType:
    """``importlib.import_module(module)``, or an ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split('.')[0] != module.split('.')[0]:
            raise  # the package is there and something it imports is missing: its own error says what
        raise ModuleNotFoundError(missing_message(module, purpose), name=e.name) from e
