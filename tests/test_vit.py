"""The timm contract of the vispe ViT, pretrained timm weights with a swapped encoding, and input errors."""
import json

import pytest
import timm
import torch
from timm.models._hub import save_for_hf

import vispe
from conftest import TINY

MODELS = sorted(set(timm.list_models('vispe_vit_*')) | {f'vit_{s}' for s in vispe.vit.VIT_SIZES})


def test_every_size_is_registered_under_both_names_and_no_timm_name_is_reused():
    for size in ('tiny', 'small', 'base', 'large'):
        assert timm.is_model(f'vit_{size}') and timm.is_model(f'vispe_vit_{size}_patch16_224')
        assert timm.models.model_entrypoint(f'vit_{size}_patch16_224').__module__ == \
            'timm.models.vision_transformer'


@pytest.mark.parametrize('name', MODELS)
def test_timm_contract(name):
    m = timm.create_model(name, pe='rope_mixed+learned', **TINY)
    assert isinstance(m, vispe.VisionTransformer)
    assert m.pretrained_cfg['hf_hub_id'].startswith('timm/vit_') and m.pretrained_cfg['architecture'] == name
    x = torch.randn(2, 3, 32, 32)
    assert m(x).shape == (2, 5)
    feats = m.forward_features(x)
    assert feats.shape == (2, 17, 32)
    assert m.forward_head(feats, pre_logits=True).shape == (2, 32)
    final, inter = m.forward_intermediates(x, indices=[0, 1])
    assert final.shape == (2, 17, 32) and [t.shape for t in inter] == [(2, 32, 4, 4)] * 2
    only = m.forward_intermediates(x, indices=1, output_fmt='NLC', intermediates_only=True, return_prefix_tokens=True)
    assert only[0][0].shape == (2, 16, 32) and only[0][1].shape == (2, 1, 32)
    # non-square input at inference (dynamic_img_size is on by default)
    assert m(torch.randn(1, 3, 24, 48)).shape == (1, 5)
    assert {'pe.encodings.0.freqs', 'pe.encodings.1.pos_embed', 'cls_token'} <= m.no_weight_decay()
    m.reset_classifier(3)
    assert m(x).shape == (2, 3)
    m.reset_classifier(0, 'avg')
    assert m(x).shape == (2, 32)


def test_set_input_size_resamples_learned_table():
    m = timm.create_model('vit_tiny', pe='learned', **TINY)
    m.set_input_size(img_size=(48, 64))
    assert m.patch_embed.grid_size == (6, 8)
    assert m.pe.pos_embed.shape == (1, 1 + 48, 32)
    assert m.pe.ctx.grid_size == (6, 8)
    assert m(torch.randn(1, 3, 48, 64)).shape == (1, 5)


def test_gradient_checkpointing_gives_same_gradients():
    m = timm.create_model('vit_tiny', pe='rope_mixed', **TINY)
    x = torch.randn(2, 3, 32, 32)
    m(x).sum().backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    m.set_grad_checkpointing(True)
    m(x).sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad, ref[n], rtol=1e-5, atol=1e-6, msg=n)


def test_features_only_wraps_intermediates():
    m = timm.create_model('vit_tiny', pe='rope_axial', features_only=True, out_indices=(0, 1), **TINY)
    outs = m(torch.randn(1, 3, 32, 32))
    assert [o.shape for o in outs] == [(1, 32, 4, 4)] * 2


def test_save_for_hf_local_dir_round_trip(tmp_path):
    m = timm.create_model('vit_tiny', pe={'name': 'rope_axial', 'theta': 50}, **TINY).eval()
    save_for_hf(m, tmp_path)
    cfg = json.loads((tmp_path / 'config.json').read_text())
    assert cfg['model_args']['pe'] == {'name': 'rope_axial', 'theta': 50}
    m2 = timm.create_model(f'local-dir:{tmp_path}', pretrained=True).eval()
    assert m2.pe.theta == 50
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(m2(x), m(x), rtol=0, atol=0)


def test_open_clip_visual_tower_from_model_config(tmp_path):
    """open_clip builds its image tower with timm.create_model(timm_model_name): a local-dir export carries pe."""
    import open_clip
    tower = timm.create_model('vit_tiny', pe='rope_mixed', **dict(TINY, num_classes=0))
    save_for_hf(tower, tmp_path / 'tower')
    cfg = dict(embed_dim=16,
               vision_cfg=dict(timm_model_name=f'local-dir:{tmp_path / "tower"}', timm_model_pretrained=False,
                               timm_pool='avg', timm_proj='linear', image_size=32),
               text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1))
    (tmp_path / 'cfgs').mkdir()
    (tmp_path / 'cfgs' / 'vispe-test.json').write_text(json.dumps(cfg))
    open_clip.add_model_config(tmp_path / 'cfgs')
    model = open_clip.create_model('vispe-test', pretrained=None)
    assert isinstance(model.visual.trunk, vispe.VisionTransformer) and model.visual.trunk.pe.name == 'rope_mixed'
    img = model.encode_image(torch.randn(2, 3, 32, 32))
    txt = model.encode_text(torch.randint(0, 64, (2, 8)))
    assert img.shape == txt.shape == (2, 16)


