"""Swap the multimodal RoPE of one transformers Qwen-VL model instance for any `vispe.multimodal` scheme.

``patch_vlm(model, 'videorope')`` makes a Qwen2-VL, Qwen2.5-VL, Qwen3-VL or Qwen3-VL-MoE model
(``*ForConditionalGeneration`` or the bare ``*Model``) compute its position ids and rotary embeddings
with vispe, for forward passes with or without explicit ``position_ids``, training, and
``generate`` (prefill, then cached decoding through ``rope_deltas``). It replaces, on that instance
only (transformers' classes and module functions stay untouched, so two models of one process can
carry different schemes):

* ``<model>.get_rope_index`` and ``<model>.compute_3d_position_ids`` (instance attributes shadowing the
  methods): ids from `vispe.multimodal.position_ids` on the token ids, ``rope_deltas`` in transformers'
  convention (next position minus the number of real tokens);
* ``<language_model>.rotary_emb``: a `VLMRotary` with transformers' ``(x, position_ids) -> (cos, sin)``
  signature, whose cos/sin the model's own ``apply_rotary_pos_emb`` applies;
* for ``mhrope`` only (whole heads per axis, which one cos/sin table for q and k cannot express):
  forward hooks on each attention's ``q_proj`` / ``k_proj`` (Qwen2-VL, Qwen2.5-VL) or ``q_norm`` /
  ``k_norm`` (Qwen3-VL) that rotate q and k head-wise, while the rotary module hands the attention an
  identity cos/sin.

Ids that travel through transformers' ``position_ids``: a scheme with 3 axes uses transformers' own
``(3, B, L)`` (or ``[text; t; h; w]`` in ``generate``); a scheme with another number of axes ``A``
(VRoPE 4, V2PE and 1D RoPE 1) travels as ``(A + 1, B, L)`` = ``[text; axes]``, so VRoPE's 4 rows never
meet transformers' rule that a 4-row ``position_ids`` is ``[text; t; h; w]``. `VLMPatch.position_ids`
builds them for explicit ``position_ids=``.

MHRoPE with fewer key/value heads than axes: heads are assigned at key/value-head granularity (a
query head uses its key/value head's axis, or q and k would rotate by different positions), so a model
with fewer than 3 key/value heads needs ``head_sections=(t, h, w)`` summing to at most its key/value
heads (an axis given 0 heads is not encoded); without it `patch_vlm` raises and says so.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .. import multimodal as mm
from ..extras import SUPPORTED, require
from ..rotary import apply_pair_rotation
from .base import ModelPatch, UnsupportedModelError, refuse_patched

__all__ = ['patch_vlm', 'VLMPatch', 'VLMRotary', 'SUPPORTED_MODEL_TYPES', 'SUPPORTED_TRANSFORMERS']

Tensor = torch.Tensor

SUPPORTED_TRANSFORMERS = SUPPORTED['transformers']  # [low, high): what this adapter is written and tested against


@dataclass(frozen=True)
class _Family:
    """What differs between the supported model families."""
    scheme: str                # the model's own scheme
    video_blocks: str          # how the processor lays a video out in the token ids
    timed: bool                # Qwen2.5-VL: video time ids from tokens_per_second * second_per_grid_ts


_FAMILIES = {
    'qwen2_vl': _Family('mrope', 'video', timed=False),
    'qwen2_5_vl': _Family('mrope', 'video', timed=True),
    'qwen3_vl': _Family('mrope_interleave', 'frame', timed=False),
    'qwen3_vl_moe': _Family('mrope_interleave', 'frame', timed=False),
}
SUPPORTED_MODEL_TYPES = tuple(_FAMILIES)
_REFUSED = {
    'qwen2_5_omni': 'its thinker interleaves audio positions with the visual ones in get_rope_index',
    'qwen3_omni_moe': 'its thinker interleaves audio positions with the visual ones in get_rope_index',
}
_ROTARY_OPTIONS = ('sections', 'head_sections')


def _parts(model: nn.Module) -> Tuple[nn.Module, Optional[nn.Module], str]:
    """(inner model with get_rope_index, outer generation model or None, model_type)."""
    config = getattr(model, 'config', None)
    model_type = getattr(config, 'model_type', None)
    if model_type in _REFUSED or 'Omni' in type(model).__name__:
        why = _REFUSED.get(model_type, 'its get_rope_index is not the Qwen-VL one')
        raise UnsupportedModelError(f'patch_vlm does not support {type(model).__name__}: {why}. Supported model types: '
                        f'{", ".join(SUPPORTED_MODEL_TYPES)} (their *ForConditionalGeneration and *Model classes)')
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(f'patch_vlm supports transformers models of type {", ".join(SUPPORTED_MODEL_TYPES)} '
                        f'(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE; *ForConditionalGeneration or *Model), '
                        f'got {type(model).__name__} (model_type={model_type!r})')
    inner = model.model if hasattr(model, 'model') and hasattr(model.model, 'get_rope_index') else model
    outer = model if inner is not model else None
    for attr in ('get_rope_index', 'compute_3d_position_ids', 'language_model', 'rope_deltas'):
        if not hasattr(inner, attr):
            raise UnsupportedModelError(f'{type(inner).__name__} has no {attr!r}: not the transformers '
                            f'>= {SUPPORTED_TRANSFORMERS[0]}, < {SUPPORTED_TRANSFORMERS[1]} Qwen-VL layout')
    if not isinstance(getattr(inner.language_model, 'rotary_emb', None), nn.Module):
        raise UnsupportedModelError(f'{type(inner.language_model).__name__} has no rotary_emb module')
    return inner, outer, model_type


class VLMRotary(nn.Module):
    """The language model's rotary module under a vispe scheme: ``(x, position_ids) -> (cos, sin)``.

    ``position_ids``: ``(A, B, N)`` for a 3-axis scheme, ``(A + 1, B, N)`` = ``[text; axes]``
    otherwise, ``(1, B, N)`` / ``(B, N)`` (decoding: the same id on every axis), or three equal rows
    (transformers' own expansion of 1D text positions). For MHRoPE the cos/sin it returns are the
    identity and the head-wise tables wait in ``heads`` for the attention hooks of the same forward.
    """

    def __init__(self, rotary: mm.MultimodalRotary, head_dim: int) -> None:
        super().__init__()
        self.rotary = rotary
        self.head_dim = head_dim
        self.num_axes = len(rotary.axes)
        self.heads: Optional[Tuple[Tensor, Tensor]] = None

    def axes_ids(self, position_ids: Tensor) -> Tensor:
        """The scheme's ``(A, B, N)`` ids from what transformers passes."""
        A = self.num_axes
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
        if rows == 3 and bool((ids == ids[:1]).all()):  # transformers' expansion of 1D positions
            return ids[:1].expand(A, -1, -1)
        extra = (' transformers reads a 4-row position_ids as [text; t; h; w] and drops row 0: give '
                 f'{A + 1} rows [text; axes], as VLMPatch.position_ids returns them.' if A == 4 else '')
        raise ValueError(f'scheme {self.rotary.scheme!r} takes position_ids with {A} axes '
                         f'({A if A == 3 else A + 1} rows{"" if A == 3 else " [text; axes]"}), got '
                         f'{rows} rows.{extra}')

    def forward(self, x: Tensor, position_ids: Tensor) -> Tuple[Tensor, Tensor]:
        ids = self.axes_ids(position_ids)
        cos, sin = self.rotary(ids)
        if self.rotary.mode == 'heads':
            self.heads = (cos, sin)
            shape = (*ids.shape[1:], self.head_dim)
            one = torch.ones(shape, dtype=x.dtype, device=x.device)
            return one, torch.zeros_like(one)
        return cos.to(x.dtype), sin.to(x.dtype)


def _rotate_heads(rotary: VLMRotary, head_dim: int, module: nn.Module, args: Any, out: Tensor) -> Tensor:
    """A forward hook (bound to ``rotary`` and ``head_dim`` with `functools.partial`) rotating a q or k
    projection output head-wise by ``rotary.heads``."""
    cos, sin = rotary.heads
    x = out if out.dim() == 4 else out.unflatten(-1, (-1, head_dim))  # (B, N, H, hd)
    y = apply_pair_rotation(x, mm.rotary_table(cos, sin, x, unsqueeze_dim=2), 'half')
    return y if out.dim() == 4 else y.flatten(-2)


class VLMPatch(ModelPatch):
    """What `patch_vlm` did to one model instance; ``remove()`` (or leaving a ``with`` block) undoes it.

    Attributes:
        scheme: the `vispe.multimodal.Scheme` in use; ``rotary``: the `VLMRotary` module installed.
        replaced: ``(owner, attribute name)`` of everything replaced, for the record.
    """
    adapter = 'patch_vlm'

    def __init__(self, model: nn.Module, inner: nn.Module, family: _Family, scheme: mm.Scheme,
                 rotary: VLMRotary, rule: str) -> None:
        super().__init__(model)
        self.inner, self.family, self.scheme, self.rotary, self.rule = inner, family, scheme, rotary, rule
        cfg = inner.config
        self._tokens = dict(image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                            vision_start_token_id=cfg.vision_start_token_id,
                            spatial_merge_size=cfg.vision_config.spatial_merge_size)

    # ------------------------------------------------------------------ ids
    def rope_index(self, input_ids: Tensor, mm_token_type_ids: Optional[Tensor] = None,
                   image_grid_thw: Optional[Tensor] = None, video_grid_thw: Optional[Tensor] = None,
                   attention_mask: Optional[Tensor] = None, second_per_grid_ts: Optional[Tensor] = None,
                   **_: Any) -> Tuple[Tensor, Tensor]:
        """``get_rope_index`` under the scheme: ids ``(A, B, L)`` and ``rope_deltas`` ``(B, 1)``.

        ``rope_deltas`` follow transformers 5.x: next position minus the number of real tokens (what
        its decoding adds to ``cumsum(attention_mask) - 1``), whatever ``rule`` built the ids.
        """
        ids, delta = mm.position_ids(
            input_ids, scheme=self.scheme, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
            second_per_grid_ts=second_per_grid_ts if self.family.timed else None, attention_mask=attention_mask,
            mm_token_type_ids=mm_token_type_ids, video_blocks=self.family.video_blocks, rule=self.rule,
            training=self.model.training, **self._tokens)
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
                                second_per_grid_ts: Optional[Tensor] = None,
                                mm_token_type_ids: Optional[Tensor] = None, **kwargs: Any) -> Optional[Tensor]:
        """The model's ``compute_3d_position_ids`` with vispe's ids (same branches as transformers')."""
        cache = kwargs.get('past_key_values', cache)
        cache_length = 0 if cache is None else cache.get_seq_length()
        inner = self.inner
        multimodal = image_grid_thw is not None or video_grid_thw is not None
        if input_ids is not None and multimodal and (inner.rope_deltas is None or cache_length == 0):
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
            A = self.rotary.num_axes
            return pos[None].expand(A if A == 3 else A + 1, -1, -1)
        return None

    # ------------------------------------------------------------------ install / remove
    def _install(self, attn_modules: List[Tuple[str, nn.Module]], head_dim: int) -> None:
        inner = self.inner
        self._saved_rope_deltas = inner.rope_deltas
        self.set(inner, 'get_rope_index', self.rope_index)
        self.set(inner, 'compute_3d_position_ids', self.compute_3d_position_ids)
        self.set(inner.language_model, 'rotary_emb', self.rotary)
        if self.rotary.rotary.mode == 'heads':
            hook = functools.partial(_rotate_heads, self.rotary, head_dim)
            for name, attn in attn_modules:
                q, k = ('q_norm', 'k_norm') if hasattr(attn, 'q_norm') else ('q_proj', 'k_proj')
                for part in (q, k):
                    self.add_hook(getattr(attn, part), hook, label=f'{name}.{part}')
        self.activate()

    def remove(self) -> None:
        """Restore the instance: the original attributes and modules, no hooks, the old ``rope_deltas``."""
        if self.active:
            self.inner.rope_deltas = self._saved_rope_deltas
        super().remove()

    def __repr__(self) -> str:
        return (f'VLMPatch({type(self.model).__name__}, scheme={self.scheme!r}, rule={self.rule!r}, '
                f'active={self._active}, replaced={len(self.replaced)})')


