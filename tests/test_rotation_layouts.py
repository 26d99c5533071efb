"""Rotations train from every q/k layout a host can hand to `pe_attention`: the memory-lean backward
equals autograd through the reference kernels, and DETR and the VLM resampler train with each rotary
encoding (the backward once required the ViT's own fused-projection layout)."""
import pytest
import torch

import vispe
from vispe_models.detection_data import SyntheticShapes, collate_detection
from vispe_models.detr import DETR, SetCriterion
from vispe_models.vlm import Resampler
from vispe.rotary import apply_pair_rotation, apply_rotation, rotate_qk
from vispe.rotary.kernels import apply_block_rotation

# DETR's own attention dropout (0.1) kept: SDPA's dropout backward hands over a gradient whose channels
# are not at stride 1, the layout that once broke the rotary backward
DETR_TINY = dict(hidden_dim=32, num_heads=4, enc_layers=1, dec_layers=1, dim_feedforward=64, num_queries=4)
ROTARY = ['rope_axial', 'rope2d', 'rope_mixed', 'liere', 'comrope_ap', 'string_cayley', 'gta', 'rope_golden',
          'rope_spiral']


def _layouts(B=2, H=2, N=6, hd=8):
    """q of shape (B, H, N, hd) in the layouts hosts produce: contiguous, a view of a fused qkv
    projection, transposed channels-first storage, a strided slice, and DETR's separate projection."""
    fused = torch.randn(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)[0]           # timm: qkv.reshape.permute
    channels_first = torch.randn(B, H, hd, N).transpose(-1, -2)             # stride(-1) != 1
    strided = torch.randn(B, H, N, 2 * hd)[..., ::2]                        # every other channel
    odd_offset = torch.randn(B, H, N, hd + 1)[..., 1:]                      # odd storage offset
    separate = torch.randn(B, N, H * hd).view(B, N, H, hd).transpose(1, 2)  # DETR: q_proj(x).view.transpose
    return {'contiguous': torch.randn(B, H, N, hd), 'fused': fused, 'channels_first': channels_first,
            'strided': strided, 'odd_offset': odd_offset, 'separate': separate}


@pytest.mark.parametrize('layout', list(_layouts()))
def test_pair_rotation_backward_equals_autograd_of_the_reference_in_every_layout(layout):
    x = _layouts()[layout].requires_grad_()
    angle = torch.randn(6, 4, requires_grad=True)
    grad_out = torch.randn(2, 2, 6, 8).transpose(-1, -2).contiguous().transpose(-1, -2)  # a strided gradient too
    out = apply_rotation(x, 'pair', angle)
    gx, ga = torch.autograd.grad(out, (x, angle), grad_out)
    ref = apply_pair_rotation(x, torch.polar(torch.ones_like(angle), angle))
    rx, ra = torch.autograd.grad(ref, (x, angle), grad_out)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gx, rx, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ga, ra, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('layout', list(_layouts()))
def test_block_rotation_backward_equals_autograd_of_the_reference_in_every_layout(layout):
    q = _layouts()[layout].requires_grad_()
    k = _layouts()[layout].requires_grad_()
    generator = torch.randn(6, 2, 4, 4).triu(1)
    rot = torch.linalg.matrix_exp(generator - generator.mT).requires_grad_()  # orthogonal, as the kernel assumes
    gq, gk = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8).mT.contiguous().mT
    out = rotate_qk(q, k, rot, rot, 'block')
    grads = torch.autograd.grad(out, (q, k, rot), (gq, gk))
    ref = (apply_block_rotation(q, rot), apply_block_rotation(k, rot))
    ref_grads = torch.autograd.grad(ref, (q, k, rot), (gq, gk))
    for a, b in zip((*out, *grads), (*ref, *ref_grads)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('cross_pe', ['none', 'keys'])
@pytest.mark.parametrize('pe', ROTARY)
def test_detr_trains_with_each_rotary_encoding(pe, cross_pe):
    torch.manual_seed(0)
    ds = SyntheticShapes(num_images=2, image_size=(48, 64), seed=0)
    images, mask, targets = collate_detection([ds[0], ds[1]])
    model = DETR(num_classes=4, backbone='resnet18', pe=pe, cross_pe=cross_pe, **DETR_TINY)
    loss = SetCriterion(num_classes=4)(model(images, mask), targets)['loss']
    loss.backward()
    assert torch.isfinite(loss)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.pe.parameters())
    assert sum(p.grad.abs().sum() for p in trained if p.grad is not None) > 0


def test_vlm_resampler_trains_with_a_rotary_encoding():
    torch.manual_seed(0)
    res = Resampler(8, 16, num_queries=4, num_heads=2, pe='rope_axial', grid_size=(4, 4))
    x = torch.randn(2, 16, 8, requires_grad=True)
    res(x, (4, 4)).square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
