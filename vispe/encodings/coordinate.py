"""Coordinate encodings: fixed maps from continuous coordinates to features (NeRF, Fourier features).

A coordinate MLP (NeRF, an image-fitting network) *replaces* its input coordinates by such a map;
a transformer adds a projection of it to the tokens. Each encoding therefore exists twice:

* a plain ``nn.Module`` (`FrequencyEncoding`, `GaussianFourierFeatures`): ``forward(coords)`` maps
  ``(..., D)`` coordinates to ``(..., out_dim)`` features, nothing else;
* a registered vispe encoding (``'nerf_freq'``, ``'fourier_gaussian'``) that holds the plain module
  as ``encoder`` and offers ``encode(coords)`` / ``out_dim`` for coordinate MLPs, plus
  ``embedding(pos)`` / ``embed(x, pos)`` for token sequences: grid positions become pixel-centre
  coordinates of the current grid in ``[0, 1]`` (``grid_range='unit'``) or ``[-1, 1]``
  (``'signed'``), so a larger input samples the same range more densely (interpolation); point
  sets are used as given. A learned linear map to the token width follows (``project=True``).
"""
from __future__ import annotations

import math
from typing import Literal, Optional

import torch
from torch import nn

from ..positions import Positions
from ..registry import register_pe
from ._checks import check_positive
from .additive import AdditivePE
from ..contract import PEContext, autocast_off, resolve_num_axes

__all__ = ['FrequencyEncoding', 'GaussianFourierFeatures', 'NeRFFrequencyPE', 'GaussianFourierPE',
           'CoordinatePE', 'unit_coordinates']

GridRange = Literal['unit', 'signed']


def unit_coordinates(pos: Positions, grid_range: GridRange = 'unit') -> torch.Tensor:
    """Continuous coordinates of ``pos``: pixel centres ``(i + 0.5) / n`` of a grid in ``[0, 1]``
    (or mapped to ``[-1, 1]`` with ``'signed'``), in a NaFlex batch each sample's over its own grid;
    point sets unchanged."""
    if grid_range not in ('unit', 'signed'):
        raise ValueError(f"grid_range must be 'unit' or 'signed', got {grid_range!r}")
    if pos.sample_grids is None:
        return pos.coords
    # (D,) for one grid, (B, 1, D) per sample in a NaFlex batch
    size = torch.tensor(pos.grid if pos.grids is None else [[g] for g in pos.grids], dtype=pos.coords.dtype,
                        device=pos.device)
    unit = (pos.coords + 0.5) / size
    return unit if grid_range == 'unit' else 2 * unit - 1


MAX_LEVELS = 32


