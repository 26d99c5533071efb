"""Cost of `vispe.integrations.patch_vision` on a transformers vision encoder, as ratios in one process.

Two comparisons, each in eval (forward, no grad) and train (forward + backward) mode, interleaved rounds:

* **own encoding**: the model patched with ``pe=None`` (its own encoding, computed by vispe) against an
  identical unpatched instance (goal: within 3 %);
* **each encoding** (``--pes``) against the same model patched with ``pe='none'`` (the NoPE baseline).

On the CPU the process clock and one thread are used (``--threads``): on a shared machine wall time
mostly measures the other jobs. On a GPU (``--device cuda``) wall time with synchronisation.

    python benchmarks/transformers_vision.py                            # ViT, 224 px, batch 8
    python benchmarks/transformers_vision.py --family siglip --pes rope_mixed liere
    python benchmarks/transformers_vision.py --device cuda --batch 64 --dtype bfloat16
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
import transformers  # noqa: E402

from vispe.integrations import patch_vision  # noqa: E402
from _timing import compare  # noqa: E402

MODELS = {  # --family -> (config class, model class)
    'vit': ('ViTConfig', 'ViTModel'),
    'dinov2': ('Dinov2Config', 'Dinov2Model'),
    'siglip': ('SiglipVisionConfig', 'SiglipVisionModel'),
    'clip': ('CLIPVisionConfig', 'CLIPVisionModel'),
    'dinov3': ('DINOv3ViTConfig', 'DINOv3ViTModel'),
}
PES = ['learned', 'rope_axial', 'rope_mixed', 'liere', 'comrope_ld', 'irpe', 'peg']


def build(family: str, args: argparse.Namespace) -> torch.nn.Module:
    config_cls, model_cls = (getattr(transformers, n) for n in MODELS[family])
    torch.manual_seed(0)
    config = config_cls(hidden_size=args.width, num_hidden_layers=args.depth, num_attention_heads=args.width // 64,
                        intermediate_size=4 * args.width, image_size=args.img, patch_size=args.patch,
                        attn_implementation='sdpa')
    return model_cls(config).to(device=args.device, dtype=getattr(torch, args.dtype))


def step(model: torch.nn.Module, x: torch.Tensor, train: bool) -> Callable[[], None]:
    model.train(train)

    def run() -> None:
        if train:
            model.zero_grad(set_to_none=True)
            model(pixel_values=x).last_hidden_state.float().square().mean().backward()
        else:
            with torch.no_grad():
                model(pixel_values=x)
    return run


def main(argv: List[str] = None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--family', default='vit', choices=tuple(MODELS))
    p.add_argument('--pes', nargs='*', default=PES, help='encodings timed against pe=none')
    p.add_argument('--width', type=int, default=384)
    p.add_argument('--depth', type=int, default=4)
    p.add_argument('--img', type=int, default=224)
    p.add_argument('--patch', type=int, default=16)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--device', default='cpu')
    p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    clock = 'process' if device.type == 'cpu' else 'wall'
    x = torch.randn(a.batch, 3, a.img, a.img, device=device, dtype=getattr(torch, a.dtype))
    models = {'unpatched': build(a.family, a)}
    models['own (pe=None)'] = build(a.family, a)
    own = patch_vision(models['own (pe=None)']).encoding.name
    for pe in ['none'] + list(a.pes):
        models[pe] = build(a.family, a)
        patch_vision(models[pe], pe)
    results: Dict[str, float] = {}
    tokens = (a.img // a.patch) ** 2
    print(f'{MODELS[a.family][1]}: width {a.width}, {a.depth} layers, {tokens} patches, batch {a.batch}, '
          f'{a.dtype}, {a.device}, {clock} clock' + (f', {a.threads} thread(s)' if clock == 'process' else '')
          + f'; own encoding: {own}')
    for mode in ('eval', 'train'):
        fns = {name: step(m, x, mode == 'train') for name, m in models.items()}
        times = compare(fns, rounds=a.rounds, per_round=1, warmup=1, device=device, clock=clock)
        print(f'{mode}:')
        print(f'  {"patched with its own encoding":32s} {1e3 * times["own (pe=None)"]:9.2f} ms   '
              f'x {times["own (pe=None)"] / times["unpatched"]:.3f} unpatched ({1e3 * times["unpatched"]:.2f} ms)')
        results[f'{mode} own / unpatched'] = times['own (pe=None)'] / times['unpatched']
        for pe in a.pes:
            ratio = times[pe] / times['none']
            results[f'{mode} {pe} / none'] = ratio
            print(f'  {pe:32s} {1e3 * times[pe]:9.2f} ms   x {ratio:.3f} pe=none ({1e3 * times["none"]:.2f} ms)')
    return results


if __name__ == '__main__':
    main()
