"""ViTDet backbone (`vispe_models.vitdet`): windows that keep every token's grid position, ViTDet's
pyramid and block layout, timm weights, and torchvision's three detectors on it."""
import pytest
import timm
import torch
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads

import vispe
from vispe_models.vitdet import (
    SimpleFeaturePyramid, ViTDetBackbone, global_block_indices, vitdet_detector, window_partition, window_unpartition,
)

TINY = dict(depth=3, embed_dim=64, num_heads=2, img_size=64)


def _backbone(pe, **kwargs):
    torch.manual_seed(0)
    return ViTDetBackbone('vit_tiny_patch16_224', pe, out_channels=32, **dict(TINY, **kwargs)).eval()


def _masked_global_reference(bb: ViTDetBackbone, x: torch.Tensor, window: int) -> torch.Tensor:
    """The trunk run on the whole token sequence, every non-global block with attention masked to pairs
    of tokens in the same window: windowed attention by its definition, without partitioning."""
    trunk = bb.trunk
    tokens = trunk.patch_embed(x)
    B, h, w, C = tokens.shape
    pe = trunk.pe.prepare(vispe.grid(h, w, train_grid=tuple(trunk.patch_embed.grid_size)))
    tokens = trunk.norm_pre(pe.embed(tokens.reshape(B, -1, C)))
    rows, cols = torch.meshgrid(torch.arange(h) // window, torch.arange(w) // window, indexing='ij')
    window_id = (rows * w + cols).reshape(-1)
    same_window = (window_id[:, None] == window_id[None, :])[None, None]
    for i, block in enumerate(trunk.blocks):
        tokens = block(tokens, pe=pe, attn_mask=None if i in bb.global_blocks else same_window)
        tokens = pe.between_blocks(tokens, i)
    return tokens.transpose(1, 2).reshape(B, C, h, w)


@pytest.mark.parametrize('pe', ['learned', 'rope_mixed', 'irpe', 'liere', 'peg', 'pape', 'gta'])
def test_window_attention_equals_global_attention_masked_to_windows(pe):
    """A 4x7 grid in 3x3 windows (padded to 6x9): every token keeps its global grid position, so the
    windowed trunk equals the whole sequence with attention masked to windows (relative encodings see
    the true offsets, normalising ones the whole grid, PEG convolves the whole grid between blocks)."""
    bb = _backbone(pe, window_size=3, global_blocks=[1], depth=2)
    x = torch.randn(2, 3, 64, 112)
    with torch.no_grad():
        torch.testing.assert_close(bb.forward_features(x), _masked_global_reference(bb, x, 3), rtol=1e-5, atol=1e-5)


def test_an_eval_forward_reuses_the_global_and_the_windowed_state():
    """Eval keeps both preparations of a forward (whole grid, windows): a second forward builds none
    and gives the same maps."""
    bb = _backbone('liere', window_size=3, global_blocks=[1], depth=2)
    built = []
    build = bb.pe._full_precision_prepare
    bb.pe._full_precision_prepare = lambda *a: built.append(a) or build(*a)
    x = torch.randn(1, 3, 64, 112)
    with torch.no_grad():
        first = bb.forward_features(x)
        assert len(built) == 2
        torch.testing.assert_close(bb.forward_features(x), first, rtol=0, atol=0)
    assert len(built) == 2


def _image_encodings():
    return [n for n in vispe.list_pes() if not vispe.pe_info(n)['cls'].requires]  # cameras: no image host


@pytest.mark.slow
@pytest.mark.parametrize('pe', _image_encodings())
def test_window_attention_keeps_grid_positions_for_every_image_encoding(pe):
    test_window_attention_equals_global_attention_masked_to_windows(pe)


def test_a_window_as_large_as_the_grid_is_global_attention():
    windowed, plain = _backbone('rope_mixed', window_size=14, num_global=1), _backbone('rope_mixed', window_size=None)
    assert windowed.global_blocks != plain.global_blocks
    x = torch.randn(1, 3, 64, 96)
    with torch.no_grad():
        torch.testing.assert_close(windowed.forward_features(x), plain.forward_features(x), rtol=1e-5, atol=1e-5)


def test_window_partition_round_trip_with_padding():
    x = torch.randn(2, 5, 7, 4)
    parts, padded = window_partition(x, (3, 3))
    assert parts.shape == (2 * 2 * 3, 9, 4) and padded == (6, 9)
    assert torch.equal(parts[0, :3], x[0, 0, :3])  # first window, first row: tokens (0, 0..2)
    assert torch.equal(parts[2, 0], x[0, 0, 6]) and torch.equal(parts[2, 1], torch.zeros(4))  # (0, 6), then padding
    assert torch.equal(window_unpartition(parts, (3, 3), padded, (5, 7)), x.reshape(2, 35, 4))


def test_global_blocks_are_vitdets():
    """ViTDet's configs: ViT-B blocks 2, 5, 8, 11; ViT-L 5, 11, 17, 23; ViT-H 7, 15, 23, 31."""
    assert global_block_indices(12, 4) == [2, 5, 8, 11]
    assert global_block_indices(24, 4) == [5, 11, 17, 23]
    assert global_block_indices(32, 4) == [7, 15, 23, 31]
    assert _backbone('learned', window_size=2, depth=4, num_global=1).global_blocks == {3}


def test_pyramid_levels_have_vitdets_strides_and_torchvisions_keys():
    bb = _backbone('learned', window_size=2)
    with torch.no_grad():
        out = bb(torch.randn(1, 3, 64, 128))
    assert list(out) == ['0', '1', '2', '3', 'pool']
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(16, 32), (8, 16), (4, 8), (2, 4), (1, 2)]
    assert all(v.shape[1] == bb.out_channels == 32 for v in out.values())
    pyramid = SimpleFeaturePyramid(64, 16, top_block=False)
    assert list(pyramid(torch.randn(1, 64, 4, 4))) == ['0', '1', '2', '3']


