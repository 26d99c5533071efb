"""Bad input to vispe's models and helpers: refused with an error that names the argument and what it
takes, or given the documented result, never a size error from deep inside torch."""
import pytest
import torch
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

import vispe
from vispe.cross_attention import check_cross_pe
from vispe.rotary.kernels import apply_pair_rotation
from vispe_models.detr import DETR
from vispe_models.nerf import NeRF
from vispe_models.vitdet import ViTDetBackbone

DETR_TINY = dict(num_classes=3, backbone='resnet18', hidden_dim=16, num_heads=2, enc_layers=1, dec_layers=1,
                 dim_feedforward=32, num_queries=5, dropout=0.0)
VITDET_TINY = dict(depth=2, embed_dim=32, num_heads=2, img_size=64, out_channels=16, window_size=2)


# ---------------------------------------------------------------------- DETR's cross-attention policy
@pytest.mark.parametrize('spec', ['irpe', 'detr_sine+irpe:on=k', 'swin_rpb'])
def test_detr_refuses_a_logit_bias_in_cross_attention_keys_when_built(spec):
    """A term per query-key pair needs query positions, which object queries lack: refused at build
    (it used to build, then fail at forward with a bare size error, or swin_rpb's own error)."""
    with pytest.raises(ValueError, match=r"cross_pe='keys' cannot take encoding .* needs query positions.*"
                                         r"use cross_pe='additive'"):
        DETR(pe=spec, cross_pe='keys', **DETR_TINY)
    assert DETR(pe=spec, **DETR_TINY).cross_pe == 'additive'  # 'auto' keeps it to encoder self-attention


def test_detr_runs_every_cross_pe_the_policy_accepts_on_a_padded_batch():
    """What `check_cross_pe` lets through runs: rotary and additive encodings on the keys of a padded batch."""
    images = [torch.rand(3, 64, 96), torch.rand(3, 32, 64)]
    model = DETR(pe='detr_sine+rope_mixed', cross_pe='keys', **DETR_TINY).eval()
    assert model.cross_hooks
    with torch.no_grad():
        assert torch.isfinite(model(images)['pred_boxes']).all()


def test_check_cross_pe_resolves_auto_and_refuses_keys_by_capability():
    ctx = vispe.PEContext(dim=32, num_heads=2, grid_size=(4, 4))
    for name in ['rope_axial', 'detr_sine', 'irpe', 'swin_rpb', 'gta', 'liere']:
        caps = vispe.create_pe(name, ctx, device='meta').capabilities
        assert check_cross_pe(caps, 'auto') == ('additive' if caps.needs_query_positions else 'keys'), name
        assert check_cross_pe(caps, 'none') == 'none' and check_cross_pe(caps, 'additive') == 'additive'
        if caps.needs_query_positions:
            with pytest.raises(ValueError, match="cross_pe='keys' cannot take"):
                check_cross_pe(caps, 'keys')
        else:
            assert check_cross_pe(caps, 'keys') == 'keys'
    with pytest.raises(ValueError, match=r"cross_pe must be one of \('auto', 'keys', 'additive', 'none'\), got "
                                         r"'queries'"):
        check_cross_pe(caps, 'queries')


# ---------------------------------------------------------------------- DETR and NeRF inputs
def test_detr_refuses_an_empty_batch_by_name():
    model = DETR(**DETR_TINY).eval()
    with pytest.raises(ValueError, match=r'images is an empty list'):
        model([])
    with pytest.raises(ValueError, match=r'images must be \(B, 3, H, W\) with B >= 1.*got \(0, 3, 64, 64\)'):
        model(torch.zeros(0, 3, 64, 64))


def test_nerf_renders_rays_with_any_leading_dims_as_the_flat_rays():
    torch.manual_seed(0)
    model = NeRF(depth=2, width=16, skips=(), num_coarse=8, num_fine=4).eval()
    rays_o, rays_d = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    with torch.no_grad():
        batched = model(rays_o, rays_d)
        flat = model(rays_o.reshape(-1, 3), rays_d.reshape(-1, 3))
    for key, value in flat.items():
        assert batched[key].shape == (2, 5, *value.shape[1:]), key
        torch.testing.assert_close(batched[key].reshape(value.shape), value, rtol=0, atol=0)


