"""timm's attention modules and blocks, PE-aware: the same parameters and names, a forward that
hands the prepared encoding (`PreparedPE`) to `vispe.pe_attention`.

Each class subclasses its timm original; a host becomes PE-aware by swapping the ``__class__`` of
its blocks and attention modules (`BLOCKS`, `ATTENTIONS`), so every weight stays where it was and
timm checkpoints load unchanged. The forwards are timm's, written again around `pe_attention`, in
three shapes: the standard attentions share `_PEAttentionForward` (their own q, k, v projections,
`_project`, then `pe_attention`, then the module's own output path); the differential attentions share
`_PEDifferential`; the ViT-22B parallel blocks are their own attention. Blocks take
``(x, pe=, attn_mask=, is_causal=)`` and pass the prepared encoding to their attention. Each copy is
compared with the installed timm's forward by tests/test_drift.py, which names the copy when timm
changes.

Kept: ``Attention``, ``EvaAttention`` (fused or separate q/k/v, ``q_bias`` / ``v_bias``),
``AttentionRope`` (grouped-query: k and v are repeated to every head before the encoding acts, so
per-head encodings see one key per head), ``DiffAttention`` and ``DiffParallelScalingBlock``
(differential attention, see `_PEDifferential`); blocks ``Block``, ``ResPostBlock``,
``ParallelScalingBlock``, ``ParallelThingsBlock`` (its parallel attentions share the block's layer
index), ``EvaBlock``, ``EvaBlockPostNorm``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from timm.layers import Attention, AttentionRope, DiffAttention
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.vision_transformer import (
    Block, DiffParallelScalingBlock, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock,
)
from torch import nn

from .attention import pe_attention
from .contract import PreparedPE

# torch.fx (timm's feature_cls='fx', create_feature_extractor) records each call of pe_attention made
# here as one opaque call: the dispatch branches on the prepared encoding and on shapes
torch.fx.wrap('pe_attention')

__all__ = ['PEAttention', 'PEEvaAttention', 'PEAttentionRope', 'PEDiffAttention', 'PEBlock', 'PEResPostBlock',
           'PEParallelThingsBlock', 'PEParallelScalingBlock', 'PEDiffParallelScalingBlock', 'PEEvaBlock',
           'PEEvaBlockPostNorm', 'BLOCKS', 'ATTENTIONS', 'attentions', 'is_differential']


def _attend(module: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pe: Optional[PreparedPE],
            x: torch.Tensor, attn_mask: Optional[torch.Tensor], is_causal: bool, dropout_p: float) -> torch.Tensor:
    """`pe_attention` with a timm attention module's scale, dropout and fused / explicit choice."""
    options: Dict[str, Any] = dict(x=x, attn_mask=attn_mask, dropout_p=dropout_p if module.training else 0.0,
                                   scale=module.scale, is_causal=is_causal, force_explicit=not module.fused_attn)
    return pe_attention(q, k, v, pe, module.layer_index, **options)


# ---------------------------------------------------------------------- attention
class _PEAttentionForward:
    """The forward every PE-aware timm attention shares: its own q, k, v (`_project`, after q/k norm),
    `pe_attention` on them, then the module's own output path (scale norm, gate, projection)."""
    layer_index: int = 0

    def _project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        """``x`` ``(B, N, C)``; ``pe``: the encoding prepared for this forward (None: plain attention)."""
        B, N = x.shape[:2]
        q, k, v = self._project(x)
        o = _attend(self, q, k, v, pe, x, attn_mask, is_causal, self.attn_drop.p)
        o = self.norm(o.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim))
        if self.gate is not None:
            o = o * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(o))


class PEAttention(_PEAttentionForward, Attention):
    """timm's `Attention` (same parameters, names and options) with a positional encoding's hooks.

    Built directly (an attention layer of your own model) it takes timm's arguments and
    ``layer_index``, the layer whose per-layer encoding parameters it uses; its forward takes the
    encoding prepared for the forward: ``attn(x, pe=encoding.prepare(pos))``.
    """

    def __init__(self, *args: Any, layer_index: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layer_index = layer_index

    def _project(self, x):
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        return self.q_norm(q), self.k_norm(k), v


class PEEvaAttention(_PEAttentionForward, EvaAttention):
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


class PEAttentionRope(_PEAttentionForward, AttentionRope):
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
    maps (`vispe.convert` refuses it)."""
    layer_index: int = 0

    def _differential(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      pe: Optional[PreparedPE], attn_mask: Optional[torch.Tensor], is_causal: bool) -> torch.Tensor:
        """``(B, N, C)`` from q, k ``(B, 2H, N, hd)`` and v ``(B, H, N, 2hd)``."""
        B, N = x.shape[:2]
        lambda_full = self._compute_lambda().type_as(q)
        o = _attend(self, q, k, v.repeat_interleave(2, dim=1), pe, x, attn_mask, is_causal, self.attn_drop_p)
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

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        q, k, v = self._qkv_heads(*self.qkv(x).chunk(3, dim=2))
        o = self._differential(x, q, k, v, pe, attn_mask, is_causal)
        return self.proj_drop(self.proj(self.norm(o)))


# ---------------------------------------------------------------------- blocks
class PEBlock(Block):
    """timm's pre-norm `Block` whose attention receives the prepared encoding."""

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), pe=pe, attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


