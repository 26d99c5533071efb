"""NeRF (`models.nerf.NeRF`) with swappable coordinate encodings, on Blender scenes or the embedded scene.

An item of the training set is one pixel (its flat index over all training views); a batch of
``train.batch_size`` indices becomes rays on the device (NeRF's ``N_rand`` random rays per step,
drawn from all images), and the loss is NeRF's: MSE of the fine plus the coarse rendering. The
metric is NeRF's test PSNR: the mean over the evaluation views of each full image's PSNR.

NeRF's optimiser is Adam at 5e-4 decayed exponentially to 5e-5; the configs approximate it with
timm's cosine schedule to ``min_lr`` 5e-5 (``optim.opt: adam``, no weight decay).
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from vispe_models.nerf import NeRF
from vispe_models.nerf_data import SceneData, load_blender, pixel_rays, synthetic_scene

from ..schema import Config, ConfigError, constructor_kwargs, constructor_section, option
from .base import Task, register_task

__all__ = ['NeRFTask', 'ModelConfig', 'DataConfig', 'SyntheticSceneConfig']

_logger = logging.getLogger(__name__)

# data.white_background sets the model's compositing too
ModelConfig = constructor_section(
    'ModelConfig', NeRF, module=__name__, exclude=('white_background',),
    depth=option(min=1), width=option(min=2), num_coarse=option(min=2), num_fine=option(min=0),
    raw_noise_std=option(min=0), encoding_dim=option(min=1), chunk=option(min=1))


@dataclass
class SyntheticSceneConfig:
    """The embedded ray-traced scene (``data.kind: synthetic``)."""
    train_views: int = option(30, 'training views (random on the upper hemisphere)', min=1)
    eval_views: int = option(4, 'evaluation views (a ring at 30 degrees elevation)', min=1)
    height: int = option(48, 'image height', min=2)
    width: int = option(48, 'image width', min=2)
    seed: int = option(0, 'seed of the training cameras', min=0)


@dataclass
class DataConfig:
    """``data:`` section of the NeRF task."""
    kind: Literal['synthetic', 'blender'] = option('synthetic', 'embedded scene, or a Blender-format scene folder')
    root: Optional[str] = option(None, 'scene folder with transforms_{train,val,test}.json (kind: blender)')
    eval_split: Literal['test', 'val'] = option('test', 'Blender split to evaluate on')
    eval_views: Optional[int] = option(8, 'evaluate on the first N views of the split (null: all)', min=1)
    downscale: int = option(1, 'Blender images downscaled by this factor (2: NeRF half_res)', min=1)
    white_background: bool = option(True, 'composite RGBA on white (NeRF white_bkgd)')
    near: float = option(2.0, 'near bound of the rays', min=0)
    far: float = option(6.0, 'far bound of the rays', min=0)
    pixel_offset: float = option(0.0, 'pixel position within a pixel (0: NeRF code, 0.5: pixel centres)',
                                 min=0, max=1)
    eval_rays: int = option(4096, 'rays per rendering batch in evaluation', min=1)
    workers: int = option(0, 'data loading worker processes per rank (items are just indices)', min=0)
    synthetic: SyntheticSceneConfig = option(factory=SyntheticSceneConfig)


class _Indices(Dataset):
    """``0..n-1``: pixels (training) or views (evaluation); the task turns them into rays."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


