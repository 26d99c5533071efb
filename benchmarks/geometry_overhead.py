"""Overhead of the geometric encodings (GTA, PRoPE, multi-view GTA) against no encoding.

1. GTA on ViT-B/16 at 224, batch 8, CPU by default: eval-mode forward and a training step
   (forward, cross-entropy, backward) with ``pe='gta'`` against ``pe='none'`` (target <= 1.05x),
   with ``rope_axial`` alongside for reference (GTA adds the value and output rotations to it).
2. PRoPE on a multi-view layout (8 views of 16 x 16 patches = 2048 tokens, ViT-B width): one
   attention layer (qkv, SDPA, proj) with ``prope`` / ``gta_multiview`` against plain attention,
   forward and forward + backward, the per-forward ``prepare`` (shared by all layers) timed
   separately and reported relative to one plain attention layer.

Every candidate is interleaved with its baseline in the same process (`_timing.compare`). On a
machine shared with other jobs, ``--clock process`` times the CPU time this process used
(`time.process_time`, best with ``--threads 1``) instead of wall time, which waiting for a core
inflates and scatters.

    python benchmarks/geometry_overhead.py                      # both parts (several minutes on 2 cores)
    python benchmarks/geometry_overhead.py --no-vit --views 8   # only the multi-view part
    python benchmarks/geometry_overhead.py --threads 1 --clock process
"""
from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from typing import Callable, Dict

import timm
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
from _timing import compare, eval_step, train_step  # noqa: E402

import vispe  # noqa: E402
from vispe import PEAttention  # noqa: E402
from vispe.cameras import Cameras  # noqa: E402


def _timer(args: argparse.Namespace) -> Callable[..., Dict[str, float]]:
    return functools.partial(compare, clock=args.clock)


