"""Fused Triton kernels for the pair and block rotations of `vispe.rotary` (kinds ``table``,
``half_table``, ``pair``, ``block``, ``matrix``).

On a GPU the reference rotations of `kernels` are launch-bound: a rotation of q and k costs 20-40
small kernels (complex views, products, casts, concatenations, copies into a stack, and as many
again in backward). Here each direction is one launch of `_rotation_kernel`:

* forward: ``R x`` for q and k together (the members of one launch share the rotation), read in
  whatever strided layout they come in (notably as two views of timm's fused qkv projection,
  ``qkv.reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)``) and written, stacked, in q's memory order
  with channels last: the contract of ``autograd._forward(keep_layout=True)``, so that SDPA's output
  and the projection after it keep the fused projection's layout;
* backward: ``grad_x = R^T grad`` (the same kernel, transposed rotation) and, in the same pass, the
  rotation's gradient from the saved output ``y = R x`` (never ``x`` itself, as in
  ``autograd._SavedOutputRotation``), reduced in-kernel over the dims the rotation broadcasts along
  (batch, q / k, shared heads) into a few partial sums that torch adds up.

Conventions of the reference kept exactly: interleaved pairs ``(2j, 2j + 1)``, or rotate-half pairs
``(j, j + P)`` of the first ``2P`` channels (``half_table``: LLM code, timm's ``rotate_half``, PRoPE),
pair ``j`` multiplied by table entry ``j`` either way; a complex table may have magnitude != 1 (YaRN),
so its adjoint is the conjugate and its gradient ``grad * conj(x)`` with ``x = y / table``; angles'
gradient ``Re(conj(grad) i y)``; block ``j`` of ``b`` channels multiplied by ``rot[..., j, :, :]``, its
adjoint ``R^T``, its gradient ``sum_z g_z x_z^T``: ``(sum_z g_z y_z^T) R`` for orthogonal blocks
(``block``, ``x = R^T y``), ``(sum_z g_z y_z^T) R^-T`` for any invertible ones (``matrix``: GTA's
scaled SE(3), PRoPE's projective maps; ``x = R^-1 y``), the kernel computing the same sum for both;
channels beyond the rotated width (partial rotary, LieRE's leftover channels) pass through; prefix
tokens need nothing here (their rows of the table or blocks are the identity). Products in float32,
results in the activation dtype.

Each program takes ``BLOCK_N`` tokens of one (batch, head) slice where the rotation varies and loops
over the slices it broadcasts along: the rotation is loaded once per program and the parameter
gradient accumulates in registers. Every channel ``c`` is computed as a ``b``-term dot product of its
block's matrix row with the block's channels (pairs: ``b = 2``, the matrix built from cos / sin or the
complex entry), so one code path serves pairs, blocks, their transposes and the pass-through; the two
pair layouts differ only in the stride between a pair's channels (1 or ``P``), hence in which channel
each matrix column reads and which table entry a channel uses.

Importable without triton (`AVAILABLE` is then False and nothing is launched).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference kernels of `kernels` serve alone
    triton = tl = None

__all__ = ['AVAILABLE', 'INNER_DIMS', 'supported', 'rotate', 'rotate_members']

AVAILABLE = triton is not None
# without triton the kernel is a plain function that `supported` never lets run (annotations are strings)
_jit = triton.jit if AVAILABLE else (lambda fn: fn)

_ACTIVATIONS = (torch.float16, torch.bfloat16, torch.float32)
_ROTATION_DTYPES = {'table': (torch.complex64,), 'half_table': (torch.complex64,),
                    'pair': (torch.float32, torch.complex64), 'block': (torch.float32,), 'matrix': (torch.float32,)}
_BLOCK_KINDS = ('block', 'matrix')  # rot (..., N, nb, b, b); the pair kinds: (..., N, P)
# each kind's rotation dims after the token dim
INNER_DIMS = {kind: 3 if kind in _BLOCK_KINDS else 1 for kind in _ROTATION_DTYPES}
_BLOCK_SIZES = (2, 4, 8)  # larger blocks would need b^2 registers per channel
# gathered elements per program and member, BLOCK_N * BLOCK_C * b, halved with the parameter gradient's
# temporaries: at most ~110 registers a thread on sm_90 (ptxas, 4 warps), no spills
_TILE = 1024
_COMPLEX, _ANGLE, _BLOCK = 0, 1, 2  # how the kernel reads the rotation


@_jit
def _rotation_kernel(
        X0, X1, sx0b, sx0h, sx0n, sx0c, sx1b, sx1h, sx1n, sx1c,  # members (q, k or their gradients), (B, H, N, C)
        Y0, Y1, sy0b, sy0h, sy0n, sy0c, sy1b, sy1h, sy1n, sy1c,  # saved outputs R x (parameter gradients only)
        OUT, sos, sob, soh, son, soc,  # (S, B, H, N, C)
        ROT, srb, srh, srn, sr1, sr2, sr3,  # rotation at (b, h, n); sr1-3: pair / re-im, or block / row / column
        PARTIAL,  # (chunks, MB * MH, N, Q) float32 partial sums of the parameter gradient
        N, C, W, MH, ZH, Z, ZPP,
        KIND: tl.constexpr, BLK: tl.constexpr, HALF: tl.constexpr, S: tl.constexpr, TRANSPOSE: tl.constexpr,
        WRITE_OUT: tl.constexpr, PARAM_GRAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """``OUT[s] = R X_s`` (``R^T`` with TRANSPOSE) and, with PARAM_GRAD, the rotation's gradient from
    ``X_s`` (the output's gradient) and ``Y_s = R x_s``, summed over this program's chunk of ``Z``.

    Grid: (token blocks, MB * MH slices where the rotation varies, chunks of the Z = ZB * ZH slices it
    broadcasts along; ``b = mb + zb`` and ``h = mh + zh``, one term of each sum always 0). HALF: pairs
    ``(j, j + W / 2)`` instead of ``(2j, 2j + 1)`` (pair kinds only)."""
    m = tl.program_id(1)
    chunk = tl.program_id(2)
    mb = m // MH
    mh = m % MH
    n2 = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]  # (BLOCK_N, 1)
    c2 = tl.arange(0, BLOCK_C)[None, :]  # (1, BLOCK_C)
    # the channels of one pair or block lie `step` apart: 1, or W / 2 for rotate-half pairs; beyond the
    # rotated width the same formulas put column i2 at c itself (the identity's 1) and the other, whose
    # entry is 0, at c +- W / 2: never negative, masked where >= C
    step = W // 2 if HALF else 1
    i2 = (c2 // step) % BLK  # row of the matrix: c's place in its pair or block
    pair = c2 % step if HALF else c2 // 2  # the table entry of c's pair (pair kinds)
    c3 = c2[:, :, None]
    i3 = i2[:, :, None]
    k3 = tl.arange(0, BLK)[None, None, :]  # column of the matrix row, i.e. channel k of c's block
    src = c3 + (k3 - i3) * step  # the channel that column k reads
    n64 = n2.to(tl.int64)
    rows = n2 < N
    rotated = rows & (c2 < W)

    # the rotation of this program's tokens, as each channel's matrix row: (BLOCK_N, BLOCK_C, BLK)
    rot = ROT + mb.to(tl.int64) * srb + mh.to(tl.int64) * srh + n64 * srn
    if KIND == 2:
        cols = k3 * sr2 + i3 * sr3 if TRANSPOSE else i3 * sr2 + k3 * sr3
        mat = tl.load(rot[:, :, None] + (c3 // BLK) * sr1 + cols, mask=rotated[:, :, None], other=0.0)
        mat = mat.to(tl.float32)
    else:
        if KIND == 0:
            tr = tl.load(rot + pair * sr1, mask=rotated, other=0.0).to(tl.float32)
            ti = tl.load(rot + pair * sr1 + sr2, mask=rotated, other=0.0).to(tl.float32)
        else:
            angle = tl.load(rot + pair * sr1, mask=rotated, other=0.0).to(tl.float32)
            tr = tl.cos(angle)
            ti = tl.sin(angle)
        sin = -ti if TRANSPOSE else ti
        # [[re, -im], [im, re]]: the product by re + i im on the pair (x_2j, x_2j+1) or (x_j, x_j+P)
        mat = tl.where(k3 == i3, tr[:, :, None], tl.where(i3 == 0, -sin[:, :, None], sin[:, :, None]))
    mat = tl.where(c3 < W, mat, (k3 == i3).to(tl.float32))  # pass-through channels: the identity

    gather = rows[:, :, None] & (c3 < C) & (src < C)
    if PARAM_GRAD:
        if KIND == 2:
            acc = tl.zeros([BLOCK_N, BLOCK_C, BLK], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_N, BLOCK_C], dtype=tl.float32)
    for z in range(chunk * ZPP, tl.minimum(chunk * ZPP + ZPP, Z)):
        zb = z // ZH
        b = (mb + zb).to(tl.int64)
        h = (mh + z - zb * ZH).to(tl.int64)
        for s in tl.static_range(S):
            if s == 0:
                xg = tl.load(X0 + b * sx0b + h * sx0h + n64[:, :, None] * sx0n + src * sx0c, mask=gather, other=0.0)
            else:
                xg = tl.load(X1 + b * sx1b + h * sx1h + n64[:, :, None] * sx1n + src * sx1c, mask=gather, other=0.0)
            xg = xg.to(tl.float32)
            if WRITE_OUT:
                out = OUT + s * sos + b * sob + h * soh + n64 * son + c2 * soc
                tl.store(out, tl.sum(mat * xg, axis=2).to(OUT.dtype.element_ty), mask=rows & (c2 < C))
            if PARAM_GRAD:
                if s == 0:
                    yg = tl.load(Y0 + b * sy0b + h * sy0h + n64[:, :, None] * sy0n + src * sy0c, mask=gather, other=0.0)
                else:
                    yg = tl.load(Y1 + b * sy1b + h * sy1h + n64[:, :, None] * sy1n + src * sy1c, mask=gather, other=0.0)
                yg = yg.to(tl.float32)
                if KIND == 2:  # sum_z g_z y_z^T per block: g at row c, y at column k
                    acc += tl.sum(tl.where(k3 == i3, xg, 0.0), axis=2)[:, :, None] * yg
                else:
                    gr = tl.sum(tl.where(k3 == 0, xg, 0.0), axis=2)
                    gi = tl.sum(tl.where(k3 == 1, xg, 0.0), axis=2)
                    yr = tl.sum(tl.where(k3 == 0, yg, 0.0), axis=2)
                    yi = tl.sum(tl.where(k3 == 1, yg, 0.0), axis=2)
                    if KIND == 0:  # grad * conj(x), x = y / t: the real part at a pair's first channel
                        norm = tl.where(rotated, tr * tr + ti * ti, 1.0)  # masked lanes hold 0 + 0i
                        xr = (yr * tr + yi * ti) / norm
                        xi = (yi * tr - yr * ti) / norm
                        acc += tl.where(i2 == 0, gr * xr + gi * xi, gi * xr - gr * xi)
                    else:  # Re(conj(g) i y)
                        acc += gi * yr - gr * yi
    if PARAM_GRAD:
        row = (chunk.to(tl.int64) * tl.num_programs(1) + m) * N + n64
        if KIND == 2:
            tl.store(PARTIAL + row[:, :, None] * (W * BLK) + c3 * BLK + k3, acc, mask=rotated[:, :, None])
        elif KIND == 0:  # (re, im) of entry `pair`
            tl.store(PARTIAL + row * W + 2 * pair + i2, acc, mask=rotated)
        else:
            tl.store(PARTIAL + row * (W // 2) + pair, acc, mask=rotated & (i2 == 0))


def _rotation_view(kind: str, rot: torch.Tensor) -> Tuple[int, torch.Tensor, int, int, bool]:
    """(kernel kind, ``rot`` as a real ``(MB, MH, N, ...)`` view, block size, rotated width, whether
    the pairs are rotate-half ones)."""
    if kind in _BLOCK_KINDS:
        return _BLOCK, rot[(None,) * (6 - rot.dim())], rot.shape[-1], rot.shape[-3] * rot.shape[-1], False
    real = torch.view_as_real(rot.resolve_conj()) if rot.is_complex() else rot
    code = _COMPLEX if rot.is_complex() else _ANGLE
    return code, real[(None,) * (4 - rot.dim())], 2, 2 * rot.shape[-1], kind == 'half_table'


def supported(kind: str, inputs: Sequence[torch.Tensor], rot: torch.Tensor) -> bool:
    """Whether `rotate` handles these inputs (the reference kernels serve the rest): kinds ``table`` and
    ``half_table`` (complex64), ``pair`` (float32 angles or their complex64 table), ``block`` and
    ``matrix`` (float32 ``b x b``, ``b`` in 2, 4, 8); float16 / bfloat16 / float32 inputs
    ``([[B,] H,] N, hd)`` on ``rot``'s device (a GPU: compute capability 7.0 or newer); ``rot``
    ``([[B,] H,] N, ...)`` varying at most along the inputs' batch, heads and tokens, rotating at least
    one channel."""
    x = inputs[0]
    if not AVAILABLE or kind not in _ROTATION_DTYPES or not 2 <= x.dim() <= 4 or x.numel() == 0:
        return False
    if x.is_cuda and torch.cuda.get_device_capability(x.device) < (7, 0):  # older than Triton compiles for
        return False
    if x.dtype not in _ACTIVATIONS or rot.dtype not in _ROTATION_DTYPES[kind] or any(
            t.shape != x.shape or t.dtype != x.dtype or t.device != rot.device for t in inputs):
        return False
    blocks = kind in _BLOCK_KINDS
    inner = INNER_DIMS[kind]
    if rot.dim() <= inner or rot.dim() > inner + 3 or rot.shape[-inner - 1] != x.shape[-2]:
        return False
    if blocks and (rot.shape[-1] not in _BLOCK_SIZES or rot.shape[-2] != rot.shape[-1]):
        return False
    x_lead = ((1, 1) + tuple(x.shape[:-2]))[-2:]
    rot_lead = ((1, 1) + tuple(rot.shape[:-inner - 1]))[-2:]
    width = rot.shape[-3] * rot.shape[-1] if blocks else 2 * rot.shape[-1]
    # rot_lead: the (batch, head) slices where it varies, the grid's second axis (< 2^16); width 0 would
    # leave rotate-half pairs no stride
    return (all(r in (1, n) for r, n in zip(rot_lead, x_lead)) and math.prod(rot_lead) < 2 ** 16
            and 0 < width <= x.shape[-1])


def _stacked_like(x: torch.Tensor, count: int) -> torch.Tensor:
    """An empty ``(count, *x.shape)``: the stack outermost, then ``x``'s dims in its memory order,
    channels last (`autograd._stack`'s layout)."""
    order = sorted(range(x.dim() - 1), key=lambda d: -x.stride(d)) + [x.dim() - 1]
    out = x.new_empty([count] + [x.shape[d] for d in order])
    return out.permute(0, *(1 + order.index(d) for d in range(x.dim())))


def _z_chunks(programs: int, z: int, device: torch.device) -> int:
    """Chunks the broadcast slices are split into: about 8 programs per SM (enough resident warps to
    hide memory latency), each looping over as many slices as that leaves (reusing its rotation and
    adding fewer partial sums of the parameter gradient). On the CPU (Triton's interpreter, tests)
    8 programs, so that the chunked reduction is exercised on small inputs."""
    target = 8 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == 'cuda' else 8
    return max(1, min(z, triton.cdiv(target, programs)))


def _members(ts: Sequence[torch.Tensor]) -> list:
    """Kernel arguments of one or two ``(B, H, N, C)`` members: both pointers, then both strides."""
    first, second = ts[0], ts[-1]
    return [first, second, *first.stride(), *second.stride()]


def _launch(kind: str, rot: torch.Tensor, xs: Sequence[torch.Tensor], transpose: bool, write_out: bool,
            ys: Sequence[torch.Tensor] = ()) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """One launch over the members ``xs`` (``(..., N, C)``, at most 4 dims, one shape): their rotation
    stacked ``(len(xs), *shape)`` if ``write_out``, and, given the outputs ``ys`` of the forward (``xs``
    then being their gradients), the rotation's gradient (float32 or complex64, ``rot``'s shape)."""
    code, view, blk, width, half = _rotation_view(kind, rot)
    shape = xs[0].shape
    xs4 = [t[(None,) * (4 - t.dim())] for t in xs]
    batch, heads, n, c = xs4[0].shape
    mb, mh = view.shape[0], view.shape[1]
    zb, zh = (batch if mb == 1 else 1), (heads if mh == 1 else 1)
    block_c = triton.next_power_of_2(c)
    block_n = max(1, min(64, (_TILE // 2 if ys else _TILE) // (block_c * blk)))
    tiles = triton.cdiv(n, block_n) * mb * mh
    chunks = _z_chunks(tiles, zb * zh, xs[0].device)
    per_chunk = triton.cdiv(zb * zh, chunks)
    chunks = triton.cdiv(zb * zh, per_chunk)
    out = _stacked_like(xs4[0], len(xs)) if write_out else None
    width_q = {_BLOCK: width * blk, _COMPLEX: width, _ANGLE: width // 2}[code]
    partial = xs[0].new_empty(chunks, mb * mh, n, width_q, dtype=torch.float32) if ys else None
    inner = list(view.stride()[3:]) + [0] * (6 - view.dim())
    _rotation_kernel[(triton.cdiv(n, block_n), mb * mh, chunks)](
        *_members(xs4), *_members([t[(None,) * (4 - t.dim())] for t in ys] if ys else xs4),
        *((out, *out.stride()) if out is not None else (xs4[0], 0, 0, 0, 0, 0)),
        view, *view.stride()[:3], *inner,
        partial if partial is not None else xs4[0],
        n, c, width, mh, zh, zb * zh, per_chunk,
        KIND=code, BLK=blk, HALF=half, S=len(xs), TRANSPOSE=transpose, WRITE_OUT=write_out, PARAM_GRAD=bool(ys),
        BLOCK_N=block_n, BLOCK_C=block_c)
    if out is not None:
        out = out.view(len(xs), *shape)
    if partial is None:
        return out, None
    grad = partial.sum(0).view(mb, mh, n, *view.shape[3:])
    if kind == 'block':  # sum_z g_z x_z^T = (sum_z g_z y_z^T) R, x_z = R^T y_z
        grad = grad @ view
    elif kind == 'matrix':
        # x_z = R^-1 y_z: (sum_z g_z y_z^T) R^-T, solved; the _ex form skips the singularity check's host sync
        grad = torch.linalg.solve_ex(view.mT, grad, left=False).result
    elif code == _COMPLEX:
        grad = torch.view_as_complex(grad)
    return out, grad.reshape(rot.shape)


class _FusedRotation(torch.autograd.Function):
    """`autograd._SavedOutputRotation` on the fused kernels: ``x -> R x`` for one or two members sharing
    ``rot``, keeping only ``R x`` and ``rot``; backward is one launch for ``R^T grad`` and ``rot``'s
    gradient together."""

    @staticmethod
    def forward(ctx, kind, count, *args):
        inputs, rot = args[:count], args[count]
        out, _ = _launch(kind, rot, inputs, transpose=False, write_out=True)
        ctx.save_for_backward(out, rot)
        ctx.kind, ctx.count = kind, count
        return out[0] if count == 1 else tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        out, rot = ctx.saved_tensors
        present = [i for i, g in enumerate(grads) if g is not None]
        need_x = any(ctx.needs_input_grad[2 + i] for i in present)
        need_rot = ctx.needs_input_grad[2 + ctx.count]
        grads_x, grad_rot = [None] * ctx.count, None
        if present and (need_x or need_rot):
            rotated, grad_rot = _launch(ctx.kind, rot, [grads[i] for i in present], transpose=True, write_out=need_x,
                                        ys=[out[i] for i in present] if need_rot else ())
            for i, g in zip(present, rotated.unbind(0) if need_x else ()):
                grads_x[i] = g
        return (None, None, *grads_x, grad_rot)


def rotate_members(inputs: Sequence[torch.Tensor], rot: torch.Tensor, kind: str) -> torch.Tensor:
    """``R x`` for one or two (`supported`) inputs in one launch, stacked ``(len(inputs), *shape)`` and
    laid out like the first input (channels last); outside autograd (a step of a larger rotation's
    forward or backward, such as Cayley-STRING's RoPE part)."""
    return _launch(kind, rot, inputs, transpose=False, write_out=True)[0]


def rotate(inputs: Sequence[torch.Tensor], rot: torch.Tensor, kind: str) -> Tuple[torch.Tensor, ...]:
    """``R x`` for each input (`supported` ones), in one launch, memory-lean under autograd; the
    outputs are views of one stacked tensor laid out like the first input (channels last)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, rot)):
        out = _FusedRotation.apply(kind, len(inputs), *inputs, rot)
        return (out,) if len(inputs) == 1 else out
    return tuple(rotate_members(inputs, rot, kind).unbind(0))
