"""patch_detr on tiny transformers DETR-family models built from configs: parity with each model's own
encoding first (logits and boxes of a padded batch), then padding invariance of the transformer part,
masks, exact removal, isolation between instances, training, and the refusals."""
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip('transformers')

from vispe.extras import UnsupportedVersionError  # noqa: E402
from vispe.integrations import patch_detr, transformers_detr  # noqa: E402

# a padded batch: image 0 fills the 64 x 96 canvas, image 1 is 40 x 64 (feature map 3 x 4 of 4 x 6 at stride 16)
IMAGES = torch.randn(2, 3, 64, 96, generator=torch.Generator().manual_seed(0))
PIXEL_MASK = torch.ones(2, 64, 96, dtype=torch.long)
PIXEL_MASK[1, 40:] = 0
PIXEL_MASK[1, :, 64:] = 0


def _resnet(levels: int = 1):
    return transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                     out_features=['stage2', 'stage3', 'stage4'][-levels:], num_channels=3)


_DETR_SIZES = dict(use_timm_backbone=False, use_pretrained_backbone=False, d_model=32, encoder_layers=2,
                   decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                   decoder_ffn_dim=64, num_queries=5, num_labels=3)


_SHARPEN = {'q_proj': 0.3, 'k_proj': 0.3, 'sampling_offsets': 0.1, 'attention_weights': 0.1}


