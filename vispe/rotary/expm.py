"""Matrix exponentials of the learned rotations: ``R(p) = exp(sum_d p_d A_d)`` with skew-symmetric,
block-diagonal generators ``A_d`` (``b x b`` blocks; LieRE, ComRoPE, Circulant-STRING's rates).

* `expm_skew`: ``exp`` of a batch of small skew-symmetric matrices (scaling and squaring of a
  degree-12 Taylor polynomial; closed form for ``2 x 2``), faster than `torch.linalg.matrix_exp`;
* `linear_exp`: ``exp(sum_d p_d A_d)`` at every position at once: plane-rotation angles when
  ``b = 2`` (a learned-frequency RoPE, cos / sin in closed form), else ``b x b`` blocks whose Taylor
  part is one GEMM over monomials of the coordinates followed by a few squarings on a structure of
  arrays (`_soa_matmul`), in one autograd Function that recomputes them in backward
  (`_LinearExpBlocks`) instead of storing intermediates; `layerwise_exp` does it one layer at a time;
* `skew`, `skew_from_upper`, `axis_sum`: the parametrisations and the sum over axes.

Traced (torch.compile, torch.export) or on meta tensors the number of squarings cannot be read from
the data. `linear_exp` / `layerwise_exp` then run as one operator, ``vispe::linear_exp_blocks``, with
the count as a tensor: the tracer sees only its output's shape, and its kernel, run on real tensors,
reads the count and runs the eager code (values and gradients bit for bit eager's, exactly eager's
squarings, no upper limit; backward recomputes as `_LinearExpBlocks` does). `expm_skew`, which
exponentiates only a few distinct values per axis (ComRoPE on a grid), stays traced: the count as a
tensor, computed by the same rule (`_squaring_count`), and a static maximum of squarings, each kept
only where it is due (`_square_repeatedly`), so that the result is eager's; beyond that maximum the
graph fails loudly (`_traced_squarings`).

Rotation tensors are laid out ``(L', [B,] H', N, ...)``: ``L'`` is 1 (shared) or the depth, ``H'``
is 1 (shared) or the heads, ``B`` only for per-sample positions.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

from .._tracing import is_tracing
from .._cache import TensorCache
from .._dtypes import autocast_off
from .kernels import pad_identity

__all__ = ['Rotations', 'axis_sum', 'expm_skew', 'layerwise_exp', 'linear_exp', 'skew', 'skew_from_upper']

Rotations = Union[torch.Tensor, Sequence[torch.Tensor]]
Squarings = Union[int, torch.Tensor]  # read from the data (eager) or a tensor of counts (traced)

# Degree of the Taylor polynomials of exp(X): 12 in general; 10 for three-axis position polynomials
# (which have C(m + D, D) terms).
_TAYLOR_DEGREE = 12
_MAX_POLY_AXES = 3

# The largest bound of ||X||_2 a traced `expm_skew` exponentiates (`_traced_squarings`), which fixes
# its static number of squarings: 11 in float32, 13 in float64. The learned rotations' bounds (ViT-S,
# initial generators) are about 45 for LieRE gd 8 at the training grid and 180 at four times it (its
# positions reach 4), at most 40 for ComRoPE blocks of 4 and 8 (positions in [0, 1]); 2^11 leaves a
# factor of 10 beyond that for trained norms and larger inputs. Each squaring of the maximum is computed and kept only where it is due: one more costs
# one more product per matrix, so the maximum is not set higher than that margin needs.
_TRACED_MAX_BOUND = 2.0 ** 11


def _taylor_theta(degree: int, dtype: torch.dtype) -> float:
    """Largest ||X||_2 for which the degree-m Taylor polynomial of exp(X) is accurate to the unit
    roundoff: theta^(m+1) / (m+1)! <= u (the tail bound for normal matrices, whose spectrum sets it)."""
    unit = 2.0 ** -53 if dtype == torch.float64 else 2.0 ** -24
    return (unit * math.factorial(degree + 1)) ** (1 / (degree + 1))


def _squarings_readable(t: torch.Tensor) -> bool:
    """Whether the number of squarings can be read from the data (`_num_squarings`' host sync): not
    while tracing (torch.export / torch.compile see no values) nor on the meta device. There the
    count stays a tensor (`_traced_squarings`)."""
    return not (t.is_meta or is_tracing())


def _squaring_count(bound: torch.Tensor, degree: int, dtype: torch.dtype) -> torch.Tensor:
    """The least ``s >= 0`` with ``bound / 2^s <= theta_m``, elementwise, by tensor ops in float64:
    the one rule of both paths (eager reads it, traced keeps it). A NaN or infinite bound gives a
    count that neither path accepts."""
    return torch.log2(bound.double() / _taylor_theta(degree, dtype)).ceil().clamp_min(0)


def _num_squarings(bound: torch.Tensor, degree: int, dtype: torch.dtype) -> int:
    """`_squaring_count` of a 0-dim bound, read (one host sync; the whole batch shares ``s``)."""
    return next(iter(_groups_of(_squaring_count(bound, degree, dtype))))


def _squaring_limit(degree: int, dtype: torch.dtype) -> int:
    """The traced path's static number of squarings: the count of `_TRACED_MAX_BOUND` (plain
    Python, a constant of the graph)."""
    return max(0, math.ceil(math.log2(_TRACED_MAX_BOUND / _taylor_theta(degree, dtype))))


def _traced_squarings(bound: torch.Tensor, degree: int, dtype: torch.dtype) -> torch.Tensor:
    """`_squaring_count` as a tensor in ``dtype`` (the counts are small integers, exact in it), with a
    device-side assertion (it traces into compiled and exported graphs) that none exceeds
    `_squaring_limit`: beyond it the masked squarings would stop short, so the graph fails instead
    of returning a wrong rotation (a NaN bound fails too)."""
    squarings = _squaring_count(bound, degree, dtype)
    limit = _squaring_limit(degree, dtype)
    torch._assert_async((squarings <= limit).all(),
                        f'vispe: a learned rotation needs more than the {limit} squarings a traced graph '
                        f'takes (a norm bound above {int(_TRACED_MAX_BOUND)}, or not finite): run it eagerly')
    return squarings.to(dtype)


def _square_repeatedly(y: torch.Tensor, squarings: Squarings, limit: int) -> torch.Tensor:
    """``y^(2^s)`` for a batch ``(..., b, b)`` by ``s`` matrix products ``y y``. A tensor count (traced;
    broadcastable against ``y``: one for all matrices or one per sample) takes ``limit`` products,
    the ``k``-th kept only where ``k < s``: eager's result wherever ``s <= limit``, which
    `_traced_squarings` asserts. Batched products: a compiler keeps each one a kernel of its own,
    whose buffers the next ones reuse (fused broadcast multiply-adds would keep all ``limit``
    intermediates alive in one kernel, and fold the last product into every consumer)."""
    if not torch.is_tensor(squarings):
        for _ in range(squarings):
            y = y @ y
        return y
    for k in range(limit):
        y = torch.where(squarings > k, y @ y, y)
    return y


def skew(p: torch.Tensor) -> torch.Tensor:
    """``P - P^T`` over the last two dims (ComRoPE's and STRING's parametrisation)."""
    return p - p.transpose(-1, -2)


def skew_from_upper(values: torch.Tensor, size: int) -> torch.Tensor:
    """``T - T^T`` from the ``size (size - 1) / 2`` strict-upper-triangle entries of ``T`` (LieRE's)."""
    rows, cols = torch.triu_indices(size, size, 1, device=values.device)
    flat = values.new_zeros(*values.shape[:-1], size * size)
    flat = flat.scatter(-1, (rows * size + cols).expand(*values.shape[:-1], -1), values)
    upper = flat.unflatten(-1, (size, size))
    return upper - upper.transpose(-1, -2)


def expm_skew(a: torch.Tensor) -> torch.Tensor:
    """``exp(a)`` for a batch ``(..., b, b)`` of real skew-symmetric matrices (float32 or float64).

    Scaling and squaring: ``exp(a) = T(a / 2^s)^(2^s)`` with ``T`` the degree-12 Taylor polynomial
    (Paterson-Stockmeyer: 5 products, scalings folded into the coefficients) and one ``s`` for the
    whole batch, from the bound ``rho(a) <= ||a^4||_F^(1/4)`` (the spectral radius sets the error of
    normal matrices). ``b = 2`` uses the closed form (a plane rotation by ``a[1, 0]``). Traced, ``s``
    is a tensor and the squarings are masked (`_square_repeatedly`): the same result.
    """
    b = a.shape[-1]
    if b == 1:
        return torch.ones_like(a)
    if b == 2:
        angle = a[..., 1, 0]
        c, s = angle.cos(), angle.sin()
        return torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2)
    eye = torch.eye(b, dtype=a.dtype, device=a.device)
    if a.numel() == 0:
        return a + eye
    shape = a.shape
    a = a.reshape(-1, b, b)
    a2 = torch.bmm(a, a)
    a4 = torch.bmm(a2, a2)
    bound = a4.flatten(-2).norm(dim=-1).amax().pow(0.25)
    squarings = (_num_squarings if _squarings_readable(a) else _traced_squarings)(bound, _TAYLOR_DEGREE, a.dtype)
    a3 = torch.bmm(a2, a)
    # T(X) = sum_k X^k / k! with X^j = a^j / 2^(js) (the scalings, powers of two, folded into the
    # coefficients: floats, or 0-dim tensors for a traced s)
    x = [2.0 ** (-j * squarings) for j in range(4)]
    x4 = a4 * 2.0 ** (-4 * squarings)  # X^4

    def part(i: int) -> torch.Tensor:  # P_i = sum_{j<4} X^j / (4i + j)!
        c = [x[j] / math.factorial(4 * i + j) for j in range(4)]
        return a2 * c[2] + a * c[1] + a3 * c[3] + eye * c[0]

    # T = P0 + X^4 (P1 + X^4 (P2 + X^4 / 12!))
    y = part(2) + x4 / math.factorial(12)
    y = torch.baddbmm(part(1), x4, y)
    y = torch.baddbmm(part(0), x4, y)
    y = _square_repeatedly(y, squarings, _squaring_limit(_TAYLOR_DEGREE, a.dtype))
    return y.reshape(shape)


