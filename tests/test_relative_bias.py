"""2D ALiBi and the Swin relative position bias: slopes, distances, timm's index / resize as references."""
import math

import pytest
import timm
import torch
from timm.layers.pos_embed_rel import gen_relative_position_index, resize_rel_pos_bias_table_simple

import vispe
from vispe.attention import pe_attention
from vispe.encodings.relative_bias import alibi_slopes, swin_relative_position_index
from vispe.registry import create_pe


# ---------------------------------------------------------------------- ALiBi
def test_alibi_slopes_power_of_two_heads_are_geometric():
    assert alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    assert alibi_slopes(4).tolist() == [2.0 ** -(2 * (i + 1)) for i in range(4)]


def test_alibi_slopes_other_head_counts_interleave_the_next_power_of_two():
    # 6 heads: the 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8, then the odd 8-head slopes 2^-1, 2^-3
    assert alibi_slopes(6).tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    # 12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 from the 16-head sequence
    expected = [2.0 ** -(i + 1) for i in range(8)] + [2.0 ** -(0.5 + i) for i in range(4)]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected))


def test_alibi2d_bias_is_minus_slope_times_euclidean_distance_and_zero_for_prefix_tokens():
    pe = create_pe('alibi2d', dim=32, num_heads=4, grid_size=(3, 4), num_prefix_tokens=1)
    q = torch.zeros(1)
    bias = pe.prepare(vispe.grid(3, 4, num_prefix=1)).bias(q, q, 0)
    assert bias.shape == (1, 4, 13, 13)  # 4D: a 3D mask sends CPU SDPA to its slow path
    bias = bias[0]
    t = lambda r, c: 1 + r * 4 + c  # noqa: E731
    slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    for h, m in enumerate(slopes):
        assert bias[h, t(0, 0), t(0, 0)] == 0
        assert bias[h, t(0, 0), t(0, 3)] == pytest.approx(-3 * m)
        assert bias[h, t(2, 3), t(0, 0)] == pytest.approx(-math.sqrt(13) * m)
        assert bias[h, t(1, 1), t(2, 2)] == pytest.approx(-math.sqrt(2) * m)
    assert (bias[:, 0] == 0).all() and (bias[:, :, 0] == 0).all()


def test_alibi2d_is_shift_invariant_and_normalized_mode_rescales_distances():
    pe = create_pe('alibi2d', dim=32, num_heads=4)
    pts = torch.randn(6, 2) * 5
    a = pe.prepare(vispe.points(pts)).state
    b = pe.prepare(vispe.points(pts + torch.tensor([3.0, -7.0]))).state
    torch.testing.assert_close(a, b)
    norm = create_pe('alibi2d:grid_mode=normalized', dim=32, num_heads=4, grid_size=(2, 2))
    big = norm.prepare(vispe.grid(4, 4, train_grid=(2, 2))).state  # neighbours half a training patch apart
    torch.testing.assert_close(big[0, :, 0, 1], -alibi_slopes(4) * 0.5)


# ---------------------------------------------------------------------- Swin relative position bias
@pytest.mark.parametrize('grid', [(4, 4), (3, 5)])
def test_swin_relative_position_index_equals_timm(grid):
    assert torch.equal(swin_relative_position_index(grid), gen_relative_position_index(grid))


def test_swin_rpb_bias_equals_beit_style_lookup_with_timm_class_token_index():
    h, w, heads = 3, 4, 2
    pe = create_pe('swin_rpb', dim=16, num_heads=heads, depth=2, grid_size=(h, w), num_prefix_tokens=1)
    bias = pe.prepare(vispe.grid(h, w, num_prefix=1))
    # timm / BEiT: flat table ((2h-1)(2w-1) + 3, H), extra rows cls->token, token->cls, cls->cls
    index = gen_relative_position_index((h, w), class_token=True)
    for layer in (0, 1):
        flat = torch.cat([pe.relative_position_bias_table[layer], pe.prefix_bias[layer]], 0)
        expected = flat[index.view(-1)].view(1 + h * w, 1 + h * w, heads).permute(2, 0, 1)
        torch.testing.assert_close(bias.bias(torch.zeros(1), torch.zeros(1), layer), expected[None])


