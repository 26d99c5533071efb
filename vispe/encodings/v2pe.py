"""V2PE (Ge et al. 2024, InternVL): 1D positions with a fractional step for visual tokens."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..contract import PEContext
from ..registry import register_pe
from ._checks import check_min_int
from .multimodal import MULTIMODAL_FAMILY, MultimodalRoPE, draw_strides

__all__ = ['V2PE']


@register_pe('v2pe', family=MULTIMODAL_FAMILY)
class V2PE(MultimodalRoPE):
    """V2PE (Ge et al. 2024, InternVL): 1D ids with a fractional step for visual tokens.

    After the token at position ``p`` (integer), the ``n`` visual tokens of a block sit at ``p + k * delta``
    (``k = 1..n``), ``delta = stride / tokens_per_tile`` (InternVL: 256 tokens per tile); the next text token
    is at ``ceil(p + n * delta) + 1``. Training draws ``stride`` per block from ``strides``
    ({1, 2, 4, ..., 256}); inference uses the fixed ``stride`` (64 in the V2PE evaluation scripts).
    ``stride = tokens_per_tile`` reproduces ordinary 1D RoPE. Ids are float64 (exact for the power-of-two
    steps); the rotary takes the float positions unrounded. One id axis, every pair reads it.

    Args:
        stride: inference stride (``delta = stride / tokens_per_tile``).
        tokens_per_tile: tokens per tile (256); None makes ``delta = stride / n`` per block (the
            Multimodal-RoPEs port's convention: the whole block spans ``stride`` positions).
        strides: the training choices.
        random_in_training: draw the stride per block in training.
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'p'
    paper = 'Ge et al., V2PE, arXiv:2412.09616'
    row_runs = False

    def __init__(self, ctx: PEContext, *, stride: int = 64, tokens_per_tile: Optional[int] = 256,
                 strides: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256), random_in_training: bool = True,
                 theta: float = 1e6, rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        self.stride = check_min_int(self.name, 'stride', stride)
        if not strides:
            raise ValueError(f"option 'strides' of encoding {self.name!r} must not be empty")
        self.strides = tuple(check_min_int(self.name, 'strides', s) for s in strides)
        self.tokens_per_tile = (None if tokens_per_tile is None
                                else check_min_int(self.name, 'tokens_per_tile', tokens_per_tile))
        self.random_in_training = random_in_training
        self.register_axes()

    @property
    def float_ids(self) -> bool:
        return True

    def draw(self, seg, training, generator):
        seg['stride'] = draw_strides(seg['n'], self.stride, self.strides, training and self.random_in_training,
                                     generator, torch.long)

    def _denominator(self, n: torch.Tensor) -> torch.Tensor:
        return n if self.tokens_per_tile is None else torch.full_like(n, self.tokens_per_tile)

    def visual_extent(self, seg):
        num = seg['n'] * seg['stride']
        den = self._denominator(seg['n'])
        return (num + den - 1) // den  # ceil(n * delta) in integers: exact

    def visual_block(self, seg):
        delta = seg['stride'].double() / self._denominator(seg['n']).double()
        return (seg['start'].double() - 1 + delta)[None], delta[None]
