"""Drift guards: vispe keeps copies of other libraries' forwards (timm's attention and block forwards in
`vispe.layers`, written again around `vispe.pe_attention`). Each copy is compared here with the installed
library's own forward on the same module and inputs; when timm changes a forward, the test fails and
names the copy to update.

Without an encoding (``pe=None``) a PE-aware module must compute exactly what its timm original computes,
in both of timm's attention paths (fused SDPA and explicit softmax), for every option that changes the
forward (qk-norm, scale norm, gates, layer scale, grouped-query heads, fused or separate projections)."""
import copy

import pytest
import timm
import torch
from timm.layers import Attention, AttentionRope, DiffAttention
from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm
from timm.models.vision_transformer import (
    Block, DiffParallelScalingBlock, ParallelScalingBlock, ParallelThingsBlock, ResPostBlock,
)
from torch import nn

from vispe.layers import ATTENTIONS, BLOCKS

DIM, HEADS = 32, 4
ALL = {**ATTENTIONS, **BLOCKS}

# timm class -> constructor options, one entry per forward branch worth covering
CASES = [
    (Attention, dict()), (Attention, dict(qkv_bias=True, qk_norm=True, scale_norm=True)),
    (Attention, dict(gated=True)),
    (AttentionRope, dict()), (AttentionRope, dict(qkv_fused=False, num_kv_heads=2, qk_norm=True, gated=True)),
    (EvaAttention, dict()), (EvaAttention, dict(qkv_bias_separate=True, qk_norm=True)),
    (EvaAttention, dict(qkv_fused=False, scale_norm=False)), (EvaAttention, dict(qkv_bias=False)),
    (DiffAttention, dict()), (DiffAttention, dict(qk_norm=True, dual_lambda=True, depth=3)),
    (Block, dict(init_values=0.5, qk_norm=True)), (Block, dict(scale_attn_norm=True, scale_mlp_norm=True)),
    (ResPostBlock, dict(init_values=0.5)),
    (ParallelThingsBlock, dict(num_parallel=2, init_values=0.5)),
    (ParallelScalingBlock, dict(qk_norm=True, init_values=0.5)), (ParallelScalingBlock, dict(proj_bias=False)),
    (DiffParallelScalingBlock, dict(qk_norm=True)),
    (EvaBlock, dict(init_values=0.5, swiglu_mlp=True, scale_mlp=True)), (EvaBlock, dict(attn_type='rope', qkv_fused=False, num_kv_heads=2)),
    (EvaBlockPostNorm, dict(swiglu_mlp=True)),
]


def _pe_aware(module: nn.Module) -> nn.Module:
    """A copy of ``module`` made PE-aware as vispe's hosts do: every timm block and attention inside it
    gets its vispe subclass (same parameters), nothing else changes."""
    twin = copy.deepcopy(module)
    for m in twin.modules():
        if type(m) in ALL:
            m.__class__ = ALL[type(m)]
    return twin


def _randomise(module: nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.parametrize('fused', [True, False], ids=['fused', 'explicit'])
@pytest.mark.parametrize('cls, options', CASES, ids=[f'{c.__name__}-{i}' for i, (c, _) in enumerate(CASES)])
def test_pe_aware_copy_computes_timms_own_forward(cls, options, fused):
    torch.manual_seed(0)
    if cls in ATTENTIONS:  # timm's attentions take no default norm for their qk / scale norms
        options = {'norm_layer': nn.LayerNorm, **options}
    module = cls(DIM, HEADS, **options).eval()
    _randomise(module)
    for m in module.modules():
        if hasattr(m, 'fused_attn'):
            m.fused_attn = fused
    ours = _pe_aware(module)
    x = torch.randn(2, 7, DIM)
    mask = torch.rand(2, 1, 7, 7) > 0.2
    mask[..., 0] = True  # every query keeps a key
    with torch.no_grad():
        for kwargs in (dict(), dict(attn_mask=mask)):
            want = module(x, **kwargs)
            got = ours(x, pe=None, **kwargs)
            copy_name = f'vispe.layers.{type(ours).__name__}'
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (
                f'{copy_name} no longer computes timm {timm.__version__} {cls.__module__}.{cls.__name__}.forward '
                f'(options {options}, {"fused" if fused else "explicit"} attention, mask {"attn_mask" in kwargs}): '
                f'max diff {(got - want).abs().max().item():.3g}; update the copy in vispe/layers.py')


def test_every_copied_class_is_covered():
    assert {c for c, _ in CASES} == set(ALL)
