"""PE-aware attention: the encoding's hooks around one SDPA dispatch.

`pe_attention` is the shared core that every host (the timm layers of `vispe.layers`, DETR, a
resampler, a user's own attention) calls after its own projections, with the encoding prepared for
the forward (`PreparedPE`, from ``pe.prepare(pos)``). The dispatch reads the encoding's declared
`Capabilities` once per call and keeps the fastest kernel they allow:

* no bias and no weights term (``flash_eligible``): plain SDPA (flash / memory-efficient eligible);
* an additive bias: SDPA with a float ``attn_mask`` (on CPU, a bias that needs a gradient takes
  the explicit path, which is faster there than SDPA's math fallback);
* an encoding that needs the attention weights (``needs_weights``): explicit softmax attention;
* a bias the encoding offers as a FlexAttention ``score_mod`` (`PositionalEncoding.score_mod`, e.g.
  LookHere's ``kernel='flex'``): FlexAttention, which never materialises the ``N x N`` bias (not with
  dropout, ``force_explicit`` or a weights term, nor on the CPU where gradients are needed: FlexAttention
  has no CPU backward; these take the dense bias).

The attention's input tokens reach the q/k map only of an encoding that declares ``needs_tokens``.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .contract import PositionalEncoding, PreparedPE

__all__ = ['pe_attention', 'merge_masks']


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


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    # eager FlexAttention materialises the scores it exists to avoid: outside a compiled region it runs
    # compiled (one compilation per shape, on first use)
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def _flex_lacks_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """FlexAttention has no backward on the CPU: a CPU attention that needs gradients takes the dense bias."""
    return q.device.type == 'cpu' and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad
                                                                    or v.requires_grad)


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod: Callable[..., torch.Tensor],
                    attn_mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """FlexAttention with an encoding's ``score_mod`` and the host's mask folded into it."""
    if attn_mask is not None:
        mask = merge_masks(attn_mask, None, q.dtype)
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        encoding_mod = score_mod

        def score_mod(score, b, h, q_idx, kv_idx):
            return encoding_mod(score, b, h, q_idx, kv_idx) + mask[b, h, q_idx, kv_idx]

    if torch.compiler.is_compiling():
        from torch.nn.attention.flex_attention import flex_attention
        return flex_attention(q, k, v, score_mod=score_mod, scale=scale)
    return _compiled_flex_attention()(q, k, v, score_mod=score_mod, scale=scale)


# torch.fx traces a host through this function as one opaque call: the hooks read positions and state
@torch.fx.wrap
def pe_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pe: Optional[PreparedPE] = None,
        layer: int = 0,
        *,
        x: Optional[torch.Tensor] = None,
        attn_mask: Optional[torch.Tensor] = None,
        dropout_p: float = 0.0,
        scale: Optional[float] = None,
        is_causal: bool = False,
        force_explicit: bool = False,
) -> torch.Tensor:
    """Attention ``(B, H, Nq, hd)`` with every hook of the prepared encoding ``pe`` applied.

    Args:
        q, k, v: ``(B, H, N, hd)`` projections (after any q/k norm).
        pe: the encoding prepared for this forward (``encoding.prepare(pos_q, pos_k)``); None for
            plain attention. q and k must have its positions' token counts (checked: a clear error
            instead of a broadcast failure inside a hook).
        layer: index of this attention layer (per-layer parameters).
        x: the attention's normed input tokens; handed to the q/k map only of an encoding that declares
            ``needs_tokens`` (required for it).
        attn_mask: bool (True = attend) or additive float mask, broadcastable to ``(B, H, Nq, Nk)``.
        dropout_p: attention dropout (pass 0 in eval).
        scale: logit scale, default ``hd ** -0.5`` of the *original* head dim.
        is_causal: causal masking (not combinable with ``attn_mask`` or a bias).
        force_explicit: use the explicit softmax path (reference / tests).

    Raises:
        TypeError: ``pe`` is an encoding rather than a prepared one.
        ValueError: q or k do not have the token counts of the positions ``pe`` was prepared for; an
            encoding that reads the input tokens without ``x``; ``is_causal`` with a mask or a bias.
    """
    if isinstance(pe, PositionalEncoding):
        raise TypeError(f'pe_attention takes the encoding prepared for this forward: pe_attention(q, k, v, '
                        f'pe.prepare(pos), layer), not the encoding {pe.name!r} itself')
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    caps = pe.capabilities if pe is not None else None
    bias = score_mod = None
    if caps is not None:
        pe.check_tokens(q, k)
        if 'qk' in caps.hooks:
            if caps.needs_tokens and x is None:
                raise ValueError(f'encoding {pe.encoding.name!r} reads the attention input tokens (needs_tokens): '
                                 'pass x= to pe_attention')
            q_in = q
            q, k = pe.qk(q, k, layer, x=x if caps.needs_tokens else None)
            if (v.requires_grad and torch.is_grad_enabled() and q is not q_in and v._base is not None
                    and v._base is q_in._base):
                # v is a view of the fused projection q came from: once a q/k map has made new q and k,
                # v saved for backward can be all that keeps the whole projection alive (unless the map
                # saved the old q or k itself); a copy of v lets the projection go
                v = v.clone()
        if 'value' in caps.hooks:
            v = pe.value(v, layer)
        if 'bias' in caps.hooks:
            if not (caps.needs_weights or force_explicit or dropout_p > 0 or is_causal
                    or _flex_lacks_backward(q, k, v)):
                score_mod = pe.score_mod(layer, q.dtype)
            if score_mod is None:
                bias = pe.bias(q, k, layer)
    if score_mod is not None:
        o = _flex_attention(q, k, v, score_mod, attn_mask, scale)
        return pe.output(o, layer) if 'output' in caps.hooks else o
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
            o = o + pe.weights_value(attn, layer)
    else:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                           scale=scale)
    if caps is not None and 'output' in caps.hooks:
        o = pe.output(o, layer)
    return o
