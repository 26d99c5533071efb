"""The docs' figures from benchmark and run outputs: never typed by hand.

Reads every results file in ``benchmarks/results/`` (JSON written by the benchmark scripts' ``--json``
option, or by ``--collect-run`` from a training run's outputs) and writes, per file, a markdown table
``docs/figures/<name>.md`` (with the run's date, hardware, library versions and command) and a plot
``docs/figures/<name>.png``. The docs pages include the markdown; ``tests/test_docs.py`` checks that
the shipped tables are exactly what this script makes of the shipped results.

    python benchmarks/pe_overhead.py --models vit_small --threads 1 --clock process --json benchmarks/results/pe_overhead_cpu.json
    python benchmarks/make_figures.py                       # every results file -> docs/figures/
    python benchmarks/make_figures.py --collect-run runs/quickstart --name quickstart_extrapolation \\
        --command "python -m train configs/quickstart.yaml"  # a run's extrapolation.csv -> results JSON
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / 'benchmarks' / 'results'
FIGURES = ROOT / 'docs' / 'figures'


def _provenance(record: Dict[str, Any]) -> str:
    env, v = record['environment'], record['environment']['versions']
    commit = f', commit {v["commit"]}' if v.get('commit') else ''
    return (f'*Measured {env["date"]} on {env["hardware"]}; python {v["python"]}, torch {v["torch"]}, '
            f'timm {v["timm"]}, vispe {v["vispe"]}{commit}. Command: `{record["command"]}`.*')


def _ratio(x: float) -> str:
    return '-' if x != x else f'{x:.2f}x'  # NaN: not measured


# ------------------------------------------------------------------ one writer per kind
def pe_overhead(record: Dict[str, Any]) -> tuple:
    p = record['params']
    lines = [f'Eval forward, train step and train-step peak memory of each encoding over `pe=\'none\'` in '
             f'the same process, {p["size"]} px, batch {p["batch"]}, {p["dtype"]}, medians of {p["rounds"]} '
             f'interleaved rounds ({p["clock"]} clock{", compiled" if p.get("compiled") else ""}).', '']
    series = {}
    for model, rows in record['results'].items():
        base = rows['none']
        lines += [f'**{model}** (`none`: {base["eval_ms"]:.0f} ms eval, {base["train_ms"]:.0f} ms train step)', '',
                  '| encoding | eval | train | peak memory |', '|---|---:|---:|---:|']
        lines += [f'| `{pe}` | {_ratio(r["eval"])} | {_ratio(r["train"])} | {_ratio(r["memory"])} |'
                  for pe, r in rows.items() if pe != 'none']
        lines.append('')
        series[model] = {pe: (r['eval'], r['train']) for pe, r in rows.items() if pe != 'none'}

    def plot(ax):
        model, rows = next(iter(series.items()))
        names = list(rows)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [rows[n][0] for n in names], 0.4, label='eval forward')
        ax.bar([x + 0.2 for x in xs], [rows[n][1] for n in names], 0.4, label='train step')
        ax.axhline(1.0, color='grey', lw=0.8, ls='--')
        ax.set_xticks(list(xs), names, rotation=45, ha='right')
        ax.set_ylabel(f"time / time of pe='none' ({model})")
        ax.legend()
    return lines, plot


def naflex_throughput(record: Dict[str, Any]) -> tuple:
    p = record['params']
    t = p['tokens']
    aspects = ', '.join(f'{h}:{w}' for h, w in p['aspects'])
    lines = [f'{p["model"]} eval forward on {p["batch"]} images at aspect ratios (h:w) {aspects}, budget '
             f'{p["budget"]} tokens, {p["dtype"]}, medians of {p["rounds"]} interleaved rounds ({p["clock"]} '
             f'clock): {t["real"]} real patch tokens; the NaFlex batch holds {t["naflex"]} tokens, the same images '
             f'zero-padded to one tensor {t["padded"]}. Real tokens per second:', '',
             '| encoding | NaFlex ms | padded ms | NaFlex tokens/s | padded tokens/s | NaFlex / padded |',
             '|---|---:|---:|---:|---:|---:|']
    rows = record['results']
    lines += [f'| `{pe}` | {r["naflex_ms"]:.1f} | {r["padded_ms"]:.1f} | {r["naflex_tps"]:,.0f} | '
              f'{r["padded_tps"]:,.0f} | {r["ratio"]:.2f}x |' for pe, r in rows.items()]
    lines.append('')

    def plot(ax):
        names = list(rows)
        ax.bar(names, [rows[n]['ratio'] for n in names])
        ax.axhline(1.0, color='grey', lw=0.8, ls='--')
        ax.set_ylabel('NaFlex / padded real tokens per second')
        ax.tick_params(axis='x', rotation=45)
    return lines, plot


def extrapolation(record: Dict[str, Any]) -> tuple:
    rows = record['results']
    sizes = sorted({int(r['size']) for r in rows})
    train = {int(r['train_size']) for r in rows}
    labels = list(dict.fromkeys(r['label'] for r in rows))
    metric = rows[0]['metric']
    value = {(r['label'], int(r['size'])): float(r[metric]) for r in rows}
    chance = rows[0].get('chance')
    lines = [f'{metric} on held-out data at each input size of models trained at '
             f'{", ".join(str(s) for s in sorted(train))} px (`*`){f"; chance {chance} %" if chance else ""}:', '',
             '| encoding | ' + ' | '.join(f'{s}{"*" if s in train else ""}' for s in sizes) + ' |',
             '|---|' + '---:|' * len(sizes)]
    lines += [f'| `{label}` | ' + ' | '.join(f'{value.get((label, s), float("nan")):.1f}' for s in sizes) + ' |'
              for label in labels]
    lines.append('')

    def plot(ax):
        for label in labels:
            ax.plot(sizes, [value.get((label, s), float('nan')) for s in sizes], marker='o', label=label)
        if chance:
            ax.axhline(float(chance), color='grey', lw=0.8, ls='--', label='chance')
        ax.set_xlabel('input size (px)')
        ax.set_ylabel(metric)
        ax.legend()
    return lines, plot


KINDS: Dict[str, Callable[[Dict[str, Any]], tuple]] = {
    'pe_overhead': pe_overhead, 'naflex_throughput': naflex_throughput, 'extrapolation': extrapolation}


def make(results: Path, out: Path, plots: bool = True) -> List[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in sorted(results.glob('*.json')):
        record = json.loads(path.read_text())
        if record.get('kind') not in KINDS:
            raise ValueError(f'{path}: unknown kind {record.get("kind")!r}; known: {sorted(KINDS)}')
        lines, plot = KINDS[record['kind']](record)
        if plots:
            import matplotlib
            matplotlib.use('Agg')
            import matplotlib.pyplot as plt
            fig, ax = plt.subplots(figsize=(7, 3.6))
            plot(ax)
            ax.set_title(f'{path.stem} ({record["environment"]["date"][:10]}, {record["environment"]["device"]})',
                         fontsize=9)
            fig.tight_layout()
            fig.savefig(out / f'{path.stem}.png', dpi=110)
            plt.close(fig)
        lines += [f'![{path.stem}](figures/{path.stem}.png)', '', _provenance(record)]
        (out / f'{path.stem}.md').write_text(
            f'<!-- made by benchmarks/make_figures.py from benchmarks/results/{path.name}; do not edit -->\n'
            + '\n'.join(lines) + '\n')
        written.append(out / f'{path.stem}.md')
    return written


def collect_run(run: Path, name: str, command: str) -> Path:
    """A training run's ``extrapolation.csv`` as a results file, stamped with this machine's environment
    (run it where the run ran) and the date the CSV was written."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _results import environment, write_results
    table = run / 'extrapolation.csv'
    with open(table, newline='') as f:
        rows = [{k: v for k, v in r.items() if k != 'checkpoint'} for r in csv.DictReader(f)]
    env = environment()
    configs = sorted(run.glob('*/config.yaml'))
    if configs:  # the run's own thread count, not this process's
        import yaml
        threads = (yaml.safe_load(configs[0].read_text()).get('train') or {}).get('threads')
        env['hardware'] = env['hardware'].rsplit(', ', 1)[0] + (f', {threads} torch thread(s)' if threads else '')
    env['date'] = datetime.datetime.fromtimestamp(table.stat().st_mtime, datetime.timezone.utc).strftime(
        '%Y-%m-%d %H:%M UTC')
    path = RESULTS / f'{name}.json'
    write_results(str(path), 'extrapolation', command, dict(run=os.path.basename(run)), rows, env=env)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--results', default=str(RESULTS), help='folder of results JSON files')
    ap.add_argument('--out', default=str(FIGURES), help='folder the tables and plots go to')
    ap.add_argument('--no-plots', action='store_true', help='tables only (the tables still link the plots)')
    ap.add_argument('--collect-run', default=None, metavar='RUN_DIR',
                    help="turn a training run's extrapolation.csv into a results file first")
    ap.add_argument('--name', default=None, help='results file name for --collect-run')
    ap.add_argument('--command', default='', help='the command that made the run, for --collect-run')
    args = ap.parse_args(argv)
    if args.collect_run:
        print('wrote', collect_run(Path(args.collect_run), args.name or Path(args.collect_run).name, args.command))
    for path in make(Path(args.results), Path(args.out), plots=not args.no_plots):
        print('wrote', path)


if __name__ == '__main__':
    main()
