"""`vispe.doctor` finds the position bugs public projects shipped, rebuilt on tiny models, and raises no
false alarm on stock timm, transformers and diffusers models, on patched models, or on any registered
vispe encoding; it never changes the model it checks."""
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn.functional as F

import vispe
from vispe import checks
from vispe.doctor import doctor
from conftest import TINY

transformers = pytest.importorskip('transformers')

TIMM_TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


# ---------------------------------------------------------------------------------------------- tiny hosts
def timm_model(name, **kw):
    torch.manual_seed(0)
    return timm.create_model(name, **{**TIMM_TINY, **kw}).eval()


def qwen_vision_tower(**kw):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    torch.manual_seed(0)
    cfg = Qwen2VLVisionConfig(depth=1, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4,
                              spatial_merge_size=2, temporal_patch_size=2, **kw)
    return Qwen2VisionTransformerPretrainedModel(cfg).eval()


def qwen_vl(family):
    from vispe_models.qwen_vl import tiny_qwen_vl
    return tiny_qwen_vl(family)


def hf_vision(kind):
    torch.manual_seed(0)
    image = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64)
    cfgs = {'vit': ('ViTModel', transformers.ViTConfig(**image)),
            'deit': ('DeiTModel', transformers.DeiTConfig(**image)),
            'dinov2': ('Dinov2Model', transformers.Dinov2Config(**image)),
            'siglip': ('SiglipVisionModel', transformers.SiglipVisionConfig(**image)),
            'clip': ('CLIPVisionModel', transformers.CLIPVisionConfig(**image)),
            'dinov3': ('DINOv3ViTModel', transformers.DINOv3ViTConfig(num_register_tokens=2, **image)),
            'siglip2': ('Siglip2VisionModel', transformers.Siglip2VisionConfig(
                patch_size=4, num_patches=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                intermediate_size=64))}
    cls, cfg = cfgs[kind]
    return getattr(transformers, cls)(cfg).eval()


def flux(**kw):
    from diffusers import FluxTransformer2DModel
    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8,
                                  axes_dims_rope=(4, 6, 6), **kw).eval()


def flux_inputs(h, w, ids_grid=None):
    """A FLUX forward's keywords for ``h x w`` packed tokens; ``ids_grid``: the grid the image ids are built for."""
    ih, iw = ids_grid or (h, w)
    ids = torch.zeros(ih, iw, 3)
    ids[..., 1] = torch.arange(ih)[:, None]
    ids[..., 2] = torch.arange(iw)[None]
    return dict(hidden_states=torch.randn(1, h * w, 4), encoder_hidden_states=torch.randn(1, 3, 8),
                pooled_projections=torch.randn(1, 8), timestep=torch.tensor([0.5]), img_ids=ids.reshape(-1, 3),
                txt_ids=torch.zeros(3, 3))


def wan():
    from diffusers import WanTransformer3DModel
    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                 out_channels=4, text_dim=8, freq_dim=8, ffn_dim=16, num_layers=1,
                                 rope_max_seq_len=32).eval()


def failed_checks(report):
    return sorted({r.check for r in report.failed})


# ---------------------------------------------------------------------------------------------- the bugs
def test_inv_freq_rounded_by_to_bfloat16_is_flagged():
    """NeMo Automodel PR #3856: the vision tower cast with ``.to(bfloat16)`` rounds its rotary ``inv_freq``."""
    tower = qwen_vision_tower()
    assert not doctor(tower, progress=False).flagged('float32_tables')
    report = doctor(tower.to(torch.bfloat16), progress=False)
    assert report.flagged('float32_tables')
    assert any('inv_freq (bfloat16)' in r.reason for r in report.failed)


def test_inv_freq_rounded_and_cast_back_to_float32_is_flagged_by_its_values():
    """The same rounding hidden by a cast back: the dtype is right, the frequencies are not a progression."""
    tower = qwen_vision_tower()
    rot = tower.rotary_pos_emb
    rot.inv_freq = rot.inv_freq.to(torch.bfloat16).float()
    report = doctor(tower, progress=False)
    assert failed_checks(report) == ['float32_tables']
    assert any(r.subject.endswith('.inv_freq') for r in report.failed)


