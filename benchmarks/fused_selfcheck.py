"""Cost of the fused kernels' self-check under ``'auto'`` (`vispe.rotary.trust`), and what each kind ran as.

For each fused kind, on q and k of one ViT attention layer (default ViT-S/16 at 224: batch 8, 6 heads, 197
tokens, head dim 64; bf16 on CUDA, float32 on the CPU), in this process:

* ``first``: the first call under ``'auto'`` (eval, then the first training step): the check (the fused
  kernels and the reference on the call's first sample, output and gradients, one synchronisation) plus the
  call itself; on a GPU also the kernels' compilation, which the call would pay anyway;
* ``call``: the same call once trusted (median of ``--rounds``);
* ``check``: the check alone, warm (median of ``--rounds``): its cost per first launch, compilation aside.

Then it prints `vispe.rotary.fused_report()`: what each kind ran as in this process.

Usage:
    python benchmarks/fused_selfcheck.py                          # on the GPU
    python benchmarks/fused_selfcheck.py --device cpu --batch 2   # Triton's interpreter on the CPU
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, List, Optional

if __name__ == '__main__' and '--device' in sys.argv and sys.argv[sys.argv.index('--device') + 1] == 'cpu':
    os.environ.setdefault('TRITON_INTERPRET', '1')  # read when triton is imported: before vispe

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vispe.rotary import autograd, fused, fused_report, rotate_qk, rotation_table  # noqa: E402

KINDS = ['table', 'half_table', 'pair', 'block', 'matrix']


def inputs(kind: str, batch: int, heads: int, tokens: int, hd: int, dtype: torch.dtype, device: torch.device,
           grad: bool):
    """q and k as views of one qkv projection (timm's layout) and a rotation of ``kind`` shared by the batch."""
    qkv = torch.randn(batch, tokens, 3 * heads * hd, device=device).to(dtype).requires_grad_(grad)
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    if kind in ('table', 'half_table'):
        rot = rotation_table(torch.randn(tokens, hd // 2, device=device))
    elif kind == 'pair':
        rot = torch.randn(heads, tokens, hd // 2, device=device)  # per head, as RoPE-Mixed's angles
    else:
        a = torch.randn(heads, tokens, hd // 8, 8, 8, device=device)  # LieRE's 8 x 8 blocks
        rot = torch.linalg.matrix_exp(a - a.mT) if kind == 'block' else torch.eye(8, device=device) + 0.1 * a
    return q, k, rot.requires_grad_(grad)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one ``fn()``, the device synchronised."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def step(kind: str, args: argparse.Namespace, dtype: torch.dtype, device: torch.device, grad: bool
         ) -> Callable[[], object]:
    q, k, rot = inputs(kind, args.batch, args.heads, args.tokens, args.head_dim, dtype, device, grad)

    def run():
        out = torch.stack(rotate_qk(q, k, rot, rot, kind))
        if grad:
            out.float().square().sum().backward()
        return out
    return run


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--device', default='cuda', help="'cpu': Triton's interpreter")
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--heads', type=int, default=6)
    ap.add_argument('--tokens', type=int, default=197)
    ap.add_argument('--head-dim', type=int, default=64)
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--kinds', default=','.join(KINDS))
    ap.add_argument('--out', default=None, help='also write the tables to this file')
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('fused_selfcheck.py needs a CUDA device (or --device cpu)')
    if not fused.AVAILABLE:
        raise SystemExit('fused_selfcheck.py needs triton')
    if device.type == 'cpu':  # 'auto' keeps CPU tensors on the reference; here they stand in for a GPU's
        autograd._AUTO_DEVICES = ('cuda', 'cpu')
    dtype = torch.bfloat16 if device.type == 'cuda' else torch.float32
    autograd.FUSED = 'auto'
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else "cpu, Triton's interpreter"
    lines = [f'{name}; q and k ({args.batch}, {args.heads}, {args.tokens}, {args.head_dim}) {dtype}, '
             f'median of {args.rounds} rounds',
             '', '| kind | phase | first call ms | call ms | check ms | check / call |', '|---|---|---|---|---|---|']
    print('\n'.join(lines), flush=True)
    for kind in args.kinds.split(','):
        for phase, grad in (('eval', False), ('train', True)):
            run = step(kind, args, dtype, device, grad)
            with torch.set_grad_enabled(grad):
                first = timed(run, device)
                call = statistics.median(timed(run, device) for _ in range(args.rounds))
                q, k, rot = inputs(kind, args.batch, args.heads, args.tokens, args.head_dim, dtype, device, grad)
                check = statistics.median(timed(lambda: autograd._self_check(kind, (q, k), rot, (grad, grad)), device)
                                          for _ in range(args.rounds))
            lines.append(f'| {kind} | {phase} | {1e3 * first:.1f} | {1e3 * call:.1f} | {1e3 * check:.1f} | '
                         f'{check / call:.2f} |')
            print(lines[-1], flush=True)
    lines += ['', '| kind | dtype | device | status | detail |', '|---|---|---|---|---|']
    lines += [f'| {c.kind} | {c.dtype or "-"} | {c.device or "-"} | {c.status} | {c.detail} |' for c in fused_report()]
    print('\n'.join(lines[-2 - len(fused_report()):]), flush=True)
    if args.out:
        with open(args.out, 'w') as f:
            f.write('\n'.join(lines) + '\n')


if __name__ == '__main__':
    main()
