"""Rotary frequencies: the geometric table and its scaling for longer inputs.

Every rotary encoding of vispe builds its frequencies here: RoPE-ViT's axial tables, GTA's and
PRoPE's per-axis tables, the LLM tables of the multimodal rotary (Llama / Qwen2-VL's
``1 / theta ** (arange(0, d, 2) / d)``, bit for bit) and, for sinusoidal absolute embeddings, the
same geometric table. Frequencies are float32 unless a dtype is asked for.

Scaling for inputs longer than in training is a table of named functions (as transformers'
``ROPE_INIT_FUNCTIONS``), `FREQUENCY_SCALING`, each ``(freqs, factor, train_length, betas) ->
(freqs, magnitude)``; `scale_frequencies` looks the name up and names the valid ones otherwise, and
`scale_axis_frequencies` is the one call every axial table makes per coordinate axis (the table's
options, RIFLEx's repetition length included). The same entries serve ViTs, vision towers and the
diffusion transformers of `vispe.integrations.patch_dit` (whose scaling may change with the timestep).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Literal, Optional, Tuple

import torch

__all__ = ['FrequencyScaling', 'FREQUENCY_SCALING', 'RIFLEX_MARGIN', 'axial_frequencies', 'mixed_axis_angles',
           'riflex_frequencies', 'scale_frequencies', 'scale_axis_frequencies']

FrequencyScaling = Literal['none', 'linear', 'ntk', 'yarn', 'riflex']
Betas = Tuple[float, float]
ScalingFunction = Callable[[torch.Tensor, float, float, Betas], Tuple[torch.Tensor, float]]


def axial_frequencies(num_pairs: int, theta: float, step: float = 2.0, dim: Optional[int] = None,
                      dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> torch.Tensor:
    """Geometric frequencies ``1 / theta ** (step * k / dim)`` for ``k < num_pairs``, in ``dtype``.

    With ``dim`` the head dim and ``step = 4`` this is RoPE-ViT's 2D axial table ``1/theta^(4k/hd)``;
    with ``step = 2`` and ``dim = hd`` it is 1D RoPE's ``1/theta^(2k/hd)`` (Llama's ``inv_freq``);
    with ``step = 1`` and ``dim = num_pairs`` GTA's and PRoPE's ``theta^(-k / F)`` (and MAE's sin-cos
    ``1 / 10000^(k / (G/2))``).
    """
    dim = dim if dim is not None else 2 * num_pairs
    k = torch.arange(num_pairs, dtype=dtype, device=device)
    return 1.0 / theta ** (step * k / dim)


def mixed_axis_angles(coord: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE-Mixed's angles of one coordinate axis: ``coord`` ``(..., N)`` against learned per-layer,
    per-head frequencies ``(L, H, P)`` -> ``(L, ..., H, N, P)`` (batch dims before the heads). The sum
    over axes is the angle of each pair (Heo et al., ECCV 2024)."""
    f = freqs.reshape(freqs.shape[0], *([1] * (coord.dim() - 1)), freqs.shape[1], 1, freqs.shape[2])
    return coord.unsqueeze(-1).unsqueeze(-3) * f


def _none(freqs: torch.Tensor, factor: float, train_length: float, betas: Betas) -> Tuple[torch.Tensor, float]:
    return freqs, 1.0


def _linear(freqs: torch.Tensor, factor: float, train_length: float, betas: Betas) -> Tuple[torch.Tensor, float]:
    """Position interpolation (Chen et al. 2023): every frequency divided by ``factor``."""
    return freqs / factor, 1.0


def _ntk(freqs: torch.Tensor, factor: float, train_length: float, betas: Betas) -> Tuple[torch.Tensor, float]:
    """NTK-aware base scaling (bloc97 2023), ``theta' = theta * factor^(d / (d - 2))``, which for a
    geometric table sorted from high to low frequency is ``f_k * factor^(-(2k / (d - 2)))``: the highest
    frequency kept, the lowest interpolated."""
    d = 2 * freqs.numel()
    if d <= 2:
        return freqs / factor, 1.0
    k = torch.arange(freqs.numel(), dtype=freqs.dtype, device=freqs.device)
    return freqs * factor ** (-2 * k / (d - 2)), 1.0


