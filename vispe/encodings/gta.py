"""GTA: geometric transform attention (Miyato et al., ICLR 2024).

Every token carries a group element ``g_i`` with a representation ``rho_i``; attention becomes

    q~_i = rho_i^-T q_i,   k~_j = rho_j k_j,   v~_j = rho_j v_j,   o_i = rho_i^-1 sum_j a_ij v~_j,

so both the logits ``q_i^T rho_i^-1 rho_j k_j`` and the values carried to token ``i`` depend only
on the relative element ``g_i^-1 g_j``. For orthogonal ``rho`` (rotations) ``rho^-T = rho`` and
``rho^-1 = rho^T``: q, k and v get the same rotation and the output the inverse one. Without the
value/output maps (``value_transform=False``) this is RoPE.

The maps go through the shared dispatch of `vispe.rotary` (`rotate_qk`, `apply_rotation`), whose
backward keeps only the mapped output: SO(2) pairs as complex tables (the output with the conjugate
table), SE(3) blocks as ``4 x 4`` matrices (kind ``matrix``: the scaled translation makes them
non-orthogonal, so their gradient goes through the inverse).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch
from torch import nn

from ..positions import GridMode, Positions, grid_coordinates
from ..positions.multiview import view_grid
from ..registry import register_pe
from ..rotary import RotationPE, RotationState, apply_rotation, axial_frequencies, rotation_table
from ..rotary.autograd import rotate_channels
from ..rotary.base import check_head_dim
from ..rotary.kernels import block_matrices, pad_identity
from ._checks import check_nonnegative, check_positive
from ..contract import Capabilities, PEContext

__all__ = ['Gta', 'GtaMultiview', 'interleaved_axis_angles']


def interleaved_axis_angles(coords: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """GTA's SO(2) angles: ``(..., N, D)`` coordinates and ``(F,)`` frequencies -> ``(..., N, F * D)``.

    Pair ``f * D + a`` rotates by ``coords[a] * freqs[f]``: the axes are interleaved over the pairs
    (GTA's ``make_SO2mats`` layout), frequency by frequency.
    """
    return (coords.unsqueeze(-2) * freqs.to(coords.dtype)[:, None]).flatten(-2)


def _as_table(rot: torch.Tensor, batched: bool) -> torch.Tensor:
    """(..., B, N, P) -> (..., B, 1, N, P): broadcast a per-sample table over heads."""
    return rot.unsqueeze(-3) if batched else rot


def _value_hooks(caps: Capabilities, value_transform: bool) -> Capabilities:
    """Without the value transform, v and the output are left alone: no value / output hooks."""
    return caps if value_transform else dataclasses.replace(caps, hooks=caps.hooks - {'value', 'output'})


@register_pe('gta', family='gta')
class Gta(RotationPE):
    """GTA on the image grid (Miyato et al., ICLR 2024, "GTA: A Geometry-Aware Attention Mechanism
    for Multi-View Transformers"; the 2D form of its DiT / image-ViT code).

    Conventions of the official code (``make_SO2mats`` with ``make_2dcoord``): each token's
    representation is block-diagonal SO(2), one 2x2 rotation per channel pair (``(2j, 2j + 1)``),
    ``F = hd / 4`` frequencies ``10000^(-f / F)`` per axis, the (row, col) axes interleaved over the
    pairs (pair ``2f`` rotated by ``row * w_f``, pair ``2f + 1`` by ``col * w_f``), integer patch
    indices, no learned parameters. q, k and v are rotated by ``rho(p)``, the attention output by
    ``rho(p)^T`` (the inverse), so logits and outputs depend on position differences only. For a
    ``D``-axis grid (video ``(t, row, col)``, point sets) the ``hd / 2`` pairs hold
    ``(hd / 2) // D`` frequencies per axis, interleaved the same way; leftover pairs are identity.
    Prefix tokens get the identity.

    Args:
        theta: frequency base (10000).
        grid_mode: ``index`` (integer patch indices: a larger input extrapolates) or ``normalized``.
        value_transform: transform v and the output too (GTA); False leaves only q and k rotated (RoPE).
    """
    shift_invariant = True
    larger_input = 'extrapolate'
    paper = 'Miyato et al., ICLR 2024 (GTA), arXiv:2310.10375'
    rotation_kind = 'table'

    def __init__(
            self,
            ctx: PEContext,
            *,
            theta: float = 10000.0,
            grid_mode: GridMode = 'index',
            value_transform: bool = True,
    ) -> None:
        super().__init__(ctx)
        check_head_dim('gta', ctx.head_dim, 4, 'two axes of channel pairs')
        self.theta = check_positive(self.name, 'theta', theta)
        self.grid_mode = grid_mode
        self.value_transform = value_transform

    def _declare_capabilities(self) -> Capabilities:
        return _value_hooks(super()._declare_capabilities(), self.value_transform)

    def frequencies(self, num_axes: int) -> torch.Tensor:
        """``(F,)`` frequencies ``theta^(-f / F)``, ``F = (hd / 2) // num_axes`` (float64)."""
        nf = self.ctx.head_dim // 2 // num_axes
        if nf == 0:
            raise ValueError(f"encoding 'gta' needs head_dim >= {2 * num_axes} for {num_axes} axes, "
                             f"got head_dim={self.ctx.head_dim}")
        return axial_frequencies(nf, self.theta, step=1.0, dim=nf, dtype=torch.float64)

    def table(self, pos: Positions) -> torch.Tensor:
        """Complex table ``([B, 1,] N_total, hd / 2)``: one rotation per pair, identity for prefix tokens."""
        coords = grid_coordinates(pos, self.grid_mode)
        coords = coords.to(torch.promote_types(coords.dtype, torch.float32))
        angles = interleaved_axis_angles(coords, self.frequencies(coords.shape[-1]).to(coords.device))
        rot = rotation_table(angles)
        missing = self.ctx.head_dim // 2 - rot.shape[-1]
        if missing:  # pairs left over when hd / 2 is not a multiple of D: not rotated
            rot = torch.cat([rot, torch.ones(*rot.shape[:-1], missing, dtype=rot.dtype, device=rot.device)], -1)
        return _as_table(pad_identity(rot, pos.num_prefix, 'table'), pos.batched)

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> torch.Tensor:
        return self.table(pos).unsqueeze(0)  # one table for every layer

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]) -> Tuple[RotationState, torch.Tensor]:
        state = super()._prepare(pos_q, pos_k)
        # rho^T = rho^-1 = conjugate table; resolved once here rather than in every layer
        return state, state.q[0].conj().resolve_conj()

    def qk(self, q, k, state, layer, x=None):
        return super().qk(q, k, state[0], layer)

    def value(self, v, state, layer):
        return apply_rotation(v, 'table', state[0].k[0])

    def output(self, o, state, layer):
        return apply_rotation(o, 'table', state[1])


