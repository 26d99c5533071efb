"""The one rotary core: pair rotations, dense block rotations, frequencies and their scaling.

Every rotation encoding in vispe (RoPE-axial/mixed, ComRoPE, LieRE, STRING, GTA, M-RoPE) applies
its rotation through the functions here, so the kernels and their precision rules live once:
angles and matrices are built in float32 (float64 inputs stay float64) and the result is cast back
to the activation dtype.

Two pair layouts exist in the field:

* ``'interleaved'``: pairs ``(2j, 2j + 1)`` (RoPE-ViT, timm's vision RoPE, GTA, ComRoPE);
* ``'half'``: pairs ``(j, j + hd/2)`` (rotate-half, the layout of LLM code: Llama, Qwen2-VL).

On CUDA, `rotate_qk` and `orthogonal_map` run kinds ``table``, ``pair`` and ``block`` as fused Triton
kernels (`_triton_rotary`: one launch per direction instead of tens); `FUSED` selects.
"""
from __future__ import annotations

import itertools
import math
import os
from typing import Any, Callable, Dict, Literal, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from .._tracing import is_tracing
from . import _triton_rotary

__all__ = [
    'PairLayout', 'FrequencyScaling', 'axial_frequencies', 'scale_frequencies', 'rotation_table',
    'apply_pair_rotation', 'apply_block_rotation', 'pad_prefix', 'compute_dtype',
    'block_rotation_grad', 'block_rotation_grad_from_output', 'fourier_rotation', 'orthogonal_map', 'rotate_qk',
    'RotationKind', 'angle_tables', 'FUSED',
]

PairLayout = Literal['interleaved', 'half']
FrequencyScaling = Literal['none', 'linear', 'ntk', 'yarn']

FUSED: Literal['auto', 'on', 'off'] = os.environ.get('VISPE_FUSED', 'auto')  # type: ignore[assignment]
"""When q / k rotations run the fused Triton kernels (kinds ``table``, ``pair``, ``block``; the inputs
and rotations `_triton_rotary.supported` lists, the reference kernels otherwise): ``'auto'`` on CUDA
tensors when triton imports, ``'on'`` on any device (CPU tensors need Triton's interpreter,
``TRITON_INTERPRET=1`` before vispe is imported: for tests), ``'off'`` never. Never while tracing
(torch.compile fuses the reference itself). Set this attribute, or ``VISPE_FUSED`` before import."""


def axial_frequencies(num_pairs: int, theta: float, step: float = 2.0, dim: Optional[int] = None) -> torch.Tensor:
    """Geometric frequencies ``1 / theta ** (step * k / dim)`` for ``k < num_pairs`` (float32).

    With ``dim`` the head dim and ``step = 4`` this is RoPE-ViT's 2D axial table ``1/theta^(4k/hd)``;
    with ``step = 2`` and ``dim = hd`` it is 1D RoPE's ``1/theta^(2k/hd)``.
    """
    dim = dim if dim is not None else 2 * num_pairs
    k = torch.arange(num_pairs, dtype=torch.float32)
    return 1.0 / theta ** (step * k / dim)


