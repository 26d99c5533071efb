"""Directional 2D RoPE: each channel pair rotates with the position measured along its own direction.

A pair ``k`` with unit direction ``u_k`` and frequency ``w_k`` turns by ``w_k * (u_k . p)``: a
RoPE-Mixed whose frequency vectors ``f_k = w_k u_k`` are fixed instead of learned, so both
encodings here are `MixedAnglePE` with a frequency buffer, shift-invariant between patch tokens,
prefix tokens not rotated. Where they differ is how the directions spread over the plane:

* Golden-Gate RoPE: consecutive pairs (and heads) step by a golden-ratio angle, so no two pairs of
  a head share a direction and the directions of any few pairs are nearly uniform;
* Spiral RoPE: ``K`` directions uniformly spaced over a half turn, each taking a share of the
  frequencies.

Axial RoPE (RoPE-ViT) is the ``K = 2`` case of the second one.
"""
from __future__ import annotations

import math
from typing import Literal, Tuple

import torch

from ..contract import PEContext
from ..positions import Positions, grid_coordinates
from ..registry import register_pe
from ..rotary import axial_frequencies
from ._checks import check_min_int, check_nonnegative, check_positive
from .rope import MixedAnglePE

__all__ = ['DirectionalRope', 'RopeGolden', 'RopeSpiral', 'golden_gate_frequencies', 'spiral_frequencies',
           'spiral_layout']

GOLDEN_SPACING = math.pi * (math.sqrt(5.0) - 1.0) / 2.0
"""The golden angle taken modulo a half turn, ``pi / phi`` (about 111.25 degrees): a direction and its
opposite give the same set of rotations up to sign, so directions only matter modulo pi."""


def golden_gate_frequencies(num_heads: int, head_dim: int, min_freq: float = 0.2, max_freq: float = 20.0,
                            p_zero_freqs: float = 0.0, spacing: float = GOLDEN_SPACING) -> torch.Tensor:
    """Golden-Gate RoPE's frequency vectors ``(2, H, hd/2)`` (x first), float64.

    Pair ``k`` of head ``h`` points at angle ``(h * hd/2 + k) * spacing`` and has magnitude ``w_k``: the
    first ``round(p_zero_freqs * hd/2)`` magnitudes are 0 (position-free pairs), the others
    log-spaced from ``min_freq`` up to ``max_freq``.
    """
    pairs = head_dim // 2
    zeros = round(p_zero_freqs * pairs)
    ramp = torch.linspace(0.0, 1.0, pairs - zeros, dtype=torch.float64)
    magnitude = torch.cat([torch.zeros(zeros, dtype=torch.float64), min_freq * (max_freq / min_freq) ** ramp])
    angle = torch.arange(num_heads * pairs, dtype=torch.float64).reshape(num_heads, pairs) * spacing
    return torch.stack([angle.cos(), angle.sin()]) * magnitude


