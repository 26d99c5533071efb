"""Applying a rotation to q and k (and GTA's v and output): the dispatch and its autograd.

`rotate_qk` and `apply_rotation` are the one entry of every rotary encoding. They pick, per call:

* the fused Triton kernels (`fused`, kinds ``table``, ``half_table``, ``pair``, ``block``, ``matrix`` on
  CUDA; `set_fused` / ``VISPE_FUSED`` select); under ``'auto'`` each kind only once it has agreed with
  the reference on the device (`trust`: the first launch of each variant is checked on the call's first
  sample, `_self_check`; a kind that fails runs the reference from then on, with one warning);
* under autograd, `_SavedOutputRotation`: only the rotated output (which attention saves anyway)
  and the rotation are kept for backward, the input gradient is ``R^T grad`` and the rotation's
  gradient comes from ``R x`` itself or from ``x = R^-1 (R x)``, never from a second copy of q and k;
* otherwise the reference kernels (`kernels`) on q and k stacked into one call, read as one view of
  their fused projection where the layout allows (the stack and layout helpers here).

Traced (torch.compile, torch.export) the reference kernels run under autograd as they are: the
compiler decides what to save and fuses the stack itself.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Literal, NamedTuple, Optional, Sequence, Tuple

import torch

from .._tracing import is_tracing
from .._dtypes import autocast_off
from . import fused, trust
from .kernels import (
    PairRotation, apply_pair_rotation, block_rotation_grad_from_output, fourier_rotation, mixed_pair,
    mixed_pair_adjoint, mixed_pair_grads, rotate_blocks, rotation_table, unit_table,
)

__all__ = ['FUSED', 'fused_mode', 'set_fused', 'fused_report', 'KINDS', 'RotationKind', 'angle_tables',
           'apply_rotation', 'rotate_channels', 'rotate_qk']

FusedMode = Literal['auto', 'on', 'off']
_MODES = ('auto', 'on', 'off')

FUSED: Optional[FusedMode] = None
"""When q / k rotations run the fused Triton kernels (kinds ``table``, ``half_table``, ``pair``, ``block``,
``matrix``, and ``mixed_pair``'s pairs after its dense product; the inputs and rotations
`fused.supported` lists, also as tokens-first ``(B, N, H, hd)`` views, the reference kernels otherwise):
``'auto'`` on CUDA tensors when triton imports, each kind once it has agreed with the reference kernels there
(`trust`; otherwise the reference, and one warning), ``'on'`` on any device and unchecked, raising what a kernel
raises (CPU tensors need Triton's interpreter, ``TRITON_INTERPRET=1`` before vispe is imported: for tests),
``'off'`` never. Never while tracing (torch.compile fuses the reference itself). None (the default): the
environment variable ``VISPE_FUSED``, read when a rotation runs, else ``'auto'``. Set with `set_fused`, read with
`fused_mode`; `fused_report` says what each kind ran as under ``'auto'``."""


def fused_mode() -> FusedMode:
    """The fused-kernel setting in force: `set_fused`'s, else ``VISPE_FUSED``, else ``'auto'``."""
    mode = FUSED if FUSED is not None else os.environ.get('VISPE_FUSED', 'auto')
    if mode not in _MODES:
        source = 'vispe.rotary.set_fused' if FUSED is not None else 'VISPE_FUSED'
        raise ValueError(f"{source} must be 'auto', 'on' or 'off', got {mode!r}")
    return mode  # type: ignore[return-value]


def set_fused(mode: Optional[FusedMode]) -> Optional[FusedMode]:
    """Choose when rotations run the fused kernels (`FUSED`; None: back to ``VISPE_FUSED`` / ``'auto'``),
    at any time; returns the previous setting, so ``prev = set_fused('off') ... set_fused(prev)``."""
    global FUSED
    if mode is not None and mode not in _MODES:
        raise ValueError(f"set_fused takes 'auto', 'on', 'off' or None, got {mode!r}")
    previous, FUSED = FUSED, mode
    return previous


fused_report = trust.fused_report

Kernel = Callable[..., torch.Tensor]


class RotationKind(NamedTuple):
    """How one kind of rotation is applied: ``R x``, ``R^T y``, ``R^-1 y`` (None: ``R^T``, the
    rotation is orthogonal) and, optionally, the parameters' gradients from the rotated output,
    ``(grad, R x, *params, block) -> grads`` (None: ``x`` is recovered as ``R^-1 (R x)`` and autograd
    runs through ``forward``). ``reads_views``: in inference, ``forward`` reads q and k as one view
    of their fused projection instead of a stacked copy (False for ``block``, whose batched products
    need the stack dim outermost)."""
    forward: Kernel
    adjoint: Kernel
    inverse: Optional[Kernel] = None
    param_grads: Optional[Callable[..., Tuple[torch.Tensor, ...]]] = None
    reads_views: bool = True


def angle_tables(angles: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Per-layer rotation angles as their unit complex tables when no gradient is wanted (eval,
    where the state is cached: cos / sin once, not in every layer of every forward); unchanged
    otherwise."""
    if torch.is_grad_enabled():
        return tuple(angles)
    return tuple(rotation_table(a) for a in angles)


# ``table`` / ``half_table``: a complex pair table, interleaved or rotate-half pairs (YaRN scales its
# magnitude, so there R^-1 != R^T). ``pair`` / ``fourier``: real angles (training keeps half the bytes
# per rotation), or their unit complex table (`angle_tables`: eval, built once into the cached state).
# ``block``: orthogonal b x b matrices. ``matrix``: any invertible b x b matrices (GTA's scaled SE(3),
# PRoPE's projective maps), whose gradient goes through R^-1. ``mixed_pair``: Cayley-STRING's
# RoPE(r) P x, P orthogonal and dense per head.
KINDS: Dict[str, RotationKind] = {
    'table': RotationKind(lambda x, table, block: apply_pair_rotation(x, table),
                          lambda y, table, block: apply_pair_rotation(y, table.conj()),
                          lambda y, table, block: apply_pair_rotation(y, table.reciprocal())),
    'half_table': RotationKind(lambda x, table, block: apply_pair_rotation(x, table, 'half'),
                               lambda y, table, block: apply_pair_rotation(y, table.conj(), 'half'),
                               lambda y, table, block: apply_pair_rotation(y, table.reciprocal(), 'half')),
    'pair': RotationKind(lambda x, angle, block: apply_pair_rotation(x, unit_table(angle)),
                         lambda y, angle, block: apply_pair_rotation(y, unit_table(angle).conj())),
    'block': RotationKind(lambda x, rot, block: rotate_blocks(x, rot),
                          lambda y, rot, block: rotate_blocks(y, rot, transpose=True, relayout=False),
                          param_grads=lambda grad, out, rot, block: (block_rotation_grad_from_output(grad, out, rot),),
                          reads_views=False),
    'matrix': RotationKind(lambda x, rot, block: rotate_blocks(x, rot),
                           lambda y, rot, block: rotate_blocks(y, rot, transpose=True, relayout=False),
                           lambda y, rot, block: rotate_blocks(y, torch.linalg.inv(rot)),
                           reads_views=False),
    'fourier': RotationKind(lambda x, angle, block: fourier_rotation(x, unit_table(angle), block),
                            lambda y, angle, block: fourier_rotation(y, unit_table(angle).conj(), block),
                            reads_views=False),
    'mixed_pair': RotationKind(
        lambda x, mix, angle, block: mixed_pair(x, mix, angle, _fused_pairs(x)),
        lambda y, mix, angle, block: mixed_pair_adjoint(y, mix, angle, _fused_pairs(y)),
        param_grads=lambda grad, out, mix, angle, block: mixed_pair_grads(grad, out, mix, angle, _fused_pairs(out))),
}
"""How each kind of rotation is applied (`RotationKind`), by name."""


def _rotated_width(kind: str, params: Sequence[torch.Tensor], hd: int) -> int:
    """Channels a rotation covers: whole ``b x b`` blocks for kinds ``block`` and ``matrix`` (LieRE when
    ``gd`` does not divide the head dim; the rest pass through), all of them otherwise."""
    return params[0].shape[-3] * params[0].shape[-1] if kind in ('block', 'matrix') else hd


def _stacked_view(inputs: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The inputs as one ``(n, ...)`` view of their storage when they are equally spaced slices of
    it with equal strides (q and k of a fused qkv projection), else None."""
    first = inputs[0]
    step = inputs[1].storage_offset() - first.storage_offset()
    if step <= 0 or any(
            t.shape != first.shape or t.stride() != first.stride() or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
            or t.storage_offset() != first.storage_offset() + i * step for i, t in enumerate(inputs)):
        return None
    return first.as_strided((len(inputs), *first.shape), (step, *first.stride()), first.storage_offset())


def _stack(inputs: Sequence[torch.Tensor], as_view: bool = False) -> torch.Tensor:
    """``stack(inputs)`` laid out in the first one's memory order (a fused qkv projection gives q as
    (B, N, H, hd) under its (B, H, N, hd) view), which the kernels and so attention's output keep;
    with ``as_view``, no copy at all where `_stacked_view` finds one."""
    if len(inputs) == 1:
        return inputs[0]
    if is_tracing():  # strides and storage offsets do not trace; compiled, the stack fuses anyway
        return torch.stack(list(inputs))
    first = inputs[0]
    view = _stacked_view(inputs) if as_view else None
    if view is not None:
        return view
    order = sorted(range(first.dim() - 1), key=lambda d: -first.stride(d)) + [first.dim() - 1]  # channels last
    back = [1 + order.index(d) for d in range(first.dim())]
    return torch.stack([t.permute(order) for t in inputs]).permute(0, *back)


def _forward(kind: str, block: int, x: torch.Tensor, params: Sequence[torch.Tensor], keep_layout: bool
             ) -> torch.Tensor:
    """``R x`` on the rotated channels, the others passed through; in ``x``'s memory layout with
    ``keep_layout`` (in training: SDPA's output follows q's layout, and the projection after
    attention would otherwise save a relaid copy of it next to the one attention saves)."""
    kernel = KINDS[kind].forward
    width = _rotated_width(kind, params, x.shape[-1])
    if width == x.shape[-1]:
        out = kernel(x, *params, block)
        return torch.empty_like(x).copy_(out) if keep_layout and out.stride() != x.stride() else out
    out = torch.empty_like(x)
    out[..., :width] = kernel(x[..., :width], *params, block)
    out[..., width:] = x[..., width:]
    return out


class _SavedOutputRotation(torch.autograd.Function):
    """``x -> R x`` for one or more inputs sharing a rotation (q and k, stacked into one ``x``),
    keeping only ``R x`` (which attention saves anyway) and the parameters for backward: there
    ``grad_x = R^T grad``, and the parameters' gradient comes from ``R x`` directly (kind ``block``)
    or from ``x = R^-1 (R x)``, instead of storing a second copy of q and k per layer."""

    @staticmethod
    def forward(ctx, kind, block, count, *args):
        inputs, params = args[:count], args[count:]
        out = _forward(kind, block, _stack(inputs), params, keep_layout=True)
        ctx.save_for_backward(out, *params)
        ctx.kind, ctx.block, ctx.count = kind, block, count
        return out if count == 1 else tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        out, *params = ctx.saved_tensors
        if ctx.count == 1:  # an expanded gradient (of a sum) has no complex view: materialise it
            grad = grads[0] if 0 not in grads[0].stride() else torch.empty_like(out).copy_(grads[0])
        else:  # stacked like the outputs, so that the kernels see views of it again
            grad = torch.empty_like(out)
            for part, g in zip(grad.unbind(0), grads):
                part.copy_(g) if g is not None else part.zero_()
        kernels = KINDS[ctx.kind]
        width = _rotated_width(ctx.kind, params, out.shape[-1])
        g_rot, y_rot = (grad, out) if width == out.shape[-1] else (grad[..., :width], out[..., :width])
        grads_x = (None,) * ctx.count
        if any(ctx.needs_input_grad[3:3 + ctx.count]):
            grad_x = kernels.adjoint(g_rot, *params, ctx.block)
            if width != out.shape[-1]:
                grad_x = torch.cat([grad_x, grad[..., width:]], dim=-1)
            grads_x = (grad_x,) if ctx.count == 1 else tuple(grad_x.unbind(0))
        need = ctx.needs_input_grad[3 + ctx.count:]
        grads_p = [None] * len(params)
        if any(need) and kernels.param_grads is not None:
            grads_p = [g if n else None for g, n in zip(kernels.param_grads(g_rot, y_rot, *params, ctx.block), need)]
        elif any(need):
            x = (kernels.inverse or kernels.adjoint)(y_rot, *params, ctx.block)
            with torch.enable_grad():
                leaves = [p.detach().requires_grad_(n) for p, n in zip(params, need)]
                found = iter(torch.autograd.grad(kernels.forward(x, *leaves, ctx.block),
                                                 [p for p, n in zip(leaves, need) if n], g_rot))
            grads_p = [next(found) if n else None for n in need]
        return (None, None, None, *grads_x, *grads_p)


_AUTO_DEVICES = ('cuda',)
"""Device types whose tensors ``'auto'`` puts on the fused kernels."""


def _fused_device(x: torch.Tensor) -> bool:
    """Whether `FUSED` puts rotations of ``x`` on the fused kernels, where they support them."""
    mode = fused_mode()
    return not (mode == 'off' or (mode == 'auto' and x.device.type not in _AUTO_DEVICES) or is_tracing())


def _fused(kind: str, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether this rotation runs the fused kernels (see `FUSED`): under ``'auto'``, checked first (`_trusted`)."""
    if not (_fused_device(inputs[0]) and len(params) == 1 and fused.supported(kind, inputs, params[0])):
        return False
    return fused_mode() == 'on' or _trusted(kind, inputs, params[0])


def _trust_key(kind: str, x: torch.Tensor) -> trust.Key:
    return kind, x.dtype, str(x.device)


def _trusted(kind: str, inputs: Sequence[torch.Tensor], rot: torch.Tensor) -> bool:
    """`trust.trusted` for this call's variant: the kernel specialisations it launches follow the rotation's
    dtype and block size and, under autograd, which of the inputs and the rotation need a gradient (the
    backward launch). No check while a CUDA graph is captured (it synchronises): the reference runs there
    until a check outside the capture has passed."""
    x = inputs[0]
    needs = ((any(t.requires_grad for t in inputs), rot.requires_grad) if torch.is_grad_enabled() else (False, False))
    variant = (rot.dtype, rot.shape[-1] if kind in ('block', 'matrix') else 2, needs)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    return trust.trusted(_trust_key(kind, x), variant, lambda: _self_check(kind, inputs, rot, needs),
                         may_check=not capturing)


def _self_check(kind: str, inputs: Sequence[torch.Tensor], rot: torch.Tensor, needs: Tuple[bool, bool]) -> float:
    """The largest difference between the fused and the reference kernels on the first sample of this call
    (its layout, head dim, tokens and rotation; a batch's worth of time and memory would buy nothing more),
    relative to the reference's largest entry: the rotated inputs and, for ``needs`` = (inputs, rotation)
    needing gradients, the gradients of a fixed random cotangent (the backward launch the call will make).
    Runs with autocast off (the reference in its own precision), synchronises once and leaves the global
    random state alone."""
    x = inputs[0]
    inner = fused.INNER_DIMS[kind]
    if x.dim() == 4 and x.shape[0] > 1:
        inputs = [t[:1] for t in inputs]
        rot = rot[:1] if rot.dim() == inner + 3 and rot.shape[0] > 1 else rot
    if any(t.is_inference() for t in (*inputs, rot)):  # inference tensors take no part in autograd
        with torch.inference_mode(False):
            inputs, rot = [t.clone() for t in inputs], rot.clone()
    generator = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(t.shape, generator=generator).to(t.device, t.dtype) for t in inputs]

    def run(fused_kernels: bool) -> list:
        leaves = [t.detach().requires_grad_(needs[0]) for t in inputs]
        param = rot.detach().requires_grad_(needs[1])
        if fused_kernels:
            outs = fused.rotate(leaves, param, kind)
        else:
            outs = [_forward(kind, 0, t, (param,), keep_layout=False) for t in leaves]
        wrt = [t for t in (*leaves, param) if t.requires_grad]
        grads = torch.autograd.grad(outs, wrt, cotangents) if wrt else ()
        return [o.detach() for o in outs] + list(grads)

    with torch.inference_mode(False), torch.enable_grad(), autocast_off(x.device):
        differences = [_relative_difference(a, b) for a, b in zip(run(True), run(False))]
        return torch.stack(differences).max().item()  # the check's one synchronisation


def _relative_difference(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """``max |got - want| / max |want|`` in float32 (complex tensors as their real pairs), a 0-dim tensor, over the
    entries the reference has finite (a diverged step's inf and NaN pass through both alike); infinite where
    the two are finite at different entries."""
    if got.is_complex():
        got, want = torch.view_as_real(got.resolve_conj()), torch.view_as_real(want.resolve_conj())
    got, want = got.float(), want.float()
    finite = torch.isfinite(want)
    scale = torch.where(finite, want, 0).abs().max().clamp_min(1e-30)
    difference = torch.where(finite, got - want, 0).abs().max() / scale
    return torch.where((torch.isfinite(got) != finite).any(), torch.inf, difference)


def _run_fused(kind: str, inputs: Sequence[torch.Tensor], launch: Callable[[], Any]) -> Any:
    """``launch()``; under ``'auto'`` an exception (a shape whose kernel fails to compile after the kind's
    checks passed) falls the kind back (`trust.failed`) and gives None: the caller runs the reference."""
    if fused_mode() == 'on':
        return launch()
    try:
        return launch()
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        trust.failed(_trust_key(kind, inputs[0]), error)
        return None


def _fused_pair_rotation(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``R x`` by a complex table of interleaved pairs in one fused launch where the kernels support
    it (``x``: one input, or q and k stacked ``(2, ...)``, as `_SavedOutputRotation` hands them), else
    `apply_pair_rotation`. No autograd: it serves inside `_SavedOutputRotation`."""
    members = tuple(x.unbind(0)) if x.dim() == 5 else (x,)
    if torch.is_grad_enabled() and (x.requires_grad or table.requires_grad) or not _fused('table', members, (table,)):
        return apply_pair_rotation(x, table)
    out = _run_fused('table', members, lambda: fused.rotate_members(members, table, 'table'))
    return apply_pair_rotation(x, table) if out is None else out.view(x.shape)


def _fused_pairs(x: torch.Tensor) -> Optional[PairRotation]:
    """The pair rotation inside ``mixed_pair`` (Cayley-STRING's RoPE part): `_fused_pair_rotation`
    where `FUSED` puts rotations of ``x`` on the fused kernels, else None (the reference)."""
    return _fused_pair_rotation if _fused_device(x) else None


def _heads_first(kind: str, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
                 ) -> Optional[Tuple[Tuple[torch.Tensor, ...], torch.Tensor]]:
    """Inputs ``(B, N, H, hd)``, tokens before heads (transformers' ``unsqueeze_dim=2``), and their
    rotation (``(..., N, H', ...)``) as the ``(B, H, N, hd)`` views the fused kernels take, where they
    take them; else None. Swapping the same two dims of both keeps the broadcast, and the kernels
    write in the inputs' memory order, so the result swapped back has the inputs' layout."""
    if len(params) != 1 or inputs[0].dim() != 4 or kind not in fused.INNER_DIMS:
        return None
    inner, rot = fused.INNER_DIMS[kind], params[0]
    if rot.dim() < inner + 2:  # no head dim: the rotation broadcasts along the tokens
        return None
    swapped = tuple(x.transpose(1, 2) for x in inputs), rot.transpose(-inner - 2, -inner - 1)
    return swapped if _fused(kind, swapped[0], swapped[1:]) else None


def _rotate(inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor], kind: str, block: int
            ) -> Tuple[torch.Tensor, ...]:
    if kind not in KINDS:
        raise ValueError(f'rotation kind must be one of {tuple(KINDS)}, got {kind!r}')
    out = None
    if _fused(kind, inputs, params):
        out = _run_fused(kind, inputs, lambda: fused.rotate(inputs, params[0], kind))
    else:
        swapped = _heads_first(kind, inputs, params)
        if swapped is not None:
            out = _run_fused(kind, inputs, lambda: tuple(y.transpose(1, 2) for y in fused.rotate(*swapped, kind)))
    if out is not None:
        return out
    # traced, autograd runs through the reference kernels: the compiler decides what to save itself
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *params)) and not is_tracing():
        out = _SavedOutputRotation.apply(kind, block, len(inputs), *inputs, *params)
        return (out,) if len(inputs) == 1 else out
    if kind == 'half_table' and len(inputs) > 1 and not is_tracing():
        # elementwise on each input: stacking q and k would add a copy of both and widen nothing
        return tuple(_forward(kind, block, x, params, keep_layout=False) for x in inputs)
    out = _forward(kind, block, _stack(inputs, as_view=KINDS[kind].reads_views), params, keep_layout=False)
    return (out,) if len(inputs) == 1 else out.unbind(0)


def apply_rotation(x: torch.Tensor, kind: str, *params: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Map ``x`` ``(..., N, hd)`` by a rotation of ``kind`` (a name in `KINDS`: ``table`` /
    ``half_table`` complex pairs, ``pair`` angles, ``block`` / ``matrix`` blocks, ``fourier`` angles
    with FFT blocks of ``block`` channels, ``mixed_pair`` matrix and angles); channels beyond whole
    ``b x b`` blocks pass through. Memory-lean under autograd (keeps only the output)."""
    return _rotate((x,), params, kind, block)[0]


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rot_q: Any, rot_k: Any, kind: str, block: int = 0
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`apply_rotation` to q and k; in self-attention (one rotation for both) as a single call on
    ``stack(q, k)``, which halves the kernel launches and widens the small per-position products.
    ``rot_q`` / ``rot_k``: a tensor, or a tuple of tensors for the multi-parameter kinds."""
    params_q = rot_q if isinstance(rot_q, tuple) else (rot_q,)
    params_k = rot_k if isinstance(rot_k, tuple) else (rot_k,)
    if q.shape == k.shape and all(a is b for a, b in zip(params_q, params_k)):
        return _rotate((q, k), params_q, kind, block)
    return _rotate((q,), params_q, kind, block)[0], _rotate((k,), params_k, kind, block)[0]


def rotate_channels(x: torch.Tensor, parts: Sequence[Tuple[int, Optional[str], Any]]) -> torch.Tensor:
    """Map consecutive channel groups of ``x`` by their own rotations (GTA's and PRoPE's head splits):
    ``parts`` lists ``(width, kind, params)`` in channel order, kind None for channels passed through,
    the widths summing to the head dim. Each group goes through `apply_rotation`."""
    if sum(width for width, _, _ in parts) != x.shape[-1]:
        raise ValueError(f'channel groups {[width for width, _, _ in parts]} do not cover the head dim {x.shape[-1]}')
    groups = x.split([width for width, _, _ in parts], dim=-1)
    out = [g if kind is None or g.shape[-1] == 0 else
           apply_rotation(g, kind, *(params if isinstance(params, tuple) else (params,)))
           for g, (_, kind, params) in zip(groups, parts)]
    return torch.cat(out, dim=-1)
