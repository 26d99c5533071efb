"""Position error of every encoding converted to bfloat16 / float16 (``module.to(dtype)``) at a large grid.

For each registered encoding that takes a plain grid, the float32 encoding and its converted copy run
their hooks on the same inputs (drawn in float32, rounded to the dtype, so both see the same values)
at a 96 x 96 grid with a class token, and the script prints the largest difference relative to the
float32 result's largest entry, ``max |half - float32| / max |float32|``, per hook: the rotated q
(``qk``), the logit bias (``bias``, among 64 tokens: the grid's four corners (the largest offsets), its
centre and 59 drawn at random; masked entries must agree), the embedded tokens (``embed``), ``value`` /
``output`` / ``between_blocks``.

Two references:

* ``float32``: the float32 encoding as built: the whole error of a pure half-precision model,
  including its learned parameters rounded to the dtype (the user's choice: autocast keeps them float32);
* ``same params``: the float32 encoding with its parameters rounded like the converted one's (its
  buffers as built): what is left is the error of the computation, one rounding of the result where
  positions are handled in float32 (`vispe.contract.PositionalEncoding.float32_buffers`).

A single rounding of the result to the dtype is at most its unit roundoff (bfloat16 3.9e-3, float16
4.9e-4) relative to the largest entry; errors above that come from the encoding's own precision.

Usage:
    python benchmarks/low_precision_tables.py                    # every encoding, bf16 and fp16
    python benchmarks/low_precision_tables.py --pes rope_golden,lookhere --out table.md
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Collection, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vispe  # noqa: E402
from vispe.contract import HOOKS, PositionalEncoding  # noqa: E402

GRID = (96, 96)
# ViT-B's 12 heads; 4 layers, the second one's: ALiBi's and LookHere's head and layer slopes are then
# not all powers of two (a bfloat16 table would round them)
DIM, HEADS, DEPTH, LAYER = 192, 12, 4, 1
DTYPES = {'bf16': torch.bfloat16, 'fp16': torch.float16}
# options a 96 x 96 grid needs (the defaults suit ViT grids)
OPTIONS: Dict[str, Dict[str, object]] = {'detr_learned': {'num_embeddings': GRID[0]}}
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def grid_pes() -> List[str]:
    """Registered encodings that need nothing beyond the token grid."""
    return [p for p in vispe.list_pes() if p != 'none' and not vispe.pe_info(p)['cls'].requires]


def build(name: str, options: Optional[Dict[str, object]] = None, seed: int = 0) -> PositionalEncoding:
    """Encoding ``name`` at the 96 x 96 grid (`OPTIONS`, then ``options``), in eval mode."""
    torch.manual_seed(seed)
    return vispe.create_pe(name, dim=DIM, num_heads=HEADS, depth=DEPTH, grid_size=GRID, num_prefix_tokens=1,
                           **{**OPTIONS.get(name, {}), **(options or {})}).eval()


def with_rounded_parameters(pe: PositionalEncoding, dtype: torch.dtype) -> PositionalEncoding:
    """A float32 copy of ``pe`` whose parameters hold their values rounded to ``dtype`` (buffers as built)."""
    twin = copy.deepcopy(pe)
    with torch.no_grad():
        for p in twin.parameters():
            p.copy_(p.to(dtype))
    return twin


def hook_inputs(seed: int = 1) -> Dict[str, object]:
    """Positions and float32 inputs: q / k / v over the whole grid, and the tokens of the bias (the four
    corners, the centre and 59 random tokens of the grid, a batch of one: an ``N x N`` bias of the whole
    grid would take gigabytes)."""
    g = torch.Generator().manual_seed(seed)
    pos = vispe.positions.grid(*GRID, num_prefix=1)
    n = 1 + GRID[0] * GRID[1]
    h, w = GRID
    corners = torch.tensor([0, w - 1, (h - 1) * w, h * w - 1, (h // 2) * w + w // 2])
    few = torch.cat([corners, torch.randperm(h * w, generator=g)[:59]]).unsqueeze(0)
    hd = DIM // HEADS
    return dict(pos=pos, pos_few=pos.select(few), q=torch.randn(1, HEADS, n, hd, generator=g),
                k=torch.randn(1, HEADS, n, hd, generator=g), v=torch.randn(1, HEADS, n, hd, generator=g),
                q_few=torch.randn(1, HEADS, 1 + few.shape[1], hd, generator=g),
                x=torch.randn(1, n, DIM, generator=g))


def run_hooks(pe: PositionalEncoding, inputs: Dict[str, object], dtype: torch.dtype, feed: torch.dtype,
              only: Collection[str] = HOOKS) -> Dict[str, torch.Tensor]:
    """Each hook of ``pe`` (among ``only``) on ``inputs`` rounded to ``dtype``, handed over as ``feed`` tensors."""
    t = {k: v.to(dtype).to(feed) if torch.is_tensor(v) else v for k, v in inputs.items()}
    pos = inputs['pos']
    out: Dict[str, torch.Tensor] = {}
    with torch.no_grad():
        hooks = pe.hooks & frozenset(only)
        if hooks & {'qk', 'value', 'output'}:
            state = pe.prepare(pos)
            if 'qk' in hooks:
                out['qk'] = state.qk(t['q'], t['k'], LAYER, x=t['x'])[0]
            if 'value' in hooks:
                out['value'] = state.value(t['v'], LAYER)
            if 'output' in hooks:
                out['output'] = state.output(t['v'], LAYER)
        if 'bias' in hooks:
            out['bias'] = pe.prepare(inputs['pos_few']).bias(t['q_few'], t['q_few'], LAYER)
        if 'embed' in hooks:
            out['embed'] = pe.embed(t['x'], pos)
        if 'between_blocks' in hooks:
            out['between_blocks'] = pe.between_blocks(t['x'], pos, 0)  # PEG's conv: after the first block
    return out


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max |want|`` over the entries ``want`` does not mask (1.0 where the masks of
    the two differ: a key blocked in one and visible in the other)."""
    got, want = got.double(), want.double()
    masked_got, masked_want = got <= torch.finfo(torch.float16).min, want <= torch.finfo(torch.float16).min
    if not torch.equal(masked_got, masked_want):
        return 1.0
    keep = ~masked_want
    scale = want[keep].abs().max().clamp_min(1e-30)
    return ((got - want)[keep].abs().max() / scale).item()


