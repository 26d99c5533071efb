"""DETR-R50 encoder forward time per encoding, as ratios against ``pe='none'`` (and iRPE vs sine).

The encoder is DETR's (6 post-norm layers, width 256, 8 heads) over the stride-32 feature grid of
an ``H x W`` input (800 x 1216 -> 25 x 38 = 950 tokens); the backbone is identical for every
encoding, so by default the encoder runs on random tokens of that grid and the backbone is left
out (``--full`` times the whole detector, backbone and decoder included). Eval mode, no grad,
interleaved rounds (`benchmarks._timing.compare`).

    python benchmarks/detr_encoder.py                 # 800 x 1216
    python benchmarks/detr_encoder.py --quick         # 320 x 480, fewer rounds
    python benchmarks/detr_encoder.py --pes none detr_sine irpe:on=k rope_axial --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vispe  # noqa: E402
from benchmarks._timing import compare  # noqa: E402
from vispe_models.detr import DETR  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--size', type=int, nargs=2, default=(800, 1216), metavar=('H', 'W'))
    parser.add_argument('--quick', action='store_true', help='320 x 480 input and fewer rounds')
    parser.add_argument('--pes', nargs='+', default=['none', 'detr_sine', 'irpe:on=k', 'detr_sine+irpe:on=k'],
                        help='encoding specs, space-separated')
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--full', action='store_true', help='time the whole detector instead of the encoder')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = parser.parse_args()
    if args.quick:
        args.size, args.rounds = (320, 480), 5
    device = torch.device(args.device)
    pes = list(args.pes)
    if 'none' not in pes:
        pes.insert(0, 'none')
    h, w = args.size
    grid = (h // 32, w // 32)
    torch.manual_seed(0)
    src = torch.randn(args.batch, grid[0] * grid[1], 256, device=device)
    pos = vispe.grid(*grid, device=device).replace(
        key_padding_mask=torch.zeros(args.batch, grid[0] * grid[1], dtype=torch.bool, device=device))
    images = torch.randn(args.batch, 3, h, w, device=device)

    fns = {}
    for pe in pes:
        model = DETR(num_classes=91, backbone='resnet50', pe=pe, grid_size=grid).to(device).eval()

        def run(model=model):
            with torch.no_grad():
                return model(images) if args.full else model.encode(src, pos)
        fns[pe] = run
    what = 'DETR-R50 forward' if args.full else 'DETR-R50 encoder forward'
    print(f'{what}, input {h}x{w} (grid {grid[0]}x{grid[1]} = {grid[0] * grid[1]} tokens), batch {args.batch}, '
          f'{device}, torch {torch.__version__}')
    times = compare(fns, rounds=args.rounds, per_round=2, warmup=2, device=device)
    base = times['none']
    print(f'{"encoding":32s} {"ms":>10s} {"vs none":>9s}')
    for pe, t in times.items():
        print(f'{pe:32s} {t * 1e3:10.2f} {t / base:9.3f}')
    for irpe in (p for p in pes if 'irpe' in p):
        ref = 'detr_sine' if 'detr_sine' in times else None
        if ref is not None:
            print(f'ratio {irpe} / {ref}: {times[irpe] / times[ref]:.3f}')


if __name__ == '__main__':
    main()