@register_task('nerf')
class NeRFTask(Task):
    """NeRF training; evaluation renders whole views (metrics ``psnr``, ``mse``)."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    metric = 'psnr'
    metric_mode = 'max'

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        super().__init__(cfg)
        self.rank = rank
        self._scenes: Dict[str, SceneData] = {}
        self._on_device: Dict[Tuple[str, str], Tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        d = cfg.data
        if d.kind == 'blender' and not d.root:
            raise ConfigError('data.root: required when data.kind is blender (the folder with transforms_*.json)')
        if d.far <= d.near:
            raise ConfigError(f'data.far: must exceed data.near={d.near}, got {d.far}')

    # ------------------------------------------------------------------ model
    def _model_kwargs(self) -> Dict[str, Any]:
        return dict(constructor_kwargs(self.cfg.model), white_background=self.cfg.data.white_background)

    def _create(self, kwargs: Dict[str, Any]) -> nn.Module:
        try:
            return NeRF(**kwargs)
        except ValueError as e:
            raise ConfigError(f'model: {e}') from None

    def build_model(self) -> nn.Module:
        return self._create(self._model_kwargs())

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        return dict(name='nerf', kwargs=self._model_kwargs())

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        return self._create(dict(spec['kwargs']))

    # ------------------------------------------------------------------ data
    def scene(self, split: str) -> SceneData:
        """The posed images of ``split`` ('train' or the evaluation split), loaded once."""
        if split not in self._scenes:
            d = self.cfg.data
            if d.kind == 'synthetic':
                s = d.synthetic
                n = s.train_views if split == 'train' else s.eval_views
                scene = synthetic_scene(split, n, s.height, s.width, seed=s.seed)
            else:
                try:
                    scene = load_blender(d.root, split, d.downscale, d.white_background, d.near, d.far)
                except ValueError as e:
                    raise ConfigError(f'data.root: {e}') from None
                if split != 'train' and d.eval_views is not None:
                    scene.images, scene.poses = scene.images[:d.eval_views], scene.poses[:d.eval_views]
            if d.kind == 'synthetic' and not d.white_background:
                scene.images = scene.images * scene.alphas[..., None]  # the rendered scene is on white
            self._scenes[split] = scene
            _logger.info('%s views: %d of %dx%d, focal %.1f', split, len(scene.images), scene.height, scene.width,
                         scene.focal)
        return self._scenes[split]

    @property
    def eval_split(self) -> str:
        """The evaluation views: the embedded scene's ring, or the Blender split ``data.eval_split``."""
        return 'eval' if self.cfg.data.kind == 'synthetic' else self.cfg.data.eval_split

    def _device_tensors(self, split: str, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        key = (split, str(device))
        if key not in self._on_device:
            scene = self.scene(split)
            self._on_device[key] = (scene.images.to(device), scene.poses.to(device))
        return self._on_device[key]

    def train_dataset(self) -> Dataset:
        scene = self.scene('train')
        return _Indices(scene.images.shape[0] * scene.height * scene.width)

    def eval_dataset(self, size: Optional[int] = None) -> Dataset:
        if size is not None:
            raise ValueError('the nerf task evaluates at the resolution of its views; it has no input-size sweep')
        return _Indices(self.scene(self.eval_split).images.shape[0])

    # ------------------------------------------------------------------ steps
    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        d = self.cfg.data
        scene = self.scene('train')
        images, poses = self._device_tensors('train', batch.device)
        rays_o, rays_d = pixel_rays(poses, scene.height, scene.width, scene.focal, batch, d.pixel_offset)
        target = images.flatten(0, 2)[batch]
        out = model(rays_o, rays_d, d.near, d.far)
        mse = F.mse_loss(out['rgb'].float(), target)
        loss = mse + F.mse_loss(out['rgb_coarse'].float(), target) if self.cfg.model.num_fine > 0 else mse
        return loss, {'psnr': -10.0 * math.log10(max(mse.item(), 1e-10))}

    def evaluate(self, model: nn.Module, batches: Iterable[Any], device: torch.device, autocast: Any,
                 reduce: Callable[[Dict[str, torch.Tensor]], Dict[str, float]]) -> Dict[str, float]:
        d = self.cfg.data
        scene = self.scene(self.eval_split)
        images, poses = self._device_tensors(self.eval_split, device)
        sums = {k: torch.zeros((), dtype=torch.float64, device=device) for k in ('psnr', 'mse', 'count')}
        model.eval()
        with torch.no_grad():
            for batch in batches:
                for view in batch.tolist():
                    with autocast():
                        render = model.render_image(scene.height, scene.width, scene.focal, poses[view], d.near,
                                                    d.far, batch_rays=d.eval_rays, pixel_offset=d.pixel_offset)
                    mse = F.mse_loss(render.float(), images[view]).double()
                    sums['psnr'] += -10.0 * torch.log10(mse.clamp_min(1e-10))
                    sums['mse'] += mse
                    sums['count'] += 1
        total = reduce(sums)
        n = max(total['count'], 1.0)
        return {'psnr': total['psnr'] / n, 'mse': total['mse'] / n}
