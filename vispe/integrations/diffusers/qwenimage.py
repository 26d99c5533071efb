"""QwenImage (``QwenImageTransformer2DModel``), Qwen-Image-Edit's condition images included.

QwenImage's own rotary: ``pos_embed`` (``QwenEmbedRope(10000, axes_dims_rope, scale_rope=True)``) holds
complex tables of positions ``0 .. 4095`` and ``-4096 .. -1`` per axis (angles in float32). Image ``i`` of
``img_shapes`` (frames, h, w) takes frame positions ``i .. i + frames - 1`` and rows / columns centred on 0
(``-(h - h // 2) .. h // 2 - 1``); the text takes ``m .. m + L - 1`` on all three axes, ``m`` the largest
``max(h // 2, w // 2)`` of the images. The host caches its results per shape (an in-place edit of its
tables does nothing) and slices its table, so text past row 4,096 silently gets fewer positions than
tokens. The patched module computes every position from the formula (nothing cached across forwards);
``text_layout='continue'`` (default) gives long text its positions past the table, ``'table'`` refuses it
with an error. Rows and columns are the scaled axes; the frame axis (the image index) is never scaled.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...attention import pe_attention
from ...contract import PositionalEncoding
from ..base import UnsupportedModelError
from .host import Host, axis_tables
from .scaling import DiTScaling
from .state import DiTState, TimestepSlot, prepare_state

__all__ = ['QwenImageHost', 'QwenImageRope', 'QwenImageProcessor', 'TEXT_LAYOUTS', 'TABLE_ROWS']

TEXT_LAYOUTS = ('continue', 'table')
TABLE_ROWS = 4096


class QwenImageRope(TimestepSlot):
    """QwenImage's ``pos_embed`` under a patch: ``(img_shapes, device, max_txt_seq_len) -> (image table,
    text table)`` (complex64, the host's rotary, frequency-scaled as configured) or, with a vispe encoding,
    a `DiTState`."""

    def __init__(self, theta: float, axes_dim: Sequence[int], scale_rope: bool, scaling: DiTScaling,
                 encoding: Optional[PositionalEncoding], train_grid: Tuple[int, int], text_layout: str) -> None:
        super().__init__()
        self.theta, self.axes_dim, self.scale_rope = theta, tuple(axes_dim), scale_rope
        self.scaling, self.train_grid, self.text_layout = scaling, train_grid, text_layout
        self.encoding = encoding

    def _shapes(self, video_fhw: Any) -> List[Tuple[int, int, int]]:
        if isinstance(video_fhw, list):  # one list per sample: the host positions every sample as the first
            video_fhw = video_fhw[0]
        if not isinstance(video_fhw, list):
            video_fhw = [video_fhw]
        return [tuple(int(v) for v in fhw) for fhw in video_fhw]

    def _axis(self, size: int, centred: bool, device: torch.device) -> torch.Tensor:
        pos = torch.arange(size, device=device, dtype=torch.float32)
        return pos - (size - size // 2) if centred else pos

    def forward(self, video_fhw: Any, device: Optional[torch.device] = None,
                max_txt_seq_len: Optional[Any] = None) -> Any:
        if max_txt_seq_len is None:
            raise ValueError('`max_txt_seq_len` must be provided.')
        shapes, text_len = self._shapes(video_fhw), int(max_txt_seq_len)
        start = max(max(h // 2, w // 2) if self.scale_rope else max(h, w) for _, h, w in shapes)
        if self.text_layout == 'table' and start + text_len > TABLE_ROWS:
            raise ValueError(f'{text_len} text tokens after position {start} run past QwenImage\'s {TABLE_ROWS}-row '
                             f"table (text_layout='table'); text_layout='continue' gives them the positions of "
                             f'the formula')
        if self.encoding is not None:
            if len(shapes) != 1 or shapes[0][0] != 1:
                raise ValueError(f'patch_dit: a vispe encoding in QwenImage positions one image; img_shapes gives '
                                 f'{shapes} (condition images are positioned by the QwenImage rotary, pe=None)')
            return prepare_state(self.encoding, shapes[0][1:], text_len, self.train_grid, device)
        options = self.scaling.at(self.noise_level) if self.scaling.active else None
        lengths = {'h': float(shapes[0][1]), 'w': float(shapes[0][2])}
        names = (None, 'h', 'w')
        images = []
        for i, (f, h, w) in enumerate(shapes):
            axes = [torch.arange(i, i + f, device=device, dtype=torch.float32),
                    self._axis(h, self.scale_rope, device), self._axis(w, self.scale_rope, device)]
            angles = axis_tables(self.scaling, options, self.axes_dim, self.theta, names, axes, lengths, torch.float32)
            tables = [torch.polar(torch.full_like(a, m), a) for a, m in angles]
            t, r, c = tables
            images.append(torch.cat([t.view(f, 1, 1, -1).expand(f, h, w, -1), r.view(1, h, 1, -1).expand(f, h, w, -1),
                                     c.view(1, 1, w, -1).expand(f, h, w, -1)], dim=-1).reshape(f * h * w, -1))
        text_pos = torch.arange(start, start + text_len, device=device, dtype=torch.float32)
        text = [torch.polar(torch.full_like(a, m), a) for a, m in
                axis_tables(self.scaling, options, self.axes_dim, self.theta, names, [text_pos] * 3, lengths,
                            torch.float32)]
        return torch.cat(images, dim=0), torch.cat(text, dim=-1)

    def extra_repr(self) -> str:
        return (f'theta={self.theta}, axes_dim={self.axes_dim}, text_layout={self.text_layout!r}, '
                f'scaling=({self.scaling.describe()})')


class QwenImageProcessor:
    """QwenImage's joint attention processor with a vispe encoding: the host's projections, q/k norms and
    text mask, then `vispe.pe_attention` over ``[text, image]`` with the `DiTState` handed as
    ``image_rotary_emb``."""

    def __init__(self, layer: int) -> None:
        self.layer = layer

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor = None,
                 encoder_hidden_states_mask: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, image_rotary_emb: Optional[DiTState] = None) -> Any:
        if encoder_hidden_states is None:
            raise ValueError('the QwenImage attention needs encoder_hidden_states (the text stream)')
        if attention_mask is not None:
            raise ValueError('the QwenImage attention builds its mask from encoder_hidden_states_mask; pass that')
        if encoder_hidden_states_mask is not None:
            image_mask = torch.ones(hidden_states.shape[:2], dtype=torch.bool, device=hidden_states.device)
            attention_mask = torch.cat([encoder_hidden_states_mask.to(torch.bool), image_mask], dim=1)[:, None, None, :]
        head_dim = attn.inner_dim // attn.heads

        def heads(proj: nn.Module, x: torch.Tensor, norm: Optional[nn.Module]) -> torch.Tensor:
            t = proj(x).unflatten(-1, (-1, head_dim))
            return norm(t) if norm is not None else t

        query = torch.cat([heads(attn.add_q_proj, encoder_hidden_states, attn.norm_added_q),
                           heads(attn.to_q, hidden_states, attn.norm_q)], dim=1)
        key = torch.cat([heads(attn.add_k_proj, encoder_hidden_states, attn.norm_added_k),
                         heads(attn.to_k, hidden_states, attn.norm_k)], dim=1)
        value = torch.cat([heads(attn.add_v_proj, encoder_hidden_states, None),
                           heads(attn.to_v, hidden_states, None)], dim=1)
        prepared = image_rotary_emb.prepared if image_rotary_emb is not None else None
        out = pe_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), prepared, self.layer,
                           attn_mask=attention_mask, x=torch.cat([encoder_hidden_states, hidden_states], dim=1))
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)
        text_len = encoder_hidden_states.shape[1]
        image = attn.to_out[0](out[:, text_len:].contiguous())
        if len(attn.to_out) > 1:
            image = attn.to_out[1](image)
        return image, attn.to_add_out(out[:, :text_len].contiguous())


class QwenImageHost(Host):
    rope_attr = 'pos_embed'
    processor = QwenImageProcessor
    state_arg = ('image_rotary_emb', 4)
    label = 'QwenImage'
    classes = ('QwenImageTransformer2DModel',)
    axes = ('h', 'w')
    timestep_scale = 1.0  # the pipeline passes sigma in [0, 1]

    def check(self, transformer):
        if getattr(transformer.config, 'use_layer3d_rope', False):
            raise UnsupportedModelError('patch_dit: QwenImage with use_layer3d_rope=True (the layered rotary) is not '
                                        'supported; the QwenEmbedRope models are')
        if type(transformer.pos_embed).__name__ != 'QwenEmbedRope':
            raise UnsupportedModelError(f'patch_dit: QwenImage with a {type(transformer.pos_embed).__name__} '
                                        f'pos_embed; QwenEmbedRope is supported')

    def train_grid(self, transformer):
        return (64, 64)  # the pipeline's default 1024 x 1024: 8x VAE, 2 x 2 patches

    def pixels(self, transformer):
        return (lambda px: px // 16, lambda px: px // 16)

    def make_rope(self, handle):
        own = handle.model.pos_embed
        return QwenImageRope(own.theta, own.axes_dim, own.scale_rope, handle.scaling, handle.encoding,
                             handle.train_grid, handle.options['text_layout'])