def _scheme_for(family: _Family, scheme: Union[None, str, mm.Scheme], tokens_per_second: Optional[float],
                options: Dict[str, Any]) -> mm.Scheme:
    if isinstance(scheme, mm.Scheme):
        return mm.get_scheme(scheme, **options)
    name = family.scheme if scheme is None else scheme
    if name not in mm.SCHEMES:
        raise ValueError(f'scheme must be None (the model\'s own) or one of {tuple(mm.SCHEMES)}, got {scheme!r}')
    accepts = inspect.signature(mm.SCHEMES[name].__init__).parameters
    if 'tokens_per_second' in accepts and 'tokens_per_second' not in options:
        options = dict(options, tokens_per_second=tokens_per_second)  # the family's own timing
    return mm.get_scheme(name, **options)


def patch_vlm(model: nn.Module, scheme: Union[None, str, mm.Scheme] = None, *, rule: Optional[str] = None,
              **scheme_options: Any) -> VLMPatch:
    """Make one Qwen-VL-family model instance use a `vispe.multimodal` scheme; returns the `VLMPatch`.

    Args:
        model: a transformers ``Qwen2VL*``, ``Qwen2_5_VL*``, ``Qwen3VL*`` or ``Qwen3VLMoe*`` model
            (``ForConditionalGeneration`` or ``Model``).
        scheme: a name in ``vispe.multimodal.SCHEMES`` or a `Scheme`; None: the model's own (``mrope`` for
            Qwen2-VL / Qwen2.5-VL with their time rule, ``mrope_interleave`` for Qwen3-VL), which gives
            the unpatched model's outputs.
        rule: ``'5.x'`` (default: the installed transformers' ``get_rope_index``) or ``'4.x'``.
        scheme_options: options of the scheme (e.g. ``spatial_reset=True``, ``delta=2``); ``sections``
            (pairs per axis; default the model's ``mrope_section`` for its own scheme, else the
            scheme's split scaled to the head dim) and ``head_sections`` (MHRoPE: key/value heads per
            axis) go to the rotary.

    Raises:
        vispe.integrations.UnsupportedModelError: unsupported model class (a TypeError).
        vispe.extras.UnsupportedVersionError: unsupported transformers version (an ImportError).
        vispe.integrations.AlreadyPatchedError: the model, a module inside it or a model holding it is
            already patched (a RuntimeError).
        ValueError: bad scheme or options, or MHRoPE on fewer than 3 key/value heads without
            ``head_sections``.
    """
    require('transformers', 'patch_vlm')
    inner, outer, model_type = _parts(model)
    refuse_patched(model, 'patch_vlm')
    if rule is None:
        rule = '5.x'
    if rule not in mm.RULES:
        raise ValueError(f'rule must be one of {mm.RULES}, got {rule!r}')
    family = _FAMILIES[model_type]
    text_cfg = inner.language_model.config
    rope = dict(getattr(text_cfg, 'rope_parameters', None) or {})
    if rope.get('rope_type', 'default') != 'default':
        raise ValueError(f"patch_vlm supports rope_type 'default', the model has {rope.get('rope_type')!r}")
    rotary_opts = {k: scheme_options.pop(k) for k in _ROTARY_OPTIONS if k in scheme_options}
    tps = getattr(inner.config.vision_config, 'tokens_per_second', None) if family.timed else None
    sch = _scheme_for(family, scheme, tps, scheme_options)
    head_dim = getattr(text_cfg, 'head_dim', None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    kv_heads = text_cfg.num_key_value_heads
    if sch.name == family.scheme and 'sections' not in rotary_opts and 'mrope_section' in rope:
        rotary_opts['sections'] = tuple(rope['mrope_section'])
    if sch.name == 'mhrope' and 'head_sections' not in rotary_opts and kv_heads < 3:
        raise ValueError(f'scheme mhrope assigns whole key/value heads to the axes t, h, w and this model has '
                         f'{kv_heads} key/value heads: pass head_sections=(t, h, w) summing to at most '
                         f'{kv_heads} (an axis with 0 heads is not encoded), or use mrope_interleave')
    old = inner.language_model.rotary_emb
    inv_freq = getattr(old, 'inv_freq', None)
    device = inv_freq.device if inv_freq is not None else None
    rot = mm.MultimodalRotary(head_dim, theta=float(rope.get('rope_theta', 1e6)), scheme=sch,
                              num_heads=kv_heads if sch.name == 'mhrope' else None, device=device, **rotary_opts)
    if inv_freq is not None and inv_freq.shape == rot.inv_freq.shape:
        rot.inv_freq.copy_(inv_freq)  # the model's own frequencies, bit for bit
    module = VLMRotary(rot, head_dim)
    handle = VLMPatch(model, inner, family, sch, module, rule)
    attn = [(f'language_model.layers.{i}.self_attn', layer.self_attn)
            for i, layer in enumerate(inner.language_model.layers)]
    handle._install(attn, head_dim)
    return handle
