"""Give one transformers DETR-family model instance any vispe positional encoding.

``patch_detr(model, 'rope_mixed')`` makes a transformers ``DetrForObjectDetection`` / ``DetrModel``
(and the Conditional DETR, Deformable DETR, RT-DETR and RT-DETRv2 models) position its image tokens
with a vispe encoding. On that instance only (transformers' classes, modules and registries stay
untouched, so two models of one process can carry different encodings) it replaces:

* ``<model>.position_embedding`` (DETR, Conditional and Deformable DETR): a `DetrPositionTable` that
  returns the encoding's additive embedding of each feature map (zeros for an encoding without
  one; transformers adds it to the inputs of the query and key projections, never to the values);
* the bound ``forward`` of every encoder self-attention (DETR, Conditional DETR) and of every
  decoder cross-attention (DETR): q/k/v projections, then `vispe.pe_attention` with the encoding's
  attention-side hooks, the padding mask and the layer's scale and dropout;
* the bound ``forward`` of every AIFI layer of RT-DETR's hybrid encoder (its only attention over
  image tokens), which runs the AIFI encoder layers with the encoding;
* forward hooks: on the inner model (checks ``pixel_mask``, clears the state of the last forward),
  on each encoder layer (encodings acting between blocks, e.g. PEG) and on RT-DETR's backbone
  (the feature-map padding masks, which RT-DETR itself does not keep).

The encoding itself is registered as ``<model>.vispe_pe`` (its parameters train and save with the
model's ``state_dict``). `DetrPatch.remove` undoes everything: module types, attributes and
``state_dict`` are then those of the unpatched model. The replaced forwards are the handle's methods
bound to this instance's modules (`vispe.integrations.base`): a patched model deep-copies into an
independent patched model and pickles.

Padding. transformers' ``pixel_mask`` is 1 on real pixels and 0 on padding (vispe's
``key_padding_mask`` is the opposite). Its downsampling to the feature map (transformers' own,
nearest) gives each image a top-left rectangle of the canvas; every image is then encoded at the
positions of its own grid (`vispe.positions.pack_padded_grid`: the tokens of the patched attentions
run in the NaFlex layout and come back in canvas order), so an image padded in a batch gets the
positions it gets alone, and padded keys are masked in every attention the patch replaces (the mask
comes from ``pixel_mask``, never from transformers' attention-mask dispatch).

What each family takes:

* **DETR**: any encoding in encoder self-attention; decoder cross-attention by ``cross_pe`` with the
  policy of vispe's own DETR (`vispe.cross_attention.check_cross_pe`): ``'keys'`` (additive part on
  the keys and attention-side hooks with the object queries at the origin), ``'additive'`` (additive
  part on the keys only, DETR's arrangement), ``'none'``; ``'auto'`` is ``'keys'`` unless the encoding
  has a term per query-key pair (iRPE's logit bias, ...), which needs query positions and so stays in
  the encoder; ``'keys'`` refuses such an encoding.
* **Conditional DETR**: any encoding with an additive part in encoder self-attention; its
  cross-attention builds the spatial half of each key from the additive embedding (``k_pos_proj``),
  so an encoding needs an additive part (compose one: ``'detr_sine+rope_mixed'``); ``cross_pe``
  ``'auto'`` / ``'additive'``.
* **Deformable DETR**: multi-scale deformable attention samples values at offsets predicted from the
  query; there is no query-key product for a rotation or a bias to act on, so only additive
  encodings apply (per level; transformers adds its level embedding); ``cross_pe`` ``'auto'``.
* **RT-DETR / RT-DETRv2**: any encoding in the AIFI self-attention (the decoder's cross-attention is
  deformable and sees no image positions); ``cross_pe`` ``'auto'``. transformers' RT-DETR ignores
  ``pixel_mask``; the patched AIFI masks padded keys when one is given. With ``config.eval_size`` set,
  transformers' AIFI drops its position embedding in eval mode (RT-DETR's own code uses a table built
  at that size instead); the patched AIFI always applies the encoding.

The model's own encodings as vispe specs (the patched model then gives the unpatched one's outputs):
DETR and Conditional DETR ``'detr_sine'``; Deformable DETR ``'detr_sine:offset=-0.5'``; RT-DETR
``'sincos:axis_order=grid'``; with ``position_embedding_type='learned'``, ``'detr_learned'`` starts from
the model's own row and column tables.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..attention import pe_attention
from ..contract import PEContext, PositionalEncoding, PreparedPE
from ..cross_attention import CROSS_PE, check_cross_pe
from ..positions import Positions, grid, pack_padded_grid, points
from ..positions.padding import PaddedGrid
from ..extras import SUPPORTED, require
from ..registry import PESpec, create_pe
from .base import ModelPatch, UnsupportedModelError, refuse_patched

__all__ = ['patch_detr', 'DetrPatch', 'DetrPositionTable', 'SUPPORTED_MODEL_TYPES', 'SUPPORTED_TRANSFORMERS',
           'CROSS_PE']

Tensor = torch.Tensor

SUPPORTED_TRANSFORMERS = SUPPORTED['transformers']  # [low, high): what this adapter is written and tested against


@dataclass(frozen=True)
class _Family:
    """What differs between the supported model families."""
    label: str
    encoder: str                   # 'attention' (DETR-style self-attention), 'deformable', 'aifi'
    cross_pe: Tuple[str, ...]      # the cross_pe values the family takes
    needs_additive: bool           # the decoder builds its key positions from the additive embedding
    grid_size: Tuple[int, int]     # default training grid of the encoded feature map
    own: str                       # the vispe spec of the model's own encoding


_FAMILIES = {
    'detr': _Family('DETR', 'attention', CROSS_PE, False, (25, 38), 'detr_sine'),
    'conditional_detr': _Family('Conditional DETR', 'attention', ('auto', 'additive'), True, (25, 38), 'detr_sine'),
    'deformable_detr': _Family('Deformable DETR', 'deformable', ('auto',), False, (25, 38),
                               'detr_sine:offset=-0.5'),
    'rt_detr': _Family('RT-DETR', 'aifi', ('auto',), False, (20, 20), 'sincos:axis_order=grid'),
    'rt_detr_v2': _Family('RT-DETRv2', 'aifi', ('auto',), False, (20, 20), 'sincos:axis_order=grid'),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
_CLASS_SUFFIXES = ('ForObjectDetection', 'Model')


def _parts(model: nn.Module) -> Tuple[nn.Module, str]:
    """(inner model holding backbone / encoder / decoder, model_type)."""
    model_type = getattr(getattr(model, 'config', None), 'model_type', None)
    name = type(model).__name__
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f'patch_detr supports transformers models of type {", ".join(SUPPORTED_MODEL_TYPES)} (their '
            f'*ForObjectDetection and *Model classes), got {name} (model_type={model_type!r})')
    if not name.endswith(_CLASS_SUFFIXES):
        raise UnsupportedModelError(f'patch_detr supports the *ForObjectDetection and *Model classes of {model_type}, got {name}')
    inner = model.model if name.endswith('ForObjectDetection') else model
    family = _FAMILIES[model_type]
    needed = {'attention': ('backbone', 'position_embedding', 'encoder', 'decoder'),
              'deformable': ('backbone', 'position_embedding', 'encoder'),
              'aifi': ('backbone', 'encoder')}[family.encoder]
    for attr in needed:
        if not isinstance(getattr(inner, attr, None), nn.Module):
            raise UnsupportedModelError(
                f'{type(inner).__name__} has no {attr!r} module: not the transformers >= {SUPPORTED_TRANSFORMERS[0]}, '
                f'< {SUPPORTED_TRANSFORMERS[1]} {family.label} layout')
    return inner, model_type


# ----------------------------------------------------------------------------------------- one feature map
class _Canvas:
    """One padded feature map of a forward: canvas grid positions and, with padding, the packed layout.

    Args:
        real: ``(B, h, w)`` bool, True on real tokens (transformers' downsampled ``pixel_mask``), or None.
    """

    def __init__(self, batch: int, h: int, w: int, real: Optional[Tensor], train_grid: Tuple[int, int],
                 device: torch.device) -> None:
        pad = None
        if real is not None:
            if real.shape != (batch, h, w):
                raise ValueError(f'the feature-map mask is {tuple(real.shape)}, expected {(batch, h, w)}')
            pad = ~real.to(torch.bool).flatten(1)
        self.num_tokens = h * w
        self.pos = grid(h, w, train_grid=train_grid, device=device)
        if pad is not None:
            self.pos = self.pos.replace(key_padding_mask=pad)
        try:
            self.packed: Optional[PaddedGrid] = pack_padded_grid(self.pos)
        except ValueError as e:
            raise ValueError(f'{e}. pixel_mask is 1 on real pixels and 0 on padding (transformers\' convention, '
                             f'the opposite of a key_padding_mask); each image must keep at least one real '
                             f'feature-map token') from None
        self.positions: Positions = self.packed.positions if self.packed is not None else self.pos

    def mask(self, packed: bool) -> Optional[Tensor]:
        """Bool ``(B, 1, 1, N)`` (True = attend) of the real keys in packed or canvas order, None without padding."""
        if self.packed is None:  # pack_padded_grid gives None exactly when no token is padding
            return None
        pad = self.positions.key_padding_mask if packed else self.pos.key_padding_mask
        return ~pad[:, None, None, :]

    def embedding(self, encoding: PositionalEncoding, dtype: torch.dtype) -> Tensor:
        """The additive embedding ``(B | 1, N, C)`` in canvas order, each image at its own grid."""
        emb = encoding.embedding(self.positions).to(dtype)
        if self.packed is None:
            return emb
        return self.packed.unpack(emb.expand(self.packed.index.shape[0], -1, -1))

    def between_blocks(self, encoding: PositionalEncoding, x: Tensor, index: int) -> Tensor:
        if self.packed is None:
            return encoding.between_blocks(x, self.pos, index)
        return self.packed.unpack(encoding.between_blocks(self.packed.pack(x), self.positions, index))


@dataclass
class _Plan:
    """How one patched attention runs in this forward: the prepared encoding, the key mask, token order."""
    prepared: Optional[PreparedPE]
    mask: Optional[Tensor]               # bool (B, 1, 1, N), True = attend, in the order the attention uses
    num_tokens: int
    packed: Optional[PaddedGrid] = None  # reorder the canvas tokens into this layout inside the attention

    def order(self, x: Tensor) -> Tensor:
        if x.shape[1] != self.num_tokens:
            raise ValueError(f'the patched attention expected {self.num_tokens} image tokens (the feature map '
                             f'of this forward), got {x.shape[1]}')
        return self.packed.pack(x) if self.packed is not None else x

    def restore(self, x: Tensor) -> Tensor:
        return self.packed.unpack(x) if self.packed is not None else x

    @classmethod
    def on(cls, canvas: _Canvas, prepared: Optional[PreparedPE], packed: bool) -> '_Plan':
        """Canvas-ordered tokens, packed inside the attention when ``packed`` (per-sample positions)."""
        return cls(prepared, canvas.mask(packed), canvas.num_tokens, canvas.packed if packed else None)


def _heads(module: nn.Module, proj: nn.Module, x: Tensor) -> Tensor:
    return proj(x).unflatten(-1, (-1, module.head_dim)).transpose(1, 2)


class DetrPositionTable(nn.Module):
    """The model's ``position_embedding`` under a vispe encoding: ``(shape, device, dtype, mask) -> (B, C, H, W)``.

    ``mask`` is transformers' feature-map mask (True / 1 on real tokens). Each image gets the additive
    embedding of its own grid (zeros for an encoding without one). The encoding is not a submodule here
    (it is registered once, as ``<model>.vispe_pe``).
    """

    def __init__(self, patch: 'DetrPatch') -> None:
        super().__init__()
        self._patch = [patch]  # a list: not a submodule, no reference cycle through _modules

    def forward(self, shape: torch.Size, device: Any, dtype: torch.dtype, mask: Optional[Tensor] = None) -> Tensor:
        patch = self._patch[0]
        b, _, h, w = shape
        canvas = _Canvas(b, h, w, mask, patch.grid_size, torch.device(device))
        patch._on_feature_map(canvas)
        enc = patch.encoding
        if enc.capabilities.additive:
            emb = canvas.embedding(enc, dtype).expand(b, -1, -1)
        else:
            emb = torch.zeros(b, h * w, patch.dim, device=device, dtype=dtype)
        return emb.transpose(1, 2).reshape(b, -1, h, w)


# ----------------------------------------------------------------------------------------- the handle
class DetrPatch(ModelPatch):
    """What `patch_detr` did to one model instance; ``remove()`` (or leaving a ``with`` block) undoes it.

    The feature map of a forward (its grid and padding) is known only once transformers calls the
    position table, whose call carries no keyword arguments to thread it to the attentions: it is held
    on the handle for the length of one forward (set by the table, cleared by a forward hook on the
    inner model that runs also when the forward raises), never between forwards.

    Attributes:
        encoding: the vispe encoding (also ``<model>.vispe_pe``); ``family``: the model family's name;
        cross_pe: the resolved ``cross_pe``; cross_hooks: whether cross-attention runs the encoding's
        attention-side hooks; replaced: ``(owner, attribute)`` of everything replaced, for the record.
    """
    adapter = 'patch_detr'

    def __init__(self, model: nn.Module, inner: nn.Module, family: _Family, encoding: PositionalEncoding,
                 cross_pe: str, cross_hooks: bool, grid_size: Tuple[int, int], dim: int) -> None:
        super().__init__(model)
        self.inner, self.family_spec, self.encoding = inner, family, encoding
        self.family = family.label
        self.cross_pe, self.cross_hooks, self.grid_size, self.dim = cross_pe, cross_hooks, grid_size, dim
        self._clear()

    # ------------------------------------------------------------------ per-forward state
    def _clear(self) -> None:
        self._canvas: Optional[_Canvas] = None
        self._enc: Optional[_Plan] = None
        self._cross: Optional[_Plan] = None
        self._aifi: Optional[_Plan] = None
        self._level_masks: Optional[List[Tensor]] = None

    def _on_feature_map(self, canvas: _Canvas) -> None:
        """A DETR / Conditional DETR feature map for this forward: the encoder's plan."""
        if self.family_spec.encoder != 'attention':
            return  # Deformable DETR: the table is all there is, level by level
        caps = self.encoding.capabilities
        self._canvas = canvas
        prepared = self.encoding.prepare(canvas.positions) if caps.in_attention else None
        self._enc = _Plan.on(canvas, prepared, packed=caps.in_attention)
        self._cross = None

    def _encoder_plan(self) -> _Plan:
        if self._enc is None:
            raise RuntimeError(f'the patched {self.family} encoder ran without a feature map of this forward: call the '
                               f'model with pixel_values (and pixel_mask), not the encoder alone or inputs_embeds')
        return self._enc

    def _cross_plan(self, num_queries: int) -> _Plan:
        self._encoder_plan()
        canvas = self._canvas
        if self._cross is None or (self._cross.prepared is not None and
                                   self._cross.prepared.pos_q.num_tokens != num_queries):
            prepared = None
            if self.cross_hooks:  # object queries have no position: place them at the origin
                zeros = torch.zeros(num_queries, 2, device=canvas.pos.device)
                prepared = self.encoding.prepare(points(zeros), canvas.positions)
            self._cross = _Plan.on(canvas, prepared, packed=self.cross_hooks)
        return self._cross

    def _aifi_plan(self) -> _Plan:
        if self._aifi is None:
            raise RuntimeError('the patched RT-DETR AIFI attention ran outside an AIFI layer forward')
        return self._aifi

    # ------------------------------------------------------------------ hooks
    def _check_inputs(self, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """Forward pre-hook of the inner model: a clear error for bad masks, and a fresh state."""
        self._clear()
        pixel_values = args[0] if args else kwargs.get('pixel_values')
        pixel_mask = args[1] if len(args) > 1 else kwargs.get('pixel_mask')
        if kwargs.get('inputs_embeds') is not None and self.family_spec.encoder != 'aifi':
            raise ValueError(f'the patched {self.family} takes pixel_values, not inputs_embeds: the positions come '
                             f'from the backbone feature map and pixel_mask')
        if pixel_mask is None:
            return
        if not torch.is_tensor(pixel_mask) or pixel_mask.is_floating_point() or pixel_mask.is_complex():
            got = pixel_mask.dtype if torch.is_tensor(pixel_mask) else type(pixel_mask).__name__
            raise ValueError(f'pixel_mask must be a bool or integer tensor (1 on real pixels, 0 on padding), got {got}')
        if torch.is_tensor(pixel_values):
            want = (pixel_values.shape[0], *pixel_values.shape[-2:])
            if tuple(pixel_mask.shape) != want:
                raise ValueError(f'pixel_mask must be (batch, height, width) = {want} like pixel_values '
                                 f'{tuple(pixel_values.shape)}, got {tuple(pixel_mask.shape)}')
        if pixel_mask.dtype != torch.bool and not bool(((pixel_mask == 0) | (pixel_mask == 1)).all()):
            raise ValueError('pixel_mask must hold only 0 (padding) and 1 (real pixels)')
        empty = (~pixel_mask.flatten(1).bool().any(1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f'images {empty} of the batch are all padding (pixel_mask is 0 everywhere); every image '
                             f"needs real pixels. pixel_mask is 1 on real pixels and 0 on padding (transformers' "
                             f'convention, the opposite of a key_padding_mask)')

    def _keep_level_masks(self, module: nn.Module, args: Any, out: Any) -> None:
        """Forward hook of RT-DETR's backbone: the feature-map masks it computes and drops."""
        self._level_masks = [mask for _, mask in out]

    def _between_blocks(self, index: int, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        """Forward hook of encoder layer ``index``: encodings acting between blocks (PEG)."""
        self._encoder_plan()
        return self._canvas.between_blocks(self.encoding, out, index)

    def _end_forward(self, module: nn.Module, args: Any, out: Any) -> None:
        """Forward hook of the inner model (also on error): nothing of this forward stays on the handle."""
        self._clear()

    def _attention(self, module: nn.Module, layer: int, plan_of: str, additive: bool, hidden_states: Tensor,
                   attention_mask: Optional[Tensor] = None, position_embeddings: Optional[Tensor] = None,
                   **kwargs: Any) -> Tuple[Tensor, None]:
        """The forward of a DETR / RT-DETR self-attention over image tokens (``module``): its q/k/v projections,
        then `vispe.pe_attention` with the plan ``plan_of`` (``'encoder'`` or ``'aifi'``); ``additive``: the
        encoding has an additive part (else ``position_embeddings`` are the table's zeros, not added)."""
        p = self._encoder_plan() if plan_of == 'encoder' else self._aifi_plan()
        add = additive and position_embeddings is not None
        qk_in = hidden_states + position_embeddings if add else hidden_states
        x, qk_in = p.order(hidden_states), p.order(qk_in)
        q, k, v = (_heads(module, module.q_proj, qk_in), _heads(module, module.k_proj, qk_in),
                   _heads(module, module.v_proj, x))
        o = pe_attention(q, k, v, p.prepared, layer, x=x, attn_mask=p.mask, scale=module.scaling,
                         dropout_p=module.attention_dropout if module.training else 0.0)
        return module.o_proj(p.restore(o.transpose(1, 2).flatten(2))), None

    def _cross_attention(self, module: nn.Module, layer: int, keys_additive: bool, hidden_states: Tensor,
                         key_value_states: Tensor, attention_mask: Optional[Tensor] = None,
                         position_embeddings: Optional[Tensor] = None,
                         encoder_position_embeddings: Optional[Tensor] = None, **kwargs: Any) -> Tuple[Tensor, None]:
        """The forward of DETR's decoder cross-attention ``module`` (object queries to image tokens)."""
        p = self._cross_plan(hidden_states.shape[1])
        q_in = hidden_states if position_embeddings is None else hidden_states + position_embeddings
        kv = p.order(key_value_states)
        k_in = kv + p.order(encoder_position_embeddings) if keys_additive and encoder_position_embeddings is not None \
            else kv
        q, k, v = (_heads(module, module.q_proj, q_in), _heads(module, module.k_proj, k_in),
                   _heads(module, module.v_proj, kv))
        o = pe_attention(q, k, v, p.prepared, layer, x=hidden_states, attn_mask=p.mask, scale=module.scaling,
                         dropout_p=module.attention_dropout if module.training else 0.0)
        return module.o_proj(o.transpose(1, 2).flatten(2)), None

    def _aifi_forward(self, aifi: nn.Module, level: int, offset: int, hidden_states: Tensor, **kwargs: Any) -> Tensor:
        """The forward of an RT-DETR AIFI layer ``aifi`` (feature ``level``; its first attention layer is
        ``offset``): its encoder layers under the encoding."""
        b, c, h, w = hidden_states.shape
        masks = self._level_masks
        real = masks[level] if masks is not None and level < len(masks) else None
        if real is not None and tuple(real.shape) != (b, h, w):
            raise ValueError(f'RT-DETR feature level {level} is {(h, w)} but its mask is {tuple(real.shape[1:])}')
        canvas = _Canvas(b, h, w, real, self.grid_size, hidden_states.device)
        enc, caps = self.encoding, self.encoding.capabilities
        x = hidden_states.flatten(2).transpose(1, 2)
        packed = canvas.packed is not None
        if packed:
            x = canvas.packed.pack(x)
        emb = enc.embedding(canvas.positions).to(x.dtype) if caps.additive else None
        prepared = enc.prepare(canvas.positions) if caps.in_attention else None
        # the tokens are packed here once, so the attentions take them in the order they come
        self._aifi = _Plan(prepared, canvas.mask(packed=True), canvas.num_tokens)
        try:
            for j, layer in enumerate(aifi.layers):
                x = layer(x, attention_mask=self._aifi.mask, spatial_position_embeddings=emb, **kwargs)
                if caps.between_blocks:
                    x = enc.between_blocks(x, canvas.positions, offset + j)
        finally:
            self._aifi = None
        if packed:
            x = canvas.packed.unpack(x)
        return x.transpose(1, 2).reshape(b, c, h, w).contiguous()

    # ------------------------------------------------------------------ install / remove
    def _install(self) -> None:
        inner, fam, caps = self.inner, self.family_spec, self.encoding.capabilities
        partial = functools.partial  # forwards and hooks: the handle's methods, never closures (copies, pickles)
        self.set(inner, 'vispe_pe', self.encoding)
        self.add_hook(inner, self._check_inputs, 'forward_pre', with_kwargs=True)
        self.add_hook(inner, self._end_forward, always_call=True)
        if fam.encoder in ('attention', 'deformable'):
            self.set(inner, 'position_embedding', DetrPositionTable(self))
        if fam.encoder == 'attention':
            for i, layer in enumerate(inner.encoder.layers):
                attn = layer.self_attn
                self.set(attn, 'forward', partial(self._attention, attn, i, 'encoder', caps.additive),
                         f'encoder.layers.{i}.self_attn')
                if caps.between_blocks:
                    self.add_hook(layer, partial(self._between_blocks, i), label=f'encoder.layers.{i}')
        if fam.label == 'DETR':
            offset = len(inner.encoder.layers)
            keys_additive = caps.additive and self.cross_pe in ('keys', 'additive')
            for i, layer in enumerate(inner.decoder.layers):
                attn = layer.encoder_attn
                self.set(attn, 'forward', partial(self._cross_attention, attn, offset + i, keys_additive),
                         f'decoder.layers.{i}.encoder_attn')
        if fam.encoder == 'aifi':
            self.add_hook(inner.backbone, self._keep_level_masks)
            offset = 0
            for j, (aifi, level) in enumerate(zip(inner.encoder.aifi, inner.encoder.encode_proj_layers)):
                self.set(aifi, 'forward', partial(self._aifi_forward, aifi, level, offset), f'encoder.aifi.{j}')
                for i, layer in enumerate(aifi.layers):
                    attn = layer.self_attn
                    self.set(attn, 'forward', partial(self._attention, attn, offset + i, 'aifi', caps.additive),
                             f'encoder.aifi.{j}.layers.{i}.self_attn')
                offset += len(aifi.layers)
        self.activate()

    def remove(self) -> None:
        """Restore the instance: the original modules and attributes, no hooks, no ``vispe_pe``."""
        super().remove()
        self._clear()

    def __repr__(self) -> str:
        return (f'DetrPatch({type(self.model).__name__}, encoding={self.encoding.name!r}, cross_pe={self.cross_pe!r}, '
                f'active={self._active}, replaced={len(self.replaced)})')


# ----------------------------------------------------------------------------------------- entry point
_DEFORMABLE_WHY = ('its encoder attention is multi-scale deformable attention: each query samples values at '
                   'offsets predicted from its own features, with no query-key product for a rotation, a bias or a '
                   'value / output map to act on, so only additive encodings apply (e.g. detr_sine, learned, '
                   'sincos, fourier); the self-attention of DETR and Conditional DETR encoders and RT-DETR\'s AIFI '
                   'take any encoding')
_CROSS_WHY = {
    'Conditional DETR': 'its cross-attention builds the spatial half of each key from the additive embedding '
                        "(k_pos_proj), so cross_pe is 'auto' or 'additive'",
    'Deformable DETR': 'its decoder cross-attention is deformable (sampling around reference points) and sees no '
                       "image-token positions, so cross_pe is 'auto'",
    'RT-DETR': 'its decoder cross-attention is deformable and sees no image-token positions, so cross_pe is '
               "'auto' (the encoding acts in the AIFI self-attention)",
    'RT-DETRv2': 'its decoder cross-attention is deformable and sees no image-token positions, so cross_pe is '
                 "'auto' (the encoding acts in the AIFI self-attention)",
}


def _host(inner: nn.Module, family: _Family, config: Any) -> Tuple[int, int, int, int]:
    """(token width, encoder heads, encoder attention layers, decoder heads) of the attentions patched."""
    if family.encoder == 'aifi':
        layers = [layer for aifi in inner.encoder.aifi for layer in aifi.layers]
        if not layers:
            raise ValueError(f'this {family.label} has no AIFI encoder layers (config.encoder_layers=0): nothing '
                             f'takes an encoding')
        attn = layers[0].self_attn
        return config.encoder_hidden_dim, attn.q_proj.out_features // attn.head_dim, len(layers), 0
    return config.d_model, config.encoder_attention_heads, config.encoder_layers, config.decoder_attention_heads


def _start_from_learned_table(inner: nn.Module, encoding: PositionalEncoding) -> None:
    """``detr_learned`` on a model built with learned position embeddings starts from the model's tables."""
    own = inner.position_embedding
    row, col = getattr(own, 'row_embeddings', None), getattr(own, 'column_embeddings', None)
    if (getattr(encoding, 'name', None) == 'detr_learned' and isinstance(row, nn.Embedding)
            and row.weight.shape == encoding.row_embed.weight.shape
            and col.weight.shape == encoding.col_embed.weight.shape):
        with torch.no_grad():
            encoding.row_embed.weight.copy_(row.weight)
            encoding.col_embed.weight.copy_(col.weight)


def patch_detr(model: nn.Module, pe: Optional[PESpec] = 'rope_mixed', *, cross_pe: str = 'auto',
               grid_size: Optional[Tuple[int, int]] = None, **options: Any) -> DetrPatch:
    """Make one transformers DETR-family model instance use a vispe encoding; returns the `DetrPatch`.

    Args:
        model: a transformers ``Detr*``, ``ConditionalDetr*``, ``DeformableDetr*``, ``RTDetr*`` or
            ``RTDetrV2*`` model (``ForObjectDetection`` or ``Model``).
        pe: any vispe encoding spec (``'rope_mixed'``, ``'irpe'``, ``'detr_sine+rope_mixed'``, ...); None:
            the model's own, computed by vispe: ``'detr_sine'`` (DETR, Conditional DETR; ``'detr_learned'``
            from the model's tables for ``position_embedding_type='learned'``), ``'detr_sine:offset=-0.5'``
            (Deformable DETR), ``'sincos:axis_order=grid'`` (RT-DETR).
        cross_pe: DETR's decoder cross-attention: ``'auto'``, ``'keys'``, ``'additive'`` or ``'none'``
            (module docstring); the other families take what their decoder allows.
        grid_size: the training grid ``(h, w)`` of the encoded feature map, for encodings that rescale
            or resample to it (default ``(25, 38)``, RT-DETR ``(20, 20)``).
        options: options of the encoding (override the spec's).

    Raises:
        vispe.integrations.UnsupportedModelError: unsupported model class (a TypeError).
        vispe.extras.UnsupportedVersionError: unsupported transformers version (an ImportError).
        vispe.integrations.AlreadyPatchedError: the model, a module inside it or a model holding it is
            already patched (a RuntimeError).
        ValueError: an encoding or ``cross_pe`` the model family cannot take (the error says why).
    """
    require('transformers', 'patch_detr')
    inner, model_type = _parts(model)
    refuse_patched(model, 'patch_detr')
    family = _FAMILIES[model_type]
    learned = family.encoder != 'aifi' and getattr(model.config, 'position_embedding_type', None) == 'learned'
    if pe is None:
        pe = 'detr_learned' if learned else family.own
    if not isinstance(cross_pe, str) or cross_pe not in CROSS_PE:
        raise ValueError(f'cross_pe must be one of {CROSS_PE}, got {cross_pe!r}')
    if cross_pe not in family.cross_pe:
        raise ValueError(f'cross_pe={cross_pe!r} does not apply to {family.label}: {_CROSS_WHY[family.label]}')
    if grid_size is None:
        grid_size = family.grid_size
    elif not isinstance(grid_size, (tuple, list)) or len(grid_size) != 2 or not all(
            isinstance(g, int) and not isinstance(g, bool) and g > 0 for g in grid_size):
        raise ValueError(f'grid_size must be two positive integers (h, w), got {grid_size!r}')
    grid_size = tuple(grid_size)
    dim, heads, enc_depth, dec_heads = _host(inner, family, model.config)
    ctx = PEContext(dim=dim, num_heads=heads, depth=enc_depth, grid_size=grid_size)
    caps = create_pe(pe, ctx, device='meta', **options).capabilities
    if caps.requires:
        raise ValueError(f'encoding {pe!r} reads {sorted(caps.requires)} from its positions, which a detection '
                         f'feature map does not have')
    if family.encoder == 'deformable' and (caps.in_attention or caps.between_blocks or not caps.additive):
        raise ValueError(f'{family.label} cannot take encoding {pe!r} (hooks {sorted(caps.hooks)}): {_DEFORMABLE_WHY}')
    if family.needs_additive and not caps.additive:
        raise ValueError(f"{family.label} cannot take encoding {pe!r} alone: {_CROSS_WHY[family.label]}; compose "
                         f"an additive encoding with it, e.g. 'detr_sine+{pe}'" if isinstance(pe, str) else
                         f'{family.label} needs an encoding with an additive part: {_CROSS_WHY[family.label]}')
    if family.label == 'DETR':  # the policy vispe's own DETR follows
        cross_pe = check_cross_pe(caps, cross_pe, encoding=pe if isinstance(pe, str) else None)
    elif cross_pe == 'auto':
        cross_pe = 'additive' if family.needs_additive else 'none'
    cross_hooks = cross_pe == 'keys' and caps.in_attention
    if cross_hooks and dec_heads != heads:
        raise ValueError(f"cross_pe='keys' runs the encoding's attention hooks in cross-attention, which has "
                         f'{dec_heads} heads against the encoder\'s {heads}: use cross_pe=\'additive\' or \'none\'')
    depth = enc_depth + len(inner.decoder.layers) if cross_hooks else enc_depth
    device = next(iter(model.parameters())).device
    encoding = create_pe(pe, ctx, depth=depth, device=device, **options)
    encoding.train(model.training)  # registered into a model that may already be in eval mode
    if learned:
        _start_from_learned_table(inner, encoding)
    handle = DetrPatch(model, inner, family, encoding, cross_pe, cross_hooks, grid_size, dim)
    handle._install()
    return handle