def spiral_layout(head_dim: int, num_directions: int = 4, max_freq: float = 1.5, theta: float = 10000.0,
                  same_freqs: bool = False, truncate: float = 0.0
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spiral RoPE's pairs in the released order: unit directions ``(2, hd/2)`` (x first), magnitudes
    ``(hd/2,)`` and whether each pair was turned from the y axis ``(hd/2,)`` (else from x), float64.

    With ``R = num_directions / 2``: the first half of the pairs measures along y (rows), the second
    along x (columns); in every run of ``2R`` consecutive pairs the ``i``-th two are turned by
    ``i * pi / num_directions`` (y turning towards +x, x towards -y), so the directions are
    ``num_directions`` angles spaced by ``pi / num_directions``. Magnitudes per half,
    ``max_freq * theta^(-2j / E)``: with ``same_freqs`` ``E = hd / (2R)`` and every direction repeats
    the same pairs of magnitudes, else ``E = hd / 2`` and the magnitudes run on through the
    directions; the last ``int(truncate * count)`` magnitudes (the lowest) are set to 0.
    """
    rotations = num_directions // 2
    quarter = head_dim // 4  # pairs per half
    count = head_dim // (4 * rotations) if same_freqs else quarter
    magnitude = max_freq * axial_frequencies(count, theta, step=2.0, dim=2 * count, dtype=torch.float64)
    cut = int(count * truncate)
    if cut:
        magnitude[-cut:] = 0.0
    p = torch.arange(2 * quarter)
    m = p % quarter
    index = 2 * (m // (2 * rotations)) + m % 2 if same_freqs else m
    alpha = ((p % (2 * rotations)) // 2).double() * math.pi / (2 * rotations)
    along_y = p < quarter
    ux = torch.where(along_y, alpha.sin(), alpha.cos())
    uy = torch.where(along_y, alpha.cos(), -alpha.sin())
    return torch.stack([ux, uy]), magnitude[index], along_y


def spiral_frequencies(head_dim: int, num_directions: int = 4, max_freq: float = 1.5, theta: float = 10000.0,
                       same_freqs: bool = False, truncate: float = 0.0) -> torch.Tensor:
    """Spiral RoPE's frequency vectors ``(2, hd/2)`` (x first), float64: `spiral_layout`'s directions
    times magnitudes."""
    direction, magnitude, _ = spiral_layout(head_dim, num_directions, max_freq, theta, same_freqs, truncate)
    return direction * magnitude


def _check_planar(name: str, ctx: PEContext) -> None:
    if ctx.host_axes not in (None, 2):
        raise ValueError(f'encoding {name!r} spreads directions over the 2D plane, but the host positions have '
                         f'{ctx.host_axes} coordinate axes (grid {ctx.grid_size})')


def _check_plane_positions(name: str, coords: torch.Tensor) -> None:
    if coords.shape[-1] != 2:
        raise ValueError(f'encoding {name!r} spreads directions over the 2D plane, but the positions have '
                         f'{coords.shape[-1]} coordinate axes')


class DirectionalRope(MixedAnglePE):
    """`MixedAnglePE` with fixed frequency vectors ``(2, 1, H', hd/2)``: one table for every layer.

    The vectors are a non-persistent buffer: they follow from the options, so checkpoints of a model
    with a directional RoPE carry none of them. They stay float32 when the model is cast to half
    precision (``float32_buffers``): a rounded frequency turns every angle by a rounding error that grows
    with the position.
    """
    larger_input = 'interpolate'
    float32_buffers = frozenset({'freqs'})

    def __init__(self, ctx: PEContext, grid_mode: str, freqs: torch.Tensor) -> None:
        _check_planar(self.name, ctx)
        super().__init__(ctx, grid_mode if grid_mode != 'image' else 'index', 2)
        self.grid_mode = grid_mode
        self.register_buffer('freqs', freqs.to(torch.float32), persistent=False)


@register_pe('rope_golden')
class RopeGolden(DirectionalRope):
    """Golden-Gate RoPE (J. Xiong, "On N-dimensional Rotary Positional Embeddings", blog post, 2025,
    https://jerryxio.ng/posts/nd-rope).

    Pair ``k`` of head ``h`` rotates by ``w_k * (cos phi, sin phi) . (x, y)`` with
    ``phi = (h * hd/2 + k) * direction_spacing`` (default ``pi / phi_golden``, the golden angle modulo
    a half turn) and ``w_k`` log-spaced from ``min_freq`` to ``max_freq`` after a share
    ``p_zero_freqs`` of zero frequencies. Positions (``grid_mode='image'``, the released code's):
    patch centres spread evenly over ``[-sqrt(W/H), sqrt(W/H)]`` in x and ``[-sqrt(H/W), sqrt(H/W)]``
    in y, so every image spans the same area and a larger one is sampled more densely; ``index`` and
    ``normalized`` use vispe's grid modes instead. The released code rotates channel ``k`` with
    ``k + hd/2``; vispe rotates ``(2k, 2k + 1)``: the same attention up to a fixed permutation of
    the q / k channels.

    Args:
        min_freq: lowest nonzero frequency magnitude (radians per unit of position).
        max_freq: highest frequency magnitude.
        p_zero_freqs: share of the pairs left unrotated, in ``[0, 1]``.
        direction_spacing: angle between the directions of consecutive pairs, radians.
        grid_mode: ``image`` (centred, aspect-preserving unit area; point sets keep their coordinates),
            ``index`` or ``normalized``.
    """
    paper = 'J. Xiong, "On N-dimensional Rotary Positional Embeddings", blog post, 2025'

    def __init__(
            self,
            ctx: PEContext,
            *,
            min_freq: float = 0.2,
            max_freq: float = 20.0,
            p_zero_freqs: float = 0.0,
            direction_spacing: float = GOLDEN_SPACING,
            grid_mode: Literal['image', 'index', 'normalized'] = 'image',
    ) -> None:
        name = 'rope_golden'
        check_positive(name, 'min_freq', min_freq)
        check_positive(name, 'max_freq', max_freq)
        if max_freq < min_freq:
            raise ValueError(f"option 'max_freq' of encoding {name!r} must be >= min_freq={min_freq}, got {max_freq}")
        if not (check_nonnegative(name, 'p_zero_freqs', p_zero_freqs) <= 1):
            raise ValueError(f"option 'p_zero_freqs' of encoding {name!r} must be in [0, 1], got {p_zero_freqs}")
        check_positive(name, 'direction_spacing', direction_spacing)
        if ctx.head_dim % 2:
            raise ValueError(f'encoding {name!r} needs an even head_dim, got head_dim={ctx.head_dim}')
        freqs = golden_gate_frequencies(ctx.num_heads, ctx.head_dim, min_freq, max_freq, p_zero_freqs,
                                        direction_spacing)
        super().__init__(ctx, grid_mode, freqs.unsqueeze(1))
        self.min_freq, self.max_freq, self.p_zero_freqs = min_freq, max_freq, p_zero_freqs
        self.direction_spacing = direction_spacing

    def coordinates(self, pos: Positions) -> torch.Tensor:
        if self.grid_mode != 'image':
            return super().coordinates(pos)
        coords = grid_coordinates(pos, 'index').flip(-1)
        if pos.index_grids is not None:  # NaFlex: each sample against its own grid
            scale, shift = zip(*(_image_affine(g, coords) for g in pos.index_grids))
            return coords * torch.stack(scale).unsqueeze(1) + torch.stack(shift).unsqueeze(1)
        grid = pos.index_grid or pos.train_grid
        if grid is None:  # a point set: its coordinates as they are (the released N-d form)
            return coords
        _check_plane_positions(self.name, coords)
        scale, shift = _image_affine(grid, coords)
        return coords * scale + shift


def _image_affine(grid: Tuple[int, ...], like: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale and shift ``(2,)`` (x first) taking patch indices of ``grid`` (h, w) to the released
    positions: ``linspace(-lim, lim, n)`` per axis, ``lim_x = sqrt(w / h)``, ``lim_y = sqrt(h / w)``."""
    h, w = grid
    lim = (math.sqrt(w / h), math.sqrt(h / w))
    scale = [2 * l / (n - 1) if n > 1 else 0.0 for l, n in zip(lim, (w, h))]
    shift = [-l if n > 1 else 0.0 for l, n in zip(lim, (w, h))]
    return like.new_tensor(scale), like.new_tensor(shift)


@register_pe('rope_spiral')
class RopeSpiral(DirectionalRope):
    """Spiral RoPE ("Spiral RoPE: Rotate Your Rotary Positional Embeddings in the 2D Plane",
    arXiv:2602.03227, 2026; code and DeiT / DiT checkpoints: huajianduzhuo-code/Spiral_RoPE).

    ``num_directions`` (the paper's ``K``; the released ``rotate`` is ``K / 2``) directions spaced by
    ``pi / K``; pair ``p`` rotates by ``w (u . (x, y))`` with its direction and magnitude laid out as
    the released DeiT does (`spiral_frequencies`): magnitudes ``max_freq * theta^(-2j/E)``, every
    direction with magnitudes of its own unless ``same_freqs``. Positions as released:
    ``grid_mode='normalized'``, patch index times training grid over grid (interpolation at other
    sizes). The class token is not rotated.

    The released code turns the angle *image* of each direction about the grid centre by bilinear
    resampling with border padding: the angle is ``w * clamp(c_b + u . (p - c), 0, 2 c_b)`` (``c`` the
    grid centre, ``c_b`` its coordinate along the pair's unturned axis), linear where the turned
    position stays in the grid and clamped in the corners. ``corners='linear'`` (default) uses
    ``w * u . p`` everywhere, exactly shift-invariant, equal to the released angles up to a constant
    per pair on every patch whose turned positions stay in the grid, hence the same patch-to-patch
    logits there; ``corners='clamp'`` reproduces the released angles everywhere (needed for the
    released checkpoints' logits), at the cost of shift invariance near the corners.

    Args:
        num_directions: K, an even number >= 2 (2 is axial RoPE); head_dim must be divisible by 2K
            (4K with ``same_freqs``).
        max_freq: the highest magnitude (released default 1.5).
        theta: base of the magnitudes (10000).
        same_freqs: every direction gets the same magnitudes (the released ``same_theta``).
        truncate: share of the lowest magnitudes set to 0, in ``[0, 1)``.
        grid_mode: ``normalized`` (released) or ``index``.
        corners: ``linear`` or ``clamp`` (the released code's angles, see above).
    """
    paper = 'Spiral RoPE, arXiv:2602.03227, 2026'
    float32_buffers = frozenset({'freqs', 'direction', 'magnitude'})  # the last two with corners='clamp'

    def __init__(
            self,
            ctx: PEContext,
            *,
            num_directions: int = 4,
            max_freq: float = 1.5,
            theta: float = 10000.0,
            same_freqs: bool = False,
            truncate: float = 0.0,
            grid_mode: Literal['normalized', 'index'] = 'normalized',
            corners: Literal['linear', 'clamp'] = 'linear',
    ) -> None:
        name = 'rope_spiral'
        check_min_int(name, 'num_directions', num_directions, 2)
        if num_directions % 2:
            raise ValueError(f"option 'num_directions' of encoding {name!r} must be even (directions come in "
                             f"pairs turned from y and from x), got {num_directions}")
        check_positive(name, 'max_freq', max_freq)
        check_positive(name, 'theta', theta)
        if not (check_nonnegative(name, 'truncate', truncate) < 1):
            raise ValueError(f"option 'truncate' of encoding {name!r} must be in [0, 1), got {truncate}")
        multiple = (4 if same_freqs else 2) * num_directions
        if ctx.head_dim % multiple:
            raise ValueError(f'encoding {name!r} with num_directions={num_directions}'
                             f'{", same_freqs=True" if same_freqs else ""} needs head_dim divisible by {multiple}, '
                             f'got head_dim={ctx.head_dim}')
        direction, magnitude, along_y = spiral_layout(ctx.head_dim, num_directions, max_freq, theta, same_freqs,
                                                      truncate)
        super().__init__(ctx, grid_mode, (direction * magnitude)[:, None, None])
        self.num_directions, self.max_freq, self.theta = num_directions, max_freq, theta
        self.same_freqs, self.truncate, self.corners = same_freqs, truncate, corners
        if corners == 'clamp':
            self.shift_invariant = False
            self.register_buffer('direction', direction.to(torch.float32), persistent=False)
            self.register_buffer('magnitude', magnitude.to(torch.float32), persistent=False)
            self.register_buffer('along_y', along_y, persistent=False)

    def angles(self, coords, pos):
        if self.corners == 'linear':
            return super().angles(coords, pos)
        _check_plane_positions(self.name, coords)
        grids = pos.index_grids or [pos.index_grid or pos.train_grid]  # a NaFlex batch: each sample's own
        if None in grids:
            raise ValueError("encoding 'rope_spiral' with corners='clamp' needs grid positions (the clamp range "
                             "is the grid's)")
        centre = coords.new_tensor([self._centre(g, pos.train_grid) for g in grids])  # (G, 2), x first
        if pos.index_grids is not None:
            centre = centre.unsqueeze(1)  # (B, 1, 2) against coords (B, N, 2)
        else:
            centre = centre[0]
        along = torch.where(self.along_y, centre[..., 1:], centre[..., :1])  # c_b: (..., P)
        turned = (coords - centre) @ self.direction.to(coords.dtype) + along  # (..., N, P)
        theta = torch.minimum(turned.clamp(min=0), 2 * along) * self.magnitude.to(coords.dtype)
        return theta.unsqueeze(-3).unsqueeze(0), 1.0  # (1, [B,] 1, N, P): every layer and head

    def _centre(self, grid: Tuple[int, ...], train_grid) -> Tuple[float, float]:
        """The grid centre (x, y) in this encoding's coordinates (normalized: index * train / n)."""
        h, w = grid
        th, tw = train_grid if self.grid_mode == 'normalized' and train_grid is not None else grid
        return (w - 1) / 2 * tw / w, (h - 1) / 2 * th / h
