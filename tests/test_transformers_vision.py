"""patch_vision on tiny transformers vision encoders of every supported family, built from configs: parity of
the model's own encoding (computed by vispe) with the unpatched model at the native size, at other sizes and
in padded SigLIP 2 batches first; then every image encoding in every family, the adapter mechanism (copies,
pickles, one patch per tree, exact removal), float32 frequency tables in bfloat16 models, and the refusals."""
import copy
import math
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip('transformers')

import vispe  # noqa: E402
from vispe.extras import UnsupportedVersionError  # noqa: E402
from vispe.integrations import UnsupportedModelError, patch_vision  # noqa: E402

from adapter_checks import check_deepcopy, check_one_patch_per_tree, check_pickle  # noqa: E402
from conftest import image_pes  # noqa: E402
from transformers_vision_models import (  # noqa: E402
    CANVAS_GRIDS, FAMILIES, NATIVE, OTHER, build, canvas_inputs, host_kwargs, inputs, sharpen, siglip2_inputs,
)

PARITY = 1e-6


def _hidden(model, kind, size=NATIVE, **extra):
    with torch.no_grad():
        return model(**inputs(kind, size), **extra).last_hidden_state


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ parity: the model's own encoding
@pytest.mark.parametrize('kind', FAMILIES)
@pytest.mark.parametrize('size', [NATIVE, OTHER], ids=['native', 'other'])
def test_own_encoding_equals_the_unpatched_model(kind, size):
    model = build(kind)
    before = _state(model)
    want = _hidden(model, kind, size, **host_kwargs(kind, size))
    with patch_vision(model) as handle:
        got = _hidden(model, kind, size)
        assert not handle.report.dropped and not handle.report.initialized
    assert (got - want).abs().max().item() <= PARITY
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(_hidden(model, kind, size, **host_kwargs(kind, size)), want, rtol=0, atol=0)


@pytest.mark.parametrize('kind', ['dinov2', 'dinov2_registers', 'dinov3'])
def test_own_encoding_keeps_the_mask_token_of_masked_image_modelling(kind):
    model = build(kind)
    masked = torch.rand(2, 16, generator=torch.Generator().manual_seed(3)) < 0.5
    want = _hidden(model, kind, bool_masked_pos=masked)
    with patch_vision(model):
        got = _hidden(model, kind, bool_masked_pos=masked)
    assert (got - want).abs().max().item() <= PARITY


SIGLIP2_GRIDS = [(4, 4), (3, 5), (6, 2)]


def test_siglip2_own_encoding_equals_the_unpatched_model_on_a_padded_mixed_batch():
    model = build('siglip2')
    pixels, mask, shapes = siglip2_inputs(SIGLIP2_GRIDS, 20)
    with torch.no_grad():
        want = model(pixels, mask, shapes)
        with patch_vision(model):
            got = model(pixels, mask, shapes)
    for b, (h, w) in enumerate(SIGLIP2_GRIDS):  # padded tokens carry no meaning (masked keys)
        assert (got.last_hidden_state[b, :h * w] - want.last_hidden_state[b, :h * w]).abs().max().item() <= PARITY
    assert (got.pooler_output - want.pooler_output).abs().max().item() <= PARITY


@pytest.mark.parametrize('pe', [None, 'rope_mixed', 'liere', 'irpe', 'peg', 'learned'])
def test_siglip2_image_packed_with_padding_gets_its_output_alone(pe):
    model = build('siglip2')
    pixels, mask, shapes = siglip2_inputs(SIGLIP2_GRIDS, 20)
    with torch.no_grad(), patch_vision(model, pe):
        together = model(pixels, mask, shapes)
        for b, (h, w) in enumerate(SIGLIP2_GRIDS):
            alone = model(pixels[b:b + 1, :h * w], mask[b:b + 1, :h * w], shapes[b:b + 1])
            torch.testing.assert_close(together.last_hidden_state[b, :h * w], alone.last_hidden_state[0],
                                       rtol=0, atol=2e-6)
            torch.testing.assert_close(together.pooler_output[b], alone.pooler_output[0], rtol=0, atol=2e-6)


def test_siglip2_refuses_a_mask_that_is_not_the_processor_layout():
    model = build('siglip2')
    pixels, mask, shapes = siglip2_inputs([(3, 5)], 20)
    mask[0, 0] = 0
    with patch_vision(model, 'rope_mixed'), pytest.raises(ValueError, match='pixel_attention_mask must be 1 on the first'):
        model(pixels, mask, shapes)


