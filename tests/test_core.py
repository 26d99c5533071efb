"""Positions, the registry and spec strings, composition, the eval cache and the attention dispatch."""
import pytest
import timm
import torch

import vispe
from vispe.attention import pe_attention
from conftest import TINY, image_pes


# ------------------------------------------------------------------ positions
def test_grid_positions_are_row_major_indices():
    pos = vispe.grid(2, 3, num_prefix=1)
    assert pos.grid == (2, 3) and pos.num_tokens == 7 and pos.ndim == 2
    assert pos.coords.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [1, 2]]


def test_grid_3d_and_normalized_mode():
    pos = vispe.grid(2, 4, 4, train_grid=(2, 2, 2))
    assert pos.coords.shape == (32, 3)
    norm = vispe.positions.grid_coordinates(pos, 'normalized')
    assert norm[:, 1:].max().item() == pytest.approx(1.5)  # 3 * 2/4
    assert torch.equal(norm[:, 0], pos.coords[:, 0])


def test_points_positions_batched_and_select():
    pos = vispe.points(torch.rand(2, 5, 3), num_prefix=1)
    assert pos.batched and pos.num_tokens == 6
    sub = vispe.grid(2, 2).select(torch.tensor([[3, 0], [1, 2]]))
    assert sub.coords.tolist() == [[[1, 1], [0, 0]], [[0, 1], [1, 0]]]


def test_positions_reject_bad_input():
    with pytest.raises(ValueError, match='coords'):
        vispe.Positions(coords=torch.zeros(3))
    with pytest.raises(ValueError, match='grid'):
        vispe.grid(0, 3)
    with pytest.raises(ValueError, match='grid_mode'):
        vispe.positions.grid_coordinates(vispe.grid(2, 2, train_grid=(1, 1)), 'bogus')


# ------------------------------------------------------------------ registry / specs
def test_spec_forms_parse_alike():
    a = vispe.parse_pe_spec('rope_axial:theta=50,grid_mode=normalized+learned')
    assert a == [('rope_axial', {'theta': '50', 'grid_mode': 'normalized'}), ('learned', {})]
    assert vispe.parse_pe_spec({'name': 'rope_axial', 'theta': 50}) == [('rope_axial', {'theta': 50})]
    assert vispe.parse_pe_spec(['rope_axial', {'name': 'learned'}]) == [('rope_axial', {}), ('learned', {})]


def test_create_pe_coerces_and_validates_options():
    pe = vispe.create_pe('rope_axial:theta=50,grid_mode=normalized', dim=32, num_heads=2)
    assert pe.theta == 50.0 and isinstance(pe.theta, float) and pe.grid_mode == 'normalized'
    pe = vispe.create_pe({'name': 'rope_axial', 'theta': 100}, dim=32, num_heads=2)
    assert pe.theta == 100.0


def test_unknown_encoding_suggests_close_names():
    with pytest.raises(ValueError, match=r"unknown encoding 'rope_axil'.*Did you mean 'rope_axial'"):
        vispe.create_pe('rope_axil', dim=32)


def test_unknown_option_lists_valid_options():
    with pytest.raises(ValueError, match=r"unknown option 'thetta' for encoding 'rope_axial'.*'theta'.*Valid options"):
        vispe.create_pe('rope_axial:thetta=3', dim=32)


def test_bad_option_value_names_option_and_allowed_values():
    with pytest.raises(ValueError, match=r"option 'grid_mode' of encoding 'rope_axial'.*allowed values: 'index', "
                                         r"'normalized'"):
        vispe.create_pe('rope_axial:grid_mode=pixels', dim=32)
    with pytest.raises(ValueError, match=r"option 'theta' of encoding 'rope_axial': expected float"):
        vispe.create_pe('rope_axial:theta=big', dim=32)


def test_head_dim_an_encoding_cannot_use_is_rejected():
    with pytest.raises(ValueError, match='head_dim divisible by 4'):
        vispe.create_pe('rope_mixed', dim=12, num_heads=2)  # head_dim 6
    with pytest.raises(ValueError, match='even head_dim'):
        vispe.create_pe('rope_axial', dim=15, num_heads=3)  # head_dim 5


def test_register_pe_rejects_duplicates():
    with pytest.raises(ValueError, match='already registered'):
        vispe.register_pe('rope_axial')(type('Other', (vispe.PositionalEncoding,), {}))


# ------------------------------------------------------------------ composition and cache
def test_composition_equals_applying_both():
    ctx = dict(dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1)
    torch.manual_seed(1)
    both = vispe.create_pe('rope_mixed+learned', **ctx)
    mixed = vispe.create_pe('rope_mixed', **ctx)
    learned = vispe.create_pe('learned', **ctx)
    mixed.load_state_dict(both.encodings[0].state_dict())
    learned.load_state_dict(both.encodings[1].state_dict())
    pos = vispe.grid(4, 4, num_prefix=1)
    x = torch.randn(2, 17, 32)
    torch.testing.assert_close(both.embed(x, pos), learned.embed(mixed.embed(x, pos), pos))
    q, k = torch.randn(2, 2, 17, 16), torch.randn(2, 2, 17, 16)
    qa, ka = both.prepare(pos).qk(q, k, 1)
    qb, kb = learned.prepare(pos).qk(*mixed.prepare(pos).qk(q, k, 1), 1)
    torch.testing.assert_close(qa, qb)
    torch.testing.assert_close(ka, kb)
    assert both.hooks == {'embed', 'qk'}
    assert both.no_weight_decay() == {'encodings.0.freqs', 'encodings.1.pos_embed'}