def scale_frequencies(
        freqs: torch.Tensor,
        factor: float,
        method: FrequencyScaling,
        train_length: float,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
) -> Tuple[torch.Tensor, float]:
    """Adapt one axis' frequencies to a sequence ``factor`` times longer than in training.

    Returns the new frequencies and a magnitude factor for cos/sin (YaRN's attention temperature).

    * ``linear``: position interpolation (Chen et al. 2023), every frequency divided by ``factor``.
    * ``ntk``: NTK-aware base scaling (bloc97 2023), ``theta' = theta * factor^(d / (d - 2))``, which
      for a geometric table is ``f_k * factor^(-(2k / (d - 2)))``: high frequencies kept, the lowest
      interpolated.
    * ``yarn``: YaRN (Peng et al. 2023) "NTK-by-parts": frequencies whose wavelength fits more than
      ``beta_fast`` times in the training length are kept, fewer than ``beta_slow`` times are
      interpolated, a linear ramp between; magnitude ``0.1 ln(factor) + 1``.
    """
    if method == 'none' or factor <= 1.0:
        return freqs, 1.0
    if method == 'linear':
        return freqs / factor, 1.0
    if method == 'ntk':  # assumes a geometric table sorted from high to low frequency
        d = 2 * freqs.numel()
        if d <= 2:
            return freqs / factor, 1.0
        k = torch.arange(freqs.numel(), dtype=freqs.dtype, device=freqs.device)
        return freqs * factor ** (-2 * k / (d - 2)), 1.0
    if method == 'yarn':
        rotations = train_length * freqs.abs() / (2 * math.pi)  # turns over the training length
        ramp = ((rotations - yarn_beta_slow) / (yarn_beta_fast - yarn_beta_slow)).clamp(0, 1)
        new = freqs / factor * (1 - ramp) + freqs * ramp
        return new, 0.1 * math.log(factor) + 1.0
    raise ValueError(f"frequency scaling must be one of ('none', 'linear', 'ntk', 'yarn'), got {method!r}")


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float64 stays float64 (exactness tests), everything else computes in float32."""
    return torch.float64 if t.dtype in (torch.float64, torch.complex128) else torch.float32


def rotation_table(angles: torch.Tensor, magnitude: Union[float, torch.Tensor] = 1.0) -> torch.Tensor:
    """Complex numbers ``magnitude * exp(i * angles)`` (complex64) for `apply_pair_rotation`.

    ``magnitude`` (a scalar or a tensor broadcastable to ``angles``) is 1 except for YaRN.
    """
    angles = angles.to(torch.promote_types(angles.dtype, torch.float32))  # float64 stays float64
    return torch.polar(torch.ones_like(angles) * magnitude, angles)


def pad_prefix(table: torch.Tensor, num_prefix: int, dim: int = -2) -> torch.Tensor:
    """Prepend identity rotations (1 + 0i) for prefix tokens along the token axis ``dim``."""
    if num_prefix == 0:
        return table
    shape = list(table.shape)
    shape[dim] = num_prefix
    ones = torch.ones(shape, dtype=table.dtype, device=table.device)
    return torch.cat([ones, table], dim=dim)


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """Real ``(..., 2P)`` (in at least float32) as complex interleaved pairs ``(..., P)``: a view
    where the layout allows one (channels at stride 1, every other stride and the offset even, as
    in q and k of a fused projection), a dense copy otherwise (a gradient of a transposed or
    strided product, a host's own projection layout)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if is_tracing():  # offsets do not trace; the compiler drops the copy where the layout allows a view
        x = x.contiguous()
    elif x.stride(-1) != 1 or x.storage_offset() % 2 or any(s % 2 for s in x.stride()[:-1]):
        x = x.clone(memory_format=torch.contiguous_format)
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


def apply_pair_rotation(x: torch.Tensor, rot: torch.Tensor, layout: PairLayout = 'interleaved') -> torch.Tensor:
    """Rotate channel pairs of ``x`` (``(..., N, hd)``) by the complex table ``rot`` (``(..., N, P)``).

    ``rot`` broadcasts against ``x``'s leading dims; ``P <= hd / 2`` pairs are rotated: the first
    ``2P`` channels, the rest pass through unchanged (partial rotary). The product is taken in float32
    (complex64; float64 input stays float64) and cast back to ``x.dtype``.
    """
    hd = x.shape[-1]
    pairs = rot.shape[-1]
    cdt = compute_dtype(x)
    rot = rot.to(torch.complex128 if cdt == torch.float64 else torch.complex64)
    ct = torch.promote_types(x.dtype, torch.float32)  # at least float32; float64 is not downcast
    if 2 * pairs > hd:
        raise ValueError(f'rotation has {pairs} pairs but head dim is {hd}')
    if layout == 'interleaved':
        rotated, rest = (x, None) if 2 * pairs == hd else (x[..., :2 * pairs], x[..., 2 * pairs:])
        out = torch.view_as_real(_pairs(rotated) * rot).flatten(-2).to(x.dtype)
    elif layout == 'half':  # GPT-NeoX partial rotary: the first 2P channels, pairs (j, j + P)
        rotated, rest = (x, None) if 2 * pairs == hd else (x[..., :2 * pairs], x[..., 2 * pairs:])
        x1, x2 = rotated[..., :pairs].to(ct), rotated[..., pairs:].to(ct)
        cos, sin = rot.real, rot.imag
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
    else:
        raise ValueError(f"layout must be 'interleaved' or 'half', got {layout!r}")
    return out if rest is None else torch.cat([out, rest], -1)


def apply_block_rotation(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Apply block-diagonal rotations: ``x`` ``(..., N, hd)``, ``rot`` ``(..., N, nb, b, b)``, ``nb * b = hd``.

    Each token's head vector is split into ``nb`` consecutive blocks of size ``b`` and block ``j``
    is multiplied by ``rot[..., j, :, :]``. ``rot`` broadcasts over batch and heads, so the same
    per-position matrices serve every sample (never a per-sample ``(B, N, H, hd, hd)`` tensor).
    """
    nb, b = rot.shape[-3], rot.shape[-1]
    if nb * b != x.shape[-1]:
        raise ValueError(f'block rotation covers {nb}x{b} channels but head dim is {x.shape[-1]}')
    ct = torch.promote_types(x.dtype, torch.float32)  # at least float32; float64 is not downcast
    xb = x.to(ct).reshape(*x.shape[:-1], nb, b)
    # einsum keeps broadcast dims out of the batched product; `rot @ xb` would copy rot once per sample
    out = torch.einsum('...ij,...j->...i', rot.to(ct), xb)
    return out.flatten(-2).to(x.dtype)


def _blocks_as_matrices(x: torch.Tensor, rot: torch.Tensor, order: Optional[Sequence[int]] = None
                        ) -> Optional[Tuple[torch.Tensor, torch.Tensor, Any]]:
    """Views for `rotate_blocks`: ``x`` as ``(M, Z, b)`` and ``rot`` as ``(M, b, b)``, or None.

    ``M``: the dims where ``rot`` varies (positions, heads, blocks; per-sample jitter), ordered as
    they lie in ``rot``'s memory; ``Z``: the dims it broadcasts along (batch, the q/k stack), in
    ``x``'s memory order unless ``order`` (a previous call's) is given. Only views qualify (None
    otherwise): the point is to feed the batched product without the copies einsum makes. None
    while traced: a tracer's strides need not be the run's, so no view is tried on them.
    """
    if is_tracing():
        return None
    nb, b = rot.shape[-3], rot.shape[-1]
    blocks = x.unflatten(-1, (nb, b))
    lead = blocks.shape[:-1]
    rot_lead = (1,) * (len(lead) - (rot.dim() - 2)) + tuple(rot.shape[:-2])
    if any(r not in (1, n) for r, n in zip(rot_lead, lead)):
        return None
    dims = range(len(lead))
    aligned = rot.reshape(rot_lead + (b, b))
    if order is None:
        m = sorted((d for d in dims if rot_lead[d] != 1), key=lambda d: -aligned.stride(d))
        z = sorted((d for d in dims if rot_lead[d] == 1 and lead[d] != 1), key=lambda d: -blocks.stride(d))
        order = [d for d in dims if d not in m and d not in z] + m + z
    num_m = math.prod(lead[d] for d in dims if rot_lead[d] != 1)
    try:
        xm = blocks.permute(*order, -1).view(num_m, -1, b)
        rm = aligned.permute(*order, -2, -1).view(num_m, b, b)
    except RuntimeError:  # not expressible as views: einsum handles it
        return None
    return xm, rm, order


def rotate_blocks(x: torch.Tensor, rot: torch.Tensor, transpose: bool = False, relayout: bool = True
                  ) -> torch.Tensor:
    """`apply_block_rotation` (``rot^T`` with ``transpose``) as one batched product on views of ``x``
    and ``rot`` when their layouts allow it (the learned rotations lay ``rot`` out to match q and k),
    the result in ``x``'s memory layout (with ``relayout=False``, a view of the product's own
    layout, for a consumer that copies anyway); einsum otherwise."""
    ct = torch.promote_types(x.dtype, torch.float32)
    views = _blocks_as_matrices(x, rot) if x.dtype == ct and rot.dtype == ct else None
    if views is None:
        return apply_block_rotation(x, rot.transpose(-1, -2) if transpose else rot)
    xm, rm, order = views
    # R_m (b x b) times the Z vectors of x as columns: MKL's batched GEMM runs this operand order
    # about twice as fast as x_m R_m^T on these small products
    out = torch.bmm(rm.transpose(1, 2) if transpose else rm, xm.transpose(1, 2)).transpose(1, 2)  # (M, Z, b)
    nb, b = rot.shape[-3], rot.shape[-1]
    blocks = x.unflatten(-1, (nb, b))
    if not relayout:
        back = sorted(range(len(order)), key=order.__getitem__)
        return out.view([blocks.shape[d] for d in order] + [b]).permute(*back, -1).flatten(-2)
    result = torch.empty_like(x)
    target = result.unflatten(-1, (nb, b)).permute(*order, -1)
    try:
        target.view(xm.shape).copy_(out)
    except RuntimeError:  # x was not dense: no view of a fresh tensor laid out like it
        return apply_block_rotation(x, rot.transpose(-1, -2) if transpose else rot)
    return result


def block_rotation_grad(grad: torch.Tensor, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Gradient of ``<grad, apply_block_rotation(x, rot)>`` with respect to ``rot``: per block the
    outer product ``grad_i x_j``, summed over the dims ``rot`` broadcasts along (one einsum, no
    per-sample ``b x b`` tensor)."""
    nb, b = rot.shape[-3], rot.shape[-1]
    ct = torch.promote_types(grad.dtype, torch.float32)
    lead = x.dim() - 1
    letters = 'abcdefghklmnopqrstuvwxyz'[:lead + 1]  # x's leading dims and the block index
    aligned = (1,) * (lead + 1 - (rot.dim() - 2)) + tuple(rot.shape[:-2])
    kept = ''.join(c for c, r in zip(letters, aligned) if r != 1)
    g = torch.einsum(f'{letters}i,{letters}j->{kept}ij', grad.to(ct).unflatten(-1, (nb, b)),
                     x.to(ct).unflatten(-1, (nb, b)))
    return g.reshape(rot.shape)