@pytest.mark.parametrize('kind', ['idefics3', 'smolvlm'])
def test_navit_own_encoding_equals_the_unpatched_model_on_a_padded_canvas(kind):
    model = build(kind)
    batch = canvas_inputs()
    with torch.no_grad():
        want = model(**batch).last_hidden_state
        with patch_vision(model):
            got = model(**batch).last_hidden_state
    real = batch['patch_attention_mask'].flatten(1)
    for b in range(len(CANVAS_GRIDS)):  # the output is in canvas order again; padded tokens carry no meaning
        assert (got[b][real[b]] - want[b][real[b]]).abs().max().item() <= PARITY


@pytest.mark.parametrize('pe', [None, 'rope_mixed', 'liere', 'peg', 'learned'])
def test_navit_image_padded_on_a_canvas_gets_its_output_alone(pe):
    model = build('idefics3')
    batch = canvas_inputs()
    real = batch['patch_attention_mask'].flatten(1)
    with torch.no_grad(), patch_vision(model, pe):
        together = model(**batch).last_hidden_state
        for b, (h, w) in enumerate(CANVAS_GRIDS):
            alone = model(pixel_values=batch['pixel_values'][b:b + 1, :, :8 * h, :8 * w]).last_hidden_state[0]
            torch.testing.assert_close(together[b][real[b]], alone, rtol=0, atol=2e-6)


# ------------------------------------------------------------------ whole models find their tower
def _tiny_pair(cls, config_cls, vision_config_cls, text_config_cls):
    torch.manual_seed(0)
    sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    vision = vision_config_cls(image_size=32, patch_size=8, **sizes).to_dict()
    text = text_config_cls(vocab_size=50, max_position_embeddings=16, **sizes).to_dict()
    return cls(config_cls(vision_config=vision, text_config=text, projection_dim=16)).eval()


@pytest.mark.parametrize('which', ['siglip', 'clip', 'vit_classifier', 'idefics3'])
def test_a_whole_model_finds_its_vision_tower(which):
    if which == 'idefics3':
        torch.manual_seed(0)
        sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
        model = transformers.Idefics3Model(transformers.Idefics3Config(
            vision_config=dict(image_size=32, patch_size=8, **sizes), scale_factor=2, image_token_id=63,
            text_config=dict(num_key_value_heads=2, vocab_size=64, **sizes))).eval()
        tower = model.vision_model

        def run(m, x):  # the connector's image features (one tensor per batch of tiles)
            return torch.cat(list(m.get_image_features(pixel_values=x[:, None]).pooler_output))
    elif which == 'siglip':
        model = _tiny_pair(transformers.SiglipModel, transformers.SiglipConfig, transformers.SiglipVisionConfig,
                           transformers.SiglipTextConfig)
        tower, run = model.vision_model, lambda m, x: m.get_image_features(pixel_values=x).pooler_output
    elif which == 'clip':
        model = _tiny_pair(transformers.CLIPModel, transformers.CLIPConfig, transformers.CLIPVisionConfig,
                           transformers.CLIPTextConfig)
        tower, run = model.vision_model, lambda m, x: m.get_image_features(pixel_values=x).pooler_output
    else:
        torch.manual_seed(0)
        model = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=64, num_labels=3)).eval()
        tower, run = model.vit, lambda m, x: m(pixel_values=x).logits
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = run(model, x)
        with patch_vision(model) as handle:
            assert handle.tower is tower and handle.tower_name
            torch.testing.assert_close(run(model, x), want, rtol=0, atol=PARITY)
        with patch_vision(model, 'rope_mixed'):
            assert (run(model, x) - want).abs().max() > 1e-4


