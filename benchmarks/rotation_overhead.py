"""Overhead of the learned rotation encodings (LieRE, ComRoPE-AP/LD, Cayley/Circulant-STRING) in a ViT.

Prints, for each encoding, the eval forward time, the train step time (forward, backward, SGD step)
and the peak memory of a train step as ratios against the same ViT with ``pe='none'``, measured in
this process with interleaved rounds (`_timing.compare`). Targets (issue #3, ViT-B/16, 224, batch 8,
CPU): eval <= 1.05x, train <= 1.15x, peak memory <= 1.10x. A second, identical ``pe='none'`` model
is timed in the same rounds (row ``none (control)``): its ratio, 1.000x on a quiet machine, is the
resolution of this run.

It then times a BASELINE that reproduces how the original ComRoPE code applies these rotations:
every attention layer exponentiates per sample (a ``(B, N, H, hd/b, b, b)`` batch of
``matrix_exp``) and scatters the blocks into dense per-sample ``(B, N, H, hd, hd)`` matrices that
multiply q and k. The baseline reuses the vispe encoding's own generators and positions, so the
outputs must agree (printed), and vispe's speed-up over it is reported.

Usage:
    python benchmarks/rotation_overhead.py                     # ViT-B/16, 224, batch 8
    python benchmarks/rotation_overhead.py --quick             # fewer rounds
    python benchmarks/rotation_overhead.py --model vit_small --batch 4 --encodings liere,comrope_ld
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List, Optional

import timm
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vispe  # noqa: E402  (registers the ViTs in timm)
from vispe.contract import PositionalEncoding  # noqa: E402
from vispe.encodings.liere import LieRE  # noqa: E402
from _timing import compare, peak_memory  # noqa: E402

ENCODINGS = ['liere', 'comrope_ap', 'comrope_ld', 'string_cayley', 'string_circulant']
# encodings compared with the dense per-sample baseline (the configurations the issue quotes)
BASELINE_SPECS = ['comrope_ld', 'comrope_ap:block=8', 'liere']
# fixed-frequency RoPE: the cost any q/k rotation has (attention keeps the rotated q and k for backward)
REFERENCE = 'rope_axial'
FOLDED = 'string_cayley folded (eval)'
# a second pe='none' model timed in the same rounds: its ratio is this run's noise floor
CONTROL = 'none (control)'
TARGETS = {'eval': 1.05, 'train': 1.15, 'memory': 1.10}


class DensePerSampleBaseline(PositionalEncoding):
    """BASELINE, not vispe's implementation: the original ComRoPE code's rotation path.

    In every attention layer: ``lnR = sum_d p_d A_d`` per sample ``(B, N, H, nb, b, b)``,
    ``R = matrix_exp(lnR)`` per sample, the blocks scattered into a dense ``(B, N, H, hd, hd)`` zero
    matrix, and ``q <- R q``, ``k <- R k`` as dense matrix-vector products. Generators and positions
    come from the wrapped vispe encoding (prefix tokens without a position get a zero exponent, i.e.
    the identity), so both compute the same function.
    """

    def __init__(self, source: PositionalEncoding) -> None:
        super().__init__(source.ctx)
        self.source = source

    def _prepare(self, pos_q, pos_k):
        src = self.source
        if isinstance(src, LieRE):
            coords, pad = src.coordinates(pos_q), pos_q.num_prefix
            gens = src.axis_generators()
        else:  # ComRoPE
            coords, pad = src.coordinates(pos_q)
            gens = src.axis_generators(pos_q.ndim)
        coords = torch.cat([coords.new_zeros(pad, coords.shape[-1]), coords])
        return coords, gens

    def qk(self, q, k, state, layer, x=None):
        coords, gens = state
        batch, heads, tokens, hd = q.shape
        gen = gens[:, layer if gens.shape[1] > 1 else 0].expand(-1, heads, -1, -1, -1)  # (D, H, nb, b, b)
        nb, b = gen.shape[2], gen.shape[-1]
        positions = coords.expand(batch, tokens, -1)  # the original takes (bs, len, D) positions
        log_r = torch.einsum('znd,dhjxy->znhjxy', positions, gen)
        blocks = torch.linalg.matrix_exp(log_r)  # per sample: (B, N, H, nb, b, b)
        selector = torch.kron(torch.eye(nb, dtype=torch.bool), torch.ones(b, b, dtype=torch.bool))
        dense = torch.zeros(batch, tokens, heads, hd, hd, dtype=blocks.dtype)
        dense[:, :, :, selector] = blocks.reshape(batch, tokens, heads, -1)
        dense = dense.transpose(1, 2)  # (B, H, N, hd, hd)
        return (dense @ q.unsqueeze(-1)).squeeze(-1), (dense @ k.unsqueeze(-1)).squeeze(-1)


def make_model(model: str, spec: str, img: int) -> nn.Module:
    torch.manual_seed(0)  # identical shared weights in every model
    return timm.create_model(model, pe=spec, img_size=img)


def train_step_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)  # stateless: the memory is the model's own

    def step() -> None:
        model.train()
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def eval_fn(model: nn.Module, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    model.eval()  # once: switching modes clears the cached rotations

    def forward() -> torch.Tensor:
        with torch.no_grad():
            return model(x)
    return forward


def table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return '\n'.join('  '.join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--model', default='vit_base', help='vispe timm ViT (vit_tiny/small/base/large)')
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--img', type=int, default=224)
    parser.add_argument('--encodings', default=','.join(ENCODINGS), help='comma-separated encoding specs')
    parser.add_argument('--threads', type=int, default=None,
                        help="torch threads (default: torch's); 1 gives steadier ratios on a shared machine")
    parser.add_argument('--clock', default='wall', choices=['wall', 'process'],
                        help="'process': CPU time of this process (with --threads 1 on a machine shared with other jobs)")
    parser.add_argument('--rounds', type=int, default=None, help='train-step rounds (default 3; eval gets 5)')
    parser.add_argument('--quick', action='store_true', help='fewer rounds (noisier)')
    parser.add_argument('--no-memory', action='store_true', help='skip the peak-memory measurement')
    parser.add_argument('--no-train', action='store_true', help='skip the train-step timing')
    parser.add_argument('--no-baseline', action='store_true', help='skip the dense per-sample baseline')
    parser.add_argument('--no-reference', action='store_true', help=f'skip the {REFERENCE} reference row')
    parser.add_argument('--no-control', action='store_true', help=f"skip the '{CONTROL}' row")
    parser.add_argument('--baseline-train', action='store_true', help='also time the baseline train step (slow)')
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    rounds_eval, rounds_train = (2, 1) if args.quick else (5, args.rounds or 3)
    rounds_eval = max(rounds_eval, rounds_train)
    specs = [s for s in args.encodings.split(',') if s]
    baseline_specs = [] if args.no_baseline else BASELINE_SPECS
    print(f'{args.model}, {args.img}px, batch {args.batch}, CPU, torch {torch.__version__}, '
          f'{torch.get_num_threads()} threads, {args.clock} clock; rounds: eval {rounds_eval}, train {rounds_train}',
          flush=True)

    x = torch.randn(args.batch, 3, args.img, args.img)
    y = torch.randint(0, 1000, (args.batch,))
    names = ['none'] + specs + ([] if args.no_reference else [REFERENCE])
    models = {name: make_model(args.model, name, args.img) for name in names}
    if not args.no_control:
        models[CONTROL] = make_model(args.model, 'none', args.img)

    memory: Dict[str, int] = {}
    if not args.no_memory:  # first, in children forked from a parent that has not run anything yet
        for name in names:
            memory[name] = peak_memory(train_step_fn(models[name], x, y))
            print(f'  peak memory {name}: {memory[name] / 2 ** 20:.0f} MiB', flush=True)

    evals = {name: eval_fn(m, x) for name, m in models.items()}
    if 'string_cayley' in specs:  # the inference path: P folded into the q/k projections
        folded = make_model(args.model, 'string_cayley', args.img).eval()
        folded.pe.fold_into(folded)
        evals[FOLDED] = eval_fn(folded, x)
    t_eval = compare(evals, rounds=rounds_eval, per_round=1, warmup=1, clock=args.clock)
    print('  eval done', flush=True)
    t_train: Dict[str, float] = {}
    if not args.no_train:
        steps = {name: train_step_fn(m, x, y) for name, m in models.items()}
        t_train = compare(steps, rounds=rounds_train, per_round=1, warmup=1, clock=args.clock)

    rows = [['encoding', 'eval', 'train', 'peak mem', 'eval s', 'train s', 'within targets']]
    for name in list(names) + [n for n in (FOLDED, CONTROL) if n in evals]:
        ratios = {'eval': t_eval[name] / t_eval['none']}
        if name in t_train:
            ratios['train'] = t_train[name] / t_train['none']
        if name in memory:
            ratios['memory'] = memory[name] / memory['none']
        ok = all(v <= TARGETS[k] for k, v in ratios.items())
        label = f'{name} (reference)' if name == REFERENCE and name not in specs else name
        rows.append([label] + [f'{ratios[k]:.3f}x' if k in ratios else '-' for k in ('eval', 'train', 'memory')]
                    + [f'{t_eval[name]:.2f}', f'{t_train[name]:.2f}' if name in t_train else '-',
                       'yes' if ok else 'NO'])
    print(f"\nratios vs pe='none' (targets: eval <= {TARGETS['eval']}x, train <= {TARGETS['train']}x, "
          f"peak memory <= {TARGETS['memory']}x)")
    print(table(rows), flush=True)

    if not baseline_specs:
        return
    print('\nBASELINE: per-sample matrix_exp + dense (B, N, H, hd, hd) rotations in every layer '
          '(the original ComRoPE code path), same generators and positions as vispe')
    rows = [['encoding', 'vispe eval s', 'baseline eval s', 'speed-up', 'max |out diff|']]
    if args.baseline_train:
        rows[0] += ['vispe train s', 'baseline train s', 'speed-up']
    for spec in baseline_specs:
        fast = make_model(args.model, spec, args.img)  # fresh: the timed models took SGD steps
        slow = make_model(args.model, spec, args.img)
        slow.pe = DensePerSampleBaseline(slow.pe)
        fast_eval, slow_eval = eval_fn(fast, x), eval_fn(slow, x)
        t = compare({'vispe': fast_eval, 'baseline': slow_eval}, rounds=max(1, rounds_eval // 2), per_round=1,
                    warmup=1, clock=args.clock)
        diff = (fast_eval() - slow_eval()).abs().max().item()
        row = [spec, f"{t['vispe']:.2f}", f"{t['baseline']:.2f}", f"{t['baseline'] / t['vispe']:.1f}x", f'{diff:.1e}']
        if args.baseline_train:
            tt = compare({'vispe': train_step_fn(fast, x, y), 'baseline': train_step_fn(slow, x, y)},
                         rounds=rounds_train, per_round=1, warmup=1, clock=args.clock)
            row += [f"{tt['vispe']:.2f}", f"{tt['baseline']:.2f}", f"{tt['baseline'] / tt['vispe']:.1f}x"]
        rows.append(row)
        print(f'  {spec} done', flush=True)
    print(table(rows), flush=True)


if __name__ == '__main__':
    main()
