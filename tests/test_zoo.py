"""timm's ViT zoo with any encoding (`vispe.zoo`): wrapped entrypoints, `vispe.convert`, weights parity.

Parity (`benchmarks.zoo_coverage.parity`, whose table docs/zoo.md shows): a random-init tiny timm model
(its attention sharpened so that positions change the logits by far more than the tolerance) is
saved to a file and loaded by the wrapped entrypoint with ``pe=timm_pe_spec(model)``,
``pretrained=True`` and ``pretrained_cfg_overlay=dict(file=...)``: timm's own loader and filters
run, then the conversion; its logits equal timm's model's to 1e-5.
"""
import copy

import pytest
import timm
import torch
from timm.models import _registry
from timm.models.vision_transformer import VisionTransformer as TimmVisionTransformer
from torch import nn

import vispe
from benchmarks.zoo_coverage import PARITY, build, parity, sharpen
from vispe.zoo import ZOO_MODULES

ALL_ENTRYPOINTS = [n for m in ZOO_MODULES for n in timm.list_models(module=m)]


def _input(model: nn.Module) -> torch.Tensor:
    return torch.randn(2, 3, *model.patch_embed.img_size, generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize('name', sorted(PARITY))
def test_own_encoding_gives_timm_logits(name, tmp_path):
    diff, blind, report = parity(name, str(tmp_path / 'timm.pth'))
    assert blind > 1e-3  # positions matter here, so the comparison below can fail
    assert diff <= 1e-5
    assert report.dropped == [] and report.initialized == []


@pytest.mark.parametrize('rope_type, options', [
    ('cat', dict(temperature=10000.0, ref_feat_shape=(16, 16))),  # EVA-02
    ('cat', dict(temperature=100.0, grid_indexing='xy')),  # RoPE-ViT axial
    ('cat', dict(temperature=10000.0, grid_offset=1.0, rotate_half=True)),
    ('dinov3', dict(temperature=100.0, rotate_half=True)),
    ('dinov3', dict(min_period=0.5, max_period=50.0, normalize_coords='max', grid_indexing='xy', rotate_half=False)),
    ('mrope', dict(temperature=10000.0, rotate_half=True, mrope_section=(2, 3, 3))),
    ('mixed', dict(temperature=10.0, grid_indexing='xy')),
])
def test_rope_timm_rotates_as_timms_rope_module(rope_type, options):
    """q and k rotated by `rope_timm` equal timm's own rope module + `apply_rot_embed_cat` on a
    non-square grid other than the reference one (prefix tokens untouched)."""
    from timm.layers import apply_rot_embed_cat, create_rope_embed
    heads, hd, depth, grid = 2, 16, 2, (5, 7)
    kw = dict(options)
    rotate_half = kw.pop('rotate_half', False)
    timm_kw = dict({'cat': dict(in_pixels=False), 'mixed': dict(depth=depth)}.get(rope_type, {}), **kw)
    rope = create_rope_embed(rope_type, dim=heads * hd, num_heads=heads, rotate_half=rotate_half, **timm_kw)
    pe = vispe.create_pe(dict(name='rope_timm', rope_type=rope_type, rotate_half=rotate_half, **kw),
                         dim=heads * hd, num_heads=heads, depth=depth, grid_size=(4, 4), num_prefix_tokens=1)
    if rope_type == 'mixed':
        pe.load_state_dict(pe.adopt_timm_rope(rope))
    emb = rope.get_embed(shape=list(grid))
    q, k = torch.randn(2, 2, heads, 1 + 35, hd).unbind(0)
    state = pe.prepare(vispe.grid(*grid, num_prefix=1, train_grid=(4, 4)))
    for layer in range(depth if rope_type == 'mixed' else 1):
        e = emb[layer] if rope_type == 'mixed' else emb
        want = [torch.cat([t[:, :, :1], apply_rot_embed_cat(t[:, :, 1:], e, half=rotate_half)], 2) for t in (q, k)]
        got = state.qk(q, k, layer)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- without pe=
@pytest.mark.parametrize('module', ZOO_MODULES)
def test_wrapped_entrypoints_are_the_modules_own(module):
    mod = getattr(timm.models, module)
    for name in timm.list_models(module=module):
        fn = _registry._model_entrypoints[name]
        assert fn._vispe_original is getattr(mod, name)
        assert (fn.__name__, fn.__module__, fn.__doc__) == (name, mod.__name__, getattr(mod, name).__doc__)


@pytest.mark.parametrize('name', ['vit_small_patch14_reg4_dinov2', 'eva02_tiny_patch14_224', 'deit3_small_patch16_224'])
def test_without_pe_timm_is_untouched(name):
    original = _registry._model_entrypoints[name]._vispe_original
    torch.manual_seed(0)
    a = timm.create_model(name, depth=1).eval()
    torch.manual_seed(0)
    b = original(depth=1).eval()
    assert type(a) is type(b) and type(a).__module__.startswith('timm.')
    assert list(a.state_dict()) == list(b.state_dict())
    x = _input(a)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    assert a.pretrained_cfg == b.pretrained_cfg


# ---------------------------------------------------------------------- conversion
def test_convert_keeps_every_weight_name():
    model = timm.create_model('vit_small_patch14_reg4_dinov2', depth=2, embed_dim=64, num_heads=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted = vispe.convert(model, 'irpe+learned')
    assert converted is model and isinstance(model, vispe.VisionTransformer)
    after = model.state_dict()
    assert set(after) == (set(before) - {'pos_embed'}) | {k for k in after if k.startswith('pe.')}
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != 'pos_embed')
    assert torch.equal(after['pe.encodings.1.pos_embed'], before['pos_embed'])


def test_report_lists_dropped_and_initialised():
    vit = vispe.convert(timm.create_model('vit_tiny_patch16_224', depth=1), 'rope_mixed')
    assert vit.pretrained_report.dropped == ['pos_embed']
    assert vit.pretrained_report.initialized == ['pe.freqs']
    eva = vispe.convert(timm.create_model('vit_small_patch16_rope_mixed_ape_224', depth=1), 'liere')
    assert eva.pretrained_report.dropped == ['pos_embed', 'rope.freqs']
    assert eva.pretrained_report.initialized == sorted(f'pe.{k}' for k in eva.pe.state_dict())
    both = vispe.convert(timm.create_model('vit_small_patch16_rope_mixed_ape_224', depth=1),
                         ['learned', 'rope_timm:rope_type=mixed,grid_indexing=xy,temperature=10'])
    assert both.pretrained_report.dropped == [] and both.pretrained_report.initialized == []


def test_checkpoint_at_another_resolution_loads_as_timm_loads_it(tmp_path):
    """A DINOv2 checkpoint (37x37 table, 4 registers) into a 224 model: timm's filter resamples the
    table for both models, so they agree."""
    tiny = dict(depth=1, embed_dim=64, num_heads=2)
    torch.manual_seed(0)
    path = tmp_path / 'dinov2_518.pth'
    torch.save(timm.create_model('vit_small_patch14_reg4_dinov2', **tiny).state_dict(), path)
    load = dict(pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), img_size=224, **tiny)
    ref = timm.create_model('vit_small_patch14_reg4_dinov2', **load).eval()
    model = timm.create_model('vit_small_patch14_reg4_dinov2', pe='learned', **load).eval()
    assert model.pe.pos_embed.shape == ref.pos_embed.shape == (1, 16 * 16, 64)  # no_embed_class
    assert model.pretrained_report.resampled == ['pe.pos_embed']  # timm's filter resampled it from 37x37
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max() <= 1e-5