def _vlm(which):
    """A whole tiny VLM of ``which`` and a function giving the image features its language model receives."""
    sizes = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    text = dict(num_key_value_heads=2, vocab_size=64, head_dim=16, **sizes)
    image = dict(image_size=32, patch_size=8, **sizes)
    sizes_of = torch.tensor([[32, 32], [24, 16]])
    torch.manual_seed(0)
    if which == 'llava_clip':
        model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**image).to_dict(), text_config=dict(model_type='llama', **text),
            image_token_id=63, vision_feature_layer=-1))
    elif which in ('llava_pixtral', 'mistral3'):
        vision = transformers.PixtralVisionConfig(head_dim=16, **image).to_dict()
        if which == 'mistral3':
            sizes_of = torch.tensor([[32, 32], [32, 16]])  # its merger joins 2 x 2 patches
            model = transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
                vision_config=vision, text_config=dict(model_type='mistral', **text), image_token_id=63,
                vision_feature_layer=-1, spatial_merge_size=2))
        else:
            model = transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(
                vision_config=vision, text_config=dict(model_type='mistral', **text), image_token_id=63,
                vision_feature_layer=-1, vision_feature_select_strategy='full'))
        model = sharpen(model).eval()

        def run(m, x):
            out = m.model.get_image_features(pixel_values=x, image_sizes=sizes_of).pooler_output
            return torch.cat([t.flatten() for t in out])
        return model, model.model.vision_tower, run
    elif which == 'paligemma':
        model = transformers.PaliGemmaForConditionalGeneration(transformers.PaliGemmaConfig(
            vision_config=transformers.SiglipVisionConfig(**image).to_dict(), text_config=dict(model_type='gemma', **text),
            image_token_id=63))
    else:
        model = transformers.InternVLForConditionalGeneration(transformers.InternVLConfig(
            vision_config=transformers.InternVLVisionConfig(**image).to_dict(), text_config=dict(model_type='qwen2', **text),
            image_token_id=63, vision_feature_layer=-1, downsample_ratio=0.5))
        with torch.no_grad():  # transformers initialises InternVL's table to zeros
            model.model.vision_tower.embeddings.position_embeddings.normal_()
    model = sharpen(model).eval()

    def run(m, x):
        out = m.model.get_image_features(pixel_values=x).pooler_output
        return torch.cat([t.flatten() for t in out]) if isinstance(out, (list, tuple)) else out
    return model, model.model.vision_tower, run


@pytest.mark.parametrize('which', ['llava_clip', 'llava_pixtral', 'paligemma', 'internvl', 'mistral3'])
def test_a_whole_vlm_finds_its_vision_tower(which):
    model, tower, run = _vlm(which)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        want = run(model, x)
        with patch_vision(model) as handle:
            assert handle.tower is tower and handle.tower_name == 'model.vision_tower'
            assert (run(model, x) - want).abs().max().item() <= PARITY
        with patch_vision(model, 'rope_mixed'):  # another encoding: other features (beyond parity's rounding)
            assert (run(model, x) - want).abs().max() > 10 * PARITY
    check_one_patch_per_tree(model, tower, lambda m: patch_vision(m, 'rope_mixed'), lambda m: patch_vision(m, 'liere'))


# ------------------------------------------------------------------ any encoding in every family
PES = image_pes()


@pytest.fixture(scope='module')
def tiny_models():
    return {kind: build(kind) for kind in FAMILIES}


def _encoding_params(model):
    return [(n, p) for n, p in model.named_parameters() if 'vispe_pe.' in n]


# every encoding in one family by default (the families in turn, so each family takes several), every
# encoding in every family under -m slow
_ROUND = [(FAMILIES[i % len(FAMILIES)], pe) for i, pe in enumerate(PES)]
_MATRIX = _ROUND + [pytest.param(kind, pe, marks=pytest.mark.slow) for kind in FAMILIES for pe in PES
                    if (kind, pe) not in _ROUND]


