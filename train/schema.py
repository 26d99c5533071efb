"""Typed config sections: dataclasses whose fields are the keys, validated by `vispe.options.coerce`.

The generic sections (`OptimConfig`, `SchedConfig`, `TrainConfig`, `LogConfig`, `ExtrapolateConfig`)
live here; a task supplies the dataclasses of its own sections (``model``, ``data``, ``loss``),
written by hand or derived from a model constructor (`constructor_section`). Every key is checked
against the dataclass fields, every value against the field's type hint (the coercer that parses
encoding options, so both read ``true``, ``1e-3`` and lists alike) and declared bounds, and a field
typed `vispe.registry.PESpec` is parsed as an encoding spec (names, option keys and types). An
error names the full dotted key (``train.batch_size: expected an integer, got 'big'``) and, for
unknown keys, the closest valid ones.

This module knows no task and no file: tasks import it, `train.config` adds YAML and the task
registry on top.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Literal, Mapping, Optional, Tuple

import vispe
from vispe.options import coerce, did_you_mean, signature_options

__all__ = [
    'ConfigError', 'option', 'Config', 'OptimConfig', 'SchedConfig', 'TrainConfig', 'EmaConfig', 'LogConfig',
    'ExtrapolateConfig', 'EmptySection', 'TASK_SECTIONS', 'validate_section', 'to_dict', 'constructor_section',
    'constructor_kwargs',
]


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the dotted key."""


def option(default: Any = dataclasses.MISSING, help: str = '', *, min: Optional[float] = None,
        max: Optional[float] = None, factory: Any = dataclasses.MISSING) -> Any:
    """A config field with a help text and optional numeric bounds (checked on load)."""
    meta = dict(help=help, min=min, max=max)
    if factory is not dataclasses.MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------- generic sections
@dataclass
class OptimConfig:
    """Optimiser: any name timm's ``create_optimizer_v2`` knows (adamw, lamb, sgd, ...)."""
    opt: str = option('adamw', 'timm optimizer name')
    lr: Optional[float] = option(None, 'absolute learning rate; null: lr_base scaled by the global batch', min=0)
    lr_base: float = option(5e-4, 'learning rate at a global batch of lr_base_size', min=0)
    lr_base_size: int = option(512, 'global batch size lr_base refers to', min=1)
    lr_base_scale: Literal['linear', 'sqrt'] = option('linear', 'how lr_base scales with the global batch')
    weight_decay: float = option(0.05, 'decoupled weight decay; never applied to biases, norms and '
                                     'model.no_weight_decay() (class token, encoding parameters)', min=0)
    momentum: float = option(0.9, 'momentum (sgd-like optimizers)', min=0, max=1)
    eps: Optional[float] = option(None, 'optimizer epsilon (null: the optimizer default)', min=0)
    betas: Optional[Tuple[float, float]] = option(None, 'Adam-style betas (null: the optimizer default)')
    layer_decay: Optional[float] = option(None, 'layer-wise lr decay (timm), e.g. 0.65 for fine-tuning', min=0, max=1)
    clip_grad: Optional[float] = option(None, 'gradient clipping threshold (null: off)', min=0)
    clip_mode: Literal['norm', 'value', 'agc'] = option('norm', 'gradient clipping mode (timm dispatch_clip_grad)')


@dataclass
class SchedConfig:
    """Learning-rate schedule through timm's ``create_scheduler_v2`` (warmup, then the named decay)."""
    name: Literal['cosine', 'tanh', 'step', 'multistep', 'poly', 'plateau', 'wsd', 'none'] = option(
        'cosine', 'timm scheduler name')
    warmup_epochs: float = option(5.0, 'linear warmup length in epochs (fractions allowed)', min=0)
    warmup_lr: float = option(1e-6, 'learning rate at the start of warmup', min=0)
    warmup_prefix: bool = option(False, "warmup before the decay, which timm then runs for train.epochs more "
                                        "(else the decay spans the warmup too: timm's default, as in DeiT)")
    min_lr: float = option(1e-5, 'floor of the decay', min=0)
    cooldown_epochs: int = option(0, 'epochs at min_lr after the decay (added to train.epochs)', min=0)
    decay_epochs: float = option(30.0, 'step schedules: epochs between decays', min=0)
    decay_rate: float = option(0.1, 'step schedules: decay factor', min=0)
    on_updates: bool = option(True, 'update the learning rate every optimizer step (else once per epoch)')