def test_checkpoint_table_of_another_grid_is_resampled_by_the_encoding():
    model = timm.create_model('vit_small_patch14_dinov2', depth=1, embed_dim=64, num_heads=2)  # 37x37 table
    table = model.pos_embed.detach().clone()
    vispe.convert(model, {'name': 'learned'})
    pe = vispe.create_pe('learned', dim=64, grid_size=(16, 16), num_prefix_tokens=1)
    entries, resampled = pe.adopt_pos_embed(table, 1, (37, 37))
    assert resampled == ['pos_embed'] and entries['pos_embed'].shape == (1, 1 + 16 * 16, 64)


@pytest.mark.parametrize('name, pe, kwargs, reason', [
    ('vit_small_patch16_224', 'prope', {}, 'cameras'), ('eva02_tiny_patch14_224', 'plucker', {}, 'cameras'),
    ('vit_dwee_patch16_reg1_gap_256', 'gta', {}, 'acts on v and acts on the attention output'),
    ('vit_dpwee_patch16_reg1_gap_256', 'pape', {}, 'widens the head'),
    ('vit_dlittle_patch16_reg1_gap_256', {'name': 'irpe', 'on': 'qkv'}, {}, 'from the attention weights'),
    ('deit_tiny_distilled_patch16_224', 'learned', dict(reg_tokens=1), 'register tokens'),
])
def test_refusals_name_the_model_and_the_reason(name, pe, kwargs, reason):
    with pytest.raises(ValueError, match=name) as err:
        timm.create_model(name, pe=pe, device='meta', **kwargs)
    assert reason in str(err.value)