def _sharpen(model: nn.Module) -> nn.Module:
    """Larger attention projections than transformers' init (0.02 std; zeros for the deformable offsets and
    weights), so positions visibly change the outputs."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, module in model.named_modules():
            std = _SHARPEN.get(name.rsplit('.', 1)[-1])
            if isinstance(module, nn.Linear) and std:
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * std)
    return model.eval()


def build(kind: str, **overrides) -> nn.Module:
    torch.manual_seed(0)
    if kind == 'detr':
        model = transformers.DetrForObjectDetection(transformers.DetrConfig(
            backbone_config=_resnet(), **{**_DETR_SIZES, **overrides}))
    elif kind == 'conditional':
        model = transformers.ConditionalDetrForObjectDetection(transformers.ConditionalDetrConfig(
            backbone_config=_resnet(), **{**_DETR_SIZES, **overrides}))
    elif kind == 'deformable':
        model = transformers.DeformableDetrForObjectDetection(transformers.DeformableDetrConfig(
            backbone_config=_resnet(3), num_feature_levels=3, encoder_n_points=2, decoder_n_points=2,
            **{**_DETR_SIZES, **overrides}))
    else:
        config_cls = {'rt_detr': transformers.RTDetrConfig,
                      'rt_detr_v2': getattr(transformers, 'RTDetrV2Config', None)}[kind]
        if config_cls is None:
            pytest.skip('this transformers has no RT-DETRv2')
        model_cls = getattr(transformers, config_cls.__name__.replace('Config', 'ForObjectDetection'))
        backbone = transformers.RTDetrResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                                   out_features=['stage2', 'stage3', 'stage4'], num_channels=3)
        model = model_cls(config_cls(
            backbone_config=backbone, encoder_hidden_dim=32, d_model=32, encoder_in_channels=[16, 16, 16],
            decoder_in_channels=[32, 32, 32], encoder_ffn_dim=64, encoder_attention_heads=4,
            decoder_attention_heads=4, decoder_ffn_dim=64, decoder_layers=2, num_queries=5, num_labels=3,
            eval_size=None, num_denoising=0, decoder_n_points=2, **overrides))
    return _sharpen(model)


def run(model, images=IMAGES, pixel_mask=PIXEL_MASK, **kw):
    with torch.no_grad():
        out = model(pixel_values=images, pixel_mask=pixel_mask, **kw)
    return out.logits, out.pred_boxes


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------- parity first
@pytest.mark.parametrize('kind, spec', [('detr', 'detr_sine'), ('conditional', 'detr_sine'),
                                        ('deformable', 'detr_sine:offset=-0.5')])
def test_own_encoding_gives_the_unpatched_logits_and_boxes_on_a_padded_batch(kind, spec):
    model = build(kind)
    ref = run(model)
    with patch_detr(model, spec):
        assert max_diff(run(model), ref) <= 1e-6
    with patch_detr(model, None) as handle:  # None: the model's own
        assert handle.encoding.name == spec.split(':')[0] and max_diff(run(model), ref) <= 1e-6
    # and the patch is live: another encoding changes the answer
    other = {'detr': 'rope_mixed', 'conditional': 'detr_sine+rope_mixed', 'deformable': 'learned'}[kind]
    with patch_detr(model, other):
        assert max_diff(run(model), ref) > 1e-4


@pytest.mark.parametrize('kind', ['rt_detr', 'rt_detr_v2'])
def test_rt_detr_own_sincos_is_axis_order_grid(kind):
    # transformers' RT-DETR ignores pixel_mask (it never pads), so parity is on an unpadded batch. At random
    # init its CNN feature pyramid passes little of the AIFI output on to the logits: the AIFI output is
    # compared too
    model = build(kind)
    aifi = []
    model.model.encoder.aifi[0].register_forward_hook(lambda m, a, out: aifi.append(out))
    ref = run(model, pixel_mask=None)
    with patch_detr(model, 'sincos:axis_order=grid'):
        assert max_diff(run(model, pixel_mask=None), ref) <= 1e-6
    with patch_detr(model, 'sincos'):  # MAE's x-first order is another table
        run(model, pixel_mask=None)
    assert (aifi[1] - aifi[0]).abs().max().item() <= 1e-6
    assert (aifi[2] - aifi[0]).abs().max().item() > 1e-4


def test_bare_detr_model_is_patched_too():
    detector = build('detr')
    model = detector.model  # DetrModel: the same modules, no heads
    with torch.no_grad():
        ref = model(pixel_values=IMAGES, pixel_mask=PIXEL_MASK).last_hidden_state
        with patch_detr(model, 'detr_sine'):
            assert (model(pixel_values=IMAGES, pixel_mask=PIXEL_MASK).last_hidden_state - ref).abs().max() <= 1e-6
        with patch_detr(model, 'rope_mixed'):
            assert (model(pixel_values=IMAGES, pixel_mask=PIXEL_MASK).last_hidden_state - ref).abs().max() > 1e-4

def test_detr_learned_starts_from_the_models_learned_tables():
    model = build('detr', position_embedding_type='learned')
    ref = run(model)
    with patch_detr(model, 'detr_learned'):
        assert max_diff(run(model), ref) <= 1e-6
    with patch_detr(model, None) as handle:
        assert handle.encoding.name == 'detr_learned'



def test_sincos_axis_order_grid_is_transformers_rt_detr_table():
    import vispe
    from transformers.models.rt_detr.modeling_rt_detr import build_2d_sinusoidal_position_embedding
    theirs = build_2d_sinusoidal_position_embedding(5, 7, embed_dim=32, temperature=10000.0)
    ours = vispe.create_pe('sincos:axis_order=grid', dim=32).embedding(vispe.grid(5, 7))
    assert (ours.reshape(theirs.shape) - theirs).abs().max().item() <= 1e-6


def test_detr_sine_offset_is_deformable_detrs_half_pixel_shift():
    import vispe
    from transformers.models.deformable_detr.modeling_deformable_detr import DeformableDetrSinePositionEmbedding
    real = torch.zeros(2, 4, 6, dtype=torch.bool)
    real[0] = True
    real[1, :3, :4] = True  # padded at the bottom and right
    theirs = DeformableDetrSinePositionEmbedding(16, normalize=True)((2, 32, 4, 6), 'cpu', torch.float32, real)
    pos = vispe.grid(4, 6).replace(key_padding_mask=~real.flatten(1))
    ours = vispe.create_pe('detr_sine:offset=-0.5', dim=32).embedding(pos)  # (B, N, C), padded tokens included
    assert (ours.transpose(1, 2).reshape(theirs.shape) - theirs)[real[:, None].expand_as(theirs)].abs().max() <= 1e-6

# ---------------------------------------------------------------------------------------------- padding
def _feature_backbone(model, levels: int = 1):
    """The model's backbone replaced (on this instance, by the test) by one that returns ``pixel_values`` as
    the last feature map: the transformer then sees identical features for an image alone and padded (a CNN
    backbone itself is not padding-invariant: its receptive field reaches into the padding)."""
    backbone = model.model.backbone

    def forward(pixel_values, pixel_mask):
        out = []
        for level in reversed(range(levels)):
            f = 2 ** level
            out.append((F.interpolate(pixel_values, scale_factor=f) if f > 1 else pixel_values,
                        F.interpolate(pixel_mask[None].float(), scale_factor=f)[0].bool() if f > 1
                        else pixel_mask.bool()))
        return out
    object.__setattr__(backbone, 'forward', forward)
    return model


def _alone_and_padded(channels: int, h=3, w=4, H=4, W=6):
    g = torch.Generator().manual_seed(3)
    alone = torch.randn(1, channels, h, w, generator=g)
    batch = torch.randn(2, channels, H, W, generator=g) * 5  # image 0 full size, garbage in image 1's padding
    batch[1, :, :h, :w] = alone[0]
    mask = torch.ones(2, H, W, dtype=torch.long)
    mask[1, h:] = 0
    mask[1, :, w:] = 0
    return alone, batch, mask


@pytest.mark.parametrize('kind, spec', [('detr', spec) for spec in ('detr_sine', 'learned', 'peg', 'liere', 'rope_mixed',
                                                                    'irpe', 'comrope_ld')]
                         + [('conditional', 'detr_sine+rope_mixed'), ('conditional', 'detr_sine+peg')])
def test_image_padded_in_a_batch_gives_its_output_alone(kind, spec):
    # what is compared: logits and boxes of the whole transformer (input projection, encoder, decoder,
    # heads) on identical backbone features
    model = _feature_backbone(build(kind))
    alone, batch, mask = _alone_and_padded(16)
    with patch_detr(model, spec):
        ref = run(model, alone, torch.ones(1, 3, 4, dtype=torch.long))
        out = run(model, batch, mask)
        assert max_diff([o[1:] for o in out], ref) <= 1e-5
        batch[1, :, 3:] = 100.0  # other garbage in the padding: same answer
        assert max_diff([o[1:] for o in run(model, batch, mask)], ref) <= 1e-5


@pytest.mark.parametrize('spec', ['learned', 'peg', 'rope_mixed'])
def test_rt_detr_aifi_output_of_a_padded_image_equals_its_output_alone(spec):
    # RT-DETR's CNN feature pyramid after AIFI convolves across the padding (transformers' RT-DETR does not
    # mask it): what the patch can promise is the AIFI output, compared here on the image's own tokens
    model = _feature_backbone(build('rt_detr'), levels=3)
    alone, batch, mask = _alone_and_padded(16)
    seen = []
    model.model.encoder.aifi[0].register_forward_hook(lambda m, a, out: seen.append(out))
    with patch_detr(model, spec):
        run(model, alone, torch.ones(1, 3, 4, dtype=torch.long))
        run(model, batch, mask)
    assert (seen[1][1:, :, :3, :4] - seen[0]).abs().max().item() <= 1e-5


def test_padded_keys_are_masked_in_every_patched_attention():
    # transformers' own DETR masks too; the patch must not lose it: with attention-side hooks in the encoder
    # and cross-attention (rope_mixed, cross_pe='keys'), garbage in the padding never reaches real outputs
    model = _feature_backbone(build('detr'))
    _, batch, mask = _alone_and_padded(16)
    with patch_detr(model, 'rope_mixed', cross_pe='keys') as handle:
        assert handle.cross_hooks
        ref = run(model, batch, mask)
        batch[1, :, 3:] = -50.0
        batch[1, :, :, 4:] = 50.0
        out = run(model, batch, mask)
    assert max_diff([o[1:] for o in out], [r[1:] for r in ref]) <= 1e-5


# ---------------------------------------------------------------------------------------------- removal, isolation
@pytest.mark.parametrize('kind, spec', [('detr', 'peg+rope_mixed'), ('rt_detr', 'irpe')])
def test_remove_restores_the_instance_bit_for_bit(kind, spec):
    model = build(kind)
    types_before = {n: type(m) for n, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    ref = run(model)
    handle = patch_detr(model, spec)
    assert any(k.startswith('model.vispe_pe.') for k in model.state_dict())
    assert not handle.encoding.training  # it follows the model's mode (ComRoPE jitters in training)
    run(model)
    handle.remove()
    assert {n: type(m) for n, m in model.named_modules()} == types_before
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
    assert not any('forward' in m.__dict__ for m in model.modules())
    assert max_diff(run(model), ref) == 0.0
    handle.remove()  # twice: nothing more to do


def test_patching_one_instance_leaves_another_and_the_classes_alone():
    a, b = build('detr'), build('detr')
    forward = type(a.model.encoder.layers[0].self_attn).forward
    ref = run(b)
    with patch_detr(a, 'rope_mixed'):
        assert max_diff(run(a), ref) > 1e-4
        assert max_diff(run(b), ref) == 0.0
        assert type(a.model.encoder.layers[0].self_attn).forward is forward
        assert b.config._attn_implementation == a.config._attn_implementation


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize('spec', ['rope_mixed', 'irpe', 'liere'])
def test_attention_side_encodings_train(spec):
    model = build('detr').train()
    handle = patch_detr(model, spec)
    labels = [{'class_labels': torch.tensor([1]), 'boxes': torch.tensor([[0.5, 0.5, 0.2, 0.3]])},
              {'class_labels': torch.tensor([0, 2]),
               'boxes': torch.tensor([[0.3, 0.3, 0.1, 0.1], [0.6, 0.4, 0.2, 0.2]])}]
    loss = model(pixel_values=IMAGES, pixel_mask=PIXEL_MASK, labels=labels).loss
    assert torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in handle.encoding.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(bool(g.abs().sum() > 0) for g in grads)
    handle.remove()


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize('spec', ['rope_mixed', 'irpe', 'peg', 'detr_sine+rope_mixed'])
def test_deformable_attention_takes_additive_encodings_only_and_says_why(spec):
    with pytest.raises(ValueError, match='no query-key product.*AIFI'):
        patch_detr(build('deformable'), spec)


def test_conditional_detr_needs_an_additive_part_and_names_the_composition():
    model = build('conditional')
    with pytest.raises(ValueError, match=r"k_pos_proj.*'detr_sine\+rope_mixed'"):
        patch_detr(model, 'rope_mixed')
    with patch_detr(model, 'detr_sine+rope_mixed'):
        assert all(torch.isfinite(t).all() for t in run(model))


@pytest.mark.parametrize('kind, cross_pe, match', [
    ('detr', 'queries', r"cross_pe must be one of \('auto', 'keys', 'additive', 'none'\)"),
    ('rt_detr', 'keys', 'deformable and sees no image-token positions'),
    ('conditional', 'none', 'k_pos_proj'),
])
def test_bad_cross_pe_is_refused_with_the_reason(kind, cross_pe, match):
    with pytest.raises(ValueError, match=match):
        patch_detr(build(kind), 'detr_sine', cross_pe=cross_pe)


def _bad_masks():
    wrong_shape = PIXEL_MASK[:, :32]
    floats = PIXEL_MASK.float()
    twos = PIXEL_MASK * 2
    empty = PIXEL_MASK.clone()
    empty[1] = 0
    inverted = (PIXEL_MASK == 0)  # vispe's convention (True on padding) by mistake
    return [(wrong_shape, r'pixel_mask must be \(batch, height, width\) = \(2, 64, 96\)'),
            (floats, 'bool or integer tensor'), (twos, 'only 0 .padding. and 1'),
            (empty, r'images \[1\] of the batch are all padding'),
            (inverted, "1 on real pixels and 0 on padding .transformers' convention")]  # image 0 all 0


@pytest.mark.parametrize('case', range(5))
def test_bad_pixel_masks_get_clear_errors(case):
    model = build('detr')
    mask, match = _bad_masks()[case]
    with patch_detr(model, 'rope_mixed'), pytest.raises(ValueError, match=match):
        run(model, pixel_mask=mask)


def test_unsupported_models_versions_encodings_and_double_patching_are_refused(monkeypatch):
    model = build('detr')
    with pytest.raises(TypeError, match='patch_detr supports transformers models of type detr'):
        patch_detr(nn.Linear(2, 2))
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=8, image_size=8, patch_size=4))
    with pytest.raises(TypeError, match="model_type='vit'"):
        patch_detr(vit)
    with pytest.raises(ValueError, match='bogus'):
        patch_detr(model, 'bogus')
    with pytest.raises(ValueError, match='cameras'):
        patch_detr(model, 'prope')
    with patch_detr(model, 'rope_mixed'):
        with pytest.raises(RuntimeError, match='already patched'):
            patch_detr(model, 'irpe')
        with pytest.raises(ValueError, match='not inputs_embeds'):
            model.model(inputs_embeds=torch.randn(2, 12, 32))
    monkeypatch.setattr(sys.modules['transformers'], '__version__', '4.57.1')  # the module transformers left there
    with pytest.raises(UnsupportedVersionError,
                       match=r'transformers >= 5.25, < 6; transformers 4.57.1 is installed: pip install "vispe\[transformers\]"'):
        patch_detr(model)


@pytest.mark.parametrize('spec', ['irpe', 'detr_sine+irpe:on=k', 'swin_rpb'])
def test_cross_pe_keys_refuses_a_logit_bias_when_patched(spec):
    """A logit bias needs query positions, which DETR's object queries lack: refused when the model is
    patched (it failed at the first forward with a bare size error), with nothing changed."""
    model = build('detr')
    before = run(model)
    with pytest.raises(ValueError, match="cross_pe='keys' cannot take encoding .*'additive'"):
        patch_detr(model, spec, cross_pe='keys')
    assert max_diff(run(model), before) == 0 and not hasattr(model.model, 'vispe_pe')
