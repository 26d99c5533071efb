"""Typed configs: YAML files, ``base:`` inheritance, dotted ``key=value`` overrides, validation.

A config is a tree of dataclasses. The generic sections (`OptimConfig`, `SchedConfig`,
`TrainConfig`, `LogConfig`, `ExtrapolateConfig`) live here; the task named by ``task:`` supplies
the dataclasses of its own sections (``model``, ``data``, ``loss``). Every key is checked against
the dataclass fields, every value against the field's type hint and declared bounds, and an
error names the full dotted key (``train.batch_size: expected int, got 'big'``) and, for unknown
keys, the closest valid ones.

Files may start from others: ``base: ../_recipes/deit_finetune.yaml`` (a path relative to the
file, or a list of them) is merged first, the file's own keys win, dictionaries merge key by key.

YAML anchors and aliases (``&recipe`` / ``*recipe``) work, but a document whose aliases expand to
more than `MAX_YAML_NODES` values (a "billion laughs" file: a few hundred bytes that unfold into
gigabytes) or refer to themselves is refused before anything walks it.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Literal, Mapping, Optional, Sequence, Tuple, Union

import yaml

__all__ = [
    'ConfigError', 'option', 'Config', 'OptimConfig', 'SchedConfig', 'TrainConfig', 'EmaConfig', 'LogConfig',
    'ExtrapolateConfig', 'EmptySection', 'load_yaml', 'parse_overrides', 'apply_overrides', 'build_config',
    'load_config', 'to_dict', 'expand_sweep', 'validate_section', 'merge_trees', 'MAX_YAML_NODES',
]

# A real config has a few hundred values; aliases may repeat parts of it, not blow it up.
MAX_YAML_NODES = 100_000


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
    batch_size: Optional[int] = option(None, 'evaluation batch (null: the eval batch size)', min=1)


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


# ---------------------------------------------------------------------- YAML and overrides
class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses documents whose aliases expand too far or refer to themselves.

    PyYAML shares an aliased node instead of copying it, so loading a billion-laughs file is cheap;
    the blow-up comes later, when the config is merged, validated or written out as a tree. The
    expanded size is counted on the composed node graph (each shared node sized once), before any
    Python object is built.
    """

    def get_single_node(self):
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {}, set())
        return node


