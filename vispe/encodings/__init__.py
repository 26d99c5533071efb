"""Encodings, one family per module. Importing this package imports every module in it, which
registers each encoding by name (`vispe.register_pe`)."""
import importlib
import pkgutil

from .base import HOOKS, Capabilities, ComposedPE, PEContext, PositionalEncoding

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith('_'):
        importlib.import_module(f'{__name__}.{_module.name}')

__all__ = ['HOOKS', 'Capabilities', 'PEContext', 'PositionalEncoding', 'ComposedPE']
