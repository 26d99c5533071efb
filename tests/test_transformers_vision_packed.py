"""patch_vision on transformers' packed vision towers: Qwen2-VL, Qwen2.5-VL, Qwen3-VL (images and video frames
run as one sequence attended in segments, ``cu_seqlens``, tokens in merge-block and window order) and Pixtral
(images of their own sizes along one sequence, a block-diagonal mask). Parity of the model's own encoding with
the unpatched tower first (the training grid, another size, a packed mixed batch), the positions against
transformers' own id helpers, an image packed with others against the image alone; then every image encoding,
the adapter mechanism, bfloat16 and the refusals."""
import copy

import pytest
import torch

transformers = pytest.importorskip('transformers')

from vispe.integrations import patch_vision  # noqa: E402
from vispe.integrations._vision_packed import varlen_layout  # noqa: E402

from adapter_checks import check_deepcopy, check_one_patch_per_tree, check_pickle  # noqa: E402
from conftest import image_pes  # noqa: E402
from transformers_vision_models import (  # noqa: E402
    PACKED_FAMILIES, QWEN_FAMILIES, QWEN_NATIVE, QWEN_PACKED, build_packed, build_qwen, build_qwen_vlm,
    packed_images, packed_inputs, qwen_config, qwen_inputs, qwen_vlm_inputs,
)

PARITY = 1e-6


def _outputs(out):
    """Every tensor a packed tower returns: tokens, Qwen-VL's merged tokens and Qwen3-VL's deepstack features."""
    extra = [out.pooler_output] if getattr(out, 'pooler_output', None) is not None else []
    return [out.last_hidden_state] + extra + list(getattr(out, 'deepstack_features', None) or [])


def _tokens(out):
    """The ``(N, C)`` tokens of the packed sequence (Pixtral's come as a batch of one)."""
    return out.last_hidden_state.flatten(0, -2)


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ parity: the model's own encoding
@pytest.mark.parametrize('kind', PACKED_FAMILIES)
@pytest.mark.parametrize('size', ['native', 'other', 'packed'])
def test_own_encoding_equals_the_unpatched_tower(kind, size):
    model = build_packed(kind)
    before = _state(model)
    x = packed_inputs(kind, size)
    with torch.no_grad():
        want = _outputs(model(**x))
        with patch_vision(model) as handle:
            got = _outputs(model(**x))
            assert not handle.report.dropped and not handle.report.initialized
            assert handle.encoding.capabilities.in_attention
        again = _outputs(model(**x))
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= PARITY
    assert all(torch.equal(a, w) for a, w in zip(again, want))
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize('kind', QWEN_FAMILIES)
def test_positions_follow_the_hosts_token_order(kind):
    """Unpacked into the host's order, the frames' positions are transformers' own rotary ids
    (`get_vision_position_ids`, merge-block order), reordered by `get_vision_window_index` in Qwen2.5-VL."""
    from transformers import vision_utils
    config = qwen_config(kind)
    thw = torch.tensor(QWEN_PACKED)
    window_index = bounds = None
    ids = vision_utils.get_vision_position_ids(thw, config.spatial_merge_size)
    if kind == 'qwen2_5_vl':
        window_index, bounds = vision_utils.get_vision_window_index(thw, config.spatial_merge_size, config.window_size,
                                                                    config.patch_size)
        ids = ids.view(-1, 4, 2)[window_index].view(-1, 2)
    layout = varlen_layout(thw, config.spatial_merge_size, (4, 4), window_index=window_index, window_bounds=bounds)
    frames = layout.frames
    assert torch.equal(frames.unpack(frames.positions.coords).long(), ids)
    assert torch.equal(frames.unpack(frames.pack(ids)), ids)
    if bounds is not None:  # each window: its tokens in the host's order, at their positions on the frame
        windows = layout.windows
        assert torch.equal(windows.unpack(windows.positions.coords).long(), ids)
        lengths = (bounds[1:] - bounds[:-1]).tolist()
        assert (~windows.positions.key_padding_mask).sum(1).tolist() == lengths


_ALONE = [(kind, pe) for kind in PACKED_FAMILIES for pe in (None, 'liere', 'peg')] + [
    ('qwen2_5_vl', 'irpe'), ('qwen2_5_vl', 'learned'), ('pixtral', 'rope_mixed'), ('qwen3_vl', 'lookhere')]


