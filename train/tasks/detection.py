"""Object detection: DETR (`models.detr`) with a swappable encoding, on COCO-format data or the embedded shapes.

``best.pt`` is chosen by COCO box AP (pycocotools) on the validation split. DETR's recipe maps to
the generic sections: ``optim.opt: adamw``, ``optim.lr: 1e-4``, ``optim.weight_decay: 1e-4``,
``optim.clip_grad: 0.1``, and DETR's backbone learning rate (``lr / 10``) through timm's layer-wise
scaling: `DETR` exposes two parameter groups to timm's ``group_matcher`` (backbone, the rest), so
``optim.layer_decay: 0.1`` gives the backbone ``0.1 x lr`` (timm then also exempts biases and
norms from weight decay, which DETR does not; the difference at 1e-4 is negligible). The
backbone scaling takes effect through the scheduler, so keep ``sched.name`` other than ``none``.

Augmentation is a function of ``(seed, epoch, index)`` (`train.rng.seeded`), so resumed runs see
the same images.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Tuple

import torch
from torch import nn
from torch.utils.data import Dataset

from vispe_models.detection_data import DETR_SCALES, CocoDetection, CocoEvaluator, SyntheticShapes, collate_detection
from vispe_models.detr import DETR, HungarianMatcher, SetCriterion, postprocess

from ..rng import seeded
from ..schema import Config, ConfigError, constructor_kwargs, constructor_section, option
from .base import Task, register_task

__all__ = ['DetectionTask', 'ModelConfig', 'DataConfig', 'LossConfig', 'SyntheticDetectionConfig']

_logger = logging.getLogger(__name__)

ModelConfig = constructor_section(
    'ModelConfig', DETR, module=__name__,
    num_classes=(Optional[int], option(None, 'largest category id + 1 (null: from the data; COCO 91)', min=1)),
    hidden_dim=option(min=8), num_heads=option(min=1), enc_layers=option(min=1), dec_layers=option(min=1),
    dim_feedforward=option(min=1), dropout=option(min=0, max=1), num_queries=option(min=1), grid_size=option(min=1))


@dataclass
class SyntheticDetectionConfig:
    """The embedded `SyntheticShapes` data (``data.kind: synthetic``)."""
    train_size: int = option(4000, 'training images', min=1)
    val_size: int = option(200, 'validation images', min=1)
    image_size: Tuple[int, int] = option((64, 96), '(smallest, largest) side in pixels', min=8)
    max_objects: int = option(4, 'objects per image: 1..max_objects', min=1)
    object_size: Tuple[float, float] = option((0.2, 0.5), 'object side range, fraction of the shorter side',
                                              min=0, max=1)
    seed: int = option(0, 'seed of the images (independent of the training seed)', min=0)


@dataclass
class DataConfig:
    """``data:`` section of the detection task."""
    kind: Literal['synthetic', 'coco'] = option('synthetic', 'embedded shapes, or a COCO-format folder')
    root: Optional[str] = option(None, 'COCO root with <split>/ images and annotations/instances_<split>.json')
    train_split: str = option('train2017', 'training image folder under root')
    val_split: str = option('val2017', 'validation image folder under root')
    scales: Optional[List[int]] = option(None, "training shorter sides (null: DETR's 480..800 for coco, "
                                               "the generated size for synthetic)", min=8)
    eval_size: Optional[int] = option(None, 'evaluation shorter side (null: 800 for coco, generated size '
                                            'for synthetic)', min=8)
    max_size: Optional[int] = option(None, 'cap on the longer side (null: 1333 for coco, none for synthetic)',
                                     min=8)
    workers: int = option(4, 'data loading worker processes per rank', min=0)
    eval_batch_size: Optional[int] = option(None, 'evaluation batch (null: 2x train.batch_size)', min=1)
    synthetic: SyntheticDetectionConfig = option(factory=SyntheticDetectionConfig)


@dataclass
class LossConfig:
    """``loss:`` section: DETR's matcher costs and loss weights."""
    cost_class: float = option(1.0, 'matcher: classification cost weight', min=0)
    cost_bbox: float = option(5.0, 'matcher: L1 box cost weight', min=0)
    cost_giou: float = option(2.0, 'matcher: GIoU cost weight', min=0)
    loss_ce: float = option(1.0, 'classification loss weight', min=0)
    loss_bbox: float = option(5.0, 'L1 box loss weight', min=0)
    loss_giou: float = option(2.0, 'GIoU loss weight', min=0)
    eos_coef: float = option(0.1, 'weight of the no-object class', min=0)


