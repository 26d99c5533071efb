"""Video ViT: (B, C, T, H, W) clips, tubelet embedding, (t, h, w) positions reaching the encoding."""
import pytest
import timm
import torch

import vispe  # noqa: F401  (registers the models)


def video_vit(pe: str, **kwargs):
    return timm.create_model('vit_tiny', pe=pe, video=True, num_frames=4, tubelet=2, img_size=32, patch_size=8,
                             depth=2, embed_dim=32, num_heads=2, num_classes=3, **kwargs)


@pytest.mark.parametrize('pe', ['rope_axial', 'gta', 'learned'])
def test_video_vit_forward_backward_at_two_clip_lengths(pe):
    torch.manual_seed(0)
    model = video_vit(pe)
    grids = []
    prepare = model.pe.prepare
    model.pe.prepare = lambda pos_q, pos_k=None: grids.append(pos_q.grid) or prepare(pos_q, pos_k)
    for frames in (4, 8):
        model.zero_grad()
        out = model(torch.randn(2, 3, frames, 32, 32))
        assert out.shape == (2, 3)
        out.square().sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)
        assert model.patch_embed.proj.weight.grad.abs().sum() > 0
    assert grids == [(2, 4, 4), (4, 4, 4)]  # (t, h, w) grids, t = frames / tubelet


def test_video_rope_axial_encodes_the_time_axis():
    # swapping the two tubelets permutes the patch tokens: the class token's output is unchanged
    # without positions, and changes once the (t, h, w) positions enter the attention
    torch.manual_seed(1)
    clip = torch.randn(1, 3, 4, 32, 32)
    swapped = clip[:, :, [2, 3, 0, 1]]
    for pe, same in (('none', True), ('rope_axial', False)):
        model = video_vit(pe).eval()
        with torch.no_grad():
            a, b = model(clip), model(swapped)
        assert torch.allclose(a, b, atol=1e-5) == same, pe


def test_video_intermediates_keep_the_time_axis():
    model = video_vit('rope_axial').eval()
    feats = model.forward_intermediates(torch.randn(1, 3, 8, 32, 32), indices=1, intermediates_only=True)
    assert feats[0].shape == (1, 32, 4, 4, 4)  # (B, C, t, h, w)
    with pytest.raises(ValueError, match='tubelet'):
        model(torch.randn(1, 3, 5, 32, 32))