def axis_sum(coords: torch.Tensor, gen: torch.Tensor) -> torch.Tensor:
    """``sum_d p_d A_d``: coords ``([B,] N, D)``, gen ``(D, L', H', ...)`` -> ``(L', [B,] H', N, ...)``."""
    d, layers, heads = gen.shape[:3]
    tail = gen.shape[3:]
    out = coords @ gen.reshape(d, -1)  # ([B,] N, L' H' ...)
    out = out.reshape(*coords.shape[:-1], layers, heads, *tail)
    n_tail = len(tail)
    # ([B,] N, L', H', tail) -> (L', [B,] H', N, tail)
    lead = coords.dim() - 1  # 1 or 2 dims before L'
    perm = [lead] + list(range(lead - 1)) + [lead + 1, lead - 1] + [lead + 2 + i for i in range(n_tail)]
    return out.permute(*perm)


Incidence = Tuple[Tuple[int, int], Tuple[Tuple[int, int], ...]]  # (shape, positions of the ones)


@lru_cache(maxsize=None)
def _monomial_plan(num_axes: int, degree: int) -> Tuple[Tuple[Tuple[int, ...], ...], Tuple[Incidence, ...]]:
    """Monomials of degree <= ``degree`` in D variables, graded; and per degree k >= 1 the 0/1 matrix
    ``(n_k, D n_{k-1})`` that sends ``(axis d, monomial m of degree k - 1)`` to ``m p_d``, as its shape
    and the positions of its ones (plain Python: this cache outlives any mode a tensor is made in)."""
    levels = [[(0,) * num_axes]]
    for _ in range(degree):
        levels.append(sorted({m[:d] + (m[d] + 1,) + m[d + 1:] for m in levels[-1] for d in range(num_axes)},
                             reverse=True))
    incidence = []
    for k in range(1, degree + 1):
        where = {m: i for i, m in enumerate(levels[k])}
        ones = tuple((where[m[:d] + (m[d] + 1,) + m[d + 1:]], d * len(levels[k - 1]) + j)
                     for d in range(num_axes) for j, m in enumerate(levels[k - 1]))
        incidence.append(((len(levels[k]), num_axes * len(levels[k - 1])), ones))
    return tuple(m for level in levels for m in level), tuple(incidence)