# ---------------------------------------------------------------------- differential attention, distillation
@pytest.mark.parametrize('name', ['vit_dwee_patch16_reg1_gap_256', 'vit_dpwee_patch16_reg1_gap_256'])
def test_differential_attention_gives_the_encoding_its_2h_qk_heads(name):
    model = timm.create_model(name, pe='rope_mixed', depth=1, embed_dim=64, num_heads=2, device='meta')
    assert (model.pe.ctx.num_heads, model.pe.ctx.head_dim) == (4, 16)
    assert model.pe.freqs.shape[-2] == 4  # one frequency set per q/k head


@pytest.mark.parametrize('name', ['vit_dwee_patch16_reg1_gap_256', 'vit_dpwee_patch16_reg1_gap_256'])
def test_differential_attention_explicit_path_equals_timms(name):
    """timm's explicit path subtracts the maps before multiplying by v, vispe after: the same to 1e-5."""
    torch.manual_seed(0)
    ref = timm.create_model(name, depth=2, embed_dim=64, num_heads=2, img_size=64, dynamic_img_size=True).eval()
    sharpen(ref)
    model = vispe.convert(copy.deepcopy(ref), 'learned').eval()
    for m in list(ref.modules()) + list(model.modules()):
        if hasattr(m, 'fused_attn'):
            m.fused_attn = False
    x = torch.randn(2, 3, 48, 80)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max() <= 1e-5


def test_distilled_heads_and_training_outputs_are_timms():
    torch.manual_seed(0)
    ref = timm.create_model('deit_tiny_distilled_patch16_224', depth=2, embed_dim=64, num_heads=2, img_size=64)
    sharpen(ref)
    model = vispe.convert(copy.deepcopy(ref), 'learned')
    x = torch.randn(2, 3, 64, 64)
    for m in (ref, model):
        m.set_distilled_training(True)
    out, want = model.train()(x), ref.train()(x)  # no dropout here: train mode is deterministic
    assert isinstance(out, tuple) and len(out) == 2
    for o, w in zip(out, want):
        torch.testing.assert_close(o, w, atol=1e-5, rtol=0)
    assert not torch.allclose(out[0], out[1], atol=1e-3)  # the two heads differ
    sum(o.sum() for o in out).backward()
    assert model.dist_token.grad is not None and model.head_dist.weight.grad is not None
    with torch.no_grad():
        model.eval(), ref.eval()
        torch.testing.assert_close(model(x), (out[0] + out[1]).detach() / 2, atol=1e-5, rtol=0)
        torch.testing.assert_close(model.forward_head(model.forward_features(x), pre_logits=True),
                                   ref.forward_head(ref.forward_features(x), pre_logits=True), atol=1e-5, rtol=0)
    assert model.get_classifier() == (model.head, model.head_dist)
    assert 'dist_token' in model.no_weight_decay()


def test_naflex_and_double_conversion_are_refused():
    with pytest.raises(ValueError, match='NaFlexVit'):
        timm.create_model('vit_tiny_patch16_224', pe='learned', use_naflex=True, device='meta')
    model = timm.create_model('vit_tiny_patch16_224', pe='learned', depth=1)
    with pytest.raises(ValueError, match='already a vispe host'):
        vispe.convert(model, 'rope_axial')


