"""Cost of `vispe.integrations.patch_vision` on a transformers vision encoder, as ratios in one process.

Two comparisons, each in eval (forward, no grad) and train (forward + backward) mode, interleaved rounds:

* **own encoding**: the model patched with ``pe=None`` (its own encoding, computed by vispe) against an
  identical unpatched instance (goal: within 3 %);
* **each encoding** (``--pes``) against the same model patched with ``pe='none'`` (the NoPE baseline).

On the CPU the process clock and one thread are used (``--threads``): on a shared machine wall time
mostly measures the other jobs. On a GPU (``--device cuda``) wall time with synchronisation.

    python benchmarks/transformers_vision.py                            # ViT, 224 px, batch 8
    python benchmarks/transformers_vision.py --family siglip --pes rope_mixed liere
    python benchmarks/transformers_vision.py --family qwen2_5_vl --preset vit-l --depth 8
    python benchmarks/transformers_vision.py --device cuda --batch 64 --dtype bfloat16

The Qwen-VL towers (``--family qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``) take the batch as ``batch`` images of
``img`` pixels along one sequence (``grid_thw``); ``--preset vit-l`` gives them (and the others) the width of
Qwen2-VL's ViT-L-size tower (1280 wide, 16 heads, patch 14).
"""
from __future__ import annotations

import argparse
import importlib
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
    'qwen2_vl': ('Qwen2VLVisionConfig', 'qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel'),
    'qwen2_5_vl': ('Qwen2_5_VLVisionConfig', 'qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel'),
    'qwen3_vl': ('Qwen3VLVisionConfig', 'qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel'),
}
PRESETS = {'small': dict(width=384, patch=16), 'vit-l': dict(width=1280, patch=14)}
PES = ['learned', 'rope_axial', 'rope_mixed', 'liere', 'comrope_ld', 'irpe', 'peg']


def _qwen_config(family: str, args: argparse.Namespace) -> transformers.PretrainedConfig:
    side = args.img // args.patch
    shared = dict(depth=args.depth, num_heads=args.width // 64, patch_size=args.patch, attn_implementation='sdpa')
    if family == 'qwen2_vl':
        return transformers.Qwen2VLVisionConfig(embed_dim=args.width, hidden_size=args.width, mlp_ratio=4, **shared)
    sizes = dict(hidden_size=args.width, intermediate_size=4 * args.width, out_hidden_size=args.width)
    if family == 'qwen2_5_vl':  # its windows of 112 pixels; every fourth block global, the last among them
        full = list(range(args.depth - 1, -1, -4))[::-1]
        return transformers.Qwen2_5_VLVisionConfig(fullatt_block_indexes=full, **sizes, **shared)
    return transformers.Qwen3VLVisionConfig(num_position_embeddings=side * side, deepstack_visual_indexes=[0],
                                            **sizes, **shared)


def build(family: str, args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    if family.startswith('qwen'):
        module, name = MODELS[family][1].rsplit('.', 1)
        model = getattr(importlib.import_module(f'transformers.models.{module}'), name)(_qwen_config(family, args))
        return model.to(device=args.device, dtype=getattr(torch, args.dtype))
    config_cls, model_cls = (getattr(transformers, n) for n in MODELS[family])
    config = config_cls(hidden_size=args.width, num_hidden_layers=args.depth, num_attention_heads=args.width // 64,
                        intermediate_size=4 * args.width, image_size=args.img, patch_size=args.patch,
                        attn_implementation='sdpa')
    return model_cls(config).to(device=args.device, dtype=getattr(torch, args.dtype))


def inputs(family: str, args: argparse.Namespace, device: torch.device) -> Dict[str, torch.Tensor]:
    """One forward's inputs: a batch of images, or for a Qwen-VL tower the same images along one sequence."""
    dtype = getattr(torch, args.dtype)
    if family.startswith('qwen'):
        side = args.img // args.patch
        patches = torch.randn(args.batch * side * side, 3 * 2 * args.patch ** 2, device=device, dtype=dtype)
        return dict(hidden_states=patches, grid_thw=torch.tensor([[1, side, side]] * args.batch, device=device))
    return dict(pixel_values=torch.randn(args.batch, 3, args.img, args.img, device=device, dtype=dtype))


def step(model: torch.nn.Module, x: Dict[str, torch.Tensor], train: bool) -> Callable[[], None]:
    model.train(train)

    def run() -> None:
        if train:
            model.zero_grad(set_to_none=True)
            model(**x).last_hidden_state.float().square().mean().backward()
        else:
            with torch.no_grad():
                model(**x)
    return run


def main(argv: List[str] = None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--family', default='vit', choices=tuple(MODELS))
    p.add_argument('--pes', nargs='*', default=PES, help='encodings timed against pe=none')
    p.add_argument('--preset', default='small', choices=tuple(PRESETS),
                   help='width and patch: small (384, 16) or vit-l (1280, 14: Qwen2-VL\'s tower); --width / --patch '
                        'override')
    p.add_argument('--width', type=int, default=None)
    p.add_argument('--depth', type=int, default=4)
    p.add_argument('--img', type=int, default=224)
    p.add_argument('--patch', type=int, default=None)
    p.add_argument('--batch', type=int, default=8)
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--threads', type=int, default=1)
    p.add_argument('--device', default='cpu')
    p.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
    a = p.parse_args(argv)
    for name, value in PRESETS[a.preset].items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    clock = 'process' if device.type == 'cpu' else 'wall'
    x = inputs(a.family, a, device)
    models = {'unpatched': build(a.family, a)}
    models['own (pe=None)'] = build(a.family, a)
    own = patch_vision(models['own (pe=None)']).encoding.name
    for pe in ['none'] + list(a.pes):
        models[pe] = build(a.family, a)
        patch_vision(models[pe], pe)
    results: Dict[str, float] = {}
    tokens = (a.img // a.patch) ** 2
    print(f'{MODELS[a.family][1].rsplit(".", 1)[-1]}: width {a.width}, {a.depth} layers, {tokens} patches, batch {a.batch}, '
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