@torch.compiler.assume_constant_result
def _constant_plan(num_axes: int, degree: int) -> Tuple[Tuple[Tuple[int, ...], ...], Tuple[Incidence, ...]]:
    """`_monomial_plan`, which a traced graph takes as a constant (dynamo would otherwise trace the
    Python that builds it, past its cache)."""
    return _monomial_plan(num_axes, degree)


def _build_plan_tensors(num_axes: int, degree: int, device: torch.device, dtype: torch.dtype
                        ) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
    monomials, incidence = _constant_plan(num_axes, degree)
    matrices = []
    for shape, ones in incidence:
        rows, cols = zip(*ones)
        inc = torch.zeros(shape, dtype=dtype)
        inc[list(rows), list(cols)] = 1
        matrices.append(inc.to(device))
    return torch.tensor(monomials, dtype=dtype, device=device), tuple(matrices)


def _plan_tensors(num_axes: int, degree: int, device: torch.device, dtype: torch.dtype,
                  cache: Optional[TensorCache]) -> Tuple[torch.Tensor, Tuple[torch.Tensor, ...]]:
    """`_monomial_plan` as tensors on ``device``: the exponents ``(K, D)`` and the incidence matrices,
    kept in the encoding's ``cache`` (each host-to-device copy of them would stall a GPU's queue)."""
    if cache is None:
        return _build_plan_tensors(num_axes, degree, device, dtype)
    return cache.get(('expm plan', num_axes, degree, device, dtype),
                     lambda: _build_plan_tensors(num_axes, degree, device, dtype))


def _incidence(gen: torch.Tensor, degree: int, cache: Optional[TensorCache]) -> Tuple[torch.Tensor, ...]:
    """The incidence matrices of `_monomial_plan` for ``gen``'s axes, device and dtype (`_word_sums`)."""
    return _plan_tensors(gen.shape[0], degree, gen.device, gen.dtype, cache)[1]


