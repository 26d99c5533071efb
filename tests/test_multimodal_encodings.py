"""The multimodal schemes as registered encodings over `vispe.sequence` positions: the registry and the spec
language name them, the contract's hooks (``prepare`` once, ``qk`` per layer, `vispe.pe_attention`) give
what language-model code gets from ``cos_sin`` + ``apply_rotary``, decoding continues a sequence through
its offset, the eval cache tells layouts apart, and bad input gets an error that names it."""
import pytest
import torch
import torch.nn.functional as F

import vispe
from vispe import Image, Text, Video, sequence
from vispe.encodings.mrope import interleaved_mrope_axes
from vispe.encodings.multimodal import apply_rotary, decode_position_ids

NAMES = ('circlerope', 'hope', 'mhrope', 'mrope', 'mrope_interleave', 'rope_1d', 'v2pe', 'videorope', 'vrope')
LAYOUTS = [[Text(3), Image(grid=(1, 4, 6)), Text(2), Video(grid=(2, 4, 4), fps=2.0), Text(1)],
           [Text(2), Video(grid=(3, 2, 4)), Text(3)],
           [Text(5)]]


def build(spec, heads=4, head_dim=16):
    return vispe.create_pe(spec, dim=heads * head_dim, num_heads=heads, head_dim=head_dim)


def test_the_registry_lists_every_multimodal_encoding_with_what_it_reads():
    found = tuple(n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal')
    assert found == NAMES
    for name in NAMES:
        assert vispe.pe_info(name)['cls'].requires == {'segments'}  # no image host picks them up
        assert build(name).capabilities.hooks == {'qk'}


def test_options_are_spelled_in_the_spec_language():
    pe = build('videorope:delta=2.5,sections=2|3|3')
    assert (pe.delta, pe.sections, pe.float_ids) == (2.5, (2, 3, 3), True)
    pe = build('mhrope:head_sections=0|1|1', heads=2)
    assert pe.head_layout == 'hw'
    assert vispe.format_pe_spec({'name': 'mhrope', 'head_sections': (0, 1, 1)}) == 'mhrope:head_sections=0|1|1'
    with pytest.raises(ValueError, match="option 'delta' of encoding 'videorope': expected float, got 'x'"):
        build('videorope:delta=x')


@pytest.mark.parametrize('name', NAMES)
def test_prepared_qk_equals_cos_sin_applied_as_language_model_code_does(name):
    pe = build(name).eval()
    pos = sequence(LAYOUTS, padding_side='left')
    ids, _ = pe.position_ids(pos)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 4, pos.num_tokens, 16, generator=g) for _ in range(2))
    want = apply_rotary(q, k, *pe.cos_sin(ids))
    got = pe.prepare(pos).qk(q, k, 0)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize('name', ['mrope', 'vrope', 'mhrope'])
def test_pe_attention_hosts_a_multimodal_encoding(name):
    pe = build(name)
    pos = sequence(LAYOUTS[0])
    ids, _ = pe.position_ids(pos)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, pos.num_tokens, 16, generator=g) for _ in range(3))
    rq, rk = apply_rotary(q, k, *pe.cos_sin(ids))
    want = F.scaled_dot_product_attention(rq, rk, v, is_causal=True)
    got = vispe.pe_attention(q, k, v, pe.prepare(pos), is_causal=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_mhrope_rotates_query_heads_by_their_key_value_heads_axis():
    pe = build('mhrope', heads=4, head_dim=8)  # built for the 4 key/value heads
    pos = sequence([LAYOUTS[0]])
    ids, _ = pe.position_ids(pos)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 8, pos.num_tokens, 8, generator=g), torch.randn(1, 4, pos.num_tokens, 8, generator=g)
    got = pe.prepare(pos).qk(q, k, 0)
    want = apply_rotary(q, k, *pe.cos_sin(ids))
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


@pytest.mark.parametrize('name', NAMES)
def test_an_offset_sequence_continues_where_the_prefix_ends(name):
    """Decoding: the next tokens as a sequence of their own, started at the prefix's next position, get the
    ids they have at the end of the whole sequence."""
    pe = build(name).eval()
    prefix = [LAYOUTS[0], LAYOUTS[1]]
    ids, delta = pe.position_ids(sequence(prefix))
    L = ids.shape[-1]
    new, _ = pe.position_ids(sequence([[Text(3)], [Text(3)]], offset=(delta[:, 0] + L)))
    for b, lay in enumerate(prefix):
        full, _ = pe.position_ids(sequence(lay + [Text(3)]))
        assert torch.equal(new[:, b], full[:, -3:]), (name, b)
        assert torch.equal(decode_position_ids(delta, L, length=3, num_axes=pe.num_axes)[:, b].to(full.dtype),
                           full[:, -3:])