def _pre_2737_resample(posemb, new_size, old_size=None, num_prefix_tokens=1, **kw):
    """timm's resample_abs_pos_embed before PR #2737: an early out on the token count alone."""
    if posemb.shape[1] == new_size[0] * new_size[1] + num_prefix_tokens:
        return posemb
    return timm.layers.resample_abs_pos_embed(posemb, new_size, old_size, num_prefix_tokens, **kw)


def test_table_not_resampled_at_an_equal_token_count_is_flagged(monkeypatch):
    """timm PR #2737: a (2, 8) grid got the (4, 4) table unchanged."""
    model = timm_model('vit_tiny_patch16_224', dynamic_img_size=True)
    assert not doctor(model, progress=False).flagged('grid_change')
    monkeypatch.setattr(timm.models.vision_transformer, 'resample_abs_pos_embed', _pre_2737_resample)
    report = doctor(model, progress=False)
    assert failed_checks(report) == ['grid_change']


def _rope_index_with(model, edit):
    """The model's own get_rope_index with ``edit(ids, kwargs)`` applied to what it returns."""
    inner = model.model
    own = inner.get_rope_index

    def rope_index(input_ids, *args, **kwargs):
        ids, delta = own(input_ids, *args, **kwargs)
        return edit(ids.clone(), input_ids, kwargs), delta
    inner.get_rope_index = rope_index
    return model


def test_temporal_ids_cast_to_int_before_scaling_are_flagged():
    """transformers PR #48669: ``second_per_grid_t`` truncated before the multiplication collapses frames
    half a second apart onto one time id."""
    model = qwen_vl('qwen2_5_vl')
    assert doctor(model, progress=False).ok
    inner = model.model
    own = inner.get_rope_index

    def truncated_first(input_ids, *args, second_per_grid_ts=None, **kwargs):
        if second_per_grid_ts is not None:
            second_per_grid_ts = second_per_grid_ts.long().to(second_per_grid_ts.dtype)
        return own(input_ids, *args, second_per_grid_ts=second_per_grid_ts, **kwargs)
    inner.get_rope_index = truncated_first
    report = doctor(model, progress=False)
    assert failed_checks(report) == ['ids_cover']
    assert [r.subject for r in report.failed] == ['model.get_rope_index (video)']


def test_still_image_given_video_time_ids_is_flagged():
    """transformers #45325: a still image's tokens given a time axis that advances, as a video's."""
    image_token = qwen_vl('qwen2_vl').config.image_token_id

    def video_time(ids, input_ids, kwargs):
        at = (input_ids[0] == image_token).nonzero()[:, 0]
        ids[0, 0, at] = ids[0, 0, at[0]] + torch.arange(len(at))
        return ids
    report = doctor(_rope_index_with(qwen_vl('qwen2_vl'), video_time), progress=False)
    assert 'model.get_rope_index (still image)' in [r.subject for r in report.failed]


def test_mrope_collapsed_to_1d_is_flagged():
    """mlx-lm PR #1768: every axis given the running 1D index, so an image loses its rows and columns."""
    def one_d(ids, input_ids, kwargs):
        return torch.arange(input_ids.shape[1]).expand_as(ids).clone()
    report = doctor(_rope_index_with(qwen_vl('qwen2_vl'), one_d), progress=False)
    subjects = {r.subject for r in report.failed}
    assert {'model.get_rope_index (image)', 'model.get_rope_index (video frame)'} <= subjects


def test_ids_built_for_unpacked_latents_are_flagged():
    """diffusion-4k #17: FLUX tokens are 2x2-packed latents, the ids were built for the unpacked latent grid."""
    model = flux()
    assert doctor(model, flux_inputs(4, 4), progress=False).ok
    report = doctor(model, flux_inputs(4, 4, ids_grid=(8, 8)), progress=False)
    assert failed_checks(report) == ['ids_cover']


