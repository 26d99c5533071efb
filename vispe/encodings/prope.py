"""PRoPE: projective positional encoding of cameras (Li et al., 2025, "Cameras as Relative
Positional Encoding", arXiv:2507.10496).

The maps go through the shared dispatch of `vispe.rotary` (`rotate_channels`), whose backward keeps
only the mapped output: the projective ``4 x 4`` blocks as kind ``matrix`` (not orthogonal: the
gradient goes through the inverse), the RoPE quarters as rotate-half tables (kind ``half_table``).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch

from ..cameras import lift_intrinsics
from ..positions import Positions
from ..positions.multiview import view_grid
from ..registry import register_pe
from ..rotary import RotationPE, axial_frequencies, rotation_table
from ..rotary.autograd import rotate_channels
from ..rotary.base import check_head_dim
from ..rotary.kernels import block_matrices, pad_identity
from ._checks import check_positive
from ..contract import Capabilities, PEContext

__all__ = ['Prope']


@register_pe('prope', family='prope')
class Prope(RotationPE):
    """PRoPE (Li et al., 2025, "Cameras as Relative Positional Encoding"; the official ``prope`` code).

    GTA with a projective group: token ``j`` of camera ``c`` has ``P_c = lift(K_c) @ world_to_cam_c``
    (image <- world, ``lift`` = ``[[K, 0], [0, 1]]``), with ``K`` normalised to the image
    (``fx / W, fy / H``, principal point ``cx / W - 1/2, cy / H - 1/2``). The head dim is split as in
    the official code:

    * the first ``hd / 2`` channels, in blocks of 4: ``q <- P_i^T q``, ``k, v <- P_j^-1 k``,
      output ``<- P_i o``, so logits see ``P_i P_j^-1`` (the relative projective transform) and the
      values are carried across cameras by the same map;
    * the next ``hd / 4`` channels: RoPE on the column index, the last ``hd / 4``: RoPE on the row
      index, each in the split layout (pairs ``(j, j + hd / 8)``), ``hd / 8`` frequencies
      ``theta^(-j / (hd / 8))`` with ``theta = 100``; as in the official code q, k and v rotate by
      ``-angle`` and the output by ``+angle`` (the inverse).

    Only relative geometry matters: outputs are invariant to a global rigid transform of all
    cameras and to a common shift of the patch indices. The value and output maps are not
    orthogonal, so proper inverses are used. Cameras without intrinsics (or ``intrinsics=False``)
    give ``P = world_to_cam``: exactly GTA's SE(3) representation (without its translation scale).
    Needs positions from `vispe.positions.multiview` (with ``Cameras.image_size`` when intrinsics
    are used); prefix tokens get the identity.

    Args:
        theta: RoPE frequency base (100).
        intrinsics: use the cameras' intrinsics (PRoPE) or the pose alone (GTA's SE(3) form).
        value_transform: transform v and the output too; False keeps only the q and k maps.
    """
    shift_invariant = True
    requires = frozenset({'cameras', 'view_index'})
    larger_input = 'extrapolate'
    paper = 'Li et al., NeurIPS 2025 (PRoPE, "Cameras as Relative Positional Encoding"), arXiv:2507.10496'

    def __init__(
            self,
            ctx: PEContext,
            *,
            theta: float = 100.0,
            intrinsics: bool = True,
            value_transform: bool = True,
    ) -> None:
        super().__init__(ctx)
        check_head_dim('prope', ctx.head_dim, 8, 'half in 4x4 blocks, two quarters of rotary pairs')
        self.theta = check_positive(self.name, 'theta', theta)
        self.intrinsics = intrinsics
        self.value_transform = value_transform
        hd = ctx.head_dim
        self.split = (hd // 2, hd // 4, hd // 4)

    def _declare_capabilities(self) -> Capabilities:
        caps = super()._declare_capabilities()
        return caps if self.value_transform else dataclasses.replace(caps, hooks=caps.hooks - {'value', 'output'})

    def matrices(self, pos: Positions) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``P`` and ``P^-1`` of the non-prefix tokens, ``([B,] N, 4, 4)``."""
        cams = pos.cameras
        if self.intrinsics and cams.K is not None:
            P = cams.projection()
            P_inv = cams.cam_to_world @ lift_intrinsics(torch.linalg.inv(cams.normalized_K()))
        else:
            P, P_inv = cams.world_to_cam, cams.cam_to_world
        return cams.gather(P, pos.view_index), cams.gather(P_inv, pos.view_index)

    def tables(self, pos: Positions) -> Tuple[torch.Tensor, torch.Tensor]:
        """Complex RoPE tables ``([B, 1,] N_total, hd / 8)`` of the column and of the row index."""
        nf = self.ctx.head_dim // 8
        coords = pos.coords.to(torch.promote_types(pos.coords.dtype, torch.float32))
        freqs = axial_frequencies(nf, self.theta, step=1.0, dim=nf, dtype=torch.float64).to(coords.device, coords.dtype)
        out = []
        for axis in (1, 0):  # column (x) first, then row (y)
            rot = pad_identity(rotation_table(coords[..., axis:axis + 1] * freqs), pos.num_prefix, 'half_table')
            out.append(rot.unsqueeze(-3) if pos.batched else rot)
        return out[0], out[1]

    def _side(self, pos: Positions):
        view_grid(pos, self.name)  # validates the multi-view layout
        P, P_inv = self.matrices(pos)
        return P, P_inv, self.tables(pos), pos.num_prefix

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]):
        P_q, _, (x_q, y_q), pad_q = side_q = self._side(pos_q)
        _, P_inv_k, (x_k, y_k), pad_k = side_q if pos_k is None else self._side(pos_k)
        n = self.split[0]
        bq, bk = P_q.dim() == 4, P_inv_k.dim() == 4
        # (matrix, column table, row table) for q, for k and v, for the output; prefix tokens: identity
        return ((block_matrices(P_q.transpose(-1, -2), n, bq, pad_q), x_q.conj().resolve_conj(),
                 y_q.conj().resolve_conj()),
                (block_matrices(P_inv_k, n, bk, pad_k), x_k.conj().resolve_conj(), y_k.conj().resolve_conj()),
                (block_matrices(P_q, n, bq, pad_q), x_q, y_q))

    def _transform(self, x: torch.Tensor, maps) -> torch.Tensor:
        mat, rot_x, rot_y = maps
        a, b, c = self.split
        return rotate_channels(x, [(a, 'matrix', mat), (b, 'half_table', rot_x), (c, 'half_table', rot_y)])

    def qk(self, q, k, state, layer, x=None):
        return self._transform(q, state[0]), self._transform(k, state[1])

    def value(self, v, state, layer):
        return self._transform(v, state[1])

    def output(self, o, state, layer):
        return self._transform(o, state[2])