@pytest.mark.parametrize('kind, pe', _MATRIX)
def test_every_image_encoding_trains_a_step_and_takes_another_size(tiny_models, kind, pe):
    model = copy.deepcopy(tiny_models[kind]).train()
    handle = patch_vision(model, pe)
    loss = model(**inputs(kind)).last_hidden_state.square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    params = _encoding_params(model)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for _, p in params if p.requires_grad), pe
    if params and any(p.requires_grad for _, p in params):
        assert any(p.grad.abs().sum() > 0 for _, p in params if p.requires_grad), f'no gradient reaches {pe}'
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-2 * p.grad
    model.eval()
    out = _hidden(model, kind, OTHER)
    grid = (OTHER[0] // 8, OTHER[1] // 8)
    assert out.shape[1] == handle.family.num_prefix(handle.tower.config) + math.prod(grid)
    assert torch.isfinite(out).all()
    handle.remove()


@pytest.mark.parametrize('kind', FAMILIES)
def test_state_dict_round_trips_through_a_patched_model(tiny_models, kind):
    a, b = copy.deepcopy(tiny_models[kind]), copy.deepcopy(tiny_models[kind])
    patch_vision(a, 'rope_mixed')
    patch_vision(b, 'rope_mixed')
    sd = a.state_dict()
    assert any('vispe_pe.freqs' in k for k in sd)
    b.load_state_dict(sd)
    torch.testing.assert_close(_hidden(b, kind), _hidden(a, kind), rtol=0, atol=0)


def test_the_report_says_what_the_encoding_took():
    model = build('vit')
    handle = patch_vision(model, 'rope_mixed+learned')
    assert handle.report.dropped == [] and handle.report.initialized == ['vispe_pe.encodings.0.freqs']
    torch.testing.assert_close(handle.encoding.encodings[1].pos_embed, model.embeddings.position_embeddings)
    handle.remove()
    with patch_vision(model, 'liere') as handle:
        assert handle.report.dropped == ['embeddings.position_embeddings']
        assert handle.report.initialized == ['vispe_pe.generators']


# ------------------------------------------------------------------ bfloat16
ROTARY = ['rope_axial', 'rope2d', 'rope_golden', 'rope_spiral']


def _float_tensors(obj, out):
    if torch.is_tensor(obj):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _float_tensors(o, out)
    elif isinstance(obj, dict):
        for o in obj.values():
            _float_tensors(o, out)
    elif hasattr(obj, '__dict__'):
        for o in vars(obj).values():
            _float_tensors(o, out)
    return out


@pytest.mark.parametrize('kind, pe', [('dinov3', None)] + [('vit', p) for p in ROTARY])
def test_frequency_tables_stay_float32_after_a_bfloat16_cast(kind, pe):
    model = build(kind)
    handle = patch_vision(model, pe)
    pos = handle.family.positions(handle.family, handle.tower, (), inputs(kind, OTHER))
    want = _float_tensors(handle.encoding.prepare(pos).state, [])
    model.to(torch.bfloat16)
    handle.encoding.clear_cache()
    got = _float_tensors(handle.encoding.prepare(pos).state, [])
    assert want and len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with torch.no_grad():
        out = model(pixel_values=inputs(kind, OTHER)['pixel_values'].bfloat16()).last_hidden_state
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_dinov3_host_rounds_its_rope_frequencies_in_bfloat16_and_the_patch_does_not():
    """The unpatched DINOv3's ``inv_freq`` buffer is rounded by ``.to(torch.bfloat16)``; vispe's own-encoding
    path computes the same frequencies in float32 (its bfloat16 model stays closer to the float32 one)."""
    model = build('dinov3')
    rope = model.rope_embeddings
    exact = rope.inv_freq.clone()
    model.to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.bfloat16 and not torch.equal(rope.inv_freq.float(), exact)
    model.to(torch.float32)  # the buffer stays rounded: transformers' cast is lossy
    assert not torch.equal(rope.inv_freq, exact)


# ------------------------------------------------------------------ the adapter mechanism
def _run(kind):
    x = inputs(kind)

    def run(model):
        with torch.no_grad():
            return model(**x).last_hidden_state
    return run


@pytest.mark.parametrize('kind', FAMILIES)
def test_patched_encoder_deep_copies_and_pickles(kind):
    check_deepcopy(build(kind), lambda m: patch_vision(m, 'rope_mixed+peg'), _run(kind))
    check_pickle(build(kind), lambda m: patch_vision(m, 'liere'), _run(kind))


def test_one_patch_per_model_tree():
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    check_one_patch_per_tree(model, model.vit, lambda m: patch_vision(m, 'rope_mixed'), lambda m: patch_vision(m, 'irpe'))


@pytest.mark.parametrize('kind', ['vit', 'idefics3', 'internvl'])
def test_gradient_checkpointing_gives_the_gradients_of_a_plain_backward(tiny_models, kind):
    """transformers checkpoints each layer's forward inside its hooks: the recomputation in backward runs
    after the tower's forward has ended. The prepared encoding reaches it through the layer's keyword
    arguments (ViT) or, in towers that do not pass them down (Idefics3, InternVL), from the forward the
    layer kept; the gradients are those of a plain backward."""
    grads = []
    for checkpointed in (False, True):
        model = copy.deepcopy(tiny_models[kind]).train()
        if checkpointed:
            model.gradient_checkpointing_enable()
        torch.manual_seed(0)  # the same encoding initialisation both times
        with patch_vision(model, 'rope_mixed+peg'):
            model(**inputs(kind)).last_hidden_state.sum().backward()
            grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any('vispe_pe' in n for n in grads[0])
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------ refusals
def test_unsupported_models_are_refused_with_the_supported_list():
    with pytest.raises(UnsupportedModelError, match='ViTModel.*Siglip2VisionModel'):
        patch_vision(nn.Linear(2, 2))
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=64, vocab_size=50))
    with pytest.raises(UnsupportedModelError, match='BertModel, which holds none'):
        patch_vision(bert)