@pytest.mark.parametrize('name, pe, kwargs', [
    ('vit_small_patch14_reg4_dinov2', 'rope_mixed', dict(dynamic_img_size=True)),
    ('vit_base_patch16_siglip_224', 'irpe', dict(dynamic_img_size=True)),  # MAP head
    ('vit_small_patch16_18x2_224', 'liere', {}),
    ('vit_base_patch16_xp_224', 'pape', {}),  # widened q/k in the fused block
    ('vit_base_patch16_rpn_224', 'peg', {}),
    ('eva02_tiny_patch14_224', 'rope_axial+learned', dict(dynamic_img_size=True)),
    ('vit_small_patch16_dinov3', 'string_cayley', {}),
    ('vit_base_patch16_sapiens2', 'rope_mixed', {}),  # grouped-query
    ('vit_pe_core_tiny_patch16_384', 'comrope_ld', {}),
    ('vit_dwee_patch16_reg1_gap_256', 'rope_mixed', dict(dynamic_img_size=True)),  # differential attention
    ('vit_dpwee_patch16_reg1_gap_256', 'irpe+liere', {}),  # differential parallel block
    ('deit_tiny_distilled_patch16_224', 'rope_axial+learned', dict(dynamic_img_size=True)),  # distillation token
])
def test_converted_models_run_and_train(name, pe, kwargs):
    small = dict(embed_dim=64, num_heads=2, num_kv_heads=1) if 'sapiens2' in name else dict(embed_dim=64, num_heads=2)
    model = timm.create_model(name, pe=pe, depth=2, img_size=112, **small, **kwargs)
    x = torch.randn(2, 3, 112, 112)
    model(x).sum().backward()
    assert all(p.grad is not None for n, p in model.pe.named_parameters())
    model.eval()
    with torch.no_grad():
        feats, inter = model.forward_intermediates(x, indices=2)
        assert inter[0].shape[-2:] == model.patch_embed.dynamic_feat_size((112, 112))
        if kwargs.get('dynamic_img_size'):
            size = model.patch_embed.patch_size[0] * 5
            assert torch.isfinite(model(torch.randn(1, 3, size, 2 * size))).all()
    assert {f'pe.{n}' for n in model.pe.no_weight_decay()} <= model.no_weight_decay()


def test_set_input_size_moves_the_encoding():
    model = timm.create_model('eva02_tiny_patch14_224', pe='learned+rope_mixed', depth=1)
    model.set_input_size(img_size=(112, 112))
    assert model.pe.ctx.grid_size == (8, 8)
    assert model(torch.randn(1, 3, 112, 112)).shape == (1, model.num_classes or model.num_features)


def test_features_only_and_patch_dropout_keep_working():
    feats = timm.create_model('vit_small_patch16_dinov3', pe='rope_mixed', features_only=True, out_indices=(0, 1),
                              depth=2, embed_dim=64, num_heads=2, img_size=64)
    assert [tuple(f.shape) for f in feats(torch.randn(1, 3, 64, 64))] == [(1, 64, 4, 4)] * 2
    model = timm.create_model('eva02_tiny_patch14_224', pe=vispe.timm_pe_spec(timm.create_model(
        'eva02_tiny_patch14_224', device='meta')), patch_drop_rate=0.5, depth=1, img_size=112)
    model.train()(torch.randn(2, 3, 112, 112)).sum().backward()
    with pytest.raises(ValueError, match='patch dropout'):
        timm.create_model('vit_tiny_patch16_224', pe='peg', patch_drop_rate=0.5, device='meta')


# ---------------------------------------------------------------------- coverage
def _applies(pe: str) -> bool:
    return not vispe.pe_info(pe)['cls'].requires


_REFUSED = ('cannot apply to differential attention',)


def _check_builds(name: str, pe, full: bool = False) -> None:
    try:
        model = build(name, pe, full)
    except ValueError as e:
        assert any(r in str(e) for r in _REFUSED) or not _applies(pe), str(e)
        return
    assert isinstance(model, vispe.zoo.PEHost) and model.pe.ctx.depth == len(model.blocks)


@pytest.mark.parametrize('name', ALL_ENTRYPOINTS)
def test_every_entrypoint_builds_with_representative_encodings(name):
    for pe in ('rope_mixed', 'irpe+learned'):
        _check_builds(name, pe)


FAMILY_EXAMPLES = ['vit_small_patch14_reg4_dinov2', 'vit_base_patch16_siglip_224', 'deit3_small_patch16_224',
                   'eva02_small_patch14_224', 'vit_small_patch16_dinov3', 'vit_base_patch16_xp_224']


