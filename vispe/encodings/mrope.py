"""The M-RoPE family: M-RoPE (Qwen2-VL, Qwen2.5-VL), MRoPE-Interleave (Qwen3-VL) and MHRoPE.

Each token of a multimodal sequence has ids ``(t, h, w)``: text ``t = h = w =`` its running index, a
visual block starting at ``s`` gives its merged token ``(t, h, w)`` the ids ``(s + tau(t), s + h, s + w)``
and the next segment starts at the largest id + 1. The three encodings share the ids and differ in
which rotary pairs (or heads) read which axis. ENCODINGS.md's worked example (text x3, vision-start, a
2x2 merged image, vision-end, text x2): ``t = 0 1 2 3 4 4 4 4 6 7 8``, ``h = 0 1 2 3 4 4 5 5 6 7 8``,
``w = 0 1 2 3 4 5 4 5 6 7 8``.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

from ..contract import PEContext
from ..registry import register_pe
from .multimodal import MULTIMODAL_FAMILY, MultimodalRoPE, stack_axes

__all__ = ['MRoPE', 'MRoPEInterleave', 'MHRoPE', 'interleaved_mrope_axes', 'default_sections',
           'default_head_sections']

Tensor = torch.Tensor


def interleaved_mrope_axes(num_pairs: int, sections: Sequence[int], device: Optional[torch.device] = None) -> Tensor:
    """The axis (0 = t, 1 = h, 2 = w) of each of ``num_pairs`` rotary pairs in Qwen3-VL's interleaved
    M-RoPE (``apply_interleaved_mrope``): ``h`` at pairs ``1, 4, 7, ... < 3 * sections[1]``, ``w`` at
    ``2, 5, 8, ... < 3 * sections[2]``, ``t`` everywhere else. The one definition of the allocation,
    used by ``mrope_interleave`` and ``mhrope``'s ids' rotary and by ``rope_timm:rope_type=mrope``."""
    axes = torch.zeros(num_pairs, dtype=torch.long, device=device)
    axes[1:3 * sections[1]:3] = 1
    axes[2:3 * sections[2]:3] = 2
    return axes


def default_sections(name: str, num_pairs: int) -> Tuple[int, int, int]:
    """``(t, h, w)`` pairs per axis of encoding ``name``: the original values for 64 pairs (head dim 128),
    scaled for other head dims: ``[16, 24, 24]`` (``mrope``, ``circlerope``), ``[24, 20, 20]``
    (``mrope_interleave``), ``[16, 24, 24]`` with ``h == w`` (``videorope``, ``hope``)."""
    P = num_pairs
    if name == 'mrope_interleave':
        h = (5 * P) // 16
        return P - 2 * h, h, h
    if name in ('videorope', 'hope'):
        h = (P - P // 4) // 2  # h == w so that they can interleave
        return P - 2 * h, h, h
    t = P // 4
    h = (P - t) // 2
    return t, h, P - t - h


def default_head_sections(num_heads: int) -> Tuple[int, int, int]:
    """MHRoPE heads per axis ``(t, h, w)``: ``[2, 3, 3]`` of 8, scaled for other head counts."""
    if num_heads < 3:
        raise ValueError(f"encoding 'mhrope' assigns whole heads to the axes t, h, w and needs at least 3 heads "
                         f"for its default head_sections, got num_heads={num_heads}: give head_sections=t|h|w")
    t = max(1, num_heads // 4)
    h = (num_heads - t + 1) // 2
    return t, h, num_heads - t - h


def check_sections(name: str, sections: Optional[Sequence[int]], num_pairs: int) -> Tuple[int, int, int]:
    """``sections`` (default `default_sections`) if they are 3 non-negative pair counts summing to ``num_pairs``."""
    sec = tuple(sections) if sections is not None else default_sections(name, num_pairs)
    if len(sec) != 3 or any(s < 0 for s in sec) or sum(sec) != num_pairs:
        raise ValueError(f'option sections of encoding {name!r} must be 3 non-negative pair counts (t, h, w) summing '
                         f'to rotary_dim/2={num_pairs}, got {sec}')
    return sec


def check_tokens_per_second(name: str, value: Optional[float]) -> Optional[float]:
    if value is not None and not value > 0:
        raise ValueError(f'option tokens_per_second of encoding {name!r} must be > 0 or None, got {value!r}')
    return value


@register_pe('mrope', family=MULTIMODAL_FAMILY)
class MRoPE(MultimodalRoPE):
    """M-RoPE (Qwen2-VL, Wang et al. 2024) with Qwen2.5-VL's absolute time.

    A visual block starting at ``s`` gives merged token ``(t, h, w)`` the ids ``(s + tau(t), s + h, s + w)``;
    the next segment starts at ``max over all three axes + 1``. ``tau(t) = floor(t * second_per_grid_t *
    tokens_per_second)`` for timed videos (Qwen2.5-VL; multiply first, then floor: truncating
    ``second_per_grid_t`` to an integer first, as some library versions do, collapses frames), ``tau(t) = t``
    for images and untimed videos (Qwen2-VL). Rotary: chunked sections, the first ``sections[0]`` pairs read
    ``t``, the next ``sections[1]`` ``h``, the last ``w`` (``[16, 24, 24]`` for head dim 128).

    Args:
        tokens_per_second: Qwen2.5-VL's temporal ids per second (2); None ignores timing (Qwen2-VL).
        sections: rotary pairs per axis ``t|h|w`` (sum ``rotary_dim / 2``); default the original split scaled
            to the head dim.
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    axes = 'thw'
    paper = 'Wang et al., Qwen2-VL, arXiv:2409.12191; Bai et al., Qwen2.5-VL, arXiv:2502.13923'

    def __init__(self, ctx: PEContext, *, tokens_per_second: Optional[float] = 2.0,
                 sections: Optional[Tuple[int, ...]] = None, theta: float = 1e6,
                 rotary_dim: Optional[int] = None) -> None:
        super().__init__(ctx, theta=theta, rotary_dim=rotary_dim)
        self.tokens_per_second = check_tokens_per_second(self.name, tokens_per_second)
        self.sections = check_sections(self.name, sections, self.num_pairs)
        self.register_axes()

    def allocate_pairs(self) -> Tensor:
        t, h, w = self.sections
        return torch.cat([torch.full((t,), 0), torch.full((h,), 1), torch.full((w,), 2)]).long()

    def _tau(self, row):
        return row['rule'].time_index(row['t'], row['seconds'], self.tokens_per_second, row['seconds_dtype'])

    def visual_extent(self, seg):
        t_last = seg['rule'].time_index(seg['T'] - 1, seg['seconds'], self.tokens_per_second, seg['seconds_dtype'])
        return seg['rule'].mrope_extent(seg, t_last)

    def visual_rows(self, row):
        s = row['start']
        one = torch.tensor([[0], [0], [1]], device=s.device)
        return stack_axes(s + self._tau(row), s + row['h'], s), one


