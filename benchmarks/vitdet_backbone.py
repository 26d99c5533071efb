"""ViTDet backbone forward time per encoding, as ratios against ``pe='none'`` (same process).

ViTDet-B's backbone (`vispe_models.vitdet.ViTDetBackbone`: ViT-B/16, 14x14-token windows, global
blocks 2, 5, 8, 11, the simple feature pyramid) on an ``H x W`` input (1024 x 1024 -> a 64 x 64 grid),
and, as the price of windows, the same backbone with every block global. Eval mode, no grad,
interleaved rounds (`benchmarks._timing.compare`); on a shared CPU ``--clock process`` with one thread.

    python benchmarks/vitdet_backbone.py                 # ViT-B, 1024 x 1024
    python benchmarks/vitdet_backbone.py --quick         # ViT-Ti width, 4 blocks, 256 x 384, fewer rounds
    python benchmarks/vitdet_backbone.py --pes none learned rope_mixed irpe liere --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compare  # noqa: E402
from vispe_models.vitdet import ViTDetBackbone  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--size', type=int, nargs=2, default=(1024, 1024), metavar=('H', 'W'))
    parser.add_argument('--quick', action='store_true', help='a ViT-Ti-width, 4-block backbone at 256 x 384')
    parser.add_argument('--pes', nargs='+', default=['none', 'learned', 'rope_mixed', 'irpe', 'liere'])
    parser.add_argument('--batch', type=int, default=1)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--clock', choices=['wall', 'process'], default='wall')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = parser.parse_args(argv)
    model, kwargs = 'vit_base_patch16_224', dict(img_size=1024)
    if args.quick:
        args.size, args.rounds = (256, 384), 3
        model, kwargs = 'vit_tiny_patch16_224', dict(img_size=256, depth=4)
    if args.clock == 'process':
        torch.set_num_threads(1)
    device = torch.device(args.device)
    pes = ['none'] + [p for p in args.pes if p != 'none']
    images = torch.randn(args.batch, 3, *args.size, device=device)
    fns = {}
    for label, window in (('', 14), (' (all global)', None)):
        for pe in pes if window else ['none', pes[-1]]:
            torch.manual_seed(0)
            bb = ViTDetBackbone(model, pe, window_size=window, **kwargs).to(device).eval()

            def run(bb=bb):
                with torch.no_grad():
                    return bb(images)
            fns[pe + label] = run
    h, w = args.size
    print(f'ViTDet backbone ({model}, windows 14, {len(bb.trunk.blocks)} blocks), input {h}x{w} '
          f'(grid {h // 16}x{w // 16}), batch {args.batch}, {device}, {args.clock} clock, torch {torch.__version__}')
    times = compare(fns, rounds=args.rounds, per_round=1, warmup=1, device=device, clock=args.clock)
    base = times['none']
    print(f'{"encoding":32s} {"ms":>10s} {"vs none":>9s}')
    for pe, t in times.items():
        print(f'{pe:32s} {t * 1e3:10.2f} {t / base:9.3f}')


if __name__ == '__main__':
    main()