def test_eval_cache_equals_recomputation_and_tracks_parameters():
    pe = vispe.create_pe('rope_mixed', dim=32, num_heads=2, depth=2, grid_size=(4, 4)).eval()
    pos = vispe.grid(4, 4)
    with torch.no_grad():
        s1 = pe.prepare(pos).state
        s2 = pe.prepare(vispe.grid(4, 4)).state
        assert s2 is s1  # cached
        fresh = pe._prepare(pos, None)
        torch.testing.assert_close(s1.q, fresh.q)  # the rotations of the queries
        pe.freqs.mul_(2)  # in-place parameter change invalidates the cache
        s3 = pe.prepare(pos).state
        assert s3 is not s1
        torch.testing.assert_close(s3.q, pe._prepare(pos, None).q)
        assert pe.prepare(vispe.grid(5, 4)).state is not s3
    pe.train()
    assert pe.prepare(pos).state is not pe.prepare(pos).state  # no cache in training


def test_eval_cache_keeps_the_two_most_recent_position_sets():
    pe = vispe.create_pe('liere', dim=32, num_heads=2, depth=2, grid_size=(4, 4)).eval()
    a, b, c = vispe.grid(4, 4), vispe.grid(2, 2), vispe.grid(3, 5)
    with torch.no_grad():
        sa, sb = pe.prepare(a).state, pe.prepare(b).state
        assert pe.prepare(vispe.grid(4, 4)).state is sa and pe.prepare(vispe.grid(2, 2)).state is sb
        pe.prepare(a)  # a is now the most recent: c evicts b
        pe.prepare(c)
        assert pe.prepare(vispe.grid(4, 4)).state is sa
        assert pe.prepare(vispe.grid(2, 2)).state is not sb
        pe.clear_cache()
        assert pe.prepare(a).state is not sa


# ------------------------------------------------------------------ attention dispatch
@pytest.mark.parametrize('pe', image_pes())
def test_sdpa_path_equals_explicit_softmax(pe):
    m = timm.create_model('vit_tiny', pe=pe, **TINY).eval()
    for p in m.pe.parameters():  # zero-initialised tables would make the check vacuous
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        fused = m(x)
        for blk in m.blocks:
            blk.attn.fused_attn = False
        explicit = m(x)
    torch.testing.assert_close(fused, explicit, rtol=1e-4, atol=1e-4)


def test_pe_attention_combines_bias_with_user_mask():
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.tensor([True, True, False, True]).view(1, 1, 1, 4)
    out = pe_attention(q, k, v, attn_mask=mask)
    logits = (q @ k.transpose(-1, -2)) / 8 ** 0.5
    logits[..., 2] = float('-inf')
    torch.testing.assert_close(out, logits.softmax(-1) @ v)


def test_pe_attention_says_how_many_tokens_the_positions_describe():
    pe = vispe.create_pe('rope_axial', dim=32, num_heads=2, grid_size=(4, 4))
    pos = vispe.grid(4, 4)  # 16 tokens, but q and k carry a class token too
    q = torch.randn(1, 2, 17, 16)
    match = r'prepared for positions of 16 tokens \(0 prefix \+ 16 positioned\) but q has 17'
    with pytest.raises(ValueError, match=match):
        pe_attention(q, q, q, pe.prepare(pos))
    pos = vispe.grid(4, 4, num_prefix=1)
    assert pe_attention(q, q, q, pe.prepare(pos)).shape == q.shape


def test_create_pe_takes_factory_kwargs():
    pe = vispe.create_pe('rope_mixed+fourier_gaussian', dim=32, num_heads=2, grid_size=(4, 4), dtype=torch.float64)
    assert {t.dtype for t in pe.state_dict().values()} == {torch.float64}
    pe = vispe.create_pe('rope_mixed', dim=32, num_heads=2, grid_size=(4, 4), device='meta')
    assert pe.freqs.is_meta


def test_encodings_run_on_meta_tensors():
    """Shape propagation (memory planning, meta-device models) runs the forward on meta tensors."""
    for spec in image_pes():
        pe = vispe.create_pe(spec, dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1,
                             device='meta')
        pos = vispe.grid(4, 4, num_prefix=1, device='meta')
        q = torch.randn(2, 2, 17, 16, device='meta')
        x = pe.embed(torch.randn(2, 17, 32, device='meta'), pos)
        assert pe_attention(q, q, q, pe.prepare(pos), x=x).shape == q.shape, spec
