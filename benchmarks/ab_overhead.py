"""A/B the overhead of encodings between two versions of vispe, in alternating processes.

On a shared CPU the time ratios of one `rotation_overhead.py` run scatter by several percent
(the fixed-table ``rope_axial`` reference has read 1.04x-1.06x), more than most changes move them.
This script measures the same ratios (eval forward and train step against ``pe='none'`` in the
same process, single-threaded, process clock) for a git revision and for this checkout in
alternating child processes, so both versions see the same machine conditions, and prints every
run and the per-version medians.

Usage:
    python benchmarks/ab_overhead.py --ref HEAD~3 --encodings liere             # ViT-B/16, 224, batch 8
    python benchmarks/ab_overhead.py --ref main --encodings liere,comrope_ap --pairs 3 --no-eval
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _timing; vispe comes from the measured root


def measure(root: str, encodings: List[str], model: str, batch: int, img: int, rounds: int, train: bool,
            evaluate: bool) -> Dict[str, Dict[str, float]]:
    """Ratios ``{'eval' | 'train': {encoding: ratio}}`` of the vispe found at ``root``, in this process."""
    sys.path.insert(0, root)
    import timm
    import torch
    import vispe
    from _timing import compare, eval_step, train_step  # this checkout's timing helpers, for both sides
    if not os.path.abspath(vispe.__file__).startswith(os.path.abspath(root)):
        raise RuntimeError(f'imported vispe from {vispe.__file__}, not from {root}')
    torch.set_num_threads(1)
    x = torch.randn(batch, 3, img, img)
    y = torch.randint(0, 1000, (batch,))
    models = {}
    for name in ['none'] + encodings:
        torch.manual_seed(0)
        models[name] = timm.create_model(model, pe=name, img_size=img)
    result = {}
    for mode, wanted in (('eval', evaluate), ('train', train)):
        if wanted:
            steps = {name: eval_step(m, x) if mode == 'eval' else train_step(m, x, y) for name, m in models.items()}
            times = compare(steps, rounds=rounds, per_round=1, warmup=1, clock='process')
            result[mode] = {name: times[name] / times['none'] for name in encodings}
    return result


def run_child(root: str, args: argparse.Namespace) -> Dict[str, Dict[str, float]]:
    cmd = [sys.executable, os.path.abspath(__file__), '--child', root, '--encodings', args.encodings,
           '--model', args.model, '--batch', str(args.batch), '--img', str(args.img), '--rounds', str(args.rounds)]
    cmd += ['--no-eval'] if args.no_eval else []
    cmd += ['--no-train'] if args.no_train else []
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tempfile.gettempdir()).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--ref', default='HEAD', help='git revision to compare this checkout against')
    ap.add_argument('--encodings', default='liere', help='comma-separated encoding specs')
    ap.add_argument('--model', default='vit_base')
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--img', type=int, default=224)
    ap.add_argument('--rounds', type=int, default=4, help='timed rounds per process')
    ap.add_argument('--pairs', type=int, default=2, help='(ref, this checkout) process pairs')
    ap.add_argument('--no-eval', action='store_true')
    ap.add_argument('--no-train', action='store_true')
    ap.add_argument('--child', default=None, help=argparse.SUPPRESS)  # internal: measure the vispe at this root
    args = ap.parse_args(argv)
    encodings = [s for s in args.encodings.split(',') if s]
    if args.no_eval and args.no_train:
        ap.error('--no-eval and --no-train leave nothing to measure')
    if args.child:
        print(json.dumps(measure(args.child, encodings, args.model, args.batch, args.img, args.rounds,
                                 not args.no_train, not args.no_eval)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        ref_root = os.path.join(tmp, 'ref')
        subprocess.run(['git', '-C', ROOT, 'worktree', 'add', '--detach', '-q', ref_root, args.ref], check=True)
        try:
            runs: Dict[str, list] = {'ref': [], 'this': []}
            for _ in range(args.pairs):
                for label, root in (('ref', ref_root), ('this', ROOT)):
                    ratios = run_child(root, args)
                    runs[label].append(ratios)
                    cells = ', '.join(f'{mode} {spec} {r:.3f}x'
                                      for mode, row in ratios.items() for spec, r in row.items())
                    print(f'{label:4s} {cells}', flush=True)
        finally:
            subprocess.run(['git', '-C', ROOT, 'worktree', 'remove', '--force', ref_root], check=False)
    print(f'\nmedians over {args.pairs} processes each (ref = {args.ref}, this = the working tree):')
    for mode in runs['this'][0]:
        for spec in encodings:
            ref = statistics.median(r[mode][spec] for r in runs['ref'])
            this = statistics.median(r[mode][spec] for r in runs['this'])
            print(f'  {mode:5s} {spec:24s} ref {ref:.3f}x  this {this:.3f}x')


if __name__ == '__main__':
    main()