def _bicubic_resize(positional_embeddings, spatial_shapes, max_length):
    out = []
    for h, w in spatial_shapes.tolist():
        t = F.interpolate(positional_embeddings.permute(2, 0, 1)[None], size=(h, w), mode='bicubic',
                          align_corners=False)[0]
        t = t.reshape(t.shape[0], -1).T
        out.append(F.pad(t, (0, 0, 0, max_length - t.shape[0])))
    return torch.stack(out)


def test_bicubic_resampling_where_the_release_used_bilinear_is_flagged():
    """timm #2542: SigLIP 2's NaFlex table resampled bicubic, where the release resamples bilinear."""
    model = hf_vision('siglip2')
    assert not doctor(model, progress=False).flagged('resample_mode')
    model.embeddings.resize_positional_embeddings = _bicubic_resize
    report = doctor(model, progress=False)
    assert failed_checks(report) == ['resample_mode']
    assert 'best fit: bicubic' in report.failed[0].reason


def test_a_release_resampled_otherwise_than_the_model_declares_is_flagged():
    """The same mismatch from the other side: the caller names the release's mode."""
    model = timm_model('vit_tiny_patch16_224', dynamic_img_size=True)
    assert doctor(model, resample_mode='bilinear', progress=False).flagged('resample_mode')


def test_a_dead_position_path_is_flagged():
    """The table is computed and dropped: ``_pos_embed`` returns the tokens without it."""
    model = timm_model('vit_tiny_patch16_224', dynamic_img_size=True)
    own = model._pos_embed

    def dropped(x):
        with_table = own(x)
        return torch.cat([model.cls_token.expand(x.shape[0], -1, -1), x.flatten(1, 2)], 1) + 0 * with_table
    model._pos_embed = dropped
    report = doctor(model, progress=False)
    assert 'moves_output' in failed_checks(report)


@pytest.mark.parametrize('name', ['eva02_tiny_patch14_224.mim_in22k', 'vit_base_patch16_dinov3'])
def test_rotate_half_against_interleaved_tables_is_flagged(name):
    """timm PR #2692: the rope's pair layout and the attention's ``rotate_half`` disagree."""
    model = timm_model(name, dynamic_img_size=True)
    assert not doctor(model, progress=False).flagged('relative_logits')
    for blk in model.blocks:
        blk.attn.rotate_half = not blk.attn.rotate_half
    report = doctor(model, progress=False)
    assert failed_checks(report) == ['relative_logits']


def test_sections_that_do_not_cover_the_head_are_flagged():
    model = qwen_vl('qwen2_vl')
    model.config.text_config.rope_parameters['mrope_section'] = [2, 3, 2]
    assert failed_checks(doctor(model, progress=False)) == ['head_split']


# ---------------------------------------------------------------------------------------------- no false alarm
STOCK_TIMM = [('vit_tiny_patch16_224', {}), ('vit_tiny_patch16_224', dict(dynamic_img_size=True)),
              ('deit_tiny_distilled_patch16_224', dict(dynamic_img_size=True)),
              ('eva02_tiny_patch14_224.mim_in22k', {}),
              ('vit_small_patch16_rope_mixed_224', dict(dynamic_img_size=True)),
              ('vit_base_patch16_dinov3', dict(dynamic_img_size=True))]


@pytest.mark.parametrize('name, kw', STOCK_TIMM)
def test_stock_timm_models_pass(name, kw):
    report = doctor(timm_model(name, **kw), progress=False)
    assert report.ok, str(report)
    assert report.passed


@pytest.mark.parametrize('kind', ['vit', 'deit', 'dinov2', 'siglip', 'clip', 'dinov3', 'siglip2'])
def test_stock_transformers_vision_models_pass(kind):
    report = doctor(hf_vision(kind), progress=False)
    assert report.ok, str(report)
    assert {'moves_output', 'resample_mode', 'relative_logits'} & {r.check for r in report.passed}