def measure(name: str, dtype: torch.dtype, inputs: Optional[Dict[str, object]] = None
            ) -> Dict[str, Tuple[float, float]]:
    """hook -> (error against the float32 encoding, error against it with the same rounded parameters)."""
    inputs = inputs if inputs is not None else hook_inputs()
    pe = build(name)
    half = copy.deepcopy(pe).to(dtype)
    got = run_hooks(half, inputs, dtype, dtype)
    full = run_hooks(pe, inputs, dtype, torch.float32)
    same = run_hooks(with_rounded_parameters(pe, dtype), inputs, dtype, torch.float32)
    return {hook: (relative_error(got[hook], full[hook]), relative_error(got[hook], same[hook])) for hook in got}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--pes', default=None, help='comma-separated names (default: every grid encoding)')
    ap.add_argument('--dtypes', default='bf16,fp16', help=f'comma-separated, from {sorted(DTYPES)}')
    ap.add_argument('--out', default=None, help='also write the table to this file')
    args = ap.parse_args(argv)
    names = args.pes.split(',') if args.pes else grid_pes()
    dtypes = [DTYPES[d] for d in args.dtypes.split(',')]
    inputs = hook_inputs()
    header = '| encoding | hook | ' + ' | '.join(f'{d} vs float32 | {d} vs same params' for d in args.dtypes.split(','))
    lines = [header + ' |', '|' + '---|' * (2 + 2 * len(dtypes))]
    print(lines[0], lines[1], sep='\n', flush=True)
    for name in names:
        per_dtype = [measure(name, dtype, inputs) for dtype in dtypes]
        for hook in per_dtype[0]:
            cells = [f'{100 * e:.3f} %' for errors in per_dtype for e in errors[hook]]
            lines.append(f'| `{name}` | {hook} | ' + ' | '.join(cells) + ' |')
            print(lines[-1], flush=True)
    notes = [f'{GRID[0]} x {GRID[1]} grid and a class token, dim {DIM}, {HEADS} heads, layer {LAYER} of {DEPTH}; '
             'one rounding to the dtype: '
             + ', '.join(f'{d} {100 * UNIT_ROUNDOFF[DTYPES[d]]:.3f} %' for d in args.dtypes.split(','))]
    if args.out:
        with open(args.out, 'w') as f:
            f.write('\n'.join(lines + [''] + notes) + '\n')
    print('\n' + notes[0])


if __name__ == '__main__':
    main()
