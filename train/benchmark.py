"""Resolution-extrapolation benchmark: every image encoding, several seeds, two tasks, one table and plot.

    python -m train configs/benchmark/extrapolation.yaml [benchmark.seeds=[0] ...]
    python -m train.benchmark configs/benchmark/extrapolation.yaml          # the same
    python -m train.benchmark --docs runs/benchmark/extrapolation.json      # the docs page from a results file

A benchmark config has one section, ``benchmark:`` (`BenchmarkConfig`). Each of its tasks is an
ordinary training config (``python -m train`` would run it alone); the benchmark sets on it what the
protocol fixes for every run (`ProtocolConfig`: training size, patch size, how a learned table is
resampled, trained or frozen encoding parameters, mixed-resolution training), then the encoding
and the seed. Every (task, encoding, seed) is one run of the shared loop (`train.engine.Trainer`),
evaluated afterwards by the resolution sweep of `train.extrapolate` at ``test_scales`` times the
training side. The seed fixes the data order and the initialisation, so all encodings of a seed see
the same batches in the same order.

Variants (``variants:``) are encodings that differ from a benchmarked one only in options that act
at evaluation (frequency scaling, the table's resampling mode, a test-time slope): with
``weights_of`` they are evaluated on that encoding's trained weights of the same task and seed (no
training), after a check that the two models hold the same parameters; whether they compute the
same function at the training size is recorded too. Without ``weights_of`` they are trained like
any other encoding. With mixed-resolution training every variant is trained (scaling then acts in
training too).

Outputs, ``<output_dir>/<name>.{json,csv,md,png}``: per task, encoding and test size the mean and
sample standard deviation (``ddof=1``) of top-1 over the seeds, the rank among the benchmarked
encodings at each size (1 = best mean, equal means share the better rank), training cost (CPU
seconds of the training process, mean over seeds) as a ratio to NoPE, and in the JSON every run's
own numbers, the date, hardware, library versions and the config. Runs live in
``<output_dir>/<name>/<task>/<encoding>/seed<k>/``; each writes ``result.json`` when it is done,
and ``benchmark.resume: true`` reuses finished runs (an interrupted benchmark continues).
"""
from __future__ import annotations

import argparse
import copy
import csv
import dataclasses
import datetime
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
import yaml
from torch import nn

import vispe

from .checkpoint import atomic_save, load_checkpoint
from .config import (
    ConfigError, apply_overrides, build_config, load_yaml, parse_overrides, to_dict, validate_section,
)
from .distributed import DistEnv
from .engine import Trainer
from .extrapolate import evaluate_checkpoints
from .schema import Config, option

__all__ = [
    'ProtocolConfig', 'VariantConfig', 'BenchmarkConfig', 'PublishedOrdering', 'PUBLISHED_ORDERINGS',
    'FAMILY_GROUPS', 'load_benchmark', 'protocol_sizes', 'select_encodings', 'summarize', 'run_benchmark',
    'render_markdown', 'write_outputs', 'update_docs', 'is_benchmark_config', 'main',
]

_logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- config
@dataclass
class ProtocolConfig:
    """What every run of the benchmark shares: the published protocols' knobs, at small scale.

    Defaults follow RoPE-ViT and LookHere: one training resolution, square inputs, a learned table
    resampled bicubically, encoding parameters trained, no mixed-resolution training.
    """
    train_size: int = option(32, 'training side in pixels, for every task (data.img_size)', min=8)
    test_scales: List[float] = option(factory=lambda: [0.75, 1.0, 1.5, 2.0, 3.0, 4.0],
                                      help='test sides as multiples of train_size; each must give a multiple '
                                           'of patch_size', min=0.01)
    patch_size: int = option(8, 'ViT patch size (model.kwargs.patch_size)', min=1)
    learned_resample: Literal['bicubic', 'bilinear', 'nearest'] = option(
        'bicubic', "how learned tables ('learned', 'swin_rpb') are resampled to other grids (their "
                   'interpolation option, where the spec does not set it)')
    pe_trainable: bool = option(True, "train the encodings' own parameters (learned frequencies, tables, "
                                      'generators); false: keep them at their initialisation (fixed)')
    mixed_resolution: List[int] = option(factory=list, help='training sides drawn per batch (each batch resized, '
                                                            'bilinear, antialiased); empty: train at train_size '
                                                            'only', min=8)


@dataclass
class VariantConfig:
    """An encoding evaluated beside the benchmarked ones (part of the options sweep)."""
    pe: str = option('', 'encoding spec, e.g. rope_axial:scaling=ntk')
    weights_of: Optional[str] = option(None, 'a benchmarked encoding whose trained weights it is evaluated with '
                                             '(null: trained like the others)')
    note: str = option('', 'what the variant changes, for the table')


@dataclass
class BenchmarkConfig:
    """``benchmark:`` section (see the module docstring)."""
    name: str = option('extrapolation', 'output file stem; runs go to output_dir/name/')
    output_dir: str = option('runs/benchmark', 'folder of the outputs')
    seeds: List[int] = option(factory=lambda: [0, 1, 2], help='training seeds (data order and init)', min=0)
    encodings: Any = option('all', "'all' (every registered encoding an image ViT can host) or a list of specs")
    options: Dict[str, Dict[str, Any]] = option(factory=dict, help='per encoding name, options set on it where '
                                                                   'its spec does not set them (with the reason '
                                                                   'in the config)')
    exclude: Dict[str, str] = option(factory=dict, help='encoding name -> reason, left out')
    variants: List[VariantConfig] = option(factory=list, help='further encodings, evaluated on the weights of a '
                                                              'benchmarked one or trained')
    tasks: Dict[str, str] = option(factory=dict, help="task name -> training config (a path relative to this "
                                                        "config's folder, or to its base: files' folders)")
    protocol: ProtocolConfig = option(factory=ProtocolConfig)
    workers: int = option(1, 'training processes in parallel (one torch thread each)', min=1)
    resume: bool = option(False, 'reuse finished runs (their result.json) and continue unfinished ones')
    batch_size: Optional[int] = option(None, 'evaluation batch (null: the task config\'s)', min=1)