@pytest.mark.parametrize('side', ['left', 'right'])
def test_a_sample_of_a_padded_batch_is_that_sequence_alone(side):
    pe = build('vrope')
    batch = sequence(LAYOUTS, padding_side=side, offset=torch.tensor([0.0, 3.0, 7.0]))
    ids, _ = pe.position_ids(batch)
    for b, lay in enumerate(LAYOUTS):
        alone = sequence(lay, offset=[0.0, 3.0, 7.0][b])
        one, _ = pe.position_ids(batch.sample(b))
        assert torch.equal(one, pe.position_ids(alone)[0])
        assert torch.equal(ids[:, b][:, ~batch.key_padding_mask[b]], one)


def test_eval_cache_serves_the_same_sequence_and_not_another_layout():
    pe = build('mrope').eval()
    with torch.no_grad():
        a = pe.prepare(sequence([Text(2), Image(grid=(1, 2, 4)), Text(1)]))
        assert pe.prepare(sequence([Text(2), Image(grid=(1, 2, 4)), Text(1)])).state is a.state
        b = pe.prepare(sequence([Text(2), Image(grid=(1, 4, 2)), Text(1)]))  # same token count, other grid
        timed = pe.prepare(sequence([Text(2), Video(grid=(2, 2, 2), fps=1.0), Text(1)]))
        untimed = pe.prepare(sequence([Text(2), Video(grid=(2, 2, 2)), Text(1)]))
    assert b.state is not a.state and not torch.equal(b.state.q[0], a.state.q[0])
    assert not torch.equal(timed.state.q[0], untimed.state.q[0])


def test_frequencies_stay_float32_when_the_module_is_cast():
    pe = build('mrope_interleave')
    ids, _ = pe.position_ids(sequence(LAYOUTS[0]))
    want = pe.cos_sin(ids)
    for dtype in (torch.bfloat16, torch.float16):
        got = pe.to(dtype).cos_sin(ids)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), dtype


def test_a_grid_is_no_multimodal_sequence():
    with pytest.raises(ValueError, match=r"encoding 'mrope' reads the segments of a multimodal sequence.*"
                                         r"vispe.sequence"):
        build('mrope').prepare(vispe.grid(4, 4))
    with pytest.raises(ValueError, match=r"needs \['segments'\] in its positions"):
        import timm
        timm.create_model('vit_tiny', pe='mrope', img_size=32, patch_size=8, depth=1, embed_dim=64, num_heads=4)


def test_the_interleaved_allocation_is_transformers_qwen3_vl_and_timm_ropes():
    transformers = pytest.importorskip('transformers')
    from transformers.models.qwen3_vl import modeling_qwen3_vl
    sections = (24, 20, 20)
    rotary = modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding.__new__(modeling_qwen3_vl.Qwen3VLTextRotaryEmbedding)
    rotary.mrope_section = list(sections)
    freqs = torch.arange(3, dtype=torch.float32).view(3, 1, 1, 1).repeat(1, 1, 1, 64)  # axis a's angles are a
    theirs = rotary.recomposition_frequencies(freqs)[0, 0, :64].long()
    assert torch.equal(interleaved_mrope_axes(64, sections), theirs)
    assert build('mrope_interleave:sections=24|20|20', heads=1, head_dim=128).pair_layout == \
        ''.join('thw'[a] for a in theirs.tolist())
    pe = vispe.create_pe('rope_timm:rope_type=mrope,mrope_section=8|12|12,rotate_half=true', dim=64, num_heads=1,
                         grid_size=(4, 4))
    # rope_timm's mrope reads (0, row, col): at row 1, column 0 (token 4 of the grid) only the h pairs turn
    theta = pe.angles(vispe.grid(4, 4))[4]
    assert torch.equal(theta != 0, interleaved_mrope_axes(32, (8, 12, 12)) == 1)


# ---------------------------------------------------------------------- bad input gets a clear error
def test_a_bad_item_in_a_layout_is_named_by_its_index():
    with pytest.raises(ValueError, match=r"layout\[1\] must be a vispe.Text / vispe.Image / vispe.Video segment, "
                                         r"got 'image'"):
        sequence([Text(3), 'image'])
    with pytest.raises(ValueError, match=r"layouts\[1\]\[0\] must be a .* segment, got 5"):
        sequence([[Text(3)], [5]])