@pytest.mark.parametrize('name', FAMILY_EXAMPLES)
def test_every_encoding_builds_on_one_model_per_family(name):
    for pe in vispe.list_pes():
        _check_builds(name, pe)


@pytest.mark.slow
@pytest.mark.parametrize('name', ALL_ENTRYPOINTS)
def test_every_entrypoint_builds_with_every_encoding(name):
    for pe in vispe.list_pes():
        _check_builds(name, pe, full=True)


@pytest.mark.parametrize('name, pe, size', [
    ('eva02_tiny_patch14_224', 'own', 224),  # Eva host, learned + rope_timm
    ('vit_small_patch14_reg4_dinov2', 'rope_mixed', 224),  # registers
    ('vit_dwee_patch16_reg1_gap_256', 'rope_axial', 256),  # differential attention
    ('deit_tiny_distilled_patch16_224', 'rope_axial+learned', 224),  # distillation token, a composition
])
def test_converted_hosts_compile_whole_and_run_under_inference_mode(name, pe, size):
    """The converted timm hosts trace as one graph (eval and a train step, equal to eager) and a forward
    under torch.inference_mode() leaves nothing that breaks the next training step."""
    torch.manual_seed(0)
    tiny = dict(depth=2, embed_dim=64, num_heads=2, img_size=size)
    if pe == 'own':
        model = timm.create_model(name, **tiny)
        vispe.convert(model, vispe.timm_pe_spec(model))
    else:
        model = timm.create_model(name, pe=pe, **tiny)
    x = torch.randn(2, 3, size, size)
    model.eval()
    with torch.inference_mode():
        first = model(x)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, backend='aot_eager')(x)
    assert torch.equal(first, eager) and (compiled - eager).abs().max() <= 1e-5
    model.train()
    torch.manual_seed(1)
    out = torch.compile(model, fullgraph=True, backend='aot_eager')(x)
    loss = (out[0] if isinstance(out, tuple) else out).square().mean()  # distilled training: (x, x_dist)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.pe.parameters())


