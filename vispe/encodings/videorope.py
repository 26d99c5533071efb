"""VideoRoPE (Wei et al., ICML 2025) and HoPE (Li et al., NeurIPS 2025): a diagonal layout for video."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..contract import PEContext
from ..registry import register_pe
from ._checks import check_positive
from .mrope import check_sections, check_tokens_per_second
from .multimodal import MULTIMODAL_FAMILY, MultimodalRoPE, draw_strides, stack_axes, time_index

__all__ = ['VideoRoPE', 'HoPE']

Tensor = torch.Tensor


def _centred(t: Tensor, row) -> Tensor:
    """Ids ``(t, t + h - (H-1)//2, t + w - (W-1)//2)`` of each row run (w advancing by one)."""
    one = torch.tensor([[0], [0], [1]], device=t.device)
    return stack_axes(t, t + row['h'] - (row['H'] - 1) // 2, t - (row['W'] - 1) // 2), one


@register_pe('videorope', family=MULTIMODAL_FAMILY)
class VideoRoPE(MultimodalRoPE):
    """VideoRoPE (Wei et al., ICML 2025): diagonal layout, adjustable temporal spacing.

    Token ``(t, h, w)`` of a block at ``s``: ``t' = s + delta * tau(t)``, ``h' = t' + h - (H-1)//2``,
    ``w' = t' + w - (W-1)//2`` (the frame centred on the diagonal); the next segment starts at
    ``max(t') + 1`` (the temporal axis, as in the authors' code). Rotary: the high-frequency pairs
    interleave ``h, w`` (``h`` on even, ``w`` on odd pairs below ``2 * sections[1]``), the low-frequency
    pairs carry ``t`` (VideoRoPE's low-frequency temporal allocation; ``[16, 24, 24]`` for head dim 128).
    Ids are int64 when ``delta`` is integral, else float64.

    Args:
        delta: temporal spacing (2).
        tokens_per_second: Qwen2.5-VL timing for timed videos; None (the original, built on Qwen2-VL) uses
            the frame index.
        sections: rotary pairs per axis ``t|h|w`` with ``h == w``.
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'thw'
    paper = 'Wei et al., VideoRoPE, arXiv:2502.05173'

    def __init__(self, ctx: PEContext, *, delta: float = 2.0, tokens_per_second: Optional[float] = None,
                 sections: Optional[Tuple[int, ...]] = None, theta: float = 1e6,
                 rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        self.delta = check_positive(self.name, 'delta', delta)
        self.tokens_per_second = check_tokens_per_second(self.name, tokens_per_second)
        self.sections = check_sections(self.name, sections, self.num_pairs)
        self.register_axes()

    def allocate_pairs(self) -> Tensor:
        t, h, w = self.sections
        if h != w:
            raise ValueError(f'encoding {self.name!r} interleaves h and w pairs, so option sections needs h == w, '
                             f'got {self.sections}')
        axes = torch.zeros(self.num_pairs, dtype=torch.long)
        axes[0:2 * h:2] = 1
        axes[1:2 * h:2] = 2
        return axes

    @property
    def float_ids(self) -> bool:
        return not float(self.delta).is_integer()

    def _scaled(self, tau: Tensor) -> Tensor:
        return tau * self.delta if self.float_ids else tau * int(self.delta)

    def visual_extent(self, seg):
        return self._scaled(time_index(seg['T'] - 1, seg['seconds'], self.tokens_per_second)) + 1

    def visual_rows(self, row):
        tau = time_index(row['t'], row['seconds'], self.tokens_per_second)
        return _centred(row['start'].to(self.id_dtype) + self._scaled(tau), row)


@register_pe('hope', family=MULTIMODAL_FAMILY)
class HoPE(MultimodalRoPE):
    """HoPE (Li et al., NeurIPS 2025, arXiv:2505.20444), as the Multimodal-RoPEs reference implements it.

    Ids: VideoRoPE's diagonal layout, ``t' = s + stride * t``, ``h' = t' + h - (H-1)//2``,
    ``w' = t' + w - (W-1)//2``, with HoPE's *dynamic temporal scaling*: in training each visual block draws
    its ``stride`` from ``temporal_strides`` (the reference draws one per block); otherwise the fixed
    ``temporal_stride``. The next segment starts at ``max(t') + 1``. Ids are float64 (the strides are
    fractional). Rotary: the reference's VideoRoPE allocation (pair ``0`` and the pairs from
    ``2 * sections[1]`` on carry ``t``; ``h`` odd and ``w`` even pairs below) with the temporal pairs not
    rotated (NoPE, HoPE's lowest frequencies). The reference splits videos into one block per frame
    (Qwen3-VL), so ``video_blocks = 'frame'``.

    Args:
        temporal_stride: stride outside training (1: no scaling).
        temporal_strides: the training choices (``[0.5, 0.75, 1, 1.25, 1.5]``, the reference's).
        random_in_training: draw the stride per block in training.
        sections: rotary pairs per axis ``t|h|w``.
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'thw'
    paper = 'Li et al., HoPE, arXiv:2505.20444'
    video_blocks = 'frame'

    def __init__(self, ctx: PEContext, *, temporal_stride: float = 1.0,
                 temporal_strides: Tuple[float, ...] = (0.5, 0.75, 1.0, 1.25, 1.5), random_in_training: bool = True,
                 sections: Optional[Tuple[int, ...]] = None, theta: float = 1e6,
                 rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        self.temporal_stride = float(check_positive(self.name, 'temporal_stride', temporal_stride))
        if not temporal_strides:
            raise ValueError(f"option 'temporal_strides' of encoding {self.name!r} must not be empty")
        self.temporal_strides = tuple(float(check_positive(self.name, 'temporal_strides', x))
                                      for x in temporal_strides)
        self.random_in_training = random_in_training
        self.sections = check_sections(self.name, sections, self.num_pairs)
        self.register_axes()

    def allocate_pairs(self) -> Tensor:
        _, h, w = self.sections
        axes = torch.full((self.num_pairs,), -1, dtype=torch.long)  # -1: not rotated
        axes[1:2 * h:2] = 1
        axes[2:2 * w:2] = 2
        return axes

    @property
    def float_ids(self) -> bool:
        return True

    def draw(self, seg, training, generator):
        seg['stride'] = draw_strides(seg['n'], self.temporal_stride, self.temporal_strides,
                                     training and self.random_in_training, generator, torch.float64)

    def visual_extent(self, seg):
        return (seg['T'] - 1).double() * seg['stride'] + 1

    def visual_rows(self, row):
        return _centred(row['start'].double() + row['t'].double() * row['stride'], row)
