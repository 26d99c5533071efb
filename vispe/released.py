"""Checkpoints released with encoding papers, loaded into vispe ViTs from a local file.

* Spiral RoPE's DeiT-III models (huajianduzhuo-code/Spiral_RoPE, ``RoPE_DeiT/models_v2.py``,
  ``deit_{small,base,large}_patch16_LS_rms_rope``): a DeiT-III ViT with LayerScale, RMSNorm, a
  learned absolute table on the patch tokens (none for the class token) and Spiral RoPE in every
  attention layer, the class token not rotated. Their state dict maps onto `vispe.VisionTransformer`
  with ``pe='learned+rope_spiral'``: ``blocks.i.gamma_{1,2}`` -> ``blocks.i.ls{1,2}.gamma``,
  ``*.scale`` (RMSNorm) -> ``*.weight``, ``pos_embed`` into the ``learned`` encoding; the rope's
  frequency buffer is checked against `rope_spiral`'s and not loaded (vispe computes it).
"""
from __future__ import annotations

import argparse
import math
import re
from functools import partial
from typing import Any, Dict, Literal, Mapping, Tuple, Union

import torch
from torch import nn

from .rotary import axial_frequencies
from .vit import VisionTransformer
from .weights import load_timm_checkpoint

__all__ = ['DeitRMSNorm', 'spiral_rope_deit', 'spiral_rope_deit_state_dict']