class FrequencyEncoding(nn.Module):
    """NeRF's frequency ("positional") encoding as a plain module: ``(..., D) -> (..., out_dim)``.

    ``gamma(p) = (p, sin(f_0 p), cos(f_0 p), ..., sin(f_{L-1} p), cos(f_{L-1} p))``, each term over
    all D axes, with ``f_k = 2^k`` (``log_sampling``) or ``f_k`` evenly spaced in ``[1, 2^(L-1)]``,
    times ``pi`` when ``multiply_pi``. ``out_dim = D * (include_input + 2 L)``.

    Args:
        input_dim: coordinate axes D.
        levels: number of frequencies L.
        include_input: prepend (layout ``'nerf'``) or append (``'grouped'``) the raw coordinates.
        multiply_pi: use ``2^k pi`` (the paper's equation 4) instead of ``2^k`` (the released code).
        log_sampling: ``2^k`` frequencies; False: ``linspace(1, 2^(L-1), L)``.
        layout: ``'nerf'``: per frequency ``[sin over axes, cos over axes]`` after the input;
            ``'grouped'``: ``[all sines, all cosines]`` with each axis' frequencies contiguous and
            the input last (nerfstudio's ``NeRFEncoding`` order).
    """

    def __init__(
            self,
            input_dim: int,
            levels: int = 10,
            include_input: bool = True,
            multiply_pi: bool = False,
            log_sampling: bool = True,
            layout: Literal['nerf', 'grouped'] = 'nerf',
    ) -> None:
        super().__init__()
        if input_dim <= 0:
            raise ValueError(f'input_dim must be positive, got {input_dim}')
        if not 0 <= levels <= MAX_LEVELS:
            # beyond 2^31 a float32 product with a unit coordinate keeps no fractional part: noise features
            raise ValueError(f'levels must be in 0..{MAX_LEVELS} (the top frequency is 2^(levels - 1)), got {levels}')
        if layout not in ('nerf', 'grouped'):
            raise ValueError(f"layout must be 'nerf' or 'grouped', got {layout!r}")
        if levels == 0 and not include_input:
            raise ValueError('levels=0 with include_input=False encodes nothing')
        self.input_dim = input_dim
        self.levels = levels
        self.include_input = include_input
        self.multiply_pi = multiply_pi
        self.log_sampling = log_sampling
        self.layout = layout
        self.out_dim = input_dim * (int(include_input) + 2 * levels)

    def frequencies(self, device: Optional[torch.device] = None) -> torch.Tensor:
        """The L frequencies ``f_k``, float32. Computed where they are used rather than kept as a
        buffer: a buffer would follow the model to bf16, and ``2^k pi`` is not exact there."""
        if self.log_sampling:
            freqs = 2.0 ** torch.linspace(0.0, self.levels - 1, self.levels, device=device)
        else:
            freqs = torch.linspace(1.0, 2.0 ** (self.levels - 1), self.levels, device=device)
        return freqs * math.pi if self.multiply_pi else freqs

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        if coords.shape[-1] != self.input_dim:
            raise ValueError(f'FrequencyEncoding was built for {self.input_dim}D coordinates, got '
                             f'{coords.shape[-1]}D')
        dtype = coords.dtype
        coords = coords.float()  # float32 phases: 2^(L-1) x at L = 10 needs the mantissa
        freqs = self.frequencies(coords.device)
        if self.layout == 'nerf':
            scaled = coords[..., None, :] * freqs[:, None]  # (..., L, D)
            feats = torch.stack([scaled.sin(), scaled.cos()], dim=-2).flatten(-3)
            out = torch.cat([coords, feats], -1) if self.include_input else feats
        else:
            scaled = (coords[..., :, None] * freqs).flatten(-2)  # (..., D * L), axis-major
            feats = torch.cat([scaled.sin(), scaled.cos()], -1)
            out = torch.cat([feats, coords], -1) if self.include_input else feats
        return out.to(dtype)

    def extra_repr(self) -> str:
        return f'input_dim={self.input_dim}, levels={self.levels}, out_dim={self.out_dim}, layout={self.layout}'


class GaussianFourierFeatures(nn.Module):
    """Random Fourier features (Tancik et al., NeurIPS 2020) as a plain module: ``(..., D) -> (..., 2m)``.

    ``gamma(v) = [cos(2 pi B v), sin(2 pi B v)]`` with ``B`` an ``(m, D)`` matrix of i.i.d.
    ``N(0, scale^2)`` entries, drawn once and fixed (a buffer, so checkpoints keep it).

    Args:
        input_dim: coordinate axes D.
        num_features: rows m of ``B`` (``out_dim = 2 m``).
        scale: standard deviation sigma of ``B``'s entries.
        order: ``'cos_sin'`` (the paper's equation) or ``'sin_cos'`` (the authors' released notebook).
        seed: draw ``B`` from a generator with this seed (reproducible); None uses the global RNG.
    """

    def __init__(
            self,
            input_dim: int,
            num_features: int = 256,
            scale: float = 10.0,
            order: Literal['cos_sin', 'sin_cos'] = 'cos_sin',
            seed: Optional[int] = None,
    ) -> None:
        super().__init__()
        if input_dim <= 0 or num_features <= 0:
            raise ValueError(f'input_dim and num_features must be positive, got {input_dim} and {num_features}')
        if not (math.isfinite(scale) and scale > 0):  # inf draws inf frequencies: NaN features
            raise ValueError(f'scale must be a finite number > 0, got {scale}')
        if order not in ('cos_sin', 'sin_cos'):
            raise ValueError(f"order must be 'cos_sin' or 'sin_cos', got {order!r}")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.register_buffer('B', torch.randn(num_features, input_dim, generator=generator) * scale)
        self.input_dim = input_dim
        self.order = order
        self.out_dim = 2 * num_features

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        if coords.shape[-1] != self.input_dim:
            raise ValueError(f'GaussianFourierFeatures was built for {self.input_dim}D coordinates, got '
                             f'{coords.shape[-1]}D')
        # phases reach hundreds of radians: compute them in float32 even under autocast (bf16 would
        # be off by a large fraction of a period)
        with autocast_off(coords.device):
            proj = (2 * math.pi) * coords.float() @ self.B.float().t()
        parts = (proj.cos(), proj.sin()) if self.order == 'cos_sin' else (proj.sin(), proj.cos())
        return torch.cat(parts, dim=-1).to(coords.dtype)

    def extra_repr(self) -> str:
        return f'input_dim={self.input_dim}, out_dim={self.out_dim}, order={self.order}'


