"""Give one transformers Qwen-VL model instance any multimodal encoding of vispe (its ids and its rotary).

``patch_vlm(model, 'videorope:delta=2')`` makes a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model
(``*ForConditionalGeneration`` or the bare ``*Model``; a PEFT wrapper is looked through) compute its
position ids and rotary embeddings with a multimodal encoding (`vispe.encodings.multimodal`: ``mrope``,
``mrope_interleave``, ``mhrope``, ``vrope``, ``v2pe``, ``videorope``, ``hope``, ``circlerope``,
``rope_1d``), for forward passes with or without explicit ``position_ids``, training, and ``generate``
(prefill, then cached decoding through ``rope_deltas``). ``None`` is the model's own encoding computed
by vispe (bit for bit the unpatched outputs). It changes, on that instance only (transformers' classes
and module functions stay untouched, so two models of one process can carry different encodings):

* ``<model>.get_rope_index`` and ``<model>.compute_3d_position_ids`` (instance attributes shadowing the
  methods): the encoding's ids from the token ids (`rope_index`), ``rope_deltas`` in transformers'
  convention (next position minus the number of real tokens). The copy of ``compute_3d_position_ids``
  keeps transformers' branches, and its refusal of multimodal inputs without ``mm_token_type_ids``
  (tests/test_vlm_adapter.py compares it with the installed library's on every branch);
* ``<language_model>.rotary_emb``: a `VLMRotary` with transformers' ``(x, position_ids) -> (cos, sin)``
  signature, whose cos/sin the model's own ``apply_rotary_pos_emb`` applies;
* a forward pre-hook on ``<language_model>`` that gives an encoding with other than 3 id axes its ids
  in the ``[text; axes]`` form below where transformers would build or expand 1D text positions itself;
* for ``mhrope`` only (whole heads per axis, which one cos/sin table for q and k cannot express): the
  rotary module returns an identity cos/sin carrying the head-wise tables (`HeadwiseEmbeddings`); a
  forward pre-hook on each attention reads them from its ``position_embeddings`` argument and forward
  hooks on its ``q_proj`` / ``k_proj`` (Qwen2-VL, Qwen2.5-VL) or ``q_norm`` / ``k_norm`` (Qwen3-VL) rotate
  q and k head-wise with them. transformers calls the projections with the hidden states alone, so the
  tables travel from the attention's call to its projections' through a context variable that holds
  them for the duration of that one attention call (set by the pre-hook, cleared by a forward hook that
  runs also when the call raises); nothing of a forward is kept on the model or the handle.

Ids that travel through transformers' ``position_ids``: an encoding with 3 axes uses transformers' own
``(3, B, L)`` (or ``[text; t; h; w]`` in ``generate``); one with another number of axes ``A`` (VRoPE 4,
V2PE and 1D RoPE 1) travels as ``(A + 1, B, L)`` = ``[text; axes]``, so VRoPE's 4 rows never meet
transformers' rule that a 4-row ``position_ids`` is ``[text; t; h; w]``. `VLMPatch.position_ids` builds
them for explicit ``position_ids=``.

MHRoPE with fewer key/value heads than axes: heads are assigned at key/value-head granularity (a query
head uses its key/value head's axis, or q and k would rotate by different positions), so a model with
fewer than 3 key/value heads needs ``head_sections`` (``'mhrope:head_sections=0|1|1'``) summing to at
most its key/value heads (an axis given 0 heads is not encoded); without it `patch_vlm` raises and says so.
"""
from __future__ import annotations

import contextvars
import functools
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..contract import PEContext
from ..encodings.multimodal import MULTIMODAL_FAMILY, MultimodalRoPE, rotary_table
from ..extras import SUPPORTED, require
from ..options import short_repr
from ..registry import PESpec, create_pe, list_pes, parse_pe_spec, pe_info
from ..rotary import apply_pair_rotation
from ._qwen_ids import QWEN2_VL_TOKEN_IDS, RULES, rope_index, token_positions
from .base import ModelPatch, UnsupportedModelError, refuse_patched

