"""DETR: its encodings as DETR defines them, the matcher, padding, losses, data and evaluation."""
import itertools
import math

import pytest
import torch
import torchvision
from torchvision.ops import generalized_box_iou

import vispe
from vispe_models.detection_data import CocoEvaluator, SyntheticShapes, collate_detection
from vispe_models.detr import DETR, HungarianMatcher, SetCriterion, postprocess

TINY = dict(hidden_dim=32, num_heads=4, enc_layers=2, dec_layers=2, dim_feedforward=64, num_queries=8, dropout=0.0)


def _sine_features(p, num_pos_feats, temperature=10000.0):
    """One axis of DETR's sine encoding, written out: channel k uses dim_t = T^(2 floor(k/2) / F),
    sin on even channels, cos on odd ones."""
    out = []
    for k in range(num_pos_feats):
        dim_t = temperature ** (2 * (k // 2) / num_pos_feats)
        out.append(math.sin(p / dim_t) if k % 2 == 0 else math.cos(p / dim_t))
    return out


def test_detr_sine_matches_hand_computation_without_padding():
    pe = vispe.create_pe('detr_sine', dim=8)
    emb = pe.embedding(vispe.grid(2, 3))
    assert emb.shape == (1, 6, 8)
    eps, scale = 1e-6, 2 * math.pi
    for r in range(2):
        for c in range(3):
            y = (r + 1) / (2 + eps) * scale  # cumulative count of real rows, normalised
            x = (c + 1) / (3 + eps) * scale
            expected = _sine_features(y, 4) + _sine_features(x, 4)  # y channels before x
            assert emb[0, r * 3 + c].tolist() == pytest.approx(expected, abs=1e-6)


def test_detr_sine_normalises_over_the_padding_mask():
    pe = vispe.create_pe('detr_sine', dim=8, temperature=20.0)
    pad = torch.zeros(2, 2, 3, dtype=torch.bool)
    pad[1, 1, :] = True  # image 1 is 1 x 2: one padded row and one padded column
    pad[1, :, 2] = True
    emb = pe.embedding(vispe.grid(2, 3).replace(key_padding_mask=pad.flatten(1)))
    assert emb.shape == (2, 6, 8)
    eps, scale = 1e-6, 2 * math.pi
    for c in range(2):  # the real tokens of image 1 span (0, 2 pi] on their own extent
        y = 1 / (1 + eps) * scale
        x = (c + 1) / (2 + eps) * scale
        expected = _sine_features(y, 4, 20.0) + _sine_features(x, 4, 20.0)
        assert emb[1, c].tolist() == pytest.approx(expected, abs=1e-6)
    # the unpadded image 0 is unaffected by its neighbour's padding
    assert torch.allclose(emb[0], vispe.create_pe('detr_sine', dim=8, temperature=20.0).embedding(vispe.grid(2, 3))[0])
    # and image 1's real tokens equal those of an unpadded 1 x 2 image
    alone = pe.embedding(vispe.grid(1, 2))[0]
    assert torch.allclose(emb[1, :2], alone, atol=1e-6)


def test_detr_sine_cached_table_equals_the_padded_path_exactly():
    pe = vispe.create_pe('detr_sine', dim=16)
    pad = torch.zeros(2, 12, dtype=torch.bool)
    pad[1, -4:] = True  # image 1 padded, image 0 not: image 0 goes through the cumulative-sum path
    padded = pe.embedding(vispe.grid(3, 4).replace(key_padding_mask=pad))
    assert torch.equal(pe.embedding(vispe.grid(3, 4))[0], padded[0])


def test_detr_sine_without_normalize_uses_raw_cumulative_counts():
    pe = vispe.create_pe('detr_sine:normalize=false', dim=4)
    emb = pe.embedding(vispe.grid(1, 2))
    assert emb[0, 1].tolist() == pytest.approx(_sine_features(1.0, 2) + _sine_features(2.0, 2), abs=1e-6)


def test_detr_sine_rejects_bad_width_and_point_sets():
    with pytest.raises(ValueError, match='divisible by 4'):
        vispe.create_pe('detr_sine', dim=6)
    with pytest.raises(ValueError, match='2D grid'):
        vispe.create_pe('detr_sine', dim=8).embedding(vispe.points(torch.rand(5, 2)))


def test_detr_learned_concatenates_column_then_row_embeddings():
    pe = vispe.create_pe('detr_learned', dim=8)
    h, w = 3, 4
    emb = pe.embedding(vispe.grid(h, w))
    # DETR's PositionEmbeddingLearned.forward, transcribed
    x_emb = pe.col_embed(torch.arange(w))
    y_emb = pe.row_embed(torch.arange(h))
    ref = torch.cat([x_emb.unsqueeze(0).repeat(h, 1, 1), y_emb.unsqueeze(1).repeat(1, w, 1)], dim=-1)
    assert torch.equal(emb[0], ref.flatten(0, 1))
    assert pe.row_embed.weight.shape == (50, 4)
    with pytest.raises(ValueError, match='num_embeddings'):
        pe.embedding(vispe.grid(3, 51))


def _brute_force_cost(cost):
    nq, nt = cost.shape
    return min(sum(cost[q, t] for t, q in enumerate(perm)) for perm in itertools.permutations(range(nq), nt))


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_hungarian_matcher_is_optimal_against_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    bs, nq, k = 3, 5, 4
    outputs = {'pred_logits': torch.randn(bs, nq, k + 1, generator=g),
               'pred_boxes': torch.rand(bs, nq, 4, generator=g) * 0.5 + 0.25}
    targets = [{'labels': torch.randint(0, k, (n,), generator=g), 'boxes': torch.rand(n, 4, generator=g) * 0.5 + 0.25}
               for n in (0, 3, 5)]
    matches = HungarianMatcher(cost_class=1.0, cost_bbox=5.0, cost_giou=2.0)(outputs, targets)
    for b, ((qi, ti), t) in enumerate(zip(matches, targets)):
        n = len(t['labels'])
        assert len(qi) == len(ti) == n and len(set(qi.tolist())) == n and sorted(ti.tolist()) == list(range(n))
        if n == 0:
            continue
        # DETR's cost, from its definition: 5 L1 - p(class) - 2 GIoU
        prob = outputs['pred_logits'][b].softmax(-1)
        pb, tb = outputs['pred_boxes'][b], t['boxes']

        def xyxy(x):
            return torch.cat([x[:, :2] - x[:, 2:] / 2, x[:, :2] + x[:, 2:] / 2], 1)
        cost = (5 * (pb[:, None] - tb[None]).abs().sum(-1) - prob[:, t['labels']]
                - 2 * generalized_box_iou(xyxy(pb), xyxy(tb)))
        chosen = sum(cost[q, j] for q, j in zip(qi.tolist(), ti.tolist()))
        assert float(chosen) == pytest.approx(float(_brute_force_cost(cost)), abs=1e-5)


def test_postprocess_scales_boxes_to_the_original_size():
    outputs = {'pred_logits': torch.tensor([[[0.0, 3.0, 0.0]]]), 'pred_boxes': torch.tensor([[[0.5, 0.5, 0.2, 0.4]]])}
    res = postprocess(outputs, torch.tensor([[100, 200]]))[0]  # (h, w)
    assert res['boxes'][0].tolist() == pytest.approx([80.0, 30.0, 120.0, 70.0])
    assert res['labels'].tolist() == [1]
    assert float(res['scores'][0]) == pytest.approx(math.exp(3) / (math.exp(3) + 2))


# every registered encoding that positions image tokens (those reading cameras are refused by DETR)
IMAGE_ENCODINGS = [spec for spec in vispe.list_pes()
                   if not vispe.create_pe(spec, dim=32, num_heads=4, grid_size=(3, 4), device='meta')
                   .capabilities.requires]
# a 3 x 4 and a 2 x 6 image padded into a 4 x 6 canvas beside an unpadded 4 x 6 one
EXTENTS, CANVAS = [(3, 4), (2, 6), (4, 6)], (4, 6)


def _padded_batch(dim, seed=0):
    """Tokens of a padded canvas batch with garbage in the padding, its positions, and each image alone."""
    g = torch.Generator().manual_seed(seed)
    canvas = torch.randn(len(EXTENTS), *CANVAS, dim, generator=g) * 10
    pad = torch.ones(len(EXTENTS), *CANVAS, dtype=torch.bool)
    alone = []
    for b, (h, w) in enumerate(EXTENTS):
        pad[b, :h, :w] = False
        alone.append((canvas[b:b + 1, :h, :w].flatten(1, 2), vispe.grid(h, w, train_grid=(3, 4))))
    pos = vispe.grid(*CANVAS, train_grid=(3, 4)).replace(key_padding_mask=pad.flatten(1))
    return canvas.flatten(1, 2), pos, alone, ~pad.flatten(1)


@pytest.mark.parametrize('pe', IMAGE_ENCODINGS + ['detr_sine+irpe:on=qkv', 'peg:kernel_size=5', 'liere+peg'])
def test_every_encoding_gives_a_padded_image_its_output_alone(pe):
    """DETR pads a batch to one canvas: each image's encoder memory and decoder outputs must not depend on
    the canvas or the other images (per-sample grids), PEG must not convolve the padding in."""
    torch.manual_seed(0)
    model = DETR(num_classes=4, backbone='resnet18', pe=pe, grid_size=(3, 4), **TINY).eval()
    with torch.no_grad():
        for p in model.pe.parameters():  # zero-initialised tables (iRPE) and gates (PEG) would hide errors
            p.normal_(std=0.5)
    src, pos, alone, real = _padded_batch(TINY['hidden_dim'])
    with torch.no_grad():
        memory, embedding = model.encode(src, pos)
        decoded = model.decode(memory, pos, embedding)
        for b, (src_b, pos_b) in enumerate(alone):
            memory_b, embedding_b = model.encode(src_b, pos_b)
            torch.testing.assert_close(memory[b, real[b]], memory_b[0], atol=1e-5, rtol=0)
            torch.testing.assert_close(decoded[:, b], model.decode(memory_b, pos_b, embedding_b)[:, 0],
                                       atol=1e-5, rtol=0)


def test_a_padded_forward_equals_the_encoder_and_decoder_on_the_canvas():
    """`forward` packs the batch once; `encode` / `decode` pack canvas inputs themselves: same outputs."""
    torch.manual_seed(0)
    model = DETR(num_classes=4, backbone='resnet18', pe='liere', **TINY).eval()
    images = [torch.randn(3, 64, 96), torch.randn(3, 96, 64)]
    with torch.no_grad():
        out = model(images)
        src, pos = model.features(images)
        assert pos.key_padding_mask.any()
        memory, embedding = model.encode(src, pos)
        hs = model.decode(memory, pos, embedding)
    torch.testing.assert_close(out['pred_logits'], model.class_embed(hs)[-1], atol=1e-6, rtol=0)


def test_detr_refuses_encodings_that_read_cameras():
    with pytest.raises(ValueError, match="pe='prope' reads the positions' cameras"):
        DETR(num_classes=4, backbone='resnet18', pe='prope', **TINY)


def test_bad_padding_masks_are_refused_with_the_convention():
    model = DETR(num_classes=4, backbone='resnet18', pe='rope_mixed', **TINY).eval()
    images = torch.randn(2, 3, 64, 64)
    mask = torch.zeros(2, 64, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match=r'mask must be \(B, H, W\)'):
        model(images, mask[:, :32])
    with pytest.raises(ValueError, match='mask must be a bool tensor, True on padding'):
        model(images, mask.float())
    with pytest.raises(ValueError, match='all padding'):
        model(images, mask.index_fill(0, torch.tensor([1]), True))
    holes = mask.clone()
    holes[0, :32, :32] = True  # padding at the top left: not how a batch is padded
    with pytest.raises(ValueError, match='bottom and right'):
        model(images, holes)


def test_images_smaller_than_the_backbone_stride_still_get_a_token():
    model = DETR(num_classes=4, backbone='resnet18', pe='learned', **TINY).eval()
    with torch.no_grad():
        out = model([torch.randn(3, 8, 8), torch.randn(3, 70, 40)])
    assert torch.isfinite(out['pred_logits']).all() and torch.isfinite(out['pred_boxes']).all()


def test_empty_and_degenerate_targets_give_finite_losses_and_bad_boxes_errors():
    torch.manual_seed(0)
    outputs = {'pred_logits': torch.randn(2, 8, 5, requires_grad=True),
               'pred_boxes': torch.rand(2, 8, 4).mul(0.5).add(0.25).requires_grad_()}
    criterion = SetCriterion(num_classes=4)
    empty = {'labels': torch.zeros(0, dtype=torch.int64), 'boxes': torch.zeros(0, 4)}
    line = {'labels': torch.tensor([1]), 'boxes': torch.tensor([[0.5, 0.5, 0.0, 0.3]])}  # zero width
    loss = criterion(outputs, [empty, line])['loss']
    assert torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(outputs['pred_boxes'].grad).all()
    assert torch.isfinite(criterion(outputs, [empty, empty])['loss'])
    with pytest.raises(ValueError, match=r"targets\[1\]\['boxes'\] .* non-negative width and height"):
        criterion(outputs, [empty, {'labels': torch.tensor([1]), 'boxes': torch.tensor([[0.5, 0.5, -0.1, 0.3]])}])
    with pytest.raises(ValueError, match=r"targets\[0\]\['boxes'\] must be \(T, 4\)"):
        criterion(outputs, [{'labels': torch.tensor([1]), 'boxes': torch.rand(1, 5)}, empty])
    with pytest.raises(ValueError, match=r"targets\[0\]\['labels'\] must be .* in \[0, 4\)"):
        criterion(outputs, [{'labels': torch.tensor([4]), 'boxes': torch.rand(1, 4)}, empty])


def test_cross_attention_modes_follow_the_encoding():
    assert DETR(num_classes=4, backbone='resnet18', pe='detr_sine', **TINY).cross_pe == 'keys'
    assert DETR(num_classes=4, backbone='resnet18', pe='rope_axial', **TINY).cross_pe == 'keys'
    assert DETR(num_classes=4, backbone='resnet18', pe='irpe:on=k', **TINY).cross_pe == 'additive'
    # per-layer encodings get separate parameters for the cross-attention layers
    rope = DETR(num_classes=4, backbone='resnet18', pe='rope_mixed', **TINY)
    assert rope.pe.freqs.shape[1] == TINY['enc_layers'] + TINY['dec_layers']
    with pytest.raises(ValueError, match='cross_pe'):
        DETR(num_classes=4, backbone='resnet18', cross_pe='queries', **TINY)


def test_rotary_keys_give_the_decoder_positions_and_none_does_not():
    torch.manual_seed(0)
    src = torch.randn(1, 6, TINY['hidden_dim'])
    pos = vispe.grid(2, 3)
    perm = torch.randperm(6)
    outs = {}
    for cross in ('keys', 'none'):
        model = DETR(num_classes=4, backbone='resnet18', pe='rope_axial', cross_pe=cross, **TINY).eval()
        with torch.no_grad():  # same memory, tokens shuffled: only key positions can tell them apart
            a = model.decode(src, pos, None)
            b = model.decode(src[:, perm], pos, None)
        outs[cross] = torch.allclose(a, b, atol=1e-5)
    assert outs == {'keys': False, 'none': True}


def test_detr_spec_examples_build_and_run():
    images = [torch.randn(3, 64, 64), torch.randn(3, 48, 80)]
    for pe in ('detr_sine', 'irpe:on=k'):
        model = DETR(num_classes=91, backbone='resnet50', pe=pe).eval()
        with torch.no_grad():
            out = model(images)
        assert out['pred_logits'].shape == (2, 100, 92) and out['pred_boxes'].shape == (2, 100, 4)
        assert len(out['aux_outputs']) == 5
        assert bool((out['pred_boxes'] >= 0).all() and (out['pred_boxes'] <= 1).all())


def test_backbone_loads_torchvision_weights_from_a_file(tmp_path):
    reference = torchvision.models.resnet18(weights=None)
    path = tmp_path / 'resnet18.pth'
    torch.save(reference.state_dict(), path)
    model = DETR(num_classes=4, backbone='resnet18', backbone_weights=str(path), **TINY)
    body = model.backbone.body
    assert torch.equal(body.layer3[0].conv1.weight, reference.layer3[0].conv1.weight)
    assert torch.equal(body.bn1.running_var, reference.bn1.running_var)
    assert isinstance(body.bn1, torchvision.ops.misc.FrozenBatchNorm2d)
    assert not body.conv1.weight.requires_grad and not body.layer1[0].conv1.weight.requires_grad
    assert body.layer2[0].conv1.weight.requires_grad
    torch.save({'conv1.weight': reference.conv1.weight}, tmp_path / 'partial.pth')
    with pytest.raises(ValueError, match='lacks'):
        DETR(num_classes=4, backbone='resnet18', backbone_weights=str(tmp_path / 'partial.pth'), **TINY)


def test_synthetic_shapes_are_deterministic_and_boxes_are_tight():
    ds = SyntheticShapes(num_images=4, image_size=(40, 56), seed=3)
    image, boxes, labels = ds.sample(2)
    again, boxes2, _ = ds.sample(2)
    assert (image == again).all() and (boxes == boxes2).all()
    assert set(labels.tolist()) <= {1, 2, 3} and len(labels) >= 1
    _, target = ds[2]
    cx, cy, w, h = target['boxes'].unbind(1)
    hh, ww = image.shape[:2]
    assert torch.allclose(torch.stack([(cx - w / 2) * ww, (cy - h / 2) * hh], 1), torch.from_numpy(boxes[:, :2]),
                          atol=1e-4)


def test_coco_evaluator_scores_perfect_and_wrong_detections():
    ds = SyntheticShapes(num_images=6, seed=1)
    perfect, wrong = CocoEvaluator(ds.coco()), CocoEvaluator(ds.coco())
    for i in range(len(ds)):
        _, t = ds[i]
        h, w = t['orig_size'].tolist()
        cx, cy, bw, bh = t['boxes'].unbind(1)
        xyxy = torch.stack([cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2], 1) * torch.tensor([w, h, w, h])
        scores = torch.ones(len(xyxy))
        perfect.update([t], [{'boxes': xyxy, 'scores': scores, 'labels': t['labels']}])
        wrong.update([t], [{'boxes': xyxy, 'scores': scores, 'labels': t['labels'] % 3 + 1}])
    assert perfect.summarize()['AP'] == pytest.approx(1.0)
    assert wrong.summarize()['AP'] == pytest.approx(0.0)


def test_detr_training_smoke_reduces_the_loss():
    torch.manual_seed(0)
    ds = SyntheticShapes(num_images=2, image_size=(48, 64), seed=0)
    images, mask, targets = collate_detection([ds[0], ds[1]])
    model = DETR(num_classes=4, backbone='resnet18', pe='detr_sine', **TINY)
    criterion = SetCriterion(num_classes=4)
    opt = torch.optim.AdamW(model.param_groups(lr=1e-3, lr_backbone=1e-4), weight_decay=1e-4)
    losses = []
    for _ in range(8):
        loss = criterion(model(images, mask), targets)
        opt.zero_grad()
        loss['loss'].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        opt.step()
        losses.append(loss['loss'].item())
    assert {'loss_ce', 'loss_bbox', 'loss_giou', 'loss_ce_0'} <= set(loss)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_detection_task_trains_evaluates_and_rebuilds_through_the_shared_script(tmp_path):
    from train.checkpoint import load_checkpoint
    from train.cli import run
    from train.config import load_config
    from train.tasks import get_task
    overrides = [
        'task=detection', 'name=det', f'output_dir={tmp_path}', 'model.backbone=resnet18', 'model.pe=irpe:on=k',
        'model.hidden_dim=32', 'model.num_heads=4', 'model.enc_layers=1', 'model.dec_layers=1',
        'model.dim_feedforward=32', 'model.num_queries=6', 'data.workers=0', 'data.synthetic.train_size=4',
        'data.synthetic.val_size=3', 'data.synthetic.image_size=[40,56]', 'train.epochs=1', 'train.batch_size=2',
        'optim.lr=1e-4', 'optim.layer_decay=0.1', 'sched.warmup_epochs=0', 'log.progress=off',
        'log.tensorboard=off']
    result, = run(None, overrides)
    assert result.best['metric'] == 'AP' and result.steps == 2
    assert {'AP', 'AP50', 'APs', 'loss'} <= set(result.last_metrics)
    assert 0.0 <= result.last_metrics['AP'] <= 100.0
    best = load_checkpoint(result.best_path)
    cfg, _ = load_config(None, overrides)
    model = get_task('detection')(cfg).rebuild_model(best['model_spec'])
    model.load_state_dict(best['model'])
    assert model.pe.name == 'irpe' and model.cross_pe == 'additive'


@pytest.mark.parametrize('name', ['synthetic', 'coco'])
def test_detr_configs_validate(name):
    from pathlib import Path

    from train.config import load_config
    cfg, _ = load_config(Path(__file__).parent.parent / 'configs' / 'detr' / f'{name}.yaml', ['data.root=/data/coco'])
    assert cfg.task == 'detection' and cfg.name == f'detr_{name}'
    for spec_name, _ in vispe.parse_pe_spec(cfg.model.pe):
        assert spec_name in vispe.list_pes()


@pytest.mark.parametrize('spec', ['detr_sine', 'detr_learned', 'learned', 'sincos', 'rope_axial', 'irpe', 'pape'])
def test_a_key_padding_mask_over_the_whole_sequence_drops_its_prefix_columns(spec):
    """The documented mask forms: ``(B, N)`` over the positioned tokens, or ``(B, num_prefix + N)`` over
    the sequence attention sees (the class token's column first); both give the same encoding."""
    pad = torch.zeros(2, 3, 4, dtype=torch.bool)
    pad[1, 2:, :] = True
    pad[1, :, 3:] = True
    pe = vispe.create_pe(spec, dim=16, num_heads=2, grid_size=(3, 4), num_prefix_tokens=1).eval()
    positioned = vispe.grid(3, 4, num_prefix=1).replace(key_padding_mask=pad.flatten(1))
    whole = vispe.grid(3, 4, num_prefix=1).replace(
        key_padding_mask=torch.cat([torch.zeros(2, 1, dtype=torch.bool), pad.flatten(1)], 1))
    assert torch.equal(whole.key_padding_mask, positioned.key_padding_mask)
    x = torch.randn(2, 13, 16)
    q, k = torch.randn(2, 2, 13, 8), torch.randn(2, 2, 13, 8)
    with torch.no_grad():
        a, b = pe.prepare(positioned), pe.prepare(whole)
        torch.testing.assert_close(vispe.pe_attention(q, k, k, a, x=x), vispe.pe_attention(q, k, k, b, x=x))
        torch.testing.assert_close(pe.embed(x, positioned), pe.embed(x, whole))


def test_key_padding_masks_of_another_shape_or_dtype_or_padding_a_prefix_token_are_refused():
    pos = vispe.grid(3, 4, num_prefix=1)
    with pytest.raises(ValueError, match=r'must be \(B, 12\) over the positioned tokens or \(B, 13\)'):
        pos.replace(key_padding_mask=torch.zeros(2, 11, dtype=torch.bool))
    with pytest.raises(ValueError, match='must be a bool tensor'):
        pos.replace(key_padding_mask=torch.zeros(2, 12))
    with pytest.raises(ValueError, match='prefix .* tokens are always attended'):
        pos.replace(key_padding_mask=torch.ones(2, 13, dtype=torch.bool))