def test_nerf_renders_no_rays_as_empty_outputs():
    model = NeRF(depth=2, width=16, skips=(), num_coarse=8, num_fine=4)
    for training in (True, False):
        out = model.train(training)(torch.zeros(0, 3), torch.zeros(0, 3))
        assert {k: tuple(v.shape) for k, v in out.items()} == {
            'rgb_coarse': (0, 3), 'rgb': (0, 3), 'depth': (0,), 'acc': (0,)}
    with pytest.raises(ValueError, match=r'rays_o and rays_d must be tensors of one shape \(\.\.\., 3\).*'
                                         r'got \(2, 5, 3\) and \(10, 3\)'):
        model(torch.zeros(2, 5, 3), torch.zeros(10, 3))


# ---------------------------------------------------------------------- ViTDet
@pytest.mark.parametrize('size', [(16, 16), (16, 64), (64, 16)])
def test_vitdet_refuses_an_input_one_patch_high_or_wide_naming_the_smallest_size(size):
    backbone = ViTDetBackbone('vit_tiny_patch16_224', 'learned', **VITDET_TINY)
    with pytest.raises(ValueError, match=rf'input size {size[0]}x{size[1]} is smaller than the smallest '
                                         r'ViTDetBackbone takes, two patches per side \(32x32\)'):
        backbone(torch.randn(1, 3, *size))


def test_vitdet_gives_empty_maps_for_an_empty_batch_as_torchvision_backbones():
    backbone = ViTDetBackbone('vit_tiny_patch16_224', 'liere', **VITDET_TINY).eval()
    resnet = resnet_fpn_backbone(backbone_name='resnet18', weights=None, trainable_layers=0).eval()
    with torch.no_grad():
        one = backbone(torch.randn(1, 3, 64, 96))
        empty = backbone(torch.randn(0, 3, 64, 96))
        reference = resnet(torch.randn(0, 3, 64, 96))  # torchvision's own backbone: empty maps
    assert list(empty) == list(one) == list(reference)
    for key in one:
        assert empty[key].shape == (0, *one[key].shape[1:]) and reference[key].shape[0] == 0


@pytest.mark.parametrize('global_blocks', [5, '1', 1.0])
def test_vitdet_refuses_global_blocks_that_are_not_a_sequence(global_blocks):
    with pytest.raises(TypeError, match=r'global_blocks must be a sequence of block indices'):
        ViTDetBackbone('vit_tiny_patch16_224', 'learned', global_blocks=global_blocks, **VITDET_TINY)


# ---------------------------------------------------------------------- vispe helpers and messages
def test_pack_padded_grid_refuses_a_tensor_with_a_type_error():
    mask = torch.zeros(2, 3, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match=r'pack_padded_grid takes the Positions of a padded canvas.*got Tensor'):
        vispe.positions.pack_padded_grid(mask)


@pytest.mark.parametrize('spec', [b'rope_axial', bytearray(b'rope_axial')])
def test_a_bytes_spec_is_named_as_bytes(spec):
    with pytest.raises(TypeError, match=r'pe must be a str, dict or list of them, got (bytes|bytearray) .*decode'):
        vispe.create_pe(spec, vispe.PEContext(dim=32, num_heads=2))


@pytest.mark.parametrize('name', ['rope_axial', 'liere', 'irpe'])
def test_a_q_k_head_dim_mismatch_names_both_head_dims(name):
    pe = vispe.create_pe(name, vispe.PEContext(dim=32, num_heads=2, grid_size=(2, 2)))
    state = pe.prepare(vispe.grid(2, 2))
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r'q and k must have one head dim, got q \(1, 2, 4, 16\) \(head dim 16\) '
                                         r'and k \(1, 2, 4, 8\) \(head dim 8\)'):
        vispe.pe_attention(q, k, torch.randn(1, 2, 4, 16), state, 0)


def test_a_rotation_wider_than_the_head_names_its_channels():
    with pytest.raises(ValueError, match=r'rotation table has 8 channel pairs \(16 channels\) but the tensor it '
                                         r'rotates \(1, 4, 8\) has head dim 8'):
        apply_pair_rotation(torch.randn(1, 4, 8), torch.ones(4, 8, dtype=torch.complex64))
