"""Point tokens with 3D coordinates through the attention layers (point-cloud transformers)."""
import pytest
import torch

import vispe


def point_cloud(seed: int = 0, batch: int = 2, n: int = 10):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, 3, generator=g) * 4, torch.randn(batch, n, 32, generator=g)


@pytest.mark.parametrize('spec', ['rope_axial', 'gta'])
def test_point_tokens_attention_is_invariant_to_a_translation_of_the_cloud(spec):
    # the documented recipe: positions = vispe.points(xyz), one prepare per forward, PEAttention per layer
    xyz, x = point_cloud()
    pe = vispe.create_pe(spec, dim=32, num_heads=2)
    attn = vispe.PEAttention(32, num_heads=2)
    out = attn(x, pe=pe.prepare(vispe.points(xyz)))
    moved = attn(x, pe=pe.prepare(vispe.points(xyz + torch.tensor([5.0, -2.0, 0.5]))))
    torch.testing.assert_close(out, moved, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(out, attn(x), atol=1e-3)  # the coordinates do enter the attention


def test_point_tokens_are_permutation_equivariant_and_accept_a_class_token():
    xyz, x = point_cloud(seed=1)
    cls = torch.randn(2, 1, 32)
    pe = vispe.create_pe('rope_axial', dim=32, num_heads=2)
    attn = vispe.PEAttention(32, num_heads=2)
    out = attn(torch.cat([cls, x], 1), pe=pe.prepare(vispe.points(xyz, num_prefix=1)))
    perm = torch.randperm(10)
    out_p = attn(torch.cat([cls, x[:, perm]], 1), pe=pe.prepare(vispe.points(xyz[:, perm], num_prefix=1)))
    torch.testing.assert_close(out_p[:, 1:], out[:, 1 + perm], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_p[:, 0], out[:, 0], atol=1e-5, rtol=1e-5)


def test_point_tokens_with_pe_attention_and_own_projections():
    # a host with its own q/k/v projections calls pe_attention directly
    xyz, x = point_cloud(seed=2, batch=1)
    pe = vispe.create_pe('rope_axial:theta=10', dim=32, num_heads=2)
    state = pe.prepare(vispe.points(xyz))
    q, k, v = (torch.nn.Linear(32, 32)(x).reshape(1, 10, 2, 16).transpose(1, 2) for _ in range(3))
    o = vispe.pe_attention(q, k, v, state)
    o.sum().backward()
    assert o.shape == (1, 2, 10, 16)
