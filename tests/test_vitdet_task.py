"""The ``vitdet`` task of the shared training script: torchvision detectors on a ViTDet backbone,
trained and evaluated on the detection task's data."""
from pathlib import Path

import pytest
import torch

import vispe

CONFIGS = Path(__file__).resolve().parents[1] / 'configs' / 'detection'
TINY_RUN = [
    'task=vitdet', 'name=vd', 'model.model=vit_tiny_patch16_224', 'model.pe=rope_mixed',
    'model.model_args={depth: 2, embed_dim: 32, num_heads: 2, img_size: 64}', 'model.out_channels=16',
    'model.window_size=2', 'model.num_global=1', 'model.keep_size=true',
    'model.detector_args={rpn_post_nms_top_n_train: 20, rpn_post_nms_top_n_test: 10, box_batch_size_per_image: 16,'
    ' box_detections_per_img: 5}',
    'data.workers=0', 'data.synthetic.train_size=4', 'data.synthetic.val_size=3', 'data.synthetic.image_size=[40,56]',
    'train.epochs=1', 'train.batch_size=2', 'sched.warmup_epochs=0', 'log.progress=off', 'log.tensorboard=off']


def test_boxes_become_torchvisions_absolute_corners_of_the_unpadded_image():
    from train.tasks.vitdet import to_torchvision
    images = torch.zeros(1, 3, 60, 80)  # padded batch; the image itself is 40 x 50
    target = {'boxes': torch.tensor([[0.5, 0.25, 0.2, 0.5], [0.1, 0.1, 0.0, 0.1]]), 'labels': torch.tensor([1, 2]),
              'size': torch.tensor([40, 50])}
    (image,), (t,) = to_torchvision(images, [target])
    assert image.shape == (3, 40, 50)
    # (cx, cy, w, h) = (25, 10, 10, 20) px -> (20, 0, 30, 20); the second box has no width: dropped
    torch.testing.assert_close(t['boxes'], torch.tensor([[20.0, 0.0, 30.0, 20.0]]))
    assert t['labels'].tolist() == [1]


def test_vitdet_task_trains_evaluates_and_rebuilds_through_the_shared_script(tmp_path):
    from train.checkpoint import load_checkpoint
    from train.cli import run
    from train.config import load_config
    from train.tasks import get_task
    overrides = TINY_RUN + [f'output_dir={tmp_path}']
    result, = run(None, overrides)
    assert result.best['metric'] == 'AP' and result.steps == 2
    assert 0.0 <= result.last_metrics['AP'] <= 100.0
    best = load_checkpoint(result.best_path)
    cfg, _ = load_config(None, overrides)
    model = get_task('vitdet')(cfg).rebuild_model(best['model_spec'])
    model.load_state_dict(best['model'])
    assert model.backbone.pe.name == 'rope_mixed' and model.backbone.window_size == 2


@pytest.mark.parametrize('name', ['vitdet_synthetic', 'vitdet_coco'])
def test_vitdet_configs_validate(name):
    from train.config import load_config
    cfg, _ = load_config(CONFIGS / f'{name}.yaml', ['data.root=/data/coco'])
    assert cfg.task == 'vitdet' and cfg.name == name
    for spec_name, _ in vispe.parse_pe_spec(cfg.model.pe):
        assert spec_name in vispe.list_pes()


def test_mask_rcnn_without_masks_in_the_data_is_refused():
    from train.config import ConfigError, load_config
    with pytest.raises(ConfigError, match="model.detector: 'mask_rcnn' needs instance masks"):
        load_config(CONFIGS / 'vitdet_synthetic.yaml', ['model.detector=mask_rcnn'])
