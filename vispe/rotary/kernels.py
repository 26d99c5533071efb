"""Reference rotation kernels: what a rotation of each kind does to ``(..., N, hd)`` q, k, v or o.

Precision: angles and matrices are applied in float32 (float64 inputs stay float64) and the result
is cast back to the activation dtype. Two pair layouts exist in the field:

* ``'interleaved'``: pairs ``(2j, 2j + 1)`` (RoPE-ViT, timm's vision RoPE, GTA, ComRoPE);
* ``'half'``: pairs ``(j, j + hd/2)`` (rotate-half, the layout of LLM code: Llama, Qwen2-VL; PRoPE).

Kinds of rotation: complex pair tables (`apply_pair_rotation`), ``b x b`` blocks
(`apply_block_rotation`, `rotate_blocks` on views of q and k where their layout allows), circulant
blocks through the FFT (`fourier_rotation`) and Cayley-STRING's dense ``P`` before pairs
(`mixed_pair`), with the gradients the memory-lean backward of `autograd` takes from the rotated
output. Prefix tokens get identity rows (`pad_identity`).
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union

import torch

from .._dtypes import compute_dtype
from .._tracing import is_tracing

__all__ = [
    'PairLayout', 'rotation_table', 'unit_table', 'pad_identity', 'block_matrices',
    'apply_pair_rotation', 'apply_block_rotation', 'rotate_blocks', 'block_rotation_grad',
    'block_rotation_grad_from_output', 'fourier_rotation', 'mixed_pair', 'mixed_pair_adjoint', 'mixed_pair_grads',
]

PairLayout = Literal['interleaved', 'half']
PairRotation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x, table) -> R x`` by a complex table of interleaved pairs, as `apply_pair_rotation`."""

def rotation_table(angles: torch.Tensor, magnitude: Union[float, torch.Tensor] = 1.0) -> torch.Tensor:
    """Complex numbers ``magnitude * exp(i * angles)`` (complex64) for `apply_pair_rotation`.

    ``magnitude`` (a scalar or a tensor broadcastable to ``angles``) is 1 except for YaRN.
    """
    angles = angles.to(torch.promote_types(angles.dtype, torch.float32))  # float64 stays float64
    return torch.polar(torch.ones_like(angles) * magnitude, angles)


def unit_table(angle: torch.Tensor) -> torch.Tensor:
    """Angles as their unit complex table; a complex table is returned as it is."""
    return angle if angle.is_complex() else rotation_table(angle)


def pad_identity(rot: torch.Tensor, num_prefix: int, kind: str, after: int = 0) -> torch.Tensor:
    """Prepend identity rotations for ``num_prefix`` prefix tokens along the token axis (and append
    ``after`` more: the padding tokens of a NaFlex sample): ones of a complex table (kinds ``table`` /
    ``half_table``, ``(..., N, P)``), zero angles (``pair`` / ``fourier``, ``(..., N, P)``), identity
    ``b x b`` blocks (``block`` / ``matrix``, ``(..., N, nb, b, b)``, keeping ``rot``'s memory layout)."""
    if num_prefix == 0 and after == 0:
        return rot
    if kind in ('block', 'matrix'):
        if is_tracing():  # symbolic strides have no order to sort by; the compiler lays the result out itself
            eye = torch.eye(rot.shape[-1], dtype=rot.dtype, device=rot.device)
            return torch.cat([eye.expand(*rot.shape[:-4], num_prefix, *rot.shape[-3:]), rot,
                              eye.expand(*rot.shape[:-4], after, *rot.shape[-3:])], -4)
        shape = list(rot.shape)
        shape[-4] += num_prefix + after
        order = sorted(range(rot.dim()), key=lambda d: -rot.stride(d))  # rot's memory order
        out = rot.new_empty([shape[d] for d in order]).permute(*sorted(range(rot.dim()), key=order.__getitem__))
        eye = torch.eye(rot.shape[-1], dtype=rot.dtype, device=rot.device)
        out.narrow(-4, 0, num_prefix).copy_(eye)
        out.narrow(-4, num_prefix, rot.shape[-4]).copy_(rot)
        out.narrow(-4, num_prefix + rot.shape[-4], after).copy_(eye)
        return out
    if kind not in ('table', 'half_table', 'pair', 'fourier'):
        raise ValueError(f"kind must be one of ('table', 'half_table', 'pair', 'fourier', 'block', 'matrix'), "
                         f'got {kind!r}')

    def fill(count: int) -> torch.Tensor:
        shape = list(rot.shape)
        shape[-2] = count
        return rot.new_ones(shape) if kind in ('table', 'half_table') else rot.new_zeros(shape)

    parts = ([fill(num_prefix)] if num_prefix else []) + [rot] + ([fill(after)] if after else [])
    return torch.cat(parts, dim=-2)