def _expanded_size(node: yaml.Node, sizes: Dict[int, int], open_nodes: set) -> int:
    """Number of values ``node`` stands for once every alias is written out; raises past the limit."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise ConfigError(f'the YAML collection at line {node.start_mark.line + 1}, column '
                          f'{node.start_mark.column + 1} contains an alias to itself; write the values out')
    children: List[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    open_nodes.add(key)
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, open_nodes)
        if size > MAX_YAML_NODES:
            raise ConfigError(f'YAML aliases expand the document to more than {MAX_YAML_NODES} values (a "billion '
                              f'laughs" file?); write the values out or share them through base: files')
    open_nodes.discard(key)
    sizes[key] = size
    return size


def _safe_load(stream: Any) -> Any:
    return yaml.load(stream, Loader=_Loader)


def merge_trees(base: Dict[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    """``over`` on top of ``base``: mappings merge key by key (``sweep`` is replaced whole)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict) and k != 'sweep':
            out[k] = merge_trees(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def load_yaml(path: Union[str, Path], _seen: Tuple[Path, ...] = ()) -> Dict[str, Any]:
    """Read a YAML config, resolving ``base:`` files (relative to the file) first."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f'config file {str(path)!r} does not exist')
    resolved = path.resolve()
    if resolved in _seen:
        raise ConfigError(f'config {str(path)!r} includes itself through base:')
    with open(path) as f:
        try:
            raw = _safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f'config {str(path)!r} is not valid YAML: {e}') from None
        except ConfigError as e:
            raise ConfigError(f'config {str(path)!r}: {e}') from None
    if not isinstance(raw, dict):
        raise ConfigError(f'config {str(path)!r} must be a mapping of sections, got {type(raw).__name__}')
    bases = raw.pop('base', None) or []
    merged: Dict[str, Any] = {}
    for b in [bases] if isinstance(bases, str) else bases:
        merged = merge_trees(merged, load_yaml(path.parent / b, _seen + (resolved,)))
    return merge_trees(merged, raw)


def parse_overrides(items: Iterable[str]) -> List[Tuple[str, Any]]:
    """``['train.epochs=3', 'model.pe=rope_mixed']`` -> ``[(key, value)]``; values are parsed as YAML."""
    out = []
    for item in items:
        key, eq, text = item.partition('=')
        key = key.strip()
        if not eq or not key or any(not part for part in key.split('.')):
            raise ConfigError(f'override {item!r} must look like section.key=value (e.g. train.epochs=10)')
        try:
            value = _safe_load(text) if text.strip() else None
        except yaml.YAMLError:
            value = text
        except ConfigError as e:
            raise ConfigError(f'override {item!r}: {e}') from None
        out.append((key, value))
    return out


def apply_overrides(raw: Dict[str, Any], overrides: Iterable[Tuple[str, Any]]) -> Dict[str, Any]:
    """Set dotted keys in a raw config tree (validation happens later, in `build_config`)."""
    raw = copy.deepcopy(raw)
    for key, value in overrides:
        node = raw
        parts = key.split('.')
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise ConfigError(f'cannot set {key!r}: {".".join(parts[:i + 1])} is {child!r}, not a section')
            node = child
        node[parts[-1]] = value
    return raw


# ---------------------------------------------------------------------- validation
def _type_name(hint: Any) -> str:
    if hint is type(None):
        return 'null'
    if isinstance(hint, type):
        return hint.__name__
    return str(hint).replace('typing.', '')


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return validate_section(hint, value, key)
    if origin is Union:
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f'{key}: may not be null')
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f'{key}: {value!r} is not a {" or ".join(_type_name(a) for a in args)}')
    if value is None:
        raise ConfigError(f'{key}: may not be null (expected {_type_name(hint)})')
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        if value is True and 'on' in args:  # YAML reads a bare on/off as a bool
            return 'on'
        if value is False and 'off' in args:
            return 'off'
        raise ConfigError(f'{key}: {value!r} is not allowed; allowed values: {", ".join(map(repr, args))}')
    if origin in (list, tuple, List, Tuple, Sequence) or hint in (list, tuple):
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(items) != len(args):
                raise ConfigError(f'{key}: expected {len(args)} values, got {value!r}')
            return tuple(_coerce(v, a, f'{key}[{i}]') for i, (v, a) in enumerate(zip(items, args)))
        elem = args[0] if args else Any
        out = [_coerce(v, elem, f'{key}[{i}]') for i, v in enumerate(items)]
        return tuple(out) if origin is tuple else out
    if origin in (dict, Dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f'{key}: expected a mapping, got {value!r}')
        vt = args[1] if args else Any
        return {str(k): _coerce(v, vt, f'{key}.{k}') for k, v in value.items()}
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f'{key}: expected true or false, got {value!r}')
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigError(f'{key}: expected an integer, got {value!r}')
        try:
            number = float(value)  # YAML 1.1 reads 1e3 as a string
        except ValueError:
            number = math.nan
        if not number.is_integer():
            raise ConfigError(f'{key}: expected an integer, got {value!r}')
        return int(number)
    if hint is float:
        if isinstance(value, bool):
            raise ConfigError(f'{key}: expected a number, got {value!r}')
        try:
            return float(value)  # YAML 1.1 reads 1e-3 as a string
        except (TypeError, ValueError):
            raise ConfigError(f'{key}: expected a number, got {value!r}') from None
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f'{key}: expected a string, got {value!r}')
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
            close = difflib.get_close_matches(str(k), fields, n=3, cutoff=0.6)
            close = [f'{key}.{c}' if key else c for c in close]
            hint = f' Did you mean {" or ".join(repr(c) for c in close)}?' if close else ''
            valid = ', '.join(fields) if fields else 'none (this section must be empty)'
            raise ConfigError(f'unknown config key {full!r}.{hint} Valid keys here: {valid}.')
        value = _coerce(v, hints[k], full)
        _check_bounds(value, fields[k].metadata, full)
        if isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                _check_bounds(item, fields[k].metadata, f'{full}[{i}]')
        kwargs[k] = value
    try:
        return cls(**kwargs)
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


def build_config(raw: Mapping[str, Any]) -> Config:
    """Validate a raw tree: generic sections here, ``model``/``data``/``loss`` by the task's dataclasses."""
    from .tasks import get_task  # tasks import this module

    raw = dict(raw)
    task_name = raw.get('task', Config.task)
    if not isinstance(task_name, str):
        raise ConfigError(f'task: expected a task name, got {task_name!r}')
    try:
        task_cls = get_task(task_name)
    except ValueError as e:
        raise ConfigError(f'task: {e}') from None
    for key, values in (raw.get('sweep') or {}).items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f'sweep.{key}: expected a non-empty list of values for the dotted key {key!r} '
                              f"(e.g. sweep='{{model.pe: [none, rope_mixed]}}'), got {values!r}")
    task_raw = {s: raw.pop(s, None) for s in TASK_SECTIONS}
    cfg = validate_section(Config, raw, '')
    if not re.fullmatch(r'auto|cpu|cuda(:\d+)?', cfg.train.device):
        raise ConfigError(f"train.device: {cfg.train.device!r} is not allowed; allowed values: 'auto', 'cpu', "
                          f"'cuda', 'cuda:N'")
    for section, cls in zip(TASK_SECTIONS, (task_cls.ModelConfig, task_cls.DataConfig, task_cls.LossConfig)):
        setattr(cfg, section, validate_section(cls, task_raw[section], section))
    task_cls.check_config(cfg)
    return cfg


