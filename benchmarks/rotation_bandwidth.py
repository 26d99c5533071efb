"""The q / k rotation alone on ViT-B shapes: fused Triton kernels against the reference path, against
``torch.compile`` of the reference, and against Liger-Kernel's RoPE, as GB/s and as a fraction of the
GPU's memory bandwidth.

A rotation is memory-bound: it reads q and k and writes them rotated (the rotation itself is small
beside them: a ``(N, P)`` table, or ``(H, N, nb, b, b)`` blocks). GB/s here counts those q / k bytes
only, ``4 x B x H x N x hd x`` bytes per element for a forward (read q, k; write q, k), twice that for
a forward and backward (the backward reads the two gradients and writes two), so it is what the
kernel achieves on the tensors a user cares about; the rotation's own bytes are listed beside. The
bandwidth is the device-to-device copy measured in this process (read + write), and, where the GPU is
known, its data-sheet figure.

Rows: each kernel kind as an encoding uses it (``table``: RoPE's eval table; ``pair``: angles with
their gradient, training; ``half_table``: rotate-half pairs; ``block``: LieRE's per-head 8 x 8
blocks; ``matrix``: GTA's 4 x 4 maps), q and k as views of timm's fused qkv projection (what vispe's
attention hands the kernels); and ``half_table`` again on contiguous tokens-first q and k
``(B, N, H, hd)`` seen as ``(B, H, N, hd)``, the layout in which Liger's kernel works in place
(transformers' Llama layout, rotate-half pairs, a ``(N, hd)`` cos / sin), so that all four paths
compute the same function on the same memory. Liger's outputs are checked against the fused ones.

Targets (issue: fused rotation at >= 70 % of memory bandwidth, faster than Liger's RoPE).

Usage:
    python benchmarks/rotation_bandwidth.py                   # ViT-B/16 at 224: B 64, 12 heads, 197 tokens, hd 64
    python benchmarks/rotation_bandwidth.py --device cpu --batch 2 --no-compile   # smoke test
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Callable, Dict, Iterator, List, Optional, Tuple

if __name__ == '__main__' and '--device' in sys.argv and sys.argv[sys.argv.index('--device') + 1] == 'cpu':
    os.environ.setdefault('TRITON_INTERPRET', '1')  # the fused path on CPU tensors: read when triton is imported

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vispe.rotary import autograd, rotate_qk, rotation_table  # noqa: E402
from vispe.rotary.kernels import pad_identity  # noqa: E402
from _timing import time_fn  # noqa: E402

# data-sheet HBM bandwidth (GB/s) of GPUs this project has measured on
DATASHEET_GBS = {'H200': 4800.0, 'H100 80GB HBM3': 3350.0, 'A100-SXM4-80GB': 2039.0}
KINDS = ['table', 'pair', 'half_table', 'block', 'matrix']
PATHS = ['fused', 'reference', 'compiled reference', 'liger']


@contextlib.contextmanager
def fused_mode(mode: str) -> Iterator[None]:
    before = autograd.FUSED
    autograd.FUSED = mode
    try:
        yield
    finally:
        autograd.FUSED = before


def rotation(kind: str, heads: int, grid: int, hd: int, device: torch.device) -> torch.Tensor:
    """The rotation an encoding hands the kernels for a class token and a ``grid x grid`` patch grid."""
    n = grid * grid
    if kind in ('table', 'half_table', 'pair'):
        angles = torch.randn(n, hd // 2, device=device) * 3
        rot = angles if kind == 'pair' else rotation_table(angles)
    elif kind == 'block':  # LieRE: per-head orthogonal 8 x 8 blocks
        a = torch.randn(heads, n, hd // 8, 8, 8, device=device)
        rot = torch.linalg.matrix_exp(a - a.mT)
    else:  # GTA: one 4 x 4 map per token, expanded over the channel blocks
        rot = (torch.eye(4, device=device) + 0.3 * torch.randn(n, 1, 4, 4, device=device)).expand(n, hd // 4, 4, 4)
    return pad_identity(rot, 1, kind)


def qk_views(batch: int, heads: int, tokens: int, hd: int, dtype: torch.dtype, device: torch.device,
             tokens_first: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """q and k ``(B, H, N, hd)``: views of one fused qkv projection ``(B, N, 3 H hd)`` (timm), or two
    contiguous tokens-first ``(B, N, H, hd)`` tensors transposed (transformers / Liger)."""
    if tokens_first:
        return tuple(torch.randn(batch, tokens, heads, hd, dtype=dtype, device=device).transpose(1, 2)
                     for _ in range(2))
    qkv = torch.randn(batch, tokens, 3 * heads * hd, dtype=dtype, device=device)
    q, k, _ = qkv.reshape(batch, tokens, 3, heads, hd).permute(2, 0, 3, 1, 4).unbind(0)
    return q, k


def liger_rope() -> Tuple[Optional[Callable], str]:
    """Liger-Kernel's RoPE forward (in place on tokens-first q / k) and its version, or None and why not."""
    try:
        from importlib.metadata import version
        from liger_kernel.ops.rope import LigerRopeFunction
        return LigerRopeFunction.apply, f'liger-kernel {version("liger-kernel")}'
    except Exception as e:  # not installed, or not importable with this torch / triton
        return None, f'liger-kernel unavailable ({type(e).__name__}: {str(e).splitlines()[0][:80]})'


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy (bytes read + written)."""
    src = torch.empty(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src), device)
    return 2 * nbytes / seconds / 1e9


def bench(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``fn()``: CUDA events through triton's do_bench on a GPU, wall time on the CPU."""
    if device.type == 'cuda':
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode='median') / 1e3
    return time_fn(fn, warmup=1, iters=3, device=device)