def is_benchmark_config(path: str) -> bool:
    """Whether the YAML file at ``path`` is a benchmark config (has a ``benchmark:`` section)."""
    try:
        return 'benchmark' in load_yaml(path)
    except ConfigError:
        return False


def load_benchmark(path: str, overrides: Sequence[str] = ()) -> Tuple[BenchmarkConfig, Dict[str, Dict[str, Any]]]:
    """The validated ``benchmark`` section of ``path`` with ``overrides`` (``benchmark.seeds=[0]``), and
    each task's training config as a raw tree (``base:`` resolved)."""
    raw = apply_overrides(load_yaml(path), parse_overrides(overrides))
    extra = sorted(set(raw) - {'benchmark'})
    if extra:
        raise ConfigError(f'a benchmark config holds only a benchmark: section; found {extra} too (training keys '
                          f'belong in the task configs it names)')
    section = dict(raw['benchmark'] or {})
    section['variants'] = [validate_section(VariantConfig, v, f'benchmark.variants[{i}]')
                           for i, v in enumerate(section.get('variants') or [])]
    cfg = validate_section(BenchmarkConfig, section, 'benchmark')
    if not cfg.tasks:
        raise ConfigError('benchmark.tasks: name at least one task, e.g. {shapes: _shapes.yaml}')
    if not cfg.seeds or len(set(cfg.seeds)) != len(cfg.seeds):
        raise ConfigError(f'benchmark.seeds: give distinct seeds, got {cfg.seeds}')
    for v in cfg.variants:
        if not v.pe:
            raise ConfigError('benchmark.variants: every variant needs a pe spec')
    tasks = {}
    for name, file in cfg.tasks.items():
        found = [d / file for d in _config_dirs(Path(path)) if (d / file).is_file()]
        if not found:
            raise ConfigError(f'benchmark.tasks.{name}: {file} not found next to {path} or its base: files')
        tree = load_yaml(found[0])
        if 'benchmark' in tree:
            raise ConfigError(f'benchmark.tasks.{name}: {file} is a benchmark config, not a training config')
        tasks[name] = tree
    protocol_sizes(cfg.protocol)  # the sizes must fit the patch before anything trains
    return cfg, tasks


def _config_dirs(path: Path) -> List[Path]:
    """The folder of a config and of its ``base:`` files, nearest first: where its relative paths resolve."""
    dirs = [path.parent]
    with open(path) as f:
        bases = (yaml.safe_load(f) or {}).get('base') or []  # load_yaml has read and checked this file already
    for b in [bases] if isinstance(bases, str) else bases:
        dirs += [d for d in _config_dirs(path.parent / b) if d not in dirs]
    return dirs


def protocol_sizes(protocol: ProtocolConfig) -> List[int]:
    """The test sides in pixels, ``round(scale * train_size)``; each a multiple of the patch size."""
    p = protocol
    sizes = [round(s * p.train_size) for s in p.test_scales]
    bad = [(s, x) for s, x in zip(p.test_scales, sizes) if x % p.patch_size or x < p.patch_size]
    if bad:
        raise ConfigError(f'benchmark.protocol.test_scales: {bad[0][0]} x {p.train_size} px = {bad[0][1]} px is not a '
                          f'positive multiple of the patch size {p.patch_size}')
    for size in p.mixed_resolution:
        if size % p.patch_size:
            raise ConfigError(f'benchmark.protocol.mixed_resolution: {size} px is not a multiple of the patch size '
                              f'{p.patch_size}')
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f'benchmark.protocol.test_scales: two scales give the same size ({sizes})')
    return sizes


# ---------------------------------------------------------------------- encodings
def select_encodings(cfg: BenchmarkConfig) -> Tuple[List[str], Dict[str, str]]:
    """The benchmarked encoding specs (configured options applied) and the left-out ones with the reason.

    ``'all'`` is every registered encoding except those that read `Positions` fields an image ViT
    does not supply (cameras, view indices: the class declares them in ``requires``) and those in
    ``exclude``.
    """
    excluded: Dict[str, str] = {}
    if cfg.encodings == 'all':
        names = []
        for name in vispe.list_pes():
            needs = sorted(getattr(vispe.pe_info(name)['cls'], 'requires', ()) or ())
            if name in cfg.exclude:
                excluded[name] = cfg.exclude[name]
            elif needs:
                excluded[name] = f'needs {", ".join(needs)} in its positions, which an image ViT does not supply'
            else:
                names.append(name)
        specs = names
    elif isinstance(cfg.encodings, list) and cfg.encodings:
        specs = [s for s in cfg.encodings if _names(s)[0] not in cfg.exclude]
        excluded = {n: r for n, r in cfg.exclude.items()}
    else:
        raise ConfigError(f"benchmark.encodings: 'all' or a non-empty list of encoding specs, got {cfg.encodings!r}")
    for name in cfg.options:
        if name not in vispe.list_pes():
            raise ConfigError(f'benchmark.options.{name}: not a registered encoding')
    out = [_with_options(s, cfg.options) for s in specs]
    if len(set(out)) != len(out):
        raise ConfigError(f'benchmark.encodings: the same encoding twice in {out}')
    return out, excluded


def _names(spec: Any) -> List[str]:
    try:
        return [n for n, _ in vispe.parse_pe_spec(spec, typed=True)]
    except (TypeError, ValueError) as e:
        raise ConfigError(f'benchmark: encoding spec {spec!r}: {e}') from None


def _with_options(spec: Any, options: Dict[str, Dict[str, Any]]) -> str:
    """``spec`` with the configured per-encoding options set where the spec does not set them."""
    parts = vispe.parse_pe_spec(spec, typed=True)
    return vispe.format_pe_spec([(n, {**options.get(n, {}), **opts}) for n, opts in parts])


LEARNED_TABLES = ('learned', 'swin_rpb')
"""Encodings whose learned table is resampled for other grids (their ``interpolation`` option)."""


