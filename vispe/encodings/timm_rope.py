"""timm's vision RoPE conventions as one encoding (``rope_timm``), so timm's rope checkpoints keep
their numerics under vispe: EVA-02 (Fang et al. 2023, arXiv:2303.11331), timm's SBB rope ViTs, the
Perception Encoder (Bolya et al. 2025), RoPE-ViT's ports (Heo et al., ECCV 2024) and DINOv3
(Simeoni et al. 2025, arXiv:2508.10104).

Conventions, read from ``timm/layers/pos_embed_sincos.py`` (timm 1.0.31), per ``rope_type``:

* ``cat`` (`RotaryEmbeddingCat` with ``in_pixels=False``): per axis ``hd/4`` frequencies
  ``1 / temperature^(k / (hd/4))``; coordinates are integer indices plus ``grid_offset``, rescaled
  EVA-style to ``ref_feat_shape`` (``t * ref / n``) when given; the first ``hd/4`` pairs follow the
  first coordinate axis, the next ``hd/4`` the second. ``axis_bands='alternating'`` gives the axes alternate
  entries of one sequence ``1 / temperature^(2j / hd)``, ``j < hd/2`` instead (the first axis the even ones,
  the second the odd ones: Pixtral's vision rope, ``PixtralVisionRotaryEmbedding``, not a timm convention).
* ``mixed`` (`RotaryEmbeddingMixed`, RoPE-Mixed): learned ``freqs`` ``(2, L, H, hd/2)`` in timm's
  layout (axis 0 first), angle ``t_0 f_0 + t_1 f_1`` per layer and head, integer indices.
* ``dinov3`` (`RotaryEmbeddingDinoV3`): coordinates ``2 (i + 0.5 + grid_offset) / n - 1`` in
  ``[-1, 1]`` (``normalize_coords``: each axis by its own size, or both by the min / max), angles
  ``2 pi t / period`` with periods ``temperature^(2k / (hd/2))`` (or geometric from ``min_period`` to
  ``max_period``); pairs ordered as for ``cat``.
* ``mrope`` (`RotaryEmbeddingMRope`, Qwen2-VL style for images): one frequency vector
  ``1 / temperature^(2k / hd)`` over ``hd/2`` pairs, pairs strided ``t, h, w, t, h, w, ...`` by
  ``mrope_section``; the temporal pairs sit at position 0 (identity).

``grid_indexing='ij'`` orders the axes (row, column), ``'xy'`` (column, row). ``rotate_half`` pairs
channels ``(j, j + hd/2)`` (timm's ``half`` layout, default for DINOv3 and MRoPE) instead of
``(2j, 2j + 1)``. Prefix tokens are not rotated. In training, the optional coordinate augmentations
(``shift_coords``, ``jitter_coords``, ``rescale_coords``: DINOv3's) transform the coordinates once per
forward with timm's own sampler. The rotation itself is vispe's pair rotation (float32 angles).
"""
from __future__ import annotations

import math
from typing import Dict, Literal, Optional, Tuple, Union

import torch
from .._timm import apply_coord_augs, freq_bands, init_random_2d_freqs
from torch import nn

from ..positions import Positions
from ..registry import register_pe
from ..rotary import RotationPE, rotation_table
from ..rotary.frequencies import mixed_axis_angles
from ..rotary.kernels import pad_identity
from ._checks import check_positive
from .mrope import interleaved_mrope_axes
from ..contract import PEContext

__all__ = ['TimmRope']

RopeType = Literal['cat', 'mixed', 'dinov3', 'mrope']
Size = Union[int, torch.Tensor]  # a grid size, or each sample's in a NaFlex batch


