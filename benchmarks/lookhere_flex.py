"""LookHere's two kernels against ``pe='none'``: the dense ``(H, N, N)`` float mask handed to SDPA and the
FlexAttention ``score_mod`` that computes each logit's bias from the token indices.

Eval-mode forward of a ViT (ViT-S/16 by default) at 224 px (N = 197 tokens) and 448 px (N = 785), every
model interleaved with the baseline in the same process, and the bias tensors each builds: the prepared
state held for the forward plus one layer's bias handed to SDPA (the flex kernel holds none).
On the CPU FlexAttention has no backward, so a training step takes the dense bias in both cases (no
train-step column here); ``kernel='flex'`` is compiled on its first call (excluded by the warm-up).

    python benchmarks/lookhere_flex.py                        # 224 and 448 px, batch 2
    python benchmarks/lookhere_flex.py --img 224 --rounds 3 --threads 1 --timer cpu
"""
from __future__ import annotations

import argparse
import os
import sys

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
from _timing import compare, eval_step  # noqa: E402

import vispe  # noqa: E402  (also registers the models in timm)

SPECS = ['none', 'alibi2d', 'lookhere', 'lookhere:kernel=flex']


def run(args: argparse.Namespace, img: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, img, img)
    models = {spec: timm.create_model(args.model, pe=spec, img_size=img, num_classes=1000) for spec in SPECS}
    fns = {spec: eval_step(m, x) for spec, m in models.items()}
    times = compare(fns, rounds=args.rounds, per_round=1, warmup=2, clock='process' if args.timer == 'cpu' else 'wall')
    n = (img // 16) ** 2 + 1
    base = times['none']
    print(f"\neval forward: {args.model}, {img}px (N = {n}), batch {args.batch}, {torch.get_num_threads()} threads, "
          f"{args.timer} time; pe='none' {base * 1e3:.0f} ms", flush=True)
    print(f'{"spec":24s} {"ratio":>6s} {"bias MiB":>9s}')
    for spec in SPECS:
        print(f'{spec:24s} {times[spec] / base:6.3f} {_bias_bytes(models[spec], img) / 2**20:9.1f}', flush=True)


def _bias_bytes(model: torch.nn.Module, img: int) -> int:
    """Bytes of the bias tensors of one forward: the prepared state's and one layer's dense bias."""
    if model.pe.capabilities.hooks.isdisjoint({'bias'}):
        return 0
    grid = (img // 16, img // 16)
    prepared = model.pe.prepare(vispe.grid(*grid, num_prefix=1))
    state = [prepared.state] if isinstance(prepared.state, torch.Tensor) else list(vars(prepared.state).values())
    q = torch.zeros(1, model.pe.ctx.num_heads, 1, 1)
    bias = [] if prepared.encoding.score_mod(prepared.state, 0, q.dtype) is not None else [prepared.bias(q, q, 0)]
    return sum(t.numel() * t.element_size() for t in state + bias
               if isinstance(t, torch.Tensor) and t.dim() >= 3)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='vit_small')
    parser.add_argument('--img', type=int, nargs='+', default=[224, 448])
    parser.add_argument('--batch', type=int, default=2)
    parser.add_argument('--rounds', type=int, default=3)
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0: leave as is)')
    parser.add_argument('--timer', choices=('wall', 'cpu'), default='wall')
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for img in args.img:
        run(args, img)


if __name__ == '__main__':
    main()
