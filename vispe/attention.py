"""PE-aware attention: timm's `Attention` parameters, the encoding hooks, and one SDPA dispatch.

`pe_attention` is the shared core that any host (this ViT, DETR, a resampler) calls after its own
projections; `PEAttention` is timm's self-attention module with it inside. The dispatch reads the
encoding's declared `Capabilities` once per call and keeps the fastest kernel they allow:

* no bias and no weights term (``flash_eligible``): plain SDPA (flash / memory-efficient eligible);
* an additive bias: SDPA with a float ``attn_mask`` (on CPU, a bias that needs a gradient takes
  the explicit path, which is faster there than SDPA's math fallback);
* an encoding that needs the attention weights (``needs_weights``): explicit softmax attention.

The attention's input tokens reach the q/k map only of an encoding that declares ``needs_tokens``.
"""
from __future__ import annotations

from typing import Any, Optional, Type

import torch
import torch.nn.functional as F
from timm.layers import use_fused_attn
from torch import nn

from .encodings.base import PositionalEncoding
from .positions import Positions

__all__ = ['pe_attention', 'PEAttention', 'merge_masks']


def merge_masks(attn_mask: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Combine a user mask (bool: True = attend, or additive float) with an additive bias."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill(
            ~attn_mask, float('-inf'))
    if bias is None:
        return attn_mask
    bias = bias.to(dtype)
    while bias.dim() < 4:  # CPU SDPA is several times slower with a 3D mask than with a 4D one
        bias = bias.unsqueeze(0)
    return bias if attn_mask is None else bias + attn_mask


def _check_token_counts(q: torch.Tensor, k: torch.Tensor, pos_q: Positions, pos_k: Optional[Positions]) -> None:
    for name, t, pos in (('q', q, pos_q), ('k', k, pos_q if pos_k is None else pos_k)):
        if t.shape[-2] != pos.num_tokens:
            raise ValueError(
                f'the positions of {name} describe {pos.num_tokens} tokens ({pos.num_prefix} prefix + '
                f'{pos.coords.shape[-2]} positioned) but {name} has {t.shape[-2]} (q: {q.shape[-2]}, k: '
                f'{k.shape[-2]}); build the positions for the tokens attention sees, prefix tokens included '
                f'(num_prefix=...)')


# torch.fx traces a host through this function as one opaque call: the hooks read positions and state
@torch.fx.wrap
def pe_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pe: Optional[PositionalEncoding] = None,
        state: Any = None,
        layer: int = 0,
        x: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        scale: Optional[float] = None,
        is_causal: bool = False,
        force_explicit: bool = False,
        pos_q: Optional[Positions] = None,
        pos_k: Optional[Positions] = None,
) -> torch.Tensor:
    """Attention ``(B, H, Nq, hd)`` with every hook of ``pe`` applied.

    Args:
        q, k, v: ``(B, H, N, hd)`` projections (after any q/k norm).
        pe: the encoding (or composition); None for plain attention.
        state: ``pe.prepare(...)``'s result for this forward.
        layer: index of this attention layer (per-layer parameters).
        x: the attention's normed input tokens; handed to the q/k map only of an encoding that declares
            ``needs_tokens`` (required for it).
        attn_mask: bool (True = attend) or additive float mask, broadcastable to ``(B, H, Nq, Nk)``.
        dropout_p: attention dropout (pass 0 in eval).
        scale: logit scale, default ``hd ** -0.5`` of the *original* head dim.
        is_causal: causal masking (not combinable with ``attn_mask`` or a bias).
        force_explicit: use the explicit softmax path (reference / tests).
        pos_q, pos_k: the positions ``state`` was prepared from (``pos_k`` defaults to ``pos_q``, as in
            ``prepare``); when given, their token counts are checked against q and k, a clear error
            instead of a broadcast failure inside a hook.
    """
    if pos_q is not None:
        _check_token_counts(q, k, pos_q, pos_k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    caps = pe.capabilities if pe is not None else None
    bias = None
    if caps is not None:
        if 'qk' in caps.hooks:
            if caps.needs_tokens and x is None:
                raise ValueError(f'encoding {pe.name!r} reads the attention input tokens (needs_tokens): pass x= '
                                 f'to pe_attention')
            q_in = q
            q, k = pe.qk(q, k, state, layer, x=x if caps.needs_tokens else None)
            if (v.requires_grad and torch.is_grad_enabled() and q is not q_in and v._base is not None
                    and v._base is q_in._base):
                # v is a view of the fused projection q came from: once a q/k map has made new q and k,
                # v saved for backward can be all that keeps the whole projection alive (unless the map
                # saved the old q or k itself); a copy of v lets the projection go
                v = v.clone()
        if 'value' in caps.hooks:
            v = pe.value(v, state, layer)
        if 'bias' in caps.hooks:
            bias = pe.bias(q, k, state, layer)
    weights_term = caps is not None and caps.needs_weights
    mask = merge_masks(attn_mask, bias, q.dtype)
    if is_causal and mask is not None:
        raise ValueError('is_causal cannot be combined with attn_mask or a bias encoding')

    # CPU SDPA falls back to a math kernel slower than the explicit path when the mask needs a gradient
    explicit = weights_term or force_explicit or (
        mask is not None and mask.requires_grad and q.device.type == 'cpu')
    if explicit:
        logits = (q * scale) @ k.transpose(-2, -1)
        if is_causal:
            nq, nk = logits.shape[-2:]
            logits = logits.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(1 + nk - nq),
                                        float('-inf'))
        if mask is not None:
            logits = logits + mask
        attn = logits.softmax(dim=-1)
        if dropout_p > 0:
            attn = F.dropout(attn, p=dropout_p)
        o = attn @ v
        if weights_term:
            o = o + pe.weights_value(attn, state, layer)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                           scale=scale)
    if caps is not None and 'output' in caps.hooks:
        o = pe.output(o, state, layer)
    return o


