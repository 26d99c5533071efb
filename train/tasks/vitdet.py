"""ViTDet detection: torchvision's Faster R-CNN or RetinaNet on a ViTDet backbone (`models.vitdet`)
with a swappable encoding, on the embedded shapes or COCO-format data.

The data, its seeded augmentation (DETR's multi-scale resize and flip) and the COCO box evaluation
are the ``detection`` task's; only the model and the conversion of batches to torchvision's
interface differ: each padded image is cut back to its own size, its boxes become absolute
``(x0, y0, x1, y1)`` pixels (boxes without extent after resizing are dropped; torchvision refuses
them), and the detector keeps the size the data pipeline chose (``model.keep_size: true``) or
resizes as torchvision does. Predictions are mapped to each image's original pixels for COCO AP.
Mask R-CNN needs instance masks, which neither data source yields here; build it with
`vispe_models.vitdet.vitdet_detector` for your own data.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from vispe_models.detection_data import CocoEvaluator
from vispe_models.vitdet import vitdet_detector

from ..schema import Config, ConfigError, EmptySection, constructor_kwargs, constructor_section, option
from .base import Task, register_task
from .detection import DetectionTask

__all__ = ['ViTDetTask', 'ModelConfig', 'to_torchvision']

ModelConfig = constructor_section(
    'ModelConfig', vitdet_detector, module=__name__,
    num_classes=(Optional[int], option(None, 'classes including the background (null: from the data; COCO 91)',
                                       min=1)),
    out_channels=option(min=1), num_global=option(min=0), min_size=option(min=1), max_size=option(min=1))


def to_torchvision(images: torch.Tensor, targets: List[Dict[str, torch.Tensor]]
                   ) -> Tuple[List[torch.Tensor], List[Dict[str, torch.Tensor]]]:
    """A padded detection batch (`collate_detection`: boxes normalised ``(cx, cy, w, h)`` of each unpadded
    image) as torchvision's detectors take it: the images cut to their ``size``, absolute ``(x0, y0, x1,
    y1)`` boxes in their pixels, boxes without extent dropped."""
    out_images, out_targets = [], []
    for image, t in zip(images, targets):
        h, w = (int(s) for s in t['size'])
        cx, cy, bw, bh = t['boxes'].unbind(-1)
        boxes = torch.stack([(cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h], -1)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        out_images.append(image[:, :h, :w])
        out_targets.append({'boxes': boxes[keep], 'labels': t['labels'][keep]})
    return out_images, out_targets


@register_task('vitdet')
class ViTDetTask(DetectionTask):
    """ViTDet training and COCO evaluation: ``AP`` (the metric), AP50, AP75, APs, APm, APl in percent."""
    ModelConfig = ModelConfig

    LossConfig = EmptySection  # torchvision's detectors carry their losses

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        Task.__init__(self, cfg)  # not DETR's: no set criterion to build
        self.rank = rank
        self._coco_gt: Any = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        d, m = cfg.data, cfg.model
        if m.detector == 'mask_rcnn':
            raise ConfigError("model.detector: 'mask_rcnn' needs instance masks, which the detection data here does "
                              "not yield; use 'faster_rcnn' or 'retinanet' (or vitdet_detector on your own data)")
        if d.kind == 'coco' and not d.root:
            raise ConfigError('data.root: required when data.kind is coco (the folder with train2017/, val2017/ '
                              'and annotations/)')
        lo, hi = d.synthetic.image_size
        if lo > hi:
            raise ConfigError(f'data.synthetic.image_size: (min, max) with min <= max, got {(lo, hi)}')

    def _model_kwargs(self) -> Dict[str, Any]:
        return dict(constructor_kwargs(self.cfg.model), num_classes=self._num_classes())

    def _create(self, kwargs: Dict[str, Any]) -> nn.Module:
        try:
            return vitdet_detector(**kwargs)
        except ValueError as e:
            raise ConfigError(f'model: {e}') from None

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        kwargs = self._model_kwargs()
        kwargs['pretrained_file'] = None  # the checkpoint holds every weight
        return dict(name='vitdet', kwargs=kwargs)

    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        images, _, targets = batch
        losses = model(*to_torchvision(images, targets))
        return sum(losses.values()), {k: float(v.detach()) for k, v in losses.items()}

    def evaluate(self, model: nn.Module, batches: Iterable[Any], device: torch.device, autocast: Any,
                 reduce: Callable[[Dict[str, torch.Tensor]], Dict[str, float]]) -> Dict[str, float]:
        evaluator = CocoEvaluator(self._ground_truth())
        model.eval()
        with torch.no_grad():
            for batch in batches:
                images, _, targets = self.to_device(batch, device)
                with autocast():
                    outputs = model(to_torchvision(images, targets)[0])
                results = []
                for out, t in zip(outputs, targets):  # input pixels -> original image pixels
                    (h, w), (oh, ow) = t['size'].tolist(), t['orig_size'].tolist()
                    scale = torch.tensor([ow / w, oh / h, ow / w, oh / h], device=out['boxes'].device)
                    results.append(dict(out, boxes=out['boxes'].float() * scale))
                evaluator.update(targets, results)
        return {k: 100.0 * v if v >= 0 else v for k, v in evaluator.summarize().items()}
