"""CUDA checks of every encoding: flash eligibility, bf16 training, CPU agreement, speed and memory.

Needs a GPU. For each encoding (every registered one plus a few option variants) it reports:

* ``flash``: whether every attention layer's SDPA call runs with the flash backend alone (bf16
  autocast, eval), next to what the encoding claims (`PositionalEncoding.flash_eligible`); a
  claim of "yes" that fails is a bug, a "no" that runs is a missed speed-up;
* ``bf16``: a train step under bf16 autocast gives a finite loss and finite gradients;
* ``fused``: launches of the fused Triton rotation kernels (`vispe.rotary.fused`) in
  that train step, forward and backward (0: the reference rotations ran); after the table,
  `vispe.rotary.fused_report()`: what each kernel kind ran as under ``'auto'`` (trusted after its
  check against the reference, fell back and why, not tried);
* ``cpu diff``: largest difference between the float32 outputs of the same tiny model on CUDA and
  on the CPU (TF32 off), relative to the output's scale;
* eval forward, train step and train-step peak memory as ratios against ``pe='none'``, measured in
  this process with interleaved rounds (bf16 autocast), for every batch size (``--batch 64,256``)
  and every mode (``--modes eager,compiled``: the same models as they are and under
  ``torch.compile``, the compiled ones against compiled ``pe='none'``).

GPU time is scarce, so the run keeps to a budget (``--budget-min``, default 8): the checks come
first, then the timing groups batch by batch, eager before compiled. An eager group runs while the
elapsed time plus the last group's duration stays within the budget. In a compiled group the
compilations dominate, so the models are compiled one by one (``none`` first, then in ``--pes``
order: put the encodings that matter most first) while the elapsed time plus the slowest
compilation so far plus the timing still to come fits; those compiled are timed, the rest are listed
as skipped. Every phase prints its elapsed time, and the notes give each model's compile seconds
(what the next run's ``--pes`` can plan with). ``c/e`` columns: an encoding's compiled time over its
eager time at the same batch (the issue's "compiled at least as fast as eager": <= 1).

Camera encodings (``gta_multiview``, ``prope``, ``plucker``) run on one multi-view attention layer
(8 views x 16 x 16 patches) instead of a ViT.

Usage:
    python benchmarks/cuda_check.py                              # ViT-B/16, 224, batch 64 and 256, eager + compiled
    python benchmarks/cuda_check.py --model vit_small --batch 32 --pes liere,irpe:on=qkv --modes eager
    python benchmarks/cuda_check.py --compile --pes rope_axial,liere      # compiled only (= --modes compiled)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import timm
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import vispe  # noqa: E402  (registers the ViTs in timm)
from vispe import PEAttention  # noqa: E402
from vispe.rotary import fused as fused_kernels  # noqa: E402
from _timing import compare, compile_models, peak_memory  # noqa: E402

VARIANTS = ['irpe:on=qkv', 'liere:block=2', 'comrope_ap:block=8']


class SDPACounter:
    """Counts SDPA calls (and the dtypes / head dims they see) while installed."""

    def __init__(self) -> None:
        self.calls: List[Tuple[torch.dtype, int, bool]] = []
        self._orig = F.scaled_dot_product_attention

    def __enter__(self) -> 'SDPACounter':
        def counted(q, k, v, *args, **kwargs):
            self.calls.append((q.dtype, q.shape[-1], kwargs.get('attn_mask') is not None))
            return self._orig(q, k, v, *args, **kwargs)
        F.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc) -> None:
        F.scaled_dot_product_attention = self._orig


class FusedCounter:
    """Counts launches of the fused rotation kernels while installed."""

    def __init__(self) -> None:
        self.launches = 0
        self._orig = fused_kernels._launch

    def __enter__(self) -> 'FusedCounter':
        def counted(*args, **kwargs):
            self.launches += 1
            return self._orig(*args, **kwargs)
        fused_kernels._launch = counted
        return self

    def __exit__(self, *exc) -> None:
        fused_kernels._launch = self._orig


def cameras(views: int, image: int, device: torch.device) -> vispe.Cameras:
    """Cameras on a circle of radius 3 looking at the origin (OpenCV: z forward, y down)."""
    angles = torch.arange(views, dtype=torch.float32) * (2 * math.pi / views)
    c2w = torch.eye(4).repeat(views, 1, 1)
    c2w[:, 0, 0], c2w[:, 0, 2] = angles.cos(), -angles.sin()
    c2w[:, 2, 0], c2w[:, 2, 2] = angles.sin(), angles.cos()
    c2w[:, :3, 3] = -3 * c2w[:, :3, 2]
    K = torch.tensor([[image * 0.9, 0, image / 2], [0, image * 0.9, image / 2], [0, 0, 1]]).repeat(views, 1, 1)
    return vispe.Cameras(K.to(device), cam_to_world=c2w.to(device), image_size=(image, image))


class CameraHost(torch.nn.Module):
    """One multi-view attention layer with a camera encoding: ``x (B, N, dim) -> (B, N, dim)``."""

    def __init__(self, spec: str, dim: int, heads: int, pos: vispe.Positions) -> None:
        super().__init__()
        self.pe = vispe.create_pe(spec, dim=dim, num_heads=heads, depth=1) if spec != 'none' else None
        self.attn = PEAttention(dim, heads, qkv_bias=True)
        self.pos = pos
        self.depth = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pe is None:
            return self.attn(x)
        pe = self.pe.prepare(self.pos)
        x = pe.embed(x)  # Plücker rays are added to the tokens; a no-op for the others
        return self.attn(x, pe=pe)


def build(spec: str, args: argparse.Namespace, device: torch.device, pos: vispe.Positions, model: str
          ) -> torch.nn.Module:
    name = spec.split(':')[0].split('+')[0]
    with torch.device(device):
        if vispe.pe_info(name)['cls'].requires:
            return CameraHost(spec, 768, 12, pos)
        return timm.create_model(model, pe=spec, num_classes=1000)


def flash_runs(model: torch.nn.Module, x: torch.Tensor, depth: int) -> str:
    """'yes' when all ``depth`` attention layers ran SDPA under the flash backend alone."""
    model.eval()
    with SDPACounter() as counter, sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.no_grad(), \
            torch.autocast(x.device.type, dtype=torch.bfloat16):
        try:
            model(x)
        except RuntimeError as e:
            return f'no ({str(e).splitlines()[0][:60]})'
    if len(counter.calls) < depth:
        return f'no (explicit softmax in {depth - len(counter.calls)} of {depth} layers)'
    return 'yes'


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: Optional[torch.Tensor]) -> torch.Tensor:
    out = model(x)
    return F.cross_entropy(out, y) if y is not None else out.float().square().mean()


def bf16_step(model: torch.nn.Module, x: torch.Tensor, y: Optional[torch.Tensor]) -> Callable[[], object]:
    model.train()

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = loss_of(model, x, y)
        loss.backward()
        return loss
    return run


def bf16_eval(model: torch.nn.Module, x: torch.Tensor) -> Callable[[], object]:
    model.eval()

    def run():
        with torch.no_grad(), torch.autocast(x.device.type, dtype=torch.bfloat16):
            return model(x)
    return run


def bf16_finite(model: torch.nn.Module, x: torch.Tensor, y: Optional[torch.Tensor]) -> str:
    loss = bf16_step(model, x, y)()
    bad = [n for n, p in model.named_parameters() if p.grad is not None and not torch.isfinite(p.grad).all()]
    if not torch.isfinite(loss):
        return 'NO (loss not finite)'
    return f'NO ({len(bad)} grads not finite)' if bad else 'yes'


def cpu_agreement(spec: str, device: torch.device, pos_cpu: vispe.Positions, pos: vispe.Positions) -> str:
    """Relative max difference of one model's float32 output on CUDA and on the CPU."""
    torch.manual_seed(0)
    name = spec.split(':')[0].split('+')[0]
    if vispe.pe_info(name)['cls'].requires:
        model = CameraHost(spec, 64, 4, pos_cpu).eval()
        x = torch.randn(2, pos_cpu.num_tokens, 64)
    else:
        model = timm.create_model('vit_tiny', pe=spec, num_classes=10).eval()
        x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        ref = model(x)
        if isinstance(model, CameraHost):
            model.pos = pos  # the same cameras, built on the device
        out = model.to(device)(x.to(device)).cpu()
    return f'{((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item():.1e}'