@pytest.mark.parametrize('kind, pe', _ALONE)
def test_an_image_packed_with_others_gets_its_output_alone(kind, pe):
    model = build_packed(kind)
    x = packed_inputs(kind, 'packed')
    with torch.no_grad(), patch_vision(model, pe):
        together = _tokens(model(**x))
        for (start, end), alone in packed_images(kind, x):
            torch.testing.assert_close(together[start:end], _tokens(model(**alone)), rtol=0, atol=2e-6)


def test_the_unpatched_hosts_give_a_packed_image_its_output_alone_too():
    """The property the patch keeps is the host's own (what parity then carries over)."""
    for kind in ('qwen2_5_vl', 'pixtral'):
        model = build_packed(kind)
        x = packed_inputs(kind, 'packed')
        with torch.no_grad():
            together = _tokens(model(**x))
            for (start, end), alone in packed_images(kind, x):
                torch.testing.assert_close(together[start:end], _tokens(model(**alone)), rtol=0, atol=2e-6)


@pytest.mark.parametrize('align_corners', [True, False])
@pytest.mark.parametrize('grid', [(6, 8), (2, 2), (4, 4), (2, 12), (8, 6)])
def test_learned_aligned_corner_weights_are_qwen3s_resampling(grid, align_corners):
    """``learned:interpolation=bilinear,align_corners=true,resample=weights`` gives each patch the table rows
    that Qwen3-VL's tower takes (`get_vision_interpolation_indices_and_weights`), to float rounding; without
    aligned corners it does not."""
    import vispe
    from transformers import vision_utils
    ctx = vispe.PEContext(dim=32, grid_size=(4, 4))
    pe = vispe.create_pe(f'learned:interpolation=bilinear,antialias=false,align_corners={align_corners},'
                         f'resample=weights,init_std=1', ctx)
    table = pe.pos_embed.detach()[0]
    index, weights = vision_utils.get_vision_interpolation_indices_and_weights(
        torch.tensor([(1, *grid)]), num_grid_per_side=4, mode='bilinear', align_corners=True)
    host = (table[index] * weights[..., None]).sum(1)  # raster order (no merge)
    with torch.no_grad():
        ours = pe.embedding(vispe.positions.grid(*grid, train_grid=(4, 4)))[0]
    if align_corners:
        assert (ours - host).abs().max().item() <= 5e-7
    elif grid != (4, 4):
        assert (ours - host).abs().max().item() > 1e-2


# ------------------------------------------------------------------ whole models find their tower
@pytest.mark.parametrize('kind', QWEN_FAMILIES)
def test_a_whole_qwen_vl_model_finds_its_vision_tower(kind):
    model = build_qwen_vlm(kind)
    images = QWEN_PACKED[:2]
    batch = qwen_vlm_inputs(images)

    def features(m):  # the merged image tokens the language model receives
        x = m.model.get_image_features(pixel_values=batch['pixel_values'], image_grid_thw=batch['image_grid_thw'])
        return torch.cat(list(x.pooler_output))

    with torch.no_grad():
        want, logits = features(model), model(**batch).logits
        with patch_vision(model) as handle:
            assert handle.tower is model.model.visual and handle.tower_name == 'model.visual'
            assert (features(model) - want).abs().max().item() <= PARITY
            assert (model(**batch).logits - logits).abs().max().item() <= PARITY
        with patch_vision(model.model, 'rope_mixed') as handle:  # the model without its head too
            assert handle.tower is model.model.visual
            assert (features(model) - want).abs().max() > 1e-3
    check_one_patch_per_tree(model, model.model.visual, lambda m: patch_vision(m, 'rope_mixed'),
                             lambda m: patch_vision(m, 'liere'))


# ------------------------------------------------------------------ any encoding in every family
PES = image_pes()
_ROUND = [(PACKED_FAMILIES[i % len(PACKED_FAMILIES)], pe) for i, pe in enumerate(PES)]
_MATRIX = _ROUND + [pytest.param(kind, pe, marks=pytest.mark.slow) for kind in PACKED_FAMILIES for pe in PES
                    if (kind, pe) not in _ROUND]


