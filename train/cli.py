"""``python -m train CONFIG [key=value ...]``: train every run of a config, then the resolution sweep.

A config without ``sweep:`` is one run in ``output_dir/name``; with ``sweep:`` (dotted keys to lists
of values) each combination is a run in ``output_dir/name/<values>``, trained one after the other.
When ``extrapolate.sizes`` (or ``extrapolate.max_tokens``, native aspect ratios) is set, the best
checkpoint of every run is evaluated at those sizes (budgets) afterwards and the table is printed
(and written with a CSV and a plot to ``output_dir/name``).
A run folder that already holds a run is refused before anything trains unless ``train.resume``
is set. The same command runs under ``torchrun`` (DDP). A config with a ``benchmark:`` section
(``configs/benchmark/``) is a benchmark of many runs instead, handed to `train.benchmark`.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import yaml

from .benchmark import is_benchmark_config, main as benchmark_main
from .config import ConfigError, expand_sweep, load_config, to_dict
from .distributed import barrier, init_distributed, leave_process, shutdown_distributed
from .engine import RunResult, Trainer, check_run_dir
from .extrapolate import evaluate_checkpoints, extrapolation_table, write_reports
from .logs import format_table, setup_logging

__all__ = ['main', 'run', 'summary_table']

_logger = logging.getLogger('train')


def summary_table(results: Sequence[RunResult]) -> str:
    """Markdown summary of finished runs."""
    header = ['run', 'encoding', 'params (M)', 'epochs', 'steps', 'best', 'last eval', 'time (s)', 'skipped']
    rows = []
    for r in results:
        best = f'{r.best["metric"]} {r.best["value"]:.2f} (epoch {r.best["epoch"]})' \
            if r.best.get('value') is not None else '-'
        last = ', '.join(f'{k} {v:.3g}' for k, v in r.last_metrics.items() if k not in ('epoch', 'step')) or '-'
        rows.append([r.name, r.label, f'{r.params / 1e6:.2f}', r.epochs, r.steps, best, last,
                     f'{r.seconds:.0f}', r.skipped])
    return format_table(header, rows)


def run(config: Optional[str], overrides: Sequence[str] = ()) -> List[RunResult]:
    """Train the runs of ``config`` (a YAML path) with ``overrides``; returns their summaries."""
    cfg, raw = load_config(config, overrides)
    env = init_distributed(cfg.train.device)
    setup_logging(env.rank, cfg.log.level)
    name = cfg.name or 'run'
    root = Path(cfg.output_dir) / name
    results: List[RunResult] = []
    try:
        runs = expand_sweep(raw)
        run_dirs = [root / suffix if suffix else root for suffix, _ in runs]
        for (_, run_cfg), run_dir in zip(runs, run_dirs):  # every run of a sweep, before the first one trains
            check_run_dir(run_dir, run_cfg.train.resume, env)
        for i, ((suffix, run_cfg), run_dir) in enumerate(zip(runs, run_dirs)):
            run_cfg.name = f'{name}/{suffix}' if suffix else name
            if env.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / 'config.yaml').write_text(yaml.safe_dump(to_dict(run_cfg), sort_keys=False))
            if len(runs) > 1:
                _logger.info('sweep run %d/%d: %s', i + 1, len(runs), run_cfg.name)
            results.append(Trainer(run_cfg, env, run_dir).fit())
        if env.is_main:
            table = summary_table(results)
            (root / 'summary.md').write_text(table + '\n')
            sys.stdout.write(f'\nsummary ({root}):\n{table}\n')
        barrier()  # best.pt files are written by rank 0
        best = [r.best_path for r in results if r.best_path is not None]
        if (cfg.extrapolate.sizes or cfg.extrapolate.max_tokens) and best:
            rows = evaluate_checkpoints(best, cfg.extrapolate.sizes, batch_size=cfg.extrapolate.batch_size,
                                        env=env, progress_mode=cfg.log.progress,
                                        max_tokens=cfg.extrapolate.max_tokens)
            if env.is_main:
                out = write_reports(rows, root)
                sys.stdout.write(f'\nresolution extrapolation ({out["md"]}, plot {out["png"]}):\n'
                                 f'{extrapolation_table(rows)}\n')
    finally:
        shutdown_distributed()
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog='python -m train',
        description='Train / fine-tune a model from a YAML config (see configs/). Any key can be overridden '
                    'with section.key=value, e.g. train.epochs=10 model.pe=rope_mixed data.root=/data/imagenet.')
    parser.add_argument('config', help='YAML config file')
    parser.add_argument('overrides', nargs='*', help='section.key=value overrides')
    parser.add_argument('--print-config', action='store_true', help='print the validated config and exit')
    args = parser.parse_args(argv)
    if is_benchmark_config(args.config):
        return benchmark_main([args.config, *args.overrides, *(['--print-config'] if args.print_config else [])])
    try:
        if args.print_config:
            cfg, _ = load_config(args.config, args.overrides)
            sys.stdout.write(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            return 0
        run(args.config, args.overrides)
    except ConfigError as e:
        sys.stderr.write(f'config error: {e}\n')
        return leave_process(2)
    return leave_process(0)  # under torchrun: without interpreter shutdown (see leave_process)
