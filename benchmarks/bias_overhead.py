"""Overhead of the bias, conditional and input-coordinate encodings against ``pe='none'``.

ViT-S/16 at 224, batch 8, CPU by default: eval-mode forward and a training step (forward,
cross-entropy, backward), every encoding interleaved with the baseline in the same process, and
the ratio to the baseline printed next to the issue's target. Then peak memory of one iRPE
attention layer (contextual on K and on QK) for growing grids, to show that the extra memory grows
like the ``(B, H, N, N)`` logits and not like an ``(N, N, hd)`` tensor.

    python benchmarks/bias_overhead.py                     # everything (several minutes on 2 cores)
    python benchmarks/bias_overhead.py --only irpe,pape --rounds 3 --no-train
    python benchmarks/bias_overhead.py --threads 1 --timer cpu   # on a machine shared with other jobs

``--timer wall`` (default) is `_timing.compare`'s interleaved wall-clock medians; ``--timer cpu`` its
process CPU time, which other jobs on a shared machine disturb far less (use it with ``--threads 1``:
with several threads, descheduled partners inflate every parallel region).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Tuple

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
from _timing import compare, eval_step, peak_memory, train_step  # noqa: E402

import vispe  # noqa: E402  (also registers the models in timm)
from vispe import PEAttention  # noqa: E402
from vispe.registry import create_pe  # noqa: E402

# (label, spec, target ratio from the issue)
CASES: List[Tuple[str, str, float]] = [
    ('irpe product contextual K', 'irpe', 1.08),
    ('irpe product contextual QKV', 'irpe:on=qkv', 1.40),
    ('peg (after block 0)', 'peg', 1.02),
    ('fourier_learnable', 'fourier_learnable', 1.02),
    ('pape', 'pape', 1.50),
    ('pape_ri', 'pape_ri', 1.10),
    ('alibi2d', 'alibi2d', 1.10),
    ('swin_rpb', 'swin_rpb', 1.10),
    ('lookhere (dense bias)', 'lookhere', 1.10),
]


def _models(args: argparse.Namespace, specs: List[str]) -> Dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    out = {}
    for spec in ['none'] + specs:
        out[spec] = timm.create_model(args.model, pe=spec, img_size=args.img, num_classes=1000)
    return out


def speed(args: argparse.Namespace, cases: List[Tuple[str, str, float]]) -> None:
    x = torch.randn(args.batch, 3, args.img, args.img)
    y = torch.randint(0, 1000, (args.batch,))
    models = _models(args, [spec for _, spec, _ in cases])
    modes = [('eval forward', True)] + ([('train step', False)] if args.train else [])
    for title, is_eval in modes:
        fns = {}
        for spec, m in models.items():
            fns[spec] = eval_step(m, x) if is_eval else train_step(m, x, y)
        times = compare(fns, rounds=args.rounds, per_round=1, warmup=1,
                        clock='process' if args.timer == 'cpu' else 'wall')
        base = times['none']
        print(f'\n{title}: {args.model}, {args.img}px, batch {args.batch}, {torch.get_num_threads()} threads, '
              f"{args.timer} time; pe='none' {base * 1e3:.0f} ms", flush=True)
        print(f'{"encoding":34s} {"spec":18s} {"ratio":>6s} {"target":>7s}')
        for label, spec, target in cases:
            ratio = times[spec] / base
            print(f'{label:34s} {spec:18s} {ratio:6.3f} {target:7.2f}{"" if ratio <= target else "  (over)"}',
                  flush=True)


def memory(args: argparse.Namespace) -> None:
    dim, heads, batch = 384, 6, 1
    hd = dim // heads
    print(f'\nPeak memory of one attention layer, forward + backward (dim {dim}, {heads} heads, batch {batch}):')
    print(f'{"grid":>6s} {"N":>5s} {"spec":14s} {"extra MiB":>10s} {"extra / logits":>15s} {"(N,N,hd) MiB":>13s}')
    for g in args.grids:
        n = g * g + 1
        logits = batch * heads * n * n * 4
        results = {}
        for spec in ('none', 'irpe', 'irpe:on=qk'):
            torch.manual_seed(0)
            attn = PEAttention(dim, heads, qkv_bias=True)
            pe = create_pe(spec, dim=dim, num_heads=heads, depth=1, grid_size=(g, g), num_prefix_tokens=1)
            pos = vispe.grid(g, g, num_prefix=1)
            x = torch.randn(batch, n, dim, requires_grad=True)

            def run():
                state = pe.prepare(pos)
                attn(x, pe=state).sum().backward()
            results[spec] = peak_memory(run)
        for spec in ('irpe', 'irpe:on=qk'):
            extra = results[spec] - results['none']
            print(f'{g:>6d} {n:>5d} {spec:14s} {extra / 2**20:10.1f} {extra / logits:15.2f} '
                  f'{batch * heads * n * n * hd * 4 / 2**20:13.1f}', flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='vit_small')
    parser.add_argument('--img', type=int, default=224)
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0: leave as is)')
    parser.add_argument('--timer', choices=('wall', 'cpu'), default='wall')
    parser.add_argument('--only', default='', help='comma-separated substrings of the specs to run')
    parser.add_argument('--no-train', dest='train', action='store_false')
    parser.add_argument('--no-memory', dest='memory', action='store_false')
    parser.add_argument('--no-speed', dest='speed', action='store_false')
    parser.add_argument('--grids', type=int, nargs='+', default=[14, 20, 28])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = CASES
    if args.only:
        keys = [k.strip() for k in args.only.split(',') if k.strip()]
        cases = [c for c in CASES if any(k in c[1] for k in keys)]
    if args.speed:
        speed(args, cases)
    if args.memory:
        memory(args)


if __name__ == '__main__':
    main()
