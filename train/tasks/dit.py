"""Diffusion transformers: a tiny diffusers FLUX, SD3, QwenImage, Wan, HunyuanVideo or LTX-Video transformer
with a swappable encoding (`vispe.integrations.patch_dit`), trained by flow matching on embedded generated images.

The data needs no download: item ``i`` is a scene drawn from ``(data.seed, i)``: three shapes of one of
``data.classes`` kinds (blob, ring, square, blob with a sign change across it; in video each moves along
a line over the frames)
rendered as a latent image whose channels mix the shapes with random weights. A scene is defined in
continuous coordinates, so ``eval_dataset(size)`` renders the same scenes on a ``size x size`` token grid:
the extrapolation sweep measures how the encoding holds at grids it never trained on. The text of a scene
is its kind: a fixed random embedding per kind (``data.text_tokens`` tokens and a pooled vector).

Flow matching (rectified flow, as these models train): ``x_t = (1 - t) x_0 + t noise``,
the transformer predicts the velocity ``noise - x_0`` at noise level ``t``, loss the mean squared error;
``t ~ U(0, 1)`` in training, a fixed level per evaluation item (``data.eval_levels`` levels in turn, noise
from the item's index), so evaluations are comparable across encodings and sizes. The metric is that loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from vispe.extras import require

from ..schema import Config, ConfigError, option
from .base import Task, register_task

__all__ = ['DiTTask', 'DiTModel', 'ModelConfig', 'DataConfig', 'render_scene', 'TINY_HOSTS']

HOSTS = ('flux', 'sd3', 'qwenimage', 'wan', 'hunyuan_video', 'ltx_video')
VIDEO = ('wan', 'hunyuan_video', 'ltx_video')
TINY_HOSTS: Dict[str, Tuple[str, Dict[str, Any]]] = {
    'flux': ('FluxTransformer2DModel', dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                            pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))),
    'sd3': ('SD3Transformer2DModel', dict(sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2,
                                          attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                          caption_projection_dim=32, pooled_projection_dim=16, pos_embed_max_size=64)),
    'qwenimage': ('QwenImageTransformer2DModel', dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                                      attention_head_dim=16, num_attention_heads=2,
                                                      joint_attention_dim=16, axes_dims_rope=(4, 6, 6))),
    'wan': ('WanTransformer3DModel', dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                          in_channels=4, out_channels=4, text_dim=16, freq_dim=16, ffn_dim=48,
                                          num_layers=2, rope_max_seq_len=64)),
    'hunyuan_video': ('HunyuanVideoTransformer3DModel', dict(in_channels=4, out_channels=4, num_attention_heads=2,
                                                             attention_head_dim=12, num_layers=1, num_single_layers=1,
                                                             num_refiner_layers=1, patch_size=2, patch_size_t=1,
                                                             text_embed_dim=16, pooled_projection_dim=16,
                                                             rope_axes_dim=(4, 4, 4), guidance_embeds=False)),
    'ltx_video': ('LTXVideoTransformer3DModel', dict(in_channels=4, out_channels=4, num_attention_heads=3,
                                                     attention_head_dim=12, cross_attention_dim=36, num_layers=2,
                                                     caption_channels=16)),
}
"""The tiny transformers of the task (``model.kwargs`` overrides any key): diffusers class, config."""


@dataclass
class ModelConfig:
    """``model:`` section of the dit task."""
    host: Literal['flux', 'sd3', 'qwenimage', 'wan', 'hunyuan_video', 'ltx_video'] = option(
        'flux', 'the diffusers transformer class')
    pe: str = option('own', "vispe encoding spec, or 'own': the host's own encoding, computed by vispe")
    scaling: str = option('none', "frequency scaling of the host's own encoding (pe: own) at larger grids: none, "
                                  'linear, ntk, yarn, riflex')
    kwargs: Dict[str, Any] = option(factory=dict, help='diffusers config keys of the transformer (over the tiny one)')


@dataclass
class DataConfig:
    """``data:`` section of the dit task."""
    grid: int = option(8, 'training token grid (side)', min=2)
    frames: int = option(2, 'latent frames (video hosts)', min=1)
    classes: int = option(4, 'scene kinds (blob, ring, square, two-signed blob), each with its own text', min=1, max=4)
    text_tokens: int = option(4, 'text tokens per scene', min=1)
    train_size: int = option(256, 'generated training scenes', min=1)
    val_size: int = option(32, 'generated evaluation scenes', min=1)
    eval_levels: int = option(4, 'noise levels of the evaluation, one per item in turn', min=1)
    seed: int = option(0, 'seed of the scenes', min=0)
    workers: int = option(0, 'data loading worker processes per rank', min=0)


def render_scene(index: int, seed: int, classes: int, channels: int, size: int, frames: Optional[int] = None
                 ) -> Tuple[torch.Tensor, int]:
    """Scene ``index`` as a latent image ``(channels, size, size)`` (video: ``(channels, frames, size, size)``)
    and its kind (module docstring); the same scene at every ``size``."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    kind = index % classes
    centres = torch.rand(3, 2, generator=g) * 0.6 + 0.2
    velocity = (torch.rand(3, 2, generator=g) - 0.5) * 0.3
    radius = torch.rand(3, generator=g) * 0.12 + 0.1
    weights = torch.randn(3, channels, generator=g)
    axis = (torch.arange(size, dtype=torch.float32) + 0.5) / size
    y, x = torch.meshgrid(axis, axis, indexing='ij')
    times = [0.0] if frames is None else [f / max(frames - 1, 1) for f in range(frames)]
    out = []
    for tau in times:
        image = torch.zeros(channels, size, size)
        for s in range(3):
            cy, cx = (centres[s] + tau * velocity[s]).tolist()
            d = ((y - cy) ** 2 + (x - cx) ** 2).sqrt() / radius[s]
            if kind == 0:
                shape = torch.exp(-d ** 2)
            elif kind == 1:
                shape = torch.exp(-((d - 1) / 0.25) ** 2)
            elif kind == 2:
                box = torch.maximum((y - cy).abs(), (x - cx).abs()) / radius[s]
                shape = torch.sigmoid((1 - box) * 12)
            else:
                shape = torch.exp(-d ** 2) * torch.sin(math.pi * (x - cx) / radius[s].item())
            image += weights[s][:, None, None] * shape
        out.append(image)
    latent = out[0] if frames is None else torch.stack(out, dim=1)
    return latent, kind


