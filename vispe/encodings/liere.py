"""LieRE (Ostmeier et al., ICML 2025, "LieRE: Lie Rotational Positional Encodings").

A token at position ``p`` rotates q and k by ``R(p) = exp(sum_d p_d A_d)`` with learned
skew-symmetric generators ``A_d``, block-diagonal with dense ``block x block`` blocks.
"""
from __future__ import annotations

import math
from typing import List, Literal, Optional, Tuple

import torch
from torch import nn

from ..positions import Positions, grid_coordinates
from ..registry import register_pe
from ..rotary import RotationPE
from ..rotary.base import check_axes, heads_and_layers, token_grid
from ..rotary.expm import Rotations, layerwise_exp, skew_from_upper
from ._checks import check_nonnegative
from ..contract import PEContext, resolve_num_axes

__all__ = ['LieRE']

LieREPositions = Literal['linspace', 'index', 'normalized']


@register_pe('liere')
class LieRE(RotationPE):
    """LieRE (Ostmeier et al., ICML 2025): ``R(p) = matrix_exp(sum_d p_d A_d)``, learned generators.

    Conventions (the original code, ImageNet configuration):

    * per coordinate axis ``d`` a generator ``A_d = T_d - T_d^T`` from the strict upper triangle
      ``T_d`` of a learned parameter, block-diagonal: the head dim is split into ``hd // block``
      consecutive ``block x block`` blocks (channels beyond ``block * (hd // block)`` are not rotated);
    * generators per layer and per head by default (``per_layer``, ``per_head``), as the released
      ImageNet run sets them (``imagenet_224.yaml`` and ``lightning_imagenet.sh``: both on, ``gd`` 8);
      the original ViT reuses layer 0's rotations in every layer through a slicing bug, so the model
      it effectively trains has per-head generators shared by all layers, which ``per_layer=false``
      gives; vispe's default implements per-layer generators as intended;
    * raw parameters (the strict upper triangles, stored packed as ``generators`` with shape
      ``(D, L', H', hd // block, block (block - 1) / 2)``) initialised uniformly in ``[0, 2 pi)``, as RoPE-Mixed
      draws its angles; excluded from weight decay;
    * positions per grid axis ``linspace(0, n / n_train, n)`` (``[0, 1]`` at the training size, so a
      larger input reaches beyond 1: extrapolation); point sets are used as given;
    * prefix (class / register) tokens: identity; q and k rotated, v not; the exponential is taken
      in float32 (float64 for float64 parameters).

    Shift invariance: with ``block = 2`` the blocks are plane rotations, which commute, so LieRE is a
    learned-frequency 2D RoPE and exactly shift-invariant. With ``block > 2`` (the default 8) the
    generators do not commute and ``R(p)^T R(p') != R(p' - p)``: a common shift of all positions
    changes the logits. This is the method as published, not a defect to fix.

    Cost: ``R`` depends on positions and parameters only; it is built once per forward for all
    layers and heads (``L' x H' x N x hd/block`` small exponentials, never per sample; their Taylor
    part is one GEMM over monomials of the coordinates, then a few squarings) and cached in eval
    mode; ``block = 2`` uses the closed form (cos / sin) and the pair-rotation kernel.

    Args:
        block: generator block size (the paper's ``gd``; 8 in its ImageNet setting; 2 = learned-frequency
            RoPE). ComRoPE's ``block`` is the same concept; specs saying ``gd`` still load, with a warning.
        per_layer: separate generators in every attention layer.
        per_head: separate generators for every head.
        num_axes: coordinate axes D (default: the host grid's, else 2).
        positions: ``linspace`` (the paper's), ``index`` (integer patch indices) or ``normalized``
            (indices rescaled to the training grid).
        init_scale: raw parameters are drawn from ``U[0, init_scale)`` (2 pi).
    """
    larger_input = 'extrapolate'
    shift_invariant = False
    paper = 'Ostmeier et al., ICML 2025 (LieRE), arXiv:2406.10322'
    cache_compiled_state = True  # eval rotations are exponentials: costly to rebuild in every compiled forward
    renamed_options = {'gd': 'block'}  # the paper's name, ComRoPE's ``block`` for the same concept

    def __init__(
            self,
            ctx: PEContext,
            *,
            block: int = 8,
            per_layer: bool = True,
            per_head: bool = True,
            num_axes: Optional[int] = None,
            positions: LieREPositions = 'linspace',
            init_scale: float = 2 * math.pi,
    ) -> None:
        super().__init__(ctx)
        if block < 2 or block > ctx.head_dim:
            raise ValueError(f"option block of encoding 'liere' must be in [2, head_dim={ctx.head_dim}], got {block}")
        check_nonnegative('liere', 'init_scale', init_scale)
        if init_scale > 1e3:  # angles that wrap thousands of times per patch are noise (and overflow expm)
            raise ValueError(f"option 'init_scale' of encoding 'liere' must be at most 1000, got {init_scale}")
        self.block = block
        self.rotation_kind = 'pair' if block == 2 else 'block'
        self.num_blocks = ctx.head_dim // block
        self.num_axes = resolve_num_axes(ctx, num_axes, 'liere')
        self.positions = positions
        self.shift_invariant = block == 2  # per instance: only 2x2 blocks commute
        layers, heads = heads_and_layers(ctx, per_layer, per_head)
        self.generators = nn.Parameter(
            torch.rand(self.num_axes, layers, heads, self.num_blocks, block * (block - 1) // 2) * init_scale)

    def no_weight_decay(self) -> set:
        return {'generators'}

    def axis_generators(self) -> torch.Tensor:
        """Skew-symmetric blocks ``(D, L', H', hd // block, block, block)`` in the compute dtype."""
        return skew_from_upper(self.generators.to(self.compute_dtype()), self.block)

    @staticmethod
    def linspace_steps(grid: Tuple[int, ...], train: Tuple[int, ...]) -> List[float]:
        """Per axis the step of ``linspace(0, n / n_train, n)``: ``(n / n_train) / (n - 1)``."""
        return [n / t / (n - 1) if n > 1 else 0.0 for n, t in zip(grid, train)]

    def coordinates(self, pos: Positions) -> torch.Tensor:
        """Token coordinates in the configured convention, ``([B,] N, D)``."""
        grid = token_grid(pos)
        if self.positions == 'linspace' and pos.index_grids is not None:  # NaFlex: each sample's own grid
            steps = [self.linspace_steps(g, pos.train_grid or g) for g in pos.index_grids]
            coords = pos.coords * torch.tensor(steps, dtype=pos.coords.dtype, device=pos.device)[:, None]
        elif self.positions != 'linspace' or grid is None:
            coords = grid_coordinates(pos, 'normalized' if self.positions == 'normalized' else 'index')
        else:
            step = self.linspace_steps(grid, pos.train_grid or grid)
            coords = pos.coords * torch.tensor(step, dtype=pos.coords.dtype, device=pos.device)
        check_axes('liere', coords, self.num_axes)
        return coords.to(self.compute_dtype())

    def per_grid(self) -> bool:
        # without gradients (eval: built once, cached) each NaFlex grid alone, hence exactly its own
        # rotations; in training one batched build for all layers, each sample with its own squarings
        return not (torch.is_grad_enabled() and self.generators.requires_grad)

    def rotation(self, pos: Positions, batch: Optional[int] = None) -> Rotations:
        # a NaFlex sample gets the squarings it needs alone, hence the same rotations as alone
        return layerwise_exp(self.axis_generators(), self.coordinates(pos), pos.num_prefix,
                             sample_squarings=pos.index_grids is not None, cache=self.tensor_cache)

    def extra_repr(self) -> str:
        return (f'block={self.block}, blocks={self.num_blocks}, axes={self.num_axes}, '
                f'generators={tuple(self.generators.shape)}')