@pytest.mark.parametrize('family', ['qwen2_vl', 'qwen2_5_vl', 'qwen3_vl'])
def test_stock_qwen_vl_models_pass(family):
    report = doctor(qwen_vl(family), progress=False)
    assert report.ok, str(report)
    assert {'relative_logits', 'float32_tables', 'padded_alone', 'ids_cover', 'head_split'} <= \
        {r.check for r in report.passed}


def test_stock_diffusers_models_pass():
    report = doctor(flux(), flux_inputs(4, 4), progress=False)
    assert report.ok, str(report)
    assert {'relative_logits', 'head_split', 'ids_cover'} <= {r.check for r in report.passed}
    report = doctor(wan(), progress=False)
    assert report.ok, str(report)
    assert {'relative_logits', 'head_split', 'float32_tables'} <= {r.check for r in report.passed}


def test_patched_models_pass():
    from vispe.integrations import patch_vlm
    model = qwen_vl('qwen2_vl')
    patch_vlm(model, 'mrope_interleave')
    report = doctor(model, progress=False)
    assert report.ok, str(report)
    assert 'ids_cover' in {r.check for r in report.passed}
    from test_hf_detr import build
    from vispe.integrations import patch_detr
    model = build('detr')
    patch_detr(model, 'rope_mixed')
    report = doctor(model, progress=False)
    assert report.ok, str(report)
    assert any('rope_mixed' in r.subject for r in report.passed)
    open_clip = pytest.importorskip('open_clip')
    from vispe.integrations import use_pe
    torch.manual_seed(0)
    model = open_clip.CLIP(embed_dim=16, vision_cfg=dict(timm_model_name='vit_tiny_patch16_224', image_size=224,
                                                         timm_model_pretrained=False, timm_pool='token',
                                                         timm_proj='linear'),
                           text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)).eval()
    use_pe(model, 'rope_axial')
    report = doctor(model, progress=False)
    assert report.ok, str(report)
    assert any('rope_axial' in r.subject and r.check == 'relative_logits' for r in report.passed)


def _encoding_model(spec):
    cls = vispe.pe_info(spec)['cls']
    if cls.requires:  # cameras, multimodal segments: no image ViT hosts it; the encoding alone (mhrope: 3+ heads)
        return vispe.create_pe(spec, dim=64, num_heads=4, depth=2, grid_size=(4, 4), num_prefix_tokens=1)
    torch.manual_seed(0)
    return timm.create_model('vit_tiny', pe=spec, **TINY).eval()


@pytest.mark.parametrize('spec', vispe.list_pes())
def test_every_registered_encoding_passes(spec):
    report = doctor(_encoding_model(spec), progress=False)
    assert report.ok, str(report)
    if not vispe.pe_info(spec)['cls'].requires and spec != 'none':
        assert {'moves_output', 'grid_change', 'padded_alone'} <= {r.check for r in report.passed}