class _Scenes(Dataset):
    def __init__(self, first: int, count: int, seed: int, classes: int, channels: int, size: int,
                 frames: Optional[int]) -> None:
        self.first, self.count, self.seed, self.classes = first, count, seed, classes
        self.channels, self.size, self.frames = channels, size, frames

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int, int]:
        latent, kind = render_scene(self.first + i, self.seed, self.classes, self.channels, self.size, self.frames)
        return latent, kind, i


class DiTModel(nn.Module):
    """A tiny diffusers transformer (``self.transformer``, patched with ``pe``) and the fixed text of each
    scene kind; ``forward(latents, t, kinds)`` is the velocity prediction, the latents' shape.

    Args:
        host: ``'flux'``, ``'sd3'``, ``'qwenimage'``, ``'wan'``, ``'hunyuan_video'`` or ``'ltx_video'``.
        pe: a vispe encoding spec, or None (the host's own, computed by vispe).
        scaling: the scaling of the host's own encoding for grids beyond ``grid``.
        kwargs: config keys of the transformer over `TINY_HOSTS`.
        grid: the training token grid side; frames: latent frames (wan).
        classes, text_tokens: scene kinds and their text length.
    """

    def __init__(self, host: str, pe: Optional[str] = None, scaling: str = 'none', kwargs: Optional[Dict] = None,
                 grid: int = 8, frames: int = 2, classes: int = 4, text_tokens: int = 4) -> None:
        super().__init__()
        diffusers = require('diffusers', 'the dit task')
        from vispe.integrations import patch_dit
        cls_name, config = TINY_HOSTS[host]
        config = {**config, **(kwargs or {})}
        self.host = host
        self.transformer = getattr(diffusers, cls_name)(**config)
        cfg = self.transformer.config
        text_dim = getattr(cfg, {'wan': 'text_dim', 'hunyuan_video': 'text_embed_dim',
                                 'ltx_video': 'caption_channels'}.get(host, 'joint_attention_dim'))
        pooled = getattr(cfg, 'pooled_projection_dim', None) or 1
        g = torch.Generator().manual_seed(1234)
        self.register_buffer('text', torch.randn(classes, text_tokens, text_dim, generator=g))
        self.register_buffer('pooled', torch.randn(classes, pooled, generator=g))
        train_grid = (frames, grid, grid) if host in VIDEO else (grid, grid)
        self.patch = patch_dit(self.transformer, pe, train_grid=train_grid, scaling=scaling)

    @property
    def latent_patch(self) -> int:
        """Latent pixels per token side: what the transformer's own patch embedding takes (FLUX and
        QwenImage take packed tokens)."""
        return 2 if self.host in ('sd3', 'wan', 'hunyuan_video') else 1

    @property
    def channels(self) -> int:
        return self.transformer.config.in_channels

    def no_weight_decay(self) -> set:
        """The encoding's parameters (vispe's convention: no weight decay on positional parameters)."""
        if self.patch.encoding is None:
            return set()
        own = {id(p) for p in self.patch.encoding.parameters()}
        return {n for n, p in self.named_parameters() if id(p) in own}

    def forward(self, latents: torch.Tensor, t: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        text, pooled = self.text[kinds], self.pooled[kinds]
        tr = self.transformer
        if self.host in ('flux', 'qwenimage'):
            b, c, h, w = latents.shape
            tokens = latents.flatten(2).transpose(1, 2)
            if self.host == 'flux':
                axes = (torch.zeros(1), torch.arange(h, dtype=torch.float32), torch.arange(w, dtype=torch.float32))
                ids = torch.stack(torch.meshgrid(*axes, indexing='ij'), -1).reshape(-1, 3).to(latents)
                out = tr(hidden_states=tokens, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                         img_ids=ids, txt_ids=torch.zeros(text.shape[1], 3).to(latents)).sample
            else:
                mask = torch.ones(text.shape[:2], dtype=torch.bool, device=latents.device)
                out = tr(hidden_states=tokens, encoder_hidden_states=text, encoder_hidden_states_mask=mask, timestep=t,
                         img_shapes=[[(1, h, w)]] * b).sample
            return out.transpose(1, 2).reshape(b, c, h, w)
        if self.host == 'sd3':
            return tr(hidden_states=latents, encoder_hidden_states=text, pooled_projections=pooled,
                      timestep=1000 * t).sample
        if self.host == 'ltx_video':  # packed tokens, the pipeline's VAE compression as its rope scale
            b, c, f, h, w = latents.shape
            mask = torch.ones(text.shape[:2], device=latents.device)
            out = tr(hidden_states=latents.flatten(2).transpose(1, 2), encoder_hidden_states=text, timestep=1000 * t,
                     encoder_attention_mask=mask, num_frames=f, height=h, width=w,
                     rope_interpolation_scale=(8 / 25, 32, 32)).sample
            return out.transpose(1, 2).reshape(b, c, f, h, w)
        if self.host == 'hunyuan_video':
            mask = torch.ones(text.shape[:2], device=latents.device)
            return tr(hidden_states=latents, timestep=1000 * t, encoder_hidden_states=text, encoder_attention_mask=mask,
                      pooled_projections=pooled).sample
        return tr(hidden_states=latents, timestep=1000 * t, encoder_hidden_states=text).sample


@register_task('dit')
class DiTTask(Task):
    """Flow matching of a tiny diffusion transformer on generated scenes (metric: the evaluation ``loss``)."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    metric = 'loss'
    metric_mode = 'min'

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        super().__init__(cfg)
        self.rank = rank

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        m = cfg.model
        if m.pe != 'own' and m.scaling != 'none':
            raise ConfigError("model.scaling: scales the host's own encoding (model.pe: own); an encoding takes its "
                              "own options, e.g. model.pe: 'rope_axial:scaling=yarn'")
        if m.host == 'qwenimage' and cfg.data.grid % 2:
            raise ConfigError('data.grid: QwenImage centres its rows and columns; use an even grid')

    # ------------------------------------------------------------------ model
    def _kwargs(self) -> Dict[str, Any]:
        m, d = self.cfg.model, self.cfg.data
        return dict(host=m.host, pe=None if m.pe == 'own' else m.pe, scaling=m.scaling, kwargs=dict(m.kwargs),
                    grid=d.grid, frames=d.frames, classes=d.classes, text_tokens=d.text_tokens)

    def _create(self, kwargs: Dict[str, Any]) -> nn.Module:
        try:
            return DiTModel(**kwargs)
        except (ValueError, TypeError) as e:
            raise ConfigError(f'model: {e}') from None

    def build_model(self) -> nn.Module:
        return self._create(self._kwargs())

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        return dict(name='dit', kwargs=self._kwargs())

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        return self._create(dict(spec['kwargs']))

    # ------------------------------------------------------------------ data
    def _scenes(self, first: int, count: int, grid: int) -> Dataset:
        d = self.cfg.data
        channels = TINY_HOSTS[self.cfg.model.host][1]['in_channels']
        channels = self.cfg.model.kwargs.get('in_channels', channels)
        patch = 2 if self.cfg.model.host in ('sd3', 'wan', 'hunyuan_video') else 1
        frames = d.frames if self.cfg.model.host in VIDEO else None
        return _Scenes(first, count, d.seed, d.classes, channels, grid * patch, frames)

    def train_dataset(self) -> Dataset:
        return self._scenes(0, self.cfg.data.train_size, self.cfg.data.grid)

    def eval_dataset(self, size: Optional[int] = None) -> Dataset:
        """The evaluation scenes on the training grid, or on a ``size x size`` token grid."""
        return self._scenes(self.cfg.data.train_size, self.cfg.data.val_size, size or self.cfg.data.grid)

    # ------------------------------------------------------------------ steps
    def _loss(self, model: nn.Module, x0: torch.Tensor, kinds: torch.Tensor, t: torch.Tensor,
              noise: torch.Tensor) -> torch.Tensor:
        shape = (-1,) + (1,) * (x0.dim() - 1)
        xt = (1 - t.view(shape)) * x0 + t.view(shape) * noise
        pred = model(xt, t, kinds)
        return F.mse_loss(pred.float(), (noise - x0).float(), reduction='none').flatten(1).mean(1)

    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        x0, kinds, _ = batch
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 64 + self.rank)
        t = torch.rand(x0.shape[0], generator=g).to(x0.device)
        noise = torch.randn(x0.shape, generator=g).to(x0.device)
        return self._loss(model, x0, kinds, t, noise).mean(), {}

    def eval_step(self, model: nn.Module, batch: Any) -> Dict[str, torch.Tensor]:
        x0, kinds, index = batch
        levels = self.cfg.data.eval_levels
        noises: List[torch.Tensor] = []
        for i in index.tolist():
            noises.append(torch.randn(x0.shape[1:], generator=torch.Generator().manual_seed(10_007 * i + 1)))
        noise = torch.stack(noises).to(x0.device)
        t = ((index % levels).float() + 0.5).to(x0.device) / levels
        loss = self._loss(model, x0, kinds, t, noise)
        return {'loss': loss.sum().double(), 'count': torch.tensor(float(len(loss)), dtype=torch.float64)}

    def summarize(self, sums: Dict[str, float]) -> Dict[str, float]:
        return {'loss': sums['loss'] / max(sums['count'], 1.0)}