def _yarn(freqs: torch.Tensor, factor: float, train_length: float, betas: Betas) -> Tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) "NTK-by-parts": frequencies that turn more than ``beta_fast`` times over
    the training length are kept, fewer than ``beta_slow`` times interpolated, a ramp linear in the
    number of turns between (transformers ramps linearly in the pair index: the same ends, another
    middle); magnitude ``0.1 ln(factor) + 1`` (the attention temperature)."""
    beta_fast, beta_slow = betas
    rotations = train_length * freqs.abs() / (2 * math.pi)
    ramp = ((rotations - beta_slow) / (beta_fast - beta_slow)).clamp(0, 1)
    return freqs / factor * (1 - ramp) + freqs * ramp, 0.1 * math.log(factor) + 1.0


RIFLEX_MARGIN = 0.9
"""RIFLEx's released margin: the lowered frequency turns 0.9 of a period over the test length."""


def riflex_frequencies(freqs: torch.Tensor, test_length: float, repetition: float) -> torch.Tensor:
    """RIFLEx (Zhao et al., ICML 2025, "RIFLEx: A Free Lunch for Length Extrapolation in Video Diffusion
    Transformers", arXiv:2502.15894): only the intrinsic frequency changes, the one whose period
    ``2 pi / f`` rounded to whole positions is nearest ``repetition`` (the length after which the
    trained model's videos repeat; the first on a tie, along the last dim). When ``test_length`` exceeds
    that period the frequency becomes ``0.9 * 2 pi / test_length``, so that it turns less than once over
    the whole sequence; otherwise nothing changes."""
    periods = torch.round(2 * math.pi / freqs.abs())
    nearest = (periods - repetition).abs().argmin(-1, keepdim=True)
    intrinsic = torch.arange(freqs.shape[-1], device=freqs.device) == nearest
    lowered = torch.full_like(freqs, RIFLEX_MARGIN * 2 * math.pi / test_length).copysign(freqs)
    return torch.where(intrinsic & (periods < test_length), lowered, freqs)


def _riflex(freqs: torch.Tensor, factor: float, train_length: float, betas: Betas) -> Tuple[torch.Tensor, float]:
    """RIFLEx (`riflex_frequencies`) for a sequence ``factor`` times the training length, the intrinsic
    frequency taken as the one whose period is nearest the training length."""
    return riflex_frequencies(freqs, factor * train_length, train_length), 1.0


FREQUENCY_SCALING: Dict[str, ScalingFunction] = {
    'none': _none, 'linear': _linear, 'ntk': _ntk, 'yarn': _yarn, 'riflex': _riflex}
"""Frequency scaling by name: ``(freqs, factor, train_length, (beta_fast, beta_slow)) -> (freqs, magnitude)``."""


def scale_frequencies(
        freqs: torch.Tensor,
        factor: float,
        method: FrequencyScaling,
        train_length: float,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
) -> Tuple[torch.Tensor, float]:
    """Adapt one axis' frequencies to a sequence ``factor`` times longer than ``train_length``.

    Returns the new frequencies and a magnitude factor for cos / sin (1 except for YaRN). A factor of
    at most 1 (no longer than in training) leaves the frequencies as they are.
    """
    if method not in FREQUENCY_SCALING:
        raise ValueError(f'frequency scaling must be one of {tuple(FREQUENCY_SCALING)}, got {method!r}')
    if method == 'none' or factor <= 1.0:  # 'none' first: a traced (symbolic) factor is then never compared
        return freqs, 1.0
    return FREQUENCY_SCALING[method](freqs, factor, train_length, (yarn_beta_fast, yarn_beta_slow))


def scale_axis_frequencies(
        freqs: torch.Tensor,
        factor: float,
        method: FrequencyScaling,
        train_length: float,
        yarn_beta_fast: float = 32.0,
        yarn_beta_slow: float = 1.0,
        riflex_repetition: Optional[float] = None,
) -> Tuple[torch.Tensor, float]:
    """One coordinate axis' frequencies for an axis ``factor`` times its training length ``train_length``:
    `scale_frequencies`, except that RIFLEx with a ``riflex_repetition`` (the length after which the trained
    model repeats itself) takes the intrinsic frequency nearest that length rather than the training length."""
    if method == 'riflex' and riflex_repetition is not None and factor > 1.0:
        return riflex_frequencies(freqs, factor * train_length, riflex_repetition), 1.0
    return scale_frequencies(freqs, factor, method, train_length, yarn_beta_fast, yarn_beta_slow)