def effective_spec(spec: str, protocol: ProtocolConfig) -> str:
    """The spec a run builds: the protocol's resampling mode on the learned tables that do not set one."""
    parts = vispe.parse_pe_spec(spec, typed=True)
    out = [(n, {'interpolation': protocol.learned_resample, **o} if n in LEARNED_TABLES else o) for n, o in parts]
    return vispe.format_pe_spec(out)


def family(spec: str) -> str:
    """The registry family of an encoding spec's first part."""
    return vispe.pe_info(_names(spec)[0])['family']


FAMILY_GROUPS: Dict[str, str] = {
    'baseline': 'absolute (added to the tokens)', 'fourier': 'absolute (added to the tokens)',
    'coordinate': 'absolute (added to the tokens)', 'detr': 'absolute (added to the tokens)',
    'conditional': 'absolute (added to the tokens)',
    'rope': 'rotary, fixed or axial frequencies', 'directional_rope': 'rotary, fixed or axial frequencies',
    'gta': 'rotary, fixed or axial frequencies',
    'liere': 'rotary, learned generators', 'comrope': 'rotary, learned generators',
    'string': 'rotary, learned generators',
    'relative_bias': 'attention bias', 'irpe': 'attention bias', 'pape': 'attention bias',
}
"""Plot panel of each registry family; a family not listed gets a panel of its own. RoPE-Mixed (learned
frequencies) sits in the panel of its family, ``rope``."""


# ---------------------------------------------------------------------- one run
class _MixedResolution:
    """A task whose training batches are resized to a side drawn from ``sizes`` per optimizer step
    (from ``(seed, step)`` only, so a resumed run draws the same sides); everything else is the task's."""

    def __init__(self, task: Any, sizes: Sequence[int], seed: int) -> None:
        self._task, self._sizes, self._seed = task, list(sizes), seed

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def side(self, step: int) -> int:
        return self._sizes[int(np.random.default_rng([self._seed, step]).integers(len(self._sizes)))]

    def train_step(self, model: nn.Module, batch: Any, step: int):
        x, size = batch[0], self.side(step)
        if x.shape[-1] != size or x.shape[-2] != size:
            x = F.interpolate(x, size=(size, size), mode='bilinear', align_corners=False, antialias=True)
        return self._task.train_step(model, (x, *batch[1:]), step)


class BenchmarkTrainer(Trainer):
    """The shared loop with the protocol's two training-side knobs: frozen encoding parameters
    (``pe_trainable: false``; parameters without gradients are skipped by the optimizer) and
    mixed-resolution batches."""

    def __init__(self, cfg: Config, env: DistEnv, run_dir: Path, protocol: ProtocolConfig) -> None:
        super().__init__(cfg, env, run_dir)
        if not protocol.pe_trainable:
            for name, param in self.model.named_parameters():
                if name.startswith('pe.'):
                    param.requires_grad_(False)
        if protocol.mixed_resolution:
            self.task = _MixedResolution(self.task, protocol.mixed_resolution, cfg.seed)


def run_config(task_tree: Dict[str, Any], protocol: ProtocolConfig, spec: str, seed: int, run_dir: Path,
               resume: bool) -> Config:
    """The training config of one run: the task's, with the protocol, encoding and seed set."""
    over = [('model.pe', spec), ('seed', seed), ('data.img_size', protocol.train_size),
            ('model.kwargs.patch_size', protocol.patch_size), ('output_dir', str(run_dir.parent)),
            ('name', run_dir.name), ('log.progress', 'off'), ('log.tensorboard', 'off'),
            ('train.resume', 'auto' if resume else None)]
    raw = apply_overrides({k: v for k, v in task_tree.items() if k not in ('sweep', 'extrapolate')}, over)
    cfg = build_config(raw)
    cfg.train.eval_every = cfg.train.epochs  # one evaluation, after the last step: best.pt = the final weights
    return cfg


def _run_job(job: Dict[str, Any]) -> Dict[str, Any]:
    """Train one (task, encoding, seed) and evaluate it at the test sizes; writes and returns its record."""
    _quiet_worker()
    run_dir = Path(job['run_dir'])
    protocol = ProtocolConfig(**job['protocol'])
    cfg = run_config(job['task_tree'], protocol, job['spec'], job['seed'], run_dir, job['resume'])
    t0, c0 = time.perf_counter(), time.process_time()
    trainer = BenchmarkTrainer(cfg, DistEnv(), run_dir, protocol)
    result = trainer.fit()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rows = evaluate_checkpoints([result.best_path], job['sizes'], batch_size=job['batch_size'], progress_mode='off')
    record = dict(task=job['task'], encoding=job['label'], spec=job['spec'], seed=job['seed'], kind='trained',
                  params=result.params, steps=result.steps, train_wall_s=wall, train_cpu_s=cpu,
                  resumed=trainer.resumed_from is not None,  # then the cost covers the resumed part only
                  eval_wall_s=time.perf_counter() - t0 - wall, eval_cpu_s=time.process_time() - c0 - cpu,
                  train_size=protocol.train_size, chance=rows[0]['chance'], metric=rows[0]['metric'],
                  top1={str(r['size']): r[r['metric']] for r in rows})
    (run_dir / 'result.json').write_text(json.dumps(record, indent=1) + '\n')
    return record


def _variant_job(job: Dict[str, Any]) -> Dict[str, Any]:
    """Evaluate a variant on the weights of its base run: the base's best.pt with the variant's encoding."""
    _quiet_worker()
    run_dir = Path(job['run_dir'])
    base = load_checkpoint(Path(job['base_dir']) / 'best.pt')
    ckpt = copy.deepcopy(base)
    ckpt['model_spec']['kwargs']['pe'] = job['spec']
    ckpt['config']['model']['pe'] = job['spec']
    ckpt['weights_of'] = job['base_dir']
    same = _same_function(base, ckpt)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_save(ckpt, run_dir / 'best.pt')
    rows = evaluate_checkpoints([run_dir / 'best.pt'], job['sizes'], batch_size=job['batch_size'],
                                progress_mode='off')
    record = dict(task=job['task'], encoding=job['label'], spec=job['spec'], seed=job['seed'], kind='variant',
                  weights_of=job['weights_of'], identical_at_train_size=same, train_size=job['train_size'],
                  chance=rows[0]['chance'], metric=rows[0]['metric'],
                  top1={str(r['size']): r[r['metric']] for r in rows})
    (run_dir / 'result.json').write_text(json.dumps(record, indent=1) + '\n')
    return record


