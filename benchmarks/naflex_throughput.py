"""Throughput of a mixed-size batch in NaFlex form against the same images padded to one tensor.

Images of different aspect ratios are each resized to their NaFlex size under a token budget
(`vispe.naflex_size`, timm's NaFlex resize). The NaFlex form packs their patches into sequences of
``budget`` tokens with the padding masked (`vispe.naflex_batch`); the padded form zero-pads each
resized image to the largest height and width of the batch and runs the usual ``(B, C, H, W)``
tensor. Both process the same real patches, so the figure is real (non-padding) tokens per second
of an eval forward, per encoding family, and their ratio measured in the same process (interleaved
rounds, `_timing.compare`).

    python benchmarks/naflex_throughput.py                                  # ViT-B/16, 8 images, 256 tokens
    python benchmarks/naflex_throughput.py --model vit_small --threads 1 --clock process
    python benchmarks/naflex_throughput.py --device cuda --dtype bfloat16
    python benchmarks/naflex_throughput.py --smoke                          # a tiny model, one round
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List, Sequence, Tuple

import timm
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
import vispe  # noqa: E402
from _results import write_results  # noqa: E402
from _timing import compare, eval_step  # noqa: E402

# one encoding per family: none, additive table, rotary, learned rotation, relative bias, convolution, PaPE
FAMILIES = ('none', 'learned', 'rope_mixed', 'liere', 'irpe', 'peg', 'pape')
# height:width of the batch's images, from tall to wide (cycled for larger batches)
ASPECTS = ((3, 1), (2, 1), (4, 3), (1, 1), (3, 4), (9, 16), (1, 2), (1, 3))
SMOKE = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8)


def mixed_images(batch: int, long_side: int, generator: torch.Generator) -> List[torch.Tensor]:
    """``batch`` random images whose longer side is ``long_side``, at the aspect ratios `ASPECTS`."""
    images = []
    for i in range(batch):
        h, w = ASPECTS[i % len(ASPECTS)]
        scale = long_side / max(h, w)
        images.append(torch.randn(3, round(h * scale), round(w * scale), generator=generator))
    return images


def padded_batch(images: Sequence[torch.Tensor], patch_size: int, budget: int) -> torch.Tensor:
    """The images resized as in the NaFlex form, zero-padded (bottom, right) to the largest size."""
    resized = []
    for img in images:
        size = vispe.naflex_size(tuple(img.shape[-2:]), patch_size, budget)
        resized.append(F.interpolate(img[None], size=size, mode='bilinear', align_corners=False, antialias=True)[0])
    H = max(r.shape[-2] for r in resized)
    W = max(r.shape[-1] for r in resized)
    return torch.stack([F.pad(r, (0, W - r.shape[-1], 0, H - r.shape[-2])) for r in resized])


def bench(model_name: str, pes: Sequence[str], batch: int, budget: int, long_side: int, rounds: int,
          device: torch.device, dtype: torch.dtype, clock: str, model_kwargs: Dict
          ) -> Tuple[Dict[str, Dict[str, float]], Dict[str, int]]:
    images = mixed_images(batch, long_side, torch.Generator().manual_seed(0))
    probe = timm.create_model(model_name, pe='none', **model_kwargs)
    p = probe.patch_embed.patch_size[0]
    naflex = {k: v.to(device) for k, v in vispe.naflex_batch(images, p, max_tokens=budget).items()}
    naflex['patches'] = naflex['patches'].to(dtype)
    padded = padded_batch(images, p, budget).to(device=device, dtype=dtype)
    real = int(naflex['patch_valid'].sum())
    tokens = dict(real=real, naflex=naflex['patches'].shape[0] * naflex['patches'].shape[1],
                  padded=padded.shape[0] * (padded.shape[-2] // p) * (padded.shape[-1] // p))
    out = {}
    for spec in pes:
        torch.manual_seed(0)
        model = timm.create_model(model_name, pe=spec, **model_kwargs).to(device=device, dtype=dtype)
        t = compare({'naflex': eval_step(model, naflex), 'padded': eval_step(model, padded)}, rounds=rounds,
                    device=device, clock=clock)
        out[spec] = dict(naflex_ms=1e3 * t['naflex'], padded_ms=1e3 * t['padded'], naflex_tps=real / t['naflex'],
                         padded_tps=real / t['padded'], ratio=t['padded'] / t['naflex'])
    return out, tokens


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--model', default='vit_base', help='a vispe / timm ViT name that takes pe=')
    ap.add_argument('--pes', default=','.join(FAMILIES), help='comma-separated encodings')
    ap.add_argument('--batch', type=int, default=8)
    ap.add_argument('--budget', type=int, default=256, help='tokens per image (NaFlex max_tokens)')
    ap.add_argument('--long-side', type=int, default=512, help='longer side of the source images (pixels)')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--device', default='cpu')
    ap.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    ap.add_argument('--threads', type=int, default=None, help='torch.set_num_threads (CPU)')
    ap.add_argument('--clock', default='wall', choices=['wall', 'process'])
    ap.add_argument('--smoke', action='store_true', help='a tiny model, one round (a check that it runs)')
    ap.add_argument('--json', default=None, metavar='PATH',
                    help='also write the results with date, hardware and versions (benchmarks/make_figures.py)')
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pes = [p.strip() for p in args.pes.split(',') if p.strip()]
    if args.smoke:
        model_name, model_kwargs = 'vit_tiny', dict(SMOKE, num_classes=10)
        pes = [p for p in pes if p in ('none', 'rope_mixed', 'peg')] or ['none']
        batch, budget, long_side, rounds = 3, 12, 40, 1
    else:
        model_name, model_kwargs = args.model, dict(num_classes=1000)
        batch, budget, long_side, rounds = args.batch, args.budget, args.long_side, args.rounds
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    results, tokens = bench(model_name, pes, batch, budget, long_side, rounds, device, dtype, args.clock, model_kwargs)

    print(f'{model_name}, {batch} images (aspect h:w {", ".join(f"{h}:{w}" for h, w in ASPECTS[:batch])}), budget '
          f'{budget} tokens, {args.device} {args.dtype}, {torch.get_num_threads()} thread(s), {args.clock} clock')
    print(f'real patch tokens {tokens["real"]}; NaFlex sequence {tokens["naflex"]} tokens; padded tensor '
          f'{tokens["padded"]} tokens ({tokens["padded"] / tokens["real"]:.2f}x the real ones)')
    print()
    print('| encoding | NaFlex ms | padded ms | NaFlex real tok/s | padded real tok/s | NaFlex / padded |')
    print('|---|---:|---:|---:|---:|---:|')
    for spec, r in results.items():
        print(f'| `{spec}` | {r["naflex_ms"]:.1f} | {r["padded_ms"]:.1f} | {r["naflex_tps"]:.0f} | '
              f'{r["padded_tps"]:.0f} | {r["ratio"]:.2f}x |')

    if args.json:
        params = dict(model=model_name, batch=batch, budget=budget, long_side=long_side, rounds=rounds,
                      dtype=args.dtype, clock=args.clock, aspects=[list(a) for a in ASPECTS[:batch]], tokens=tokens)
        write_results(args.json, 'naflex_throughput',
                      'python benchmarks/naflex_throughput.py ' + ' '.join(argv or sys.argv[1:]), params, results, device)


if __name__ == '__main__':
    main()
