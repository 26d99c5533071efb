"""What every diffusers host description gives `patch_dit`, and the shared pieces of their rotaries."""
from __future__ import annotations

import inspect
import math
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...contract import PEContext
from ...rotary.frequencies import axial_frequencies
from .scaling import DiTScaling

if TYPE_CHECKING:
    from .patch import DiTPatch

__all__ = ['Host', 'axis_tables', 'interleaved_cos_sin']


def axis_tables(scaling: DiTScaling, options: Any, dims: Sequence[int], theta: float, names: Sequence[Optional[str]],
                positions: Sequence[torch.Tensor], lengths: Dict[str, float], dtype: torch.dtype,
                ) -> List[Tuple[torch.Tensor, float]]:
    """Per axis: the angles ``outer(positions[a], f_a)`` of the host's geometric table
    ``f_a = 1 / theta^(2k / dims[a])`` (computed in ``dtype``, as the host does), scaled where the axis is
    named in ``names`` (None: never scaled), and the magnitude of its cos / sin."""
    out = []
    for d, name, pos in zip(dims, names, positions):
        freqs = axial_frequencies(d // 2, theta, step=2.0, dim=d, dtype=dtype, device=pos.device)
        mag = 1.0
        if name is not None and options is not None:
            freqs, mag = scaling.axis_frequencies(options, name, freqs, lengths.get(name))
        out.append((torch.outer(pos, freqs), mag))
    return out


def interleaved_cos_sin(tables: List[Tuple[torch.Tensor, float]], shape: Sequence[int]
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The per-token ``(cos, sin)`` ``(prod(shape), sum of the axes' widths)`` of a ``(t, h, w)`` grid from
    `axis_tables`' per-axis angles ``(shape[a], d_a / 2)``: each angle repeated for its interleaved pair
    (diffusers' ``repeat_interleave_real``), the axes concatenated along the channels, float32; YaRN's
    temperature (the magnitude) on cos and sin alike."""
    cos, sin = [], []
    for i, (angles, mag) in enumerate(tables):
        c, s = angles.cos(), angles.sin()
        if mag != 1.0:  # YaRN's temperature on q and k alike
            c, s = c * mag, s * mag
        view = [1] * len(shape) + [-1]
        view[i] = shape[i]
        cos.append(c.repeat_interleave(2, dim=1).float().view(*view).expand(*shape, -1))
        sin.append(s.repeat_interleave(2, dim=1).float().view(*view).expand(*shape, -1))
    n = math.prod(shape)
    return torch.cat(cos, dim=-1).reshape(n, -1), torch.cat(sin, dim=-1).reshape(n, -1)


class Host:
    """One diffusers transformer class and how `patch_dit` patches it.

    Most hosts are described by class attributes and `make_rope`; `install` and `context` then do the rest:
    the host's position module ``<transformer>.<rope_attr>`` is replaced by the vispe one (the host's own
    table, scaled, or a vispe encoding's per-forward `DiTState`), and with a vispe encoding every attention
    ``<block>.<attention>`` of ``block_lists`` gets ``processor(layer)``, the encoding's additive part entering
    the first block's image tokens (its state read from the argument ``state_arg``).

    Class attributes:
        label: the name in messages; classes: the diffusers class names it takes; axes: the scaled axes;
        timestep_scale: the transformer's ``timestep`` argument at pure noise (1 or 1000);
        video: time is a grid axis; joint_text: the text tokens share the image tokens' attention (as
        prefix tokens of vispe's positions); rope_attr: the position module's attribute; block_lists: the
        attributes holding the blocks, in layer order; attention: a block's self-attention attribute;
        processor: the vispe attention processor class (built with the layer index); state_arg: the name
        and position of the block argument that carries the position module's output.
    """
    label: ClassVar[str] = ''
    classes: ClassVar[Tuple[str, ...]] = ()
    axes: ClassVar[Tuple[str, ...]] = ('h', 'w')
    timestep_scale: ClassVar[float] = 1000.0
    video: ClassVar[bool] = False
    joint_text: ClassVar[bool] = True
    rope_attr: ClassVar[str] = 'rope'
    block_lists: ClassVar[Tuple[str, ...]] = ('transformer_blocks',)
    attention: ClassVar[str] = 'attn'
    processor: ClassVar[Optional[Callable[[int], Any]]] = None
    state_arg: ClassVar[Tuple[str, int]] = ('image_rotary_emb', 3)

    def check(self, transformer: nn.Module) -> None:
        """Raise `UnsupportedModelError` when the instance lacks what the patch replaces."""

    def train_grid(self, transformer: nn.Module) -> Tuple[int, ...]:
        """The token grid of the released model's native resolution (the scaled axes' training lengths)."""
        raise NotImplementedError

    def pixels(self, transformer: nn.Module) -> Sequence[Callable[[int], int]]:
        """Per scaled axis: pixels (frames) -> tokens."""
        raise NotImplementedError

    def blocks(self, transformer: nn.Module) -> List[nn.Module]:
        """The blocks whose attentions a vispe encoding acts in, in layer order."""
        return [b for name in self.block_lists for b in getattr(transformer, name)]

    def context(self, transformer: nn.Module, train_grid: Tuple[int, ...]) -> PEContext:
        """The attentions a vispe encoding acts in: width, heads, head width, count, training grid."""
        cfg = transformer.config
        return PEContext(dim=cfg.num_attention_heads * cfg.attention_head_dim, num_heads=cfg.num_attention_heads,
                         head_dim=cfg.attention_head_dim, depth=len(self.blocks(transformer)), grid_size=train_grid)

    def make_rope(self, handle: 'DiTPatch') -> nn.Module:
        """The vispe module that replaces ``<transformer>.<rope_attr>``, built from the host's own."""
        raise NotImplementedError

    def install(self, handle: 'DiTPatch') -> None:
        """Replace the position module (and, with a vispe encoding, the attention processors) of
        ``handle.model`` through ``handle.set`` / ``handle.add_hook``."""
        model = handle.model
        handle.rope = self.make_rope(handle)
        handle.set(model, self.rope_attr, handle.rope, self.rope_attr)
        if handle.encoding is None:
            return
        blocks = self.blocks(model)
        for i, block in enumerate(blocks):
            handle.set(getattr(block, self.attention), 'processor', self.processor(i),
                       f'block {i} {self.attention}.processor')
        if handle.encoding.capabilities.additive and blocks:
            handle.add_embedding_hook(blocks[0], 'hidden_states', 0, *self.state_arg)

    @staticmethod
    def timestep_index(transformer: nn.Module) -> int:
        """The position of ``timestep`` in the transformer's forward (for a call that passes it positionally)."""
        names = list(inspect.signature(type(transformer).forward).parameters)[1:]
        return names.index('timestep')