def _word_sums(gen: torch.Tensor, incidence: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``S_alpha`` for ``|alpha| <= degree``: the sum of all products of generators with ``alpha_d``
    factors ``A_d``, so that ``(sum_d p_d A_d)^k = sum_{|alpha| = k} p^alpha S_alpha``. Built degree by
    degree from ``S_alpha = sum_d A_d S_{alpha - e_d}``: per degree one batched product and one small
    GEMM with the 0/1 incidence matrix (`_incidence`, one per degree). gen ``(D, ...lead, b, b)`` -> per
    degree ``k`` a tensor ``(n_k, ...lead, b, b)``, the monomials in `_monomial_plan`'s order."""
    b = gen.shape[-1]
    lead = gen.shape[1:-2]
    level = torch.eye(b, dtype=gen.dtype, device=gen.device).expand(1, *lead, b, b)
    levels = [level]
    for k, inc in enumerate(incidence, start=1):
        # A_d S_m for every axis d and monomial m of degree k - 1: (D, n_{k-1}, ...)
        prods = gen.unsqueeze(1) if k == 1 else gen.unsqueeze(1) @ level.unsqueeze(0)
        level = (inc @ prods.reshape(inc.shape[1], -1)).reshape(inc.shape[0], *lead, b, b)
        levels.append(level)
    return levels


def _soa_matmul(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a_m b_m`` for matrices stored as a structure of arrays, ``(C, b, b, c)``: entry ``(i, j)`` of
    matrix ``(C, m)`` at ``[C, i, j, m]``. One broadcast multiply-add per inner index covers every
    matrix at once; for ``8 x 8`` blocks this is about twice as fast as `torch.bmm` on a CPU, which
    runs one small GEMM per matrix."""
    out = torch.mul(a[:, :, :1], b[:, :1], out=out)
    for k in range(1, a.shape[2]):
        out.addcmul_(a[:, :, k:k + 1], b[:, k:k + 1])
    return out


def _soa_squaring_grad(grad: torch.Tensor, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Gradient through ``y -> y y`` in the `_soa_matmul` layout: ``G y^T + y^T G``."""
    torch.mul(grad[:, :, :1], y[:, None, :, 0], out=out)  # G y^T: sum_k G[i, k] y[j, k]
    for k in range(1, y.shape[2]):
        out.addcmul_(grad[:, :, k:k + 1], y[:, None, :, k])
    for k in range(y.shape[2]):  # y^T G: sum_k y[k, i] G[k, j]
        out.addcmul_(y[:, k, :, None], grad[:, k:k + 1])
    return out


def _monomials(coords: torch.Tensor, squarings: Squarings, degree: int, cache: Optional[TensorCache]) -> torch.Tensor:
    """Taylor coefficients of every position, ``p^alpha / (2^(s |alpha|) |alpha|!)`` for ``|alpha| <=
    degree`` in `_monomial_plan`'s order: ``([B,] N, K)``. Shared by all layers of a forward. A traced
    ``s`` is 0-dim or one per sample, ``(B, 1, 1)``."""
    exponents, _ = _plan_tensors(coords.shape[-1], degree, coords.device, coords.dtype, cache)  # (K, D)
    order = exponents.sum(-1)
    scale = torch.exp2(-squarings * order) / torch.lgamma(order + 1).exp()
    return (coords.unsqueeze(-2) ** exponents).prod(-1) * scale


def _taylor_soa(gen: torch.Tensor, coef: torch.Tensor, incidence: Sequence[torch.Tensor]) -> torch.Tensor:
    """``T(sum_d p_d A_d / 2^s)`` at every position, ``T`` the Taylor polynomial (its degree: one
    incidence matrix per degree) written as a polynomial in the coordinates, ``sum_alpha coef_alpha
    S_alpha`` (`_monomials`): one GEMM over the monomials (no matrix product per position). Laid out
    for `_soa_matmul`, ``(L' [B] H', b, b, nb N)``."""
    layers, heads, nb, b = gen.shape[1:5]
    # (L', H', b, b, nb, K) in one copy: the GEMM's rows (H', b, b, nb) give the squarings' layout
    sums = torch.cat([level.permute(1, 2, 4, 5, 3, 0) for level in _word_sums(gen, incidence)], dim=-1)
    flat = sums.reshape(layers, heads * b * b * nb, -1)
    if coef.dim() == 3:  # (L', 1, F, K) x (B, K, N) -> (L', B, F, N)
        y = torch.matmul(flat.unsqueeze(1), coef.transpose(-1, -2))
    else:  # (L', F, K) x (K, N) -> (L', F, N)
        y = torch.matmul(flat, coef.transpose(-1, -2))
    return y.reshape(-1, b, b, nb * coef.shape[-2])


def _blocks_shape(gen: torch.Tensor, coef: torch.Tensor, num_prefix: int) -> Tuple[int, ...]:
    """Shape of the position-major rotations of `_blocks_forward`: ``(L', [B,] N_prefix + N, H', nb, b, b)``."""
    layers, heads, nb, b = gen.shape[1:5]
    return (layers, *coef.shape[:-2], num_prefix + coef.shape[-2], heads, nb, b, b)


def _position_major(y: torch.Tensor, gen: torch.Tensor, coef: torch.Tensor, num_prefix: int) -> torch.Tensor:
    """`_taylor_soa`-layout blocks as rotations with identity rows for the prefix tokens, contiguous
    and position-major ``(L', [B,] N_prefix + N, H', nb, b, b)`` as q and k lie in attention, so that
    `kernels.rotate_blocks` multiplies views of both without copying either."""
    heads, nb, b = gen.shape[2], gen.shape[3], gen.shape[-1]
    out = y.new_empty(_blocks_shape(gen, coef, num_prefix))
    lead, n = out.shape[:-5], coef.shape[-2]
    out.narrow(-5, 0, num_prefix).copy_(torch.eye(b, dtype=y.dtype, device=y.device))
    at = len(lead)
    blocks = y.reshape(*lead, heads, b, b, nb, n).permute(*range(at), at + 4, at, at + 3, at + 1, at + 2)
    out.narrow(-5, num_prefix, n).copy_(blocks)
    return out


def _squarings_soa(y: torch.Tensor, squarings: int, keep: bool = False) -> Tuple[torch.Tensor, ...]:
    """``y^(2^s)`` by ``s`` squarings in the `_soa_matmul` layout; with ``keep`` also every factor
    ``y^(2^k)``, ``k < s`` (for backward), else two buffers are reused."""
    factors = [y]
    spare = None
    for _ in range(squarings):
        nxt = _soa_matmul(factors[-1], factors[-1], out=spare)
        if keep:
            factors.append(nxt)
        else:
            spare, factors[-1] = (factors[-1] if factors[-1] is not y else None), nxt
    return tuple(factors)


def _blocks_forward(gen: torch.Tensor, coef: torch.Tensor, squarings: int, incidence: Sequence[torch.Tensor],
                    num_prefix: int) -> torch.Tensor:
    """Rotations from the positions' Taylor coefficients (`_monomials` with ``squarings``): the
    Taylor polynomial by one GEMM (`_taylor_soa`), ``s`` squarings, the position-major layout of
    `_position_major`. Plain tensor code without autograd: `_LinearExpBlocks` and, traced, the
    `vispe::linear_exp_blocks` operator run it."""
    y = _squarings_soa(_taylor_soa(gen, coef, incidence), squarings)[-1]
    return _position_major(y, gen, coef, num_prefix)


def _blocks_backward(grad: torch.Tensor, gen: torch.Tensor, coef: torch.Tensor, squarings: int,
                     incidence: Sequence[torch.Tensor], num_prefix: int, needs: Tuple[bool, bool]
                     ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Gradients of `_blocks_forward` for the generators and the coefficients (those ``needs`` asks
    for), from ``grad`` of the position-major rotations: recomputes the Taylor part and the squarings'
    factors (not the last squaring: its output, the rotation, is what the gradient arrives for), goes
    back through each squaring, ``G <- G y^T + y^T G``, then through the Taylor part by `torch.func.vjp`
    (which, unlike `torch.autograd.grad`, also runs inside an operator's kernel, below autograd)."""
    if not any(needs):
        return None, None
    inputs = [gen, coef]
    wanted = [i for i, need in enumerate(needs) if need]

    def taylor_of(*values: torch.Tensor) -> torch.Tensor:
        args = list(inputs)
        for i, v in zip(wanted, values):
            args[i] = v
        return _taylor_soa(args[0], args[1], incidence)

    taylor, pullback = torch.func.vjp(taylor_of, *(inputs[i] for i in wanted))
    factors = _squarings_soa(taylor, squarings - 1, keep=True) if squarings else ()
    # the rotations' gradient in the Taylor layout (C, b, b, nb N)
    n = coef.shape[-2]
    g = grad.narrow(-5, num_prefix, n)  # (L', [B,] N, H', nb, b, b)
    at = g.dim() - 5
    g = g.permute(*range(at), at + 1, at + 3, at + 4, at + 2, at).reshape(taylor.shape)
    spare = [torch.empty_like(taylor), torch.empty_like(taylor)] if factors else []
    for i, y in enumerate(reversed(factors)):
        g = _soa_squaring_grad(g, y, out=spare[i % 2])
    found = iter(pullback(g))
    grads = [next(found) if need else None for need in needs]
    return grads[0], grads[1]


class _LinearExpBlocks(torch.autograd.Function):
    """`_blocks_forward` eagerly, as rotations ``(L', [B,] H', N_prefix + N, nb, b, b)`` (a view of the
    position-major tensor). Only the generators and coefficients are kept for backward
    (`_blocks_backward` recomputes the rest)."""

    @staticmethod
    def forward(ctx, gen, coef, squarings, degree, num_prefix, cache):
        incidence = _incidence(gen, degree, cache)
        ctx.save_for_backward(gen, coef)
        ctx.squarings, ctx.incidence, ctx.num_prefix = squarings, incidence, num_prefix
        return _blocks_forward(gen, coef, squarings, incidence, num_prefix).transpose(-5, -4)

    @staticmethod
    def backward(ctx, grad):
        gen, coef = ctx.saved_tensors
        grads = _blocks_backward(grad.transpose(-5, -4), gen, coef, ctx.squarings, ctx.incidence, ctx.num_prefix,
                                 tuple(ctx.needs_input_grad[:2]))
        return grads + (None, None, None, None)


def _poly_degree(num_axes: int) -> int:
    return _TAYLOR_DEGREE if num_axes < 3 else 10


def _position_bounds(gen: torch.Tensor, coords: torch.Tensor) -> torch.Tensor:
    """Bounds of ``||sum_d p_d A_d||_2`` at every position, ``(..., N, L' H' nb)``:
    ``||sum_d p_d A_d||_2 <= sum_d |p_d| ||A_d||_2`` and ``||A||_2 <= ||A^4||_F^(1/4)``."""
    num_axes = gen.shape[0]
    with torch.no_grad():
        g = gen.reshape(num_axes, -1, *gen.shape[-2:])
        g2 = g @ g
        rho = (g2 @ g2).flatten(-2).norm(dim=-1).pow(0.25)  # (D, L' H' nb)
        return coords.abs() @ rho


def _max_bound(gen: torch.Tensor, coords: torch.Tensor, per_sample: bool = False) -> torch.Tensor:
    """The largest `_position_bounds` over all positions (0-dim), or over each sample's own positions
    of batched ``coords`` ``(B, N, D)`` (``(B, 1, 1)``: padding rows, at 0, bound nothing)."""
    if per_sample:
        return _position_bounds(gen, coords).flatten(1).amax(1)[:, None, None]
    return _position_bounds(gen, coords.reshape(-1, gen.shape[0])).amax()


def _squarings(gen: torch.Tensor, coords: torch.Tensor) -> int:
    """Squarings that bring every ``sum_d p_d A_d`` within the Taylor polynomial's range (one host sync)."""
    return _num_squarings(_max_bound(gen, coords), _poly_degree(gen.shape[0]), gen.dtype)


def _sample_groups(gen: torch.Tensor, coords: torch.Tensor) -> Dict[int, List[int]]:
    """Samples of batched ``coords`` ``(B, N, D)`` grouped by the squarings each needs alone (one host
    sync): `_squarings` of every sample's own positions."""
    return _groups_of(_squaring_count(_max_bound(gen, coords, per_sample=True), _poly_degree(gen.shape[0]), gen.dtype))


def _traced_count(gen: torch.Tensor, coords: torch.Tensor, per_sample: bool) -> torch.Tensor:
    """`_squarings` (``per_sample``: each sample's own, as `_sample_groups` finds them, ``(B, 1, 1)``)
    as a tensor in ``gen``'s dtype (small integers, exact in it; no host sync), for a traced graph:
    `_monomials` scales by it and `vispe::linear_exp_blocks` reads it when it runs."""
    return _squaring_count(_max_bound(gen, coords, per_sample), _poly_degree(gen.shape[0]), gen.dtype).to(gen.dtype)


def _regroup(parts: Sequence[torch.Tensor], groups: Sequence[List[int]]) -> torch.Tensor:
    """Rotations ``(L', B_g, H', N, nb, b, b)`` of sample groups back in sample order ``(L', B, ...)``,
    position-major like each part."""
    order = torch.tensor([b for members in groups for b in members], device=parts[0].device)
    joined = torch.cat([p.transpose(-5, -4) for p in parts], dim=1)  # (L', B, N, H', nb, b, b)
    return joined.index_select(1, torch.argsort(order)).transpose(-5, -4)


def _groups_of(counts: torch.Tensor) -> Dict[int, List[int]]:
    """Squaring counts (`_squaring_count`, any shape) read to the host, one sync: the indices of the
    flattened counts grouped by count. A non-finite norm bound (NaN or infinite generators or
    positions) has no count: it fails here with a clear error rather than in an integer conversion."""
    values = counts.flatten().tolist()
    if not all(math.isfinite(v) for v in values):
        raise RuntimeError('vispe: the norm bound of a learned rotation is not finite (NaN or infinite generators '
                           'or positions): no number of squarings exponentiates it')
    groups: Dict[int, List[int]] = {}
    for i, s in enumerate(values):
        groups.setdefault(int(s), []).append(i)
    return groups


# Traced (torch.compile, torch.export) the rotations are one operator, opaque to the tracer, whose
# kernel is the eager code (`_blocks_forward`, `_blocks_backward`): it reads the squaring count from
# its count tensor as eager code does and takes exactly that many squarings (no static maximum of
# masked ones), in the eager path's own layout and order of operations, hence eager's numbers.


@torch.library.custom_op('vispe::linear_exp_blocks', mutates_args=())
def _linear_exp_blocks(gen: torch.Tensor, coef: torch.Tensor, squarings: torch.Tensor,
                       incidence: List[torch.Tensor], num_prefix: int) -> torch.Tensor:
    """`_blocks_forward` with the count read from ``squarings`` (0-dim, or ``(B, 1, 1)`` per sample of
    batched ``coef`` ``(B, N, K)``: each group of samples with its own count, as `linear_exp` groups
    them eagerly); position-major rotations ``(L', [B,] N_prefix + N, H', nb, b, b)``, contiguous."""
    with autocast_off(gen.device):  # as `prepare` runs it: the caller's autocast is traced away
        groups = _groups_of(squarings)
        if squarings.dim() == 0 or len(groups) == 1:
            return _blocks_forward(gen, coef, next(iter(groups)), incidence, num_prefix)
        out = gen.new_empty(_blocks_shape(gen, coef, num_prefix))
        for s, members in groups.items():
            index = torch.tensor(members, device=coef.device)
            out.index_copy_(1, index, _blocks_forward(gen, coef[index], s, incidence, num_prefix))
        return out


@_linear_exp_blocks.register_fake
def _(gen, coef, squarings, incidence, num_prefix):
    return gen.new_empty(_blocks_shape(gen, coef, num_prefix))


@torch.library.custom_op('vispe::linear_exp_blocks_backward', mutates_args=())
def _linear_exp_blocks_backward(grad: torch.Tensor, gen: torch.Tensor, coef: torch.Tensor, squarings: torch.Tensor,
                                incidence: List[torch.Tensor], num_prefix: int, needs_gen: bool, needs_coef: bool
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """`_blocks_backward` per group of `_linear_exp_blocks`; a gradient not asked for is an empty tensor."""
    needs = (needs_gen, needs_coef)
    with autocast_off(gen.device):
        groups = _groups_of(squarings)
        if squarings.dim() == 0 or len(groups) == 1:
            grad_gen, grad_coef = _blocks_backward(grad, gen, coef, next(iter(groups)), incidence, num_prefix, needs)
        else:
            grad_gen = torch.zeros_like(gen) if needs_gen else None
            grad_coef = torch.zeros_like(coef) if needs_coef else None
            for s, members in groups.items():
                index = torch.tensor(members, device=coef.device)
                part_gen, part_coef = _blocks_backward(grad.index_select(1, index), gen, coef[index], s, incidence,
                                                       num_prefix, needs)
                if needs_gen:
                    grad_gen += part_gen
                if needs_coef:
                    grad_coef.index_copy_(0, index, part_coef)
    return (grad_gen.contiguous() if needs_gen else gen.new_empty(0),
            grad_coef.contiguous() if needs_coef else coef.new_empty(0))


@_linear_exp_blocks_backward.register_fake
def _(grad, gen, coef, squarings, incidence, num_prefix, needs_gen, needs_coef):
    return (gen.new_empty(gen.shape if needs_gen else (0,)), coef.new_empty(coef.shape if needs_coef else (0,)))


def _keep_for_backward(ctx, inputs, output) -> None:
    gen, coef, squarings, incidence, num_prefix = inputs
    ctx.save_for_backward(gen, coef, squarings, *incidence)
    ctx.num_prefix = num_prefix


def _linear_exp_blocks_grad(ctx, grad):
    gen, coef, squarings, *incidence = ctx.saved_tensors
    needs_gen, needs_coef = ctx.needs_input_grad[:2]
    grad_gen, grad_coef = _linear_exp_blocks_backward(grad, gen, coef, squarings, incidence, ctx.num_prefix,
                                                      needs_gen, needs_coef)
    return grad_gen if needs_gen else None, grad_coef if needs_coef else None, None, [None] * len(incidence), None


_linear_exp_blocks.register_autograd(_linear_exp_blocks_grad, setup_context=_keep_for_backward)


def _exp_from_monomials(gen: torch.Tensor, coef: torch.Tensor, squarings: Squarings, degree: int, num_prefix: int,
                        cache: Optional[TensorCache]) -> torch.Tensor:
    """Rotations ``(L', [B,] H', N_prefix + N, nb, b, b)`` from the positions' Taylor coefficients,
    memory-lean under autograd (only the inputs are kept; backward recomputes the rest): eagerly
    `_LinearExpBlocks`; traced, the `vispe::linear_exp_blocks` operator, which runs the same code."""
    if _squarings_readable(gen):
        return _LinearExpBlocks.apply(gen, coef, squarings, degree, num_prefix, cache)
    if not torch.is_tensor(squarings):
        squarings = torch.full((), float(squarings), dtype=gen.dtype, device=gen.device)
    incidence = list(_incidence(gen, degree, cache))
    return _linear_exp_blocks(gen, coef, squarings, incidence, num_prefix).transpose(-5, -4)


def linear_exp(gen: torch.Tensor, coords: torch.Tensor, squarings: Optional[int] = None, num_prefix: int = 0,
               sample_squarings: bool = False, cache: Optional[TensorCache] = None) -> torch.Tensor:
    """``R(p) = exp(sum_d p_d A_d)`` for every position: gen ``(D, L', H', nb, b, b)`` skew blocks,
    coords ``([B,] N, D)``; ``num_prefix`` identity rotations (prefix tokens) come first.

    ``b = 2``: the plane-rotation angles ``(L', [B,] H', N, nb)``, ``sum_d p_d A_d[1, 0]`` (kind
    ``pair``: interleaved channel pairs are the consecutive 2 x 2 blocks). ``b > 2``: real blocks
    ``(L', [B,] H', N, nb, b, b)`` by scaling and squaring, the Taylor part evaluated for all positions
    by one GEMM over monomials of the coordinates (up to three axes; more axes exponentiate each
    position), with ``squarings`` squarings (default: from a norm bound over all positions; with
    ``sample_squarings``, each sample of batched coords with the squarings it needs alone, so that it
    gets the same rotations as alone: a NaFlex batch). With gradients on, the result is recomputed in
    backward rather than keeping the squarings' intermediates. Traced, the same numbers by the same
    code (the ``vispe::linear_exp_blocks`` operator). ``cache``: the calling encoding's `TensorCache`, which keeps the small
    constant tensors of the monomial plan on the device.
    """
    if gen.shape[-1] == 2:
        return pad_identity(axis_sum(coords, gen[..., 1, 0]), num_prefix, 'pair')
    num_axes = gen.shape[0]
    if num_axes > _MAX_POLY_AXES:
        return pad_identity(expm_skew(axis_sum(coords, gen).contiguous()), num_prefix, 'block')
    degree = _poly_degree(num_axes)
    per_sample = sample_squarings and squarings is None and coords.dim() == 3
    if not _squarings_readable(gen):  # one count tensor, per sample where eager groups the samples
        squarings = _traced_count(gen, coords, per_sample) if squarings is None else squarings
        return _exp_from_monomials(gen, _monomials(coords, squarings, degree, cache), squarings, degree, num_prefix, cache)
    if per_sample:
        groups = _sample_groups(gen, coords)
        if len(groups) > 1:
            parts = [_exp_from_monomials(gen, _monomials(coords[members], s, degree, cache), s, degree, num_prefix, cache)
                     for s, members in groups.items()]
            return _regroup(parts, list(groups.values()))
        squarings = next(iter(groups))
    squarings = _squarings(gen, coords) if squarings is None else squarings
    return _exp_from_monomials(gen, _monomials(coords, squarings, degree, cache), squarings, degree, num_prefix, cache)


def layerwise_exp(gen: torch.Tensor, coords: torch.Tensor, num_prefix: int = 0, sample_squarings: bool = False,
                  cache: Optional[TensorCache] = None) -> Rotations:
    """`linear_exp` with ``num_prefix`` identity rows prepended, for the state of a `RotationPE`.

    In training with ``b > 2`` each layer is computed (and recomputed in backward) on its own, so the
    backward pass holds one layer's scaling-and-squaring intermediates at a time, not all of them;
    the number of squarings and the positions' Taylor coefficients are found once for all layers
    (per group of samples with ``sample_squarings``, see `linear_exp`; traced, per sample).
    """
    if gen.shape[-1] == 2 or not (torch.is_grad_enabled() and gen.requires_grad):
        return linear_exp(gen, coords, num_prefix=num_prefix, sample_squarings=sample_squarings, cache=cache)
    if gen.shape[0] > _MAX_POLY_AXES:
        return [linear_exp(g, coords, num_prefix=num_prefix, cache=cache)[0] for g in gen.split(1, dim=1)]
    degree = _poly_degree(gen.shape[0])
    per_sample = sample_squarings and coords.dim() == 3
    if not _squarings_readable(gen):
        squarings = _traced_count(gen, coords, per_sample)
        coef = _monomials(coords, squarings, degree, cache)
        return [_exp_from_monomials(g, coef, squarings, degree, num_prefix, cache)[0] for g in gen.split(1, dim=1)]
    groups = _sample_groups(gen, coords) if per_sample else {}
    if len(groups) <= 1:  # one squaring count for all positions
        groups = {next(iter(groups)) if groups else _squarings(gen, coords): None}
    # the Taylor coefficients of each group, the same for every layer
    coefs = [(s, _monomials(coords if members is None else coords[members], s, degree, cache))
             for s, members in groups.items()]
    layers = []
    for g in gen.split(1, dim=1):
        parts = [_exp_from_monomials(g, coef, s, degree, num_prefix, cache) for s, coef in coefs]
        layers.append(parts[0][0] if len(parts) == 1 else _regroup(parts, list(groups.values()))[0])
    return layers
