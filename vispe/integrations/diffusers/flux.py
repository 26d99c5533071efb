"""FLUX.1 (``FluxTransformer2DModel``), FLUX.1 Kontext's reference images included.

FLUX's own rotary: ``pos_embed`` (``FluxPosEmbed(10000, axes_dims_rope)``) turns ``cat(txt_ids, img_ids)``
(``(N, 3)``: image index, row, column; text ids zero) into ``(cos, sin)`` ``(N, head_dim)``, each axis'
``1 / 10000^(2k / d_a)`` angles in float64, pairs interleaved; the processors apply them to the joint
``[text, image]`` queries and keys. Rows and columns are the scaled axes (``'h'``, ``'w'``); the image
index is never scaled.

Reference images (Kontext): the pipeline gives the reference tokens image index 1 and their own rows and
columns from 0. Several references have two layouts in use: ``'index'`` (reference ``k`` at image index
``k``, each from row / column 0) and ``'offset'`` (every reference at index 1, side by side: reference
``k``'s columns start after the widths of references ``1 .. k-1``). `kontext_ids` builds either; the
``reference_layout`` option of `patch_dit` re-lays the reference tokens a transformer is given (grouped
by their image index) at every forward. With one reference both layouts are the pipeline's ids.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import torch
from torch import nn

from ...attention import pe_attention
from ...contract import PositionalEncoding
from ..base import UnsupportedModelError
from .host import Host, axis_tables
from .scaling import DiTScaling
from .state import DiTState, TimestepSlot, prepare_state

__all__ = ['FluxHost', 'FluxRope', 'FluxProcessor', 'kontext_ids', 'REFERENCE_LAYOUTS']

REFERENCE_LAYOUTS = ('index', 'offset')


def _grid_ids(index: float, h: int, w: int, row: int = 0, col: int = 0) -> torch.Tensor:
    rows = torch.arange(h, dtype=torch.float32)[:, None].expand(h, w) + row
    cols = torch.arange(w, dtype=torch.float32)[None, :].expand(h, w) + col
    return torch.stack([torch.full((h, w), float(index)), rows, cols], -1).reshape(h * w, 3)


def kontext_ids(image: Tuple[int, int], references: Sequence[Tuple[int, int]], layout: str = 'index') -> torch.Tensor:
    """FLUX ``img_ids`` ``(N, 3)`` of a generated image of ``image = (h, w)`` tokens followed by reference
    images of ``references`` grids, in ``layout`` (module docstring)."""
    if layout not in REFERENCE_LAYOUTS:
        raise ValueError(f'layout must be one of {REFERENCE_LAYOUTS}, got {layout!r}')
    parts, col = [_grid_ids(0, *image)], 0
    for k, (h, w) in enumerate(references, start=1):
        if layout == 'index':
            parts.append(_grid_ids(k, h, w))
        else:
            parts.append(_grid_ids(1, h, w, col=col))
            col += w
    return torch.cat(parts)


def relayout_references(ids: torch.Tensor, layout: str) -> torch.Tensor:
    """``ids`` with the tokens of image index ``k >= 1`` (reference ``k``, in increasing index) re-laid in
    ``layout``; text and generated-image tokens (index 0) unchanged."""
    index = ids[:, 0]
    if not bool((index != 0).any()):
        return ids
    out, col = ids.clone(), 0
    for k, value in enumerate(torch.unique(index[index != 0]).tolist(), start=1):
        rows = index == value
        ref = ids[rows]
        r, c = ref[:, 1] - ref[:, 1].min(), ref[:, 2] - ref[:, 2].min()
        if layout == 'index':
            out[rows] = torch.stack([torch.full_like(r, k), r, c], -1)
        else:
            out[rows] = torch.stack([torch.ones_like(r), r, c + col], -1)
            col += int(c.max()) + 1
    return out


class FluxRope(TimestepSlot):
    """FLUX's ``pos_embed`` under a patch: ``ids -> (cos, sin)`` (the host's rotary, frequency-scaled as
    configured) or, with a vispe encoding, ``ids -> DiTState``."""

    def __init__(self, theta: float, axes_dim: Sequence[int], scaling: DiTScaling,
                 encoding: Optional[PositionalEncoding], train_grid: Tuple[int, int],
                 reference_layout: Optional[str]) -> None:
        super().__init__()
        self.theta, self.axes_dim = theta, tuple(axes_dim)
        self.scaling, self.train_grid, self.reference_layout = scaling, train_grid, reference_layout
        self.encoding = encoding
        from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device
        self._angle_dtype = maybe_adjust_dtype_for_device  # the host's rule: float64 where the device has it

    def forward(self, ids: torch.Tensor) -> Any:
        if self.reference_layout is not None:
            ids = relayout_references(ids, self.reference_layout)
        if self.encoding is not None:
            return self._state(ids)
        pos = ids.float()
        options = lengths = None
        if self.scaling.active:
            options = self.scaling.at(self.noise_level)
            if any(s.factor is None for s in options.values()):  # lengths read from the ids (a fixed target
                main = pos[pos[:, 0] == 0]  # needs none): the generated image, and the text at row / column 0
                lengths = {'h': float(main[:, 1].max() - main[:, 1].min() + 1),
                           'w': float(main[:, 2].max() - main[:, 2].min() + 1)}
        dtype = self._angle_dtype(torch.float64, ids.device)
        tables = axis_tables(self.scaling, options, self.axes_dim, self.theta, (None, 'h', 'w'),
                             [pos[:, i] for i in range(ids.shape[-1])], lengths or {}, dtype)
        cos, sin = [], []
        for angles, mag in tables:
            c, s = angles.cos(), angles.sin()
            if mag != 1.0:  # YaRN's temperature on q and k alike
                c, s = c * mag, s * mag
            cos.append(c.repeat_interleave(2, dim=1).float())
            sin.append(s.repeat_interleave(2, dim=1).float())
        return torch.cat(cos, dim=-1).to(ids.device), torch.cat(sin, dim=-1).to(ids.device)

    def _state(self, ids: torch.Tensor) -> DiTState:
        if bool((ids[:, 0] != 0).any()):
            raise ValueError('patch_dit: a vispe encoding in FLUX positions one generated image; these ids hold '
                             'reference images (image index > 0), which the FLUX rotary (pe=None) positions')
        h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        num_text = ids.shape[0] - h * w
        expected = torch.cat([torch.zeros(max(num_text, 0), 3), _grid_ids(0, h, w)]).to(ids)
        if num_text < 0 or not torch.equal(ids.float(), expected.float()):
            raise ValueError('patch_dit: a vispe encoding in FLUX needs the pipeline\'s ids: text ids zero, then the '
                             'image ids (0, row, column) of one grid in row-major order')
        return prepare_state(self.encoding, (h, w), num_text, self.train_grid, ids.device)

    def extra_repr(self) -> str:
        return f'theta={self.theta}, axes_dim={self.axes_dim}, scaling=({self.scaling.describe()})'


class FluxProcessor:
    """FLUX's attention processor with a vispe encoding: the host's projections and q/k norms, then
    `vispe.pe_attention` over the joint ``[text, image]`` sequence with the `DiTState` diffusers hands it
    as ``image_rotary_emb``. ``layer``: this attention's index (double-stream blocks first)."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb: Optional[DiTState] = None
                 ) -> Any:
        from diffusers.models.transformers.transformer_flux import _get_qkv_projections
        query, key, value, e_query, e_key, e_value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        if attn.added_kv_proj_dim is not None:
            query = torch.cat([attn.norm_added_q(e_query.unflatten(-1, (-1, attn.head_dim))), query], dim=1)
            key = torch.cat([attn.norm_added_k(e_key.unflatten(-1, (-1, attn.head_dim))), key], dim=1)
            value = torch.cat([e_value.unflatten(-1, (-1, attn.head_dim)), value], dim=1)
        prepared = image_rotary_emb.prepared if image_rotary_emb is not None else None
        x = hidden_states if encoder_hidden_states is None else torch.cat([encoder_hidden_states, hidden_states], 1)
        out = pe_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), prepared, self.layer,
                           x=x, attn_mask=attention_mask)
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out
        text_len = encoder_hidden_states.shape[1]
        text, out = out[:, :text_len], out[:, text_len:]
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(text.contiguous())