def _same_function(base: Dict[str, Any], variant: Dict[str, Any]) -> bool:
    """Whether the variant holds the base's parameters (else a clear error) and computes exactly the same
    outputs at the training size (on a fixed random batch)."""
    import timm
    models = []
    for ckpt in (base, variant):
        spec = ckpt['model_spec']
        model = timm.create_model(spec['name'], **spec['kwargs'])
        try:
            model.load_state_dict(ckpt['model'])
        except RuntimeError as e:
            raise ConfigError(f"benchmark.variants: {spec['kwargs']['pe']!r} does not hold the parameters of "
                              f"{base['model_spec']['kwargs']['pe']!r}, so it cannot use its weights ({e}); drop "
                              f'weights_of to train it') from None
        models.append(model.eval())
    size = base['config']['data']['img_size']
    x = torch.randn(4, 3, size, size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return bool(torch.equal(models[0](x), models[1](x)))


def _quiet_worker() -> None:
    torch.set_num_threads(1)
    logging.getLogger('train').setLevel(logging.WARNING)


# ---------------------------------------------------------------------- the whole benchmark
def _slug(spec: str) -> str:
    return ''.join(c if c.isalnum() or c in '+-.=' else '_' for c in spec)


def plan(cfg: BenchmarkConfig, tasks: Dict[str, Dict[str, Any]]) -> Tuple[List[Dict[str, Any]],
                                                                          List[Dict[str, Any]], Dict[str, str]]:
    """Training jobs, variant jobs (evaluated after the training jobs) and the left-out encodings."""
    specs, excluded = select_encodings(cfg)
    p = cfg.protocol
    sizes = protocol_sizes(p)
    root = Path(cfg.output_dir) / cfg.name
    trained = [(s, s) for s in specs]  # (label, spec as configured)
    derived = []
    for v in cfg.variants:
        spec = _with_options(v.pe, cfg.options)
        if v.weights_of is not None and not p.mixed_resolution:
            base = _with_options(v.weights_of, cfg.options)
            if base not in specs:
                raise ConfigError(f'benchmark.variants: weights_of {v.weights_of!r} is not a benchmarked encoding '
                                  f'({specs})')
            derived.append((spec, spec, base))
        else:
            trained.append((spec, spec))
    labels = [t[0] for t in trained] + [d[0] for d in derived]
    if len(set(labels)) != len(labels):
        raise ConfigError(f'benchmark.variants: a variant repeats an encoding ({labels})')
    jobs, variant_jobs = [], []
    for seed in cfg.seeds:  # seed-major: a partial benchmark holds whole seeds
        for task, tree in tasks.items():
            for label, spec in trained:
                jobs.append(dict(task=task, label=label, spec=effective_spec(spec, p), seed=seed, sizes=sizes,
                                 task_tree=tree, protocol=dataclasses.asdict(p), resume=cfg.resume,
                                 batch_size=cfg.batch_size, run_dir=str(root / task / _slug(label) / f'seed{seed}')))
            for label, spec, base in derived:
                variant_jobs.append(dict(task=task, label=label, spec=effective_spec(spec, p), seed=seed,
                                         sizes=sizes, weights_of=base, train_size=p.train_size,
                                         batch_size=cfg.batch_size,
                                         base_dir=str(root / task / _slug(base) / f'seed{seed}'),
                                         run_dir=str(root / task / _slug(label) / f'seed{seed}')))
    return jobs, variant_jobs, excluded


def _check_models(jobs: Sequence[Dict[str, Any]]) -> None:
    """Build every (task, encoding) model once before anything trains: a spec the tiny ViT cannot host
    stops the benchmark now, not an hour in."""
    seen = set()
    for job in jobs:
        key = (job['task'], job['spec'])
        if key in seen:
            continue
        seen.add(key)
        cfg = run_config(job['task_tree'], ProtocolConfig(**job['protocol']), job['spec'], job['seed'],
                         Path(job['run_dir']), True)
        m = cfg.model
        import timm
        try:
            timm.create_model(m.name, pe=m.pe, img_size=cfg.data.img_size, num_classes=m.num_classes or 10,
                              **m.kwargs)
        except (TypeError, ValueError) as e:
            raise ConfigError(f'benchmark: task {job["task"]!r} cannot build {m.name} with pe={m.pe!r}: {e}') from None


def _finished(job: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    path = Path(job['run_dir']) / 'result.json'
    return json.loads(path.read_text()) if path.is_file() else None


def _run_all(fn: Callable[[Dict[str, Any]], Dict[str, Any]], jobs: Sequence[Dict[str, Any]], workers: int,
             resume: bool, done: int, total: int, t0: float) -> Tuple[List[Dict[str, Any]], int]:
    """Every job's record, run by ``workers`` processes, and how many were reused (finished earlier)."""
    records: List[Optional[Dict[str, Any]]] = [None] * len(jobs)
    todo = []
    for i, job in enumerate(jobs):
        old = _finished(job) if resume else None
        if old is not None:
            records[i] = old
        else:
            todo.append(i)
    done += len(jobs) - len(todo)

    def report(i: int, rec: Dict[str, Any]) -> None:
        nonlocal done
        done += 1
        records[i] = rec
        where = ', '.join(f'{s} {v:.1f}' for s, v in rec['top1'].items())
        cost = f', {rec["train_cpu_s"]:.0f} s CPU' if 'train_cpu_s' in rec else ''
        _logger.info('[%d/%d %.0f s] %s %s seed %d%s: %s', done, total, time.perf_counter() - t0, rec['task'],
                     rec['encoding'], rec['seed'], cost, where)

    if workers == 1:
        for i in todo:
            report(i, fn(jobs[i]))
    else:
        with ProcessPoolExecutor(workers, mp_context=get_context('spawn')) as pool:
            futures = {pool.submit(fn, jobs[i]): i for i in todo}
            for fut in as_completed(futures):
                report(futures[fut], fut.result())
    return [r for r in records if r is not None], len(jobs) - len(todo)


def run_benchmark(path: str, overrides: Sequence[str] = ()) -> Dict[str, Any]:
    """Run the benchmark of config ``path``; writes and returns the results (see `write_outputs`)."""
    cfg, tasks = load_benchmark(path, overrides)
    jobs, variant_jobs, excluded = plan(cfg, tasks)
    specs = select_encodings(cfg)[0]
    if not cfg.resume:  # refuse before anything trains, as python -m train does for a run folder
        taken = [j['run_dir'] for j in jobs + variant_jobs
                 if Path(j['run_dir']).is_dir() and any(Path(j['run_dir']).iterdir())]
        if taken:
            raise ConfigError(f'benchmark.resume: not set, but {taken[0]} (and {len(taken) - 1} more) already holds a '
                              f'run; set benchmark.resume=true to reuse finished runs and continue the others, or '
                              f'choose another benchmark.name / benchmark.output_dir')
    _check_models(jobs)
    for tree in tasks.values():  # a bundled data set is written once here, not by two workers at a time
        data = tree.get('data') or {}
        if data.get('prepare') == 'digits':
            from .data.digits import write_digits
            write_digits(data['root'])
    total = len(jobs) + len(variant_jobs)
    _logger.info('benchmark %s: %d training runs (%d encodings, %d trained variants; %d tasks; %d seeds), %d '
                 'evaluations of variants on trained weights, %d worker(s); left out: %s', cfg.name, len(jobs),
                 len(specs), len(jobs) // len(tasks) // len(cfg.seeds) - len(specs), len(tasks), len(cfg.seeds),
                 len(variant_jobs), cfg.workers,
                 ', '.join(f'{k} ({v})' for k, v in excluded.items()) or 'none')
    t0 = time.perf_counter()
    records, reused = _run_all(_run_job, jobs, cfg.workers, cfg.resume, 0, total, t0)
    more, reused_variants = _run_all(_variant_job, variant_jobs, cfg.workers, cfg.resume, len(jobs), total, t0)
    records += more
    results = dict(
        kind='extrapolation_benchmark', command=' '.join(['python -m train', path, *overrides]),
        environment=_environment(cfg.workers), wall_seconds=time.perf_counter() - t0,
        reused_runs=reused + reused_variants, total_runs=total,
        seeds=list(cfg.seeds), tasks=list(tasks), sizes=protocol_sizes(cfg.protocol),
        train_size=cfg.protocol.train_size, excluded=excluded,
        encodings=specs,
        variants=[dict(encoding=_with_options(v.pe, cfg.options), note=v.note,
                       weights_of=_with_options(v.weights_of, cfg.options)
                       if v.weights_of and not cfg.protocol.mixed_resolution else None)
                  for v in cfg.variants],
        config=dict(benchmark=to_dict(cfg), tasks=tasks), runs=records)
    results.update(summarize(results))
    write_outputs(results, Path(cfg.output_dir) / cfg.name)
    return results


# ---------------------------------------------------------------------- statistics
def _stats(values: Sequence[float]) -> Tuple[float, Optional[float]]:
    """Mean and sample standard deviation (``ddof=1``; None for one value)."""
    n = len(values)
    mean = math.fsum(values) / n
    if n < 2:
        return mean, None
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))