def test_timm_weights_load_from_a_file(tmp_path):
    """pretrained_file goes through timm's loader as in the zoo: every block weight is the checkpoint's
    and the learned table is the checkpoint's pos_embed (without the class token's row)."""
    torch.manual_seed(1)
    ref = timm.create_model('vit_tiny_patch16_224', **TINY)
    path = tmp_path / 'vit.pth'
    torch.save(ref.state_dict(), path)
    bb = ViTDetBackbone('vit_tiny_patch16_224', 'learned', pretrained_file=str(path), window_size=2, **TINY)
    own = bb.trunk.state_dict()
    for name, value in ref.state_dict().items():
        if name.startswith(('blocks.', 'patch_embed.')):
            assert torch.equal(own[name], value), name
    assert torch.equal(bb.pe.pos_embed[:, -16:], ref.pos_embed[:, 1:])
    assert bb.trunk.cls_token is None  # ViTDet drops the class token


def test_the_models_own_encoding_by_default():
    """pe=None: the zoo model's own encoding (EVA-02: its learned table and rope), as pe=timm_pe_spec."""
    spec = vispe.timm_pe_spec(timm.create_model('eva02_tiny_patch14_224', depth=1))
    torch.manual_seed(0)
    own = ViTDetBackbone('eva02_tiny_patch14_224', depth=2, window_size=4).eval()
    torch.manual_seed(0)
    explicit = ViTDetBackbone('eva02_tiny_patch14_224', spec, depth=2, window_size=4).eval()
    x = torch.randn(1, 3, 112, 168)
    with torch.no_grad():
        out = own(x)
        torch.testing.assert_close(out['2'], explicit(x)['2'])
    assert tuple(out['2'].shape[-2:]) == (8, 12)


