"""Checkpoints that survive a kill at any moment.

`atomic_save` writes to a temporary file in the same folder, flushes it to disk and renames it
over the target with `os.replace` (atomic on POSIX and Windows), so a reader sees either the old
or the new file, never half of one. A run keeps two kinds:

* ``checkpoint.pt``: everything needed to continue exactly (model, optimiser, scheduler, grad
  scaler, EMA, every rank's RNG states, epoch / batch-in-epoch / step, best metric, config);
* ``best.pt``: the best evaluated weights with what rebuilds the model (``model_spec``: the model
  name and keyword arguments, encoding included), its metrics and the config. This is what
  ``python -m train.extrapolate`` reads.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Union

import torch

__all__ = ['atomic_save', 'load_checkpoint', 'CHECKPOINT_VERSION']

CHECKPOINT_VERSION = 1


def atomic_save(obj: Any, path: Union[str, Path]) -> Path:
    """``torch.save`` to ``path`` through a temporary file + fsync + ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f'.{path.name}.', suffix='.tmp', dir=path.parent)
    try:
        with os.fdopen(fd, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if hasattr(os, 'O_DIRECTORY'):  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    return path


def load_checkpoint(path: Union[str, Path]) -> Dict[str, Any]:
    """Load a vispe training checkpoint (``checkpoint.pt`` or ``best.pt``) on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'checkpoint {str(path)!r} does not exist')
    ckpt = torch.load(path, map_location='cpu', weights_only=True)
    if not isinstance(ckpt, dict) or 'model_spec' not in ckpt or 'model' not in ckpt:
        raise ValueError(f'{str(path)!r} is not a checkpoint written by python -m train '
                         f'(no model_spec / model entries)')
    if ckpt.get('version', 0) > CHECKPOINT_VERSION:
        raise ValueError(f'{str(path)!r} was written by a newer version (format {ckpt["version"]}, '
                         f'this code reads up to {CHECKPOINT_VERSION})')
    return ckpt
