"""Image classification with a transformers vision encoder whose encoding is vispe's (`vispe.integrations.patch_vision`).

The model is one of transformers' image classifiers (ViT, DeiT, DINOv2, DINOv2 with registers, DINOv3-ViT,
SigLIP, CLIP), built from its config with the sizes of ``model.config`` (or loaded with ``from_pretrained``
from ``model.pretrained``, a local directory or a hub name), then patched with ``model.pe`` (null: the
model's own encoding, computed by vispe). The data, the loss, the evaluation and the resolution sweep are
the ``classification`` task's (the embedded `SpatialShapes` scenes by default); the patched model takes
every sweep size the patch divides. Checkpoints hold the patched model's ``state_dict`` (the encoding's
parameters under ``vispe_pe``) and the recipe to rebuild it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Optional, Set

import torch
from torch import nn

import vispe
from vispe.integrations import patch_vision
from vispe.extras import require

from ..schema import Config, ConfigError, option
from .base import register_task
from .classification import ClassificationTask, DataConfig, LossConfig

__all__ = ['TransformersVisionTask', 'ModelConfig', 'VisionClassifier', 'CLASSIFIERS']

_logger = logging.getLogger(__name__)

CLASSIFIERS = {  # model.family -> (config class, image-classification class) of transformers
    'vit': ('ViTConfig', 'ViTForImageClassification'),
    'deit': ('DeiTConfig', 'DeiTForImageClassification'),
    'dinov2': ('Dinov2Config', 'Dinov2ForImageClassification'),
    'dinov2_registers': ('Dinov2WithRegistersConfig', 'Dinov2WithRegistersForImageClassification'),
    'dinov3': ('DINOv3ViTConfig', 'DINOv3ViTForImageClassification'),
    'siglip': ('SiglipVisionConfig', 'SiglipForImageClassification'),
    'clip': ('CLIPVisionConfig', 'CLIPForImageClassification'),
}
_OWNED = {'num_labels': 'model.num_classes', 'image_size': 'data.img_size'}


@dataclass
class ModelConfig:
    """``model:`` section of the transformers_vision task."""
    family: str = option('vit', f'transformers classifier family: {", ".join(CLASSIFIERS)}')
    pe: vispe.registry.PESpec = option(None, "vispe encoding spec ('rope_mixed', 'liere', ...); null: the model's "
                                             "own encoding computed by vispe; 'none': no encoding")
    pretrained: Optional[str] = option(None, 'from_pretrained name or local directory (null: built from model.config)')
    num_classes: Optional[int] = option(None, 'classifier outputs (null: the number of classes of the data)', min=1)
    config: Dict[str, Any] = option(factory=dict, help='config sizes of the encoder (hidden_size, num_hidden_layers, '
                                                       'num_attention_heads, intermediate_size, patch_size, ...)')


class VisionClassifier(nn.Module):
    """A transformers image classifier as the classification loop takes it: ``pixel_values -> logits``."""

    def __init__(self, model: nn.Module, handle: Any) -> None:
        super().__init__()
        self.model = model
        self.patch = handle  # the VisionPatch (not a module): its encoding is registered inside ``model``

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """The prefix tokens and the encoding's own no-decay parameters (as timm's ViTs)."""
        names = {n for n, _ in self.named_parameters()
                 if n.rsplit('.', 1)[-1] in ('cls_token', 'distillation_token', 'register_tokens', 'class_embedding')}
        tower = f'model.{self.patch.tower_name}.' if self.patch.tower_name else 'model.'
        return names | {f'{tower}vispe_pe.{n}' for n in self.patch.encoding.no_weight_decay()}


@register_task('transformers_vision')
class TransformersVisionTask(ClassificationTask):
    """Image classification by a patched transformers vision encoder; ``best.pt`` by top-1 accuracy."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    LossConfig = LossConfig

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        m, d = cfg.model, cfg.data
        if m.family not in CLASSIFIERS:
            raise ConfigError(f'model.family: {m.family!r} is not one of {", ".join(CLASSIFIERS)}')
        for k in m.config:
            if k in _OWNED:
                raise ConfigError(f'model.config.{k}: set {_OWNED[k]} instead')
        if d.naflex:
            raise ConfigError('data.naflex: the transformers_vision task takes square images (the classifiers here '
                              'have no NaFlex input); set data.naflex: false')
        if d.kind == 'folder' and not d.root:
            raise ConfigError('data.root: required when data.kind is folder (the folder with train/ and val/)')
        patch = m.config.get('patch_size', 16)
        bad = [s for s in [d.img_size] + list(cfg.extrapolate.sizes) if s % patch]
        if bad:
            raise ConfigError(f'data.img_size / extrapolate.sizes: {bad[0]} px is not a multiple of the patch size '
                              f'{patch} (model.config.patch_size)')

    # ------------------------------------------------------------------ model
    def _spec(self, pe: vispe.registry.PESpec) -> Dict[str, Any]:
        """The recipe of the model: the classifier, and under ``kwargs`` its encoding (null resolved to the
        model's own spec, which also labels the run), classes and config."""
        m = self.cfg.model
        return dict(name=CLASSIFIERS[m.family][1], family=m.family, pretrained=m.pretrained,
                    kwargs=dict(pe=pe, num_classes=self._num_classes(),
                                config=dict(m.config, image_size=self.cfg.data.img_size)))

    def _build(self, spec: Dict[str, Any], load: bool) -> VisionClassifier:
        transformers = require('transformers', 'the transformers_vision task')
        config_cls, model_cls = (getattr(transformers, n) for n in CLASSIFIERS[spec['family']])
        kwargs = spec['kwargs']
        try:
            if spec['pretrained'] and load:
                model = model_cls.from_pretrained(spec['pretrained'], num_labels=kwargs['num_classes'],
                                                  ignore_mismatched_sizes=True)
            else:
                model = model_cls(config_cls(num_labels=kwargs['num_classes'], **kwargs['config']))
        except TypeError as e:
            raise ConfigError(f'model.config: {e}') from None
        try:
            handle = patch_vision(model, kwargs['pe'])
        except ValueError as e:
            raise ConfigError(f'model.pe: {e}') from None
        _logger.info('%s with pe=%s: %s', type(model).__name__, handle.encoding.name, handle.report)
        return VisionClassifier(model, handle)

    def build_model(self) -> nn.Module:
        return self._build(self._spec(self.cfg.model.pe), load=True)

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        return self._spec(model.patch.spec)

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        if self.cfg.data.kind == 'folder':
            self._num_classes()  # class mapping for the eval folder
        return self._build(spec, load=False)  # the checkpoint's state dict follows

    def eval_dataset(self, size: Optional[int] = None, max_tokens: Optional[int] = None):
        if size is not None and size % self.cfg.model.config.get('patch_size', 16):
            raise ValueError(f'size {size} px is not a multiple of the patch size')
        return super().eval_dataset(size, max_tokens)

