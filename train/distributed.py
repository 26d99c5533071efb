"""Process group setup for ``torchrun`` (DDP or FSDP2: nccl on GPUs, gloo on CPU) and rank-aware helpers.

Under ``torchrun`` the environment carries ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``; without it
the script runs as a single process. Each rank drives one device (its local GPU, or the CPU).
"""
from __future__ import annotations

import datetime
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from .config import ConfigError

__all__ = ['DistEnv', 'init_distributed', 'shutdown_distributed', 'leave_process', 'all_reduce_sum',
           'all_gather_objects', 'barrier', 'broadcast_object', 'fully_shard_model', 'full_model_state',
           'load_full_model_state', 'full_optimizer_state', 'load_full_optimizer_state']

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: rank, world size and its device."""
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device('cpu')

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(spec: str, local_rank: int, key: str) -> torch.device:
    if spec == 'auto':
        spec = 'cuda' if torch.cuda.is_available() else 'cpu'
    if spec == 'cpu':
        return torch.device('cpu')
    match = re.fullmatch(r'cuda(?::(\d+))?', spec)
    if match is None:
        raise ConfigError(f"{key}: {spec!r} is not allowed; allowed values: 'auto', 'cpu', 'cuda', 'cuda:N'")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"{key}: {spec!r}, but this machine has no usable CUDA GPU; use 'cpu' or 'auto'")
    index = local_rank % count if match.group(1) is None else int(match.group(1))
    if index >= count:
        raise ConfigError(f'{key}: {spec!r}, but this machine has {count} GPU(s): cuda:0 to cuda:{count - 1}')
    return torch.device('cuda', index)


def init_distributed(device: str = 'auto', key: str = 'train.device') -> DistEnv:
    """Join the process group if launched by torchrun, and pick this rank's device.

    ``key`` names the setting ``device`` came from in errors (``train.device``, or a command-line flag).
    """
    world = int(os.environ.get('WORLD_SIZE', '1'))
    rank = int(os.environ.get('RANK', '0'))
    local_rank = int(os.environ.get('LOCAL_RANK', '0'))
    dev = _pick_device(device, local_rank, key)
    if world > 1 and not dist.is_initialized():
        backend = 'nccl' if dev.type == 'cuda' else 'gloo'
        if dev.type == 'cuda':
            torch.cuda.set_device(dev)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))
        _logger.info('joined process group: rank %d of %d (%s, %s)', rank, world, backend, dev)
    return DistEnv(rank=rank, world_size=world, local_rank=local_rank, device=dev)


def shutdown_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def leave_process(code: int) -> int:
    """Under ``torchrun`` (``WORLD_SIZE`` > 1): destroy the process group and end the process with
    ``code`` without interpreter shutdown; otherwise return ``code``.

    torch keeps gloo's threads alive after ``destroy_process_group()`` while its DTensor caches hold
    the group (through the device mesh, after FSDP2). A gloo thread that frees a finished collective
    holding the last reference to a tensor made in Python needs the GIL; asked for during interpreter
    shutdown, CPython ends the thread inside that C++ destructor and the process aborts now and then
    ("terminate called without an active exception", SIGABRT). Everything is written and closed by then.
    """
    if int(os.environ.get('WORLD_SIZE', '1')) <= 1:
        return code
    shutdown_distributed()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _active():
        dist.barrier()


def all_reduce_sum(values: Dict[str, torch.Tensor], device: torch.device) -> Dict[str, float]:
    """Sum scalar tensors over ranks; a key missing on a rank (e.g. one that had no batch) counts as 0."""
    keys = sorted(values)
    if _active():
        keys = sorted(set().union(*all_gather_objects(keys)))
    if not keys:
        return {}
    zero = torch.zeros((), dtype=torch.float64, device=device)
    flat = torch.stack([values[k].detach().to(device=device, dtype=torch.float64).reshape(()) if k in values
                        else zero for k in keys])
    if _active():
        dist.all_reduce(flat)
    return {k: float(v) for k, v in zip(keys, flat.tolist())}


def all_gather_objects(obj: Any) -> List[Any]:
    """Every rank's ``obj`` (a list of one element without a process group)."""
    if not _active():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------------- FSDP2
def fully_shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each block of ``model`` (its ``blocks``, when it has them), then the root,
    over all processes. The positional encoding stays in the root's unit: its parameters are gathered
    for the whole forward, so the blocks' attention hooks read them unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in getattr(model, 'blocks', None) or []:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_options(**kwargs: Any):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kwargs)


def full_model_state(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The unsharded state dict of a sharded model, on the CPU (collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_full_options(cpu_offload=True))


def load_full_model_state(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict into a sharded model (collective)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(model, state, options=_full_options())


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The unsharded optimizer state of a sharded model, keyed by parameter name (collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: Dict[str, Any]) -> None:
    """Load `full_optimizer_state`'s dict into the optimizer of a sharded model (collective)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    set_optimizer_state_dict(model, optimizer, state, options=_full_options())