class PEAttention(nn.Module):
    """timm's multi-head self-attention with positional-encoding hooks.

    Parameter names (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``proj``) equal timm's
    `timm.layers.Attention`, so timm ViT checkpoints load unchanged. As there, ``fused_attn`` is
    timm's `use_fused_attn()` at construction (``TIMM_FUSED_ATTN=0``, `timm.layers.set_fused_attn`,
    exportable mode): False takes the explicit softmax path.

    Args:
        dim: token width.
        num_heads: attention heads.
        attn_head_dim: per-head width (default ``dim // num_heads``).
        dim_out: output width (default ``dim``).
        qkv_bias: bias on the qkv projection.
        qk_norm: normalise q and k per head.
        scale_norm: normalise the attention output before the projection.
        proj_bias: bias on the output projection.
        attn_drop: dropout on the attention weights.
        proj_drop: dropout after the projection.
        norm_layer: norm for ``qk_norm`` / ``scale_norm``.
        layer_index: this layer's index, used to pick per-layer encoding parameters.
    """

    def __init__(
            self,
            dim: int,
            num_heads: int = 8,
            attn_head_dim: Optional[int] = None,
            dim_out: Optional[int] = None,
            qkv_bias: bool = False,
            qk_norm: bool = False,
            scale_norm: bool = False,
            proj_bias: bool = True,
            attn_drop: float = 0.,
            proj_drop: float = 0.,
            norm_layer: Optional[Type[nn.Module]] = None,
            layer_index: int = 0,
            device=None,
            dtype=None,
    ) -> None:
        super().__init__()
        dd = {'device': device, 'dtype': dtype}
        dim_out = dim_out or dim
        head_dim = attn_head_dim
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f'dim={dim} must be divisible by num_heads={num_heads}')
            head_dim = dim // num_heads
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError('norm_layer must be given when qk_norm or scale_norm is set')
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim ** -0.5
        self.layer_index = layer_index
        self.fused_attn = use_fused_attn()  # as timm's Attention: False selects the explicit softmax path

        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.proj = nn.Linear(self.attn_dim, dim_out, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
            self,
            x: torch.Tensor,
            pe: Optional[PositionalEncoding] = None,
            state: Any = None,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
            pos: Optional[Positions] = None,
    ) -> torch.Tensor:
        """``x`` ``(B, N, C)``; ``state`` is ``pe.prepare(pos)``, and ``pos`` (optional) is checked
        against the N tokens."""
        B, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        o = pe_attention(
            q, k, v, pe, state, self.layer_index, x=x, attn_mask=attn_mask,
            dropout_p=self.attn_drop.p if self.training else 0.0, scale=self.scale, is_causal=is_causal,
            force_explicit=not self.fused_attn, pos_q=pos)
        o = o.transpose(1, 2).reshape(B, N, self.attn_dim)
        return self.proj_drop(self.proj(self.norm(o)))