class DeitRMSNorm(nn.Module):
    """The RMSNorm of the DeiT-III models with Spiral RoPE: ``weight * x / (rms(x) + eps)``, eps outside
    the square root (timm's `RMSNorm` puts it inside, which differs where activations are small).

    Args:
        dim: normalised width.
        eps: added to the root mean square.
    """

    def __init__(self, dim: int, eps: float = 1e-6, device: Any = None, dtype: Any = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.norm(2, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
        return self.weight * x / (rms + self.eps)


_RENAMES = ((re.compile(r'^(blocks\.\d+)\.gamma_([12])$'), r'\1.ls\2.gamma'),
            (re.compile(r'^(.*norm\d?)\.scale$'), r'\1.weight'))
_ROPE_KEY = re.compile(r'^blocks\.\d+\.attn\.rope\.freqs$')


def _read(checkpoint: Union[str, Mapping[str, Any]], ema: bool) -> Dict[str, torch.Tensor]:
    if isinstance(checkpoint, str):
        # DeiT's training checkpoints also hold the run's argparse.Namespace: allow that type only
        with torch.serialization.safe_globals([argparse.Namespace]):
            checkpoint = torch.load(checkpoint, map_location='cpu', weights_only=True)
    key = 'model_ema' if ema else 'model'
    if key in checkpoint:
        checkpoint = checkpoint[key]
    elif ema:
        raise ValueError("ema=True but the checkpoint has no 'model_ema' entry")
    if 'cls_token' not in checkpoint or not any(_ROPE_KEY.match(k) for k in checkpoint):
        raise ValueError('not a Spiral RoPE DeiT checkpoint: expected cls_token and blocks.*.attn.rope.freqs keys')
    return dict(checkpoint)


def spiral_rope_deit_state_dict(checkpoint: Union[str, Mapping[str, Any]], *, num_directions: int = 4,
                                same_freqs: bool = False, theta: float = 10000.0, ema: bool = False
                                ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A released Spiral RoPE DeiT state dict (path, full checkpoint or state dict) in vispe / timm key
    names, and the model arguments it implies (sizes, ``pe`` spec).

    The frequency buffer holds neither the number of directions nor whether they share frequencies,
    so those are arguments (released defaults: 4 directions, own frequencies); its values give
    ``max_freq`` and the truncated share and are checked against ``theta``.

    Raises:
        ValueError: not such a checkpoint, or its frequencies disagree with the arguments.
    """
    sd = _read(checkpoint, ema)
    freqs = [sd.pop(k) for k in sorted(k for k in list(sd) if _ROPE_KEY.match(k))]
    ref = freqs[0].double()
    if any(not torch.equal(f, freqs[0]) for f in freqs):
        raise ValueError('the layers of this checkpoint have different rope frequencies; rope_spiral shares one table')
    count = ref.numel()
    head_dim = 4 * count * (num_directions // 2 if same_freqs else 1)
    embed_dim = sd['cls_token'].shape[-1]
    if num_directions < 2 or num_directions % 2 or embed_dim % head_dim:
        raise ValueError(f'num_directions={num_directions}, same_freqs={same_freqs} give head_dim={head_dim} from '
                         f'{count} rope frequencies, which does not divide the width {embed_dim}')
    zeros = int((ref == 0).sum())
    truncate = (zeros + 0.5) / count if zeros else 0.0  # int(count * truncate) == zeros, as released
    max_freq = float(ref[0])
    expected = max_freq * axial_frequencies(count, theta, step=2.0, dim=2 * count, dtype=torch.float64)
    expected[count - zeros:] = 0.0
    if not torch.allclose(expected, ref, rtol=1e-4, atol=0.0):
        raise ValueError(f'the checkpoint rope frequencies {ref[:4].tolist()}... are not max_freq * theta^(-2k/E) '
                         f'with theta={theta}: pass the theta it was trained with')
    for pattern, repl in _RENAMES:
        sd = {pattern.sub(repl, k): v for k, v in sd.items()}
    depth = 1 + max(int(k.split('.')[1]) for k in sd if k.startswith('blocks.'))
    patch = sd['patch_embed.proj.weight'].shape[-1]
    side = math.isqrt(sd['pos_embed'].shape[1])
    spec = {'name': 'rope_spiral', 'num_directions': num_directions, 'max_freq': max_freq, 'theta': theta,
            'same_freqs': same_freqs, 'truncate': truncate}
    args = dict(pe=['learned', spec], img_size=side * patch, patch_size=patch, embed_dim=embed_dim, depth=depth,
                num_heads=embed_dim // head_dim, mlp_ratio=sd['blocks.0.mlp.fc1.weight'].shape[0] / embed_dim,
                qkv_bias='blocks.0.attn.qkv.bias' in sd, num_classes=sd['head.weight'].shape[0],
                class_token=True, no_embed_class=True, global_pool='token', init_values=1e-4,
                norm_layer=partial(DeitRMSNorm, eps=1e-6))
    return sd, args


def spiral_rope_deit(checkpoint: Union[str, Mapping[str, Any]], *, num_directions: int = 4, same_freqs: bool = False,
                     theta: float = 10000.0, corners: Literal['clamp', 'linear'] = 'clamp', ema: bool = False,
                     **kwargs: Any) -> VisionTransformer:
    """A vispe ViT holding a released Spiral RoPE DeiT checkpoint (a local ``checkpoint.pth`` of
    huajianduzhuo-code/Spiral_RoPE, its ``model`` or ``model_ema`` entry, or a state dict).

    ``corners='clamp'`` (default) computes the angles as the released code does, so the logits are
    the original model's; ``'linear'`` gives the exactly shift-invariant form (`RopeSpiral`).
    ``kwargs`` override the model arguments. The model takes other input sizes as it is (timm's
    ``dynamic_img_size``): the rope interpolates positions to the training grid, as released, and
    the learned table is resampled.

    Example:
        >>> model = spiral_rope_deit('deit_small_patch16_LS_rms_rope/checkpoint.pth').eval()  # doctest: +SKIP
    """
    sd, args = spiral_rope_deit_state_dict(checkpoint, num_directions=num_directions, same_freqs=same_freqs,
                                           theta=theta, ema=ema)
    args['pe'][1]['corners'] = corners
    model = VisionTransformer(**dict(args, **kwargs))
    load_timm_checkpoint(model, sd)
    return model