# ------------------------------------------------------------------ pretrained weights
def _timm_checkpoint(tmp_path, **kw):
    ref = timm.create_model('vit_tiny_patch16_224', **dict(TINY, num_classes=1000, **kw)).eval()
    path = tmp_path / 'vit.pth'
    torch.save(ref.state_dict(), path)
    return ref, str(path)


def test_learned_pe_from_timm_checkpoint_equals_timm_model(tmp_path):
    ref, path = _timm_checkpoint(tmp_path)
    m = timm.create_model('vit_tiny', pe='learned', pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=1000)).eval()
    assert m.pretrained_report.dropped == [] and m.pretrained_report.initialized == []
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), ref(x), rtol=1e-5, atol=1e-5)


def test_swapped_encoding_keeps_shared_weights_and_reports(tmp_path):
    ref, path = _timm_checkpoint(tmp_path)
    m = timm.create_model('vit_tiny', pe='rope_mixed', pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=1000))
    assert m.pretrained_report.dropped == ['pos_embed']
    assert m.pretrained_report.initialized == ['pe.freqs']
    ours = m.state_dict()
    for k, v in ref.state_dict().items():
        if k != 'pos_embed':
            assert torch.equal(ours[k], v), k


def test_timm_checkpoint_into_composed_encoding_moves_the_table(tmp_path):
    ref, path = _timm_checkpoint(tmp_path)
    m = timm.create_model('vit_tiny', pe='rope_axial+learned', **dict(TINY, num_classes=1000))
    report = vispe.load_timm_checkpoint(m, path)
    assert report.dropped == [] and report.initialized == []
    assert torch.equal(m.pe.encodings[1].pos_embed, ref.pos_embed)


def test_other_number_of_classes_reports_the_classifier_dropped_and_initialised(tmp_path):
    _, path = _timm_checkpoint(tmp_path)
    m = timm.create_model('vit_tiny', pe='rope_mixed', pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=7))
    report = m.pretrained_report
    assert report.dropped == ['pos_embed', 'head.bias', 'head.weight']
    assert report.initialized == ['head.bias', 'head.weight', 'pe.freqs']
    assert 'initialised nothing' not in str(report)


def test_load_timm_checkpoint_into_a_headless_backbone(tmp_path):
    ref, path = _timm_checkpoint(tmp_path)
    m = timm.create_model('vit_tiny', pe='rope_axial+learned', **dict(TINY, num_classes=0))
    report = vispe.load_timm_checkpoint(m, path)
    assert report.dropped == ['head.bias', 'head.weight'] and report.initialized == []
    assert torch.equal(m.blocks[1].attn.qkv.weight, ref.blocks[1].attn.qkv.weight)


def test_checkpoint_of_other_depth_raises(tmp_path):
    _, path = _timm_checkpoint(tmp_path, depth=3)
    with pytest.raises(ValueError, match='does not match this architecture'):
        timm.create_model('vit_tiny', pe='rope_axial', pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=1000))


def test_checkpoint_of_other_width_raises(tmp_path):
    _, path = _timm_checkpoint(tmp_path)
    with pytest.raises(RuntimeError, match='size mismatch'):
        timm.create_model('vit_tiny', pe='rope_axial', pretrained=True, pretrained_cfg_overlay=dict(file=path),
                          **dict(TINY, num_classes=1000, embed_dim=64))


# ------------------------------------------------------------------ bad input
def test_input_not_divisible_by_patch_size_is_a_clear_error():
    m = timm.create_model('vit_tiny', pe='rope_axial', **TINY)
    with pytest.raises(ValueError, match=r'input size 30x32 is not divisible by the patch size 8x8'):
        m(torch.randn(1, 3, 30, 32))


@pytest.mark.parametrize('arg, kwargs', [
    ('num_heads', dict(num_heads=0)),
    ('tubelet', dict(video=True, tubelet=0)),
    ('num_frames', dict(video=True, num_frames=0)),
])
def test_non_positive_sizes_name_the_argument(arg, kwargs):
    with pytest.raises(ValueError, match=rf'{arg} must be a positive integer, got 0'):
        timm.create_model('vit_tiny', pe='rope_axial', **dict(TINY, **kwargs))


def test_unknown_encoding_through_timm_suggests_names():
    with pytest.raises(ValueError, match=r"unknown encoding 'rope_mixd' \(argument pe\).*'rope_mixed'"):
        timm.create_model('vit_tiny', pe='rope_mixd', **TINY)


def test_pos_embed_argument_points_to_pe():
    with pytest.raises(ValueError, match='pe='):
        timm.create_model('vit_tiny', pos_embed='learn', **TINY)


def test_patch_dropout_carries_positions_of_kept_tokens():
    m = timm.create_model('vit_tiny', pe='rope_axial', patch_drop_rate=0.5, **TINY).train()
    out = m.forward_features(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 1 + 8, 32)