class _SeededAugmentation(Dataset):
    """Items of ``dataset`` with their random augmentation seeded by ``(seed, epoch, index)``."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        with seeded(self.seed, self.epoch, index):
            return self.dataset[index]


@register_task('detection')
class DetectionTask(Task):
    """DETR training and COCO evaluation: ``AP`` (the metric), AP50, AP75, APs, APm, APl in percent as
    papers report them (-1 where the ground truth has no object of that size), and the loss."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    LossConfig = LossConfig
    metric = 'AP'
    metric_mode = 'max'
    collate_fn = staticmethod(collate_detection)

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        super().__init__(cfg)
        self.rank = rank
        self._coco_gt: Any = None
        loss = cfg.loss
        self.criterion = SetCriterion(
            self._num_classes(), eos_coef=loss.eos_coef,
            weight_dict={'loss_ce': loss.loss_ce, 'loss_bbox': loss.loss_bbox, 'loss_giou': loss.loss_giou})
        self.criterion.matcher = HungarianMatcher(loss.cost_class, loss.cost_bbox, loss.cost_giou)

    # ------------------------------------------------------------------ config
    @classmethod
    def check_config(cls, cfg: Config) -> None:
        m, d, loss = cfg.model, cfg.data, cfg.loss
        if m.hidden_dim % m.num_heads:
            raise ConfigError(f'model.hidden_dim: {m.hidden_dim} is not divisible by model.num_heads={m.num_heads}')
        if d.kind == 'coco' and not d.root:
            raise ConfigError('data.root: required when data.kind is coco (the folder with train2017/, val2017/ '
                              'and annotations/)')
        if loss.cost_class == loss.cost_bbox == loss.cost_giou == 0:
            raise ConfigError('loss.cost_class / cost_bbox / cost_giou: at least one matcher cost must be > 0')
        lo, hi = d.synthetic.image_size
        if lo > hi:
            raise ConfigError(f'data.synthetic.image_size: (min, max) with min <= max, got {(lo, hi)}')

    # ------------------------------------------------------------------ model
    def _ann_file(self, split: str) -> str:
        return os.path.join(os.path.expanduser(self.cfg.data.root), 'annotations', f'instances_{split}.json')

    def _num_classes(self) -> int:
        m, d = self.cfg.model, self.cfg.data
        if m.num_classes is not None:
            return m.num_classes
        if d.kind == 'synthetic':
            return max(c['id'] for c in SyntheticShapes.categories) + 1
        return 91  # COCO's largest category id + 1, as DETR

    def _model_kwargs(self) -> Dict[str, Any]:
        return dict(constructor_kwargs(self.cfg.model), num_classes=self._num_classes())

    def _create(self, kwargs: Dict[str, Any]) -> nn.Module:
        try:
            return DETR(**kwargs)
        except ValueError as e:
            raise ConfigError(f'model: {e}') from None

    def build_model(self) -> nn.Module:
        return self._create(self._model_kwargs())

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        kwargs = self._model_kwargs()
        del kwargs['dropout'], kwargs['backbone_weights']  # training-only: the checkpoint holds the weights
        if self.cfg.model.backbone_weights and kwargs['backbone_norm'] is None:
            kwargs['backbone_norm'] = 'frozen'  # the rebuilt model must have the same layers
        return dict(name='detr', kwargs=kwargs)

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        return self._create(dict(spec['kwargs']))

    # ------------------------------------------------------------------ data
    def _dataset(self, train: bool, size: Optional[int] = None) -> Dataset:
        d = self.cfg.data
        if d.kind == 'synthetic':
            s = d.synthetic
            scales = d.scales if train else ([size or d.eval_size] if (size or d.eval_size) else None)
            return SyntheticShapes(s.train_size if train else s.val_size, tuple(s.image_size), s.max_objects,
                                   tuple(s.object_size), seed=s.seed if train else s.seed + 1, train=train,
                                   scales=scales, max_size=d.max_size)
        split = d.train_split if train else d.val_split
        scales = (d.scales or DETR_SCALES) if train else [size or d.eval_size or DETR_SCALES[-1]]
        try:
            ds = CocoDetection(os.path.join(os.path.expanduser(d.root), split), self._ann_file(split), train=train,
                               scales=scales, max_size=d.max_size or 1333)
        except ValueError as e:
            raise ConfigError(f'data.root: {e}') from None
        _logger.info('%s data: %d images in %s', 'train' if train else 'eval', len(ds), ds.img_folder)
        return ds

    def _ground_truth(self) -> Any:
        """COCO ground truth of the validation split, in original image pixels (any eval size)."""
        if self._coco_gt is None:
            d = self.cfg.data
            self._coco_gt = self._dataset(train=False).coco() if d.kind == 'synthetic' else \
                CocoDetection(os.path.join(os.path.expanduser(d.root), d.val_split), self._ann_file(d.val_split),
                              scales=None).coco()
        return self._coco_gt

    def train_dataset(self) -> Dataset:
        return _SeededAugmentation(self._dataset(train=True), self.cfg.seed)

    def eval_dataset(self, size: Optional[int] = None) -> Dataset:
        """Validation images; ``size`` is the shorter side to evaluate at (resolution sweeps)."""
        return self._dataset(train=False, size=size)

    # ------------------------------------------------------------------ steps
    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        images, mask, targets = batch
        losses = self.criterion(model(images, mask), targets)
        extra = {k: float(losses[k].detach()) for k in ('loss_ce', 'loss_bbox', 'loss_giou')}
        return losses['loss'], extra

    def evaluate(self, model: nn.Module, batches: Iterable[Any], device: torch.device, autocast: Any,
                 reduce: Callable[[Dict[str, torch.Tensor]], Dict[str, float]]) -> Dict[str, float]:
        coco_gt = self._ground_truth()
        evaluator = CocoEvaluator(coco_gt)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        count = torch.zeros((), dtype=torch.float64, device=device)
        model.eval()
        with torch.no_grad():
            for batch in batches:
                images, mask, targets = self.to_device(batch, device)
                with autocast():
                    outputs = model(images, mask)
                boxes = float(sum(len(t['labels']) for t in targets))  # this rank's: no collective here
                loss_sum += self.criterion(outputs, targets, num_boxes=boxes)['loss'].double() * len(targets)
                count += len(targets)
                sizes = torch.stack([t['orig_size'] for t in targets])
                evaluator.update(targets, postprocess(outputs, sizes))
        sums = reduce({'loss': loss_sum, 'count': count})
        metrics = {k: 100.0 * v if v >= 0 else v for k, v in evaluator.summarize().items()}  # percent
        metrics['loss'] = sums['loss'] / max(sums['count'], 1.0)
        return metrics