__all__ = ['patch_vlm', 'VLMPatch', 'VLMRotary', 'HeadwiseEmbeddings', 'rope_index', 'token_positions',
           'QWEN2_VL_TOKEN_IDS', 'RULES', 'SUPPORTED_MODEL_TYPES', 'SUPPORTED_TRANSFORMERS']

_logger = logging.getLogger(__name__)
Tensor = torch.Tensor

SUPPORTED_TRANSFORMERS = SUPPORTED['transformers']  # [low, high): what this adapter is written and tested against


@dataclass(frozen=True)
class _Family:
    """What differs between the supported model families."""
    label: str                 # the family's name, for messages and `VLMPatch.family`
    encoding: str              # the model's own encoding
    video_blocks: str          # how the processor lays a video out in the token ids
    timed: bool                # Qwen2.5-VL: video time ids from tokens_per_second * second_per_grid_ts
    needs_types: bool          # compute_3d_position_ids raises on multimodal inputs without mm_token_type_ids
    # (Qwen2.5-VL's instead leaves the positions to the language model's 1D default)


_FAMILIES = {
    'qwen2_vl': _Family('Qwen2-VL', 'mrope', 'video', timed=False, needs_types=True),
    'qwen2_5_vl': _Family('Qwen2.5-VL', 'mrope', 'video', timed=True, needs_types=False),
    'qwen3_vl': _Family('Qwen3-VL', 'mrope_interleave', 'frame', timed=False, needs_types=True),
    'qwen3_vl_moe': _Family('Qwen3-VL-MoE', 'mrope_interleave', 'frame', timed=False, needs_types=True),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
_REFUSED = {
    'qwen2_5_omni': 'its thinker interleaves audio positions with the visual ones in get_rope_index',
    'qwen3_omni_moe': 'its thinker interleaves audio positions with the visual ones in get_rope_index',
}
_OLD_NAMES = {'rope': 'rope_1d'}  # scheme names of vispe.multimodal that are encodings under another name

# The head-wise tables of the attention call in progress (MHRoPE): set by the attention's pre-hook from its
# position_embeddings argument, read by its q / k projection hooks, cleared when the call ends.
_HEADWISE: contextvars.ContextVar[Optional[Tuple[Tensor, Tensor]]] = contextvars.ContextVar('vispe_headwise',
                                                                                            default=None)


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside a wrapper that exposes it through ``get_base_model()`` (PEFT's
    ``PeftModel``), else ``model``."""
    get_base = getattr(type(model), 'get_base_model', None)
    if callable(get_base):
        base = model.get_base_model()
        if isinstance(base, nn.Module) and base is not model:
            _logger.info('patch_vlm: patching %s inside %s', type(base).__name__, type(model).__name__)
            return _unwrap(base)
    return model


def _parts(model: nn.Module) -> Tuple[nn.Module, str]:
    """(inner model with get_rope_index, model_type)."""
    config = getattr(model, 'config', None)
    model_type = getattr(config, 'model_type', None)
    if model_type in _REFUSED or 'Omni' in type(model).__name__:
        why = _REFUSED.get(model_type, 'its get_rope_index is not the Qwen-VL one')
        raise UnsupportedModelError(f'patch_vlm does not support {type(model).__name__}: {why}. Supported model types: '
                                    f'{", ".join(SUPPORTED_MODEL_TYPES)} (their *ForConditionalGeneration and *Model '
                                    'classes)')
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(f'patch_vlm supports transformers models of type '
                                    f'{", ".join(SUPPORTED_MODEL_TYPES)} '
                                    f'(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; *ForConditionalGeneration or '
                                    f'*Model), got {type(model).__name__} (model_type={model_type!r})')
    inner = model.model if isinstance(getattr(model, 'model', None), nn.Module) and hasattr(
        model.model, 'get_rope_index') else model
    for attr in ('get_rope_index', 'compute_3d_position_ids', 'language_model', 'rope_deltas'):
        if not hasattr(inner, attr):
            raise UnsupportedModelError(
                f'{type(inner).__name__} has no {attr!r}: not the transformers >= {SUPPORTED_TRANSFORMERS[0]}, '
                f'< {SUPPORTED_TRANSFORMERS[1]} Qwen-VL layout (patch_vlm takes the *ForConditionalGeneration or '
                'the *Model itself, or a wrapper with get_base_model())')
    if not isinstance(getattr(inner.language_model, 'rotary_emb', None), nn.Module):
        raise UnsupportedModelError(f'{type(inner.language_model).__name__} has no rotary_emb module')
    return inner, model_type


class HeadwiseEmbeddings(tuple):
    """What `VLMRotary` returns for a head-wise encoding (``mhrope``): ``(cos, sin)`` of the identity, which
    the model's ``apply_rotary_pos_emb`` applies unchanged, carrying the head-wise tables ``heads`` =
    ``(cos, sin)`` of shape ``(B, H_kv, N, rotary_dim)`` to the attention's hooks."""
    heads: Tuple[Tensor, Tensor]

    def __new__(cls, identity: Tuple[Tensor, Tensor], heads: Tuple[Tensor, Tensor]) -> 'HeadwiseEmbeddings':
        self = super().__new__(cls, identity)
        self.heads = heads
        return self

    def __reduce__(self):
        return HeadwiseEmbeddings, (tuple(self), self.heads)


class VLMRotary(nn.Module):
    """The language model's rotary module under a multimodal encoding: ``(x, position_ids) -> (cos, sin)``.

    ``position_ids``: ``(A, B, N)`` for a 3-axis encoding, ``(A + 1, B, N)`` = ``[text; axes]`` otherwise, or
    ``(1, B, N)`` (the same id on every axis). A head-wise encoding (``mhrope``) returns `HeadwiseEmbeddings`.

    Attributes:
        encoding: the `vispe.encodings.multimodal.MultimodalRoPE`.
    """

    def __init__(self, encoding: MultimodalRoPE) -> None:
        super().__init__()
        self.encoding = encoding

    def axes_ids(self, position_ids: Tensor) -> Tensor:
        """The encoding's ``(A, B, N)`` ids from what transformers passes."""
        A = self.encoding.num_axes
        ids = position_ids[None] if position_ids.dim() == 2 else position_ids
        if ids.dim() != 3:
            raise ValueError(f'position_ids must be (B, N) or (rows, B, N), got shape {tuple(position_ids.shape)}')
        rows = ids.shape[0]
        if rows == A:
            return ids
        if A != 3 and rows == A + 1:
            return ids[1:]
        if rows == 1:
            return ids.expand(A, -1, -1)
        extra = (' transformers reads a 4-row position_ids as [text; t; h; w] and drops row 0: give '
                 f'{A + 1} rows [text; axes], as VLMPatch.position_ids returns them.' if A == 4 else '')
        raise ValueError(f'encoding {self.encoding.name!r} takes position_ids with {A} axes '
                         f'({A if A == 3 else A + 1} rows{"" if A == 3 else " [text; axes]"}), got '
                         f'{rows} rows.{extra}')

    def forward(self, x: Tensor, position_ids: Tensor) -> Tuple[Tensor, Tensor]:
        ids = self.axes_ids(position_ids)
        cos, sin = self.encoding.cos_sin(ids)
        if self.encoding.head_layout is not None:
            one = torch.ones((*ids.shape[1:], self.encoding.ctx.head_dim), dtype=x.dtype, device=x.device)
            return HeadwiseEmbeddings((one, torch.zeros_like(one)), (cos, sin))
        return cos.to(x.dtype), sin.to(x.dtype)


def _rotate_heads(head_dim: int, module: nn.Module, args: Any, out: Tensor) -> Tensor:
    """A forward hook (``head_dim`` bound with `functools.partial`) rotating a q or k projection output
    head-wise by the tables of the attention call in progress."""
    heads = _HEADWISE.get()
    if heads is None:
        raise RuntimeError('a q / k projection of an mhrope-patched attention ran outside its attention call, or the '
                           'attention got no head-wise position_embeddings from the patched rotary module')
    cos, sin = heads
    x = out if out.dim() == 4 else out.unflatten(-1, (-1, head_dim))  # (B, N, H, hd)
    y = apply_pair_rotation(x, rotary_table(cos, sin, x, unsqueeze_dim=2), 'half')
    return y if out.dim() == 4 else y.flatten(-2)


def _open_heads(module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> None:
    """Forward pre-hook of an mhrope-patched attention: its head-wise tables, for its projections' hooks."""
    # by keyword in every supported family's decoder layer; where the argument sits positionally differs by family
    emb = next((a for a in (kwargs.get('position_embeddings'), *args) if isinstance(a, HeadwiseEmbeddings)), None)
    _HEADWISE.set(None if emb is None else emb.heads)


def _close_heads(module: nn.Module, args: Any, out: Any) -> None:
    _HEADWISE.set(None)


class VLMPatch(ModelPatch):
    """What `patch_vlm` did to one model instance; ``remove()`` (or leaving a ``with`` block) undoes it.

    Attributes:
        encoding: the `vispe.encodings.multimodal.MultimodalRoPE` in use; ``rotary``: the `VLMRotary` installed.
        family: the model family's name (``'Qwen2.5-VL'``); ``rule``: ``'5.x'`` or ``'4.x'``.
        vision: the `vispe.integrations.VisionPatch` of the vision tower when ``vision_pe`` was given (one
            handle for the whole model: removing this one removes both), else None.
        replaced: ``(owner, attribute name)`` of everything replaced, for the record.
    """
    adapter = 'patch_vlm'
    vision: Optional['ModelPatch'] = None

    def __init__(self, model: nn.Module, inner: nn.Module, family: _Family, encoding: MultimodalRoPE,
                 rotary: VLMRotary, rule: str) -> None:
        super().__init__(model)
        self.inner, self.family_spec, self.encoding, self.rotary, self.rule = inner, family, encoding, rotary, rule
        self.family = family.label
        cfg = inner.config
        self._tokens = dict(image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                            vision_start_token_id=cfg.vision_start_token_id,
                            spatial_merge_size=cfg.vision_config.spatial_merge_size)

    @property
    def scheme(self) -> MultimodalRoPE:
        """Deprecated name of `encoding`."""
        warnings.warn('VLMPatch.scheme is deprecated: use VLMPatch.encoding', DeprecationWarning, stacklevel=2)
        return self.encoding

    @property
    def rows(self) -> int:
        """Rows of the ids as they travel through transformers' ``position_ids`` (module docstring)."""
        A = self.encoding.num_axes
        return A if A == 3 else A + 1

    # ------------------------------------------------------------------ ids
    def rope_index(self, input_ids: Tensor, mm_token_type_ids: Optional[Tensor] = None,
                   image_grid_thw: Optional[Tensor] = None, video_grid_thw: Optional[Tensor] = None,
                   attention_mask: Optional[Tensor] = None, second_per_grid_ts: Optional[Tensor] = None,
                   **_: Any) -> Tuple[Tensor, Tensor]:
        """``get_rope_index`` under the encoding: ids ``(A, B, L)`` and ``rope_deltas`` ``(B, 1)``.

        ``rope_deltas`` follow transformers 5.x: next position minus the number of real tokens (what
        its decoding adds to ``cumsum(attention_mask) - 1``), whatever ``rule`` built the ids.
        """
        ids, delta = rope_index(
            self.encoding, input_ids, rule=self.rule, video_blocks=self.family_spec.video_blocks,
            training=self.model.training, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts if self.family_spec.timed else None, attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids, **self._tokens)
        if self.rule == '4.x':  # 4.x deltas count from the padded length
            L = input_ids.shape[1]
            real = attention_mask.sum(1, keepdim=True) if attention_mask is not None else L
            delta = delta + L - real
        if not ids.is_floating_point():
            ids = ids.to(input_ids.dtype)
        return ids, delta

    def _transport(self, ids: Tensor, text: Tensor) -> Tensor:
        """Ids as they travel through transformers' ``position_ids`` (module docstring)."""
        if ids.shape[0] == 3:
            return ids
        return torch.cat([text[None].to(ids.dtype), ids])

    def position_ids(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, **kwargs: Any) -> Tensor:
        """Explicit ``position_ids=`` for a forward of the patched model (grids etc. as keywords)."""
        ids, _ = self.rope_index(input_ids, attention_mask=attention_mask, **kwargs)
        return self._transport(ids, self._text_positions(input_ids, attention_mask))

    @staticmethod
    def _text_positions(input_ids: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
        if attention_mask is None:
            return torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    def compute_3d_position_ids(self, input_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None,
                                image_grid_thw: Optional[Tensor] = None, video_grid_thw: Optional[Tensor] = None,
                                attention_mask: Optional[Tensor] = None, cache: Any = None,
                                second_per_grid_ts: Optional[Tensor] = None, mm_token_type_ids: Optional[Tensor] = None,
                                **kwargs: Any) -> Optional[Tensor]:
        """The model's ``compute_3d_position_ids`` with vispe's ids: transformers' branches and refusals (a
        copy of transformers 5.25's; tests/test_vlm_adapter.py checks it against the installed one)."""
        cache = kwargs.get('past_key_values', cache)
        cache_length = 0 if cache is None else cache.get_seq_length()
        inner = self.inner
        multimodal = image_grid_thw is not None or video_grid_thw is not None
        if multimodal and mm_token_type_ids is None and input_ids is not None and self.family_spec.needs_types:
            raise ValueError(
                'Multimodal data was passed (via `image_grid_thw` or `video_grid_thw`) but `mm_token_type_ids` is '
                'missing. Please pass `mm_token_type_ids` to the model so that multimodal RoPE (M-RoPE) can be '
                'computed correctly. `mm_token_type_ids` is returned by the processor alongside `input_ids`.')
        can_compute = input_ids is not None and mm_token_type_ids is not None and multimodal
        if can_compute and (inner.rope_deltas is None or cache_length == 0):
            ids, delta = self.rope_index(input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw,
                                         attention_mask, second_per_grid_ts)
            inner.rope_deltas = delta
            return self._transport(ids, self._text_positions(input_ids, attention_mask))
        if inner.rope_deltas is not None and (cache_length > 0 or input_ids is None):
            B, n = inputs_embeds.shape[:2]
            if attention_mask is not None:
                pos = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
            else:
                pos = torch.arange(cache_length, cache_length + n, device=inputs_embeds.device).expand(B, -1)
            delta = inner.rope_deltas.repeat_interleave(B // inner.rope_deltas.shape[0], dim=0)
            pos = pos.to(inputs_embeds.device) + delta.to(inputs_embeds.device)
            return pos[None].expand(self.rows, -1, -1)
        return None

    def language_positions(self, module: nn.Module, args: Any, kwargs: Dict[str, Any]) -> Optional[Tuple]:
        """Forward pre-hook of the language model, for an encoding with other than 3 id axes: 1D text
        positions (none given, or ``(B, N)``), which transformers would expand to 3 rows, become the
        ``[text; axes]`` rows of the same positions."""
        pos = kwargs.get('position_ids')
        if pos is not None and pos.dim() != 2:
            return None
        if pos is None:
            embeds = kwargs.get('inputs_embeds')
            tokens = embeds if embeds is not None else kwargs.get('input_ids')
            if tokens is None:
                return None
            cache = kwargs.get('cache', kwargs.get('past_key_values'))
            past = cache.get_seq_length() if cache is not None else 0
            pos = (torch.arange(tokens.shape[1], device=tokens.device) + past).expand(tokens.shape[0], -1)
        kwargs['position_ids'] = pos[None].expand(self.rows, -1, -1)
        return args, kwargs

    # ------------------------------------------------------------------ install / remove
    def _install(self, attn_modules: List[Tuple[str, nn.Module]]) -> None:
        inner = self.inner
        self._saved_rope_deltas = inner.rope_deltas
        self.set(inner, 'get_rope_index', self.rope_index)
        self.set(inner, 'compute_3d_position_ids', self.compute_3d_position_ids)
        self.set(inner.language_model, 'rotary_emb', self.rotary)
        if self.encoding.num_axes != 3:
            self.add_hook(inner.language_model, self.language_positions, 'forward_pre', with_kwargs=True,
                          label='language_model')
        if self.encoding.head_layout is not None:
            hook = functools.partial(_rotate_heads, self.encoding.ctx.head_dim)
            for name, attn in attn_modules:
                self.add_hook(attn, _open_heads, 'forward_pre', with_kwargs=True, label=name)
                self.add_hook(attn, _close_heads, always_call=True, label=name)
                q, k = ('q_norm', 'k_norm') if hasattr(attn, 'q_norm') else ('q_proj', 'k_proj')
                for part in (q, k):
                    self.add_hook(getattr(attn, part), hook, label=f'{name}.{part}')
        self.activate()

    def remove(self) -> None:
        """Restore the instance: the original attributes and modules, no hooks, the old ``rope_deltas``, and
        the vision tower's own encoding where ``vision_pe`` replaced it."""
        if self.active:
            self.inner.rope_deltas = self._saved_rope_deltas
        if self.vision is not None:
            self.vision.remove()
        super().remove()

    def __repr__(self) -> str:
        return (f'VLMPatch({type(self.model).__name__}, encoding={self.encoding.name!r}, rule={self.rule!r}, '
                f'active={self._active}, replaced={len(self.replaced)})')


def _multimodal_names() -> List[str]:
    return [n for n in list_pes() if pe_info(n)['family'] == MULTIMODAL_FAMILY]


def _spec(pe: Any, legacy: Dict[str, Any]) -> Tuple[Optional[str], Dict[str, Any]]:
    """``(encoding name or None, options)`` from ``pe`` and the keywords of the old spelling."""
    if 'scheme' in legacy:
        if pe is not None:
            raise ValueError("patch_vlm: give the encoding once, as pe (scheme= is its deprecated name)")
        pe = legacy.pop('scheme')
    if isinstance(pe, MultimodalRoPE):  # an encoding instance, as vispe.multimodal.get_scheme returns
        warnings.warn('patch_vlm(model, <encoding instance>) is deprecated: give its spec, e.g. '
                      "'videorope:delta=2'", DeprecationWarning, stacklevel=3)
        legacy = {**pe._init_args[1], **legacy}
        pe = pe.name
    if legacy:
        warnings.warn(f'patch_vlm(model, scheme, **options) is deprecated: give one spec, e.g. '
                      f"patch_vlm(model, 'videorope:delta=2'); got options {sorted(legacy)}", DeprecationWarning,
                      stacklevel=3)
    if pe is None:
        if legacy:
            raise ValueError(f'patch_vlm: options {sorted(legacy)} need an encoding; pe=None is the model\'s own')
        return None, {}
    if not isinstance(pe, (str, dict)):
        raise ValueError(f'patch_vlm takes one multimodal encoding: None (the model\'s own), a spec string such as '
                         f"'videorope:delta=2' or a dict {{'name': ..., option: value}}; got "
                         f'{type(pe).__name__} {short_repr(pe)}')
    if isinstance(pe, str) and pe.split(':')[0].strip() in _OLD_NAMES:
        old = pe.split(':')[0].strip()
        warnings.warn(f'the scheme name {old!r} is deprecated: its encoding is {_OLD_NAMES[old]!r}', DeprecationWarning,
                      stacklevel=3)
        pe = _OLD_NAMES[old] + pe.strip()[len(old):]
    names = _multimodal_names()
    try:
        parts = parse_pe_spec(pe)
    except ValueError as e:
        raise ValueError(f'patch_vlm: {e}') from None
    if len(parts) != 1 or parts[0][0] not in names:
        raise ValueError(f"patch_vlm: pe must be None (the model's own) or one multimodal encoding "
                         f"({', '.join(names)}), got {short_repr(pe)}")
    name, options = parts[0]
    twice = sorted(set(options) & set(legacy))
    if twice:
        raise ValueError(f'patch_vlm: options {twice} given in the spec and as keywords')
    return name, {**options, **legacy}


_TOWER_UNCHANGED = object()  # vision_pe left out: the vision tower keeps its own code


def patch_vlm(model: nn.Module, pe: PESpec = None, *, vision_pe: Any = _TOWER_UNCHANGED, rule: Optional[str] = None,
              **legacy: Any) -> VLMPatch:
    """Make one Qwen-VL-family model instance use a multimodal encoding; returns the `VLMPatch`.

    Args:
        model: a transformers ``Qwen2VL*``, ``Qwen2_5_VL*``, ``Qwen3VL*`` or ``Qwen3VLMoe*`` model
            (``ForConditionalGeneration`` or ``Model``), or a wrapper of one with ``get_base_model()`` (PEFT).
        pe: a multimodal encoding spec (``'mrope'``, ``'videorope:delta=2'``, ``'mhrope:head_sections=0|1|1'``,
            or a dict); None: the model's own (``mrope`` for Qwen2-VL / Qwen2.5-VL with their time rule,
            ``mrope_interleave`` for Qwen3-VL), which gives the unpatched model's outputs. Options left out
            take the model's values: ``theta``, ``sections`` (for its own encoding) and ``tokens_per_second``.
        vision_pe: also give the vision tower an encoding (`vispe.integrations.patch_vision`: any image or
            video encoding, ``'rope_mixed'``, ``'liere'``, ...; None: the tower's own, computed by vispe), so
            that both sides change in one call and one handle; left out, the tower is untouched.
        rule: ``'5.x'`` (default: the installed transformers' ``get_rope_index``) or ``'4.x'``.
        legacy: the deprecated spelling ``scheme='videorope', delta=2`` (one release).

    Raises:
        vispe.integrations.UnsupportedModelError: unsupported model class (a TypeError).
        vispe.extras.UnsupportedVersionError: unsupported transformers version (an ImportError).
        vispe.integrations.AlreadyPatchedError: the model, a module inside it or a model holding it is
            already patched (a RuntimeError).
        ValueError: a bad spec or option, or MHRoPE on fewer than 3 key/value heads without ``head_sections``.
    """
    require('transformers', 'patch_vlm')
    model = _unwrap(model)
    inner, model_type = _parts(model)
    refuse_patched(model, 'patch_vlm')
    rule = '5.x' if rule is None else rule
    if rule not in RULES:
        raise ValueError(f'rule must be one of {RULES}, got {rule!r}')
    family = _FAMILIES[model_type]
    name, options = _spec(pe, dict(legacy))
    name = name or family.encoding
    text_cfg = inner.language_model.config
    rope = dict(getattr(text_cfg, 'rope_parameters', None) or {})
    if rope.get('rope_type', 'default') != 'default':
        raise ValueError(f"patch_vlm supports rope_type 'default', the model has {rope.get('rope_type')!r}")
    accepts = pe_info(name)['options']
    defaults = dict(theta=float(rope.get('rope_theta', 1e6)))
    if 'tokens_per_second' in accepts:  # the family's own timing
        defaults['tokens_per_second'] = (getattr(inner.config.vision_config, 'tokens_per_second', None)
                                         if family.timed else None)
    if name == family.encoding and 'mrope_section' in rope:
        defaults['sections'] = tuple(rope['mrope_section'])
    head_dim = getattr(text_cfg, 'head_dim', None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    kv_heads = text_cfg.num_key_value_heads
    if name == 'mhrope' and 'head_sections' not in options and kv_heads < 3:
        raise ValueError(f'encoding mhrope assigns whole key/value heads to the axes t, h, w and this model has '
                         f'{kv_heads} key/value heads: pass head_sections=(t, h, w) summing to at most '
                         f"{kv_heads} ('mhrope:head_sections=0|1|1'; an axis with 0 heads is not encoded), or use "
                         'mrope_interleave')
    inv_freq = getattr(inner.language_model.rotary_emb, 'inv_freq', None)
    ctx = PEContext(dim=kv_heads * head_dim, num_heads=kv_heads, head_dim=head_dim)
    # the model's frequencies are Llama's 1 / theta ** (arange(0, d, 2) / d), computed by the encoding in float32
    encoding = create_pe({'name': name, **defaults, **options}, ctx, device=inv_freq.device if inv_freq is not None
                         else None)
    handle = VLMPatch(model, inner, family, encoding, VLMRotary(encoding), rule)
    attn = [(f'language_model.layers.{i}.self_attn', layer.self_attn)
            for i, layer in enumerate(inner.language_model.layers)]
    if vision_pe is not _TOWER_UNCHANGED:
        from .transformers_vision import patch_vision
        # the tower is patched first and this handle then marks the whole tree: one patch per model, whose
        # remove() takes the tower's patch with it
        handle.vision = patch_vision(inner.visual, vision_pe)
    try:
        handle._install(attn)
    except BaseException:
        handle.remove()  # nothing patched half-way: the tower and what the install had changed
        raise
    return handle
