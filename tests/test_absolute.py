"""Absolute baselines: MAE sin-cos values by hand, timm's learned table semantics, NoPE."""
import math

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed

import vispe
from conftest import TINY


def test_sincos_mae_values_by_hand():
    """MAE: channels [sin(x w), cos(x w)] then [sin(y w), cos(y w)], w_k = 1/10000^(k/(D/4)); class token zeros."""
    pe = vispe.create_pe('sincos', dim=8, grid_size=(2, 3), num_prefix_tokens=1)
    emb = pe.embedding(vispe.grid(2, 3, num_prefix=1))[0]
    assert emb.shape == (7, 8)
    assert torch.all(emb[0] == 0)
    row, col = 1, 2
    w = [1.0, 1 / 10000 ** 0.5]
    expect = [math.sin(col * w[0]), math.sin(col * w[1]), math.cos(col * w[0]), math.cos(col * w[1]),
              math.sin(row * w[0]), math.sin(row * w[1]), math.cos(row * w[0]), math.cos(row * w[1])]
    torch.testing.assert_close(emb[1 + row * 3 + col], torch.tensor(expect))


def test_sincos_big_vision_layout_by_hand():
    """big_vision posemb_sincos_2d: w_k = 1/10000^(k/(D/4 - 1))."""
    pe = vispe.create_pe('sincos:layout=big_vision', dim=8, grid_size=(2, 2))
    emb = pe.embedding(vispe.grid(2, 2))[0]
    x, y = 1, 1
    w = [1.0, 1e-4]
    expect = [math.sin(x * w[0]), math.sin(x * w[1]), math.cos(x * w[0]), math.cos(x * w[1]),
              math.sin(y * w[0]), math.sin(y * w[1]), math.cos(y * w[0]), math.cos(y * w[1])]
    torch.testing.assert_close(emb[3], torch.tensor(expect))


def test_sincos_normalized_mode_interpolates():
    pe = vispe.create_pe('sincos:grid_mode=normalized', dim=16, grid_size=(4, 4))
    small = pe.embedding(vispe.grid(4, 4))[0].reshape(4, 4, 16)
    big = pe.embedding(vispe.grid(8, 8, train_grid=(4, 4)))[0].reshape(8, 8, 16)
    torch.testing.assert_close(big[::2, ::2], small)  # every other token sits on the trained coordinates


def test_learned_table_resamples_like_timm():
    pe = vispe.create_pe('learned', dim=16, grid_size=(4, 4), num_prefix_tokens=1)
    got = pe.embedding(vispe.grid(6, 8, num_prefix=1))
    expect = resample_abs_pos_embed(pe.pos_embed, new_size=[6, 8], old_size=[4, 4], num_prefix_tokens=1)
    torch.testing.assert_close(got, expect)
    assert got.shape == (1, 1 + 48, 16)


def test_learned_without_prefix_rows_pads_zeros_for_class_token():
    m = timm.create_model('vit_tiny', pe='learned', no_embed_class=True, **TINY)
    assert m.pe.pos_embed.shape == (1, 16, TINY['embed_dim'])
    emb = m.pe.embedding(vispe.grid(4, 4, num_prefix=1))
    assert torch.all(emb[:, 0] == 0)


def test_learned_3d_grid_resamples_trilinearly():
    pe = vispe.create_pe('learned', dim=8, grid_size=(2, 2, 2))
    out = pe.embedding(vispe.grid(4, 2, 2))
    assert out.shape == (1, 16, 8)


def test_nope_model_is_permutation_equivariant():
    """Without class token and position, permuting the patches permutes the tokens (the NoPE baseline)."""
    m = timm.create_model('vit_tiny', pe='none', class_token=False, global_pool='avg', **TINY).eval()
    x = torch.randn(1, 3, 32, 32)
    perm = torch.randperm(16)
    patches = x.reshape(1, 3, 4, 8, 4, 8).permute(0, 2, 4, 1, 3, 5).reshape(1, 16, 3, 8, 8)
    xp = patches[:, perm].reshape(1, 4, 4, 3, 8, 8).permute(0, 3, 1, 4, 2, 5).reshape(1, 3, 32, 32)
    with torch.no_grad():
        f, fp = m.forward_features(x), m.forward_features(xp)
    torch.testing.assert_close(fp, f[:, perm], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('pe', ['learned', 'sincos', 'rope_axial'])
def test_position_aware_models_are_not_permutation_equivariant(pe):
    m = timm.create_model('vit_tiny', pe=pe, class_token=False, global_pool='avg', **TINY).eval()
    x = torch.randn(1, 3, 32, 32)
    xp = x.flip(-1).flip(-2)
    with torch.no_grad():
        a = m.forward_features(x)
        b = m.forward_features(xp)
    # tokens of the flipped image, flipped back: equal only if position were ignored
    b = b.reshape(1, 4, 4, -1).flip(1).flip(2).reshape(1, 16, -1)
    assert (a - b).abs().max() > 1e-3
