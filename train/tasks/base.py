"""The task interface: what one kind of model (classifier, detector, NeRF, VLM) gives the shared loop.

The loop (`train.engine.Trainer`) owns everything that is the same for every model: devices and
DDP, the optimiser and schedule, mixed precision, clipping, EMA, checkpoints and exact resume,
progress bars, logs, the resolution sweep. A task owns the rest, through a few methods:

==========================  ==========================================================================
``ModelConfig``             dataclass of the ``model:`` section (validated like every section)
``DataConfig``              dataclass of the ``data:`` section
``LossConfig``              dataclass of the ``loss:`` section (`EmptySection` if the task has none)
``metric``, ``metric_mode`` the eval metric that picks ``best.pt`` and whether higher is better
``chance_level(spec)``      optional: the metric of a guessing model (a line in the extrapolation plot)
``build_model()``           the model to train (pretrained weights loaded here)
``model_spec(model)``       JSON-serialisable recipe stored in checkpoints ...
``rebuild_model(spec)``     ... and turned back into a model (evaluation, extrapolation)
``train_dataset()``         items for training; ``eval_dataset(size)`` for evaluation, at input
                            resolution ``size`` when given (tasks without a notion of resolution
                            raise ValueError)
``collate_fn``              optional batch collation
``train_step(model, batch, step)``  loss (a scalar tensor) and extra scalars to log; runs under autocast
``eval_step(model, batch)`` per-batch *sums* (tensors); ``summarize(sums)`` turns the sums over
                            all ranks into metrics. Tasks whose metric is not a sum (COCO AP)
                            override ``evaluate`` instead.
==========================  ==========================================================================

Every item a dataset yields may carry, as its last element, its own dataset index when its input
was unreadable (the item then holds the next readable input instead), else -1; ``unreadable(batch)``
returns those indices (none when the task has no such slot), and the loop reports how many distinct
inputs were unreadable: a bad file is counted once, however many epochs, ranks or repeats meet it.

A new task is a module ``train/tasks/<name>.py`` with ``@register_task('<name>')`` on its class;
configs select it with ``task: <name>`` and the module is imported on first use.
"""
from __future__ import annotations

import difflib
import importlib
import pkgutil
from pathlib import Path
from typing import Any, Callable, ClassVar, Dict, Iterable, List, Literal, Optional, Tuple, Type

import torch
from torch import nn
from torch.utils.data import Dataset

from ..schema import Config, EmptySection

__all__ = ['Task', 'register_task', 'get_task', 'list_tasks']

_TASKS: Dict[str, Type['Task']] = {}


class Task:
    """Base class of the tasks of the training script (see the module docstring)."""
    name: ClassVar[str] = ''
    ModelConfig: ClassVar[type] = EmptySection
    DataConfig: ClassVar[type] = EmptySection
    LossConfig: ClassVar[type] = EmptySection
    metric: ClassVar[str] = 'loss'
    metric_mode: ClassVar[Literal['max', 'min']] = 'min'
    collate_fn: Optional[Callable] = None

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """Cross-section checks after every section validated; raise `ConfigError` naming the key."""

    # ------------------------------------------------------------------ model
    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        raise NotImplementedError

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        raise NotImplementedError

    def chance_level(self, spec: Dict[str, Any]) -> Optional[float]:
        """``metric`` of a model of ``spec`` that guesses; None when the task has no such level."""
        return None

    # ------------------------------------------------------------------ data
    def train_dataset(self) -> Dataset:
        raise NotImplementedError

    def eval_dataset(self, size: Optional[int] = None) -> Dataset:
        raise NotImplementedError

    def unreadable(self, batch: Any) -> List[int]:
        """Dataset indices of the unreadable inputs of ``batch`` (last element of each item by convention)."""
        return []

    # ------------------------------------------------------------------ steps
    def to_device(self, batch: Any, device: torch.device) -> Any:
        if torch.is_tensor(batch):
            return batch.to(device, non_blocking=True)
        if isinstance(batch, (list, tuple)):
            return type(batch)(self.to_device(b, device) for b in batch)
        if isinstance(batch, dict):
            return {k: self.to_device(v, device) for k, v in batch.items()}
        return batch

    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        raise NotImplementedError

    def eval_step(self, model: nn.Module, batch: Any) -> Dict[str, torch.Tensor]:
        raise NotImplementedError

    def summarize(self, sums: Dict[str, float]) -> Dict[str, float]:
        raise NotImplementedError

    def evaluate(self, model: nn.Module, batches: Iterable[Any], device: torch.device, autocast: Any,
                 reduce: Callable[[Dict[str, torch.Tensor]], Dict[str, float]]) -> Dict[str, float]:
        """Metrics over ``batches`` (this rank's shard); ``reduce`` sums over ranks."""
        totals: Dict[str, torch.Tensor] = {}
        model.eval()
        with torch.no_grad():
            for batch in batches:
                batch = self.to_device(batch, device)
                with autocast():
                    sums = self.eval_step(model, batch)
                for k, v in sums.items():
                    totals[k] = totals.get(k, 0) + v.detach().double()
        return self.summarize(reduce(totals))


def register_task(name: str) -> Callable[[Type[Task]], Type[Task]]:
    """Class decorator: make a `Task` available as ``task: name`` in configs."""
    def wrap(cls: Type[Task]) -> Type[Task]:
        if name in _TASKS and _TASKS[name] is not cls:
            raise ValueError(f'task {name!r} is already registered by {_TASKS[name].__name__}')
        cls.name = name
        _TASKS[name] = cls
        return cls
    return wrap


def list_tasks() -> list:
    """Registered tasks and the task modules of this package (imported on use)."""
    modules = {m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name != 'base'}
    return sorted(set(_TASKS) | modules)


def get_task(name: str) -> Type[Task]:
    """The task class registered as ``name``, importing ``train/tasks/<name>.py`` if needed."""
    if name not in _TASKS and name in list_tasks():
        importlib.import_module(f'{__package__}.{name}')
    if name not in _TASKS:
        close = difflib.get_close_matches(name, list_tasks(), n=2, cutoff=0.5)
        hint = f' Did you mean {" or ".join(map(repr, close))}?' if close else ''
        raise ValueError(f'unknown task {name!r}.{hint} Available: {", ".join(list_tasks()) or "none"}.')
    return _TASKS[name]
