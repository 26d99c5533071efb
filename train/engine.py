"""The training loop shared by every task: one process, one GPU, or DDP / FSDP2 under torchrun.

What it guarantees:

* **Exact resume.** ``checkpoint.pt`` holds the model, optimiser, scheduler, grad scaler, EMA,
  every rank's RNG states and the position (epoch, batch within the epoch, optimizer step). The
  data order of an epoch depends only on ``(seed, epoch)``, augmentation on ``(seed, epoch,
  index)``, mixup on ``(seed, step, rank)``, and data loaders never draw from the global RNG, so
  a run killed at any point and resumed from its last checkpoint ends with the same weights as a
  run that was never interrupted.
* **Atomic files.** Checkpoints go through a temporary file and ``os.replace``; the temporary
  files of a write killed mid-way are removed when the run starts again.
* **No silent overwrite.** A run folder that already holds a run is refused unless
  ``train.resume`` is set (`check_run_dir`): new rows would interleave with the old run's.
* **Recipes as in timm.** ``create_optimizer_v2`` (no weight decay on biases, norms and
  ``model.no_weight_decay()``, which lists the class token and every encoding parameter that
  must not decay), ``create_scheduler_v2`` (warmup then cosine by default, stepped per update),
  bf16 autocast where supported, gradient clipping, ModelEmaV3.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Union

import numpy as np
import torch
from timm.optim import create_optimizer_v2
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3, dispatch_clip_grad
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from tqdm.contrib.logging import logging_redirect_tqdm

from .checkpoint import CHECKPOINT_VERSION, CheckpointError, atomic_save, load_checkpoint, remove_stale_temporaries
from .config import Config, ConfigError, to_dict
from .data import ShardSampler, TrainSampler, make_loader
from .distributed import (
    DistEnv, all_gather_objects, all_reduce_sum, broadcast_object, full_model_state, full_optimizer_state,
    fully_shard_model, load_full_model_state, load_full_optimizer_state,
)
from .logs import CsvLog, TensorBoardLog, add_file_log, progress, tensorboard_enabled
from .rng import derive_seed, get_rng_state, set_rng_state
from .tasks import Task, get_task

__all__ = ['Trainer', 'RunResult', 'autocast_for', 'pe_label', 'check_run_dir', 'RUN_FILES']

_logger = logging.getLogger(__name__)

# what a run writes into its folder (config.yaml aside: the command line rewrites it before each run)
RUN_FILES = ('checkpoint.pt', 'best.pt', 'train.csv', 'eval.csv', 'log.txt', 'tensorboard')


def check_run_dir(run_dir: Union[str, Path], resume: Optional[str], env: DistEnv = DistEnv()) -> None:
    """Refuse to start a new run in a folder that holds one, unless ``train.resume`` is set.

    Overwriting would replace the old checkpoints and append the new rows to the old CSV files and
    log. Rank 0 looks (only it writes the folder) and every rank raises the same error.
    """
    found = []
    if env.is_main and not resume:
        found = [f for f in RUN_FILES if (Path(run_dir) / f).exists()]
    found = broadcast_object(found)
    if found:
        raise ConfigError(
            f'train.resume: not set, but the output folder {str(run_dir)!r} already holds a run '
            f'({", ".join(found)}); refusing to overwrite it. To continue that run: train.resume=auto '
            f'(or train.resume=PATH/checkpoint.pt). To start a new run: choose another folder with '
            f'output_dir=DIR or name=NAME, or delete {str(run_dir)!r}')


@dataclass
class RunResult:
    """What a finished run reports (rank 0 has the paths; every rank has the metrics)."""
    name: str
    run_dir: Path
    best_path: Optional[Path]
    best: Dict[str, Any]
    last_metrics: Dict[str, float]
    epochs: int
    steps: int
    seconds: float
    skipped: int  # distinct unreadable training inputs met
    label: str
    params: int


def pe_label(spec: Dict[str, Any]) -> str:
    """A short name for a model spec: its encoding (``rope_mixed``, ``irpe:mode=bias+learned``)."""
    pe = spec.get('kwargs', {}).get('pe')
    if pe is None:
        return spec.get('name', '?')
    if isinstance(pe, str):
        return pe
    if isinstance(pe, dict):
        opts = ','.join(f'{k}={v}' for k, v in pe.items() if k != 'name')
        return pe.get('name', '?') + (f':{opts}' if opts else '')
    return '+'.join(pe_label({'kwargs': {'pe': p}}) for p in pe)


def autocast_for(amp: str, device: torch.device):
    """``(context factory, dtype or None)`` for ``train.amp``; 'auto' is bf16 on GPUs that support it."""
    if amp == 'auto':
        amp = 'bf16' if device.type == 'cuda' and torch.cuda.is_bf16_supported() else 'off'
    if amp == 'off':
        return contextlib.nullcontext, None
    dtype = torch.bfloat16 if amp == 'bf16' else torch.float16
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype), dtype


def _lr(cfg: Config, world_size: int) -> float:
    o = cfg.optim
    if o.lr is not None:
        return o.lr
    ratio = cfg.train.batch_size * world_size / o.lr_base_size
    return o.lr_base * (ratio if o.lr_base_scale == 'linear' else math.sqrt(ratio))


class Trainer:
    """One training run of ``cfg`` in ``run_dir`` (see the module docstring)."""

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path) -> None:
        self.cfg, self.env, self.run_dir = cfg, env, Path(run_dir)
        t = cfg.train
        check_run_dir(self.run_dir, t.resume, env)
        self.tensorboard = tensorboard_enabled(cfg.log.tensorboard)
        if t.threads:
            torch.set_num_threads(t.threads)
        self.task: Task = get_task(cfg.task)(cfg, rank=env.rank)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in (self.checkpoint_path, self.best_path):
                for tmp in remove_stale_temporaries(path):
                    _logger.info('removed %s, left by a checkpoint write that was interrupted', tmp)
        self.device = env.device

        torch.manual_seed(cfg.seed)  # identical initialisation on every rank
        model = self.task.build_model()
        self.train_set = self.task.train_dataset()
        self.eval_set = self.task.eval_dataset()
        self.model = model.to(self.device)
        self.params = sum(p.numel() for p in model.parameters())
        # FSDP2 shards the parameters in place, before the optimizer takes them
        self.fsdp = env.distributed and t.parallel == 'fsdp'
        if self.fsdp:
            if t.ema.enabled:
                raise ConfigError("train.ema.enabled: the EMA keeps a full copy of the model, which "
                                  "train.parallel='fsdp' does not; use train.parallel='ddp' or disable the EMA")
            fully_shard_model(model, self.device)
        self.spec = self.task.model_spec(model)
        self.label = pe_label(self.spec)

        self.ema = ModelEmaV3(model, decay=t.ema.decay, use_warmup=t.ema.warmup) if t.ema.enabled else None

        o = cfg.optim
        opt_kwargs: Dict[str, Any] = {}
        if o.eps is not None:
            opt_kwargs['eps'] = o.eps
        if o.betas is not None:
            opt_kwargs['betas'] = tuple(o.betas)
        self.lr = _lr(cfg, env.world_size)
        try:
            self.optimizer = create_optimizer_v2(model, opt=o.opt, lr=self.lr, weight_decay=o.weight_decay,
                                                 momentum=o.momentum, layer_decay=o.layer_decay, **opt_kwargs)
        except (AssertionError, ValueError, TypeError) as e:
            raise ConfigError(f'optim.opt: {e}') from None

        self.sampler = TrainSampler(self.train_set, env.rank, env.world_size, cfg.seed,
                                    repeats=getattr(getattr(cfg.data, 'aug', None), 'repeated_aug', 0))
        per_epoch = self.sampler.full_length() // t.batch_size
        if per_epoch == 0:
            raise ConfigError(f'train.batch_size: {t.batch_size} is larger than the {self.sampler.full_length()} '
                              f'training items of each of the {env.world_size} process(es)')
        self.steps_per_epoch = min(per_epoch, t.steps_per_epoch or per_epoch)

        s = cfg.sched
        self.scheduler = None
        self.num_epochs = t.epochs
        if s.name != 'none':
            self.scheduler, self.num_epochs = create_scheduler_v2(
                self.optimizer, sched=s.name, num_epochs=t.epochs, warmup_epochs=s.warmup_epochs,
                warmup_lr=s.warmup_lr, warmup_prefix=s.warmup_prefix, min_lr=s.min_lr,
                cooldown_epochs=s.cooldown_epochs,
                decay_epochs=s.decay_epochs, decay_rate=s.decay_rate,
                step_on_epochs=not s.on_updates, updates_per_epoch=self.steps_per_epoch)

        self.autocast, self.amp_dtype = autocast_for(t.amp, self.device)
        self.scaler = torch.amp.GradScaler(self.device.type) if self.amp_dtype == torch.float16 else None

        self.ddp: nn.Module = model
        if env.distributed and not self.fsdp:
            self.ddp = DistributedDataParallel(
                model, device_ids=[self.device.index] if self.device.type == 'cuda' else None,
                find_unused_parameters=t.find_unused_parameters)
        self.train_model: nn.Module = torch.compile(self.ddp) if t.compile else self.ddp

        # position and bookkeeping
        self.epoch, self.batch_in_epoch, self.step = 0, 0, 0
        self.best: Dict[str, Any] = dict(metric=self.task.metric, value=None, epoch=None, step=None)
        self.last_metrics: Dict[str, float] = {}
        self.unreadable: Set[int] = set()  # training-set indices of the unreadable inputs met so far
        self.seconds = 0.0
        self.resumed_from: Optional[Path] = None
        # per-rank streams for dropout etc. from here on (data and mixup have their own)
        self._seed_rank_streams()
        self._resume()

    # ------------------------------------------------------------------ state
    def _seed_rank_streams(self) -> None:
        seed = derive_seed(self.cfg.seed, self.env.rank, 1)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / 'checkpoint.pt'

    @property
    def best_path(self) -> Path:
        return self.run_dir / 'best.pt'

    def _model_state(self) -> Dict[str, torch.Tensor]:
        """The model's unsharded state dict (collective under FSDP2: every rank calls it)."""
        return full_model_state(self.model) if self.fsdp else self.model.state_dict()

    def _state(self, rng: List[Dict[str, Any]], model: Dict[str, torch.Tensor], optimizer: Dict[str, Any]
               ) -> Dict[str, Any]:
        return dict(
            version=CHECKPOINT_VERSION, config=to_dict(self.cfg), model_spec=self.spec,
            model=model, optimizer=optimizer, parallel='fsdp' if self.fsdp else 'ddp',
            scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            ema=self.ema.module.state_dict() if self.ema is not None else None,
            rng=rng, world_size=self.env.world_size,
            position=dict(epoch=self.epoch, batch=self.batch_in_epoch, step=self.step),
            best=dict(self.best), unreadable=sorted(self.unreadable), seconds=self.seconds + self._elapsed(),
        )

    def save_checkpoint(self) -> None:
        rng = all_gather_objects(get_rng_state())  # every rank's streams, collective
        self._share_unreadable()
        # under FSDP2 the unsharded state is gathered by every rank (collective) and written by rank 0
        model = self._model_state()
        optimizer = full_optimizer_state(self.model, self.optimizer) if self.fsdp else self.optimizer.state_dict()
        if self.env.is_main:
            atomic_save(self._state(rng, model, optimizer), self.checkpoint_path)
            _logger.debug('checkpoint: epoch %d batch %d step %d', self.epoch, self.batch_in_epoch, self.step)

    def _resume(self) -> None:
        r = self.cfg.train.resume
        if not r:
            return
        path = self.checkpoint_path if r == 'auto' else Path(r)
        if not path.is_file():
            if r == 'auto':
                return
            raise ConfigError(f'train.resume: checkpoint {str(path)!r} does not exist')
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            raise ConfigError(f'train.resume: {e}. Resume from another checkpoint with train.resume=PATH, or delete '
                              f'{str(path)!r} to start this run over (with train.resume=auto)') from None
        if 'optimizer' not in ckpt:
            raise ConfigError(f'train.resume: {str(path)!r} holds weights only (a best.pt?); resume needs a '
                              f'checkpoint.pt. To start from weights, use model.pretrained_file')
        if ckpt['model_spec'] != self.spec:
            raise ConfigError(f'train.resume: {str(path)!r} holds another model ({ckpt["model_spec"]}) '
                              f'than this config ({self.spec})')
        saved_by = ckpt.get('parallel', 'ddp')
        if (saved_by == 'fsdp') != self.fsdp:  # the optimizer states are keyed differently (names / indices)
            raise ConfigError(f"train.resume: {str(path)!r} was written with train.parallel={saved_by!r}; resume it "
                              f"with the same setting (its weights load into any run through model.pretrained_file)")
        if self.fsdp:
            load_full_model_state(self.model, ckpt['model'])
            load_full_optimizer_state(self.model, self.optimizer, ckpt['optimizer'])
        else:
            self.model.load_state_dict(ckpt['model'])
            self.optimizer.load_state_dict(ckpt['optimizer'])
        if self.scheduler is not None and ckpt.get('scheduler') is not None:
            self.scheduler.load_state_dict(ckpt['scheduler'])
        if self.scaler is not None and ckpt.get('scaler') is not None:
            self.scaler.load_state_dict(ckpt['scaler'])
        if self.ema is not None:
            if ckpt.get('ema') is None:
                _logger.warning('resume: the checkpoint has no EMA; starting the EMA from the current weights')
                self.ema.set(self.model)
            else:
                self.ema.module.load_state_dict(ckpt['ema'])
        pos = ckpt['position']
        self.epoch, self.batch_in_epoch, self.step = pos['epoch'], pos['batch'], pos['step']
        self.best = dict(ckpt['best'])
        self.unreadable = set(ckpt.get('unreadable', []))
        self.seconds = float(ckpt.get('seconds', 0.0))
        rng = ckpt['rng']
        if len(rng) == self.env.world_size:
            set_rng_state(rng[self.env.rank])
        else:
            _logger.warning('resume: the checkpoint was written by %d process(es), this run has %d; the data '
                            'order continues per epoch but the run is not bit-identical', len(rng),
                            self.env.world_size)
            set_rng_state(rng[0])
            if self.batch_in_epoch:
                self.batch_in_epoch = self.batch_in_epoch * ckpt['world_size'] // self.env.world_size
        if self.scheduler is not None:
            self.scheduler.step(self.epoch)
            if self.cfg.sched.on_updates:
                self.scheduler.step_update(self.step)
        self.resumed_from = path
        _logger.info('resumed from %s at epoch %d, batch %d, step %d', path, self.epoch, self.batch_in_epoch,
                     self.step)

    # ------------------------------------------------------------------ loop
    @property
    def skipped(self) -> int:
        """Distinct unreadable training inputs met so far (each counted once, however often it comes back)."""
        return len(self.unreadable)

    def _share_unreadable(self) -> None:
        """Every rank learns the unreadable inputs the others met (collective)."""
        for found in all_gather_objects(self.unreadable):
            self.unreadable |= found

    def _elapsed(self) -> float:
        return time.perf_counter() - self._t0 if hasattr(self, '_t0') else 0.0

    def _loader(self, dataset, sampler, batch_size: int, drop_last: bool, seed: int):
        workers = getattr(self.cfg.data, 'workers', 0)
        return make_loader(dataset, sampler, batch_size, workers, self.device, drop_last, self.task.collate_fn,
                           seed=seed)

    def evaluate(self, model: nn.Module, dataset=None, batch_size: Optional[int] = None) -> Dict[str, float]:
        """Task metrics of ``model`` on ``dataset`` (default: the validation set), over all ranks."""
        dataset = self.eval_set if dataset is None else dataset
        bs = batch_size or getattr(self.cfg.data, 'eval_batch_size', None) or 2 * self.cfg.train.batch_size
        loader = self._loader(dataset, ShardSampler(dataset, self.env.rank, self.env.world_size), bs, False, 0)
        bar = progress(self.cfg.log.progress, self.env.is_main, total=len(loader), desc='eval')
        batches = _counting(loader, bar)
        if self.fsdp:  # every forward of a sharded model is collective: the same count of batches on every rank
            batches = _padded_with_empty(batches, len(loader), max(all_gather_objects(len(loader))))
        try:
            return self.task.evaluate(model, batches, self.device, self.autocast,
                                      lambda sums: all_reduce_sum(sums, self.device))
        finally:
            bar.close()

    def _train_epoch(self, csv_log: CsvLog, tb: TensorBoardLog) -> None:
        t, cfg = self.cfg.train, self.cfg
        skip = self.batch_in_epoch
        if skip >= self.steps_per_epoch:
            return
        self.sampler.set_epoch(self.epoch, skip * t.batch_size)
        if hasattr(self.train_set, 'set_epoch'):
            self.train_set.set_epoch(self.epoch)
        loader = self._loader(self.train_set, self.sampler, t.batch_size, True,
                              derive_seed(cfg.seed, self.epoch, self.env.rank))
        bar = progress(cfg.log.progress, self.env.is_main, total=self.steps_per_epoch, initial=skip,
                       desc=f'epoch {self.epoch + 1}/{self.num_epochs}')
        self.train_model.train()
        window_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        window_steps, window_t = 0, time.perf_counter()
        it = iter(loader)
        try:
            for b in range(skip, self.steps_per_epoch):
                batch = next(it)
                self.unreadable.update(self.task.unreadable(batch))
                batch = self.task.to_device(batch, self.device)
                with self.autocast():
                    loss, extra = self.task.train_step(self.train_model, batch, self.step)
                self._backward_step(loss)
                self.step += 1
                self.batch_in_epoch = b + 1
                if self.scheduler is not None:
                    self.scheduler.step_update(num_updates=self.step)
                if self.ema is not None:
                    self.ema.update(self.model, step=self.step)
                window_loss += loss.detach().double()
                window_steps += 1
                bar.update(1)
                if self.step % cfg.log.every == 0 or self.batch_in_epoch == self.steps_per_epoch:
                    sums = all_reduce_sum(dict(loss=window_loss), self.device)
                    self._share_unreadable()
                    mean_loss = sums['loss'] / (window_steps * self.env.world_size)
                    if not math.isfinite(mean_loss):
                        raise FloatingPointError(
                            f'loss is {mean_loss} at step {self.step}; lower optim.lr, set optim.clip_grad, or '
                            f'use train.amp=off')
                    dt = time.perf_counter() - window_t
                    row = dict(epoch=self.epoch, step=self.step, loss=mean_loss,
                               lr=self.optimizer.param_groups[0]['lr'],
                               samples_per_s=window_steps * t.batch_size * self.env.world_size / max(dt, 1e-9),
                               skipped=self.skipped, **extra)
                    if self.env.is_main:
                        csv_log.write(row)
                        tb.write('train', row, self.step)
                    bar.set_postfix(loss=f'{mean_loss:.4f}', lr=f'{row["lr"]:.2e}')
                    window_loss.zero_()
                    window_steps, window_t = 0, time.perf_counter()
                if t.checkpoint_every and self.step % t.checkpoint_every == 0:
                    self.save_checkpoint()
        finally:
            bar.close()
            del it

    def _backward_step(self, loss: torch.Tensor) -> None:
        o = self.cfg.optim
        params = self.model.parameters
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            if o.clip_grad is not None:
                self.scaler.unscale_(self.optimizer)
                dispatch_clip_grad(params(), o.clip_grad, mode=o.clip_mode)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            if o.clip_grad is not None:
                dispatch_clip_grad(params(), o.clip_grad, mode=o.clip_mode)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _improved(self, value: float) -> bool:
        best = self.best['value']
        if best is None:
            return True
        return value > best if self.task.metric_mode == 'max' else value < best

    def _evaluate_epoch(self, csv_log: CsvLog, tb: TensorBoardLog) -> None:
        metrics = self.evaluate(self.model)
        row: Dict[str, Any] = dict(epoch=self.epoch, step=self.step, **metrics)
        chosen = metrics
        if self.ema is not None and self.cfg.train.ema.evaluate:
            ema_metrics = self.evaluate(self.ema.module)
            row.update({f'ema_{k}': v for k, v in ema_metrics.items()})
            chosen = ema_metrics
        self.last_metrics = dict(row)
        value = chosen[self.task.metric]
        improved = self._improved(value)
        if improved:
            self.best = dict(metric=self.task.metric, value=value, epoch=self.epoch, step=self.step)
        best_weights = None
        if improved:  # metrics are reduced over ranks, so every rank agrees (the FSDP2 gather is collective)
            best_weights = self.ema.module.state_dict() if chosen is not metrics else self._model_state()
        if self.env.is_main:
            csv_log.write(row)
            tb.write('eval', row, self.step)
            _logger.info('epoch %d/%d step %d: %s%s', self.epoch, self.num_epochs, self.step,
                         ', '.join(f'{k} {v:.4g}' for k, v in row.items() if k not in ('epoch', 'step')),
                         ' (best)' if improved else '')
            if improved:
                atomic_save(dict(version=CHECKPOINT_VERSION, config=to_dict(self.cfg), model_spec=self.spec,
                                 model=best_weights, weights='ema' if chosen is not metrics else 'model',
                                 metrics=dict(chosen), epoch=self.epoch, step=self.step), self.best_path)

    def fit(self) -> RunResult:
        """Train to the end (or continue a resumed run), evaluate, checkpoint; returns the summary."""
        cfg = self.cfg
        handler = add_file_log(self.run_dir / 'log.txt') if self.env.is_main else None
        csv_train = CsvLog(self.run_dir / 'train.csv') if self.env.is_main else None
        csv_eval = CsvLog(self.run_dir / 'eval.csv') if self.env.is_main else None
        if csv_train is not None:  # a resumed run repeats the rows after its checkpoint; a new one keeps none
            csv_train.truncate(self.step)
            csv_eval.truncate(self.step)
        tb = TensorBoardLog(self.tensorboard and self.env.is_main, self.run_dir / 'tensorboard', self.step)
        self._t0 = time.perf_counter()
        _logger.info('run %s: %s (%s), %.2fM parameters, %d epochs x %d steps, batch %d x %d process(es), '
                     'lr %.3g, amp %s, device %s', cfg.name, self.spec['name'], self.label, self.params / 1e6,
                     self.num_epochs, self.steps_per_epoch, cfg.train.batch_size, self.env.world_size, self.lr,
                     self.amp_dtype or 'off', self.device)
        if self.epoch >= self.num_epochs:
            _logger.info('run %s already finished (%d epochs); nothing to train', cfg.name, self.epoch)
        try:
            with logging_redirect_tqdm():
                while self.epoch < self.num_epochs:
                    self._train_epoch(csv_train, tb)
                    self.epoch += 1
                    self.batch_in_epoch = 0
                    if self.scheduler is not None:
                        self.scheduler.step(self.epoch)
                    if self.epoch % cfg.train.eval_every == 0 or self.epoch == self.num_epochs:
                        self._evaluate_epoch(csv_eval, tb)
                    self.save_checkpoint()
            self.seconds += self._elapsed()
        finally:
            tb.close()
            if handler is not None:
                logging.getLogger().removeHandler(handler)
                handler.close()
        return RunResult(name=cfg.name or '', run_dir=self.run_dir,
                         best_path=self.best_path if self.best['value'] is not None else None,
                         best=dict(self.best), last_metrics=self.last_metrics, epochs=self.epoch, steps=self.step,
                         seconds=self.seconds, skipped=self.skipped, label=self.label, params=self.params)


def _counting(loader, bar):
    for batch in loader:
        yield batch
        bar.update(1)


def _padded_with_empty(batches, count: int, total: int):
    """``batches`` (``count`` of them), then empty batches (every tensor cut to length 0, every list
    emptied) shaped as the first, up to ``total``: a rank with fewer evaluation batches still joins
    each collective forward of a sharded model, and adds nothing to the metric sums."""
    first = None
    for batch in batches:
        first = batch if first is None else first
        yield batch
    if count < total and first is None:
        raise RuntimeError('a process has no evaluation batch while others have some; the evaluation set is '
                           'smaller than the number of processes')
    for _ in range(total - count):
        yield _empty_like(first)


def _empty_like(batch: Any, top: bool = True) -> Any:
    """``batch`` with no samples: tensors cut to length 0; the batch's own fields (its top-level list,
    tuple or dict) kept, nested per-sample lists (detection targets) emptied."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return {k: _empty_like(v, False) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if not top:
            return type(batch)() if type(batch) in (list, tuple) else batch[:0]
        items = [_empty_like(v, False) for v in batch]
        return items if isinstance(batch, list) else type(batch)(items)
    return batch
