"""Resolution extrapolation: evaluate checkpoints at several input sizes; CSV, Markdown table, PNG plot.

    python -m train.extrapolate runs/*/best.pt --sizes 160 224 288 384 448 512 \\
        --data configs/data/imagenet_val.yaml [data.root=/data/imagenet] [--out DIR]
    python -m train.extrapolate runs/*/best.pt --max-tokens 64 256 1024     # native aspect ratios

Each checkpoint (``best.pt`` or ``checkpoint.pt`` of ``python -m train``) carries the model name and
keyword arguments (encoding included) and its config, so the model is rebuilt exactly and
evaluated on the validation data of its config, or of ``--data`` (a YAML file with a ``data:``
section that replaces the checkpoint's, e.g. the ImageNet validation folder), rendered or
resized to each size. The model keeps its training grid: encodings extrapolate, interpolate or
resample as each one documents. Under ``torchrun`` the evaluation is sharded over the ranks.

Native aspect ratios (NaFlex): ``--max-tokens`` evaluates every checkpoint, whatever its training
data, on images that keep their aspect ratio, each resized to at most that many patches (the
classification task's ``data.naflex``); a checkpoint trained with ``data.naflex`` is evaluated that
way at ``--sizes`` too, each size standing for the token count of its square, ``(size / patch)^2``.
Its rows, table columns and plot axis are then token budgets, with the mean grid the images got.

Outputs (``--out``, default: the deepest folder holding every checkpoint):
``extrapolation.csv`` (one row per checkpoint and size), ``extrapolation.md`` (a table, one row
per encoding, one column per size or token budget) and ``extrapolation.png`` (metric against size or
budget, one line per encoding at the points evaluated, the training size marked, chance level as a
horizontal line where the task defines one, e.g. 100 / classes for top-1).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence


from vispe.extras import require

from .checkpoint import load_checkpoint
from .config import ConfigError, apply_overrides, build_config, load_yaml, merge_trees, parse_overrides
from .data import ShardSampler, make_loader
from .distributed import DistEnv, all_reduce_sum, init_distributed, shutdown_distributed
from .engine import autocast_for, pe_label
from .logs import format_table, progress, setup_logging
from .tasks import get_task

# --max-tokens on a checkpoint trained at fixed sizes: its config switched to NaFlex evaluation (training-time
# mixing and the fixed-size crop play no part in it)
_NAFLEX_EVAL = (('data.naflex', True), ('data.aug.mixup', 0.0), ('data.aug.cutmix', 0.0), ('data.crop_pct', None))

__all__ = ['evaluate_checkpoints', 'write_reports', 'extrapolation_table', 'main']

_logger = logging.getLogger(__name__)


def _labels(ckpts: Sequence[Dict[str, Any]], paths: Sequence[Path]) -> List[str]:
    """Encoding names; the run folder is appended where two checkpoints share one."""
    base = [pe_label(c['model_spec']) for c in ckpts]
    return [b if base.count(b) == 1 else f'{b} ({p.parent.name})' for b, p in zip(base, paths)]


def evaluate_checkpoints(
        paths: Sequence[Path],
        sizes: Sequence[int] = (),
        data: Optional[Dict[str, Any]] = None,
        overrides: Sequence[str] = (),
        batch_size: Optional[int] = None,
        workers: Optional[int] = None,
        env: DistEnv = DistEnv(),
        progress_mode: str = 'auto',
        max_tokens: Sequence[int] = (),
) -> List[Dict[str, Any]]:
    """One row per (checkpoint, size or token budget): label, encoding, sizes, the task's metrics;
    NaFlex rows also ``max_tokens`` and ``train_max_tokens`` (the budgets evaluated and trained at).

    Args:
        paths: checkpoints written by ``python -m train``.
        sizes: input sizes (pixels; square inputs, or with NaFlex the token counts of those squares).
        data: a raw config tree whose ``data`` (and ``task``) replace the checkpoint's.
        overrides: ``key=value`` strings applied after ``data`` (``data.root=...``).
        batch_size: evaluation batch per process (default: the config's eval batch).
        workers: data loader workers (default: the config's).
        env: distributed environment (device, rank).
        progress_mode: tqdm bars ('auto', 'on', 'off').
        max_tokens: token budgets (patches per image) to evaluate at native aspect ratios, instead of
            ``sizes``.
    """
    if not paths:
        raise ValueError('no checkpoints given')
    if bool(sizes) == bool(max_tokens):
        raise ValueError(f'give either --sizes (input sizes) or --max-tokens (token budgets at native aspect '
                         f'ratios), got sizes {list(sizes)} and max_tokens {list(max_tokens)}')
    points, flag = (sizes, '--sizes') if sizes else (max_tokens, '--max-tokens')
    if any(s <= 0 for s in points):
        raise ValueError(f'{flag}: give positive {"input sizes" if sizes else "token budgets"}, got {list(points)}')
    ckpts = [load_checkpoint(p) for p in paths]
    labels = _labels(ckpts, [Path(p) for p in paths])
    cfgs = [_eval_config(ckpt, data, overrides, bool(max_tokens)) for ckpt in ckpts]
    naflex = {bool(getattr(cfg.data, 'naflex', False)) for cfg in cfgs}
    if len(naflex) > 1:  # one table and one plot axis: pixels or tokens
        raise ValueError('the checkpoints mix NaFlex (data.naflex: true) and fixed-size training; evaluate them all '
                         'at native aspect ratios with --max-tokens, or at square sizes with data.naflex=false')
    rows: List[Dict[str, Any]] = []
    for path, ckpt, label, cfg in zip(paths, ckpts, labels, cfgs):
        task = get_task(cfg.task)(cfg, rank=env.rank)
        model = task.rebuild_model(ckpt['model_spec'])
        model.load_state_dict(ckpt['model'])
        model.to(env.device)
        autocast, _ = autocast_for(cfg.train.amp, env.device)
        bs = batch_size or getattr(cfg.data, 'eval_batch_size', None) or 2 * cfg.train.batch_size
        nw = workers if workers is not None else getattr(cfg.data, 'workers', 0)
        train_size = getattr(cfg.data, 'img_size', None)
        for point in points:
            size = point if sizes else None
            try:
                dataset = task.eval_dataset(size, max_tokens=point) if max_tokens else task.eval_dataset(size)
            except NotImplementedError:
                raise ValueError(f'task {cfg.task!r} has no input-size sweep') from None
            if max_tokens:
                budget = point
            else:  # a NaFlex checkpoint: the size stands for its square's token count
                budget = task.naflex_budget(size) if naflex == {True} else None
            loader = make_loader(dataset, ShardSampler(dataset, env.rank, env.world_size), bs, nw, env.device,
                                 drop_last=False, collate_fn=task.collate_fn)
            where = f'{budget} tokens' if budget is not None else str(size)
            bar = progress(progress_mode, env.is_main, total=len(loader), desc=f'{label} @ {where}')
            try:
                metrics = task.evaluate(model, _tick(loader, bar), env.device, autocast,
                                        lambda sums: all_reduce_sum(sums, env.device))
            finally:
                bar.close()
            naflex_keys = {} if budget is None else dict(max_tokens=budget, train_max_tokens=task.naflex_budget())
            rows.append(dict(label=label, pe=pe_label(ckpt['model_spec']), checkpoint=str(path),
                             train_size=train_size, size=size, **naflex_keys, metric=task.metric,
                             chance=task.chance_level(ckpt['model_spec']), **metrics))
            _logger.info('%s @ %s: %s', label, where, ', '.join(f'{k} {v:.4g}' for k, v in metrics.items()))
        del model
    return rows


def _eval_config(ckpt: Dict[str, Any], data: Optional[Dict[str, Any]], overrides: Sequence[str], naflex: bool):
    """The checkpoint's config with ``--data`` and the overrides applied (and NaFlex evaluation if asked)."""
    raw = dict(ckpt['config'])
    if data:
        if 'task' in data and data['task'] != raw.get('task'):
            raise ConfigError(f"--data: task {data['task']!r} differs from the checkpoint's {raw.get('task')!r}")
        raw['data'] = merge_trees(raw.get('data') or {}, data.get('data') or {})
    if naflex:
        task = raw.get('task', 'classification')
        if 'naflex' not in {f.name for f in dataclasses.fields(get_task(task).DataConfig)}:
            raise ValueError(f'--max-tokens: task {task!r} has no native-aspect (NaFlex) evaluation')
        raw = apply_overrides(raw, _NAFLEX_EVAL)
    raw = apply_overrides(raw, parse_overrides(overrides))
    raw['sweep'] = {}
    raw.get('train', {}).pop('resume', None)
    return build_config(raw)


def _tick(loader, bar):
    for batch in loader:
        yield batch
        bar.update(1)


def extrapolation_table(rows: Sequence[Dict[str, Any]]) -> str:
    """Markdown: one row per encoding, one column per size (the training size marked with *); NaFlex
    rows: one column per token budget, with the mean grid and aspect ratio of the images under it."""
    if rows[0].get('max_tokens') is not None:
        return _naflex_table(rows)
    labels = list(dict.fromkeys(r['label'] for r in rows))
    sizes = sorted({r['size'] for r in rows})
    train_sizes = {r['train_size'] for r in rows}
    metric = rows[0]['metric']
    header = [f'encoding ({metric})'] + [f'{s}*' if s in train_sizes else str(s) for s in sizes]
    value = {(r['label'], r['size']): r[r['metric']] for r in rows}
    body = [[lab] + [value.get((lab, s), '-') for s in sizes] for lab in labels]
    note = f'\n\n`*` training resolution ({", ".join(str(s) for s in sorted(x for x in train_sizes if x))} px).'
    return format_table(header, body) + note


def _naflex_table(rows: Sequence[Dict[str, Any]]) -> str:
    labels = list(dict.fromkeys(r['label'] for r in rows))
    budgets = sorted({r['max_tokens'] for r in rows})
    trained = {r['train_max_tokens'] for r in rows}
    metric = rows[0]['metric']
    header = [f'encoding ({metric}) / tokens'] + [f'{b}*' if b in trained else str(b) for b in budgets]
    value = {(r['label'], r['max_tokens']): r[metric] for r in rows}
    body = [[lab] + [value.get((lab, b), '-') for b in budgets] for lab in labels]
    first = {b: next(r for r in rows if r['max_tokens'] == b) for b in budgets}  # the same images for every model
    if all('grid_h' in r for r in first.values()):
        body.append(['mean tokens'] + [f'{first[b]["tokens"]:.1f}' for b in budgets])
        body.append(['mean grid (h x w)'] + [f'{first[b]["grid_h"]:.1f} x {first[b]["grid_w"]:.1f}' for b in budgets])
        body.append(['mean aspect (w / h)'] + [f'{first[b]["aspect"]:.2f}' for b in budgets])
    note = (f'\n\nColumns: token budgets; each image keeps its aspect ratio, resized to at most that many patches. '
            f'`*` training budget ({", ".join(str(t) for t in sorted(trained))} tokens).')
    return format_table(header, body) + note


def write_reports(rows: Sequence[Dict[str, Any]], out_dir: Path) -> Dict[str, Path]:
    """``extrapolation.csv``, ``extrapolation.md`` and ``extrapolation.png`` in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = dict(csv=out_dir / 'extrapolation.csv', md=out_dir / 'extrapolation.md', png=out_dir / 'extrapolation.png')
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(paths['csv'], 'w', newline='') as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows(rows)
    paths['md'].write_text(extrapolation_table(rows) + '\n')
    _plot(rows, paths['png'])
    return paths


def _plot(rows: Sequence[Dict[str, Any]], path: Path) -> None:
    matplotlib = require('matplotlib', 'the extrapolation plot')
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    metric = rows[0]['metric']
    tokens = rows[0].get('max_tokens') is not None
    x_key, trained_key = ('max_tokens', 'train_max_tokens') if tokens else ('size', 'train_size')
    fig, ax = plt.subplots(figsize=(7.6, 4.2))
    if tokens:  # budgets grow as squares of sizes: even steps of size are even steps of log tokens
        ax.set_xscale('log')
        ax.minorticks_off()
    for label in dict.fromkeys(r['label'] for r in rows):
        pts = sorted((r[x_key], r[metric]) for r in rows if r['label'] == label)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o', label=label)
    for chance in sorted({r['chance'] for r in rows if r.get('chance') is not None}):
        ax.axhline(chance, color='black', linestyle='--', linewidth=1, label=f'chance ({chance:.3g})')
    for s in sorted({r[trained_key] for r in rows if r[trained_key]}):
        ax.axvline(s, color='grey', linestyle=':', linewidth=1)
    ticks = sorted({r[x_key] for r in rows})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_xlabel('token budget per image, native aspect ratio; dotted: training budget' if tokens
                  else 'input size (px); dotted: training size')
    ax.set_ylabel(metric)
    ax.set_title('resolution extrapolation' + (' (native aspect ratios)' if tokens else ''))
    ax.grid(alpha=0.3)
    # outside the axes, on the right: inside, any corner can sit on a line
    ax.legend(fontsize='small', loc='upper left', bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    fig.savefig(path, dpi=120, bbox_inches='tight')
    plt.close(fig)


def _default_out(paths: Sequence[Path]) -> Path:
    """The deepest folder holding every checkpoint's run folder (the run folder for one checkpoint)."""
    return Path(os.path.commonpath([str(Path(p).resolve().parent) for p in paths]))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog='python -m train.extrapolate',
        description='Evaluate checkpoints at several input sizes; write a CSV, a Markdown table and a plot.')
    parser.add_argument('checkpoints', nargs='+', help='best.pt / checkpoint.pt files of python -m train, '
                                                       'then optional key=value overrides (data.root=...)')
    points = parser.add_mutually_exclusive_group(required=True)
    points.add_argument('--sizes', nargs='+', type=int, help='input sizes in pixels (NaFlex checkpoints: the token '
                                                             'budgets of these squares)')
    points.add_argument('--max-tokens', nargs='+', type=int, help='token budgets: evaluate at native aspect ratios, '
                                                                  'each image resized to at most that many patches')
    parser.add_argument('--data', help="YAML with a data: section replacing the checkpoints' (e.g. "
                                       'configs/data/imagenet_val.yaml)')
    parser.add_argument('--out', help='output folder (default: next to the run folders)')
    parser.add_argument('--batch-size', type=int, help='evaluation batch per process')
    parser.add_argument('--workers', type=int, help='data loader workers')
    parser.add_argument('--device', default='auto', help="'auto', 'cpu', 'cuda', 'cuda:N'")
    parser.add_argument('--progress', default='auto', choices=['auto', 'on', 'off'])
    args = parser.parse_intermixed_args(argv)
    overrides = [a for a in args.checkpoints if '=' in a and not Path(a).exists()]
    paths = [Path(a) for a in args.checkpoints if a not in overrides]
    try:
        env = init_distributed(args.device, key='--device')
    except ConfigError as e:
        sys.stderr.write(f'error: {e}\n')
        return 2
    setup_logging(env.rank)
    try:
        data = load_yaml(args.data) if args.data else None
        rows = evaluate_checkpoints(paths, args.sizes or (), data, overrides, args.batch_size, args.workers, env,
                                    args.progress, max_tokens=args.max_tokens or ())
        if env.is_main:
            out = write_reports(rows, Path(args.out) if args.out else _default_out(paths))
            sys.stdout.write(extrapolation_table(rows) + '\n\n')
            sys.stdout.write(f'wrote {out["csv"]}, {out["md"]}, {out["png"]}\n')
    except (ConfigError, ValueError, FileNotFoundError) as e:
        _logger.error('%s', e)
        return 2
    finally:
        shutdown_distributed()
    return 0


if __name__ == '__main__':
    sys.exit(main())