class CoordinatePE(AdditivePE):
    """Shared mechanics of the registered coordinate encodings (see the module docstring).

    ``encode(coords)`` / ``out_dim`` for coordinate MLPs; ``embedding(pos)`` for tokens, through a
    learned ``proj`` (``Linear(out_dim, dim)``) when ``project``, else the features themselves
    (which then must have the token width). ``project`` defaults to True, and to False for a host
    that uses the encoding as a coordinate map (``ctx.coordinate_map``). The coordinate axes are the
    ``input_dim`` option, else the host's (``ctx.num_axes``), else its grid's, else 2. Prefix tokens
    get zeros.
    """
    larger_input = 'interpolate'

    def __init__(self, ctx: PEContext, encoder: nn.Module, project: Optional[bool], grid_range: GridRange) -> None:
        super().__init__(ctx)
        if grid_range not in ('unit', 'signed'):
            raise ValueError(f"option 'grid_range' of encoding {self.name!r} must be 'unit' or 'signed', "
                             f"got {grid_range!r}")
        self.encoder = encoder
        self.grid_range = grid_range
        project = not ctx.coordinate_map if project is None else project
        if not project and not ctx.coordinate_map and encoder.out_dim != ctx.dim:
            raise ValueError(f'encoding {self.name!r} with project=False gives {encoder.out_dim} features but the '
                             f'tokens have dim={ctx.dim}; set project=True')
        self.proj = nn.Linear(encoder.out_dim, ctx.dim) if project else None

    @classmethod
    def _input_dim(cls, ctx: PEContext, input_dim: Optional[int]) -> int:
        return resolve_num_axes(ctx, input_dim, cls.name, option='input_dim')

    @property
    def out_dim(self) -> int:
        """Width of `encode`'s features."""
        return self.encoder.out_dim

    def encode(self, coords: torch.Tensor) -> torch.Tensor:
        """Features ``(..., out_dim)`` of continuous coordinates ``(..., D)``."""
        return self.encoder(coords)

    def _rows(self, pos: Positions) -> torch.Tensor:
        feats = self.encode(unit_coordinates(pos, self.grid_range).float())
        if self.proj is not None:
            return self.proj(feats.to(self.proj.weight.dtype))  # a bf16 model's projection takes bf16
        if feats.shape[-1] != self.ctx.dim:
            raise ValueError(f'encoding {self.name!r} with project=False gives {feats.shape[-1]} features but the '
                             f'tokens have dim={self.ctx.dim}; set project=True')
        return feats


