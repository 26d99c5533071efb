"""Circle-RoPE (Wang et al. 2025): every visual token on a circle orthogonal to the text direction."""
from __future__ import annotations

import math
from typing import Dict, Literal, Optional, Tuple

import torch

from ..contract import PEContext
from ..registry import register_pe
from ._checks import check_positive
from .mrope import check_sections
from .multimodal import MULTIMODAL_FAMILY, MultimodalRoPE, Runs

__all__ = ['CircleRoPE']

Tensor = torch.Tensor


def check_finite(name: str, option: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f'option {option!r} of encoding {name!r} must be a finite number, got {value!r}')
    return value


def _unit_interval(name: str, option: str, value: float) -> float:
    if not 0 <= float(value) <= 1:
        raise ValueError(f'option {option!r} of encoding {name!r} must be in [0, 1], got {value!r}')
    return float(value)


@register_pe('circlerope', family=MULTIMODAL_FAMILY)
class CircleRoPE(MultimodalRoPE):
    """Circle-RoPE (Wang et al. 2025, arXiv:2505.16416), as the Multimodal-RoPEs reference implements it.

    Each frame's ``H x W`` tokens are mapped onto a circle in the plane orthogonal to the text direction
    ``(1, 1, 1)``, so every image token is equidistant from the text axis: grid coordinates ``(w, h)``
    (centred when ``move_to_origin``) get the angle ``alpha * normalised atan2(h, w) + (1 - alpha) *
    2 pi k / (H W)`` (``k`` the raster index) and the point ``radius * (cos, sin)``, expressed in the
    orthonormal basis ``u = (-1, 1, 0)/sqrt 2``, ``v = (1, 1, 1)/sqrt 3 x u`` of that plane (ids
    ``(t, h, w)`` = components ``(z, y, x)``); ``dff_rate`` mixes in the un-mapped grid projected the same
    way, ``move_to_positive`` shifts the block by its smallest coordinate (plus ``positive_offset``).
    Frame ``f`` of a video is the first frame's ring moved by ``f * temporal_stride`` on every axis (the
    reference's video extension). The block sits at ``s +`` those coordinates and the next segment starts
    at ``max over all axes + 1``. Computed in float32 as the reference, returned as float64. Rotary:
    M-RoPE's chunked sections.

    Args:
        radius: circle radius.
        auto_radius: instead of ``radius``, ``auto_radius`` times the largest coordinate of the block (the
            reference's ``'auto'`` is 1, ``'auto-k'`` is ``k``).
        alpha: weight of the normalised original angle against the raster-index angle, in [0, 1].
        temporal_stride: spacing of a video's rings.
        move_to_origin: centre the grid before mapping.
        move_to_positive: shift the block by its smallest coordinate (the reference's ``'auto'``).
        positive_offset: a further shift with ``move_to_positive`` (the reference's numeric value).
        dff_rate: weight in [0, 1] of the un-mapped coordinates (0: the circle only; the reference's
            documented example passes ``True``, i.e. 1).
        method: ``'circle'`` or ``'no_circle'`` (the grid projected onto the plane, no circle).
        sections: rotary pairs per axis ``t|h|w`` (chunked, as M-RoPE).
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'thw'
    paper = 'Wang et al., Circle-RoPE, arXiv:2505.16416'
    video_blocks = 'frame'
    row_runs = False

    def __init__(self, ctx: PEContext, *, radius: float = 10.0, auto_radius: Optional[float] = None,
                 alpha: float = 0.5, temporal_stride: float = 1.0, move_to_origin: bool = True,
                 move_to_positive: bool = False, positive_offset: float = 0.0, dff_rate: float = 0.0,
                 method: Literal['circle', 'no_circle'] = 'circle', sections: Optional[Tuple[int, ...]] = None,
                 theta: float = 1e6, rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        name = self.name
        self.radius = check_positive(name, 'radius', radius)
        self.auto_radius = None if auto_radius is None else check_positive(name, 'auto_radius', auto_radius)
        self.alpha = _unit_interval(name, 'alpha', alpha)
        self.dff_rate = _unit_interval(name, 'dff_rate', dff_rate)
        self.temporal_stride = float(check_positive(name, 'temporal_stride', temporal_stride))
        self.move_to_origin = move_to_origin
        self.move_to_positive = move_to_positive
        self.positive_offset = float(check_finite(name, 'positive_offset', positive_offset))
        self.method = method
        self.sections = check_sections(name, sections, self.num_pairs)
        self.register_axes()

    def allocate_pairs(self) -> Tensor:
        t, h, w = self.sections
        return torch.cat([torch.full((t,), 0), torch.full((h,), 1), torch.full((w,), 2)]).long()

    @property
    def float_ids(self) -> bool:
        return True

    def _rings(self, seg: Dict[str, Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
        """float32 ids ``(3, M)`` of the first frame of every block relative to its start, the block of
        each of those ``M`` tokens, and each block's largest id (all axes, all frames)."""
        T, H, W = seg['T'], seg['H'], seg['W']
        dev, f32 = T.device, torch.float32
        hw = H * W
        K, M = hw.numel(), int(hw.sum())
        blk = torch.repeat_interleave(torch.arange(K, device=dev), hw, output_size=M)
        k = torch.arange(M, device=dev) - (torch.cumsum(hw, 0) - hw)[blk]
        Wb = W[blk]
        x, y = (k % Wb).to(f32), (k // Wb).to(f32)
        t_last = (T - 1).to(f32) * self.temporal_stride
        z = torch.zeros_like(x)
        hi = torch.stack([(W - 1).to(f32), (H - 1).to(f32), t_last])  # per-axis max of the block's grid
        if self.move_to_origin:
            centre = hi / 2.0
            x, y, z = x - centre[0][blk], y - centre[1][blk], z - centre[2][blk]
            hi = hi - centre
        u = torch.tensor([-1.0, 1.0, 0.0], dtype=f32, device=dev)
        u = u / torch.linalg.vector_norm(u)
        n = torch.ones(3, dtype=f32, device=dev)
        n = n / torch.linalg.vector_norm(n)
        v = torch.linalg.cross(n, u)
        v = v / torch.linalg.vector_norm(v)
        flat_x, flat_y = x[None] * u[:, None], y[None] * v[:, None]
        plane = flat_x + flat_y  # the grid itself in the plane orthogonal to (1, 1, 1): (3, M)
        if self.method == 'circle':
            if self.auto_radius is not None:
                radius = (hi.amax(0).abs() * self.auto_radius)[blk]
            else:
                radius = torch.full_like(x, float(self.radius))
            theta = torch.atan2(y, x)
            lo_t = torch.full((K,), math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, theta, 'amin')
            hi_t = torch.full((K,), -math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, theta, 'amax')
            span = (hi_t - lo_t)[blk]
            norm = torch.where(span > 0, (theta - lo_t[blk]) / span * (2 * math.pi), theta)
            index = k.to(f32) / hw[blk].to(f32) * (2 * math.pi)
            ang = self.alpha * norm + (1 - self.alpha) * index
            cx, cy = radius * torch.cos(ang), radius * torch.sin(ang)
            coords = cx[None] * u[:, None] + cy[None] * v[:, None]
        else:
            coords = plane
        if self.dff_rate:
            coords = (1 - self.dff_rate) * coords + self.dff_rate * plane
        if self.move_to_positive:
            offset = self.positive_offset
            lo = torch.full((K,), math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, coords.amin(0), 'amin')
            coords = coords + lo.abs()[blk] + offset
        ids = coords.flip(0)  # (t, h, w) = components (z, y, x)
        top = torch.full((K,), -math.inf, dtype=f32, device=dev).scatter_reduce(0, blk, ids.amax(0), 'amax')
        return ids, blk, top + t_last

    def visual_extent(self, seg):
        ids, blk, top = self._rings(seg)
        seg['ring'], seg['ring_block'] = ids, blk
        return top.double() + 1

    def _visual_runs(self, seg):
        ring, blk = seg['ring'], seg['ring_block']
        T, hw = seg['T'], seg['H'] * seg['W']
        dev = ring.device
        # one run per token: frame f of block b is its ring moved by f * temporal_stride on every axis
        reps = T[blk]
        tok = torch.repeat_interleave(torch.arange(ring.shape[1], device=dev), reps)
        first = torch.cumsum(reps, 0) - reps
        frame = torch.arange(tok.numel(), device=dev) - torch.repeat_interleave(first, reps)
        b = blk[tok]
        k = tok - (torch.cumsum(hw, 0) - hw)[b]
        v0 = ring[:, tok].double() + (frame.double() * self.temporal_stride + seg['start'][b].double())[None]
        start = seg['token_start'][b] + frame * hw[b] + k
        return Runs(v0, torch.zeros(1, 1, dtype=torch.float64, device=dev), start, torch.ones_like(start))
