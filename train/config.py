"""Configs of the training script: YAML files, ``base:`` inheritance, dotted ``key=value`` overrides,
sweeps, and the whole-config validation.

A config is a tree of dataclasses (`train.schema`): the generic sections, and the sections of the
task named by ``task:`` (``model``, ``data``, ``loss``), found in the task registry (`train.tasks`).
Imports go one way, ``config -> tasks -> schema``: tasks never import this module. Every key is
checked against the dataclass fields, every value against the field's type hint and declared
bounds, and an error names the full dotted key (``train.batch_size: expected an integer, got 'big'``)
and, for unknown keys, the closest valid ones.

Files may start from others: ``base: ../_recipes/deit_finetune.yaml`` (a path relative to the
file, or a list of them) is merged first, the file's own keys win, dictionaries merge key by key.

YAML anchors and aliases (``&recipe`` / ``*recipe``) work, but a document whose aliases expand to
more than `MAX_YAML_NODES` values (a "billion laughs" file: a few hundred bytes that unfold into
gigabytes) or refer to themselves is refused before anything walks it.
"""
from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import yaml

from .schema import (
    TASK_SECTIONS, Config, ConfigError, EmaConfig, EmptySection, ExtrapolateConfig, LogConfig, OptimConfig,
    SchedConfig, TrainConfig, option, to_dict, validate_section,
)
from .tasks import get_task

__all__ = [
    'ConfigError', 'option', 'Config', 'OptimConfig', 'SchedConfig', 'TrainConfig', 'EmaConfig', 'LogConfig',
    'ExtrapolateConfig', 'EmptySection', 'load_yaml', 'parse_overrides', 'apply_overrides', 'build_config',
    'load_config', 'to_dict', 'expand_sweep', 'validate_section', 'merge_trees', 'MAX_YAML_NODES',
]

# A real config has a few hundred values; aliases may repeat parts of it, not blow it up.
MAX_YAML_NODES = 100_000


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


# ---------------------------------------------------------------------- the whole config
def build_config(raw: Mapping[str, Any]) -> Config:
    """Validate a raw tree: generic sections here, ``model``/``data``/``loss`` by the task's dataclasses."""
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