@register_pe('gta_multiview', family='gta')
class GtaMultiview(RotationPE):
    """Multi-view GTA (Miyato et al., ICLR 2024): camera pose SE(3) and image-position SO(2) channels.

    The head dim is split, in this order (the official ``f_dims`` order ``triv, se3, so2``), into

    * ``identity`` channels (``hd - se3_dims - so2_dims``), untouched;
    * ``se3_dims`` channels in blocks of 4, each block multiplied by the 4x4 camera-to-world matrix
      of the token's camera with its translation scaled by a learnable per-layer factor (init 0.01,
      the official ``trans_coeff``): ``rho_j = S(cam_to_world_j)``, so k and v get ``rho_j``, q gets
      ``rho_i^-T = S(world_to_cam_i)^T`` and the output ``rho_i^-1 = S(world_to_cam_i)``;
    * ``so2_dims`` channels of SO(2) pairs on normalised image coordinates ``(row / h, col / w)``,
      ``n = so2_dims / 4`` frequencies ``2^(k - n)`` (``k = 1..n``), angle ``2 pi max_freq coord w``,
      the two axes interleaved over the pairs (``make_SO2mats``).

    The defaults follow the paper's MSN-Hard setting (head dim 96: 48 SE(3) + 48 SO(2), no identity):
    half of the head dim each. Logits and outputs depend only on relative camera poses (invariant to
    a global rigid transform of all cameras) and on image-position differences. Needs positions
    from `vispe.positions.multiview`; prefix tokens get the identity.

    Args:
        se3_dims: channels of the SE(3) group (multiple of 4; default ``hd / 2`` rounded down to 4).
        so2_dims: channels of the SO(2) group (multiple of 4; default the rest, rounded down to 4).
        max_freq: largest SO(2) frequency in turns per image (``max_freq_h = max_freq_w = 1``).
        translation_scale: initial translation scale of the SE(3) representation (0.01).
        learn_translation_scale: learn the scale (one per layer) or keep it fixed.
        value_transform: transform v and the output too (GTA); False keeps only q and k maps.
    """
    shift_invariant = True
    requires = frozenset({'cameras', 'view_index'})
    larger_input = 'interpolate'
    paper = 'Miyato et al., ICLR 2024 (GTA), arXiv:2310.10375'
    float32_buffers = frozenset({'translation_scale'})  # a buffer with learn_translation_scale=False

    def __init__(
            self,
            ctx: PEContext,
            *,
            se3_dims: Optional[int] = None,
            so2_dims: Optional[int] = None,
            max_freq: float = 1.0,
            translation_scale: float = 0.01,
            learn_translation_scale: bool = True,
            value_transform: bool = True,
    ) -> None:
        super().__init__(ctx)
        hd = ctx.head_dim
        se3 = 4 * (hd // 8) if se3_dims is None else se3_dims
        so2 = 4 * ((hd - se3) // 4) if so2_dims is None else so2_dims
        if se3 % 4 or so2 % 4 or se3 < 0 or so2 < 0 or se3 + so2 > hd:
            raise ValueError(f"encoding 'gta_multiview': se3_dims and so2_dims must be non-negative multiples of 4 "
                             f"with se3_dims + so2_dims <= head_dim={hd}, got se3_dims={se3}, so2_dims={so2}")
        self.se3_dims, self.so2_dims = se3, so2
        self.identity_dims = hd - se3 - so2
        self.max_freq = check_positive(self.name, 'max_freq', max_freq)
        self.value_transform = value_transform
        scale = torch.full((ctx.depth,), float(check_nonnegative(self.name, 'translation_scale', translation_scale)))
        if learn_translation_scale:
            self.translation_scale = nn.Parameter(scale)
        else:
            self.register_buffer('translation_scale', scale, persistent=False)

    def no_weight_decay(self) -> set:
        return {'translation_scale'} if isinstance(self.translation_scale, nn.Parameter) else set()

    def frequencies(self) -> torch.Tensor:
        n = self.so2_dims // 4
        return 2.0 ** (torch.arange(1, n + 1, dtype=torch.float64) - n)

    def _declare_capabilities(self) -> Capabilities:
        return _value_hooks(super()._declare_capabilities(), self.value_transform)

    def _side(self, pos: Positions) -> Tuple[Optional[Tuple[torch.Tensor, torch.Tensor]], Optional[torch.Tensor]]:
        """((world_to_cam, cam_to_world) ``([B,] N, 4, 4)`` of the non-prefix tokens, SO(2) table
        ``([B, 1,] N_total, so2_dims / 2)``) of one side of the attention."""
        h, w = view_grid(pos, self.name)
        poses = None
        if self.se3_dims:
            poses = tuple(pos.cameras.view_matrices(pos.view_index, which)
                          for which in ('world_to_cam', 'cam_to_world'))
        rot = None
        if self.so2_dims:
            coords = pos.coords.to(torch.promote_types(pos.coords.dtype, torch.float32))
            coords = coords / torch.tensor([h, w], dtype=coords.dtype, device=coords.device)
            freqs = 2 * math.pi * self.max_freq * self.frequencies().to(coords.device)
            rot = rotation_table(interleaved_axis_angles(coords, freqs))
            rot = _as_table(pad_identity(rot, pos.num_prefix, 'table'), pos.batched)
        return poses, rot

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]):
        poses_q, rot_q = self._side(pos_q)
        poses_k, rot_k = (poses_q, rot_q) if pos_k is None else self._side(pos_k)
        pad_q, pad_k = pos_q.num_prefix, (pos_q if pos_k is None else pos_k).num_prefix
        se3 = None
        if self.se3_dims:
            # rho = S(cam_to_world), S scaling the translation by the layer's factor c. S is a group
            # homomorphism, so rho^-1 = S(world_to_cam): q <- S(w2c_i)^T q, k, v <- S(c2w_j) k, o <- S(w2c_i) o.
            # Prefix tokens get the identity, which S and the transpose leave as it is.
            c = self.translation_scale.to(poses_q[0].dtype)
            column = torch.cat([c[:, None].expand(-1, 3), torch.ones_like(c)[:, None]], 1)  # (L, 4)
            mask = torch.cat([torch.ones(c.shape[0], 4, 3, dtype=c.dtype, device=c.device), column[..., None]], -1)

            def scaled(m: torch.Tensor) -> torch.Tensor:  # (..., N, 4, 4) -> (L, ..., N, 4, 4)
                return m * mask.reshape(mask.shape[0], *([1] * (m.dim() - 2)), 4, 4)

            def layers(m: torch.Tensor, batched: bool, pad: int) -> Tuple[torch.Tensor, ...]:
                return block_matrices(m, self.se3_dims, batched, pad).unbind(0)

            w2c_q, c2w_k = scaled(poses_q[0]), scaled(poses_k[1])
            bq, bk = poses_q[0].dim() == 4, poses_k[1].dim() == 4
            se3 = (layers(w2c_q.transpose(-1, -2), bq, pad_q), layers(c2w_k, bk, pad_k), layers(w2c_q, bq, pad_q))
        so2 = None
        if self.so2_dims:  # rotations: rho^-T = rho, rho^-1 = conjugate
            so2 = (rot_q, rot_k, rot_q.conj().resolve_conj())
        return se3, so2

    def _transform(self, x: torch.Tensor, state, which: int, layer: int) -> torch.Tensor:
        se3, so2 = state
        if se3 is not None and layer >= self.ctx.depth:
            raise ValueError(f"encoding 'gta_multiview' was built for depth={self.ctx.depth} (one translation "
                             f'scale per layer), got layer {layer}; pass depth=... to create_pe')
        return rotate_channels(x, [(self.identity_dims, None, None),
                                   (self.se3_dims, 'matrix', se3[which][layer] if se3 is not None else None),
                                   (self.so2_dims, 'table', so2[which] if so2 is not None else None)])

    def qk(self, q, k, state, layer, x=None):
        return self._transform(q, state, 0, layer), self._transform(k, state, 1, layer)

    def value(self, v, state, layer):
        return self._transform(v, state, 1, layer)

    def output(self, o, state, layer):
        return self._transform(o, state, 2, layer)
