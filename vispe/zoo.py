"""timm's ViT zoo with any vispe encoding: `convert` and ``timm.create_model(..., pe=...)``.

`convert` turns an already-built timm ``VisionTransformer`` (DeiT's distilled one included) or ``Eva``
(any of the entrypoints of ``timm.models.vision_transformer``, ``deit`` and ``eva``, or e.g. open_clip's
timm tower ``.trunk``) into a PE host in place: every attention module and block becomes its PE-aware subclass
(the same parameters, buffers and names, so the model's weights stay exactly where they were), the
model's ``pos_embed`` (and Eva's ``rope``) is replaced by the encoding ``model.pe``, and the
checkpoint's table is handed to the encoding (``adopt_pos_embed``; a timm rope's learned
frequencies to the encoding's ``adopt_timm_rope``). ``model.pretrained_report`` says what was
dropped, initialised and resampled.

``import vispe`` wraps each entrypoint of these timm modules so that it accepts ``pe=``: without it
the original entrypoint runs untouched (same class, outputs, state dict, pretrained configs); with
it timm builds (and loads) the model through its own entrypoint, loader and checkpoint filters, then
`convert` runs. ``timm_pe_spec(model)`` is the spec of the model's own encoding (``learned``,
``rope_timm:...`` or both), with which the converted model computes timm's own outputs.

Block types kept: ``Block``, ``ResPostBlock``, ``ParallelScalingBlock``, ``ParallelThingsBlock``
(its parallel attentions share the block's layer index), ``EvaBlock``, ``EvaBlockPostNorm``; attention
``Attention``, ``EvaAttention`` (fused or separate q/k/v, ``q_bias`` / ``v_bias``) and
``AttentionRope`` (grouped-query: k and v are repeated to every head before the encoding acts, so
per-head encodings see one key per head), ``DiffAttention`` and ``DiffParallelScalingBlock``
(differential attention: the encoding sees the 2H q/k heads of width hd, see `_PEDifferential`).
DeiT's ``VisionTransformerDistilled`` keeps its distillation token as the second prefix token and
its two heads (`PEVisionTransformerDistilled`).
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

import timm
import torch
import torch.nn.functional as F
from timm.layers import Attention, AttentionRope, DiffAttention, PatchDropout, PatchDropoutWithIndices, is_scriptable
from timm.layers.pos_embed_sincos import (
    RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed, RotaryEmbeddingMRope,
)
from timm.models import _registry
from timm.models._builder import load_pretrained, pretrained_cfg_for_features
from timm.models._features import FeatureGetterNet
from timm.models.deit import VisionTransformerDistilled
from timm.models.eva import Eva, EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.vision_transformer import (
    Block, DiffParallelScalingBlock, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock,
)
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import nn

from .attention import pe_attention
from .encodings.base import PEContext, PositionalEncoding
from .host import PEBlock, PEHost
from .positions import Positions
from .registry import PESpec, create_pe, format_pe_spec
from .vit import NO_TORCHSCRIPT, LoadReport, VisionTransformer, adopt_pos_embed, checkpoint_filter_fn

__all__ = ['convert', 'timm_pe_spec', 'checkpoint_filter_fn', 'ZOO_MODULES', 'PEEva', 'PEVisionTransformerDistilled']

# torch.fx records calls of this module's `pe_attention` as opaque ones (`torch.fx.wrap` covers the
# calls made from the module that wraps the name)
torch.fx.wrap('pe_attention')

_logger = logging.getLogger(__name__)

ZOO_MODULES = ('vision_transformer', 'deit', 'eva')


# ---------------------------------------------------------------------- attention
class _PEOutput:
    """The part every PE-aware timm attention shares: its own q, k, v (`_project`, after q/k norm),
    `pe_attention` on them, then the module's own output path (scale norm, gate, projection)."""
    layer_index: int = 0

    def _project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        B, N = x.shape[:2]
        q, k, v = self._project(x)
        o = pe_attention(q, k, v, pe, state, self.layer_index, x=x, attn_mask=attn_mask,
                         dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale,
                         is_causal=is_causal, force_explicit=not self.fused_attn, pos_q=pos)
        o = self.norm(o.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))
        if self.gate is not None:
            o = o * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(o))


