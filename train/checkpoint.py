"""Checkpoints that survive a kill at any moment.

`atomic_save` writes to a temporary file in the same folder, flushes it to disk and renames it
over the target with `os.replace` (atomic on POSIX and Windows), so a reader sees either the old
or the new file, never half of one. A kill during the write leaves the temporary file behind;
`remove_stale_temporaries` deletes it when the run starts again. A run keeps two kinds:

* ``checkpoint.pt``: everything needed to continue exactly (model, optimiser, scheduler, grad
  scaler, EMA, every rank's RNG states, epoch / batch-in-epoch / step, best metric, config);
* ``best.pt``: the best evaluated weights with what rebuilds the model (``model_spec``: the model
  name and keyword arguments, encoding included), its metrics and the config. This is what
  ``python -m train.extrapolate`` reads.
"""
from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Dict, List, Union

import torch

__all__ = ['atomic_save', 'load_checkpoint', 'remove_stale_temporaries', 'CheckpointError', 'CHECKPOINT_VERSION']

CHECKPOINT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint file is damaged or was not written by ``python -m train``; the message names it."""


def atomic_save(obj: Any, path: Union[str, Path]) -> Path:
    """``torch.save`` to ``path`` through a temporary file + fsync + ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f'.{path.name}.{secrets.token_hex(8)}.tmp'
    # os.open with 0o666 lets the umask decide the mode, as for any file the user creates
    # (tempfile.mkstemp would make it 0600, and os.replace keeps that mode)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_BINARY', 0), 0o666)
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


def remove_stale_temporaries(path: Union[str, Path]) -> List[Path]:
    """Delete the temporary files that writes of ``path`` killed mid-way left behind; returns them.

    Call it only while no other process writes ``path`` (at the start of the run that owns it).
    """
    path = Path(path)
    stale = sorted(path.parent.glob(f'.{path.name}.*.tmp'))  # atomic_save's names
    for tmp in stale:
        tmp.unlink(missing_ok=True)
    return stale


def load_checkpoint(path: Union[str, Path]) -> Dict[str, Any]:
    """Load a vispe training checkpoint (``checkpoint.pt`` or ``best.pt``) on the CPU.

    Raises `CheckpointError` naming the file when it is truncated, garbage or not from ``python -m train``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f'checkpoint {str(path)!r} does not exist')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except (OSError, MemoryError):  # the file may be fine (permissions, I/O, size): the message says why
        raise
    except Exception as e:  # torch reports damage as RuntimeError, EOFError, UnpicklingError, KeyError, ...
        reason = (str(e).strip().splitlines() or [''])[0][:200]
        raise CheckpointError(f'checkpoint {str(path)!r} is damaged (truncated or not a torch file: '
                              f'{type(e).__name__}: {reason})') from None
    if not isinstance(ckpt, dict) or 'model_spec' not in ckpt or 'model' not in ckpt:
        raise CheckpointError(f'{str(path)!r} is not a checkpoint written by python -m train '
                              f'(no model_spec / model entries)')
    if ckpt.get('version', 0) > CHECKPOINT_VERSION:
        raise CheckpointError(f'{str(path)!r} was written by a newer version (format {ckpt["version"]}, '
                              f'this code reads up to {CHECKPOINT_VERSION})')
    return ckpt