@pytest.fixture(scope='module')
def towers():
    return {kind: build_packed(kind) for kind in PACKED_FAMILIES}


@pytest.mark.parametrize('kind, pe', _MATRIX)
def test_every_image_encoding_trains_a_step_and_takes_other_sizes(towers, kind, pe):
    model = copy.deepcopy(towers[kind]).train()
    handle = patch_vision(model, pe)
    loss = model(**packed_inputs(kind, 'native')).last_hidden_state.square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    params = [p for n, p in model.named_parameters() if 'vispe_pe.' in n and p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in params), pe
    if params:
        assert any(p.grad.abs().sum() > 0 for p in params), f'no gradient reaches {pe}'
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad
    model.eval()
    x = packed_inputs(kind, 'packed')
    with torch.no_grad():
        out = _tokens(model(**x))
    assert out.shape[0] == max(end for (_, end), _ in packed_images(kind, x)) and torch.isfinite(out).all()
    handle.remove()


@pytest.mark.parametrize('kind', PACKED_FAMILIES)
def test_state_dict_round_trips(towers, kind):
    a, b = copy.deepcopy(towers[kind]), copy.deepcopy(towers[kind])
    patch_vision(a, 'rope_mixed')
    patch_vision(b, 'rope_mixed')
    b.load_state_dict(a.state_dict())
    x = packed_inputs(kind, 'packed')
    with torch.no_grad():
        torch.testing.assert_close(b(**x).last_hidden_state, a(**x).last_hidden_state, rtol=0, atol=0)


def test_qwen3_own_encoding_takes_the_hosts_table():
    model = build_qwen('qwen3_vl')
    with patch_vision(model) as handle:
        assert handle.encoding.encodings[1].name == 'learned'
        torch.testing.assert_close(handle.encoding.encodings[1].pos_embed[0], model.pos_embed.weight, rtol=0, atol=0)
    with patch_vision(model, 'liere') as handle:
        assert handle.report.dropped == ['pos_embed']


# ------------------------------------------------------------------ the adapter mechanism
@pytest.mark.parametrize('kind', PACKED_FAMILIES)
def test_patched_tower_deep_copies_and_pickles(kind):
    def run(model):
        with torch.no_grad():
            return model(**packed_inputs(kind, 'packed')).last_hidden_state

    check_deepcopy(build_packed(kind), lambda m: patch_vision(m, 'rope_mixed+peg'), run)
    check_pickle(build_packed(kind), lambda m: patch_vision(m, 'liere+learned'), run)


def test_gradient_checkpointing_threads_the_layout(towers):
    model = copy.deepcopy(towers['qwen2_5_vl']).train()
    model.gradient_checkpointing_enable()
    with patch_vision(model, 'rope_mixed'):
        model(**qwen_inputs(QWEN_PACKED)).last_hidden_state.sum().backward()
        assert model.vispe_pe.freqs.grad is not None and model.vispe_pe.freqs.grad.abs().sum() > 0


# ------------------------------------------------------------------ bfloat16
@pytest.mark.parametrize('kind', PACKED_FAMILIES)
def test_rotary_angles_stay_float32_in_a_bfloat16_tower_where_the_hosts_are_rounded(kind):
    model = build_packed(kind)
    host = model.patch_positional_embedding if kind == 'pixtral' else model.rotary_pos_emb
    exact = host.inv_freq.clone()
    handle = patch_vision(model)
    x = packed_inputs(kind, 'packed')
    pos = handle.family.positions(handle.family, handle.tower, (), x).frames.positions
    rope = handle.encoding if kind != 'qwen3_vl' else handle.encoding.encodings[0]
    want = rope.angles(pos)
    model.to(torch.bfloat16)
    assert host.inv_freq.dtype == torch.bfloat16  # transformers' table is rounded
    assert not torch.equal(host.inv_freq.float(), exact)
    handle.encoding.clear_cache()
    got = rope.angles(pos)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    first = next(iter(x))
    with torch.no_grad():
        out = model(**{**x, first: x[first].bfloat16()}).last_hidden_state
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    handle.remove()


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize('grids, message', [
    ([(1, 5, 4)], 'divisible by spatial_merge_size=2'),
    ([(0, 4, 4)], 'must be positive'),
])
def test_grids_the_merge_does_not_divide_are_refused(towers, grids, message):
    model = copy.deepcopy(towers['qwen2_vl'])
    with patch_vision(model, 'rope_mixed'), pytest.raises(ValueError, match=message):
        model(hidden_states=torch.randn(20, 384), grid_thw=torch.tensor(grids))