def _ranks(means: Dict[str, float]) -> Dict[str, int]:
    """1 = the highest mean; equal means share the better rank (1, 2, 2, 4)."""
    return {k: 1 + sum(1 for o in means.values() if o > v) for k, v in means.items()}


def summarize(results: Dict[str, Any]) -> Dict[str, Any]:
    """``summary`` (per task, encoding and size: values per seed, mean, std, n, rank among the
    benchmarked encodings) and ``cost`` (per task and trained encoding: mean training CPU seconds and
    their ratio to NoPE's) from the per-run records."""
    runs = results['runs']
    sizes = results['sizes']
    benchmarked = set(results['encodings'])
    summary = []
    for task in results['tasks']:
        labels = list(dict.fromkeys(r['encoding'] for r in runs if r['task'] == task))
        for size in sizes:
            rows = {}
            for label in labels:
                mine = sorted((r for r in runs if r['task'] == task and r['encoding'] == label),
                              key=lambda r: r['seed'])
                values = [r['top1'][str(size)] for r in mine]
                mean, std = _stats(values)
                rows[label] = dict(task=task, encoding=label, family=family(label), size=size,
                                   scale=size / results['train_size'], seeds=[r['seed'] for r in mine],
                                   values=values, n=len(values), mean=mean, std=std,
                                   chance=mine[0]['chance'], benchmarked=label in benchmarked)
            ranks = _ranks({k: r['mean'] for k, r in rows.items() if r['benchmarked']})
            for label, row in rows.items():
                row['rank'] = ranks.get(label)
                summary.append(row)
    cost = []
    for task in results['tasks']:
        trained = [r for r in runs if r['task'] == task and r['kind'] == 'trained']
        if any(not r.get('resumed') for r in trained):  # a resumed run timed only its last part
            trained = [r for r in trained if not r.get('resumed')]
        base = [r['train_cpu_s'] for r in trained if r['encoding'] == 'none']
        base_mean = _stats(base)[0] if base else None
        for label in dict.fromkeys(r['encoding'] for r in trained):
            mine = [r for r in trained if r['encoding'] == label]
            cpu, _ = _stats([r['train_cpu_s'] for r in mine])
            wall, _ = _stats([r['train_wall_s'] for r in mine])
            cost.append(dict(task=task, encoding=label, params=mine[0]['params'], steps=mine[0]['steps'],
                             train_cpu_s=cpu, train_wall_s=wall, n=len(mine),
                             ratio_to_none=cpu / base_mean if base_mean else None))
    return dict(summary=summary, cost=cost)


# ---------------------------------------------------------------------- outputs
def _fmt(mean: float, std: Optional[float]) -> str:
    return f'{mean:.1f}' if std is None else f'{mean:.1f} ± {std:.1f}'