# ---------------------------------------------------------------------- save_for_hf round trips
def _trained_a_little(model: nn.Module) -> nn.Module:
    """Encoding weights moved away from their initialisation, so that a reload that re-initialises them fails."""
    with torch.no_grad():
        for p in model.pe.parameters():
            p.add_(torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize('name, pe, size', [
    ('vit_tiny_patch16_224', 'liere', 64),
    ('vit_small_patch16_dinov3', 'rope_mixed+learned', 64),
    ('eva02_tiny_patch14_224', 'irpe', 56),
])
def test_save_for_hf_export_reloads_with_its_encoding(name, pe, size, tmp_path):
    """timm records pe= in the model's args, save_for_hf writes them; local-dir: rebuilds the converted model
    and loads the encoding's weights with the rest (before: a state-dict error, pos_embed missing)."""
    from timm.models._hub import save_for_hf
    model = _trained_a_little(timm.create_model(name, pe=pe, depth=2, img_size=size, num_classes=7))
    save_for_hf(model, tmp_path)
    x = torch.randn(2, 3, size, size)
    for again in (timm.create_model(f'local-dir:{tmp_path}', pretrained=True),
                  timm.create_model(f'local-dir:{tmp_path}', pretrained=True, pe=pe)):
        assert again.pe.name == model.pe.name and again.pretrained_report.initialized == []
        with torch.no_grad():
            torch.testing.assert_close(again.eval()(x), model(x), rtol=0, atol=0)


def test_save_for_hf_export_adapts_the_head_and_serves_features(tmp_path):
    from timm.models._hub import save_for_hf
    model = _trained_a_little(timm.create_model('vit_tiny_patch16_224', pe='rope_mixed', depth=3, img_size=64))
    save_for_hf(model, tmp_path)
    x = torch.randn(1, 3, 64, 64)
    headless = timm.create_model(f'local-dir:{tmp_path}', pretrained=True, num_classes=0).eval()
    feats = timm.create_model(f'local-dir:{tmp_path}', pretrained=True, features_only=True, out_indices=(0, 1)).eval()
    with torch.no_grad():
        torch.testing.assert_close(headless(x), model.forward_head(model.forward_features(x), pre_logits=True))
        expected = model.forward_intermediates(x, indices=(0, 1), intermediates_only=True)
        for got, want in zip(feats(x), expected):
            torch.testing.assert_close(got, want)


def test_save_for_hf_export_refuses_another_encoding(tmp_path):
    from timm.models._hub import save_for_hf
    save_for_hf(timm.create_model('vit_tiny_patch16_224', pe='liere', depth=1, img_size=32), tmp_path)
    with pytest.raises(ValueError, match="saved with pe='liere'"):
        timm.create_model(f'local-dir:{tmp_path}', pretrained=True, pe='rope_axial')


# ------------------------------------------------------------------ timm's own model tests on converted models
TIMM_CHECKED = [  # tiny configurations of the zoo families timm's model tests run on converted models
    ('deit3_small_patch16_224', 'learned', dict(depth=2, embed_dim=64, num_heads=4)),
    ('vit_small_patch14_reg4_dinov2', 'rope_mixed', dict(depth=2, embed_dim=64, num_heads=4, img_size=56)),
    ('vit_base_patch16_siglip_224', 'liere', dict(depth=2, embed_dim=64, num_heads=4, img_size=64)),
    ('eva02_tiny_patch14_224', 'irpe', dict(depth=2, img_size=56)),
    ('vit_small_patch16_rope_mixed_224', 'rope_mixed', dict(depth=2, embed_dim=64, num_heads=4, img_size=64)),
]


@pytest.mark.parametrize('name, pe, kwargs', TIMM_CHECKED, ids=[c[0] for c in TIMM_CHECKED])
def test_converted_models_trace_with_fx_forward_and_backward(name, pe, kwargs):
    """timm's fx tests: torchvision's `create_feature_extractor` traces the converted model; the traced
    graph gives the model's output and trains."""
    from torchvision.models.feature_extraction import create_feature_extractor
    model = timm.create_model(name, pe=pe, **kwargs).eval()
    x = _input(model)
    traced = create_feature_extractor(model, return_nodes=['head'])
    with torch.no_grad():
        torch.testing.assert_close(traced(x)['head'], model(x))
    traced.train()
    traced(x)['head'].sum().backward()
    assert all(p.grad is not None for p in model.pe.parameters())


def test_features_only_of_a_pruned_timm_rope_model_keeps_its_encoding():
    """``features_only`` with ``out_indices`` prunes the later blocks before the conversion; the adopted
    per-layer rope frequencies are those of the blocks left, and the features equal timm's."""
    kwargs = dict(depth=6, embed_dim=64, num_heads=4, img_size=64, features_only=True, out_indices=(2,))
    torch.manual_seed(0)
    ref = timm.create_model('vit_small_patch16_rope_mixed_224', **kwargs).eval()
    spec = vispe.timm_pe_spec(timm.create_model('vit_small_patch16_rope_mixed_224', depth=6, embed_dim=64, num_heads=4))
    torch.manual_seed(0)
    model = timm.create_model('vit_small_patch16_rope_mixed_224', pe=spec, **kwargs).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], ref(x)[0])


@pytest.mark.parametrize('kwargs', [dict(img_size=64), dict(img_size=64, dynamic_img_size=True, dynamic_img_pad=True)])
def test_an_input_the_patch_does_not_divide_runs_as_in_timm(kwargs):
    """A patch-14 Eva at 64 px: timm crops the remainder (fixed size) or pads (dynamic_img_pad); the
    converted model with timm's own encoding does the same and gives timm's output."""
    torch.manual_seed(0)
    ref = timm.create_model('eva02_tiny_patch14_224', depth=1, **kwargs).eval()
    model = vispe.convert(copy.deepcopy(ref), vispe.timm_pe_spec(ref)).eval()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def test_a_zoo_model_with_pe_runs_at_another_size():
    """With pe= a zoo name is dynamic by default (as vispe's own names): built at 32x48, run at 48x64."""
    model = timm.create_model('vit_small_patch16_224', depth=1, embed_dim=64, num_heads=4, img_size=(32, 48),
                              pe='rope_mixed')
    assert model.dynamic_img_size and not model.patch_embed.strict_img_size
    assert model(torch.randn(1, 3, 48, 64)).shape == (1, 1000)
    with pytest.raises(ValueError, match=r'input size 40x64 is not divisible by the patch size 16x16'):
        model(torch.randn(1, 3, 40, 64))


