"""Timing helpers shared by the benchmark scripts: interleaved medians and peak memory.

Absolute times on a shared machine mean little, so every script reports ratios against a baseline
measured in the same process; `compare` interleaves the candidates round by round so that drifts in
machine load hit all of them alike.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import resource
import statistics
import time
from typing import Callable, Dict

import torch

__all__ = ['time_fn', 'compare', 'peak_memory', 'sync', 'eval_step', 'train_step']


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


def peak_memory(fn: Callable[[], object], device: torch.device = torch.device('cpu')) -> int:
    """Peak bytes that ``fn()`` adds on top of what is already allocated.

    GPU: the CUDA allocator's peak. CPU: ``fn`` runs in a forked child process and the growth of
    its peak resident set (``ru_maxrss``) is returned, which counts every allocation, freed or not.
    """
    gc.collect()
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    ctx = mp.get_context('fork')
    queue = ctx.Queue()

    def child() -> None:
        # the OpenMP thread pool does not survive fork(): a parallel region in the child would deadlock
        torch.set_num_threads(1)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        fn()
        queue.put((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)

    proc = ctx.Process(target=child)
    proc.start()
    result = queue.get()
    proc.join()
    return result


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
