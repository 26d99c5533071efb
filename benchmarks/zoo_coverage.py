"""The zoo tables of docs/zoo.md: which timm ViT entrypoints build with which vispe encoding, and the
weights-parity list (timm model -> max |logit difference| of vispe's model with the model's own
encoding, loaded from the same timm state dict through ``pretrained=True``).

Coverage builds every entrypoint of ``timm.models.{vision_transformer, deit, eva}`` with every
registered encoding on the meta device (one block by default: a block's layout does not depend on the
depth; ``--full-depth`` builds every block). Parity uses random-init tiny versions (``PARITY``: two
blocks, width 64) whose attention is sharpened (`sharpen`) so that positions move the logits.

    python benchmarks/zoo_coverage.py [--full-depth] [--skip-coverage] [--skip-parity]
"""
from __future__ import annotations

import argparse
import collections
import copy
import math
import os
import re
import sys
import tempfile
from typing import Dict, List, Tuple

import timm
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))
import vispe  # noqa: E402
from vispe.zoo import ZOO_MODULES  # noqa: E402

TINY = dict(depth=2, embed_dim=64, num_heads=2)
PARITY: Dict[str, dict] = {
    # vision_transformer / deit: learned table
    'vit_tiny_patch16_224': TINY,
    'vit_small_patch32_224': TINY,
    'vit_small_patch8_224': dict(TINY, img_size=64),
    'vit_base_patch16_384': TINY,
    'vit_base_patch16_clip_224': TINY,  # CLIP: pre-norm, no patch bias
    'vit_base_patch32_clip_quickgelu_224': TINY,
    'vit_base_patch16_plus_clip_240': TINY,
    'vit_small_patch14_dinov2': TINY,  # 37x37 grid, layer scale
    'vit_small_patch14_reg4_dinov2': TINY,  # registers
    'vit_base_patch16_siglip_224': TINY,  # SigLIP MAP head, no class token
    'vit_base_patch16_siglip_gap_256': TINY,  # SigLIP(2) GAP
    'vit_so400m_patch14_siglip_224': TINY,
    'vit_medium_patch16_gap_256': TINY,
    'vit_medium_patch16_reg4_gap_256': TINY,  # no_embed_class + registers
    'vit_betwixt_patch16_reg1_gap_256': TINY,
    'vit_base_patch16_rpn_224': TINY,  # ResPostBlock
    'vit_small_patch16_18x2_224': TINY,  # ParallelThingsBlock
    'vit_base_patch16_xp_224': TINY,  # ParallelScalingBlock, qk-norm, RmsNorm
    'eva_large_patch14_196': TINY,
    'deit3_small_patch16_224': TINY,  # no_embed_class, layer scale
    'deit_tiny_distilled_patch16_224': TINY,  # distillation token, two heads
    'deit_base_distilled_patch16_384': TINY,
    'vit_dwee_patch16_reg1_gap_256': TINY,  # differential attention (DiffAttention)
    'vit_dlittle_patch16_reg1_gap_256': TINY,
    'vit_dpwee_patch16_reg1_gap_256': TINY,  # DiffParallelScalingBlock
    # eva: rope, and learned + rope
    'eva02_tiny_patch14_224': TINY,  # EVA-02: ref_feat_shape rescale, SwiGLU, q/v bias
    'eva02_small_patch14_336': TINY,
    'eva02_base_patch16_clip_224': TINY,
    'eva_giant_patch14_224': TINY,  # EVA-1: learned only
    'vit_medium_patch16_rope_reg1_gap_256': TINY,  # timm SBB rope
    'vit_betwixt_patch16_rope_reg4_gap_256': TINY,
    'vit_pe_core_tiny_patch16_384': TINY,  # Perception Encoder
    'vit_pe_spatial_tiny_patch16_512': TINY,
    'vit_small_patch16_rope_224': TINY,  # RoPE-ViT axial
    'vit_small_patch16_rope_mixed_224': TINY,  # RoPE-Mixed: learned frequencies adopted
    'vit_small_patch16_rope_ape_224': TINY,
    'vit_small_patch16_rope_mixed_ape_224': TINY,
    'vit_small_patch16_dinov3': TINY,  # DINOv3: centred coordinates, half layout
    'vit_small_patch16_dinov3_qkvb': TINY,
    'vit_base_patch16_sapiens2': dict(TINY, num_kv_heads=1, img_size=256),  # grouped-query attention
}

# the families of docs/zoo.md: the first pattern a name matches
FAMILIES: List[Tuple[str, str]] = [
    ('DINOv2', r'dinov2'), ('DINOv3', r'dinov3'), ('SigLIP / SigLIP2', r'siglip'), ('CLIP / MetaCLIP / DFN', r'clip'),
    ('EVA-02', r'^eva02'), ('EVA', r'^eva'), ('Perception Encoder', r'_pe_'),
    ('RoPE-ViT (Naver)', r'_rope(_mixed)?(_ape)?_224'),
    ('timm SBB rope', r'_rope_reg'), ('Sapiens2', r'sapiens2'), ('LingBot / EUPE', r'lingbot|eupe'),
    ('DeiT / DeiT3', r'^deit'), ('ViT, other', r'.'),
]