def block_rotation_grad_from_output(grad: torch.Tensor, out: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """`block_rotation_grad` from the rotated ``out = R x`` instead of ``x``: with ``x_z^T = y_z^T R``
    the sum ``sum_z g_z x_z^T`` is ``(sum_z g_z y_z^T) R``, two batched products on views of
    ``grad``, ``out`` and ``rot`` (no ``R^T y`` pass, no relaid copies); einsum when no views exist."""
    ct = torch.promote_types(out.dtype, torch.float32)
    views = _blocks_as_matrices(out, rot) if out.dtype == ct and rot.dtype == ct and grad.dtype == ct else None
    if views is not None:
        om, rm, order = views
        gviews = _blocks_as_matrices(grad, rot, order)
        if gviews is None:  # lay grad out like out (autograd may hand over any layout)
            gviews = _blocks_as_matrices(torch.empty_like(out).copy_(grad), rot, order)
        result = torch.empty_like(rot)
        target = _blocks_as_matrices(out, result, order)
        if gviews is not None and target is not None and target[1].is_contiguous():
            outer = torch.bmm(gviews[0].transpose(1, 2), om)  # (M, b, b): sum_z g_z y_z^T
            torch.bmm(outer, rm, out=target[1])
            return result
    x = apply_block_rotation(out, rot.transpose(-1, -2))
    return block_rotation_grad(grad, x, rot)


def fourier_rotation(x: torch.Tensor, table: torch.Tensor, block: int) -> torch.Tensor:
    """``IFFT(table * FFT(z))`` on each length-``block`` channel block ``z`` of ``x`` (real FFT): the
    rotation by a circulant exponential. ``table`` ``(..., N, blocks * (block // 2 + 1))`` unit complex."""
    if x.numel() == 0:  # an empty batch: MKL's FFT rejects empty input
        return x.clone()
    ct = torch.promote_types(x.dtype, torch.float32)
    spectrum = torch.fft.rfft(x.to(ct).unflatten(-1, (-1, block)), dim=-1)
    spectrum = spectrum * table.unflatten(-1, (spectrum.shape[-2], -1)).to(spectrum.dtype)
    return torch.fft.irfft(spectrum, n=block, dim=-1).flatten(-2).to(x.dtype)


def _flat_view(x: torch.Tensor, groups: Sequence[Sequence[int]]) -> Optional[torch.Tensor]:
    """``x`` permuted to ``(*groups, channels)`` with each group of dims flattened, as a view, or None
    (always while traced: a tracer's strides need not be the run's)."""
    if is_tracing():
        return None
    order = [d for g in groups for d in g] + [x.dim() - 1]
    try:
        return x.permute(order).view(*(math.prod(x.shape[d] for d in g) for g in groups), x.shape[-1])
    except RuntimeError:
        return None


def _mix(x: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """``P x`` with one dense ``P`` per head: ``x`` ``(..., H, N, hd)``, ``mix`` ``(H, hd, hd)``.

    One batched product, batch: the head and whichever dims before it flatten with it; rows: the
    other dims, tokens included. On a view of ``x`` (q and k stacked as a view of their fused
    projection: batch (q/k, head), rows (sample, token)), written in ``x``'s memory order so that
    attention's output keeps the projection's layout; matmul (which copies ``x``) if no view exists.
    """
    x = x.to(mix.dtype)
    if is_tracing():  # the layout search below does not trace; the compiler plans the product itself
        return x @ mix.transpose(-1, -2)
    head, hd = x.dim() - 3, x.shape[-1]
    others = [d for d in range(head) if x.shape[d] != 1]
    candidates = sorted((c for n in range(len(others) + 1) for c in itertools.combinations(others, n)),
                        key=lambda c: math.prod(x.shape[d] for d in c))  # fewest copies of P first
    for extra in candidates:
        batch = sorted([head, *extra], key=lambda d: -x.stride(d))
        rows = sorted((d for d in range(x.dim() - 1) if d not in batch), key=lambda d: -x.stride(d))
        xm = _flat_view(x, [batch, rows])
        if xm is None:
            continue
        sizes = [x.shape[d] if d in extra else 1 for d in range(head)]
        mats = mix.transpose(-1, -2).expand(*sizes, *mix.shape)
        mats = mats.permute(*batch, *(d for d in range(head) if d not in batch), -2, -1).reshape(-1, hd, hd)
        out = torch.empty_like(x)
        target = _flat_view(out, [batch, rows])
        if target is None or (torch.is_grad_enabled() and (x.requires_grad or mix.requires_grad)):
            # autograd cannot write into out=: the product's own layout, permuted back
            order = batch + rows
            y = torch.bmm(xm, mats).view(*(x.shape[d] for d in order), hd)
            return y.permute(*sorted(range(len(order)), key=order.__getitem__), -1)
        torch.bmm(xm, mats, out=target)
        return out
    return x @ mix.transpose(-1, -2)


def _head_outer(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_z a_z b_z^T`` per head over every other dim: ``(..., H, N, d)`` twice -> ``(H, d, d)``,
    one batched product on views when both are laid out alike, einsum otherwise."""
    head = a.dim() - 3
    rows = sorted((d for d in range(a.dim() - 1) if d != head), key=lambda d: -a.stride(d))
    am, bm = _flat_view(a, [[head], rows]), _flat_view(b, [[head], rows])
    if am is None or bm is None:
        return torch.einsum('...hni,...hnj->hij', a, b)
    return torch.bmm(am.transpose(1, 2), bm)


def _mixed_pair_grads(grad: torch.Tensor, out: torch.Tensor, mix: torch.Tensor, angle: torch.Tensor
                      ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``P`` and the angles from ``y = RoPE(r) P x`` itself: with ``h = RoPE^T g`` and
    ``u = RoPE^T y = P x``, ``grad_P = sum_z h_z x_z^T = (sum_z h_z u_z^T) P``; per pair, with
    ``y = u e^(i angle)``, ``grad_angle = Re(conj(g) i y)``, summed where the angles broadcast
    (a complex table gets ``g conj(u)``, autograd's convention)."""
    unit = _unit(angle).conj()
    h, u = apply_pair_rotation(grad, unit), apply_pair_rotation(out, unit)
    grad_mix = _head_outer(h.to(mix.dtype), u.to(mix.dtype)) @ mix
    if angle.is_complex():
        grad_angle = _pairs(grad) * _pairs(u).conj()
    else:
        grad_angle = (_pairs(grad).conj() * _pairs(out)).imag.neg()
    return grad_mix, grad_angle.sum_to_size(angle.shape).to(angle.dtype)


def _mixed_pair(x: torch.Tensor, mix: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Cayley-STRING's ``RoPE(r) P x``; the pair rotation in place unless autograd tracks ``P x``."""
    y = _mix(x, mix)
    if torch.is_grad_enabled() and y.requires_grad:
        return apply_pair_rotation(y, _unit(angle)).to(x.dtype)
    pairs = _pairs(y)  # y is fresh, dense and float (mix's dtype): a view, rotated in place
    pairs.mul_(_unit(angle).to(pairs.dtype))
    return y.to(x.dtype)


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


def _unit(angle: torch.Tensor) -> torch.Tensor:
    return angle if angle.is_complex() else rotation_table(angle)


def angle_tables(angles: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
    """Per-layer rotation angles as their unit complex tables when no gradient is wanted (eval,
    where the state is cached: cos / sin once, not in every layer of every forward); unchanged
    otherwise."""
    if torch.is_grad_enabled():
        return tuple(angles)
    return tuple(rotation_table(a) for a in angles)


# ``table``: a complex pair table as RoPE builds it (YaRN scales its magnitude, so there
# R^-1 != R^T). ``pair`` / ``fourier``: real angles (training keeps half the bytes per rotation), or
# their unit complex table (`angle_tables`: eval, built once into the cached state). ``block``:
# b x b matrices. ``mixed_pair``: Cayley-STRING's RoPE(r) P x, P orthogonal and dense per head.
_KERNELS: Dict[str, RotationKind] = {
    'table': RotationKind(lambda x, table, block: apply_pair_rotation(x, table),
                          lambda y, table, block: apply_pair_rotation(y, table.conj()),
                          lambda y, table, block: apply_pair_rotation(y, table.reciprocal())),
    'pair': RotationKind(lambda x, angle, block: apply_pair_rotation(x, _unit(angle)),
                         lambda y, angle, block: apply_pair_rotation(y, _unit(angle).conj())),
    'block': RotationKind(lambda x, rot, block: rotate_blocks(x, rot),
                          lambda y, rot, block: rotate_blocks(y, rot, transpose=True, relayout=False),
                          param_grads=lambda grad, out, rot, block: (block_rotation_grad_from_output(grad, out, rot),),
                          reads_views=False),
    'fourier': RotationKind(lambda x, angle, block: fourier_rotation(x, _unit(angle), block),
                            lambda y, angle, block: fourier_rotation(y, _unit(angle).conj(), block),
                            reads_views=False),
    'mixed_pair': RotationKind(
        lambda x, mix, angle, block: _mixed_pair(x, mix, angle),
        lambda y, mix, angle, block: _mix(apply_pair_rotation(y, _unit(angle).conj()), mix.transpose(-1, -2)).to(y.dtype),
        param_grads=lambda grad, out, mix, angle, block: _mixed_pair_grads(grad, out, mix, angle)),
}


def _rotated_width(kind: str, params: Sequence[torch.Tensor], hd: int) -> int:
    """Channels a rotation covers: whole ``b x b`` blocks for kind ``block`` (LieRE when ``gd`` does
    not divide the head dim; the rest pass through), all of them otherwise."""
    return params[0].shape[-3] * params[0].shape[-1] if kind == 'block' else hd


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
    kernel = _KERNELS[kind].forward
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
        kernels = _KERNELS[ctx.kind]
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


def _fused(kind: str, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]) -> bool:
    """Whether this rotation runs the fused kernels (see `FUSED`)."""
    if FUSED not in ('auto', 'on', 'off'):
        raise ValueError(f"vispe.encodings.rotary.FUSED must be 'auto', 'on' or 'off', got {FUSED!r}")
    if FUSED == 'off' or (FUSED == 'auto' and not inputs[0].is_cuda) or len(params) != 1 or is_tracing():
        return False
    return _triton_rotary.supported(kind, inputs, params[0])


def _rotate(inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor], kind: str, block: int
            ) -> Tuple[torch.Tensor, ...]:
    if _fused(kind, inputs, params):
        return _triton_rotary.rotate(inputs, params[0], kind)
    # traced, autograd runs through the reference kernels: the compiler decides what to save itself
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *params)) and not is_tracing():
        out = _SavedOutputRotation.apply(kind, block, len(inputs), *inputs, *params)
        return (out,) if len(inputs) == 1 else out
    out = _forward(kind, block, _stack(inputs, as_view=_KERNELS[kind].reads_views), params, keep_layout=False)
    return (out,) if len(inputs) == 1 else out.unbind(0)


def orthogonal_map(x: torch.Tensor, kind: str, *params: torch.Tensor, block: int = 0) -> torch.Tensor:
    """Rotate ``x`` ``(..., N, hd)`` by a rotation of ``kind`` (``table`` complex pairs, ``pair``
    angles, ``block`` matrices, ``fourier`` angles, ``mixed_pair`` matrix and angles); channels
    beyond whole ``b x b`` blocks pass through. Memory-lean under autograd (keeps only the output)."""
    return _rotate((x,), params, kind, block)[0]


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rot_q: Any, rot_k: Any, kind: str, block: int = 0
              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`orthogonal_map` q and k; in self-attention (one rotation for both) as a single call on
    ``stack(q, k)``, which halves the kernel launches and widens the small per-position products.
    ``rot_q`` / ``rot_k``: a tensor, or a tuple of tensors for the multi-parameter kinds."""
    params_q = rot_q if isinstance(rot_q, tuple) else (rot_q,)
    params_k = rot_k if isinstance(rot_k, tuple) else (rot_k,)
    if q.shape == k.shape and all(a is b for a, b in zip(params_q, params_k)):
        return _rotate((q, k), params_q, kind, block)
    return _rotate((q,), params_q, kind, block)[0], _rotate((k,), params_k, kind, block)[0]


def check_head_dim(name: str, head_dim: int, multiple: int, why: str) -> None:
    """Raise a clear error when an encoding cannot use ``head_dim``."""
    if head_dim % multiple:
        raise ValueError(f'encoding {name!r} needs head_dim divisible by {multiple} ({why}), got head_dim={head_dim}')


def per_axis(value, num_axes: int, what: str) -> Sequence:
    """Broadcast a scalar option to one value per axis."""
    if isinstance(value, (tuple, list)):
        if len(value) != num_axes:
            raise ValueError(f'{what} has {len(value)} values but positions have {num_axes} axes')
        return tuple(value)
    return (value,) * num_axes
