"""Overhead of every registered encoding on a timm-sized ViT, as ratios against ``pe='none'``.

For each encoding: eval-mode forward time (under ``inference_mode``), train step time (forward +
backward) and peak memory of a train step, each divided by the same figure for ``pe='none'``
measured in the same process, interleaved round by round.

    python benchmarks/pe_overhead.py                       # ViT-S and ViT-B, batch 8, every encoding
    python benchmarks/pe_overhead.py --models vit_base --pes rope_axial rope_mixed --rounds 9
    python benchmarks/pe_overhead.py --device cuda --dtype bfloat16
    python benchmarks/pe_overhead.py --compile --models vit_small    # torch.compile(fullgraph=True) models,
                                                                     # ratios against compiled pe='none'

Targets (issue #2): learned, sincos, rope_axial <= 1.01x; rope_mixed <= 1.02x (eval and train).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
import vispe  # noqa: E402
from _results import write_results  # noqa: E402
from _timing import compare, compile_models, eval_step, peak_memory, train_step  # noqa: E402


def _model(name: str, pe: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    return timm.create_model(name, pe=pe, num_classes=1000).to(device=device, dtype=dtype)


def bench(name: str, pes: List[str], batch: int, size: int, rounds: int, device: torch.device,
          dtype: torch.dtype, memory: bool, clock: str = 'wall', compile: bool = False
          ) -> Dict[str, Dict[str, float]]:
    torch.manual_seed(0)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    y = torch.randint(0, 1000, (batch,), device=device)
    models = {pe: _model(name, pe, device, dtype) for pe in ['none'] + [p for p in pes if p != 'none']}
    # compiled, each model is compiled once per mode in compare's warm-up rounds; memory stays eager
    timed = compile_models(models, fullgraph=True) if compile else models

    t_eval = compare({pe: eval_step(m, x) for pe, m in timed.items()}, rounds=rounds, device=device, clock=clock)
    t_train = compare({pe: train_step(m, x, y) for pe, m in timed.items()}, rounds=rounds, device=device, clock=clock)
    mem = {pe: peak_memory(train_step(m, x, y), device) for pe, m in models.items()} if memory else {}
    out = {}
    for pe in models:
        out[pe] = dict(eval=t_eval[pe] / t_eval['none'], train=t_train[pe] / t_train['none'],
                       memory=(mem[pe] / mem['none']) if memory else float('nan'),
                       eval_ms=1e3 * t_eval[pe], train_ms=1e3 * t_train[pe])
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--models', nargs='+', default=['vit_small', 'vit_base'])
    ap.add_argument('--pes', nargs='+', default=None, help='encodings (default: every registered one)')
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--size', type=int, default=224)
    ap.add_argument('--rounds', type=int, default=7)
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    ap.add_argument('--no-memory', action='store_true', help='skip the peak-memory measurement')
    ap.add_argument('--threads', type=int, default=None, help='torch CPU threads (1 on a shared machine)')
    ap.add_argument('--clock', default='wall', choices=['wall', 'process'],
                    help="'process': CPU time of this process, for a machine shared with other jobs")
    ap.add_argument('--compile', action='store_true',
                    help='time torch.compile(fullgraph=True) models (ratios against compiled none)')
    ap.add_argument('--json', default=None, metavar='PATH',
                    help='also write the ratios with date, hardware and versions (benchmarks/make_figures.py)')
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    pes = args.pes or [p for p in vispe.list_pes() if not vispe.pe_info(p)['cls'].requires]
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f'device={device} dtype={args.dtype} batch={args.batch} size={args.size} '
          f'threads={torch.get_num_threads()} clock={args.clock} compiled={args.compile}')
    recorded = {}
    for name in args.models:
        res = recorded[name] = bench(name, pes, args.batch, args.size, args.rounds, device, dtype, not args.no_memory, args.clock,
                    args.compile)
        base = res['none']
        print(f'\n{name}: none eval {base["eval_ms"]:.1f} ms, train {base["train_ms"]:.1f} ms')
        print(f'{"encoding":<24}{"eval x":>9}{"train x":>9}{"memory x":>10}')
        for pe, r in res.items():
            print(f'{pe:<24}{r["eval"]:>9.3f}{r["train"]:>9.3f}{r["memory"]:>10.3f}')
    if args.json:
        params = dict(models=args.models, batch=args.batch, size=args.size, rounds=args.rounds, dtype=args.dtype,
                      clock=args.clock, compiled=args.compile, memory=not args.no_memory)
        write_results(args.json, 'pe_overhead', 'python benchmarks/pe_overhead.py ' + ' '.join(argv or sys.argv[1:]),
                      params, recorded, device)


if __name__ == '__main__':
    main()
