"""PRoPE: projective positional encoding of cameras (Li et al., 2025, "Cameras as Relative
Positional Encoding", arXiv:2507.10496)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..cameras import lift_intrinsics
from ..positions import Positions
from ..positions.multiview import view_grid
from ..registry import register_pe
from ._checks import check_positive
from .base import PEContext, PositionalEncoding
from .gta import block_matrices, pad_prefix_matrices
from .rotary import apply_block_rotation, apply_pair_rotation, check_head_dim, pad_prefix, rotation_table

__all__ = ['Prope']


@register_pe('prope', family='prope')
class Prope(PositionalEncoding):
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

    def matrices(self, pos: Positions) -> Tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``P`` and ``P^-1``, ``([B,] N_total, 4, 4)``, identity for prefix tokens."""
        cams = pos.cameras
        if self.intrinsics and cams.K is not None:
            P = cams.projection()
            P_inv = cams.cam_to_world @ lift_intrinsics(torch.linalg.inv(cams.normalized_K()))
        else:
            P, P_inv = cams.world_to_cam, cams.cam_to_world
        return tuple(pad_prefix_matrices(cams.gather(m, pos.view_index), pos.num_prefix) for m in (P, P_inv))

    def tables(self, pos: Positions) -> Tuple[torch.Tensor, torch.Tensor]:
        """Complex RoPE tables ``([B, 1,] N_total, hd / 8)`` of the column and of the row index."""
        nf = self.ctx.head_dim // 8
        coords = pos.coords.to(torch.promote_types(pos.coords.dtype, torch.float32))
        freqs = (self.theta ** (-torch.arange(nf, dtype=torch.float64) / nf)).to(coords.device, coords.dtype)
        out = []
        for axis in (1, 0):  # column (x) first, then row (y)
            rot = pad_prefix(rotation_table(coords[..., axis:axis + 1] * freqs), pos.num_prefix, dim=-2)
            out.append(rot.unsqueeze(-3) if pos.batched else rot)
        return out[0], out[1]

    def _side(self, pos: Positions):
        view_grid(pos, self.name)  # validates the multi-view layout
        P, P_inv = self.matrices(pos)
        return P, P_inv, self.tables(pos)

    def _prepare(self, pos_q: Positions, pos_k: Optional[Positions]):
        P_q, _, (x_q, y_q) = side_q = self._side(pos_q)
        _, P_inv_k, (x_k, y_k) = side_q if pos_k is None else self._side(pos_k)
        n = self.split[0]
        bq, bk = P_q.dim() == 4, P_inv_k.dim() == 4
        # (matrix, column table, row table) for q, for k and v, for the output
        return ((block_matrices(P_q.transpose(-1, -2), n, bq), x_q.conj().resolve_conj(), y_q.conj().resolve_conj()),
                (block_matrices(P_inv_k, n, bk), x_k.conj().resolve_conj(), y_k.conj().resolve_conj()),
                (block_matrices(P_q, n, bq), x_q, y_q))

    @staticmethod
    def _transform(x: torch.Tensor, maps, split) -> torch.Tensor:
        mat, rot_x, rot_y = maps
        a, b, c = x.split(split, dim=-1)
        return torch.cat([apply_block_rotation(a, mat), apply_pair_rotation(b, rot_x, layout='half'),
                          apply_pair_rotation(c, rot_y, layout='half')], dim=-1)

    def qk(self, q, k, state, layer, x=None):
        return self._transform(q, state[0], self.split), self._transform(k, state[1], self.split)

    def value(self, v, state, layer):
        return self._transform(v, state[1], self.split) if self.value_transform else v

    def output(self, o, state, layer):
        return self._transform(o, state[2], self.split) if self.value_transform else o
