"""RoPE2D of the 3D-vision models: CroCo v2 (Weinzaepfel et al., ICCV 2023, "CroCo v2: Improved
Cross-view Completion Pre-training for Stereo Matching and Optical Flow", arXiv:2211.10408), reused
by DUSt3R (Wang et al., CVPR 2024, arXiv:2312.14132), MASt3R (Leroy et al., ECCV 2024,
arXiv:2406.09756) and VGGT (Wang et al., CVPR 2025, arXiv:2503.11651).

It is axial RoPE (`rope_axial`) in another channel layout, so it is that encoding configured, not a
second implementation: each token has integer ``(y, x)`` patch coordinates; the head dim is cut in
two halves, the first rotated by y, the second by x; inside a half of ``d = hd / 2`` channels, channel
``j`` pairs with ``j + d/2`` (rotate-half) and turns by ``p * base^(-2j / d)``, ``j < d/2``, base 100.
Special tokens (camera, register, class) sit at position 0, i.e. are not rotated; VGGT then starts the
patch coordinates at 1 (``patch_offset``).
"""
from __future__ import annotations

from typing import Any, Optional

from ..contract import PEContext
from ..registry import register_pe
from ..rotary.kernels import PairLayout
from ._checks import check_nonnegative
from .rope import AxisOrder, RopeAxial

__all__ = ['Rope2D']


@register_pe('rope2d', family='rope')
class Rope2D(RopeAxial):
    """RoPE2D (CroCo v2 / DUSt3R / MASt3R / VGGT): `rope_axial` with base 100, rotate-half pairs within
    the y half and the x half of the head dim, y first.

    Patch coordinates are the row and column indices; prefix tokens are at position 0 (identity).
    ``patch_offset`` is added to the patch coordinates: None follows VGGT's rule (1 when the sequence
    has prefix tokens, else 0; CroCo and DUSt3R have none, so their patches start at 0). An offset
    changes only the logits between prefix and patch tokens (patch-patch logits are relative).

    Args:
        theta: frequency base (100).
        patch_offset: added to every patch coordinate; None: 1 with prefix tokens, else 0 (VGGT).
        layout: ``half`` (RoPE2D) or ``interleaved``.
        axis_order: ``yx`` (RoPE2D) or ``xy``.
        **options: the other options of `rope_axial` (``grid_mode``, ``scaling``, ...).
    """
    larger_input = 'extrapolate'
    paper = 'Weinzaepfel et al., ICCV 2023 (CroCo v2), arXiv:2211.10408; VGGT, CVPR 2025'

    def __init__(
            self,
            ctx: PEContext,
            *,
            theta: float = 100.0,
            patch_offset: Optional[float] = None,
            layout: PairLayout = 'half',
            axis_order: AxisOrder = 'yx',
            **options: Any,
    ) -> None:
        super().__init__(ctx, theta=theta, layout=layout, axis_order=axis_order, **options)
        self.patch_offset = None if patch_offset is None else check_nonnegative(self.name, 'patch_offset', patch_offset)

    def angles(self, coords, pos):
        offset = self.patch_offset if self.patch_offset is not None else (1.0 if pos.num_prefix else 0.0)
        return super().angles(coords + offset if offset else coords, pos)