@register_pe('mrope_interleave', family=MULTIMODAL_FAMILY)
class MRoPEInterleave(MRoPE):
    """MRoPE-Interleave (Huang et al. 2025, "Revisiting Multimodal Positional Encoding"; Qwen3-VL).

    Ids as M-RoPE; the rotary pairs cycle ``t, h, w, t, h, w, ...`` and the rest read ``t``
    (`interleaved_mrope_axes`; sections ``[24, 20, 20]`` for head dim 128). ``spatial_reset``: visual
    ``h, w`` start at 0 and only ``t`` carries the offset ``s`` (the block still advances the running
    position as in M-RoPE, the reference code's vision-end rule). Qwen3-VL itself uses no reset and puts
    each temporal patch of a video in a block of its own with timestamp text between them
    (``video_blocks = 'frame'``); as a `vispe.sequence`, give one ``Video`` per frame.

    Args:
        spatial_reset: visual h, w ids without the offset (the paper's variant); False = Qwen3-VL.
        tokens_per_second: temporal ids per second for timed videos (None: frame index).
        sections: rotary pairs per axis ``t|h|w``.
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    paper = 'Huang et al., arXiv:2510.23095 (MRoPE-I); Qwen3-VL'
    video_blocks = 'frame'

    def __init__(self, ctx: PEContext, *, spatial_reset: bool = False, **options) -> None:
        super().__init__(ctx, **options)
        self.spatial_reset = spatial_reset

    def allocate_pairs(self) -> Tensor:
        P, (_, h, w) = self.num_pairs, self.sections
        fits = len(range(1, min(3 * h, P), 3)) == h and len(range(2, min(3 * w, P), 3)) == w
        if not fits:
            raise ValueError(f'option sections {self.sections} of encoding {self.name!r} does not fit the interleaved '
                             f'layout of {self.num_pairs} pairs (h and w take every third pair from 1 and 2)')
        return interleaved_mrope_axes(P, self.sections)

    def visual_rows(self, row):
        if not self.spatial_reset:
            return super().visual_rows(row)
        s = row['start']
        one = torch.tensor([[0], [0], [1]], device=s.device)
        return stack_axes(s + self._tau(row), row['h'], torch.zeros_like(s)), one


@register_pe('mhrope', family=MULTIMODAL_FAMILY)
class MHRoPE(MRoPEInterleave):
    """MHRoPE (Huang et al. 2025): the MRoPE-I ids; whole heads, not frequency sections, per axis.

    Every pair of a head reads that head's axis (heads ``[2, 3, 3]`` of 8 for ``t, h, w``; heads beyond the
    sections are not rotated). Under grouped-query attention the heads are the key/value heads (build the
    encoding with ``num_heads`` = key/value heads): a query head uses its key/value head's axis, or q and k
    would rotate by different positions. Token ids lay out videos one block per frame, as for MRoPE-I.

    Args:
        head_sections: heads per axis ``t|h|w`` (sum at most the heads, at least 1; an axis with 0 heads
            is not encoded); default ``[2, 3, 3]`` of 8 scaled to the heads.
        spatial_reset: visual h, w ids without the offset.
        tokens_per_second: temporal ids per second for timed videos (None: frame index).
        theta: frequency base.
        rotary_dim: rotated channels; default the head dim.
    """
    paper = 'Huang et al., arXiv:2510.23095 (MHRoPE)'

    def __init__(self, ctx: PEContext, *, head_sections: Optional[Tuple[int, ...]] = None,
                 spatial_reset: bool = False, tokens_per_second: Optional[float] = 2.0, theta: float = 1e6,
                 rotary_dim: Optional[int] = None) -> None:
        H = ctx.num_heads
        hs = tuple(head_sections) if head_sections is not None else default_head_sections(H)
        if len(hs) != 3 or any(s < 0 for s in hs) or sum(hs) > H or sum(hs) == 0:
            raise ValueError(f"option head_sections of encoding 'mhrope' must be 3 non-negative head counts (t, h, w) "
                             f'summing to at least 1 and at most num_heads={H}, got {hs}')
        self.head_sections = hs
        super().__init__(ctx, spatial_reset=spatial_reset, tokens_per_second=tokens_per_second, theta=theta,
                         rotary_dim=rotary_dim)

    def axis_buffers(self):
        hs, H = self.head_sections, self.ctx.num_heads
        head_axes = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in enumerate(hs)]
                              + [torch.full((H - sum(hs),), -1, dtype=torch.long)])
        return {**super().axis_buffers(), 'head_axes': head_axes}

    def allocate_pairs(self) -> Tensor:  # every pair of a head reads the head's axis
        return torch.zeros(self.num_pairs, dtype=torch.long)

    @property
    def pair_layout(self) -> Optional[str]:
        return None

    @property
    def head_layout(self) -> Optional[str]:
        return ''.join('-' if a < 0 else self.axes[a] for a in self.head_axes.tolist())

    def angles(self, ids: Tensor) -> Tensor:
        """float32 angles ``(B or 1, H, N, P)``: head ``j`` reads axis ``head_axes[j]`` (angle 0 for -1)."""
        if not torch.is_tensor(ids) or ids.dim() not in (2, 3) or ids.shape[0] != 3:
            shape = tuple(ids.shape) if torch.is_tensor(ids) else type(ids).__name__
            raise ValueError(f"encoding 'mhrope' takes ids of shape (3, N) or (3, B, N), got {shape}")
        pos = ids.float()
        if pos.dim() == 2:  # head-wise tables always carry a batch axis: (1, H, N, P)
            pos = pos[:, None]
        rotated = self.head_axes >= 0
        per_head = pos[self.head_axes.clamp(min=0)].movedim(0, -2)  # (B, H, N)
        ang = per_head[..., None] * self.inv_freq(pos.device)
        if bool(rotated.all()):
            return ang
        return ang * rotated[:, None, None].to(ang.dtype)  # angle 0: identity for unassigned heads

    def extra_repr(self) -> str:
        return f'{super().extra_repr()}, head_sections={self.head_sections}'