def test_bad_packed_inputs_are_refused(towers):
    model = copy.deepcopy(towers['qwen2_vl'])
    with patch_vision(model, 'rope_mixed'):
        with pytest.raises(ValueError, match=r'hidden_states must be the \(16, C \* t \* p \* p\)'):
            model(hidden_states=torch.randn(15, 384), grid_thw=torch.tensor([QWEN_NATIVE]))
        with pytest.raises(ValueError, match=r'grid_thw must be a \(num_images, 3\) integer tensor'):
            model(hidden_states=torch.randn(16, 384), grid_thw=torch.tensor([[1.0, 4.0, 4.0]]))
        with pytest.raises(ValueError, match='precomputed cu_seqlens must make each frame'):
            model(hidden_states=torch.randn(32, 384), grid_thw=torch.tensor([(2, 4, 4)]),
                  cu_seqlens=torch.tensor([0, 32], dtype=torch.int32))


def test_attention_called_outside_the_patched_forward_says_why(towers):
    model = copy.deepcopy(towers['qwen2_vl'])
    with patch_vision(model, 'rope_mixed'), pytest.raises(RuntimeError, match='called without vispe_prepared='):
        model.blocks[0].attn(torch.randn(16, 32), cu_seqlens=torch.tensor([0, 16]))


def test_pixtral_refuses_image_sizes_the_patch_does_not_divide_or_outside_the_canvas(towers):
    model = copy.deepcopy(towers['pixtral'])
    x = torch.randn(2, 3, 32, 32)
    with patch_vision(model, 'rope_mixed'):
        with pytest.raises(ValueError, match='not divisible by the patch size 8x8'):
            model(pixel_values=x, image_sizes=torch.tensor([[32, 32], [20, 32]]))
        with pytest.raises(ValueError, match='image_sizes must give each of the 2 images'):
            model(pixel_values=x, image_sizes=torch.tensor([[32, 32], [40, 32]]))
        with pytest.raises(ValueError, match='not divisible by the patch size'):
            model(pixel_values=torch.randn(1, 3, 36, 32))


def test_pixtral_rope_is_rope_timm_with_alternating_axis_bands():
    """``rope_timm:axis_bands=alternating`` gives Pixtral's cos / sin, hand-derived from transformers' module."""
    import vispe
    model = build_packed('pixtral')
    ids = torch.stack(torch.meshgrid(torch.arange(5), torch.arange(7), indexing='ij'), -1).reshape(-1, 2)
    cos, sin = model.patch_positional_embedding(torch.zeros(1), ids)
    pe = vispe.create_pe('rope_timm:rope_type=cat,temperature=10000,rotate_half=true,axis_bands=alternating',
                         vispe.PEContext(dim=32, num_heads=2, head_dim=16, grid_size=(4, 4)))
    angles = pe.angles(vispe.positions.grid(5, 7))  # (N, hd / 2): rotate-half pairs (j, j + hd / 2)
    torch.testing.assert_close(torch.cat([angles.cos()] * 2, -1), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([angles.sin()] * 2, -1), sin, rtol=0, atol=1e-6)


def test_qwen3_vl_moe_tower_is_the_qwen3_vl_family():
    """Qwen3-VL-MoE's vision tower is Qwen3-VL's under another class: the same patch, at parity."""
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe
    config = transformers.Qwen3VLMoeConfig().vision_config.__class__(
        **{k: v for k, v in qwen_config('qwen3_vl').to_dict().items() if k not in ('model_type', 'transformers_version')})
    torch.manual_seed(0)
    model = modeling_qwen3_vl_moe.Qwen3VLMoeVisionModel(config).eval()
    x = qwen_inputs(QWEN_PACKED)
    with torch.no_grad():
        want = _outputs(model(**x))
        with patch_vision(model) as handle:
            assert handle.family.label == 'Qwen3-VL vision'
            got = _outputs(model(**x))
    assert max((g - w).abs().max().item() for g, w in zip(got, want, strict=True)) <= PARITY