@register_pe('rope_timm', family='rope')
class TimmRope(RotationPE):
    """timm's vision RoPE (EVA-02, RoPE-ViT ports, Perception Encoder, DINOv3, MRoPE), numerically as
    timm computes it; see the module docstring for each ``rope_type``'s convention.

    Defaults are EVA-02's (``cat``, temperature 10000, ``ij``, interleaved pairs). `vispe.zoo`
    reads a timm model's own rope module into these options (`vispe.timm_pe_spec`), and a ``mixed``
    encoding takes over the module's learned ``freqs`` (`adopt_timm_rope`).

    Args:
        rope_type: ``cat``, ``mixed``, ``dinov3`` or ``mrope``.
        temperature: frequency base (``cat``, ``mixed`` init, ``mrope``) or period base (``dinov3``).
        grid_indexing: ``ij`` (row, column) or ``xy`` (column, row) axis order.
        grid_offset: added to the integer indices (``cat``, ``dinov3``).
        ref_feat_shape: EVA's reference grid: coordinates rescaled to it (``cat`` only).
        rotate_half: pairs ``(j, j + hd/2)`` instead of ``(2j, 2j + 1)``.
        normalize_coords: ``dinov3`` coordinate normalisation: ``separate``, ``min`` or ``max``.
        min_period: ``dinov3`` geometric periods from ``min_period`` ...
        max_period: ... to ``max_period`` (both or neither; replace ``temperature``).
        mrope_section: ``mrope`` strided extents (temporal, height, width).
        axis_bands: ``cat`` frequencies per axis: ``shared`` (the same ``hd/4`` bands on both axes) or
            ``alternating`` (alternate entries of ``1 / temperature^(2j / hd)``, Pixtral).
        shift_coords: training-only uniform shift in ``[-s, s]`` (coordinate units).
        jitter_coords: training-only per-axis log-uniform scale in ``[1/J, J]``.
        rescale_coords: training-only shared log-uniform scale in ``[1/R, R]``.
    """
    larger_input = 'extrapolate'
    paper = ('Fang et al. 2023 (EVA-02), arXiv:2303.11331; Heo et al., ECCV 2024 (RoPE-ViT); '
             'Simeoni et al. 2025 (DINOv3); timm layout')

    def __init__(
            self,
            ctx: PEContext,
            *,
            rope_type: RopeType = 'cat',
            temperature: float = 10000.0,
            grid_indexing: Literal['ij', 'xy'] = 'ij',
            grid_offset: float = 0.0,
            ref_feat_shape: Optional[Tuple[int, ...]] = None,
            rotate_half: bool = False,
            normalize_coords: Literal['separate', 'min', 'max'] = 'separate',
            min_period: Optional[float] = None,
            max_period: Optional[float] = None,
            mrope_section: Tuple[int, ...] = (8, 12, 12),
            shift_coords: Optional[float] = None,
            jitter_coords: Optional[float] = None,
            rescale_coords: Optional[float] = None,
            axis_bands: Literal['shared', 'alternating'] = 'shared',
    ) -> None:
        super().__init__(ctx)
        if ctx.grid_size is not None and len(ctx.grid_size) != 2:
            raise ValueError(f"encoding 'rope_timm' needs a 2D grid, got grid_size={ctx.grid_size}")
        hd = ctx.head_dim
        multiple = 2 if rope_type == 'mrope' else 4
        if hd % multiple:
            raise ValueError(f"encoding 'rope_timm' (rope_type={rope_type!r}) needs head_dim divisible by "
                             f'{multiple}, got head_dim={hd}')
        if rope_type == 'mixed' and rotate_half:
            raise ValueError("encoding 'rope_timm': rope_type='mixed' needs rotate_half=False (as timm)")
        if rope_type == 'mrope' and (not rotate_half or grid_indexing != 'ij'):
            raise ValueError("encoding 'rope_timm': rope_type='mrope' needs rotate_half=True and grid_indexing='ij' "
                             '(as timm)')
        if (min_period is None) != (max_period is None):
            raise ValueError("encoding 'rope_timm': give both min_period and max_period, or neither")
        if ref_feat_shape is not None and len(ref_feat_shape) != 2:
            raise ValueError(f"option 'ref_feat_shape' of encoding 'rope_timm' must have 2 values, "
                             f'got {ref_feat_shape}')
        if len(mrope_section) != 3:
            raise ValueError(f"option 'mrope_section' of encoding 'rope_timm' must have 3 values, got {mrope_section}")
        self.rope_type = rope_type
        self.rotation_kind = 'half_table' if rotate_half else 'table'
        self.temperature = check_positive(self.name, 'temperature', temperature)
        self.grid_indexing = grid_indexing
        self.grid_offset = float(grid_offset)
        self.ref_feat_shape = tuple(ref_feat_shape) if ref_feat_shape is not None else None
        self.rotate_half = rotate_half
        self.normalize_coords = normalize_coords
        self.periods_range = (min_period, max_period) if min_period is not None else None
        self.mrope_section = tuple(mrope_section)
        if axis_bands != 'shared' and rope_type != 'cat':
            raise ValueError(f"option 'axis_bands' of encoding 'rope_timm' applies to rope_type='cat', got "
                             f'rope_type={rope_type!r} with axis_bands={axis_bands!r}')
        self.axis_bands = axis_bands
        for option, value, least in (('shift_coords', shift_coords, 0.0), ('jitter_coords', jitter_coords, 1.0),
                                     ('rescale_coords', rescale_coords, 1.0)):
            if value is not None and not (math.isfinite(value) and value >= least):  # timm's ranges, checked here
                raise ValueError(f"option {option!r} of encoding 'rope_timm' must be finite and >= {least:g}, "
                                 f'got {value}')
        self.augment = dict(shift_coords=shift_coords, jitter_coords=jitter_coords, rescale_coords=rescale_coords)
        if rope_type == 'mixed':
            self.freqs = nn.Parameter(init_random_2d_freqs(hd, ctx.depth, ctx.num_heads, temperature=temperature))

    def no_weight_decay(self) -> set:
        return {'freqs'} if self.rope_type == 'mixed' else set()

    def adopt_timm_rope(self, rope: nn.Module) -> Dict[str, torch.Tensor]:
        """The entries of this encoding that a timm rope module fills: a ``mixed`` encoding takes its
        learned ``freqs`` (same layout); the fixed kinds have nothing to take."""
        if self.rope_type != 'mixed':
            return {}
        freqs = getattr(rope, 'freqs', None)
        depth = self.freqs.shape[1]
        # (2, depth, heads, hd / 4); a model whose later blocks timm pruned (features_only, out_indices)
        # keeps the whole rope module: its first layers are the ones left
        if freqs is not None and freqs.dim() == 4 and freqs.shape[1] > depth:
            freqs = freqs[:, :depth]
        if freqs is None or freqs.shape != self.freqs.shape:
            raise ValueError(f"encoding 'rope_timm' (mixed) has freqs {tuple(self.freqs.shape)}, the timm rope module "
                             f'{None if freqs is None else tuple(freqs.shape)}')
        return {'freqs': freqs.detach()}

    # ------------------------------------------------------------------ angles
    def _axes(self, pos: Positions) -> Tuple[torch.Tensor, Tuple[Size, Size]]:
        """Coordinates ``(..., N, 2)`` in timm's axis order and the grid size along those axes (in a
        NaFlex batch each sample's own, as ``(B, 1)`` tensors)."""
        if pos.ndim != 2:
            raise ValueError(f"encoding 'rope_timm' needs 2D positions, got {pos.ndim} axes")
        coords = pos.coords.float()
        if self.grid_indexing == 'xy':
            coords = coords.flip(-1)
        if pos.index_grids is not None:
            sizes = torch.tensor(pos.index_grids, dtype=coords.dtype, device=coords.device)[:, None, :]  # (B, 1, 2)
            if self.grid_indexing == 'xy':
                sizes = sizes.flip(-1)
            return coords, (sizes[..., 0], sizes[..., 1])
        grid = pos.index_grid or pos.train_grid or self.ctx.grid_size
        if grid is None:
            raise ValueError("encoding 'rope_timm' needs grid positions (vispe.positions.grid)")
        return coords, ((grid[1], grid[0]) if self.grid_indexing == 'xy' else (grid[0], grid[1]))

    def _coordinates(self, pos: Positions) -> torch.Tensor:
        t, size = self._axes(pos)
        if self.rope_type == 'cat':
            t = t + self.grid_offset
            if self.ref_feat_shape is not None:
                ref = self.ref_feat_shape if self.grid_indexing == 'ij' else self.ref_feat_shape[::-1]
                t = torch.stack([t[..., a] / size[a] * ref[a] for a in range(2)], -1)
        elif self.rope_type == 'dinov3':
            if self.normalize_coords == 'separate':
                denom = [s if torch.is_tensor(s) else float(s) for s in size]
            else:
                pick = torch.maximum if self.normalize_coords == 'max' else torch.minimum
                both = pick(*size) if torch.is_tensor(size[0]) else float(
                    max(size) if self.normalize_coords == 'max' else min(size))
                denom = [both] * 2
            t = torch.stack([(t[..., a] + 0.5 + self.grid_offset) / denom[a] for a in range(2)], -1)
            t = 2.0 * t - 1.0
        if self.training and any(v is not None for v in self.augment.values()):
            t = apply_coord_augs(t, **self.augment)
        return t

    def angles(self, pos: Positions) -> torch.Tensor:
        """Rotation angles ``([L, H,] ..., N, hd/2)`` of the non-prefix tokens (``mixed``: per layer, head)."""
        t = self._coordinates(pos)
        hd, device = self.ctx.head_dim, t.device
        if self.rope_type == 'cat':
            if self.axis_bands == 'alternating':  # (2, hd/4): each axis its own bands
                bands = freq_bands(hd, temperature=self.temperature, step=2, device=device).view(-1, 2).t()
            else:
                bands = freq_bands(hd // 4, temperature=self.temperature, step=1, device=device)
            return (t.unsqueeze(-1) * bands).flatten(-2)
        if self.rope_type == 'dinov3':
            n = hd // 4
            if self.periods_range is not None:
                lo, hi = self.periods_range
                periods = lo * ((hi / lo) ** torch.linspace(0, 1, n, dtype=torch.float32))
            else:
                periods = self.temperature ** (2.0 * torch.arange(n, dtype=torch.float32) / (hd // 2))
            return (2 * math.pi * t.unsqueeze(-1) / periods.to(device)).flatten(-2)
        if self.rope_type == 'mrope':
            axis = interleaved_mrope_axes(hd // 2, self.mrope_section, device=device)
            full = torch.cat([torch.zeros_like(t[..., :1]), t], -1).index_select(-1, axis)
            return full * freq_bands(hd, temperature=self.temperature, step=2, device=device)
        # mixed: (2, L, H, P) frequencies against (..., N) coordinates -> (L, ..., H, N, P)
        freqs = self.freqs.float()
        return mixed_axis_angles(t[..., 0], freqs[0]) + mixed_axis_angles(t[..., 1], freqs[1])

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> torch.Tensor:
        """Complex tables ``(L', [B,] H', N_total, hd/2)``: one shared by every layer and head, or per
        layer and head (``mixed``); prefix rows are the identity."""
        table = pad_identity(rotation_table(self.angles(pos)), pos.num_prefix, 'table')
        if self.rope_type == 'mixed':  # (L, [B,] H, N, P) already
            return table
        return table.unsqueeze(-3).unsqueeze(0)  # ([B,] N, P) -> (1, [B,] 1, N, P)

    def extra_repr(self) -> str:
        return f'{self.name}, rope_type={self.rope_type}'
