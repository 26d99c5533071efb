"""Timing helpers shared by the benchmark scripts: interleaved medians and peak memory.

Absolute times on a shared machine mean little, so every script reports ratios against a baseline
measured in the same process; `compare` interleaves the candidates round by round so that drifts in
machine load hit all of them alike.
"""
from __future__ import annotations

import gc
import statistics
import time
import weakref
from typing import Callable, Dict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ['time_fn', 'compare', 'peak_memory', 'TensorMemory', 'sync', 'eval_step', 'train_step']


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], warmup: int = 2, iters: int = 10, device: torch.device = torch.device('cpu')
            ) -> float:
    """Median seconds of ``fn()`` over ``iters`` runs after ``warmup``."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compile_models(models: Dict[str, torch.nn.Module], **options) -> Dict[str, torch.nn.Module]:
    """``torch.compile`` each model. Every model is another compilation of the same forward code,
    so dynamo's recompile limits (8 by default, a hard failure under ``fullgraph=True``) are raised
    to allow one per model and mode."""
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, 4 * len(models))
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * len(models))
    return {name: torch.compile(m, **options) for name, m in models.items()}


def compare(fns: Dict[str, Callable[[], object]], rounds: int = 7, per_round: int = 2, warmup: int = 2,
            device: torch.device = torch.device('cpu'), clock: str = 'wall') -> Dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds.

    ``clock='process'`` counts the CPU time of this process instead of wall time: on a machine
    shared with other jobs, run single-threaded (``torch.set_num_threads(1)``) with it, since
    descheduled threads inflate wall time by the number of parallel regions, not by the work.
    """
    if clock not in ('wall', 'process'):
        raise ValueError(f"clock must be 'wall' or 'process', got {clock!r}")
    now = time.perf_counter if clock == 'wall' else time.process_time
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: Dict[str, list] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            sync(device)
            t0 = now()
            for _ in range(per_round):
                fn()
            sync(device)
            samples[name].append((now() - t0) / per_round)
    return {k: statistics.median(v) for k, v in samples.items()}


class TensorMemory(TorchDispatchMode):
    """Bytes of tensor storage created inside this context and still alive, and their peak: on the
    CPU the quantity ``torch.cuda.max_memory_allocated`` reports on a GPU (what the tensors need, not
    what the allocator happens to hold), counted exactly and the same on every run."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for t in tree_leaves((args, kwargs)):  # storage that existed before (parameters, inputs)
            if isinstance(t, torch.Tensor) and t.device.type != 'meta':
                self._seen.setdefault(t.untyped_storage(), False)
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != 'meta':
                storage = t.untyped_storage()
                if storage not in self._seen:
                    self._seen[storage] = True
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._free, storage.nbytes())
        return out


def peak_memory(fn: Callable[[], object], device: torch.device = torch.device('cpu')) -> int:
    """Peak bytes of tensors that ``fn()`` allocates on top of what is already allocated (gradients
    and the activations saved for backward included): the CUDA allocator's peak on a GPU, a
    `TensorMemory` count on the CPU."""
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with TensorMemory() as tracker:
        fn()
    return tracker.peak


def eval_step(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """A no-grad forward of ``model`` on ``x`` (the model is put in eval mode)."""
    model.eval()

    def run():
        with torch.no_grad():
            return model(x)
    return run


def train_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], object]:
    """Forward + cross-entropy + backward of ``model`` on ``(x, y)`` (the model is put in train mode)."""
    model.train()

    def run():
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss
    return run
