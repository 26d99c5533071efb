"""What every diffusers host description gives `patch_dit`, and the shared pieces of their rotaries."""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...contract import PEContext
from ...rotary.frequencies import axial_frequencies
from .scaling import DiTScaling

if TYPE_CHECKING:
    from .patch import DiTPatch

__all__ = ['Host', 'axis_tables']


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


class Host:
    """One diffusers transformer class and how `patch_dit` patches it.

    Class attributes:
        label: the name in messages; classes: the diffusers class names it takes; axes: the scaled axes;
        timestep_scale: the transformer's ``timestep`` argument at pure noise (1 or 1000);
        video: time is a grid axis; joint_text: the text tokens share the image tokens' attention (as
        prefix tokens of vispe's positions).
    """
    label: ClassVar[str] = ''
    classes: ClassVar[Tuple[str, ...]] = ()
    axes: ClassVar[Tuple[str, ...]] = ('h', 'w')
    timestep_scale: ClassVar[float] = 1000.0
    video: ClassVar[bool] = False
    joint_text: ClassVar[bool] = True

    def check(self, transformer: nn.Module) -> None:
        """Raise `UnsupportedModelError` when the instance lacks what the patch replaces."""

    def train_grid(self, transformer: nn.Module) -> Tuple[int, ...]:
        """The token grid of the released model's native resolution (the scaled axes' training lengths)."""
        raise NotImplementedError

    def pixels(self, transformer: nn.Module) -> Sequence[Callable[[int], int]]:
        """Per scaled axis: pixels (frames) -> tokens."""
        raise NotImplementedError

    def context(self, transformer: nn.Module, train_grid: Tuple[int, ...]) -> PEContext:
        """The attentions a vispe encoding acts in: width, heads, head width, count, training grid."""
        raise NotImplementedError

    def install(self, handle: 'DiTPatch') -> None:
        """Replace the position module (and, with a vispe encoding, the attention processors) of
        ``handle.model`` through ``handle.set`` / ``handle.add_hook``."""
        raise NotImplementedError

    @staticmethod
    def timestep_index(transformer: nn.Module) -> int:
        """The position of ``timestep`` in the transformer's forward (for a call that passes it positionally)."""
        names = list(inspect.signature(type(transformer).forward).parameters)[1:]
        return names.index('timestep')
