"""Conditional position encoding (CPVT, Chu et al., ICLR 2023, "Conditional Positional Encodings
for Vision Transformers"): a depthwise convolution between blocks, the PEG.

The zero padding of the convolution is what tells a token where it is (near a border or not), so
the encoding is conditioned on the input and works at any resolution.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch
from torch import nn

from ..positions import Positions
from ..registry import register_pe
from ..contract import PEContext, PositionalEncoding

__all__ = ['PEG']


@register_pe('peg', family='conditional')
class PEG(PositionalEncoding):
    """Position encoding generator (CPVT): ``Y = X + DWConv_kxk(X)`` after the listed blocks.

    Conventions (CPVT's ``PosCNN`` and timm's `twins.PosConv`, the same operator): the grid tokens
    are reshaped to ``(B, C, h, w)``, convolved depthwise (``groups = C``) with stride 1, zero
    padding ``(k - 1) / 2`` and a bias, added back and flattened; prefix (class / register) tokens
    are split off before the convolution and re-attached unchanged. One convolution per listed
    block, applied to that block's output (the paper's default: one PEG after block 0; its best
    variant: after blocks 0-5, ``'peg:blocks=0-5'``). A 3D ``(t, h, w)`` grid uses a depthwise 3D
    convolution. In a NaFlex batch (``Positions.grids``) each sample is convolved on its own grid,
    with zero padding at its own border; padding tokens pass unchanged and reach no real token.
    PyTorch's default convolution init; the PEG parameters are excluded from weight decay, as in
    CPVT's and Twins' ``no_weight_decay`` (``pos_block``). Pair it with ``global_pool='avg'`` for CPVT-GAP.

    Parameter ``convs.<block>.weight`` / ``.bias``: the convolution after block ``<block>``.

    Args:
        blocks: indices of the blocks after which a PEG is applied.
        kernel_size: odd kernel size k (3).
    """
    larger_input = 'extrapolate'  # the same local operator on any grid
    paper = 'Chu et al., ICLR 2023 (CPVT), arXiv:2102.10882'

    def __init__(self, ctx: PEContext, *, blocks: Tuple[int, ...] = (0,), kernel_size: int = 3) -> None:
        super().__init__(ctx)
        if len(blocks) > ctx.depth:  # sized before it is materialised: blocks=range(10**9) costs nothing
            raise ValueError(f"option 'blocks' of encoding 'peg' lists {len(blocks)} blocks; with depth={ctx.depth} "
                             f'some repeat or are outside 0..{ctx.depth - 1}')
        blocks = tuple(int(b) for b in blocks)
        if not blocks:
            raise ValueError("option 'blocks' of encoding 'peg' must list at least one block")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"option 'blocks' of encoding 'peg' lists a block twice: {blocks}")
        bad = [b for b in blocks if not 0 <= b < ctx.depth]
        if bad:
            raise ValueError(f"option 'blocks' of encoding 'peg': blocks {bad} are outside 0..{ctx.depth - 1} "
                             f'(depth={ctx.depth})')
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"option 'kernel_size' of encoding 'peg' must be a positive odd integer, "
                             f'got {kernel_size}')
        self.blocks = blocks
        self.kernel_size = kernel_size
        self.num_axes = len(ctx.grid_size) if ctx.grid_size is not None else 2
        if self.num_axes not in (2, 3):
            raise ValueError(f"encoding 'peg' needs a 2D or 3D token grid, got grid_size={ctx.grid_size}")
        conv = nn.Conv2d if self.num_axes == 2 else nn.Conv3d
        self.convs = nn.ModuleDict({
            str(b): conv(ctx.dim, ctx.dim, kernel_size, stride=1, padding=kernel_size // 2, groups=ctx.dim, bias=True)
            for b in blocks})

    def no_weight_decay(self) -> set:
        return {n for n, _ in self.named_parameters()}

    def between_blocks(self, x: torch.Tensor, pos: Positions, index: int) -> torch.Tensor:
        conv = self.convs[str(index)] if str(index) in self.convs else None
        if conv is None:
            return x
        grids = pos.sample_grids
        if grids is None or len(grids[0]) != self.num_axes:
            raise ValueError(f"encoding 'peg' needs the full {self.num_axes}D token grid, got "
                             f'grid={pos.grid or pos.grids} (token dropping is not supported)')
        npre = pos.num_prefix
        prefix, tokens = x[:, :npre], x[:, npre:]
        if pos.grids is not None:
            tokens = tokens + self._naflex_conv(conv, tokens, pos)
        else:
            b, n, c = tokens.shape
            feat = tokens.transpose(1, 2).reshape(b, c, *pos.grid)
            tokens = tokens + conv(feat).flatten(2).transpose(1, 2)
        return torch.cat([prefix, tokens], dim=1) if npre else tokens

    @staticmethod
    def _naflex_conv(conv: nn.Module, tokens: torch.Tensor, pos: Positions) -> torch.Tensor:
        """The convolution of each sample of a NaFlex batch on its own grid, ``(B, N, C)`` (zero on padding).

        Every sample's tokens go to the top-left corner of one zero canvas of the largest extent per
        axis: around a sample the canvas is zero, exactly the zero padding the sample gets alone,
        and padding tokens never enter it. One convolution, then each token reads its own cell.
        """
        b, n, c = tokens.shape
        grids, device = pos.grids, tokens.device
        canvas = tuple(max(axis) for axis in zip(*grids))
        axes = range(len(canvas))
        # canvas cell -> the token at that index of the sample's own grid, or the zero row n outside it
        cell = torch.stack(torch.meshgrid(*(torch.arange(s, device=device) for s in canvas), indexing='ij'), -1)
        cell = cell.reshape(-1, len(canvas))  # (M, D)
        shapes = torch.tensor(grids, device=device)[:, None]  # (B, 1, D)
        strides = torch.tensor([[math.prod(g[a + 1:]) for a in axes] for g in grids], device=device)[:, None]
        source = torch.where((cell < shapes).all(-1), (cell * strides).sum(-1), n)  # (B, M)
        padded = torch.cat([tokens, tokens.new_zeros(b, 1, c)], 1)
        feat = padded.gather(1, source.unsqueeze(-1).expand(-1, -1, c))
        out = conv(feat.transpose(1, 2).reshape(b, c, *canvas)).flatten(2).transpose(1, 2)  # (B, M, C)
        # token -> its canvas cell (padding tokens, at index 0, read cell 0 and get zero)
        canvas_strides = torch.tensor([math.prod(canvas[a + 1:]) for a in axes], device=device)
        target = (pos.coords.round().long() * canvas_strides).sum(-1)  # (B, N)
        read = out.gather(1, target.unsqueeze(-1).expand(-1, -1, c))
        sizes = torch.tensor([math.prod(g) for g in grids], device=device)
        real = torch.arange(n, device=device) < sizes[:, None]  # (B, N): a sample's tokens come first
        return torch.where(real.unsqueeze(-1), read, 0)

    def extra_repr(self) -> str:
        return f'blocks={self.blocks}, kernel_size={self.kernel_size}'
