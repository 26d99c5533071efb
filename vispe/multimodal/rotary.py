"""Rotary embeddings for multimodal position ids, in the layout LLM code expects.

`MultimodalRotary` turns ids ``(A, [B,] N)`` into ``cos, sin`` of shape ``([B,] N, rotary_dim)``
(head-wise ``(B or 1, H, N, rotary_dim)`` for MHRoPE) with the rotate-half duplication
``cat(freqs, freqs)``: pair ``j`` is channels ``(j, j + rotary_dim/2)`` (Llama / Qwen2-VL /
GPT-NeoX, partial rotary when ``rotary_dim < head_dim``). Each pair reads one id axis; which one is
the scheme's frequency allocation:

* ``mrope``: chunked sections ``[t, h, w]`` (``[16, 24, 24]`` pairs for hd 128, Qwen2-VL);
* ``mrope_interleave``: ``t, h, w, t, h, w, ...`` then the rest ``t`` (``[24, 20, 20]``, Qwen3-VL's
  ``apply_interleaved_mrope``);
* ``mhrope``: every pair of a head reads that head's axis (heads ``[2, 3, 3]`` of 8 for t, h, w;
  heads beyond the sections are not rotated);
* ``videorope``: high-frequency pairs interleave ``h, w``, the low-frequency ones carry ``t``
  (``[16, 24, 24]``, VideoRoPE's low-frequency temporal allocation);
* ``hope``: the Multimodal-RoPEs VideoRoPE allocation (pair 0 and pairs ``>= 2 * sections[1]`` are
  temporal, ``h`` on odd pairs below ``2 * sections[1]``, ``w`` on even pairs from 2 below
  ``2 * sections[2]``) with the temporal pairs not rotated (NoPE);
* ``circlerope``: M-RoPE's chunked sections;
* ``vrope``: pair ``i`` reads axis ``i mod 4``;
* ``rope`` / ``v2pe``: one axis (V2PE's float positions).

Angles are ``float32(position) * inv_freq`` in float32, exactly as Llama / Qwen2-VL compute them, so
for pure text every scheme gives bit-identical cos/sin to ordinary 1D RoPE (the frequencies are
`vispe.rotary.axial_frequencies`). `apply_rotary` applies them through vispe's shared rotation
dispatch (`vispe.rotary.rotate_qk`, rotate-half tables: float32, result cast back to q's dtype, a
backward that keeps only the rotated q and k): bit for bit transformers' ``apply_rotary_pos_emb`` in
float32, not in bfloat16 / float16 (see there).
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import nn

from ..rotary import axial_frequencies, rotate_qk
from .ids import SCHEMES, Scheme

__all__ = ['MultimodalRotary', 'apply_rotary', 'rotary_table', 'default_sections', 'default_head_sections']

Tensor = torch.Tensor


def default_sections(scheme: str, num_pairs: int) -> Tuple[int, int, int]:
    """``(t, h, w)`` pairs per axis: the original values for 64 pairs, scaled for other head dims."""
    P = num_pairs
    if scheme == 'mrope_interleave':
        h = (5 * P) // 16  # [24, 20, 20] of 64
        return P - 2 * h, h, h
    if scheme in ('videorope', 'hope'):
        h = (P - P // 4) // 2  # [16, 24, 24] of 64, h == w so they can interleave
        return P - 2 * h, h, h
    t = P // 4  # mrope: [16, 24, 24] of 64
    h = (P - t) // 2
    return t, h, P - t - h


def default_head_sections(num_heads: int) -> Tuple[int, int, int]:
    """MHRoPE heads per axis ``(t, h, w)``: ``[2, 3, 3]`` of 8, scaled for other head counts."""
    if num_heads < 3:
        raise ValueError(f'MHRoPE needs at least 3 heads (one per axis t, h, w), got num_heads={num_heads}')
    t = max(1, num_heads // 4)
    h = (num_heads - t + 1) // 2
    return t, h, num_heads - t - h


def _pair_axes(scheme: str, num_pairs: int, sections: Sequence[int]) -> Tensor:
    P = num_pairs
    if scheme in ('rope', 'v2pe'):
        return torch.zeros(P, dtype=torch.long)
    if scheme == 'vrope':
        return torch.arange(P) % 4
    t, h, w = sections
    if scheme == 'hope':  # axis -1: not rotated
        axes = torch.full((P,), -1, dtype=torch.long)
        axes[1:2 * h:2] = 1
        axes[2:2 * w:2] = 2
        return axes
    if scheme in ('mrope', 'circlerope'):
        return torch.cat([torch.full((t,), 0), torch.full((h,), 1), torch.full((w,), 2)]).long()
    axes = torch.zeros(P, dtype=torch.long)
    if scheme == 'mrope_interleave':  # Qwen3-VL: H at 1, 4, ..., < 3h; W at 2, 5, ..., < 3w; T elsewhere
        axes[1:3 * h:3] = 1
        axes[2:3 * w:3] = 2
    elif scheme == 'videorope':
        if h != w:
            raise ValueError(f'videorope interleaves h and w pairs, so sections need h == w, got {tuple(sections)}')
        axes[0:2 * h:2] = 1
        axes[1:2 * h:2] = 2
    else:
        raise ValueError(f'scheme must be one of {tuple(SCHEMES)}, got {scheme!r}')
    counts = tuple(int((axes == a).sum()) for a in range(3))
    if counts != (t, h, w):
        raise ValueError(f'sections {tuple(sections)} do not fit the {scheme} layout of {P} pairs')
    return axes


class MultimodalRotary(nn.Module):
    """cos/sin for multimodal position ids (any scheme of `vispe.multimodal.position_ids`).

    Args:
        head_dim: attention head width.
        theta: frequency base (1e6 as Qwen2-VL; Qwen3-VL uses 5e6).
        scheme: the id scheme (a name in `SCHEMES` or a `Scheme`), which fixes the frequency allocation.
        sections: pairs per axis ``(t, h, w)`` (sum ``rotary_dim / 2``); default the original split
            scaled to the head dim (`default_sections`).
        rotary_dim: rotated channels (partial rotary, GPT-NeoX); default ``head_dim``.
        num_heads: heads (key/value heads under GQA) for MHRoPE's head-wise tables.
        head_sections: MHRoPE heads per axis ``(t, h, w)``; default `default_head_sections`.
    """
    pair_axes: Tensor
    inv_freq: Tensor
    head_axes: Tensor

    def __init__(
            self,
            head_dim: int,
            theta: float = 1e6,
            scheme: Union[str, Scheme] = 'mrope',
            sections: Optional[Sequence[int]] = None,
            rotary_dim: Optional[int] = None,
            num_heads: Optional[int] = None,
            head_sections: Optional[Sequence[int]] = None,
            device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        name = scheme.name if isinstance(scheme, Scheme) else scheme
        if name not in SCHEMES:
            raise ValueError(f'scheme must be one of {tuple(SCHEMES)}, got {scheme!r}')
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f'rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}')
        if not theta > 0:
            raise ValueError(f'theta must be > 0, got {theta!r}')
        self.scheme = name
        self.axes = SCHEMES[name].axes
        self.head_dim, self.rotary_dim, self.theta = head_dim, rotary_dim, theta
        P = rotary_dim // 2
        # Llama / Qwen2-VL: 1 / theta ** (arange(0, d, 2) / d) in float32
        inv_freq = axial_frequencies(P, theta, step=2.0, dim=rotary_dim, device=device)
        self.register_buffer('inv_freq', inv_freq, persistent=False)
        self.sections: Optional[Tuple[int, ...]] = None
        self.head_sections: Optional[Tuple[int, ...]] = None
        self.mode = 'heads' if name == 'mhrope' else 'pairs'  # MHRoPE: head-wise tables
        if name == 'mhrope':
            if num_heads is None:
                raise ValueError('scheme mhrope assigns heads to axes: pass num_heads (key/value heads under GQA)')
            hs = tuple(head_sections) if head_sections is not None else default_head_sections(num_heads)
            if len(hs) != 3 or any(s < 0 for s in hs) or sum(hs) > num_heads:
                raise ValueError(f'head_sections must be 3 non-negative counts (t, h, w) summing to at most '
                                 f'num_heads={num_heads}, got {hs}')
            self.head_sections = hs
            head_axes = torch.cat([torch.full((n,), a, dtype=torch.long) for a, n in enumerate(hs)]
                                  + [torch.full((num_heads - sum(hs),), -1, dtype=torch.long)])
            self.register_buffer('head_axes', head_axes.to(device), persistent=False)
        else:
            if name in ('mrope', 'mrope_interleave', 'videorope', 'hope', 'circlerope'):
                sec = tuple(sections) if sections is not None else default_sections(name, P)
                if len(sec) != 3 or any(s < 0 for s in sec) or sum(sec) != P:
                    raise ValueError(f'sections must be 3 non-negative pair counts (t, h, w) summing to '
                                     f'rotary_dim/2={P}, got {sec}')
                self.sections = sec
            elif sections is not None:
                raise ValueError(f'scheme {name!r} has no sections (its pairs are fixed), got sections={sections}')
            self.register_buffer('pair_axes', _pair_axes(name, P, self.sections or ()).to(device),
                                 persistent=False)
        self.nope_pairs = self.mode == 'pairs' and bool((self.pair_axes < 0).any())

    @property
    def pair_layout(self) -> Optional[str]:
        """The axis each rotary pair reads, one character per pair (``'tttthhhhwwww'``); None for MHRoPE."""
        if self.mode == 'heads':
            return None
        return ''.join('-' if a < 0 else self.axes[a] for a in self.pair_axes.tolist())

    @property
    def head_layout(self) -> Optional[str]:
        """MHRoPE: the axis of each head (``'-'`` = not rotated); None for the other schemes."""
        if self.mode != 'heads':
            return None
        return ''.join('-' if a < 0 else self.axes[a] for a in self.head_axes.tolist())

    def angles(self, ids: Tensor) -> Tensor:
        """float32 angles ``([B,] N, P)`` (MHRoPE: ``(B or 1, H, N, P)``) of ids ``(A, [B,] N)``."""
        A = len(self.axes)
        if ids.dim() not in (2, 3) or ids.shape[0] != A:
            raise ValueError(f'scheme {self.scheme!r} takes ids of shape ({A}, N) or ({A}, B, N), '
                             f'got {tuple(ids.shape)}')
        pos = ids.float()
        f = self.inv_freq
        if self.mode == 'heads':
            if pos.dim() == 2:  # head-wise tables always carry a batch axis: (1, H, N, P)
                pos = pos[:, None]
            rotated = self.head_axes >= 0
            per_head = pos[self.head_axes.clamp(min=0)].movedim(0, -2)  # (B, H, N)
            ang = per_head[..., None] * f
            if bool(rotated.all()):
                return ang
            return ang * rotated[:, None, None].to(ang.dtype)  # angle 0: identity for unassigned heads
        if A == 1:
            return pos[0][..., None] * f
        if self.nope_pairs:  # HoPE's temporal pairs: angle 0
            return pos[self.pair_axes.clamp(min=0)].movedim(0, -1) * (f * (self.pair_axes >= 0).to(f.dtype))
        return pos[self.pair_axes].movedim(0, -1) * f

    def forward(self, ids: Tensor, dtype: Optional[torch.dtype] = None) -> Tuple[Tensor, Tensor]:
        """``cos, sin`` with the rotate-half duplication, last dim ``rotary_dim`` (float32 or ``dtype``)."""
        ang = self.angles(ids)
        cos, sin = ang.cos(), ang.sin()
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
        if dtype is not None:
            cos, sin = cos.to(dtype), sin.to(dtype)
        return cos, sin

    def table(self, ids: Tensor) -> Tensor:
        """Complex table ``([B,] [H,] N, P)`` for `vispe.rotary.apply_pair_rotation(..., 'half')`."""
        ang = self.angles(ids)
        return torch.complex(ang.cos(), ang.sin())

    def extra_repr(self) -> str:
        extra = f', sections={self.sections}' if self.sections else ''
        extra += f', head_sections={self.head_sections}' if self.head_sections else ''
        return f'scheme={self.scheme!r}, head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, ' \
               f'theta={self.theta}{extra}'


def rotary_table(cos: Tensor, sin: Tensor, x: Tensor, unsqueeze_dim: int = 1) -> Tensor:
    """The complex table of ``cos, sin`` (rotate-half layout) shaped to broadcast against ``x``.

    ``cos`` ``(B, N, r)`` is unsqueezed at ``unsqueeze_dim`` (the heads axis of ``x``, as in
    transformers' ``apply_rotary_pos_emb``); head-wise ``(B, H_kv, N, r)`` is moved to that axis
    and repeated for grouped-query heads (key/value head ``j`` serves query heads
    ``j * g .. (j+1) * g - 1``, transformers' ``repeat_kv``); ``(N, r)`` broadcasts as is.
    """
    if cos.shape != sin.shape:
        raise ValueError(f'cos and sin shapes differ: {tuple(cos.shape)} vs {tuple(sin.shape)}')
    r = cos.shape[-1]
    if r % 2 or r > x.shape[-1]:
        raise ValueError(f'cos/sin last dim {r} must be even and at most the head dim {x.shape[-1]}')
    P = r // 2
    rot = torch.complex(cos[..., :P].float(), sin[..., :P].float())
    if rot.dim() == x.dim() - 1:
        return rot.unsqueeze(unsqueeze_dim)
    if rot.dim() == x.dim():  # head-wise (B, H, N, P)
        if unsqueeze_dim != 1:
            rot = rot.movedim(1, unsqueeze_dim)
        hk, hq = rot.shape[unsqueeze_dim], x.shape[unsqueeze_dim]
        if hk != hq:
            if hq % hk:
                raise ValueError(f'head-wise cos/sin has {hk} heads, which does not divide the {hq} heads of x')
            rot = rot.repeat_interleave(hq // hk, dim=unsqueeze_dim)
        return rot
    return rot


def apply_rotary(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor,
                 unsqueeze_dim: int = 1) -> Tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` by ``cos, sin`` from `MultimodalRotary` (drop-in for ``apply_rotary_pos_emb``).

    ``q, k``: ``(B, H, N, hd)`` (``unsqueeze_dim=1``) or ``(B, N, H, hd)`` (``unsqueeze_dim=2``);
    ``q`` and ``k`` may have different head counts (GQA). The first ``cos.shape[-1]`` channels
    are rotated in pairs ``(j, j + r/2)``, the rest pass through (partial rotary).

    Numerics: the rotation is computed in float32 and rounded once to ``q``'s dtype. For float32
    inputs that is bit for bit transformers' ``q * cos + rotate_half(q) * sin`` (tested against
    transformers). For bfloat16 / float16 inputs it is not: transformers casts cos / sin to the
    activation dtype and rounds every product and the sum there, so its results differ in the last
    bits (vispe's are the float32 result rounded once, closer to exact).
    """
    rq = rotary_table(cos, sin, q, unsqueeze_dim)
    rk = rq if k.shape[unsqueeze_dim] == q.shape[unsqueeze_dim] else rotary_table(cos, sin, k, unsqueeze_dim)
    return rotate_qk(q, k, rq, rk, 'half_table')
