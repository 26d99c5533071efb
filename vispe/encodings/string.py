"""STRING (Schenck et al., 2025, "Learning the RoPEs: Better 2D and 3D Position Encodings with
STRING"): separable, translation-invariant rotations for coordinates of any dimension.

Every smooth translation-invariant ``R`` with ``R(0) = I`` equals ``P^T RoPE(r) P`` for an orthogonal
``P``; inside ``q^T R(r_i)^T R(r_j) k`` the outer ``P^T`` cancels, so it suffices to rotate by
``RoPE(r) P``. Two parametrisations: Cayley-STRING (a learned dense ``P``) and Circulant-STRING
(circulant generators, diagonalised by the FFT).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .._tracing import is_tracing
from ..positions import GridMode, Positions, grid_coordinates
from ..registry import register_pe
from ..rotary import RotationPE, RotationState
from ..rotary.autograd import angle_tables
from ..rotary.base import check_axes, heads_and_layers, require_divisible, shared_sample_grid
from ..rotary.expm import axis_sum, skew_from_upper
from .._dtypes import compute_dtype
from ..rotary.kernels import pad_identity
from ._checks import check_min_int, check_nonnegative, check_positive
from ..contract import PEContext, resolve_num_axes
from .rope import RopeMixed

__all__ = ['StringCayley', 'StringCirculant']


@register_pe('string_cayley')
class StringCayley(RotationPE):
    """Cayley-STRING (Schenck et al., 2025): ``R(r) = RoPE(r) P`` with ``P = (I - S)(I + S)^-1``.

    ``S`` is antisymmetric and learned per layer and head (``skew``, the strict upper triangle,
    ``(L, H, hd (hd - 1) / 2)``), so ``P`` is orthogonal (the Cayley transform). ``P`` is applied to q
    and k *before* the RoPE rotation: ``P`` after RoPE would cancel in every logit. The RoPE part has
    learned frequencies, one D-dimensional frequency per layer, head and channel pair (RoPE-Mixed's
    parametrisation and init, parameter ``rope.freqs``); with ``S = 0`` the encoding is RoPE-Mixed.
    ``R(r_i)^T R(r_j) = P^T RoPE(r_j - r_i) P``: exactly shift-invariant, for any number of axes.

    Conventions: integer patch indices by default (``grid_mode``), so larger inputs extrapolate;
    prefix tokens get ``P`` but no RoPE angle (``R = P``, a token at the origin, so folding holds for
    every token); ``S`` starts at 0 (training starts from RoPE-Mixed; ``skew_init_std`` for a random
    start); ``S`` and the frequencies are excluded from weight decay.

    Cost: one batched solve per forward gives every layer's and head's ``P`` (``(L, H, hd, hd)``),
    one angle table serves all layers; per attention q and k are multiplied by ``P`` (a dense
    ``hd x hd`` product per token) and rotated in pairs, in one memory-lean map (backward takes
    ``P``'s and the angles' gradients from ``R q`` instead of keeping ``P q``); in inference q and k
    are read as a view of the fused qkv projection. For inference `fold_into` multiplies ``P``
    into the q/k projection weights, leaving a plain learned-frequency RoPE at run time.

    Args:
        theta: base of RoPE-Mixed's initial frequency magnitudes (10).
        num_axes: coordinate axes D (default: the host grid's, else 2).
        grid_mode: ``index`` (integer patch indices) or ``normalized`` (rescaled to the training grid).
        skew_init_std: std of the normal init of ``S`` (0: ``P = I``).
    """
    shift_invariant = True
    larger_input = 'extrapolate'
    paper = 'Schenck et al., ICML 2025 (STRING), arXiv:2502.02562'
    rotation_kind = 'mixed_pair'

    def __init__(
            self,
            ctx: PEContext,
            *,
            theta: float = 10.0,
            num_axes: Optional[int] = None,
            grid_mode: GridMode = 'index',
            skew_init_std: float = 0.0,
    ) -> None:
        super().__init__(ctx)
        if ctx.head_dim % 4:
            raise ValueError(f"encoding 'string_cayley' needs head_dim divisible by 4 (RoPE-Mixed's two halves "
                             f"of pairs), got head_dim={ctx.head_dim}")
        check_positive(self.name, 'theta', theta)  # here, so that the error names this encoding
        std = check_nonnegative(self.name, 'skew_init_std', skew_init_std)
        self.rope = RopeMixed(ctx, theta=theta, num_axes=resolve_num_axes(ctx, num_axes, 'string_cayley'),
                              grid_mode=grid_mode)
        hd = ctx.head_dim
        self.skew = nn.Parameter(torch.randn(ctx.depth, ctx.num_heads, hd * (hd - 1) // 2) * std)
        # set by `fold_into`; a buffer so that a saved folded model does not apply P twice when reloaded
        self.register_buffer('folded', torch.zeros((), dtype=torch.bool))

    def no_weight_decay(self) -> set:
        return {'skew', 'rope.freqs'}

    def orthogonal(self) -> torch.Tensor:
        """``P = (I - S)(I + S)^-1`` for every layer and head, ``(L, H, hd, hd)``: one batched solve.

        ``I - S`` and ``(I + S)^-1`` commute (both are functions of ``S``), so ``P = solve(I + S, I - S)``.
        """
        s = skew_from_upper(self.skew.to(compute_dtype(self.skew)), self.ctx.head_dim)
        eye = torch.eye(s.shape[-1], dtype=s.dtype, device=s.device)
        return torch.linalg.solve(eye + s, eye - s)

    def angles(self, pos: Positions) -> torch.Tensor:
        """RoPE-Mixed's angles ``(L, [B,] H, N_total, hd / 2)`` (x first), 0 for prefix tokens (and for
        the padding of a NaFlex batch)."""
        shared = shared_sample_grid(pos)
        if shared is not None:  # a NaFlex batch of one grid: that grid's angles, shared by the batch
            return pad_identity(self.angles(shared), 0, 'pair', after=pos.num_tokens - shared.num_tokens)
        coords = grid_coordinates(pos, self.rope.grid_mode).flip(-1)
        theta, _ = self.rope.angles(coords.to(compute_dtype(self.skew)), pos)
        return pad_identity(theta, pos.num_prefix, 'pair')

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> RotationState:
        # `P` once for q and k, and the kind depends on the folded flag: one state of kind ``pair``
        # (folded: RoPE alone) or ``mixed_pair`` with per-layer (P, angles) (indexing one (L, ...)
        # tensor per layer would build full-size gradients)
        if self.folded.is_meta or is_tracing():  # the flag has no value to branch on: P, or I once folded
            p = self.orthogonal()
            mix = torch.where(self.folded, torch.eye(p.shape[-1], dtype=p.dtype, device=p.device), p).unbind(0)
        else:
            mix = None if bool(self.folded) else self.orthogonal().unbind(0)
        angle_q = angle_tables(self.angles(pos_q).unbind(0))
        angle_k = angle_q if pos_k is None else angle_tables(self.angles(pos_k).unbind(0))
        if mix is None:
            return RotationState('pair', angle_q, angle_k)
        rot_q = tuple(zip(mix, angle_q))
        return RotationState('mixed_pair', rot_q, rot_q if pos_k is None else tuple(zip(mix, angle_k)))

    @torch.no_grad()
    def fold_into(self, model: nn.Module) -> int:
        """Multiply ``P`` into the q and k rows of every attention's fused ``qkv`` projection (inference).

        The attention layers are found by duck typing: modules with a ``qkv`` `nn.Linear`, a
        ``layer_index``, ``num_heads`` and ``head_dim`` (vispe's `PEAttention`). Afterwards this
        encoding applies only the RoPE part, with identical outputs. Returns the number of layers
        folded. Raises ValueError if q/k are normalised after the projection (a norm does not commute
        with ``P``) or if the model was folded already.
        """
        if bool(self.folded):
            raise ValueError("encoding 'string_cayley' is already folded into the model's projections")
        attns = [m for m in model.modules() if isinstance(getattr(m, 'qkv', None), nn.Linear)
                 and hasattr(m, 'layer_index') and hasattr(m, 'num_heads')]
        if not attns:
            raise ValueError("fold_into found no attention layer with a fused 'qkv' projection and a layer_index")
        mix = self.orthogonal()
        for attn in attns:
            for norm in ('q_norm', 'k_norm'):
                if not isinstance(getattr(attn, norm, nn.Identity()), nn.Identity):
                    raise ValueError(f'cannot fold P into the projections: the attention applies {norm} after them')
            heads, hd = attn.num_heads, attn.head_dim
            if (heads, hd) != (self.ctx.num_heads, self.ctx.head_dim):
                raise ValueError(f'attention has {heads} heads of {hd} channels, the encoding was built for '
                                 f'{self.ctx.num_heads} of {self.ctx.head_dim}')
            p = mix[attn.layer_index]
            weight, bias = attn.qkv.weight, attn.qkv.bias
            for part in range(2):  # q rows, then k rows
                rows = slice(part * heads * hd, (part + 1) * heads * hd)
                w = weight[rows].view(heads, hd, -1)
                weight[rows] = (p @ w.to(p.dtype)).to(weight.dtype).reshape(heads * hd, -1)
                if bias is not None:
                    b = bias[rows].view(heads, hd, 1)
                    bias[rows] = (p @ b.to(p.dtype)).to(bias.dtype).reshape(-1)
        self.folded.fill_(True)
        self.clear_cache()
        return len(attns)

    def extra_repr(self) -> str:
        return f'axes={self.rope.num_axes}, folded={"?" if self.folded.is_meta else bool(self.folded)}'


@register_pe('string_circulant')
class StringCirculant(RotationPE):
    """Circulant-STRING (Schenck et al., 2025): ``R(r) = exp(sum_k r_k L_k)``, ``L_k = C_k - C_k^T``.

    ``C_k`` is circulant, ``C[i, j] = c_k[(i - j) mod d]`` (``C z`` is the circular convolution
    ``c_k * z``), with ``d`` learned scalars per axis ``k``, layer and head (``coeffs``,
    ``(D, L, H, hd / block, block)``). Circulant matrices are diagonalised by the DFT, so the
    generators commute (exact shift invariance for any number of axes) and
    ``R(r) z = IFFT(exp(sum_k r_k mu_k) * FFT(z))`` with ``mu_k = FFT(c_k) - conj(FFT(c_k))`` (purely
    imaginary): ``O(d log d)`` per token, never a ``d x d`` matrix. ``block`` splits the head dim
    into independent circulant blocks (the paper sweeps block sizes; the default is one circulant
    over the whole head dim).

    Conventions: integer patch indices by default (``grid_mode``), so larger inputs extrapolate;
    prefix tokens are not rotated; ``c ~ N(0, init_std^2)`` with default ``init_std = 1 / sqrt(8 block)``
    (each rotation rate then has std 1/2 radian per unit of position); excluded from weight decay.

    Cost: one table of rotation angles per forward, ``(L, H, N, hd / block * (block / 2 + 1))``, for
    all layers; per attention an ``rfft`` / ``irfft`` pair of q and k.

    Args:
        block: circulant block size (default: the head dim).
        num_axes: coordinate axes D (default: the host grid's, else 2).
        grid_mode: ``index`` (integer patch indices) or ``normalized`` (rescaled to the training grid).
        init_std: std of the normal init of the circulant coefficients.
    """
    shift_invariant = True
    larger_input = 'extrapolate'
    paper = 'Schenck et al., ICML 2025 (STRING), arXiv:2502.02562'
    rotation_kind = 'fourier'

    def __init__(
            self,
            ctx: PEContext,
            *,
            block: Optional[int] = None,
            num_axes: Optional[int] = None,
            grid_mode: GridMode = 'index',
            init_std: Optional[float] = None,
    ) -> None:
        super().__init__(ctx)
        block = ctx.head_dim if block is None else check_min_int(self.name, 'block', block)
        self.block = self.rotation_block = block
        self.num_blocks = require_divisible('string_circulant', ctx.head_dim, self.block)
        self.num_axes = resolve_num_axes(ctx, num_axes, 'string_circulant')
        self.grid_mode = grid_mode
        std = (8 * self.block) ** -0.5 if init_std is None else check_nonnegative(self.name, 'init_std', init_std)
        layers, heads = heads_and_layers(ctx, per_layer=True)
        self.coeffs = nn.Parameter(torch.randn(self.num_axes, layers, heads, self.num_blocks, self.block) * std)

    def no_weight_decay(self) -> set:
        return {'coeffs'}

    def rates(self) -> torch.Tensor:
        """Rotation rate of every real-FFT bin, ``Im(mu_k) = 2 Im(FFT(c_k))``: ``(D, L, H, nb, block/2 + 1)``."""
        return 2 * torch.fft.rfft(self.coeffs.to(self.compute_dtype()), dim=-1).imag

    def generator_matrices(self) -> torch.Tensor:
        """Dense generators ``L_k = C_k - C_k^T`` ``(D, L, H, nb, block, block)`` (reference / tests only)."""
        c = self.coeffs.to(self.compute_dtype())
        i = torch.arange(self.block, device=c.device)
        circulant = c[..., (i[:, None] - i[None, :]) % self.block]
        return circulant - circulant.transpose(-1, -2)

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> torch.Tensor:
        coords = grid_coordinates(pos, self.grid_mode).to(self.compute_dtype())
        check_axes('string_circulant', coords, self.num_axes)
        angles = axis_sum(coords, self.rates().flatten(-2))  # (L, [B,] H, N, nb * bins)
        return pad_identity(angles, pos.num_prefix, 'fourier')

    def extra_repr(self) -> str:
        return f'block={self.block}, blocks={self.num_blocks}, axes={self.num_axes}'
