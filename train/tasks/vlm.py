"""Vision-language: a vispe ViT -> connector -> small decoder LM on the embedded colour-grid questions.

The model is `models.vlm.VLM` (``timm.create_model('vit_tiny', pe=model.vision_pe)`` with small
dims, an MLP projector with 2x2 merge or a resampler whose keys carry ``model.resampler_pe``, and a
decoder LM whose position ids follow ``model.scheme``, a multimodal encoding: ``rope_1d``, ``mrope``,
``mrope_interleave``, ``mhrope``, ``vrope``, ``v2pe``, ``videorope``, ``hope``, ``circlerope``). The data is
`models.vlm.ColourGridDataset`: an image of ``G x G`` coloured cells and the question "which colour is at row r, column c?"
(answered with one colour token at the last position), generated on the fly from ``(seed,
split, index)``. The metric is answer accuracy (%); the resolution sweep redraws the same
questions at larger images (more visual tokens per cell).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import vispe
from vispe_models.vlm import VLM, ColourGridDataset, ColourGridTask

from ..schema import Config, ConfigError, constructor_kwargs, constructor_section, option
from .base import Task, register_task

__all__ = ['VLMTask', 'ModelConfig', 'DataConfig']

Scheme = Literal['rope_1d', 'mrope', 'mrope_interleave', 'mhrope', 'vrope', 'v2pe', 'videorope', 'hope', 'circlerope']

# the vocabulary (and its special tokens) is the questions', the image size the data's
ModelConfig = constructor_section(
    'ModelConfig', VLM, module=__name__, exclude=('vocab_size', 'img_size', 'tokens'),
    scheme=(Scheme, option('mrope', "the LM's multimodal position-id scheme")),
    merge=option(min=1), num_queries=option(min=1), patch_size=option(min=1), vision_dim=option(min=1),
    vision_depth=option(min=1), vision_heads=option(min=1), lm_dim=option(min=1), lm_depth=option(min=1),
    lm_heads=option(min=1), lm_kv_heads=option(min=1), theta=option(min=1))


@dataclass
class DataConfig:
    """``data:`` section: the embedded colour-grid questions."""
    img_size: int = option(32, 'training image size (a multiple of grid and of the patch size)', min=4)
    grid: int = option(4, 'cells per image side', min=1)
    num_colours: int = option(4, 'palette size (chance accuracy is 1 / num_colours)', min=2, max=8)
    max_filler: int = option(2, 'at most this many filler tokens before the image (varies the padding)', min=0)
    train_size: int = option(20000, 'training questions', min=1)
    val_size: int = option(1000, 'validation questions', min=1)
    seed: int = option(0, 'seed of the questions (independent of the training seed)', min=0)
    workers: int = option(0, 'data loading worker processes per rank', min=0)
    eval_batch_size: Optional[int] = option(None, 'evaluation batch (null: 2x train.batch_size)', min=1)


@register_task('vlm')
class VLMTask(Task):
    """Colour-grid question answering with a vispe VLM; ``best.pt`` by answer accuracy."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    metric = 'accuracy'
    metric_mode = 'max'

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        super().__init__(cfg)
        self.rank = rank
        d = cfg.data
        self.questions = ColourGridTask(grid=d.grid, num_colours=d.num_colours, max_filler=d.max_filler)
        self._model: Optional[VLM] = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        m, d = cfg.model, cfg.data
        try:
            vispe.parse_pe_spec({'name': m.scheme, **(m.scheme_options or {})}, typed=True)
        except ValueError as e:
            raise ConfigError(f'model.scheme_options: {e}') from None
        if d.img_size % d.grid:
            raise ConfigError(f'data.img_size: {d.img_size} must be a multiple of data.grid={d.grid}')
        step = m.patch_size * (m.merge if m.connector == 'mlp' else 1)
        if d.img_size % step:
            raise ConfigError(f'data.img_size: {d.img_size} must be a multiple of model.patch_size x merge = {step}')

    # ------------------------------------------------------------------ model
    def _kwargs(self) -> Dict[str, Any]:
        return dict(constructor_kwargs(self.cfg.model), img_size=self.cfg.data.img_size)

    def _create(self, kwargs: Dict[str, Any]) -> VLM:
        try:
            model = VLM(self.questions.vocab_size, **kwargs)
        except ValueError as e:
            raise ConfigError(f'model: {e}') from None
        self._model = model
        return model

    def build_model(self) -> nn.Module:
        return self._create(self._kwargs())

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        m = self.cfg.model
        # the name doubles as the run label in sweeps and extrapolation tables
        return dict(name=f'{m.scheme} / vit {vispe.parse_pe_spec(m.vision_pe)[0][0]}', kwargs=self._kwargs())

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        return self._create(dict(spec['kwargs']))

    # ------------------------------------------------------------------ data
    def _visual_tokens(self, img_size: int) -> int:
        if self._model is None:
            self.build_model()
        gh, gw = self._model.visual_grid((img_size, img_size))
        return gh * gw

    def _dataset(self, split: Literal['train', 'val'], size: int, img_size: int) -> Dataset:
        d = self.cfg.data
        if img_size % d.grid:
            raise ValueError(f'input size {img_size} must be a multiple of data.grid={d.grid}')
        return ColourGridDataset(self.questions, size, img_size, self._visual_tokens(img_size), seed=d.seed,
                                 split=split)

    def train_dataset(self) -> Dataset:
        return self._dataset('train', self.cfg.data.train_size, self.cfg.data.img_size)

    def eval_dataset(self, size: Optional[int] = None) -> Dataset:
        return self._dataset('val', self.cfg.data.val_size, size or self.cfg.data.img_size)

    # ------------------------------------------------------------------ steps
    def _logits(self, model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch['images'], batch['input_ids'], batch['attention_mask'])

    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        logits = self._logits(model, batch)
        return self.questions.loss(logits, batch['labels']), {}

    def eval_step(self, model: nn.Module, batch: Any) -> Dict[str, torch.Tensor]:
        last = self._logits(model, batch)[:, -1].float()
        y = batch['labels']
        return dict(loss=F.cross_entropy(last, y, reduction='sum'), correct=(last.argmax(-1) == y).sum(),
                    count=torch.tensor(float(y.numel()), device=y.device))

    def summarize(self, sums: Dict[str, float]) -> Dict[str, float]:
        n = max(sums.get('count', 0.0), 1.0)
        return dict(accuracy=100.0 * sums.get('correct', 0.0) / n, loss=sums.get('loss', 0.0) / n)