def _task_rows(results: Dict[str, Any], task: str, benchmarked: bool) -> List[str]:
    """Encodings of ``task`` in table order: by mean rank over the sizes above the training size."""
    rows = [r for r in results['summary'] if r['task'] == task and r['benchmarked'] == benchmarked]
    labels = list(dict.fromkeys(r['encoding'] for r in rows))
    if not benchmarked:
        return labels
    above = [s for s in results['sizes'] if s > results['train_size']]

    def key(label: str) -> Tuple[float, str]:
        ranks = [r['rank'] for r in rows if r['encoding'] == label and r['size'] in above]
        return (sum(ranks) / len(ranks) if ranks else 0.0, label)
    return sorted(labels, key=key)


def render_markdown(results: Dict[str, Any], heading: str = '##') -> str:
    """The results as markdown: per task one table (encoding x test size, mean ± std over the seeds and
    the rank at that size), the variants beside their base encoding, the training cost, the left-out
    encodings and the comparison with the published orderings."""
    sizes, train = results['sizes'], results['train_size']
    cell = {(r['task'], r['encoding'], r['size']): r for r in results['summary']}
    env = results['environment']
    above = [s for s in sizes if s > train]
    n_seeds = len(results['seeds'])
    lines = [f'Top-1 (%) on held-out data, mean ± standard deviation over {n_seeds} seed(s) '
             f'({", ".join(map(str, results["seeds"]))}), rank among the {len(results["encodings"])} benchmarked '
             f'encodings in brackets; trained at {train} px (`*`), evaluated at '
             f'{", ".join(f"{s} px ({s / train:g}x)" for s in sizes)}. Rows sorted by mean rank above '
             f'{train} px. *(at chance)*: within 5 points of chance at the training size, so its row says nothing '
             f'about extrapolation.', '']
    for task in results['tasks']:
        chance = next(r['chance'] for r in results['summary'] if r['task'] == task)
        lines += [f'{heading} Task `{task}` (chance {chance:.1f} %)', '',
                  '| encoding | ' + ' | '.join(f'{s}{"*" if s == train else ""}' for s in sizes)
                  + f' | mean rank > {train} px |', '|---|' + '---:|' * (len(sizes) + 1)]
        for label in _task_rows(results, task, True):
            cells = [cell[(task, label, s)] for s in sizes]
            at_train = cell[(task, label, train)]['mean'] if (task, label, train) in cell else None
            flag = ' *(at chance)*' if at_train is not None and at_train < chance + 5 else ''
            mean_rank = sum(c['rank'] for c in cells if c['size'] in above) / max(1, len(above))
            lines.append(f'| `{label}`{flag} | ' + ' | '.join(f'{_fmt(c["mean"], c["std"])} ({c["rank"]})'
                                                          for c in cells) + f' | {mean_rank:.1f} |')
        variants = _task_rows(results, task, False)
        if variants:
            weights = {v['encoding']: v for v in results['variants']}
            lines += ['', f'Variants (options for larger inputs; `weights of`: evaluated on that encoding\'s '
                          f'trained weights, no training):', '',
                      '| variant | weights of | same at 1x | ' + ' | '.join(f'{s}{"*" if s == train else ""}'
                                                                          for s in sizes) + ' |',
                      '|---|---|---|' + '---:|' * len(sizes)]
            for label in variants:
                v = weights.get(label, {})
                same = {r.get('identical_at_train_size') for r in results['runs']
                        if r['task'] == task and r['encoding'] == label}
                same_text = 'yes' if same == {True} else 'no' if same == {False} else '-'
                base = f'`{v["weights_of"]}`' if v.get('weights_of') else 'trained'
                lines.append(f'| `{label}` | {base} | {same_text} | '
                             + ' | '.join(_fmt(cell[(task, label, s)]['mean'], cell[(task, label, s)]['std'])
                                          for s in sizes) + ' |')
        lines.append('')
    tasks = results['tasks']
    cost = {(c['task'], c['encoding']): c for c in results['cost']}
    labels = list(dict.fromkeys(c['encoding'] for c in results['cost']))
    lines += [f'{heading} Training cost', '',
              'CPU seconds of the training process (one torch thread, data loading included, evaluation not), '
              'mean over the seeds, and the ratio to `none` trained on the same task:', '',
              '| encoding | parameters | ' + ' | '.join(f'{t} CPU s | {t} / none' for t in tasks) + ' |',
              '|---|---:|' + '---:|---:|' * len(tasks)]
    for label in labels:
        params = next(cost[(t, label)]['params'] for t in tasks if (t, label) in cost)
        parts = []
        for t in tasks:
            c = cost.get((t, label))
            parts += ['-', '-'] if c is None else [f'{c["train_cpu_s"]:.1f}', '-' if c['ratio_to_none'] is None
                                                  else f'{c["ratio_to_none"]:.2f}x']
        lines.append(f'| `{label}` | {params:,} | ' + ' | '.join(parts) + ' |')
    if results['excluded']:
        lines += ['', 'Left out: ' + '; '.join(f'`{k}` ({v})' for k, v in results['excluded'].items()) + '.']
    lines += ['', f'{heading} Published orderings, measured here', '', *published_comparison(results), '',
              f'*Run {env["date"]} on {env["hardware"]}; python {env["versions"]["python"]}, torch '
              f'{env["versions"]["torch"]}, timm {env["versions"]["timm"]}, vispe {env["versions"]["vispe"]}'
              f'{", commit " + env["versions"]["commit"] if env["versions"].get("commit") else ""}; '
              f'{results["wall_seconds"] / 60:.1f} minutes wall'
              + (f' ({results["reused_runs"]} of {results["total_runs"]} runs reused from an earlier start)'
                 if results.get('reused_runs') else '') + f'. Command: `{results["command"]}`.*']
    return '\n'.join(lines) + '\n'


@dataclass(frozen=True)
class PublishedOrdering:
    """A pairwise result of a paper at a test/train ratio: ``better`` kept more accuracy than ``worse``."""
    better: str
    worse: str
    scale: float  # the nearest test scale of this benchmark to the paper's ratio
    source: str