# ---------------------------------------------------------------------------------------------- read only
def _snapshot(model):
    return dict(
        state={k: v.detach().clone() for k, v in model.state_dict().items()},
        types=[(n, type(m)) for n, m in model.named_modules()],
        training=[(n, m.training) for n, m in model.named_modules()],
        hooks=[(n, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for n, m in
               model.named_modules()],
        dtypes={k: v.dtype for k, v in model.state_dict().items()},
        attrs=[(n, sorted(m.__dict__)) for n, m in model.named_modules()],
    )


@pytest.mark.parametrize('build', [
    lambda: timm.create_model('vit_tiny', pe='rope_mixed', **TINY),
    lambda: timm_model('eva02_tiny_patch14_224.mim_in22k', dynamic_img_size=True).train(),
    lambda: qwen_vl('qwen2_vl'),
    lambda: hf_vision('deit'),  # zero table: checked with random values on a copy
    lambda: qwen_vision_tower().to(torch.bfloat16),
], ids=['vispe', 'timm_eva_training', 'qwen2_vl', 'deit_zero_table', 'bf16_tower'])
def test_the_doctor_leaves_the_model_unchanged(build):
    model = build()
    before = _snapshot(model)
    rng = torch.get_rng_state()
    doctor(model, progress=False)
    after = _snapshot(model)
    assert before['types'] == after['types'] and before['training'] == after['training']
    assert before['hooks'] == after['hooks'] and before['dtypes'] == after['dtypes']
    assert before['attrs'] == after['attrs']
    assert before['state'].keys() == after['state'].keys()
    for k, v in before['state'].items():
        assert torch.equal(v, after['state'][k]), k
    assert torch.equal(rng, torch.get_rng_state())


# ---------------------------------------------------------------------------------------------- report, CLI
def test_every_check_is_reported_and_each_result_says_what_it_measured():
    report = doctor(timm.create_model('vit_tiny', pe='rope_axial', **TINY), progress=False)
    assert set(checks.CHECKS) <= {r.check for r in report.results}
    for r in report.results:
        if r.applicable:
            assert r.compared and r.measured is not None and r.limit is not None
        else:
            assert r.reason
    assert str(report).startswith('vispe.doctor: VisionTransformer: 0 failed')
    with pytest.raises(ValueError, match='check must be one of'):
        report.flagged('shift')


def test_the_doctor_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match='model must be a torch.nn.Module'):
        doctor('vit_small_patch16_224')


def test_python_m_vispe_doctor_runs():
    out = subprocess.run([sys.executable, '-m', 'vispe', 'doctor', 'vit_tiny', '--no-progress', '--model-args',
                          'pe=rope_axial,embed_dim=32,depth=2,num_heads=2,img_size=32,patch_size=8'],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert 'relative_logits' in out.stdout and '0 failed' in out.stdout


def test_command_line_exit_code_says_whether_a_check_failed(monkeypatch, capsys, tmp_path):
    from vispe.__main__ import doctor_main, main
    tiny = 'img_size=32,patch_size=8,embed_dim=32,depth=1,num_heads=2'
    assert doctor_main(['vit_tiny_patch16_224', '--no-progress', '--model-args', tiny + ',dynamic_img_size=true']) == 0
    assert doctor_main(['vit_tiny_patch16_224', '--no-progress', '--model-args', tiny + ',dynamic_img_size=true',
                        '--resample-mode', 'bilinear']) == 1
    assert 'failed  resample_mode' in capsys.readouterr().out
    config = tmp_path / 'model.json'
    config.write_text('{"model": {"name": "vit_tiny", "pe": "rope_mixed", "kwargs": {"patch_size": 8, '
                      '"embed_dim": 32, "depth": 1, "num_heads": 2}}, "data": {"img_size": 32}}')
    assert doctor_main([str(config), '--no-progress']) == 0
    assert 'pe (rope_mixed)' in capsys.readouterr().out
    with pytest.raises(SystemExit, match='key=value'):
        doctor_main(['vit_tiny', '--model-args', 'depth'])
    monkeypatch.setattr(sys, 'argv', ['vispe', '--help'])  # the encoding table's own options are kept
    with pytest.raises(SystemExit):
        main()
    assert '--markdown' in capsys.readouterr().out


@pytest.mark.parametrize('kind, pe', [('vit', 'rope_mixed'), ('siglip2', 'liere'), ('dinov3', None)])
def test_models_patched_by_patch_vision_pass(kind, pe):
    from vispe.integrations import find_patch, patch_vision
    model = hf_vision(kind)
    patch_vision(model, pe)
    report = doctor(model, progress=False)
    assert report.ok, str(report)
    name = find_patch(model).encoding.name
    assert any(name in r.subject and r.check == 'moves_output' for r in report.passed)


@pytest.mark.parametrize('pe', [None, 'rope_axial'])
def test_transformers_patched_by_patch_dit_pass(pe):
    from vispe.integrations import find_patch, patch_dit
    model = flux()
    patch_dit(model, pe)
    report = doctor(model, flux_inputs(4, 4), progress=False)
    assert report.ok, str(report)
    if pe is not None:
        assert any(pe in r.subject for r in report.passed)
    find_patch(model).remove()