def test_an_unsupported_transformers_version_is_refused(monkeypatch):
    monkeypatch.setattr(sys.modules['transformers'], '__version__', '4.57.0')  # the module transformers left there
    with pytest.raises(UnsupportedVersionError, match=r'patch_vision supports transformers >= 5.25'):
        patch_vision(build('vit'))


def test_a_size_the_patch_does_not_divide_is_refused():
    model = build('vit')
    with patch_vision(model, 'rope_mixed'), pytest.raises(ValueError, match='not divisible by the patch size 8x8'):
        model(pixel_values=torch.randn(1, 3, 36, 32))


def test_a_failed_patch_changes_nothing():
    model = build('dinov2')
    before = _state(model)
    want = _hidden(model, 'dinov2')
    with pytest.raises(ValueError, match="patch_vision \\(DINOv2\\): pe='liere:block_size=3' cannot apply"):
        patch_vision(model, 'liere:block_size=3')
    with pytest.raises(ValueError, match='patch_vision \\(DINOv2\\).*cameras'):
        patch_vision(model, 'prope')
    assert vispe.integrations.find_patch(model) is None
    assert all(not m._forward_hooks and not m._forward_pre_hooks and 'forward' not in vars(m) for m in model.modules())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    torch.testing.assert_close(_hidden(model, 'dinov2'), want, rtol=0, atol=0)
    patch_vision(model, 'rope_mixed').remove()


def test_attention_called_outside_the_patched_forward_says_why():
    model = build('vit')
    with patch_vision(model, 'rope_mixed'), pytest.raises(RuntimeError, match='called without vispe_prepared='):
        model.layers[0].attention(torch.randn(1, 17, 32))


# ------------------------------------------------------------------ the learned table's 'weights' resampling
@pytest.mark.parametrize('grid', [(6, 5), (3, 5), (2, 2), (4, 4), (8, 3)])
def test_learned_weights_resampling_is_siglip2s_resize(grid):
    """``learned:resample=weights`` computes SigLIP 2's ``resize_positional_embeddings`` (bilinear, antialiased)
    to its rounding, and the ``interpolate`` form to float rounding."""
    from transformers.models.siglip2.modeling_siglip2 import Siglip2VisionEmbeddings
    ctx = vispe.PEContext(dim=32, grid_size=(4, 4))
    weights = vispe.create_pe('learned:interpolation=bilinear,antialias=true,resample=weights,init_std=1', ctx)
    interpolate = vispe.create_pe('learned:interpolation=bilinear,antialias=true,init_std=1', ctx)
    interpolate.load_state_dict(weights.state_dict())
    table = weights.pos_embed.detach().reshape(4, 4, 32)
    host = Siglip2VisionEmbeddings.resize_positional_embeddings(table, torch.tensor([grid]), math.prod(grid))[0]
    with torch.no_grad():
        ours = weights.embedding(vispe.positions.grid(*grid, train_grid=(4, 4)))[0]
        theirs = interpolate.embedding(vispe.positions.grid(*grid, train_grid=(4, 4)))[0]
    assert (ours - host).abs().max().item() <= 1.2e-7
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)


@pytest.mark.parametrize('grid', [(6, 7), (3, 5), (4, 4), (2, 9)])
def test_learned_buckets_resampling_is_idefics3s_fractional_positions(grid):
    """``learned:resample=buckets`` gives each token the table row Idefics3 / SmolVLM's embeddings give it."""
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings
    host = Idefics3VisionEmbeddings(transformers.Idefics3VisionConfig(hidden_size=32, image_size=32, patch_size=8))
    pe = vispe.create_pe('learned:resample=buckets', vispe.PEContext(dim=32, grid_size=(4, 4)))
    with torch.no_grad():
        host.patch_embedding.weight.zero_()
        host.patch_embedding.bias.zero_()
        pe.pos_embed.copy_(host.position_embedding.weight[None])
        mask = torch.ones(1, *grid, dtype=torch.bool)
        want = host(torch.zeros(1, 3, 8 * grid[0], 8 * grid[1]), mask)[0]
        got = pe.embedding(vispe.positions.grid(*grid, train_grid=(4, 4)))[0]
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_benchmark_runs_and_reports_its_ratios(capsys):
    from benchmarks.transformers_vision import main
    results = main(['--width', '64', '--depth', '1', '--img', '32', '--patch', '8', '--batch', '1', '--rounds', '1',
                    '--pes', 'rope_mixed'])
    assert set(results) == {'eval own / unpatched', 'eval rope_mixed / none', 'train own / unpatched',
                            'train rope_mixed / none'}
    assert all(math.isfinite(r) and r > 0 for r in results.values())
    assert 'own encoding: learned' in capsys.readouterr().out
