"""Coordinate-MLP throughput per coordinate encoding, as ratios against raw coordinates (``'none'``).

Two workloads, each timed in interleaved rounds (`benchmarks._timing.compare`):

* ``image``: one training step (forward, MSE backward, Adam) of Tancik et al.'s 2D image-fitting
  network (4 layers of 256) on a full 256 x 256 image batch;
* ``nerf``: one forward of NeRF's coarse field (8 x 256, skip at 4, view directions) on a batch of
  3D points, no grad (the rendering hot loop).

Throughput is coordinates (pixels or points) per second; the ratio is the time against ``'none'``.

    python benchmarks/coordinate_mlp.py
    python benchmarks/coordinate_mlp.py --quick
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compare  # noqa: E402
from vispe_models.nerf import CoordinateMLP, NeRF, image_coordinates  # noqa: E402

DEFAULT_ENCODINGS = ['none', 'nerf_freq:levels=10', 'fourier_gaussian:scale=10', 'fourier_learnable:gamma=0.1']


def _report(title: str, count: int, times: dict) -> None:
    base = times['none']
    print(title)
    print(f'{"encoding":32s} {"ms":>9s} {"coords/s":>12s} {"vs none":>8s}')
    for name, t in times.items():
        print(f'{name:32s} {t * 1e3:9.2f} {count / t:12.4g} {t / base:8.3f}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--encodings', nargs='+', default=DEFAULT_ENCODINGS, help='vispe specs, space-separated')
    parser.add_argument('--image-size', type=int, default=256)
    parser.add_argument('--points', type=int, default=65536, help='3D points per NeRF field forward')
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--quick', action='store_true', help='64 x 64 image, 8192 points, fewer rounds')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    args = parser.parse_args()
    if args.quick:
        args.image_size, args.points, args.rounds = 64, 8192, 5
    device = torch.device(args.device)
    encodings = list(args.encodings)
    if 'none' not in encodings:
        encodings.insert(0, 'none')
    torch.manual_seed(0)
    print(f'coordinate MLPs on {device}, torch {torch.__version__}')

    coords = image_coordinates(args.image_size, args.image_size, device)
    target = torch.rand(args.image_size, args.image_size, 3, device=device)
    steps = {}
    for spec in encodings:
        model = CoordinateMLP(spec, depth=4, width=256).to(device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt):
            loss = F.mse_loss(model(coords), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        steps[spec] = step
    _report(f'\nimage fitting: train step on {args.image_size}x{args.image_size} pixels (4 x 256 MLP)',
            args.image_size ** 2, compare(steps, rounds=args.rounds, per_round=2, warmup=2, device=device))

    points = torch.rand(args.points, 3, device=device) * 3 - 1.5
    dirs = F.normalize(torch.randn(args.points, 3, device=device), dim=-1)
    forwards = {}
    for spec in encodings:
        nerf = NeRF(pos_encoding=spec, dir_encoding='nerf_freq:levels=4', num_fine=0).to(device).eval()

        def fwd(nerf=nerf):
            with torch.no_grad():
                return nerf.query(nerf.coarse, points[:, None], dirs)
        forwards[spec] = fwd
    _report(f'\nNeRF field: forward on {args.points} points (8 x 256, view directions nerf_freq:levels=4)',
            args.points, compare(forwards, rounds=args.rounds, per_round=2, warmup=2, device=device))


if __name__ == '__main__':
    main()