def paths(kind: str, q: torch.Tensor, k: torch.Tensor, rot: torch.Tensor, backward: bool, compile_ok: bool,
          liger: Optional[Callable]) -> Dict[str, Callable[[], object]]:
    """The functions timed for one row: each rotates q and k (and, with ``backward``, back-propagates a
    cotangent into q, k and, for learned rotations, the rotation)."""
    learned = kind in ('pair', 'block', 'matrix')
    q = q.detach().requires_grad_(backward)
    k = k.detach().requires_grad_(backward)
    rot = rot.detach().requires_grad_(backward and learned)
    grads = (torch.randn_like(q), torch.randn_like(k))

    def rotate() -> Tuple[torch.Tensor, ...]:
        return rotate_qk(q, k, rot, rot, kind)

    def step(fn: Callable[[], Tuple[torch.Tensor, ...]], mode: Optional[str]) -> Callable[[], object]:
        def run():
            with fused_mode(mode) if mode else contextlib.nullcontext():
                out = fn()
                if backward:
                    torch.autograd.backward(out, grads)
            return out
        return run

    fns = {'fused': step(rotate, 'on'), 'reference': step(rotate, 'off')}
    if compile_ok:  # traced, vispe runs the reference kernels (the compiler fuses them itself)
        fns['compiled reference'] = step(torch.compile(rotate, fullgraph=True, dynamic=False), 'off')
    if liger is not None and kind == 'half_table' and q.transpose(1, 2).is_contiguous():
        # transformers' cos / sin: the table's angle per pair, repeated for both halves, (N, hd)
        cos = torch.cat([rot.real, rot.real], -1).to(q.dtype)
        sin = torch.cat([rot.imag, rot.imag], -1).to(q.dtype)
        fns['liger'] = step(lambda: liger(q, k, cos, sin), None)
    return fns


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--batch', type=int, default=64)
    ap.add_argument('--heads', type=int, default=12)
    ap.add_argument('--grid', type=int, default=14, help='patch grid side (224 / 16)')
    ap.add_argument('--head-dim', type=int, default=64)
    ap.add_argument('--dtype', default='bf16', choices=['bf16', 'fp16', 'fp32'])
    ap.add_argument('--device', default='cuda', help="'cpu' only to smoke-test this script")
    ap.add_argument('--no-compile', action='store_true', help='skip the torch.compile column')
    ap.add_argument('--out', default=None, help='also write the table to this file')
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('rotation_bandwidth.py needs a CUDA device (or --device cpu)')
    # one compilation of the same closure per row and direction
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 256)
    dtype = {'bf16': torch.bfloat16, 'fp16': torch.float16, 'fp32': torch.float32}[args.dtype]
    B, H, hd, N = args.batch, args.heads, args.head_dim, 1 + args.grid ** 2
    qk_bytes = 4 * B * H * N * hd * torch.finfo(dtype).bits // 8
    liger, liger_note = liger_rope() if device.type == 'cuda' else (None, 'liger-kernel: GPU only')
    name = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'
    copy_gbs = copy_bandwidth(device, 1 << 30 if device.type == 'cuda' else 1 << 26)
    sheet = next((v for k, v in DATASHEET_GBS.items() if k in name), None)

    header = ['rotation', 'direction', 'rotation MB'] + [f'{p} GB/s (% copy)' for p in PATHS] + ['fused x ref', 'fused x liger']
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    print(lines[0], flush=True)
    rows = [(kind, False) for kind in KINDS] + [('half_table', True)]
    best = 0.0
    for kind, tokens_first in rows:
        q, k = qk_views(B, H, N, hd, dtype, device, tokens_first)
        rot = rotation(kind, H, args.grid, hd, device)
        rot_mb = rot.untyped_storage().nbytes() / 1e6
        for backward in (False, True):
            if tokens_first and not backward and liger is not None:
                # Liger's result on the same inputs (the rotation applied once) equals the fused one
                with fused_mode('on'):
                    want = rotate_qk(q, k, rot, rot, kind)
                cos = torch.cat([rot.real, rot.real], -1).to(dtype)
                sin = torch.cat([rot.imag, rot.imag], -1).to(dtype)
                got = liger(q.clone(), k.clone(), cos, sin)
                liger_note += f'; max |liger - fused| {max((g - w).abs().max().item() for g, w in zip(got, want)):.1e}'
            cells, gbs = [], {}
            for path, fn in paths(kind, q, k, rot, backward, not args.no_compile, liger).items():
                try:
                    seconds = bench(fn, device)
                    gbs[path] = qk_bytes * (2 if backward else 1) / seconds / 1e9
                except Exception as e:  # report and go on
                    gbs[path] = float('nan')
                    print(f'{kind} {path}: {type(e).__name__}: {str(e).splitlines()[0][:120]}', flush=True)
            best = max(best, gbs['fused'])
            for path in PATHS:
                cells.append(f'{gbs[path]:.3g} ({100 * gbs[path] / copy_gbs:.0f} %)' if path in gbs else '-')
            speedup = [f"{gbs['fused'] / gbs[p]:.2f}" if p in gbs else '-' for p in ('reference', 'liger')]
            label = f'{kind} ({"tokens-first" if tokens_first else "qkv views"})'
            line = '| ' + ' | '.join([label, 'fwd+bwd' if backward else 'fwd', f'{rot_mb:.2f}', *cells, *speedup]) + ' |'
            lines.append(line)
            print(line, flush=True)
    notes = [f'{name}, torch {torch.__version__}' + (f', triton {__import__("triton").__version__}' if device.type == 'cuda' else '')
             + f'; q / k {args.dtype} ({B}, {H}, {N}, {hd}); {liger_note}',
             f'copy bandwidth {copy_gbs:.0f} GB/s (read + write); fused best {best:.0f} GB/s'
             + (f' = {100 * best / sheet:.0f} % of the data sheet\'s {sheet:.0f} GB/s' if sheet else ''),
             'GB/s: q / k bytes read and written (forward 4 x, forward + backward 8 x the size of q) per second; '
             'rotation MB: bytes of the rotation itself']
    text = '\n'.join(lines + [''] + notes)
    print('\n'.join([''] + notes), flush=True)
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text + '\n')


if __name__ == '__main__':
    main()