def family(name: str) -> str:
    return next(f for f, pattern in FAMILIES if re.search(pattern, name))


def sharpen(model: nn.Module) -> None:
    """Attention weights, layer scales and the classifier at unit scale, so that attention is peaked
    and positions move the logits (timm's 0.02 init leaves attention nearly uniform, layer scales
    start at 1e-5 and Eva scales its head by 1e-3)."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and (name.endswith(('qkv.weight', 'q_proj.weight', 'k_proj.weight', 'in_proj.weight'))
                                 or name == 'head.weight'):
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
            elif name.endswith(('gamma', 'gamma_1', 'gamma_2')):
                p.fill_(1.0)


def parity(name: str, path: str) -> Tuple[float, float, object]:
    """(max |logit diff| of vispe's model with the model's own encoding, that of the same weights
    without any encoding, the load report): timm's tiny model saved to ``path`` and loaded through
    the wrapped entrypoint with ``pretrained=True``."""
    torch.manual_seed(0)
    ref = timm.create_model(name, **PARITY[name]).eval()
    sharpen(ref)
    torch.save(ref.state_dict(), path)
    model = timm.create_model(name, pe=vispe.timm_pe_spec(ref), pretrained=True,
                              pretrained_cfg_overlay=dict(file=path), **PARITY[name]).eval()
    blind = vispe.convert(copy.deepcopy(ref), 'none')
    x = torch.randn(2, 3, *ref.patch_embed.img_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref(x)
        return (model(x) - want).abs().max().item(), (blind(x) - want).abs().max().item(), model.pretrained_report


def build(name: str, pe, full: bool = False) -> nn.Module:
    """The entrypoint with ``pe`` on the meta device; one block unless ``full`` (sapiens2 lists its kv
    heads per block: there one kv head serves the one block)."""
    if full:
        return timm.create_model(name, pe=pe, device='meta')
    try:
        return timm.create_model(name, pe=pe, device='meta', depth=1)
    except AssertionError:
        return timm.create_model(name, pe=pe, device='meta', depth=1, num_kv_heads=1)


def _reason(error: str) -> str:
    for key, short in (("'cameras'", 'needs cameras'),
                       ('differential attention', 'acts on v, the output or the weights, or widens the head: '
                                                  'differential attention')):
        if key in error:
            return short
    return error.split('cannot apply to this model: ')[-1][:90]


def _only(models: set, built: int) -> str:
    """The models a refusal concerns, where it is not all those of the family that build."""
    return '' if len(models) == built else ': ' + ', '.join(f'`{m}`' for m in sorted(models))


def coverage(full: bool) -> None:
    encodings = vispe.list_pes()
    rows: Dict[str, Dict[str, object]] = collections.OrderedDict()
    for module in ZOO_MODULES:
        for name in timm.list_models(module=module):
            fam = rows.setdefault(family(name), dict(n=0, all=0, models={}, encodings=collections.defaultdict(set),
                                                     refusers=collections.defaultdict(set)))
            fam['n'] += 1
            refused = {}
            for pe in encodings:
                try:
                    build(name, pe, full)
                except ValueError as e:
                    refused[pe] = _reason(str(e))
            if len(refused) == len(encodings):
                fam['models'][name] = next(iter(refused.values()))
            else:
                fam['all'] += 1
                for pe, why in refused.items():
                    fam['encodings'][why].add(pe)
                    fam['refusers'][why].add(name)
    print(f'| family | entrypoints | build with every applicable encoding ({len(encodings)} registered) | '
          f'refused models (why) | refused encodings (why) |')
    print('| --- | --- | --- | --- | --- |')
    for fam, row in sorted(rows.items(), key=lambda kv: -kv[1]['n']):
        models = ', '.join(f'`{m}` ({why})' for m, why in row['models'].items()) or '-'
        refused = '; '.join(f'{", ".join(sorted(pes))} ({why}{_only(row["refusers"][why], row["all"])})'
                            for why, pes in row['encodings'].items()) or '-'
        print(f'| {fam} | {row["n"]} | {row["all"]} | {models} | {refused} |')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--full-depth', action='store_true', help='build every block (slow)')
    parser.add_argument('--skip-coverage', action='store_true')
    parser.add_argument('--skip-parity', action='store_true')
    args = parser.parse_args()
    if not args.skip_coverage:
        coverage(args.full_depth)
    if not args.skip_parity:
        print('\n| model | own encoding | max logit diff | without encoding |')
        print('| --- | --- | --- | --- |')
        with tempfile.TemporaryDirectory() as tmp:
            for name in PARITY:
                diff, blind, _ = parity(name, os.path.join(tmp, 'timm.pth'))
                spec = vispe.timm_pe_spec(timm.create_model(name, device='meta'))
                own = spec if isinstance(spec, str) else '+'.join(
                    s if isinstance(s, str) else f"rope_timm:{s['rope_type']}" for s in
                    (spec if isinstance(spec, list) else [spec]))
                print(f'| `{name}` | {own} | {diff:.1e} | {blind:.1e} |')


if __name__ == '__main__':
    main()