@pytest.mark.parametrize('name', ['vit_small_patch16_224', 'eva02_tiny_patch14_224', 'deit_tiny_distilled_patch16_224'])
def test_zoo_model_with_pe_is_timms_at_the_built_size(name):
    """Dynamic by default changes nothing at the size the model was built for: with timm's own encoding
    the converted model gives the (fixed-size) timm model's output."""
    torch.manual_seed(0)
    ref = timm.create_model(name, depth=2, embed_dim=64, num_heads=4).eval()
    assert not ref.dynamic_img_size  # timm's default without pe= is unchanged
    sharpen(ref)
    torch.manual_seed(0)
    model = timm.create_model(name, depth=2, embed_dim=64, num_heads=4, pe=vispe.timm_pe_spec(ref)).eval()
    assert model.dynamic_img_size
    sharpen(model)  # the same weights: the same seed, and sharpen draws from its own generator
    x = torch.randn(2, 3, *ref.patch_embed.img_size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x), rtol=1e-5, atol=1e-5)


def test_a_zoo_model_whose_img_size_the_patch_does_not_divide_keeps_timms_fixed_size():
    """timm's fixed-size patch embedding crops the remainder of 56 px under a 16 px patch, which a dynamic
    model would refuse: with pe= (and no dynamic_img_size) the model stays fixed-size and gives timm's output."""
    torch.manual_seed(0)
    ref = timm.create_model('vit_small_patch16_224', depth=1, embed_dim=64, num_heads=4, img_size=56).eval()
    torch.manual_seed(0)
    model = timm.create_model('vit_small_patch16_224', depth=1, embed_dim=64, num_heads=4, img_size=56,
                              pe='learned').eval()
    assert not model.dynamic_img_size and model.patch_embed.strict_img_size
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


def test_a_fixed_size_zoo_model_at_another_size_says_to_pass_dynamic_img_size():
    model = timm.create_model('vit_small_patch16_224', depth=1, embed_dim=64, num_heads=4, img_size=(32, 48),
                              pe='rope_mixed', dynamic_img_size=False)
    with pytest.raises(ValueError, match=r"does not match the model's fixed input size 32x48; build it with "
                                         r'dynamic_img_size=True'):
        model(torch.randn(1, 3, 48, 64))


def test_a_zoo_model_without_pe_keeps_timms_fixed_size():
    model = timm.create_model('vit_small_patch16_224', depth=1, embed_dim=64, num_heads=4, img_size=(32, 48))
    assert type(model) is TimmVisionTransformer and not model.dynamic_img_size
    with pytest.raises(AssertionError, match=r"Input height \(48\) doesn't match model \(32\)"):
        model(torch.randn(1, 3, 48, 64))


@pytest.mark.parametrize('name', ['eva02_tiny_patch14_224', 'deit3_small_patch16_224', 'vit_tiny'])
def test_torchscript_is_refused_with_the_reason(name):
    model = timm.create_model(name, depth=1, pe='learned')
    with pytest.raises(RuntimeError, match='do not support TorchScript'):
        torch.jit.script(model)
    with timm.layers.set_layer_config(scriptable=True), pytest.raises(ValueError, match='do not support TorchScript'):
        timm.create_model(name, depth=1, pe='learned')


@pytest.mark.parametrize('name', ['eva02_tiny_patch14_224', 'deit3_small_patch16_224', 'vit_small_patch16_224'])
def test_the_host_module_filters_a_timm_checkpoint_for_the_converted_model(name):
    """timm reads ``checkpoint_filter_fn`` from the module of a model's class (headless reload): the
    module of every converted host has one, which maps the unconverted model's state dict onto it."""
    import sys
    torch.manual_seed(0)
    ref = timm.create_model(name, depth=1, img_size=56).eval()
    model = timm.create_model(name, depth=1, img_size=56, pe=vispe.timm_pe_spec(ref)).eval()
    filtered = sys.modules[type(model).__module__].checkpoint_filter_fn(ref.state_dict(), model)
    model.load_state_dict(filtered)
    x = torch.randn(1, 3, 56, 56)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))