def _batch_sizes(text: str) -> List[int]:
    sizes = [int(b) for b in text.split(',') if b.strip()]
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError(f'--batch takes positive batch sizes separated by commas, got {text!r}')
    return sizes


def _modes(text: str) -> List[str]:
    modes = [m.strip() for m in text.split(',') if m.strip()]
    if not modes or any(m not in ('eager', 'compiled') for m in modes):
        raise argparse.ArgumentTypeError(f"--modes takes 'eager' and / or 'compiled', got {text!r}")
    return modes


def main(argv: Optional[List[str]] = None) -> None:
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument('--model', default='vit_base')
    ap.add_argument('--batch', type=_batch_sizes, default=[64, 256], help='batch sizes to time, e.g. 64,256')
    ap.add_argument('--pes', default=None, help='comma-separated specs (default: all registered + variants)')
    ap.add_argument('--rounds', type=int, default=5)
    ap.add_argument('--out', default=None, help='also write the table to this file')
    ap.add_argument('--device', default='cuda', help="'cpu' only to smoke-test this script")
    ap.add_argument('--modes', type=_modes, default=['eager', 'compiled'], help='eager and / or compiled timing')
    ap.add_argument('--compile', action='store_true', help='time compiled models only (= --modes compiled)')
    ap.add_argument('--budget-min', type=float, default=8.0, help='minutes the whole run may take')
    args = ap.parse_args(argv)
    if args.compile:
        args.modes = ['compiled']
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise SystemExit('cuda_check.py needs a CUDA device')
    device = torch.device(args.device)
    budget = args.budget_min * 60

    def elapsed(what: str) -> None:
        print(f'[{time.perf_counter() - start:6.1f} s] {what}', flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    specs = args.pes.split(',') if args.pes else [p for p in vispe.list_pes() if p != 'none'] + VARIANTS
    print(f'{torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}, torch {torch.__version__}, timm {timm.__version__}; '
          f'{args.model}, 224px, batch {",".join(map(str, args.batch))}, {"+".join(args.modes)}, bf16 autocast',
          flush=True)

    torch.manual_seed(0)
    cams_cpu = cameras(8, 256, torch.device('cpu'))
    pos_cpu = vispe.positions.multiview(cams_cpu, (16, 16))
    pos = vispe.positions.multiview(cameras(8, 256, device), (16, 16))
    check_batch = min(args.batch)
    x_img = torch.randn(check_batch, 3, 224, 224, device=device)
    y = torch.randint(0, 1000, (check_batch,), device=device)
    x_mv = torch.randn(4, pos.num_tokens, 768, device=device)

    rows: Dict[str, Dict[str, str]] = {}
    models: Dict[str, torch.nn.Module] = {}
    for spec in ['none'] + specs:
        row = rows.setdefault(spec, {})
        try:
            model = build(spec, args, device, pos, args.model)
            camera = isinstance(model, CameraHost)
            x, target = (x_mv, None) if camera else (x_img, y)
            depth = model.depth if camera else len(model.blocks)
            pe = model.pe
            row['claim'] = 'yes' if pe is None or pe.capabilities.flash_eligible else 'no'
            row['flash'] = flash_runs(model, x, depth)
            with FusedCounter() as fused:
                row['bf16'] = bf16_finite(model, x, target)
            row['fused'] = str(fused.launches)
            row['cpu diff'] = cpu_agreement(spec, device, pos_cpu, pos) if spec != 'none' else '-'
            models[spec] = model
        except Exception as e:  # report and go on: one broken encoding must not hide the others
            row['error'] = f'{type(e).__name__}: {str(e).splitlines()[0][:100]}'
            traceback.print_exc()
        print(f'{spec}: {row}', flush=True)
    elapsed('checks done')

    cam_specs = [s for s in models if isinstance(models[s], CameraHost)]
    if cam_specs:
        with torch.device(device):
            models['none (camera layer)'] = CameraHost('none', 768, 12, pos)
    image_specs = [s for s in models if s not in cam_specs and s != 'none (camera layer)']

    def timed(group: Dict[str, torch.nn.Module], base: str, x: torch.Tensor, target: Optional[torch.Tensor]
              ) -> Dict[str, Dict[str, float]]:
        t_eval = compare({n: bf16_eval(m, x) for n, m in group.items()}, rounds=args.rounds, device=device)
        t_train = compare({n: bf16_step(m, x, target) for n, m in group.items()}, rounds=args.rounds, device=device)
        mem = {n: peak_memory(bf16_step(m, x, target), device) for n, m in group.items()}
        return {n: dict(eval=t_eval[n] / t_eval[base], train=t_train[n] / t_train[base], memory=mem[n] / mem[base],
                        eval_ms=t_eval[n] * 1e3, train_ms=t_train[n] * 1e3) for n in group}

    compiled = compile_models(models) if 'compiled' in args.modes else {}
    compile_s: Dict[str, float] = {}

    def warm(names: List[str], x: torch.Tensor, target: Optional[torch.Tensor], reserve: float) -> List[str]:
        """Compile ``names`` in order (their first eval forward and train step at this input) while the
        elapsed time plus the slowest compilation so far plus ``reserve`` (the timing still to come) stays
        within the budget; the names compiled. Compilation dominates a compiled group, so the budget is
        kept model by model rather than group by group."""
        done, slowest = [], 0.0
        for n in names:
            if time.perf_counter() - start + slowest + reserve * (len(done) + 1) / len(names) > budget:
                break
            t0 = time.perf_counter()
            bf16_eval(compiled[n], x)()
            bf16_step(compiled[n], x, target)()
            if device.type == 'cuda':
                torch.cuda.synchronize(device)
            compile_s[n] = compile_s.get(n, 0.0) + time.perf_counter() - t0
            slowest = max(slowest, time.perf_counter() - t0)
            done.append(n)
        return done

    # timing groups batch by batch, eager then compiled (the first batch's compiled figures matter more
    # than a second batch's eager ones); the camera layer runs with the first batch at its own token count
    ratios: Dict[Tuple[str, int], Dict[str, Dict[str, float]]] = {}
    skipped: List[str] = []
    last = 0.0
    per_model = 0.0  # timing seconds per model, from the last eager group
    for i, batch in enumerate(args.batch):
        x = torch.randn(batch, 3, 224, 224, device=device)
        target = torch.randint(0, 1000, (batch,), device=device)
        for mode in args.modes:
            label = f'{mode}, batch {batch}'
            if time.perf_counter() - start + (last if mode == 'eager' else 0.0) > budget:
                skipped.append(label)
                elapsed(f'{label}: skipped (budget of {args.budget_min:g} min)')
                continue
            t0 = time.perf_counter()
            groups = [(image_specs, 'none', x, target)]
            if cam_specs and i == 0:
                groups.append((['none (camera layer)'] + cam_specs, 'none (camera layer)', x_mv, None))
            result: Dict[str, Dict[str, float]] = {}
            for names, base, inp, tgt in groups:
                if mode == 'compiled':
                    names = warm([base] + [n for n in names if n != base], inp, tgt, per_model * len(names))
                    left = [n for n in (image_specs if base == 'none' else cam_specs) if n not in names]
                    if left:
                        skipped.append(f'{label} of {", ".join(left)}')
                    if base not in names:
                        continue
                result.update(timed({n: (compiled if mode == 'compiled' else models)[n] for n in names}, base, inp, tgt))
            if not result:
                continue
            ratios[(mode, batch)] = result
            last = time.perf_counter() - t0
            if mode == 'eager':
                per_model = last / max(1, len(result))
            elapsed(f'{label} timed')

    both = [b for b in args.batch if ('eager', b) in ratios and ('compiled', b) in ratios]
    header = ['encoding', 'flash claim', 'flash runs', 'bf16 train', 'fused', 'cpu diff']
    header += [f'{what} x ({mode[0]}{batch})' for mode, batch in ratios for what in ('eval', 'train', 'mem')]
    header += [f'c/e {what} ({batch})' for batch in both for what in ('eval', 'train')]
    lines = ['| ' + ' | '.join(header) + ' |', '|' + '---|' * len(header)]
    for spec, row in rows.items():
        if 'error' in row:
            cells = [row['error']] + [''] * (len(header) - 2)
        else:
            cells = [row['claim'], row['flash'], row['bf16'], row['fused'], row['cpu diff']]
            for result in ratios.values():
                r = result.get(spec)
                cells += [f"{r['eval']:.2f}", f"{r['train']:.2f}", f"{r['memory']:.2f}"] if r else ['-'] * 3
            for batch in both:  # compiled time over eager time of the same encoding: < 1 where compiling pays
                e, c = ratios[('eager', batch)].get(spec), ratios[('compiled', batch)].get(spec)
                cells += [f"{c[k] / e[k]:.2f}" for k in ('eval_ms', 'train_ms')] if e and c else ['-'] * 2
        lines.append('| ' + ' | '.join([f'`{spec}`'] + cells) + ' |')
    notes = [f"columns: e = eager, c = compiled (against compiled none), then the batch size ({args.model}, 224 px); "
             f"c/e: the encoding's compiled time over its eager time"]
    for (mode, batch), result in ratios.items():
        base = result['none']
        notes.append(f"none, {mode}, batch {batch}: eval {base['eval_ms']:.1f} ms, train {base['train_ms']:.1f} ms")
    if cam_specs:
        notes.append('camera encodings: ratios against one plain attention layer on the same 8 x 16 x 16 tokens '
                     '(batch 4, first batch column of each mode)')
    if compile_s:
        notes.append('compile seconds (first eval forward + train step, all batches): ' +
                     ', '.join(f'{n} {t:.0f}' for n, t in compile_s.items()))
    if skipped:
        notes.append(f'skipped to keep the {args.budget_min:g} min budget: {"; ".join(skipped)}')
    notes.append(f"fused kernels (mode {vispe.rotary.fused_mode()!r}), vispe.rotary.fused_report():")
    notes += [f'  {c.kind} {c.dtype or "-"} {c.device or "-"}: {c.status} ({c.detail})'
              for c in vispe.rotary.fused_report()]
    text = '\n'.join(lines + [''] + notes)
    print('\n' + text, flush=True)
    elapsed('done')
    if args.out:
        with open(args.out, 'w') as f:
            f.write(text + '\n')


if __name__ == '__main__':
    main()
