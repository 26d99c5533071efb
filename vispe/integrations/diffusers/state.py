"""What a patched diffusion transformer hands its blocks and attention processors once per forward.

With the host's own rotary (``pe=None``) the replaced rope module returns exactly what the host's
processors expect (FLUX's and Wan's ``(cos, sin)``, QwenImage's complex tables), float32, so the host's
processors stay. With a vispe encoding it returns a `DiTState` in the same argument (``image_rotary_emb``
/ ``rotary_emb``), which diffusers hands to every block and processor; the vispe processors read the
prepared encoding from it and the first block's pre-hook adds the encoding's embedding, if it has one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from ...contract import PositionalEncoding, PreparedPE
from ...positions import grid

__all__ = ['DiTState', 'prepare_state', 'argument', 'with_argument']


@dataclass
class DiTState:
    """One forward of a patched transformer under a vispe encoding.

    Attributes:
        prepared: the encoding prepared for the joint sequence ``[text, image]`` (text tokens first, as
            prefix tokens: no rotation, no bias of their own), or None when the encoding acts only on tokens.
        image: prepared for the image tokens alone (attentions without text), or None.
        embedding: the additive embedding ``(N_image, C)`` of the image tokens, or None.
        num_text: text tokens in the joint sequence.
        grid: the image-token grid of this forward.
        encoding, train_grid, device: what prepared it (for `joint`).
    """
    prepared: Optional[PreparedPE]
    image: Optional[PreparedPE]
    embedding: Optional[torch.Tensor]
    num_text: int
    grid: Tuple[int, ...]
    encoding: Optional[PositionalEncoding] = None
    train_grid: Optional[Tuple[int, ...]] = None
    device: Optional[torch.device] = None

    def joint(self, num_text: int) -> Optional[PreparedPE]:
        """Prepared for ``[text, image]`` with ``num_text`` text tokens: for a host whose position module does
        not see the text (HunyuanVideo) the first attention of the forward prepares it, the others reuse it."""
        if self.encoding is None or not self.encoding.capabilities.in_attention:
            return None
        if self.prepared is None or num_text != self.num_text:
            self.prepared = self.encoding.prepare(grid(*self.grid, num_prefix=num_text, train_grid=self.train_grid,
                                                       device=self.device))
            self.num_text = num_text
        return self.prepared


def prepare_state(encoding: PositionalEncoding, shape: Sequence[int], num_text: int, train_grid: Sequence[int],
                  device: torch.device, joint: bool = True, image_only: bool = False) -> DiTState:
    """The encoding prepared for a ``shape`` grid of image tokens after ``num_text`` text tokens."""
    caps = encoding.capabilities
    image_pos = grid(*shape, train_grid=tuple(train_grid), device=device)
    prepared = image = None
    if caps.in_attention:
        if joint:
            prepared = encoding.prepare(grid(*shape, num_prefix=num_text, train_grid=tuple(train_grid), device=device))
        if image_only:
            image = encoding.prepare(image_pos)
    embedding = encoding.embedding(image_pos) if caps.additive else None
    return DiTState(prepared, image, embedding, num_text, tuple(shape), encoding, tuple(train_grid), device)


def argument(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str, index: int) -> Any:
    """A call's argument ``name`` (keyword) or at position ``index``."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else None


def with_argument(args: Tuple[Any, ...], kwargs: Dict[str, Any], name: str, index: int, value: Any
                  ) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The call's arguments with ``name`` (keyword, or at position ``index``) replaced by ``value``."""
    if name in kwargs or index >= len(args):
        return args, {**kwargs, name: value}
    return args[:index] + (value,) + args[index + 1:], kwargs


class TimestepSlot(nn.Module):
    """Base of the modules a patch puts in place of a host's position module: holds the noise level of the
    running forward (set by the transformer's forward pre-hook when a scaling schedule needs it, cleared
    by its forward hook, also on error), the only input of a forward that diffusers does not hand to the
    rope module."""

    def __init__(self) -> None:
        super().__init__()
        self._noise_level: list = []

    def begin(self, level: Optional[float]) -> None:
        self._noise_level = [level]

    def end(self) -> None:
        self._noise_level = []

    @property
    def noise_level(self) -> Optional[float]:
        return self._noise_level[0] if self._noise_level else None
