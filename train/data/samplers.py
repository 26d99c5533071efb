"""Samplers: per-epoch shuffles drawn from (seed, epoch), sharded by rank, startable mid-epoch."""
from __future__ import annotations

import itertools
from typing import Iterator, Sized

import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ..rng import derive_seed

__all__ = ['TrainSampler', 'ShardSampler', 'make_loader']


class TrainSampler(Sampler[int]):
    """This rank's share of an epoch's shuffled order, optionally starting after ``skip`` items.

    The order of epoch ``e`` depends only on ``(seed, e)`` and the world size: torch's
    `DistributedSampler` (each rank takes every ``world``-th index of one shared permutation), or
    timm's `RepeatAugSampler` when ``repeats > 1`` (repeated augmentation, DeiT: each image appears
    ``repeats`` times per epoch, on different ranks). ``skip`` drops this rank's first items: a run
    resumed at batch ``b`` passes ``b * batch_size``.
    """

    def __init__(self, dataset: Sized, rank: int, world_size: int, seed: int, repeats: int = 0) -> None:
        self.seed = seed
        self.repeats = repeats
        if repeats > 1:
            self.base: Sampler[int] = RepeatAugSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                                       num_repeats=repeats)
        else:
            self.base = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
        self.epoch = 0
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip
        # RepeatAugSampler seeds its permutation with the epoch alone: fold our seed in
        self.base.set_epoch(derive_seed(self.seed, epoch) if self.repeats > 1 else epoch)

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.base), self.skip, None)

    def __len__(self) -> int:
        return max(len(self.base) - self.skip, 0)

    def full_length(self) -> int:
        """Items per epoch for this rank (without the skip)."""
        return len(self.base)


class ShardSampler(Sampler[int]):
    """Evaluation: rank ``r`` takes indices ``r, r + world, ...`` in order, no padding, no duplicates,
    so metrics summed over ranks are exactly the metrics of the whole set."""

    def __init__(self, dataset: Sized, rank: int, world_size: int) -> None:
        self.indices = range(rank, len(dataset), world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(dataset: Dataset, sampler: Sampler, batch_size: int, workers: int, device: torch.device,
                drop_last: bool, collate_fn=None, seed: int = 0) -> DataLoader:
    """A DataLoader that never draws from the global torch RNG (its own generator), so creating one
    mid-run does not shift the random stream that dropout and initialisation use."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers,
                      pin_memory=device.type == 'cuda', drop_last=drop_last, collate_fn=collate_fn,
                      generator=generator, persistent_workers=False,
                      prefetch_factor=4 if workers > 0 else None)