def load_config(path: Optional[Union[str, Path]], overrides: Iterable[str] = ()) -> Tuple[Config, Dict[str, Any]]:
    """Read, override and validate a config; returns the config and the raw tree (for sweeps)."""
    raw = load_yaml(path) if path is not None else {}
    raw = apply_overrides(raw, parse_overrides(overrides))
    if path is not None and not raw.get('name'):
        raw['name'] = Path(path).stem
    cfg = build_config(raw)
    for key, values in cfg.sweep.items():  # every sweep value must be a valid override on its own
        for value in values:
            build_config(apply_overrides(raw, [(key, value)]))
    return cfg, raw


def expand_sweep(raw: Mapping[str, Any]) -> List[Tuple[str, Config]]:
    """One ``(suffix, config)`` per combination of ``sweep`` values, in file order (suffix '' if none)."""
    sweep = dict(raw.get('sweep') or {})
    combos: List[List[Tuple[str, Any]]] = [[]]
    for key, values in sweep.items():
        combos = [c + [(key, v)] for c in combos for v in values]
    base = {k: v for k, v in raw.items() if k != 'sweep'}
    out = []
    for combo in combos:
        suffix = '_'.join(_slug(v) for _, v in combo)
        if any(suffix == s for s, _ in out):  # distinct values with one folder name
            suffix = f'{suffix}_{len(out)}'
        out.append((suffix, build_config(apply_overrides(base, combo))))
    return out


def _slug(value: Any) -> str:
    """A folder name for a sweep value: ``rope_mixed``, ``irpe_mode_bias``, ``rope_axial_theta_10``."""
    if isinstance(value, Mapping):
        name = str(value.get('name', ''))
        rest = ','.join(f'{k}={v}' for k, v in value.items() if k != 'name')
        text = f'{name}:{rest}' if rest else name
    elif isinstance(value, (list, tuple)):
        text = '+'.join(_slug(v) for v in value)
    else:
        text = str(value)
    return ''.join(c if c.isalnum() or c in '+-.' else '_' for c in text)