class PETimmAttention(_PEOutput, Attention):
    """timm's `Attention` (same parameters) with the encoding's hooks."""

    def _project(self, x):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.q_norm(q), self.k_norm(k), v


class PEEvaAttention(_PEOutput, EvaAttention):
    """timm's `EvaAttention` (fused qkv with ``q_bias`` / ``v_bias`` and no k bias, or separate
    projections) with the encoding's hooks in place of its rope."""

    def _project(self, x):
        B, N, _ = x.shape
        if self.qkv is not None:
            if self.q_bias is None:
                qkv = self.qkv(x)
            elif self.qkv_bias_separate:
                qkv = self.qkv(x) + torch.cat((self.q_bias, self.k_bias, self.v_bias))
            else:
                qkv = F.linear(x, weight=self.qkv.weight, bias=torch.cat((self.q_bias, self.k_bias, self.v_bias)))
            q, k, v = qkv.reshape(B, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (p(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.q_norm(q), self.k_norm(k), v


class PEAttentionRope(_PEOutput, AttentionRope):
    """timm's `AttentionRope` (fused or separate projections, grouped-query heads) with the
    encoding's hooks in place of its rope."""

    def _project(self, x):
        B, N, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q = self.q_proj(x).reshape(B, N, self.num_heads, self.head_dim).transpose(1, 2)
            k = self.k_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(x).reshape(B, N, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.num_kv_groups > 1:  # head h reads kv head h // groups, as timm
            k = k.repeat_interleave(self.num_kv_groups, dim=1)
            v = v.repeat_interleave(self.num_kv_groups, dim=1)
        return q, k, v


class _PEDifferential:
    """The part both PE-aware differential attentions share (Differential Transformer, Ye et al. 2024,
    https://arxiv.org/abs/2410.05258, as timm's ``DiffAttention``): q and k have 2H heads of width hd,
    heads 2h and 2h + 1 forming the pair of head h, whose value ``v_h`` has width 2hd. The encoding
    acts on the 2H q/k heads (its context: 2H heads of width hd) in one `pe_attention` call with
    ``v_h`` repeated to both heads of the pair; the pair's outputs then combine as timm's
    ``softmax(q1 k1) v - lambda softmax(q2 k2) v``, ``sub_norm``, ``(1 - lambda_init)``. An encoding
    acting on v, on the output or on the weights, or widening the head, cannot apply to the pair of
    maps (`convert` refuses it)."""
    layer_index: int = 0

    def _differential(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      pe: Optional[PositionalEncoding], state: Any, attn_mask: Optional[torch.Tensor],
                      is_causal: bool, pos: Optional[Positions]) -> torch.Tensor:
        """``(B, N, C)`` from q, k ``(B, 2H, N, hd)`` and v ``(B, H, N, 2hd)``."""
        B, N = x.shape[:2]
        lambda_full = self._compute_lambda().type_as(q)
        o = pe_attention(q, k, v.repeat_interleave(2, dim=1), pe, state, self.layer_index, x=x, attn_mask=attn_mask,
                         dropout_p=self.attn_drop_p if self.training else 0.0, scale=self.scale,
                         is_causal=is_causal, force_explicit=not self.fused_attn, pos_q=pos)
        o1, o2 = o.unflatten(1, (self.num_heads, 2)).unbind(2)
        o = self.sub_norm(o1 - lambda_full * o2) * (1 - self.lambda_init)
        return o.transpose(1, 2).reshape(B, N, -1)

    def _qkv_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(B, N, C)`` projections as timm splits them: 2H q/k heads of width hd (normed), H v heads of 2hd."""
        B, N, _ = q.shape
        q = self.q_norm(q.reshape(B, N, 2 * self.num_heads, self.head_dim).transpose(1, 2))
        k = self.k_norm(k.reshape(B, N, 2 * self.num_heads, self.head_dim).transpose(1, 2))
        return q, k, v.reshape(B, N, self.num_heads, 2 * self.head_dim).transpose(1, 2)


class PEDiffAttention(_PEDifferential, DiffAttention):
    """timm's `DiffAttention` (same parameters) with the encoding's hooks on its 2H q/k heads."""

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        q, k, v = self._qkv_heads(*self.qkv(x).chunk(3, dim=2))
        o = self._differential(x, q, k, v, pe, state, attn_mask, is_causal, pos)
        return self.proj_drop(self.proj(self.norm(o)))


# ---------------------------------------------------------------------- blocks
class PEResPostBlock(ResPostBlock):
    """timm's post-norm `ResPostBlock` whose attention receives the encoding."""

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        x = x + self.drop_path1(self.norm1(self.attn(x, pe=pe, state=state, attn_mask=attn_mask,
                                                     is_causal=is_causal, pos=pos)))
        return x + self.drop_path2(self.norm2(self.mlp(x)))


class PEParallelThingsBlock(ParallelThingsBlock):
    """timm's `ParallelThingsBlock` (parallel attentions, then parallel MLPs); its attentions share
    the block's layer index."""

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        x = x + torch.stack([a.drop_path(a.ls(a.attn(a.norm(x), pe=pe, state=state, attn_mask=attn_mask,
                                                     is_causal=is_causal, pos=pos))) for a in self.attns]).sum(0)
        return x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)


class PEParallelScalingBlock(ParallelScalingBlock):
    """timm's `ParallelScalingBlock` (ViT-22B: attention and MLP from one fused input projection)
    with the encoding's hooks in its attention."""
    layer_index: int = 0

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        B, N, C = x.shape
        y = self.in_norm(x)
        x_mlp, q, k, v = torch.split(self.in_proj(y), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            x_mlp = x_mlp + self.mlp_bias
        q = self.q_norm(q.view(B, N, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, N, self.num_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        x_attn = pe_attention(q, k, v, pe, state, self.layer_index, x=y, attn_mask=attn_mask,
                              dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale,
                              is_causal=is_causal, force_explicit=not self.fused_attn, pos_q=pos)
        x_attn = x_attn.transpose(1, 2).reshape(B, N, C)
        x_mlp = self.mlp_drop(self.mlp_act(x_mlp))
        if self.out_proj is not None:
            y = self.out_proj(torch.cat((x_attn, x_mlp), dim=-1))
        else:
            y = self.attn_out_proj(x_attn) + self.mlp_out_proj(x_mlp)
        return x + self.drop_path(self.ls(y))


class PEDiffParallelScalingBlock(_PEDifferential, DiffParallelScalingBlock):
    """timm's `DiffParallelScalingBlock` (ViT-22B parallel block with differential attention) with the
    encoding's hooks on its 2H q/k heads."""

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        y = self.in_norm(x)
        x_mlp, q, k, v = torch.split(self.in_proj(y), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            x_mlp = x_mlp + self.mlp_bias
        x_attn = self._differential(y, *self._qkv_heads(q, k, v), pe, state, attn_mask, is_causal, pos)
        x_mlp = self.mlp_drop(self.mlp_act(x_mlp))
        y = self.out_proj(torch.cat((x_attn, x_mlp), dim=-1))
        return x + self.drop_path(self.ls(y))


class PEEvaBlock(EvaBlock):
    """timm's pre-norm `EvaBlock` (SwiGLU, layer scale ``gamma_1`` / ``gamma_2``, qk-norm, scale
    norm) whose attention receives the encoding instead of a rope table."""

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[Positions] = None) -> torch.Tensor:
        x_attn = self.attn(self.norm1(x), pe=pe, state=state, attn_mask=attn_mask, is_causal=is_causal, pos=pos)
        if self.gamma_1 is not None:
            x_attn = self.gamma_1 * x_attn
        x = x + self.drop_path1(x_attn)
        x_mlp = self.mlp(self.norm2(x))
        if self.gamma_2 is not None:
            x_mlp = self.gamma_2 * x_mlp
        return x + self.drop_path2(x_mlp)


class PEEvaBlockPostNorm(EvaBlockPostNorm):
    """timm's post-norm `EvaBlockPostNorm` whose attention receives the encoding (its layout and
    forward are `ResPostBlock`'s)."""
    forward = PEResPostBlock.forward


# ---------------------------------------------------------------------- hosts
class PEEva(PEHost, Eva):
    """timm's `Eva` (EVA, EVA-02, PE, RoPE-ViT ports, DINOv3, ...) as a vispe host: its ``pos_embed``
    and ``rope`` replaced by ``self.pe``; everything else (heads, pooling, norms) is timm's."""

    def init_weights(self, needs_reset: bool = True) -> None:
        """timm's init, then the encoding's own (`reset_parameters`)."""
        super().init_weights(needs_reset)
        pe = getattr(self, 'pe', None)
        if pe is not None:
            pe.reset_parameters()

    def _pool_keeps_prefix(self, attn_pool: bool) -> bool:
        """Eva's MAP head reads every token, its global pooling none of the prefix tokens."""
        return attn_pool

    @torch.jit.ignore
    def no_weight_decay(self):
        return super().no_weight_decay() | {f'pe.{n}' for n in self.pe.no_weight_decay()}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^cls_token|reg_token|pe\.|patch_embed|norm_pre',
                    blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))])


class PEVisionTransformerDistilled(VisionTransformer, VisionTransformerDistilled):
    """DeiT's `VisionTransformerDistilled` (Touvron et al. 2021, https://arxiv.org/abs/2012.12877) as a
    vispe host: the distillation token is the second prefix token (class, distillation, as timm orders
    them), and the two heads, ``distilled_training`` and the train / eval outputs are timm's."""

    def _prefix_tokens(self) -> List[Optional[torch.Tensor]]:
        return [self.cls_token, self.dist_token]

    def forward_head(self, x: Union[torch.Tensor, Dict[str, torch.Tensor]], pre_logits: bool = False,
                     patch_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's distilled head; it reads the two prefix tokens only, so a NaFlex batch's padding
        (``patch_valid``) cannot reach it."""
        if isinstance(x, dict):
            x = x['patches']
        return VisionTransformerDistilled.forward_head(self, x, pre_logits)

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        return dict(stem=r'^cls_token|dist_token|pe\.|patch_embed|norm_pre',
                    blocks=[(r'^blocks\.(\d+)', None), (r'^norm', (99999,))])


_HOSTS: Dict[Type[nn.Module], Type[nn.Module]] = {
    TimmVisionTransformer: VisionTransformer, VisionTransformerDistilled: PEVisionTransformerDistilled, Eva: PEEva,
}
_BLOCKS: Dict[Type[nn.Module], Type[nn.Module]] = {
    Block: PEBlock, ResPostBlock: PEResPostBlock, ParallelThingsBlock: PEParallelThingsBlock,
    ParallelScalingBlock: PEParallelScalingBlock, DiffParallelScalingBlock: PEDiffParallelScalingBlock,
    EvaBlock: PEEvaBlock, EvaBlockPostNorm: PEEvaBlockPostNorm,
}
_ATTENTIONS: Dict[Type[nn.Module], Type[nn.Module]] = {
    Attention: PETimmAttention, EvaAttention: PEEvaAttention, AttentionRope: PEAttentionRope,
    DiffAttention: PEDiffAttention,
}
_PARALLEL = (ParallelScalingBlock, DiffParallelScalingBlock)  # blocks that are their own attention


def _attentions(block: nn.Module) -> List[nn.Module]:
    """The attention modules of a block (the block itself for the parallel scaling blocks)."""
    if isinstance(block, _PARALLEL):
        return [block]
    if isinstance(block, ParallelThingsBlock):
        return [a.attn for a in block.attns]
    return [block.attn]


def _model_name(model: nn.Module, name: Optional[str]) -> str:
    if name:
        return name
    cfg = getattr(model, 'pretrained_cfg', None) or {}
    return cfg.get('architecture') or type(model).__name__


def _check_convertible(model: nn.Module, label: str) -> None:
    if getattr(model, 'pe', None) is not None and isinstance(model, PEHost):
        raise ValueError(f'{label} is already a vispe host (pe={model.pe.name!r}); build it anew to change pe')
    if type(model) not in _HOSTS:
        hint = ('; for native-resolution batches build the model without use_naflex and give it '
                'vispe.naflex_batch(...)' if type(model).__name__ == 'NaFlexVit' else '')
        raise ValueError(f'{label}: vispe.convert takes timm VisionTransformer or Eva models, got '
                         f'{type(model).__module__}.{type(model).__name__}{hint}')
    if isinstance(model, VisionTransformerDistilled) and model.reg_token is not None:
        raise ValueError(f'{label}: a VisionTransformerDistilled with register tokens (reg_tokens='
                         f'{model.reg_token.shape[1]}): timm leaves them out of its sequence; use reg_tokens=0')
    for i, block in enumerate(model.blocks):
        if type(block) not in _BLOCKS:
            raise ValueError(f'{label}: block {i} is a {type(block).__name__}, which vispe cannot host '
                             f'(not a known timm block)')
        for attn in _attentions(block):
            if attn is not block and type(attn) not in _ATTENTIONS:
                raise ValueError(f'{label}: block {i} has a {type(attn).__name__}, which vispe cannot host '
                                 f'(not a known timm attention)')


def _is_differential(model: nn.Module) -> bool:
    return any(isinstance(a, (DiffAttention, DiffParallelScalingBlock)) for b in model.blocks for a in _attentions(b))


def _check_differential(enc: PositionalEncoding, pe: PESpec, label: str) -> None:
    """Refuse an encoding that cannot act on a differential attention's pair of softmax maps."""
    caps = enc.capabilities
    why = [what for what, bad in (
        ('acts on v', 'value' in caps.hooks), ('acts on the attention output', 'output' in caps.hooks),
        ('adds a term from the attention weights', caps.needs_weights), ('widens the head', caps.changes_head_dim),
    ) if bad]
    if why:
        raise ValueError(f'{label}: pe={pe!r} cannot apply to differential attention: the encoding '
                         f'{" and ".join(why)}, while the two softmax maps of a head pair share one value and '
                         'one output; only q/k maps, logit biases and token embeddings apply')


def _rope_spec(rope: nn.Module, label: str) -> Dict[str, Any]:
    """The `rope_timm` options equal to a timm rope module."""
    augment = {k: getattr(rope, k) for k in ('shift_coords', 'jitter_coords', 'rescale_coords')
               if getattr(rope, k, None) is not None}
    if type(rope) is RotaryEmbeddingCat:
        if rope.grid_type != 'index' or rope.in_pixels:
            raise ValueError(f'{label}: its rope uses pixel-frequency bands (grid_type={rope.grid_type!r}); '
                             "encoding 'rope_timm' follows the index-grid convention of timm's ViT models")
        spec = dict(rope_type='cat', temperature=float(rope.temperature), grid_indexing=rope.grid_indexing,
                    grid_offset=float(rope.grid_offset), rotate_half=bool(rope.rotate_half))
        if rope.ref_feat_shape is not None:
            spec['ref_feat_shape'] = [int(s) for s in rope.ref_feat_shape]
    elif type(rope) is RotaryEmbeddingMixed:
        spec = dict(rope_type='mixed', temperature=float(rope.temperature), grid_indexing=rope.grid_indexing)
    elif type(rope) is RotaryEmbeddingDinoV3:
        spec = dict(rope_type='dinov3', grid_indexing=rope.grid_indexing, grid_offset=float(rope.grid_offset),
                    rotate_half=bool(rope.rotate_half), normalize_coords=rope.normalize_coords)
        if rope.min_period is not None and rope.max_period is not None:
            spec.update(min_period=float(rope.min_period), max_period=float(rope.max_period))
        else:
            spec['temperature'] = float(rope.temperature)
    elif type(rope) is RotaryEmbeddingMRope:
        spec = dict(rope_type='mrope', temperature=float(rope.temperature), rotate_half=True,
                    mrope_section=[int(s) for s in rope.mrope_section])
    else:
        raise ValueError(f'{label}: unknown timm rope module {type(rope).__name__}')
    return dict(name='rope_timm', **spec, **augment)


def timm_pe_spec(model: nn.Module) -> PESpec:
    """The vispe spec of a timm ViT / Eva model's own encoding: ``'learned'`` for its ``pos_embed``, a
    ``rope_timm`` dict for its rope, both for EVA-02 (a list), ``'none'`` for neither. Converted with
    it (`convert`), the model computes timm's own outputs."""
    label = _model_name(model, None)
    parts: List[Any] = []
    if getattr(model, 'pos_embed', None) is not None:
        parts.append('learned')
    rope = getattr(model, 'rope', None)
    if rope is not None:
        parts.append(_rope_spec(rope, label))
    if not parts:
        return 'none'
    return parts[0] if len(parts) == 1 else parts


def _context(model: nn.Module) -> PEContext:
    """The encoding's context: the heads its q/k maps see (differential attention: 2H of width hd)."""
    first = _attentions(model.blocks[0])[0] if len(model.blocks) else None
    num_heads = first.num_heads if first is not None else 1
    if isinstance(first, (DiffAttention, DiffParallelScalingBlock)):
        num_heads *= 2
    return PEContext(dim=model.embed_dim, num_heads=num_heads,
                     head_dim=first.head_dim if first is not None else model.embed_dim, depth=len(model.blocks),
                     grid_size=tuple(model.patch_embed.grid_size), num_prefix_tokens=model.num_prefix_tokens,
                     embed_prefix=not model.no_embed_class)


def _adopt(model: nn.Module, pe: PositionalEncoding, loaded_grid: Optional[Tuple[int, ...]] = None
           ) -> Tuple[Dict[str, torch.Tensor], LoadReport]:
    """What of the model's own position weights the encoding takes over, and the report; a table
    the loader resampled from ``loaded_grid`` counts as resampled."""
    entries: Dict[str, torch.Tensor] = {}
    dropped: List[str] = []
    resampled: List[str] = []
    table = model.pos_embed
    if table is not None:
        found, resampled = adopt_pos_embed(pe, table.detach(), model.num_prefix_tokens,
                                           grid=tuple(model.patch_embed.grid_size),
                                           embed_prefix=not model.no_embed_class, prefix='')
        entries.update(found)
        if not found:
            dropped.append('pos_embed')
        elif loaded_grid is not None and tuple(loaded_grid) != tuple(model.patch_embed.grid_size):
            resampled = sorted(set(resampled) | set(found))
    rope = getattr(model, 'rope', None)
    if rope is not None:
        taken = pe.adopt_timm_rope(rope)
        entries.update(taken)
        rope_keys = [f'rope.{k}' for k in rope.state_dict()]
        if not taken:
            dropped += rope_keys
    initialized = sorted(f'pe.{k}' for k in pe.state_dict() if k not in entries)
    return entries, LoadReport(dropped=dropped, initialized=initialized, resampled=[f'pe.{k}' for k in resampled])


def convert(model: nn.Module, pe: PESpec, *, name: Optional[str] = None,
            loaded_grid: Optional[Tuple[int, ...]] = None, **options: Any) -> nn.Module:
    """Make a built timm ``VisionTransformer`` (DeiT's distilled one too) or ``Eva`` a vispe host with
    encoding ``pe``, in place.

    Every weight of the model stays (same names); its ``pos_embed`` is handed to the encoding
    (``adopt_pos_embed``: a ``learned`` table takes it, resampled to its grid) and its rope
    module is replaced (a ``rope_timm`` encoding with ``rope_type='mixed'`` takes its learned
    frequencies). ``model.pretrained_report`` lists what was dropped (a table or rope weights no
    encoding took), initialised (encoding weights not taken from the model) and resampled.

    Args:
        model: the timm model (on any device, the meta device included).
        pe: encoding spec (``'rope_mixed'``, ``'irpe+learned'``, ``timm_pe_spec(model)``, ...).
        name: the model's name for error messages (default: its pretrained config's architecture).
        loaded_grid: the token grid of the checkpoint the model's table was loaded from; when it is
            not the model's, timm's loader resampled the table, and the report says so.
        options: options of a single encoding, overriding the spec's.

    Returns:
        The same model object, now a `vispe.VisionTransformer`, `PEVisionTransformerDistilled` or `PEEva`.

    Raises:
        ValueError: a model vispe cannot host (another class, NaFlexVit) or an encoding that cannot
            apply to it (one that needs cameras, other head widths, one acting on v or the output of a
            differential attention), naming the model and the reason.
    """
    label = _model_name(model, name)
    if is_scriptable():
        raise ValueError(f'{label} was built with scriptable=True: {NO_TORCHSCRIPT}')
    _check_convertible(model, label)
    ref = next(iter(model.parameters()), None)
    dd = dict(device=ref.device, dtype=ref.dtype) if ref is not None else {}
    ctx = _context(model)
    try:
        enc = create_pe(pe, ctx, **dd, **options)
    except ValueError as e:
        raise ValueError(f'{label}: pe={pe!r} cannot apply to this model: {e}') from e
    caps = enc.capabilities
    if caps.requires:
        raise ValueError(f'{label}: pe={pe!r} needs {sorted(caps.requires)} in its positions, which an image '
                         'ViT does not supply (use a camera-aware host)')
    if _is_differential(model):
        _check_differential(enc, pe, label)
    drop_rate = getattr(model.patch_drop, 'prob', 0.0) if model.patch_drop is not None else 0.0
    if drop_rate > 0 and caps.between_blocks:
        raise ValueError(f'{label}: pe={pe!r} acts between blocks on the full token grid, which patch dropout '
                         f'(patch_drop_rate={drop_rate}) removes')
    entries, report = _adopt(model, enc, loaded_grid)
    with torch.no_grad():
        missing, unexpected = enc.load_state_dict(entries, strict=False)
    if unexpected:
        raise ValueError(f'{label}: the encoding has no entries {unexpected} that it adopted')  # a hook's bug

    for i, block in enumerate(model.blocks):
        block.__class__ = _BLOCKS[type(block)]
        for attn in _attentions(block):
            if attn is not block:
                attn.__class__ = _ATTENTIONS[type(attn)]
            attn.layer_index = i
    if isinstance(model.patch_drop, PatchDropout):  # timm's ViT: one that also returns the kept indices
        model.patch_drop = PatchDropoutWithIndices(model.patch_drop.prob, model.num_prefix_tokens,
                                                   ordered=model.patch_drop.ordered)
    elif not isinstance(model.patch_drop, PatchDropoutWithIndices):
        model.patch_drop = None
    model.pos_embed = None
    if isinstance(model, Eva):
        model.rope = None
        model.rope_mixed = False
    model.__class__ = _HOSTS[type(model)]
    model.pe = enc
    model.pe_context = ctx
    model.pretrained_report = report
    _logger.info('vispe: converted %s to pe=%s: %s', label, enc.name, report)
    return model


# ---------------------------------------------------------------------- timm entrypoints
def _checkpoint_grid(model: nn.Module) -> Optional[Tuple[int, ...]]:
    """The token grid of the checkpoint timm loaded (its pretrained config's input size over the
    patch size), whose ``pos_embed`` timm's own filter resampled to the model's grid if they differ."""
    size = (getattr(model, 'pretrained_cfg', None) or {}).get('input_size')
    patch = tuple(model.patch_embed.patch_size)
    return tuple(s // p for s, p in zip(size[-2:], patch)) if size else None


def _load_export(fn: Callable[..., nn.Module], pe: PESpec, saved: PESpec, kwargs: Dict[str, Any]) -> nn.Module:
    """A checkpoint that `save_for_hf` wrote from a converted model (its ``model_args`` carry ``pe``): its
    state dict is the converted model's (the encoding's entries, no ``pos_embed``), so the whole model is
    built, converted, and loaded by timm's own loader (file or hub, classifier and input-channel
    adaptation); with ``features_only`` it is then wrapped as timm wraps ViTs, in its feature getter,
    since the pruning that wrapper does would otherwise come before the encoding's per-layer weights load."""
    if format_pe_spec(pe) != format_pe_spec(saved):
        raise ValueError(f'{fn.__name__}: the checkpoint was saved with pe={saved!r} and holds that encoding\'s '
                         f'weights; load it with pe={saved!r} (or without pe), not pe={pe!r}')
    features = kwargs.pop('features_only', False)
    feature_cfg = dict(kwargs.pop('feature_cfg', None) or {}, out_indices=kwargs.pop('out_indices', 3))
    model = fn(pretrained=False, **kwargs)
    convert(model, pe, name=fn.__name__)
    load_pretrained(model, num_classes=0 if features else model.num_classes, in_chans=kwargs.get('in_chans', 3))
    model.pretrained_report = LoadReport([], [], [])  # every entry came from the checkpoint
    if not features:
        return model
    wrapped = FeatureGetterNet(model, **feature_cfg)
    wrapped.pretrained_cfg = wrapped.default_cfg = pretrained_cfg_for_features(model.pretrained_cfg)
    return wrapped


def _wrap(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``fn`` accepting ``pe=``; without it, ``fn`` itself runs."""
    @functools.wraps(fn)
    def entrypoint(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        if 'pe' not in kwargs:
            return fn(pretrained=pretrained, **kwargs)
        pe = kwargs.pop('pe')
        # timm passes a local-dir / hub checkpoint's saved model_args on as pretrained_model_args
        saved = (kwargs.get('pretrained_model_args') or {}).get('pe')
        if pretrained and saved is not None:
            return _load_export(fn, pe, saved, kwargs)
        model = fn(pretrained=pretrained, **kwargs)
        # features_only=True: timm wraps the model, which serves forward_intermediates to the wrapper
        host = model.model if isinstance(model, FeatureGetterNet) else model
        convert(host, pe, name=fn.__name__, loaded_grid=_checkpoint_grid(host) if pretrained else None)
        return model
    entrypoint._vispe_original = fn
    return entrypoint


def _wrap_entrypoints() -> None:
    """Wrap every entrypoint of timm's ViT modules in timm's registry (idempotent). timm has no
    public call to replace an entrypoint; its registry maps names to functions in
    ``_model_entrypoints``, and the wrapper keeps each function's name, module and docstring."""
    for module in ZOO_MODULES:
        for name in timm.list_models(module=module):
            fn = _registry._model_entrypoints[name]
            if not hasattr(fn, '_vispe_original'):
                _registry._model_entrypoints[name] = _wrap(fn)


_wrap_entrypoints()