def test_a_fractional_grid_is_refused_not_truncated():
    from vispe.integrations.transformers_vlm import QWEN2_VL_TOKEN_IDS, rope_index
    vs, img = QWEN2_VL_TOKEN_IDS['vision_start_token_id'], QWEN2_VL_TOKEN_IDS['image_token_id']
    input_ids = torch.tensor([[5, vs] + [img] * 4 + [8]])
    with pytest.raises(ValueError, match=r'image_grid_thw must hold whole \(T, H, W\) patch counts, got '
                                         r'\[1.0, 4.5, 4.0\]'):
        rope_index(build('mrope'), input_ids, image_grid_thw=torch.tensor([[1., 4.5, 4.]]))
    ids, _ = rope_index(build('mrope'), input_ids, image_grid_thw=torch.tensor([[1., 4., 4.]]))  # whole floats
    assert ids[0, 0].tolist() == [0, 1, 2, 2, 2, 2, 4]


def test_head_sections_are_refused_by_every_encoding_but_mhrope():
    for name in NAMES:
        if name != 'mhrope':
            with pytest.raises(ValueError, match=f"unknown option 'head_sections' for encoding '{name}'"):
                build(f'{name}:head_sections=1|1|1')


def test_head_sections_without_a_head_are_refused():
    with pytest.raises(ValueError, match=r"option head_sections of encoding 'mhrope' must be 3 non-negative head "
                                         r"counts .* at least 1 .* got \(0, 0, 0\)"):
        build('mhrope:head_sections=0|0|0')


def test_a_negative_cache_position_is_refused():
    with pytest.raises(ValueError, match=r'cache_position must be >= 0 .* got -1'):
        decode_position_ids(torch.tensor([[0]]), cache_position=-1)
    with pytest.raises(ValueError, match='cache_position must be an integer'):
        decode_position_ids(torch.tensor([[0]]), cache_position=2.5)


def test_apply_rotary_refuses_token_counts_other_than_cos_sins():
    pe = build('mrope', heads=2, head_dim=8)
    cos, sin = pe.cos_sin(torch.zeros(3, 1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r'cos / sin are for 5 tokens but q / k have 6'):
        apply_rotary(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), cos, sin)
    with pytest.raises(ValueError, match=r'cos / sin are for 5 tokens but q / k have 4'):
        apply_rotary(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 4, 8), cos, sin)


def test_an_integer_encoding_refuses_a_fractional_offset():
    with pytest.raises(ValueError, match="encoding 'mrope' has integer ids: the sequence offset must be whole"):
        build('mrope').position_ids(sequence([Text(2)], offset=0.5))
    ids, _ = build('v2pe').position_ids(sequence([Text(2)], offset=0.5))
    assert ids.tolist() == [[0.5, 1.5]]


# ---------------------------------------------------------------------- the old names, for one release
def test_the_deprecated_module_keeps_the_old_names_for_one_release():
    import importlib
    import sys
    sys.modules.pop('vispe.multimodal', None)
    with pytest.warns(DeprecationWarning, match='vispe.multimodal is deprecated'):
        mm = importlib.import_module('vispe.multimodal')
    layout = [mm.Text(3), mm.Image(grid=(1, 4, 6)), mm.Text(2), mm.Video(grid=(2, 4, 4), fps=2.0)]
    for old, new in (('rope', 'rope_1d'), ('videorope', 'videorope')):
        ids, delta = mm.position_ids(layout, scheme=old, delta=2.0) if old == 'videorope' else \
            mm.position_ids(layout, scheme=old)
        want = build(new + (':delta=2' if old == 'videorope' else '')).position_ids(sequence(layout))
        assert torch.equal(ids, want[0]) and torch.equal(delta, want[1])
    rot = mm.MultimodalRotary(16, theta=1e4, scheme='mhrope', num_heads=4)
    new = build('mhrope:theta=1e4', heads=4)
    assert rot.head_layout == new.head_layout and torch.equal(rot(ids)[0], new.cos_sin(ids)[0])
    old = mm.get_scheme('circlerope', radius='auto-2', move_to_positive=0.5)
    assert (old.auto_radius, old.move_to_positive, old.positive_offset) == (2.0, True, 0.5)
    assert mm.SCHEMES['rope'] is vispe.pe_info('rope_1d')['cls']