PUBLISHED_ORDERINGS: Tuple[PublishedOrdering, ...] = (
    PublishedOrdering('rope_mixed', 'rope_axial', 1.5, 'RoPE-ViT (DeiT-III ViT-S, 224 -> 384 px, 1.7x): Mixed 81.8 vs '
                                                       'Axial 80.0; ViT-B 84.4 vs 83.9'),
    PublishedOrdering('lookhere', 'rope_axial', 4.0, 'LookHere (224 -> 1024 px, 4.6x): far ahead of 2D RoPE'),
    PublishedOrdering('lookhere', 'rope_mixed', 4.0, 'LookHere (224 -> 1024 px, 4.6x): far ahead of 2D RoPE'),
    PublishedOrdering('comrope_ld', 'comrope_ap', 2.0, 'ComRoPE (224 -> 512 px, 2.3x): LD 55.29 vs AP 54.02'),
    PublishedOrdering('comrope_ap', 'liere', 2.0, 'ComRoPE (224 -> 512 px, 2.3x): AP 54.02 vs LieRE 53.74'),
    PublishedOrdering('liere', 'rope_axial', 2.0, 'ComRoPE (224 -> 512 px, 2.3x): LieRE 53.74 vs RoPE 51.11'),
    PublishedOrdering('rope_axial', 'learned', 2.0, 'ComRoPE (224 -> 512 px, 2.3x): RoPE 51.11 vs APE 50.99'),
    PublishedOrdering('peg', 'learned', 2.0, 'CPVT (DeiT-tiny, 224 -> 512 px, 2.3x): CPVT-Ti 70.3 vs DeiT-tiny 65.9'),
)
"""Published pairwise orderings, as the encoding pages state them (no other source
consulted). ComRoPE's "RoPE" is matched with ``rope_axial`` and its APE with ``learned``; LookHere's
"2D RoPE" with both RoPE-ViT variants."""


def published_comparison(results: Dict[str, Any]) -> List[str]:
    """A markdown table: each published ordering whose two encodings were benchmarked, against the
    measured means at the nearest test size.

    ``agrees``: the measured difference has the published sign and exceeds the larger of the two
    standard deviations; ``reversed``: the opposite sign, beyond it; ``within noise`` otherwise; with
    one seed there is no spread, and the verdict says so.
    """
    train, sizes = results['train_size'], results['sizes']
    cell = {(r['task'], r['encoding'], r['size']): r for r in results['summary']}
    by_name = {}
    for label in results['encodings']:
        by_name.setdefault(_names(label)[0], label)  # the benchmarked spec of each encoding name
    claims = [c for c in PUBLISHED_ORDERINGS if c.better in by_name and c.worse in by_name]
    if not claims:
        return ['None of the published pairs was benchmarked in this run.']
    lines = ['| published | at | ' + ' | '.join(f'{t}: better / worse | {t}' for t in results['tasks']) + ' |',
             '|---|---|' + '---|---|' * len(results['tasks'])]
    for claim in claims:
        size = min(sizes, key=lambda s: abs(s / train - claim.scale))
        a, b = by_name[claim.better], by_name[claim.worse]
        parts = []
        for task in results['tasks']:
            ca, cb = cell[(task, a, size)], cell[(task, b, size)]
            diff = ca['mean'] - cb['mean']
            noise = max(ca['std'] or 0.0, cb['std'] or 0.0)
            verdict = 'agrees' if diff > noise else 'reversed' if diff < -noise else 'within noise'
            if min(ca['n'], cb['n']) < 2:  # no spread to compare the difference with
                verdict += ' (one seed)'
            parts += [f'{ca["mean"]:.1f} / {cb["mean"]:.1f}', verdict]
        lines.append(f'| `{claim.better}` > `{claim.worse}` ({claim.source}) | {size} px ({size / train:g}x) | '
                     + ' | '.join(parts) + ' |')
    return lines


def _csv_rows(results: Dict[str, Any]) -> Tuple[List[str], List[Dict[str, Any]]]:
    seeds = results['seeds']
    header = ['task', 'encoding', 'family', 'benchmarked', 'size', 'scale', 'n', 'mean', 'std', 'rank',
              *[f'seed{s}' for s in seeds]]
    rows = []
    for r in results['summary']:
        row = {k: r[k] for k in header if k in r}
        row.update({f'seed{s}': v for s, v in zip(r['seeds'], r['values'])})
        rows.append(row)
    return header, rows


