"""Profile one eval forward or train step of a vispe ViT and print where the time goes.

For each encoding: the top operators by self time on the device (CUDA kernels, or CPU time on a
CPU), the number of operator calls, and the host-device synchronisations, next to the same
figures for ``pe='none'``, so an encoding's overhead can be traced to its operators.

Usage:
    python benchmarks/profile_step.py --pes liere,rope_mixed                       # CPU, train step
    python benchmarks/profile_step.py --device cuda --batch 64 --pes liere --mode eval
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import timm
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vispe  # noqa: E402,F401  (registers the ViTs in timm)
from _timing import eval_step, sync, train_step  # noqa: E402


def profile_one(spec: str, args: argparse.Namespace, device: torch.device) -> None:
    torch.manual_seed(0)
    with torch.device(device):
        model = timm.create_model(args.model, pe=spec, num_classes=1000)
    x = torch.randn(args.batch, 3, args.img, args.img, device=device)
    y = torch.randint(0, 1000, (args.batch,), device=device)
    step = train_step(model, x, y) if args.mode == 'train' else eval_step(model, x)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    def run():
        with autocast:
            step()
    for _ in range(3):
        run()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    with profile(activities=activities) as prof:
        run()
        sync(device)
    events = prof.key_averages()
    key = 'self_device_time_total' if device.type == 'cuda' else 'self_cpu_time_total'
    total = sum(getattr(e, key) for e in events) / 1e3
    calls = sum(e.count for e in events if e.key.startswith('aten::'))
    syncs = sum(e.count for e in events if 'Synchronize' in e.key or e.key == 'aten::_local_scalar_dense')
    print(f'\n== {spec}: {args.mode} step, {total:.1f} ms self {"device" if device.type == "cuda" else "CPU"} time, '
          f'{calls} aten calls, {syncs} host syncs', flush=True)
    print(events.table(sort_by=key, row_limit=args.rows, max_name_column_width=60), flush=True)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--pes', default='liere', help="comma-separated encodings ('none' is always profiled first)")
    ap.add_argument('--model', default='vit_base')
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--img', type=int, default=224)
    ap.add_argument('--mode', default='train', choices=['train', 'eval'])
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--bf16', action='store_true', help='bf16 autocast')
    ap.add_argument('--rows', type=int, default=15)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    for spec in ['none'] + [s for s in args.pes.split(',') if s != 'none']:
        profile_one(spec, args, device)


if __name__ == '__main__':
    main()