def _images_and_targets(sizes, masks=False):
    torch.manual_seed(0)
    images, targets = [], []
    for h, w in sizes:
        images.append(torch.rand(3, h, w))
        t = {'boxes': torch.tensor([[4.0, 6.0, w / 2, h / 2], [w / 3, h / 4, w - 2.0, h - 3.0]]),
             'labels': torch.tensor([1, 2])}
        if masks:
            m = torch.zeros(2, h, w, dtype=torch.uint8)
            m[0, 6:h // 2, 4:w // 2] = 1
            m[1, h // 4:h - 3, w // 3:w - 2] = 1
            t['masks'] = m
        targets.append(t)
    return images, targets


def small_heads(detector):
    """Few proposals and detections (torchvision's defaults, 2000 proposals and 100 detections, are for
    real images) and, for Mask R-CNN, one mask convolution instead of four 256-wide ones (16 -> 256, the
    width its predictor takes)."""
    if detector == 'retinanet':
        return dict(topk_candidates=20, detections_per_img=5)
    heads = dict(rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=50, rpn_pre_nms_top_n_test=100,
                 rpn_post_nms_top_n_test=20, box_batch_size_per_image=32, box_detections_per_img=5)
    return dict(heads, mask_head=MaskRCNNHeads(16, [256], 1)) if detector == 'mask_rcnn' else heads


@pytest.mark.parametrize('detector', ['faster_rcnn', 'mask_rcnn', 'retinanet'])
def test_torchvision_detectors_train_and_evaluate_at_two_sizes(detector):
    torch.manual_seed(0)
    net = vitdet_detector(detector, num_classes=3, pe='rope_mixed', keep_size=True, model='vit_tiny_patch16_224',
                          out_channels=16, window_size=3, model_args=dict(TINY, depth=2),
                          detector_args=small_heads(detector))
    net.train()
    images, targets = _images_and_targets([(64, 96), (48, 80)], masks=detector == 'mask_rcnn')
    losses = net(images, targets)
    loss = sum(losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    unused = [n for n, p in net.named_parameters() if p.requires_grad and p.grad is None]
    assert not unused  # DistributedDataParallel needs every parameter used
    net.eval()
    for size in [(64, 96), (96, 128)]:
        with torch.no_grad():
            out = net([torch.rand(3, *size)])
        assert set(out[0]) >= {'boxes', 'scores', 'labels'}
        assert torch.isfinite(out[0]['boxes']).all()
        if len(out[0]['boxes']):
            assert (out[0]['boxes'][:, 2:] <= torch.tensor(size[::-1])).all()  # in the input image's pixels


# ---------------------------------------------------------------------- images of other sizes in one batch
def _padded_batch(*images):
    batch = torch.zeros(len(images), 3, max(i.shape[1] for i in images), max(i.shape[2] for i in images))
    for b, image in enumerate(images):
        batch[b, :, :image.shape[1], :image.shape[2]] = image
    return batch


def _assert_region_equal(batched, alone, b):
    for key, value in alone.items():
        h, w = value.shape[-2:]
        torch.testing.assert_close(batched[key][b, :, :h, :w], value[0], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize('pe', ['learned', 'rope_mixed', 'irpe', 'liere', 'peg'])
def test_an_image_padded_in_a_batch_gets_its_maps_alone_given_the_sizes(pe):
    """Its own grid (positions, windows) and attention to its own tokens: an image of 3x5 tokens (odd
    sides: the stride-32 pooling) and one of 4x6 in 3x3 windows, batched with an 8x10 one, give on
    their regions every pyramid level they give alone; without the sizes they do not."""
    bb = _backbone(pe, window_size=3, global_blocks=[1])
    big, small, mid = torch.randn(3, 128, 160), torch.randn(3, 48, 80), torch.randn(3, 64, 96)
    batch = _padded_batch(big, small, mid)
    with torch.no_grad():
        sized = bb(batch, image_sizes=[(128, 160), (48, 80), (64, 96)])
        shared = bb(batch)
        for b, image in enumerate([big, small, mid]):
            _assert_region_equal(sized, bb(image[None]), b)
        alone = bb(small[None])
    assert (shared['2'][1, :, :3, :5] - alone['2'][0]).abs().max() > 1e-2  # the shared canvas: other maps


@pytest.mark.slow
@pytest.mark.parametrize('pe', _image_encodings())
def test_an_image_padded_in_a_batch_gets_its_maps_alone_for_every_image_encoding(pe):
    test_an_image_padded_in_a_batch_gets_its_maps_alone_given_the_sizes(pe)


def test_the_detector_hands_each_image_size_to_the_backbone():
    """torchvision's detector calls its backbone with the padded tensor alone; vitdet_detector's transform
    records each image's size on it, so the backbone sees an image batched with a larger one as alone."""
    torch.manual_seed(0)
    net = vitdet_detector('faster_rcnn', num_classes=3, pe='rope_mixed', keep_size=True, model='vit_tiny_patch16_224',
                          out_channels=16, window_size=2, model_args=TINY, detector_args=small_heads('faster_rcnn'))
    net.eval()
    seen = []
    net.backbone.register_forward_hook(lambda module, args, out: seen.append(out))
    small, big = torch.rand(3, 40, 70), torch.rand(3, 96, 128)  # padded alone to 64x96 (size_divisible 32)
    with torch.no_grad():
        net([small])
        net([small, big])
    alone, batched = seen
    assert alone['2'].shape[-2:] == (4, 6) and batched['2'].shape[-2:] == (6, 8)
    _assert_region_equal(batched, alone, 0)


@pytest.mark.parametrize('image_sizes, message', [
    ([(64, 64)], r'image_sizes must be one \(h, w\) of integer pixels per image of the batch \(2\)'),
    ([(64, 64), (64.0, 32)], r'image_sizes must be one \(h, w\) of integer pixels'),
    ([(64, 64), (80, 32)], r'image_sizes \[\(80, 32\)\] do not fit the input 64x64'),
])
def test_bad_image_sizes_are_refused(image_sizes, message):
    with pytest.raises(ValueError, match=message):
        _backbone('learned', window_size=2)(torch.randn(2, 3, 64, 64), image_sizes=image_sizes)


# ---------------------------------------------------------------------- bad input
def test_an_image_smaller_than_two_patches_is_refused_by_the_backbone_and_padded_by_the_detector():
    bb = _backbone('learned', window_size=2)
    with pytest.raises(ValueError, match=r'input size 8x40 is smaller than the smallest ViTDetBackbone takes, two '
                                         r'patches per side \(32x32\)'):
        bb(torch.randn(1, 3, 8, 40))
    with pytest.raises(ValueError, match=r'input size 40x48 is not divisible by the patch size 16x16'):
        bb(torch.randn(1, 3, 40, 48))
    with pytest.raises(ValueError, match=r'takes images \(B, C, H, W\), got \(3, 32, 32\)'):
        bb(torch.randn(3, 32, 32))
    net = vitdet_detector('faster_rcnn', num_classes=3, pe='learned', keep_size=True, model='vit_tiny_patch16_224',
                          out_channels=16, window_size=2, model_args=TINY, detector_args=small_heads('faster_rcnn')).eval()
    with torch.no_grad():
        out = net([torch.rand(3, 10, 12)])  # torchvision pads the batch to size_divisible (32): one 2x2 grid
    assert torch.isfinite(out[0]['scores']).all()


def test_an_image_without_objects_trains():
    net = vitdet_detector('faster_rcnn', num_classes=3, pe='irpe', keep_size=True, model='vit_tiny_patch16_224',
                          out_channels=16, window_size=2, model_args=TINY, detector_args=small_heads('faster_rcnn'))
    images, targets = _images_and_targets([(64, 96), (64, 64)])
    targets[1] = {'boxes': torch.zeros(0, 4), 'labels': torch.zeros(0, dtype=torch.int64)}
    losses = net(images, targets)
    assert torch.isfinite(sum(losses.values()))


def test_degenerate_boxes_are_refused_with_the_box():
    """torchvision's own check names the box and the image (the synthetic / COCO data never yield one)."""
    net = vitdet_detector('faster_rcnn', num_classes=3, pe='learned', keep_size=True, model='vit_tiny_patch16_224',
                          out_channels=32, window_size=2, model_args=TINY)
    images, targets = _images_and_targets([(64, 96)])
    targets[0]['boxes'][1, 2] = targets[0]['boxes'][1, 0]  # zero width
    with pytest.raises(AssertionError, match=r'positive height and width. Found invalid box \[32.0, 16.0, 32.0, 61.0\] '
                                             'for target at index 0'):
        net(images, targets)


@pytest.mark.parametrize('kwargs, message', [
    (dict(window_size=0), r'window_size must be a positive integer \(tokens\) or None'),
    (dict(window_size=2, global_blocks=[5]), r'global_blocks: \[5\] are not block indices of the 3-block'),
    (dict(num_classes=10), 'ViTDetBackbone sets num_classes itself'),
    (dict(patch_drop_rate=0.5), 'patch_drop_rate must be 0'),
])
def test_bad_backbone_options_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ViTDetBackbone('vit_tiny_patch16_224', 'learned', **dict(TINY, **kwargs))


def test_an_unknown_detector_is_refused():
    with pytest.raises(ValueError, match="detector must be one of 'faster_rcnn', 'mask_rcnn', 'retinanet'"):
        vitdet_detector('yolo')
