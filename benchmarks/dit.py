"""Diffusion transformers patched with their own encoding against the unpatched transformer: forward ratios.

For each diffusers host (FLUX, SD3, QwenImage, Wan, HunyuanVideo, LTX-Video) one transformer of
``--layers`` blocks, ``--heads`` heads of 64 channels, on a ``--grid`` token grid (video: 4 latent frames)
with 32 text tokens, eval mode, no grad, timed in interleaved rounds (`benchmarks._timing.compare`):
unpatched, ``patch_dit(t)`` (the host's own encoding computed by vispe), ``patch_dit(t, scaling='yarn')``
at twice the training grid (tables rebuilt every forward), and a vispe encoding (``rope_axial``, through
vispe's processors). ``--compile`` adds ``torch.compile(fullgraph=True)`` of the unpatched and the patched
transformer (one graph each: a graph break fails). Ratios are against the unpatched transformer of the
same run.

    python benchmarks/dit.py                       # 2 layers, 4 heads, 32 x 32 tokens
    python benchmarks/dit.py --quick               # 16 x 16 tokens, fewer rounds
    python benchmarks/dit.py --hosts flux --compile --device cuda
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._timing import compare, compile_models  # noqa: E402
from vispe.integrations import patch_dit  # noqa: E402

TEXT = 32


def build(host: str, layers: int, heads: int, head_dim: int = 64) -> torch.nn.Module:
    """A random ``host`` transformer of ``heads x head_dim`` attention; the rope axes split the head dim as
    the released models do (FLUX and QwenImage 16 / 56 / 56 of 128, HunyuanVideo's time axis 16)."""
    import diffusers
    dim = head_dim * heads
    flux_axes = (head_dim // 8, 7 * head_dim // 16, 7 * head_dim // 16)
    if host == 'flux':
        return diffusers.FluxTransformer2DModel(in_channels=64, num_layers=layers // 2 or 1,
                                                num_single_layers=layers - layers // 2, attention_head_dim=head_dim,
                                                num_attention_heads=heads, joint_attention_dim=dim,
                                                pooled_projection_dim=dim, axes_dims_rope=flux_axes)
    if host == 'sd3':
        return diffusers.SD3Transformer2DModel(sample_size=64, patch_size=2, in_channels=16, num_layers=layers,
                                               attention_head_dim=head_dim, num_attention_heads=heads,
                                               joint_attention_dim=dim, caption_projection_dim=dim,
                                               pooled_projection_dim=dim, out_channels=16, pos_embed_max_size=96)
    if host == 'qwenimage':
        return diffusers.QwenImageTransformer2DModel(in_channels=64, out_channels=16, num_layers=layers,
                                                     attention_head_dim=head_dim, num_attention_heads=heads,
                                                     joint_attention_dim=dim, axes_dims_rope=flux_axes)
    if host == 'hunyuan_video':
        return diffusers.HunyuanVideoTransformer3DModel(in_channels=16, out_channels=16, num_attention_heads=heads,
                                                        attention_head_dim=head_dim, num_layers=layers // 2 or 1,
                                                        num_single_layers=layers - layers // 2, num_refiner_layers=1,
                                                        text_embed_dim=dim, pooled_projection_dim=dim,
                                                        rope_axes_dim=(16, (head_dim - 16) // 2, (head_dim - 16) // 2))
    if host == 'ltx_video':
        return diffusers.LTXVideoTransformer3DModel(in_channels=64, out_channels=64, num_attention_heads=heads,
                                                    attention_head_dim=head_dim, cross_attention_dim=dim, num_layers=layers,
                                                    caption_channels=dim)
    return diffusers.WanTransformer3DModel(num_attention_heads=heads, attention_head_dim=head_dim, in_channels=16,
                                           out_channels=16, text_dim=dim, freq_dim=64, ffn_dim=4 * dim,
                                           num_layers=layers)


def inputs(host: str, model: torch.nn.Module, grid: int, device: torch.device,
           dtype: torch.dtype = torch.float32) -> Dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    cfg = model.config

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)
    width = {'wan': 'text_dim', 'hunyuan_video': 'text_embed_dim', 'ltx_video': 'caption_channels'}
    text = rand(1, TEXT, getattr(cfg, width.get(host, 'joint_attention_dim')))
    if host == 'flux':
        ids = torch.zeros(grid, grid, 3)
        ids[..., 1], ids[..., 2] = torch.arange(grid)[:, None], torch.arange(grid)[None]
        return dict(hidden_states=rand(1, grid * grid, 64), encoder_hidden_states=text,
                    pooled_projections=rand(1, cfg.pooled_projection_dim), timestep=torch.tensor([0.5], device=device),
                    img_ids=ids.reshape(-1, 3).to(device), txt_ids=torch.zeros(TEXT, 3, device=device))
    if host == 'sd3':
        return dict(hidden_states=rand(1, 16, 2 * grid, 2 * grid), encoder_hidden_states=text,
                    pooled_projections=rand(1, cfg.pooled_projection_dim),
                    timestep=torch.tensor([500.0], device=device))
    if host == 'qwenimage':
        return dict(hidden_states=rand(1, grid * grid, 64), encoder_hidden_states=text,
                    encoder_hidden_states_mask=torch.ones(1, TEXT, dtype=torch.bool, device=device),
                    timestep=torch.tensor([0.5], device=device), img_shapes=[[(1, grid, grid)]])
    if host == 'hunyuan_video':
        return dict(hidden_states=rand(1, 16, 4, 2 * grid, 2 * grid), timestep=torch.tensor([500.0], device=device),
                    encoder_hidden_states=text, encoder_attention_mask=torch.ones(1, TEXT, device=device),
                    pooled_projections=rand(1, cfg.pooled_projection_dim), guidance=torch.tensor([3.0], device=device))
    if host == 'ltx_video':
        return dict(hidden_states=rand(1, 4 * grid * grid, 64), encoder_hidden_states=text,
                    timestep=torch.tensor([500.0], device=device),
                    encoder_attention_mask=torch.ones(1, TEXT, device=device),
                    num_frames=4, height=grid, width=grid, rope_interpolation_scale=(8 / 25, 32, 32))
    return dict(hidden_states=rand(1, 16, 4, 2 * grid, 2 * grid), timestep=torch.tensor([500.0], device=device),
                encoder_hidden_states=text)


def runner(model: torch.nn.Module, kw: Dict[str, Any]) -> Callable[[], Any]:
    def run():
        with torch.no_grad():
            return model(**kw).sample
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--hosts', nargs='+', default=['flux', 'sd3', 'qwenimage', 'wan', 'hunyuan_video', 'ltx_video'])
    parser.add_argument('--layers', type=int, default=2)
    parser.add_argument('--heads', type=int, default=4)
    parser.add_argument('--head-dim', type=int, default=64, help='128: the released FLUX / Wan / HunyuanVideo heads')
    parser.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32')
    parser.add_argument('--grid', type=int, default=32, help='token grid side')
    parser.add_argument('--rounds', type=int, default=7)
    parser.add_argument('--quick', action='store_true', help='16 x 16 tokens, 5 rounds')
    parser.add_argument('--compile', action='store_true', help='also torch.compile(fullgraph=True)')
    parser.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    parser.add_argument('--clock', choices=('wall', 'process'), default=None,
                        help='process: CPU time of this process, single-threaded (default on the CPU, where other '
                             'jobs share the machine); wall: elapsed time (default on CUDA)')
    args = parser.parse_args()
    if args.quick:
        args.grid, args.rounds = 16, 5
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    clock = args.clock or ('wall' if device.type == 'cuda' else 'process')
    if clock == 'process':
        torch.set_num_threads(1)
    print(f'diffusion transformers, {args.layers} layers, {args.heads} x {args.head_dim} heads, {args.dtype}, {args.grid} x {args.grid} tokens '
          f'+ {TEXT} text, batch 1, {device}, {clock} clock, torch {torch.__version__}')
    print(f'{"host":14s} {"variant":28s} {"ms":>9s} {"vs unpatched":>13s}')
    for host in args.hosts:
        torch.manual_seed(0)
        models = {'unpatched': build(host, args.layers, args.heads, args.head_dim).to(device=device, dtype=dtype).eval()}
        half = args.grid // 2
        train = (4, half, half) if host in ('wan', 'hunyuan_video', 'ltx_video') else (half, half)
        for name, patch in (('own (patch_dit)', {}), ('own + yarn at 2x', dict(scaling='yarn', train_grid=train)),
                            ('rope_axial', dict(pe='rope_axial'))):
            twin = build(host, args.layers, args.heads, args.head_dim).to(device=device, dtype=dtype).eval()
            twin.load_state_dict(models['unpatched'].state_dict())
            patch_dit(twin, **patch)
            models[name] = twin
        kw = inputs(host, models['unpatched'], args.grid, device, dtype)
        fns = {name: runner(m, kw) for name, m in models.items()}
        if args.compile:
            compiled = compile_models({f'compiled {k}': models[k] for k in ('unpatched', 'own (patch_dit)')},
                                      fullgraph=True)
            fns.update({name: runner(m, kw) for name, m in compiled.items()})
        times = compare(fns, rounds=args.rounds, per_round=2, warmup=2, device=device, clock=clock)
        for name, t in times.items():
            base = times['compiled unpatched'] if name.startswith('compiled') else times['unpatched']
            print(f'{host:14s} {name:28s} {t * 1e3:9.2f} {t / base:13.3f}')


if __name__ == '__main__':
    main()
