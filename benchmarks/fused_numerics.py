"""Numerics of the fused Triton rotations (`vispe.rotary.fused`) against the reference kernels, per
kernel kind, activation dtype and shape: the table a GPU run must show before the kernels are trusted.

Each case rotates q and k read as views of one fused qkv projection (timm's layout) and takes
gradients of a random cotangent with respect to the projection and to the rotation. Three runs:
the float64 truth (reference kernels on float64 / complex128 copies), the reference kernels in the
case's dtype, the fused kernels in that dtype. Errors are relative to the truth's largest entry,
``max |run - truth| / max |truth|``, for the output, the projection's gradient and the rotation's
gradient. The fused kernels pass where their error is at most ``FACTOR`` times the reference's in
the same dtype, or within the dtype's floor (`FLOOR`): the rounding of the one cast at the end.

Cases cover every kind the kernels serve (``table``, ``half_table``, ``pair``, ``block`` with
``b`` = 2, 4, 8, ``matrix``), head dims 64 / 72 / 80 / 128, prefix tokens (class token, registers),
non-square grids, partial rotary (channels passed through), rotations shared by the batch, per head,
and per sample (NaFlex: every sample its own grid, hence its own table ``(B, 1, N, P)``).

Usage:
    python benchmarks/fused_numerics.py                       # on the GPU, all cases, fp32 and bf16
    python benchmarks/fused_numerics.py --device cpu --quick  # smoke test in Triton's interpreter
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, Iterator, List, NamedTuple, Optional, Tuple

if __name__ == '__main__' and '--device' in sys.argv and sys.argv[sys.argv.index('--device') + 1] == 'cpu':
    os.environ.setdefault('TRITON_INTERPRET', '1')  # read when triton is imported: before vispe

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vispe.rotary import autograd, fused, rotate_qk, rotation_table  # noqa: E402
from vispe.rotary.kernels import pad_identity  # noqa: E402

FACTOR = 4.0
# about two units in the last place of the cast that ends every kernel
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
DTYPES = {'fp32': torch.float32, 'bf16': torch.bfloat16}


class Case(NamedTuple):
    """One rotation: ``kind`` on q / k ``(batch, heads, prefix + grid tokens, hd)``; ``width`` channels
    rotated (pairs: ``width / 2`` entries; blocks: ``width / b`` blocks of ``b``); ``lead`` the dims the
    rotation varies along before the tokens: ``()`` shared, ``('H',)`` per head, ``('B', 1)`` per
    sample, ``('B', 'H')`` per sample and head."""
    name: str
    kind: str
    hd: int
    width: int
    grid: Tuple[int, int]
    prefix: int = 1
    lead: Tuple = ()
    block: int = 2
    batch: int = 3
    heads: int = 4


CASES: List[Case] = [
    Case('table hd64 14x14 cls', 'table', 64, 64, (14, 14)),
    Case('table hd72 6x9 partial', 'table', 72, 48, (6, 9)),
    Case('table hd80 naflex per-sample', 'table', 80, 80, (5, 7), lead=('B', 1)),
    Case('table hd128 5x8 4 registers', 'table', 128, 128, (5, 8), prefix=5),
    Case('half_table hd64 14x14 cls', 'half_table', 64, 64, (14, 14)),
    Case('half_table hd72 partial naflex', 'half_table', 72, 48, (6, 9), lead=('B', 1)),
    Case('half_table hd80 per sample+head', 'half_table', 80, 80, (3, 5), lead=('B', 'H')),
    Case('half_table hd128 5x8', 'half_table', 128, 96, (5, 8)),
    Case('pair hd64 per head', 'pair', 64, 64, (7, 9), lead=('H',)),
    Case('pair hd80 naflex per-sample', 'pair', 80, 80, (4, 6), lead=('B', 1)),
    Case('block b2 hd64 per head', 'block', 64, 64, (6, 9), block=2, lead=('H',)),
    Case('block b4 hd72 naflex per-sample', 'block', 72, 72, (5, 6), block=4, lead=('B', 1)),
    Case('block b8 hd80 per head', 'block', 80, 80, (7, 7), block=8, lead=('H',)),
    Case('block b8 hd128 shared, 2 pass', 'block', 130, 128, (8, 5), block=8),
    Case('matrix b4 hd64 per-sample', 'matrix', 64, 64, (6, 9), block=4, lead=('B', 1)),
    Case('matrix b4 hd72 shared, 4 pass', 'matrix', 72, 68, (5, 7), block=4),
    Case('matrix b8 hd80 per head', 'matrix', 80, 80, (4, 4), block=8, lead=('H',)),
]
QUICK = ['table hd72 6x9 partial', 'half_table hd80 per sample+head', 'pair hd80 naflex per-sample',
         'block b4 hd72 naflex per-sample', 'matrix b4 hd64 per-sample']


def _lead(case: Case) -> Tuple[int, ...]:
    return tuple(case.batch if d == 'B' else case.heads if d == 'H' else d for d in case.lead)


def make_rotation(case: Case, generator: torch.Generator) -> torch.Tensor:
    """The case's rotation (float32 or complex64), identity rows for its prefix tokens: unit tables
    (or YaRN-like magnitudes 1.3), angles, orthogonal blocks, or invertible blocks far from orthogonal."""
    lead, n = _lead(case), case.grid[0] * case.grid[1]
    if case.kind in ('table', 'half_table', 'pair'):
        angles = 3 * torch.randn(*lead, n, case.width // 2, generator=generator)
        rot = angles if case.kind == 'pair' else rotation_table(angles, 1.3 if case.kind == 'table' else 1.0)
    else:
        b = case.block
        a = torch.randn(*lead, n, case.width // b, b, b, generator=generator)
        if case.kind == 'block':
            rot = torch.linalg.matrix_exp(a - a.mT)
        else:
            scale = 1 + torch.rand(*lead, n, case.width // b, b, 1, generator=generator)
            rot = scale * torch.eye(b) + 0.3 * a
    return pad_identity(rot, case.prefix, case.kind)


@contextlib.contextmanager
def counted_launches() -> Iterator[List[str]]:
    """The kinds of the fused launches made inside the block (forward and backward)."""
    calls: List[str] = []
    launch = fused._launch

    def counted(*args, **kwargs):
        calls.append(args[0])
        return launch(*args, **kwargs)
    fused._launch = counted
    try:
        yield calls
    finally:
        fused._launch = launch


@contextlib.contextmanager
def fused_mode(mode: str) -> Iterator[None]:
    before = autograd.FUSED
    autograd.FUSED = mode
    try:
        yield
    finally:
        autograd.FUSED = before


def _run(case: Case, qkv: torch.Tensor, rot: torch.Tensor, cotangent: torch.Tensor
         ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q and k rotated, stacked), the gradients of ``<cotangent, output>`` w.r.t. qkv and rot."""
    qkv = qkv.detach().requires_grad_()
    rot = rot.detach().requires_grad_()
    q, k, _ = qkv.reshape(case.batch, -1, 3, case.heads, case.hd).permute(2, 0, 3, 1, 4).unbind(0)
    out = torch.stack(rotate_qk(q, k, rot, rot, case.kind))
    gq, grot = torch.autograd.grad(out, (qkv, rot), cotangent.to(out.dtype))
    return out.detach(), gq, grot