def vit(args: argparse.Namespace) -> None:
    specs = ['none', 'gta', 'rope_axial']
    torch.manual_seed(0)
    models = {s: timm.create_model(args.model, pe=s, img_size=args.img, num_classes=1000) for s in specs}
    x = torch.randn(args.batch, 3, args.img, args.img)
    y = torch.randint(0, 1000, (args.batch,))
    modes = [('eval forward', True)] + ([('train step', False)] if args.train else [])
    for title, is_eval in modes:
        fns = {}
        for spec, m in models.items():
            fns[spec] = eval_step(m, x) if is_eval else train_step(m, x, y)
        times = _timer(args)(fns, rounds=args.rounds, per_round=1, warmup=1)
        base = times['none']
        print(f'\n{title}: {args.model}, {args.img}px, batch {args.batch}, {torch.get_num_threads()} threads; '
              f"pe='none' {base * 1e3:.0f} ms ({args.clock} clock)")
        for spec in specs[1:]:
            ratio = times[spec] / base
            target = '  (target <= 1.05)' if spec == 'gta' else ''
            print(f'  {spec:12s} {ratio:6.3f}x{target}')
    # the encoding's own work in one eval forward (all layers' hooks), a steadier figure than the
    # difference of two whole-model timings on a busy machine
    m = models['gta'].eval()
    blk = m.blocks[0].attn
    n = m.patch_embed.num_patches + m.num_prefix_tokens
    # q, k, v as strided views of one qkv projection, as in the attention layer
    q, k, v = torch.randn(args.batch, n, 3, blk.num_heads, blk.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    state = m.pe.prepare(m.positions(m.patch_embed.grid_size, x.device))

    def hooks():
        for layer in range(len(m.blocks)):
            state.qk(q, k, layer)
            state.value(v, layer)
            state.output(v, layer)
    times = _timer(args)({'none': eval_step(models['none'].eval(), x), 'gta hooks': hooks},
                         rounds=args.rounds, per_round=1, warmup=1)
    print(f"  gta hooks alone (q, k, v, output maps of all {len(m.blocks)} layers): "
          f"{times['gta hooks'] / times['none']:.3f}x of the pe='none' eval forward")


def _cameras(views: int, image: int) -> Cameras:
    g = torch.Generator().manual_seed(0)
    angles = torch.arange(views, dtype=torch.float32) * (2 * math.pi / views)
    c2w = torch.eye(4).repeat(views, 1, 1)
    # cameras on a circle looking at the origin (OpenCV: z forward, y down)
    c2w[:, 0, 0], c2w[:, 0, 2] = angles.cos(), -angles.sin()
    c2w[:, 2, 0], c2w[:, 2, 2] = angles.sin(), angles.cos()
    c2w[:, :3, 3] = -3 * c2w[:, :3, 2] + 0.01 * torch.randn(views, 3, generator=g)
    K = torch.tensor([[image * 0.9, 0, image / 2], [0, image * 0.9, image / 2], [0, 0, 1]]).repeat(views, 1, 1)
    return Cameras(K, cam_to_world=c2w, image_size=(image, image))


def multiview(args: argparse.Namespace) -> None:
    dim, heads = 768, 12
    cams = _cameras(args.views, args.grid * 16)
    pos = vispe.positions.multiview(cams, (args.grid, args.grid))
    n = pos.num_tokens
    torch.manual_seed(0)
    attn = PEAttention(dim, heads, qkv_bias=True)
    x = torch.randn(args.mv_batch, n, dim)
    x_grad = x.clone().requires_grad_(True)
    encodings = {spec: vispe.create_pe(spec, dim=dim, num_heads=heads, depth=1) for spec in ('prope', 'gta_multiview')}
    states = {}
    for spec, pe in encodings.items():
        with torch.no_grad():
            states[spec] = pe.prepare(pos)

    def forward(pe, state):
        def run():
            with torch.no_grad():
                return attn(x, pe=state)
        return run

    def train(pe, state):
        def run():
            attn.zero_grad(set_to_none=True)
            x_grad.grad = None
            attn(x_grad, pe=state).sum().backward()
        return run

    def prepare(pe):
        def run():
            pe.clear_cache()
            with torch.no_grad():
                return pe.prepare(pos)
        return run

    print(f'\nmulti-view attention layer: {args.views} views x {args.grid}x{args.grid} patches = {n} tokens, '
          f'dim {dim}, {heads} heads, batch {args.mv_batch}, {torch.get_num_threads()} threads, {args.clock} clock')
    for title, make in (('forward', forward), ('forward + backward', train)):
        fns = {'plain': make(None, None)}
        fns.update({spec: make(pe, states[spec]) for spec, pe in encodings.items()})
        times = _timer(args)(fns, rounds=args.rounds, per_round=1, warmup=1)
        base = times['plain']
        print(f'  {title}: plain attention {base * 1e3:.0f} ms')
        for spec in encodings:
            print(f'    {spec:14s} {times[spec] / base:6.3f}x plain attention')
    fns = {'plain': forward(None, None)}
    fns.update({f'prepare {spec}': prepare(pe) for spec, pe in encodings.items()})
    times = _timer(args)(fns, rounds=args.rounds, per_round=1, warmup=1)
    for spec in encodings:
        print(f'  prepare ({spec}, once per forward for all layers): '
              f'{times[f"prepare {spec}"] / times["plain"]:6.3f}x one plain attention layer')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--model', default='vit_base')
    parser.add_argument('--img', type=int, default=224)
    parser.add_argument('--batch', type=int, default=8)
    parser.add_argument('--rounds', type=int, default=5)
    parser.add_argument('--views', type=int, default=8)
    parser.add_argument('--grid', type=int, default=16, help='patches per side of each view')
    parser.add_argument('--mv-batch', type=int, default=1, help='batch of the multi-view part')
    parser.add_argument('--threads', type=int, default=0, help='torch threads (0: leave as is)')
    parser.add_argument('--clock', choices=('wall', 'process'), default='wall',
                        help='wall time (default) or CPU time of this process (for shared machines)')
    parser.add_argument('--no-train', dest='train', action='store_false')
    parser.add_argument('--no-vit', dest='vit', action='store_false')
    parser.add_argument('--no-multiview', dest='multiview', action='store_false')
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vit:
        vit(args)
    if args.multiview:
        multiview(args)


if __name__ == '__main__':
    main()