def block_matrices(mats: torch.Tensor, channels: int, batched: bool, num_prefix: int = 0) -> torch.Tensor:
    """Per-token ``(..., N, b, b)`` matrices acting on every block of ``b`` channels, as the
    ``(..., [B, 1,] num_prefix + N, channels / b, b, b)`` blocks `apply_block_rotation` takes: identity
    rows for the prefix tokens, then the same matrix for each block of a token (an expanded view, no
    copy); per-sample matrices get a head axis to broadcast over (GTA's and PRoPE's camera maps)."""
    b = mats.shape[-1]
    mats = pad_identity(mats.unsqueeze(-3), num_prefix, 'block')
    mats = mats.expand(*mats.shape[:-3], channels // b, b, b)
    return mats.unsqueeze(-5) if batched else mats


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


def _rotate_half(x: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """``cat(x1 cos - x2 sin, x2 cos + x1 sin)`` (rotate-half pairs ``(x1_j, x2_j)``, the halves of ``x``, by the
    complex ``rot``), each product and sum rounded as written, the halves written in place into one output laid
    out as ``x`` (where ``rot`` does not widen it): no concatenation pass, no copy back into ``x``'s layout for
    autograd's saved output, and cos / sin as dense tables rather than strided views of the complex one (about
    half the time of the plain expression on CPU, the same numbers bit for bit)."""
    if is_tracing() or torch.is_grad_enabled() and (x1.requires_grad or x2.requires_grad or rot.requires_grad):
        # the compiler fuses the expression itself; autograd differentiates it (writes into views it cannot)
        return torch.cat([x1 * rot.real - x2 * rot.imag, x2 * rot.real + x1 * rot.imag], -1)
    cos, sin = rot.real.contiguous(), rot.imag.contiguous()
    shape = torch.broadcast_shapes(x1.shape, cos.shape)
    if shape == x1.shape:  # x's memory order where it is dense (else contiguous)
        out = torch.empty_like(x, dtype=x1.dtype)
    else:
        out = x1.new_empty(*shape[:-1], 2 * shape[-1])
    first, second = out[..., :shape[-1]], out[..., shape[-1]:]
    torch.mul(x1, cos, out=first)
    first.sub_(x2 * sin)
    torch.mul(x2, cos, out=second)
    second.add_(x1 * sin)
    return out


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
        raise ValueError(f'the rotation table has {pairs} channel pairs ({2 * pairs} channels) but the tensor it '
                         f'rotates {tuple(x.shape)} has head dim {hd}; q and k need the head dim the encoding was '
                         f'built for')
    if layout == 'interleaved':
        rotated, rest = (x, None) if 2 * pairs == hd else (x[..., :2 * pairs], x[..., 2 * pairs:])
        out = torch.view_as_real(_pairs(rotated) * rot).flatten(-2).to(x.dtype)
    elif layout == 'half':  # GPT-NeoX partial rotary: the first 2P channels, pairs (j, j + P)
        rotated, rest = (x, None) if 2 * pairs == hd else (x[..., :2 * pairs], x[..., 2 * pairs:])
        out = _rotate_half(rotated, rotated[..., :pairs].to(ct), rotated[..., pairs:].to(ct), rot).to(x.dtype)
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
    if is_tracing():
        # a compiler fuses the broadcast product and its sum into one pass over x and rot (einsum's
        # batched product would copy x into its layout and back, about twice the time compiled)
        return (rot.to(ct) * xb.unsqueeze(-2)).sum(-1).flatten(-2).to(x.dtype)
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


def mixed_pair_grads(grad: torch.Tensor, out: torch.Tensor, mix: torch.Tensor, angle: torch.Tensor,
                     rotate_pairs: Optional[PairRotation] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``P`` and the angles from ``y = RoPE(r) P x`` itself: with ``h = RoPE^T g`` and
    ``u = RoPE^T y = P x``, ``grad_P = sum_z h_z x_z^T = (sum_z h_z u_z^T) P``; per pair, with
    ``y = u e^(i angle)``, ``grad_angle = Re(conj(g) i y)``, summed where the angles broadcast
    (a complex table gets ``g conj(u)``, autograd's convention). ``rotate_pairs`` replaces
    `apply_pair_rotation` for the RoPE part (a fused kernel)."""
    unit = unit_table(angle).conj()
    rotate_pairs = rotate_pairs or apply_pair_rotation
    h, u = rotate_pairs(grad, unit), rotate_pairs(out, unit)
    grad_mix = _head_outer(h.to(mix.dtype), u.to(mix.dtype)) @ mix
    if angle.is_complex():
        grad_angle = _pairs(grad) * _pairs(u).conj()
    else:
        grad_angle = (_pairs(grad).conj() * _pairs(out)).imag.neg()
    return grad_mix, grad_angle.sum_to_size(angle.shape).to(angle.dtype)


def mixed_pair(x: torch.Tensor, mix: torch.Tensor, angle: torch.Tensor,
               rotate_pairs: Optional[PairRotation] = None) -> torch.Tensor:
    """Cayley-STRING's ``RoPE(r) P x``; the pair rotation by ``rotate_pairs`` if given (a fused
    kernel), else in place unless autograd tracks ``P x``."""
    y = _mix(x, mix)
    if rotate_pairs is not None:
        return rotate_pairs(y, unit_table(angle)).to(x.dtype)
    if torch.is_grad_enabled() and y.requires_grad:
        return apply_pair_rotation(y, unit_table(angle)).to(x.dtype)
    pairs = _pairs(y)  # y is fresh, dense and float (mix's dtype): a view, rotated in place
    pairs.mul_(unit_table(angle).to(pairs.dtype))
    return y.to(x.dtype)


def mixed_pair_adjoint(y: torch.Tensor, mix: torch.Tensor, angle: torch.Tensor,
                       rotate_pairs: Optional[PairRotation] = None) -> torch.Tensor:
    """``P^T RoPE(r)^T y``, the transpose of `mixed_pair`."""
    rotated = (rotate_pairs or apply_pair_rotation)(y, unit_table(angle).conj())
    return _mix(rotated, mix.transpose(-1, -2)).to(y.dtype)