def write_outputs(results: Dict[str, Any], stem: Path) -> Dict[str, Path]:
    """``stem.json`` (everything), ``stem.csv`` (one row per task, encoding and size: per-seed values,
    mean, std, rank), ``stem.md`` and ``stem.png``."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = {k: stem.with_suffix(f'.{k}') for k in ('json', 'csv', 'md', 'png')}
    paths['json'].write_text(json.dumps(results, indent=1) + '\n')
    header, rows = _csv_rows(results)
    with open(paths['csv'], 'w', newline='') as f:
        w = csv.DictWriter(f, header)
        w.writeheader()
        w.writerows(rows)
    paths['md'].write_text(f'# Which encoding extrapolates ({results["environment"]["date"]})\n\n'
                           + render_markdown(results))
    plot(results, paths['png'])
    return paths


def plot(results: Dict[str, Any], path: Path) -> None:
    """Top-1 against test size: one row of panels per family group, one column per task, one line per
    encoding (error bars: the standard deviation over the seeds); NoPE in every panel, dashed."""
    from vispe.extras import require
    matplotlib = require('matplotlib', 'the benchmark plot')
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    tasks, train = results['tasks'], results['train_size']
    groups: Dict[str, List[str]] = {}
    for label in results['encodings']:
        groups.setdefault(FAMILY_GROUPS.get(family(label), family(label)), []).append(label)
    variants = [v['encoding'] for v in results['variants']]
    bases = [b for b in dict.fromkeys(v['weights_of'] for v in results['variants'] if v['weights_of'])
             if b in results['encodings']]
    if variants:  # beside the encodings whose weights they use (dash-dotted)
        groups['variants (options for larger inputs)'] = bases + variants
    fig, axes = plt.subplots(len(groups), len(tasks), figsize=(5.2 * len(tasks), 2.9 * len(groups)),
                             squeeze=False, sharex=True)
    cell = {(r['task'], r['encoding'], r['size']): r for r in results['summary']}
    sizes = results['sizes']
    for row, (group, labels) in enumerate(groups.items()):
        for col, task in enumerate(tasks):
            ax = axes[row][col]
            shown = (['none'] if 'none' in results['encodings'] and 'none' not in labels else []) + labels
            if len(shown) > 10:  # more lines than the default cycle has colours
                ax.set_prop_cycle(color=plt.get_cmap('tab20').colors)
            for label in shown:
                pts = [cell[(task, label, s)] for s in sizes if (task, label, s) in cell]
                if not pts:
                    continue
                style = dict(color='grey', linestyle='--') if label == 'none' and label not in labels else \
                    dict(linestyle='-.') if label in bases and group.startswith('variants') else {}
                ax.errorbar([p['size'] for p in pts], [p['mean'] for p in pts],
                            yerr=[p['std'] or 0.0 for p in pts], marker='o', markersize=3, capsize=2,
                            label=label, **style)
            chance = next((r['chance'] for r in results['summary'] if r['task'] == task), None)
            if chance is not None:
                ax.axhline(chance, color='black', linewidth=0.8, linestyle=':')
            ax.axvline(train, color='grey', linewidth=0.8, linestyle=':')
            ax.set_xscale('log')
            ax.minorticks_off()
            ax.set_xticks(sizes, [str(s) for s in sizes])
            ax.set_ylim(0, 102)
            ax.grid(alpha=0.3)
            if row == 0:
                ax.set_title(f'task {task}', fontsize=10)
            if col == 0:
                ax.set_ylabel(f'{group}\ntop-1 (%)', fontsize=8)
            if col == len(tasks) - 1:
                ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.supxlabel(f'test size (px); dotted lines: the training size ({train} px) and chance', fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches='tight')
    plt.close(fig)


# ---------------------------------------------------------------------- the docs page
DOCS_BEGIN = '<!-- benchmark:results begin (made by python -m train.benchmark --docs; do not edit) -->'
DOCS_END = '<!-- benchmark:results end -->'


def docs_block(results: Dict[str, Any], figure: str) -> str:
    """What the docs page shows between its markers: the plot and `render_markdown` of the results."""
    return (f'{DOCS_BEGIN}\n\n![accuracy against test size, per family group and task]({figure})\n\n'
            f'{render_markdown(results, heading="###")}\n{DOCS_END}')


def update_docs(results_path: Path, page: Path, figures: Path) -> List[Path]:
    """Copy a results file to ``figures/extrapolation_benchmark.json``, draw its plot there, and replace
    the block between the page's markers by `docs_block` of it."""
    results = json.loads(Path(results_path).read_text())
    figures.mkdir(parents=True, exist_ok=True)
    shipped = figures / 'extrapolation_benchmark.json'
    if Path(results_path).resolve() != shipped.resolve():
        shipped.write_text(json.dumps(results, indent=1) + '\n')
    plot(results, figures / 'extrapolation_benchmark.png')
    text = page.read_text()
    start, end = text.find(DOCS_BEGIN), text.find(DOCS_END)
    if start < 0 or end < start:
        raise ValueError(f'{page}: the markers {DOCS_BEGIN!r} ... {DOCS_END!r} are missing')
    figure = os.path.relpath(figures / 'extrapolation_benchmark.png', page.parent)
    page.write_text(text[:start] + docs_block(results, figure) + text[end + len(DOCS_END):])
    return [shipped, figures / 'extrapolation_benchmark.png', page]


# ---------------------------------------------------------------------- provenance and CLI
def _environment(workers: int) -> Dict[str, Any]:
    import timm
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                cpu = line.split(':', 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(['git', '-C', str(Path(__file__).resolve().parent), 'rev-parse', '--short', 'HEAD'],
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
                hardware=f'{cpu}, {os.cpu_count()} logical cores, {workers} training process(es) of 1 torch thread',
                versions=dict(python=platform.python_version(), torch=torch.__version__, timm=timm.__version__,
                              vispe=vispe.__version__, numpy=np.__version__, commit=commit))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog='python -m train.benchmark',
        description='Resolution-extrapolation benchmark: every encoding, several seeds, one table and plot.')
    parser.add_argument('config', nargs='?', help='benchmark config (configs/benchmark/*.yaml)')
    parser.add_argument('overrides', nargs='*', help='benchmark.key=value overrides (benchmark.seeds=[0])')
    parser.add_argument('--docs', metavar='RESULTS_JSON', help='update docs/extrapolation-benchmark.md and its '
                                                               'figure from a results file, and exit')
    parser.add_argument('--print-config', action='store_true', help='print the validated benchmark section and exit')
    args = parser.parse_intermixed_args(argv)
    from .logs import setup_logging
    setup_logging(0)
    try:
        if args.docs:
            root = Path(__file__).resolve().parents[1]
            for p in update_docs(Path(args.docs), root / 'docs' / 'extrapolation-benchmark.md',
                                 root / 'docs' / 'figures'):
                sys.stdout.write(f'wrote {p}\n')
            return 0
        if not args.config:
            parser.error('give a benchmark config, or --docs RESULTS_JSON')
        if args.print_config:
            cfg, _ = load_benchmark(args.config, args.overrides)
            sys.stdout.write(yaml.safe_dump({'benchmark': to_dict(cfg)}, sort_keys=False))
            return 0
        results = run_benchmark(args.config, args.overrides)
    except ConfigError as e:
        sys.stderr.write(f'config error: {e}\n')
        return 2
    cfg_out = Path(results['config']['benchmark']['output_dir']) / results['config']['benchmark']['name']
    sys.stdout.write('\n' + render_markdown(results) + '\n')
    sys.stdout.write(f'wrote {cfg_out}.json, .csv, .md, .png\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
