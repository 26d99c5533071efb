"""VRoPE (Liu et al., EMNLP 2025): symmetric diagonal indices for video, frames along the text axis."""
from __future__ import annotations

from typing import Optional

import torch

from ..contract import PEContext
from ..registry import register_pe
from .multimodal import MULTIMODAL_FAMILY, MultimodalRoPE, stack_axes

__all__ = ['VRoPE']


@register_pe('vrope', family=MULTIMODAL_FAMILY)
class VRoPE(MultimodalRoPE):
    """VRoPE (Liu et al., EMNLP 2025): four symmetric diagonal id axes per visual token.

    For ``T`` frames of ``H x W`` merged tokens: ``span = H + W - 1``, four indices ``u0 = h + w``,
    ``u1 = h + (W-1-w)``, ``u2 = (H-1-h) + w``, ``u3 = (H-1-h) + (W-1-w)``; token ``(t, h, w)`` of a block at
    ``s`` has id ``s + t * span + u_k`` on axis ``k``; rotary pair ``i`` reads axis ``i mod 4``. The next
    segment starts at ``s + T * span``. Follows the authors' ``vrope.py``.

    Args:
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'abcd'
    paper = 'Liu et al., VRoPE, arXiv:2502.11664'

    def __init__(self, ctx: PEContext, *, theta: float = 1e6, rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        self.register_axes()

    def allocate_pairs(self) -> torch.Tensor:
        return torch.arange(self.num_pairs) % 4

    def visual_extent(self, seg):
        return seg['T'] * (seg['H'] + seg['W'] - 1)

    def visual_rows(self, row):
        H, W, h = row['H'], row['W'], row['h']
        base = row['start'] + row['t'] * (H + W - 1)
        v0 = stack_axes(base + h, base + h + W - 1, base + H - 1 - h, base + H - 1 - h + W - 1)
        slope = torch.tensor([[1], [-1], [1], [-1]], device=h.device)
        return v0, slope
