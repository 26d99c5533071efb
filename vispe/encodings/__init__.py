"""Encodings, one family per module. Importing this package imports every module in it, which
registers each encoding by name (`vispe.register_pe`); the contract they implement is `vispe.contract`."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith('_'):
        importlib.import_module(f'{__name__}.{_module.name}')