@register_pe('nerf_freq', family='coordinate')
class NeRFFrequencyPE(CoordinatePE):
    """NeRF frequency encoding (Mildenhall et al., ECCV 2020), see `FrequencyEncoding`.

    Conventions differ between the paper and the implementations, each is an option:

    * frequencies: the released code (``get_embedder``) uses ``2^k``, ``k = 0..L-1``, log-sampled
      (the default here); the paper's equation 4 writes ``2^k pi`` with coordinates in ``[-1, 1]``
      (``multiply_pi=True``); nerfstudio multiplies by ``2 pi`` (``multiply_pi`` and coordinates
      scaled by 2); ``log_sampling=False`` is the code's linear alternative;
    * the raw input is included by default (the released code; the paper's equation omits it);
    * feature order: ``layout='nerf'`` (the released code) or ``'grouped'`` (nerfstudio).

    NeRF uses L = 10 for positions (``out_dim`` 63 for 3D) and L = 4 for view directions (27).
    Grid tokens are mapped to ``[-1, 1]`` (``grid_range='signed'``).

    Args:
        levels: number of frequencies L.
        include_input: include the raw coordinates.
        multiply_pi: frequencies ``2^k pi`` instead of ``2^k``.
        log_sampling: ``2^k`` frequencies (else evenly spaced up to ``2^(L-1)``).
        layout: feature order, ``'nerf'`` or ``'grouped'``.
        input_dim: coordinate axes (default: the host's ``num_axes``, else its grid's, else 2; 3 for NeRF
            positions).
        project: learned linear map to the token width for `embedding` (default: True, False for a
            coordinate-map host, ``ctx.coordinate_map``).
        grid_range: coordinates of grid tokens, ``'signed'`` ``[-1, 1]`` or ``'unit'`` ``[0, 1]``.
    """
    paper = 'Mildenhall et al., ECCV 2020 (NeRF), arXiv:2003.08934'

    def __init__(
            self,
            ctx: PEContext,
            *,
            levels: int = 10,
            include_input: bool = True,
            multiply_pi: bool = False,
            log_sampling: bool = True,
            layout: Literal['nerf', 'grouped'] = 'nerf',
            input_dim: Optional[int] = None,
            project: Optional[bool] = None,
            grid_range: GridRange = 'signed',
    ) -> None:
        encoder = FrequencyEncoding(self._input_dim(ctx, input_dim), levels, include_input, multiply_pi,
                                    log_sampling, layout)
        super().__init__(ctx, encoder, project, grid_range)


@register_pe('fourier_gaussian', family='coordinate')
class GaussianFourierPE(CoordinatePE):
    """Gaussian random Fourier features (Tancik et al., NeurIPS 2020), see `GaussianFourierFeatures`.

    Defaults are the paper's 2D image-regression setting: m = 256 features, sigma = 10, coordinates
    in ``[0, 1)`` (grid tokens: pixel centres in ``[0, 1]``, ``grid_range='unit'``). ``B`` is fixed
    (not trained) and stored in checkpoints.

    Args:
        scale: standard deviation sigma of ``B``.
        num_features: rows m of ``B`` (``out_dim = 2 m``).
        order: ``'cos_sin'`` (paper) or ``'sin_cos'`` (released notebook).
        seed: seed of ``B`` (None: the global RNG).
        input_dim: coordinate axes (default: the host's ``num_axes``, else its grid's, else 2).
        project: learned linear map to the token width for `embedding` (default: True, False for a
            coordinate-map host, ``ctx.coordinate_map``).
        grid_range: coordinates of grid tokens, ``'unit'`` ``[0, 1]`` or ``'signed'`` ``[-1, 1]``.
    """
    paper = 'Tancik et al., NeurIPS 2020 (Fourier features), arXiv:2006.10739'
    float32_buffers = frozenset({'encoder.B'})

    def __init__(
            self,
            ctx: PEContext,
            *,
            scale: float = 10.0,
            num_features: int = 256,
            order: Literal['cos_sin', 'sin_cos'] = 'cos_sin',
            seed: Optional[int] = None,
            input_dim: Optional[int] = None,
            project: Optional[bool] = None,
            grid_range: GridRange = 'unit',
    ) -> None:
        check_positive('fourier_gaussian', 'scale', scale)
        encoder = GaussianFourierFeatures(self._input_dim(ctx, input_dim), num_features, scale, order, seed)
        super().__init__(ctx, encoder, project, grid_range)
