"""The one rotary core: pair rotations, dense block rotations, frequencies and their scaling.

Every rotation encoding in vispe (RoPE-axial/mixed, ComRoPE, LieRE, STRING, GTA, M-RoPE) applies
its rotation through the functions here, so the kernels and their precision rules live once:
angles and matrices are built in float32 (float64 inputs stay float64) and the result is cast back
to the activation dtype.

Two pair layouts exist in the field:

* ``'interleaved'``: pairs ``(2j, 2j + 1)`` (RoPE-ViT, timm's vision RoPE, GTA, ComRoPE);
* ``'half'``: pairs ``(j, j + hd/2)`` (rotate-half, the layout of LLM code: Llama, Qwen2-VL).
"""
from __future__ import annotations

import math
from typing import Literal, Optional, Sequence, Tuple, Union

import torch

__all__ = [
    'PairLayout', 'FrequencyScaling', 'axial_frequencies', 'scale_frequencies', 'rotation_table',
    'apply_pair_rotation', 'apply_block_rotation', 'pad_prefix', 'compute_dtype',
]

PairLayout = Literal['interleaved', 'half']
FrequencyScaling = Literal['none', 'linear', 'ntk', 'yarn']


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
        xc = torch.view_as_complex(rotated.to(ct).reshape(*rotated.shape[:-1], pairs, 2))
        out = torch.view_as_real(xc * rot).flatten(-2).to(x.dtype)
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