def _relative(got: torch.Tensor, truth: torch.Tensor) -> float:
    if got.is_complex():
        got, truth = torch.view_as_real(got), torch.view_as_real(truth)
    return ((got.double() - truth).abs().max() / truth.abs().max().clamp_min(1e-30)).item()


def measure(case: Case, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Dict[str, object]:
    """Relative errors of the fused and the reference runs against the float64 truth:
    ``{'fused': (out, grad qkv, grad rot), 'reference': (...), 'launches': fused launches}``."""
    g = torch.Generator().manual_seed(seed)
    n = case.prefix + case.grid[0] * case.grid[1]
    # the truth starts from the inputs as the dtype holds them: its errors are the kernels' alone
    qkv = torch.randn(case.batch, n, 3 * case.heads * case.hd, generator=g).to(dtype)
    rot = make_rotation(case, g)
    cotangent = torch.randn(2, case.batch, case.heads, n, case.hd, generator=g).to(dtype)
    wide = torch.complex128 if rot.is_complex() else torch.float64
    with fused_mode('off'):
        truth = _run(case, qkv.double().to(device), rot.to(wide).to(device), cotangent.double().to(device))
        reference = _run(case, qkv.to(device), rot.to(device), cotangent.to(device))
    with fused_mode('on'), counted_launches() as launches:
        got = _run(case, qkv.to(device), rot.to(device), cotangent.to(device))
    return {'fused': tuple(_relative(a, t) for a, t in zip(got, truth)),
            'reference': tuple(_relative(a, t) for a, t in zip(reference, truth)),
            'launches': len(launches)}


def within_bound(errors: Dict[str, object], dtype: torch.dtype) -> bool:
    """Every fused error at most `FACTOR` times the reference's in the same dtype, or under the floor."""
    return all(f <= max(FACTOR * r, FLOOR[dtype]) for f, r in zip(errors['fused'], errors['reference']))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--device', default='cuda', help="'cpu' only to smoke-test this script (Triton's interpreter)")
    ap.add_argument('--quick', action='store_true', help=f'{len(QUICK)} cases, one per kind')
    ap.add_argument('--cases', default=None, help='only the cases whose name contains this text')
    ap.add_argument('--dtypes', default='fp32,bf16', help=f'comma-separated, from {sorted(DTYPES)}')
    ap.add_argument('--out', default=None, help='also write the table to this file')
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('fused_numerics.py needs a CUDA device (or --device cpu)')
    unknown = [d for d in args.dtypes.split(',') if d not in DTYPES]
    if unknown:
        raise SystemExit(f'--dtypes takes values from {sorted(DTYPES)}, got {unknown}')
    torch.backends.cuda.matmul.allow_tf32 = False
    cases = [c for c in CASES if (not args.quick or c.name in QUICK) and (args.cases or '') in c.name]
    if not cases:
        raise SystemExit(f'--cases {args.cases!r} matches none of {[c.name for c in CASES]}')
    header = ('| case | dtype | out fused / ref | grad qkv fused / ref | grad rot fused / ref | launches | ok |\n'
              '|---|---|---|---|---|---|---|')
    lines, failed = [header], 0
    print(header, flush=True)
    for case in cases:
        for label in args.dtypes.split(','):
            try:
                e = measure(case, DTYPES[label], device)
                ok = within_bound(e, DTYPES[label]) and e['launches'] >= 2
                cells = [f'{f:.1e} / {r:.1e}' for f, r in zip(e['fused'], e['reference'])]
                line = f"| {case.name} | {label} | {' | '.join(cells)} | {e['launches']} | {'yes' if ok else 'NO'} |"
            except Exception as exc:  # one broken case must not hide the others
                ok, line = False, f'| {case.name} | {label} | {type(exc).__name__}: {str(exc).splitlines()[0][:90]} | | | | NO |'
            failed += not ok
            lines.append(line)
            print(line, flush=True)
    lines.append(f'\nerrors: max |x - float64 truth| / max |truth|; ok: fused <= {FACTOR:g} x reference or under the '
                 f'dtype floor ({", ".join(f"{k} {FLOOR[v]:g}" for k, v in DTYPES.items())}), and the fused '
                 f'kernels launched forward and backward. {device.type}, torch {torch.__version__}'
                 + (f', {torch.cuda.get_device_name(device)}' if device.type == 'cuda' else ''))
    print(lines[-1])
    if args.out:
        with open(args.out, 'w') as f:
            f.write('\n'.join(lines) + '\n')
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
