"""Image classification: any timm model (vispe ViTs with ``pe=...``), on image folders or the embedded data.

Models come from ``timm.create_model(model.name, pe=model.pe, **model.kwargs)`` after
``import vispe``; pretrained weights are timm's (``model.pretrained=true``, downloaded) or a local
file (``model.pretrained_file=...``), loaded by vispe's checkpoint filter, which keeps every shared
weight, initialises the new encoding and reports what it dropped / initialised (logged here).
Data is the ImageNet folder layout through timm's transforms and Mixup / CutMix, or the embedded
`SpatialShapes` scenes (``data.kind: synthetic``), which are rendered without per-image
augmentation (a flip or a crop would change the answer).

``data.naflex: true`` is the path of timm's NaFlex loader (`train.data.naflex`): every image keeps its
aspect ratio (the scenes get varied ones, ``data.synthetic.aspect``), resized to at most
``data.max_tokens`` patches, and batches are timm's NaFlex dicts padded to that budget, which the
model takes as input; evaluation resizes whole images the same way (no crop), and the resolution
sweep then evaluates at native aspect ratios under token budgets (`eval_dataset`).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple

import timm
import torch
import torch.nn.functional as F
from timm.data import Mixup, create_transform, resolve_model_data_config
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torch import nn
from torch.utils.data import Dataset
from torchvision.datasets.folder import find_classes

import vispe
from vispe.naflex import naflex_batch

from ..schema import Config, ConfigError, option
from ..data import ImageFolderDataset, NaFlexCollate, NaFlexScenes, SpatialShapes, split_dir
from ..data.digits import write_digits
from ..data.synthetic import SyntheticTask
from ..rng import seeded
from .base import Task, register_task

__all__ = ['ClassificationTask', 'ModelConfig', 'DataConfig', 'AugConfig', 'SyntheticConfig', 'LossConfig']

_logger = logging.getLogger(__name__)

_OWNED_KWARGS = {'pe': 'model.pe', 'num_classes': 'model.num_classes', 'img_size': 'data.img_size',
                 'pretrained': 'model.pretrained', 'drop_rate': 'model.drop_rate',
                 'drop_path_rate': 'model.drop_path_rate', 'pretrained_cfg_overlay': 'model.pretrained_file'}


@dataclass
class ModelConfig:
    """``model:`` section of the classification task."""
    name: str = option('vit_tiny', 'timm model name; vispe ViTs: vit_tiny / vit_small / vit_base / vit_large')
    pe: vispe.registry.PESpec = option('learned', "vispe encoding spec: 'rope_mixed', 'irpe+learned', "
                                      "'rope_axial:theta=100' or a dict with a name key")
    pretrained: bool = option(False, "load timm's pretrained weights (downloads; offline: pretrained_file)")
    pretrained_file: Optional[str] = option(None, 'local timm checkpoint to fine-tune from (implies pretrained)')
    num_classes: Optional[int] = option(None, 'classifier outputs (null: the number of classes of the data)', min=1)
    drop_rate: float = option(0.0, 'dropout before the classifier', min=0, max=1)
    drop_path_rate: float = option(0.0, 'stochastic depth rate', min=0, max=1)
    kwargs: Dict[str, Any] = option(factory=dict, help='further timm.create_model keyword arguments '
                                                    '(patch_size, embed_dim, depth, num_heads, global_pool, ...)')


@dataclass
class AugConfig:
    """Training augmentation of image folders (timm create_transform and Mixup arguments)."""
    scale: Tuple[float, float] = option((0.08, 1.0), 'random-resized-crop area range', min=0, max=1)
    ratio: Tuple[float, float] = option((0.75, 4 / 3), 'random-resized-crop aspect range', min=0)
    hflip: float = option(0.5, 'horizontal flip probability', min=0, max=1)
    vflip: float = option(0.0, 'vertical flip probability', min=0, max=1)
    color_jitter: float = option(0.4, 'colour jitter strength (off when auto_augment is set, as in timm)', min=0)
    auto_augment: Optional[str] = option(None, "'rand-m9-mstd0.5-inc1' (RandAugment), '3a' (DeiT III 3-Augment), ...")
    re_prob: float = option(0.0, 'random erasing probability', min=0, max=1)
    re_mode: Literal['const', 'rand', 'pixel'] = option('pixel', 'random erasing fill')
    re_count: int = option(1, 'random erasing count', min=1)
    repeated_aug: int = option(0, 'repeated augmentation: copies of each image per epoch (DeiT: 3; 0/1: off)', min=0)
    mixup: float = option(0.0, 'mixup alpha (0: off)', min=0)
    cutmix: float = option(0.0, 'cutmix alpha (0: off)', min=0)
    mixup_prob: float = option(1.0, 'probability of mixing a batch', min=0, max=1)
    mixup_switch_prob: float = option(0.5, 'probability of cutmix instead of mixup when both are on', min=0, max=1)
    mixup_mode: Literal['batch', 'pair', 'elem'] = option('batch', 'mixup granularity')


@dataclass
class SyntheticConfig:
    """The embedded `SpatialShapes` data (``data.kind: synthetic``)."""
    train_size: int = option(20000, 'training scenes', min=1)
    val_size: int = option(2000, 'validation scenes', min=1)
    task: SyntheticTask = option('relation', 'relation (where the square is relative to the circle) | '
                                             'quadrant (where the square is)')
    seed: int = option(0, 'seed of the scenes (independent of the training seed)', min=0)
    cells: int = option(4, 'objects sit in distinct cells of a cells x cells grid (4: the patches of a '
                           'patch-8 model at 32 px)', min=2)
    object_size: Tuple[float, float] = option((0.05, 0.09), 'object half-size range (fraction of the canvas)',
                                              min=0, max=0.25)
    aspect: Tuple[float, float] = option((0.5, 2.0), 'data.naflex: range of the scenes\' aspect ratios (width / '
                                                     'height, log-uniform); square scenes without NaFlex', min=0)


@dataclass
class DataConfig:
    """``data:`` section of the classification task."""
    kind: Literal['synthetic', 'folder'] = option('synthetic', 'embedded scenes, or an ImageNet-layout folder')
    root: Optional[str] = option(None, 'folder with train/ and val/ class subfolders (kind: folder)')
    prepare: Optional[Literal['digits']] = option(None, "write a bundled dataset to root on first use (kind: folder): "
                                                      "digits = scikit-learn's 8x8 digits (pip install scikit-learn)")
    train_split: str = option('train', 'training subfolder of root')
    val_split: str = option('val', 'validation subfolder of root')
    img_size: int = option(224, 'training input size (also the model img_size)', min=8)
    workers: int = option(4, 'data loading worker processes per rank', min=0)
    eval_batch_size: Optional[int] = option(None, 'evaluation batch (null: 2x train.batch_size)', min=1)
    crop_pct: Optional[float] = option(None, "eval centre-crop fraction (null: the model's default)", min=0.05, max=1)
    crop_mode: Literal['center', 'squash', 'border'] = option('center', 'eval crop mode (timm)')
    interpolation: Optional[str] = option(None, "resize interpolation (null: the model's default)")
    mean: Optional[Tuple[float, float, float]] = option(None, "normalisation mean (null: the model's default)")
    std: Optional[Tuple[float, float, float]] = option(None, "normalisation std (null: the model's default)")
    naflex: bool = option(False, "native aspect ratios (timm's NaFlex loader): each image keeps its aspect ratio, "
                                 'resized to at most data.max_tokens patches; batches are NaFlex dicts padded to '
                                 'the budget (aug.ratio then scales the aspect ratio of each image)')
    max_tokens: Optional[int] = option(None, "data.naflex: patches per image at most (timm's max_seq_len; null: "
                                             'the patches of a data.img_size square)', min=1)
    aug: AugConfig = option(factory=AugConfig)
    synthetic: SyntheticConfig = option(factory=SyntheticConfig)


@dataclass
class LossConfig:
    """``loss:`` section: cross-entropy (DeiT) or binary cross-entropy (DeiT III)."""
    name: Literal['ce', 'bce'] = option('ce', 'ce: softmax cross-entropy; bce: per-class binary cross-entropy')
    label_smoothing: float = option(0.0, 'label smoothing (applied inside mixup when mixup is on)', min=0, max=1)
    bce_target_thresh: Optional[float] = option(None, 'bce: binarise (mixed) targets above this value', min=0, max=1)


@register_task('classification')
class ClassificationTask(Task):
    """Image classification; ``best.pt`` is chosen by top-1 accuracy on the validation split."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    LossConfig = LossConfig
    metric = 'top1'
    metric_mode = 'max'

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        super().__init__(cfg)
        self.rank = rank
        self._data_cfg: Dict[str, Any] = {}
        self._class_to_idx: Optional[dict] = None
        self.mixup: Optional[Mixup] = None
        self.criterion: Optional[nn.Module] = None
        self._patch_size: Optional[int] = None  # the model's (square) patch, for NaFlex data
        if cfg.data.prepare == 'digits':  # before anything lists the folder's classes
            write_digits(cfg.data.root)

    # ------------------------------------------------------------------ config
    @classmethod
    def check_config(cls, cfg: Config) -> None:
        m, d = cfg.model, cfg.data
        for k in m.kwargs:
            if k in _OWNED_KWARGS:
                raise ConfigError(f'model.kwargs.{k}: set {_OWNED_KWARGS[k]} instead')
        if d.prepare and d.kind != 'folder':
            raise ConfigError(f'data.prepare: writes an image folder, so it needs data.kind: folder (got {d.kind})')
        if d.kind == 'folder' and not d.root:
            raise ConfigError('data.root: required when data.kind is folder (the folder with train/ and val/)')
        if (d.aug.mixup > 0 or d.aug.cutmix > 0) and d.aug.mixup_mode == 'batch' and cfg.train.batch_size % 2:
            raise ConfigError(f'train.batch_size: mixup / cutmix need an even batch, got {cfg.train.batch_size}')
        if d.aug.scale[0] > d.aug.scale[1] or d.aug.ratio[0] > d.aug.ratio[1]:
            raise ConfigError('data.aug.scale / data.aug.ratio: (low, high) with low <= high')
        if not 0 < d.synthetic.aspect[0] <= d.synthetic.aspect[1]:
            raise ConfigError(f'data.synthetic.aspect: (low, high) width / height ratios with 0 < low <= high, '
                              f'got {d.synthetic.aspect}')
        if d.max_tokens is not None and not d.naflex:
            raise ConfigError('data.max_tokens: the token budget of NaFlex batches; set data.naflex: true to use it')
        if d.naflex and (d.aug.mixup > 0 or d.aug.cutmix > 0):
            raise ConfigError('data.aug.mixup / data.aug.cutmix: images of different sizes cannot be mixed; set both '
                              'to 0 with data.naflex: true')
        if d.naflex and d.crop_pct is not None:
            raise ConfigError('data.crop_pct: NaFlex evaluation resizes whole images to the token budget, without a '
                              'crop; remove it with data.naflex: true')

    # ------------------------------------------------------------------ classes and model
    def _num_classes(self) -> int:
        d = self.cfg.data
        if d.kind == 'synthetic':
            found = SpatialShapes.num_classes
        else:
            if self._class_to_idx is None:
                # the training split defines the classes; evaluation-only setups may have val/ alone
                train = Path(d.root).expanduser() / d.train_split
                _, self._class_to_idx = find_classes(str(train if train.is_dir() else split_dir(d.root, d.val_split)))
            found = len(self._class_to_idx)
        want = self.cfg.model.num_classes
        if want is not None and want != found:
            raise ConfigError(f'model.num_classes: {want} does not match the {found} classes of the data')
        return found

    def _model_kwargs(self) -> Dict[str, Any]:
        m = self.cfg.model
        return dict(pe=m.pe, num_classes=self._num_classes(), img_size=self.cfg.data.img_size,
                    drop_rate=m.drop_rate, drop_path_rate=m.drop_path_rate, **m.kwargs)

    def _create(self, name: str, kwargs: Dict[str, Any], pretrained: bool = False,
                file: Optional[str] = None) -> nn.Module:
        extra = dict(pretrained_cfg_overlay=dict(file=file)) if file else {}
        try:
            model = timm.create_model(name, pretrained=pretrained or bool(file), **extra, **kwargs)
        except TypeError as e:
            raise ConfigError(f'model.kwargs: {e}') from None
        except (ValueError, NotImplementedError) as e:
            raise ConfigError(f'model: {e}') from None
        except RuntimeError as e:
            if 'Unknown model' in str(e):
                raise ConfigError(f'model.name: {e}') from None
            raise
        except OSError as e:  # hub download failed (offline)
            if file:
                raise
            raise OSError(f'model.pretrained=true could not fetch the timm weights of {name!r} ({e}); '
                          f'offline, pass model.pretrained_file=/path/to/weights') from e
        self._data_cfg = resolve_model_data_config(model)
        return model

    def build_model(self) -> nn.Module:
        m = self.cfg.model
        model = self._create(m.name, self._model_kwargs(), m.pretrained, m.pretrained_file)
        self._check_input_sizes(model)
        if self.cfg.data.naflex:
            self._check_naflex(model)
        report = getattr(model, 'pretrained_report', None)
        if report is not None:
            _logger.info('pretrained weights (%s): %s', m.pretrained_file or m.name, report)
        elif m.pretrained or m.pretrained_file:
            _logger.info('pretrained weights loaded (%s)', m.pretrained_file or m.name)
        return model

    def _check_input_sizes(self, model: nn.Module) -> None:
        """Training and sweep sizes must be multiples of the patch size: found now, not after training."""
        embed = getattr(model, 'patch_embed', None)
        if embed is None or getattr(embed, 'dynamic_img_pad', False):  # no patches, or padded to fit
            return
        ph, pw = embed.patch_size
        step = math.lcm(ph, pw)
        checks = (('data.img_size', [self.cfg.data.img_size]), ('extrapolate.sizes', self.cfg.extrapolate.sizes))
        for key, sizes in checks:
            bad = [size for size in sizes if size % step]
            if bad:
                near = max(bad[0] // step, 1) * step
                raise ConfigError(f'{key}: {bad[0]} px is not a multiple of the patch size {ph}x{pw} of '
                                  f'{self.cfg.model.name}; use multiples of {step} (e.g. {near} or {near + step})')

    def _check_naflex(self, model: nn.Module) -> None:
        """NaFlex needs square patches and a model that takes NaFlex dicts: a two-image batch of two grids
        runs through it now, so that an encoding or model without NaFlex support stops before step 1."""
        embed = getattr(model, 'patch_embed', None)
        ph, pw = getattr(embed, 'patch_size', (None, None))
        if ph is None or ph != pw:
            raise ConfigError(f'data.naflex: needs a ViT with square patches; {self.cfg.model.name} has '
                              f'{f"{ph}x{pw} patches" if ph else "no patch embedding"}')
        self._patch_size = ph
        chans = getattr(getattr(embed, 'proj', None), 'in_channels', 3)
        probe = naflex_batch([torch.zeros(chans, ph, 2 * ph), torch.zeros(chans, 2 * ph, ph)], ph, 3, resize=False)
        was_training = model.training
        try:
            with torch.no_grad():
                model.eval()(probe)
        except Exception as e:  # whatever the model raises, the config is what to change
            raise ConfigError(f'data.naflex: {self.cfg.model.name} with model.pe={self.cfg.model.pe!r} does not take '
                              f'NaFlex batches ({type(e).__name__}: {e})') from e
        finally:
            model.train(was_training)

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        training_only = ('drop_rate', 'drop_path_rate')
        kwargs = {k: v for k, v in self._model_kwargs().items() if k not in training_only}
        return dict(name=self.cfg.model.name, kwargs=kwargs)

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        if self.cfg.data.kind == 'folder':
            self._num_classes()  # class mapping for the eval folder
        model = self._create(spec['name'], dict(spec['kwargs']))
        if self.cfg.data.naflex:
            self._check_naflex(model)
        return model

    def chance_level(self, spec: Dict[str, Any]) -> Optional[float]:
        return 100.0 / spec['kwargs']['num_classes']  # top-1 (%) of a uniform guess

    # ------------------------------------------------------------------ data
    def _norm(self) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        d = self.cfg.data
        return (tuple(d.mean or self._data_cfg.get('mean', (0.5, 0.5, 0.5))),
                tuple(d.std or self._data_cfg.get('std', (0.5, 0.5, 0.5))))

    def _synthetic(self, split: str, size: int, img_size: int) -> SpatialShapes:
        s = self.cfg.data.synthetic
        try:
            return SpatialShapes(size, img_size, seed=s.seed, split=split, task=s.task, cells=s.cells,
                                 object_size=s.object_size, aspect=s.aspect if self.cfg.data.naflex else None)
        except ValueError as e:
            raise ConfigError(f'data.synthetic: {e}') from None

    def naflex_budget(self, size: Optional[int] = None) -> Optional[int]:
        """The token budget of NaFlex data (None without ``data.naflex``): ``data.max_tokens``, or with
        ``size`` the patches of a ``size`` square (the sweep's sizes stand for their token counts)."""
        d = self.cfg.data
        if not d.naflex:
            return None
        if self._patch_size is None:
            raise RuntimeError('naflex_budget: build the model first (the budget depends on its patch size)')
        p = self._patch_size
        if size is None:
            return d.max_tokens or (d.img_size // p) ** 2
        if size % p:
            raise ValueError(f'size {size} px is not a multiple of the patch size {p}: its token count '
                             f'({size / p:g} x {size / p:g}) is not whole')
        return (size // p) ** 2

    def _naflex_data(self, max_tokens: int) -> None:
        # one collate for the datasets built last: the loop builds its train and eval sets at one budget,
        # the sweep builds each budget's set right before its loader
        self.collate_fn = NaFlexCollate(self._patch_size, max_tokens)

    def train_dataset(self) -> Dataset:
        d = self.cfg.data
        self._build_loss()
        budget = self.naflex_budget()
        if budget is not None:
            self._naflex_data(budget)
        if d.kind == 'synthetic':
            scenes = self._synthetic('train', d.synthetic.train_size, d.img_size)
            return scenes if budget is None else NaFlexScenes(scenes, self._patch_size, budget)
        a = d.aug
        mean, std = self._norm()
        naflex = dict(naflex=True, patch_size=self._patch_size, max_seq_len=budget) if budget is not None else {}
        transform = create_transform(
            d.img_size, is_training=True, scale=a.scale, ratio=a.ratio, hflip=a.hflip, vflip=a.vflip,
            color_jitter=a.color_jitter, auto_augment=a.auto_augment,
            interpolation=d.interpolation or self._data_cfg.get('interpolation', 'bicubic'),
            mean=mean, std=std, re_prob=a.re_prob, re_mode=a.re_mode, re_count=a.re_count, **naflex)
        ds = ImageFolderDataset(split_dir(d.root, d.train_split), transform, seed=self.cfg.seed,
                                class_to_idx=self._class_to_idx)
        _logger.info('train data: %d images, %d classes in %s', len(ds), len(ds.classes), ds.root)
        return ds

    def eval_dataset(self, size: Optional[int] = None, max_tokens: Optional[int] = None) -> Dataset:
        """The validation set at ``size`` px (square), or with ``data.naflex`` at native aspect ratios
        under ``max_tokens`` (default: `naflex_budget` of ``size``, else the training budget)."""
        d = self.cfg.data
        if d.naflex:
            return self._naflex_eval(max_tokens or self.naflex_budget(size))
        if max_tokens is not None:
            raise ValueError('max_tokens: native-aspect evaluation needs data.naflex: true')
        size = size or d.img_size
        if d.kind == 'synthetic':
            return self._synthetic('val', d.synthetic.val_size, size)
        mean, std = self._norm()
        transform = create_transform(
            size, is_training=False, interpolation=d.interpolation or self._data_cfg.get('interpolation', 'bicubic'),
            mean=mean, std=std, crop_pct=d.crop_pct or self._data_cfg.get('crop_pct', 0.875), crop_mode=d.crop_mode)
        return ImageFolderDataset(split_dir(d.root, d.val_split), transform, class_to_idx=self._class_to_idx)

    def _naflex_eval(self, max_tokens: int) -> Dataset:
        d = self.cfg.data
        self._naflex_data(max_tokens)
        if d.kind == 'synthetic':
            return NaFlexScenes(self._synthetic('val', d.synthetic.val_size, d.img_size), self._patch_size, max_tokens)
        mean, std = self._norm()
        transform = create_transform(
            d.img_size, is_training=False, mean=mean, std=std,
            interpolation=d.interpolation or self._data_cfg.get('interpolation', 'bicubic'),
            naflex=True, patch_size=self._patch_size, max_seq_len=max_tokens)
        return ImageFolderDataset(split_dir(d.root, d.val_split), transform, class_to_idx=self._class_to_idx)

    def unreadable(self, batch: Any) -> List[int]:
        return batch[2][batch[2] >= 0].tolist()

    # ------------------------------------------------------------------ steps
    def _build_loss(self) -> None:
        a, loss = self.cfg.data.aug, self.cfg.loss
        num_classes = self._num_classes()
        if a.mixup > 0 or a.cutmix > 0:
            self.mixup = Mixup(mixup_alpha=a.mixup, cutmix_alpha=a.cutmix, prob=a.mixup_prob,
                               switch_prob=a.mixup_switch_prob, mode=a.mixup_mode,
                               label_smoothing=loss.label_smoothing, num_classes=num_classes)
        if loss.name == 'bce':
            smoothing = 0.0 if self.mixup is not None else loss.label_smoothing
            self.criterion = BinaryCrossEntropy(smoothing=smoothing, target_threshold=loss.bce_target_thresh)
        elif self.mixup is not None:
            self.criterion = SoftTargetCrossEntropy()
        elif loss.label_smoothing > 0:
            self.criterion = LabelSmoothingCrossEntropy(smoothing=loss.label_smoothing)
        else:
            self.criterion = nn.CrossEntropyLoss()

    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        x, y = batch[0], batch[1]
        if self.mixup is not None:
            with seeded(self.cfg.seed, step, self.rank):  # the mix of a batch depends on (seed, step, rank) only
                x, y = self.mixup(x, y)
        return self.criterion(model(x), y), {}

    def eval_step(self, model: nn.Module, batch: Any) -> Dict[str, torch.Tensor]:
        x, y = batch[0], batch[1]
        logits = model(x).float()
        sums = dict(loss=F.cross_entropy(logits, y, reduction='sum'), correct1=logits.argmax(-1).eq(y).sum(),
                    count=torch.tensor(float(y.numel()), device=y.device))
        if logits.shape[-1] > 5:  # top-5 of 5 classes or fewer says nothing
            sums['correct5'] = logits.topk(5, dim=-1).indices.eq(y[:, None]).any(dim=-1).sum()
        if isinstance(x, dict):  # NaFlex: the grids the images were seen at
            valid = x['patch_valid']
            extent = x['patch_coord'].masked_fill(~valid[..., None], -1).amax(1).float() + 1  # (B, 2): rows, cols
            sums.update(tokens=valid.sum().float(), grid_h=extent[:, 0].sum(), grid_w=extent[:, 1].sum(),
                        aspect=(extent[:, 1] / extent[:, 0]).sum())
        return sums

    def summarize(self, sums: Dict[str, float]) -> Dict[str, float]:
        n = max(sums.get('count', 0.0), 1.0)
        metrics = dict(top1=100.0 * sums.get('correct1', 0.0) / n)
        if 'correct5' in sums:
            metrics['top5'] = 100.0 * sums['correct5'] / n
        metrics['loss'] = sums.get('loss', 0.0) / n
        for k in ('tokens', 'grid_h', 'grid_w', 'aspect'):  # NaFlex: means per image
            if k in sums:
                metrics[k] = sums[k] / n
        return metrics