@dataclass
class EmaConfig:
    """Exponential moving average of the weights (timm ModelEmaV3)."""
    enabled: bool = option(False, 'keep an EMA of the weights')
    decay: float = option(0.9998, 'EMA decay per optimizer step', min=0, max=1)
    warmup: bool = option(False, "timm's EMA decay warmup")
    evaluate: bool = option(False, 'evaluate the EMA weights too; best.pt then holds the EMA weights')


@dataclass
class TrainConfig:
    """The loop: length, batch, precision, checkpoints, resume."""
    epochs: int = option(300, 'training epochs', min=1)
    steps_per_epoch: Optional[int] = option(None, 'cap on optimizer steps per epoch (null: one pass over the data)',
                                         min=1)
    batch_size: int = option(64, 'batch size per process (global batch = batch_size x world size)', min=1)
    amp: Literal['auto', 'bf16', 'fp16', 'off'] = option(
        'auto', 'mixed precision; auto = bf16 autocast on GPUs that support it, off on CPU')
    device: str = option('auto', "'auto', 'cpu', 'cuda' or 'cuda:N' (under torchrun: the local rank's GPU); "
                                 "checked against the machine when the run starts")
    threads: Optional[int] = option(None, 'torch CPU threads per process (null: torch default)', min=1)
    eval_every: int = option(1, 'evaluate every N epochs (and after the last)', min=1)
    checkpoint_every: Optional[int] = option(None, 'also checkpoint every N optimizer steps (mid-epoch)', min=1)
    resume: Optional[str] = option(None, "'auto' (this run's checkpoint.pt if present) or a checkpoint path")
    compile: bool = option(False, 'torch.compile the model')
    parallel: Literal['ddp', 'fsdp'] = option(
        'ddp', "under torchrun: 'ddp' (a full replica per process) or 'fsdp' (FSDP2 fully_shard of each block, "
               "then the root: parameters, gradients and optimizer state sharded over the processes)")
    find_unused_parameters: bool = option(False, 'DDP find_unused_parameters (models with unused weights)')
    ema: EmaConfig = option(factory=EmaConfig)


@dataclass
class LogConfig:
    """Feedback: progress bars, CSV, TensorBoard."""
    progress: Literal['auto', 'on', 'off'] = option('auto', 'tqdm bars; auto = only when stderr is a terminal')
    every: int = option(20, 'optimizer steps between rows of train.csv', min=1)
    tensorboard: Literal['auto', 'on', 'off'] = option('auto', 'TensorBoard events; auto = when installed')
    level: Literal['debug', 'info', 'warning'] = option('info', 'console log level (rank 0)')


@dataclass
class ExtrapolateConfig:
    """Resolution sweep run after training (the same as ``python -m train.extrapolate``)."""
    sizes: List[int] = option(factory=list, help='input sizes to evaluate best.pt at (empty: skip); multiples '
                                                 'of the patch size', min=1)
    max_tokens: List[int] = option(factory=list, help='token budgets to evaluate best.pt at, each image resized '
                                                      'to its native aspect ratio (NaFlex; instead of sizes)', min=1)
    batch_size: Optional[int] = option(None, 'evaluation batch (null: the eval batch size)', min=1)

    def __post_init__(self) -> None:
        if self.sizes and self.max_tokens:
            raise ConfigError('extrapolate.max_tokens: evaluates at native aspect ratios instead of square '
                              'extrapolate.sizes; give one of them')


@dataclass
class EmptySection:
    """A section the task does not use: it must stay empty."""


@dataclass
class Config:
    """A whole experiment. ``model``, ``data`` and ``loss`` are the task's dataclasses."""
    task: str = option('classification', 'task name (train.tasks registry)')
    name: Optional[str] = option(None, 'run name (default: the config file name); runs go to output_dir/name')
    output_dir: str = option('runs', 'root folder of runs')
    seed: int = option(0, 'seed of every random stream (data order, augmentation, init, dropout)', min=0)
    model: Any = option(factory=dict, help='task model section')
    data: Any = option(factory=dict, help='task data section')
    loss: Any = option(factory=dict, help='task loss section')
    optim: OptimConfig = option(factory=OptimConfig)
    sched: SchedConfig = option(factory=SchedConfig)
    train: TrainConfig = option(factory=TrainConfig)
    log: LogConfig = option(factory=LogConfig)
    extrapolate: ExtrapolateConfig = option(factory=ExtrapolateConfig)
    sweep: Dict[str, List[Any]] = option(factory=dict, help='dotted key -> values; one run per combination')


