"""Random streams: seeding, per-sample / per-step seeded blocks, and state capture for checkpoints."""
from __future__ import annotations

import contextlib
import random
from typing import Any, Dict, Iterator, Sequence

import numpy as np
import torch

__all__ = ['seed_everything', 'derive_seed', 'seeded', 'get_rng_state', 'set_rng_state']


def derive_seed(*keys: int) -> int:
    """A 32-bit seed determined by a tuple of integers (seed, epoch, index, ...), well mixed."""
    return int(np.random.SeedSequence([int(k) & 0xFFFFFFFF for k in keys]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and every GPU)."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)


@contextlib.contextmanager
def seeded(*keys: int) -> Iterator[None]:
    """Run a block with python, numpy and torch-CPU RNGs seeded from ``keys``; restore them after.

    Used where randomness must be a function of (seed, epoch, index) or (seed, step) rather than
    of how much randomness was drawn before (augmentation of one image, mixup of one batch), so
    that a resumed run, another worker count or another rank order draws exactly the same.
    """
    seed = derive_seed(*keys)
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def get_rng_state() -> Dict[str, Any]:
    """Every global random stream of this process (python, numpy, torch CPU, each CUDA device)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: Dict[str, Any] = dict(
        python=random.getstate(), torch=torch.get_rng_state(),
        # as tensors and plain numbers, so checkpoints load with torch.load(weights_only=True)
        numpy=dict(kind=kind, keys=torch.from_numpy(keys.astype(np.int64)), pos=int(pos),
                   has_gauss=int(has_gauss), cached=float(cached)))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    """Restore what `get_rng_state` captured."""
    random.setstate(_as_python_state(state['python']))
    n = state['numpy']
    np.random.set_state((n['kind'], n['keys'].numpy().astype(np.uint32), n['pos'], n['has_gauss'], n['cached']))
    torch.set_rng_state(state['torch'])
    cuda: Sequence[torch.Tensor] = state.get('cuda') or ()
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(list(cuda)[:torch.cuda.device_count()])


def _as_python_state(state: Any) -> tuple:
    # torch.save round-trips the inner tuple of random.getstate() as a list
    version, internal, gauss = state
    return version, tuple(internal), gauss