class FluxHost(Host):
    label = 'FLUX'
    classes = ('FluxTransformer2DModel',)
    axes = ('h', 'w')
    timestep_scale = 1.0  # the pipeline passes sigma in [0, 1]; the transformer multiplies by 1000
    rope_attr = 'pos_embed'
    block_lists = ('transformer_blocks', 'single_transformer_blocks')
    processor = FluxProcessor

    def check(self, transformer):
        if not hasattr(transformer, 'pos_embed') or not hasattr(transformer.pos_embed, 'axes_dim'):
            raise UnsupportedModelError('patch_dit: this FluxTransformer2DModel has no FluxPosEmbed pos_embed')
        if len(transformer.pos_embed.axes_dim) != 3:
            raise UnsupportedModelError(f'patch_dit: FLUX with {len(transformer.pos_embed.axes_dim)} rotary axes; '
                                        f'FLUX.1 has 3 (image index, row, column)')

    def train_grid(self, transformer):
        return (64, 64)  # FLUX.1 at 1024 x 1024: 8x VAE, 2 x 2 packing

    def pixels(self, transformer):
        return (lambda px: px // 16, lambda px: px // 16)

    def make_rope(self, handle):
        own = handle.model.pos_embed
        return FluxRope(own.theta, own.axes_dim, handle.scaling, handle.encoding, handle.train_grid,
                        handle.options.get('reference_layout'))