def test_swin_rpb_table_is_resized_bicubically_for_another_grid():
    pe = create_pe('swin_rpb:per_layer=false', dim=16, num_heads=2, depth=2, grid_size=(4, 4))
    new = (6, 6)
    table = resize_rel_pos_bias_table_simple(pe.relative_position_bias_table[0].detach(), new_window_size=new,
                                             new_bias_shape=((2 * 6 - 1) ** 2, 2))
    prepared = pe.prepare(vispe.grid(*new, train_grid=(4, 4)))
    expected = table[gen_relative_position_index(new).view(-1)].view(36, 36, 2).permute(2, 0, 1)
    torch.testing.assert_close(prepared.state[0], expected, atol=1e-6, rtol=1e-6)
    assert prepared.bias(torch.zeros(1), torch.zeros(1), 1) is not None and prepared.state.shape[0] == 1  # one table
    pe.set_grid_size(new)
    torch.testing.assert_close(pe.relative_position_bias_table[0], table, atol=1e-6, rtol=1e-6)


def test_swin_rpb_on_a_token_subset_equals_the_full_grid_bias_at_the_kept_tokens():
    pe = create_pe('swin_rpb', dim=16, num_heads=2, depth=2, grid_size=(3, 4), num_prefix_tokens=1)
    full = pe.prepare(vispe.grid(3, 4, num_prefix=1)).state  # (T, H, 13, 13)
    keep = torch.tensor([[0, 5, 11, 7], [3, 2, 9, 10]])  # per-sample kept patches (patch dropout)
    sub = pe.prepare(vispe.grid(3, 4, num_prefix=1).select(keep))
    assert sub.state.shape == (2, 2, 2, 5, 5)
    for b in range(2):
        rows = torch.cat([torch.tensor([0]), keep[b] + 1])
        torch.testing.assert_close(sub.state[:, b], full[:, :, rows][:, :, :, rows])
    assert sub.bias(torch.zeros(1), None, 1).shape == (2, 2, 5, 5)


def test_swin_rpb_requires_self_attention_on_a_grid():
    pe = create_pe('swin_rpb', dim=16, num_heads=2, depth=1, grid_size=(2, 2))
    with pytest.raises(ValueError, match='2D token grid or integer'):
        pe.prepare(vispe.points(torch.randn(4, 2)))
    with pytest.raises(ValueError, match='exceed'):
        pe.prepare(vispe.points(torch.tensor([[0.0, 0.0], [5.0, 0.0]])))
    with pytest.raises(ValueError, match='share positions'):
        pe.prepare(vispe.grid(2, 2), vispe.grid(2, 3))


# ---------------------------------------------------------------------- both
@pytest.mark.parametrize('spec', ['alibi2d', 'swin_rpb'])
def test_relative_bias_sdpa_path_equals_explicit_path(spec):
    pe = create_pe(spec, dim=16, num_heads=2, depth=1, grid_size=(3, 3), num_prefix_tokens=1)
    state = pe.prepare(vispe.grid(3, 3, num_prefix=1))
    q, k, v = torch.randn(3, 2, 2, 10, 8).unbind(0)
    torch.testing.assert_close(pe_attention(q, k, v, state, 0),
                               pe_attention(q, k, v, state, 0, force_explicit=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('spec', ['alibi2d', 'swin_rpb'])
def test_relative_bias_in_a_vit_trains_and_runs_at_other_resolutions(spec):
    model = timm.create_model('vit_tiny', pe=spec, img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              num_classes=3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 64)).shape == (1, 3)
    model.set_input_size(img_size=(48, 48))
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 48)).shape == (1, 3)