class PEResPostBlock(ResPostBlock):
    """timm's post-norm `ResPostBlock` whose attention receives the prepared encoding."""

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x = x + self.drop_path1(self.norm1(self.attn(x, pe=pe, attn_mask=attn_mask, is_causal=is_causal)))
        return x + self.drop_path2(self.norm2(self.mlp(x)))


class PEParallelThingsBlock(ParallelThingsBlock):
    """timm's `ParallelThingsBlock` (parallel attentions, then parallel MLPs); its attentions share
    the block's layer index."""

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x = x + torch.stack([a.drop_path(a.ls(a.attn(a.norm(x), pe=pe, attn_mask=attn_mask, is_causal=is_causal)))
                             for a in self.attns]).sum(0)
        return x + torch.stack([ffn(x) for ffn in self.ffns]).sum(dim=0)


class PEParallelScalingBlock(ParallelScalingBlock):
    """timm's `ParallelScalingBlock` (ViT-22B: attention and MLP from one fused input projection)
    with the encoding's hooks in its attention."""
    layer_index: int = 0

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        B, N, C = x.shape
        y = self.in_norm(x)
        x_mlp, q, k, v = torch.split(self.in_proj(y), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            x_mlp = x_mlp + self.mlp_bias
        q = self.q_norm(q.view(B, N, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(k.view(B, N, self.num_heads, self.head_dim)).transpose(1, 2)
        v = v.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
        x_attn = _attend(self, q, k, v, pe, y, attn_mask, is_causal, self.attn_drop.p)
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

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        y = self.in_norm(x)
        x_mlp, q, k, v = torch.split(self.in_proj(y), self.in_split, dim=-1)
        if self.mlp_bias is not None:
            x_mlp = x_mlp + self.mlp_bias
        x_attn = self._differential(y, *self._qkv_heads(q, k, v), pe, attn_mask, is_causal)
        x_mlp = self.mlp_drop(self.mlp_act(x_mlp))
        y = self.out_proj(torch.cat((x_attn, x_mlp), dim=-1))
        return x + self.drop_path(self.ls(y))


class PEEvaBlock(EvaBlock):
    """timm's pre-norm `EvaBlock` (SwiGLU, layer scale ``gamma_1`` / ``gamma_2``, qk-norm, scale
    norm) whose attention receives the prepared encoding instead of a rope table."""

    def forward(self, x: torch.Tensor, pe: Optional[PreparedPE] = None, attn_mask: Optional[torch.Tensor] = None,
                is_causal: bool = False) -> torch.Tensor:
        x_attn = self.attn(self.norm1(x), pe=pe, attn_mask=attn_mask, is_causal=is_causal)
        if self.gamma_1 is not None:
            x_attn = self.gamma_1 * x_attn
        x = x + self.drop_path1(x_attn)
        x_mlp = self.mlp(self.norm2(x))
        if self.gamma_2 is not None:
            x_mlp = self.gamma_2 * x_mlp
        return x + self.drop_path2(x_mlp)


class PEEvaBlockPostNorm(EvaBlockPostNorm):
    """timm's post-norm `EvaBlockPostNorm` whose attention receives the prepared encoding (its layout
    and forward are `ResPostBlock`'s)."""
    forward = PEResPostBlock.forward


BLOCKS: Dict[Type[nn.Module], Type[nn.Module]] = {
    Block: PEBlock, ResPostBlock: PEResPostBlock, ParallelThingsBlock: PEParallelThingsBlock,
    ParallelScalingBlock: PEParallelScalingBlock, DiffParallelScalingBlock: PEDiffParallelScalingBlock,
    EvaBlock: PEEvaBlock, EvaBlockPostNorm: PEEvaBlockPostNorm,
}
"""timm block class -> its PE-aware subclass."""
ATTENTIONS: Dict[Type[nn.Module], Type[nn.Module]] = {
    Attention: PEAttention, EvaAttention: PEEvaAttention, AttentionRope: PEAttentionRope,
    DiffAttention: PEDiffAttention,
}
"""timm attention class -> its PE-aware subclass."""
_PARALLEL = (ParallelScalingBlock, DiffParallelScalingBlock)  # blocks that are their own attention


def attentions(block: nn.Module) -> List[nn.Module]:
    """The attention modules of a block (the block itself for the parallel scaling blocks)."""
    if isinstance(block, _PARALLEL):
        return [block]
    if isinstance(block, ParallelThingsBlock):
        return [a.attn for a in block.attns]
    return [block.attn]


def is_differential(attn: nn.Module) -> bool:
    """Whether an attention module is a differential one (2H q/k heads of width hd)."""
    return isinstance(attn, (DiffAttention, DiffParallelScalingBlock))
