"""Cost of per-sample positions in padded DETR batches, as ratios measured in one process.

Two measurements, interleaved rounds (`benchmarks._timing.compare`), eval mode, no grad:

* **vispe DETR encoder** (`vispe_models.detr.DETR.encode`) on a padded batch of images of different
  sizes: each image at its own grid's positions (``encode``: pack into the NaFlex layout, run, unpack)
  against the shared canvas grid every image saw before (``_encode`` with the canvas positions and the
  same padding mask), per encoding;
* **transformers DETR** (``DetrForObjectDetection`` from a config: a small ResNet, DETR's transformer
  sizes) patched with `vispe.integrations.patch_detr` against an identical unpatched instance, on
  the same padded batch; with ``detr_sine`` (the model's own encoding) the outputs are checked equal
  first.

    python benchmarks/detr_padding.py                       # DETR sizes: width 256, 6 + 6 layers
    python benchmarks/detr_padding.py --smoke               # tiny, one round (a check that it runs)
    python benchmarks/detr_padding.py --pes detr_sine rope_mixed irpe peg --json results.json
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
import vispe  # noqa: E402
from _results import write_results  # noqa: E402
from _timing import compare  # noqa: E402
from vispe.integrations import patch_detr  # noqa: E402
from vispe_models.detr import DETR  # noqa: E402

# feature-map extents (stride 32) of a batch of differently sized images: 800 x 1216, 640 x 960, 800 x 608,
# 480 x 1216 in a 25 x 38 canvas
EXTENTS = ((25, 38), (20, 30), (25, 19), (15, 38))


def padded_canvas(extents: Sequence[Tuple[int, int]]) -> Tuple[Tuple[int, int], torch.Tensor]:
    """The canvas ``(H, W)`` and its ``(B, H, W)`` mask, True on real tokens (transformers' convention)."""
    H, W = max(h for h, _ in extents), max(w for _, w in extents)
    real = torch.zeros(len(extents), H, W, dtype=torch.bool)
    for b, (h, w) in enumerate(extents):
        real[b, :h, :w] = True
    return (H, W), real


def vispe_encoder(pes: List[str], extents, dim: int, layers: int, heads: int, rounds: int, clock: str
                  ) -> Dict[str, float]:
    (H, W), real = padded_canvas(extents)
    torch.manual_seed(0)
    src = torch.randn(len(extents), H * W, dim)
    pos = vispe.grid(H, W, train_grid=(H, W)).replace(key_padding_mask=~real.flatten(1))
    fns = {}
    for pe in pes:
        model = DETR(num_classes=91, backbone='resnet18', pe=pe, hidden_dim=dim, num_heads=heads, enc_layers=layers,
                     dec_layers=1, dim_feedforward=4 * dim, grid_size=(H, W)).eval()

        def own(model=model):
            with torch.no_grad():
                return model.encode(src, pos)

        def shared(model=model):
            with torch.no_grad():
                return model._encode(src, pos)
        fns[f'{pe} per-sample'], fns[f'{pe} shared'] = own, shared
    times = compare(fns, rounds=rounds, per_round=2, warmup=1, clock=clock)
    print(f'vispe DETR encoder, {len(extents)} images in a {H} x {W} canvas ({int(real.sum())} real of '
          f'{real.numel()} tokens), width {dim}, {layers} layers, {heads} heads, {clock} clock')
    print('| encoding | per-sample ms | shared grid ms | per-sample / shared |')
    print('|---|---:|---:|---:|')
    out = {}
    for pe in pes:
        a, b = times[f'{pe} per-sample'], times[f'{pe} shared']
        out[pe] = a / b
        print(f'| `{pe}` | {1e3 * a:.2f} | {1e3 * b:.2f} | {a / b:.3f} |')
    return out


def hf_detr(pes: List[str], extents, dim: int, layers: int, heads: int, rounds: int, clock: str) -> Dict[str, float]:
    import transformers
    (H, W), real = padded_canvas(extents)
    pixel_mask = torch.nn.functional.interpolate(real[None].float(), scale_factor=32)[0].long()
    images = torch.randn(len(extents), 3, H * 32, W * 32, generator=torch.Generator().manual_seed(0))

    def build():
        torch.manual_seed(0)
        backbone = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 32, 64], depths=[1, 1, 1, 1],
                                             out_features=['stage4'])
        return transformers.DetrForObjectDetection(transformers.DetrConfig(
            use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=dim,
            encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=heads, decoder_attention_heads=heads,
            encoder_ffn_dim=4 * dim, decoder_ffn_dim=4 * dim, num_queries=100, num_labels=91)).eval()

    def forward(model):
        def run():
            with torch.no_grad():
                return model(pixel_values=images, pixel_mask=pixel_mask)
        return run
    unpatched = build()
    fns = {'unpatched': forward(unpatched)}
    for pe in pes:
        model = build()
        patch_detr(model, pe)
        if pe == 'detr_sine':
            a, b = fns['unpatched'](), forward(model)()
            diff = max((a.logits - b.logits).abs().max().item(), (a.pred_boxes - b.pred_boxes).abs().max().item())
            if diff > 1e-5:
                raise RuntimeError(f'patched detr_sine differs from the unpatched model by {diff:.2e}')
        fns[f'patched {pe}'] = forward(model)
    times = compare(fns, rounds=rounds, per_round=1, warmup=1, clock=clock)
    print(f'transformers DetrForObjectDetection forward, images {H * 32} x {W * 32} canvas, width {dim}, '
          f'{layers} + {layers} layers, {clock} clock')
    print('| model | ms | vs unpatched |')
    print('|---|---:|---:|')
    out = {}
    for name, t in times.items():
        out[name] = t / times['unpatched']
        print(f'| {name} | {1e3 * t:.1f} | {t / times["unpatched"]:.3f} |')
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--pes', nargs='+', default=['detr_sine', 'learned', 'rope_mixed', 'irpe', 'peg'])
    ap.add_argument('--hf-pes', nargs='+', default=['detr_sine', 'rope_mixed'],
                    help='encodings for the transformers DETR measurement')
    ap.add_argument('--dim', type=int, default=256)
    ap.add_argument('--layers', type=int, default=6)
    ap.add_argument('--heads', type=int, default=8)
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--threads', type=int, default=None, help='torch.set_num_threads')
    ap.add_argument('--clock', default='wall', choices=['wall', 'process'])
    ap.add_argument('--smoke', action='store_true', help='tiny sizes, one round (a check that it runs)')
    ap.add_argument('--json', default=None, metavar='PATH',
                    help='also write the results with date, hardware and versions')
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    extents = EXTENTS
    if args.smoke:
        args.dim, args.layers, args.heads, args.rounds = 32, 1, 4, 1
        extents = ((4, 6), (3, 4))
    results = {'encoder per-sample / shared': vispe_encoder(args.pes, extents, args.dim, args.layers, args.heads,
                                                            args.rounds, args.clock)}
    print()
    results['transformers patched / unpatched'] = hf_detr(args.hf_pes, extents, args.dim, args.layers, args.heads,
                                                          args.rounds, args.clock)
    if args.json:
        params = dict(extents=[list(e) for e in extents], dim=args.dim, layers=args.layers, heads=args.heads,
                      rounds=args.rounds, clock=args.clock, threads=torch.get_num_threads())
        write_results(args.json, 'detr_padding', 'python benchmarks/detr_padding.py ' + ' '.join(argv or sys.argv[1:]),
                      params, results)
    return results


if __name__ == '__main__':
    main()
