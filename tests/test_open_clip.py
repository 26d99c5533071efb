"""vispe encodings in an open_clip image tower (`vispe.integrations.open_clip`): parity with the
tower's own encoding, any image size, a CLIP contrastive step, remove() restores the model."""
import pytest
import torch

import vispe
from vispe.integrations.open_clip import use_pe

open_clip = pytest.importorskip('open_clip', reason='open_clip_torch not installed (pip install "vispe[open_clip]")')

TEXT = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)


def _clip(timm_model_name='vit_tiny_patch16_224', **vision):
    torch.manual_seed(0)
    vision = dict(dict(timm_model_name=timm_model_name, timm_model_pretrained=False, timm_pool='token',
                       timm_proj='linear', image_size=224), **vision)
    return open_clip.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=TEXT).eval()


def test_the_towers_own_encoding_gives_its_image_features():
    model = _clip()
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        want = model.encode_image(x)
        trunk = model.visual.trunk
        handle = use_pe(model, vispe.timm_pe_spec(trunk))
        assert isinstance(model.visual.trunk, vispe.VisionTransformer) and model.visual.trunk.pe.name == 'learned'
        torch.testing.assert_close(model.encode_image(x), want, rtol=0, atol=1e-6)
    handle.remove()
    assert model.visual.trunk is trunk


def test_any_size_and_a_contrastive_step_train_the_encoding():
    model = _clip()
    use_pe(model, 'rope_mixed')
    pe = model.visual.trunk.pe
    before = {n: p.detach().clone() for n, p in pe.named_parameters()}
    with torch.no_grad():  # dynamic size: the positions follow each image's grid
        for size in ((224, 224), (160, 256), (96, 96)):
            assert model.encode_image(torch.randn(1, 3, *size)).shape == (1, 16)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    images, texts = torch.randn(4, 3, 160, 160), torch.randint(0, TEXT['vocab_size'], (4, TEXT['context_length']))
    image_features, text_features, logit_scale = model(images, texts)
    loss = open_clip.ClipLoss()(image_features, text_features, logit_scale)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None and p.grad.abs().sum() > 0 for p in pe.parameters())
    opt.step()
    assert any(not torch.equal(p, before[n]) for n, p in pe.named_parameters())


def test_remove_restores_the_model_bit_for_bit():
    model = _clip()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        want = model.encode_image(x)
    handle = use_pe(model, 'liere')
    assert any(k.startswith('visual.trunk.pe.') for k in model.state_dict())
    handle.remove()
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model.encode_image(x), want)


def test_refusals_say_what_to_do():
    own_tower = open_clip.CLIP(embed_dim=16, vision_cfg=dict(layers=1, width=32, head_width=16, patch_size=16, image_size=32),
                               text_cfg=TEXT)
    with pytest.raises(TypeError, match='timm_model_name'):
        use_pe(own_tower, 'rope_mixed')
    # a vispe name in an open_clip config gets the default encoding; use_pe says so instead of stacking
    silent = _clip('vit_tiny', image_size=32)
    assert silent.visual.trunk.pe.name == 'learned'
    with pytest.raises(ValueError, match="already a vispe host \\(pe='learned'\\)"):
        use_pe(silent, 'rope_mixed')