TASK_SECTIONS = ('model', 'data', 'loss')


def _field_value(value: Any, hint: Any, key: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return validate_section(hint, value, key)
    try:
        value = coerce(value, hint, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if hint == vispe.registry.PESpec:  # an encoding spec: its names, option keys and types, checked here
        try:
            vispe.parse_pe_spec(value, typed=True)
        except (TypeError, ValueError) as e:
            raise ConfigError(f'{key}: {e}') from None
    return value


def _check_bounds(value: Any, meta: Mapping[str, Any], key: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    lo, hi = meta.get('min'), meta.get('max')
    if lo is not None and value < lo:
        raise ConfigError(f'{key}: must be >= {lo}, got {value!r}')
    if hi is not None and value > hi:
        raise ConfigError(f'{key}: must be <= {hi}, got {value!r}')


def validate_section(cls: type, raw: Any, key: str) -> Any:
    """Build dataclass ``cls`` from a raw mapping, rejecting unknown keys and bad values."""
    if dataclasses.is_dataclass(raw) and isinstance(raw, cls):
        raw = to_dict(raw)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f'{key}: expected a section (mapping), got {raw!r}')
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in raw.items():
        full = f'{key}.{k}' if key else str(k)
        if k not in fields:
            hint = did_you_mean(str(k), fields, cutoff=0.6, sep=' or ', prefix=f'{key}.' if key else '')
            valid = ', '.join(fields) if fields else 'none (this section must be empty)'
            raise ConfigError(f'unknown config key {full!r}.{hint} Valid keys here: {valid}.')
        value = _field_value(v, hints[k], full)
        _check_bounds(value, fields[k].metadata, full)
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _check_bounds(item, fields[k].metadata, f'{full}[{i}]')
        kwargs[k] = value
    try:
        return cls(**kwargs)
    except ConfigError:  # a section's own cross-key check names its keys
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f'{key or "config"}: {e}') from None


def to_dict(obj: Any) -> Any:
    """A validated config as plain dicts and lists (YAML / JSON / checkpoint friendly)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def constructor_section(name: str, constructor: Callable, *, module: str, exclude: Iterable[str] = (),
                        **fields: Any) -> type:
    """A section (dataclass) whose keys are the keyword arguments of ``constructor`` (a class: its
    ``__init__``), each with the constructor's type hint and default: a new constructor argument is a
    new config key, with nothing to copy by hand.

    Args:
        name: the dataclass name (``'ModelConfig'``); ``module`` the module that holds it (``__name__``).
        exclude: arguments the task fills in itself (from other sections, or from the data).
        fields: per key, ``option(min=..., max=...)`` to add bounds (the default stays the
            constructor's), or ``(type, option(default, ...))`` to change the key's type and default
            too (e.g. ``Optional[int]`` with null meaning "the task decides").
    """
    init = constructor.__init__ if isinstance(constructor, type) else constructor
    params, hints, _ = signature_options(init)
    specs: List[Tuple[str, Any, Any]] = []
    for p in list(params.values())[1 if isinstance(constructor, type) else 0:]:
        if p.name in exclude or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        hint, spec = hints.get(p.name, Any), fields.pop(p.name, None)
        if isinstance(spec, tuple):
            hint, spec = spec
        spec = option() if spec is None else spec
        if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            if p.default is p.empty:
                raise TypeError(f'{constructor.__qualname__}: argument {p.name!r} has no default; give it one in '
                                f'the section or exclude it')
            if isinstance(p.default, (list, dict, set)):
                spec.default_factory = functools.partial(copy.deepcopy, p.default)
            else:
                spec.default = p.default
        specs.append((p.name, hint, spec))
    if fields:
        raise TypeError(f'{constructor.__qualname__} has no arguments {sorted(fields)}')
    section = dataclasses.make_dataclass(name, specs, namespace={
        '__doc__': f'The keyword arguments of `{constructor.__qualname__}` (see its docstring for each key).',
        '__module__': module})
    section.__qualname__ = name
    return section


def constructor_kwargs(section: Any) -> Dict[str, Any]:
    """The keys of a section as keyword arguments (a copy: the config stays as it was validated)."""
    return {f.name: copy.deepcopy(getattr(section, f.name)) for f in dataclasses.fields(section)}
