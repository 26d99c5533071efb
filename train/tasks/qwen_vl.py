"""Fine-tune a transformers Qwen-VL-family model with any multimodal encoding of vispe, through `patch_vlm`.

The model is a tiny randomly initialised ``Qwen2VL`` / ``Qwen2_5_VL`` / ``Qwen3VL`` / ``Qwen3VLMoe``
``ForConditionalGeneration`` built from a config (`vispe_models.qwen_vl.tiny_qwen_vl`, no download),
its multimodal RoPE swapped by ``vispe.integrations.patch_vlm(model, {'name': model.scheme,
**model.scheme_options})`` (``scheme: null`` keeps the model's own, computed by vispe). The data is
`vispe_models.qwen_vl.CellColours`: an image of ``grid x grid`` coloured cells, then "row r, column c";
the answer is that cell's colour token, read from the logits at the last position. The metric is answer
accuracy (%).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import vispe
from vispe.integrations import patch_vlm
from vispe_models.qwen_vl import CellColours, collate_cell_colours, tiny_qwen_vl

from ..schema import Config, ConfigError, option
from .base import Task, register_task

__all__ = ['QwenVLTask', 'ModelConfig', 'DataConfig']


@dataclass
class ModelConfig:
    """``model:`` section: the tiny Qwen-VL model and the scheme patched into it."""
    family: Literal['qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe'] = option('qwen2_vl', 'transformers family')
    scheme: Optional[str] = option(None, "a multimodal encoding of vispe (null: the model's own)")
    scheme_options: Dict[str, Any] = option(factory=dict, help='options of the encoding (sections, head_sections, ...)')
    hidden: int = option(96, 'language model width', min=8)
    heads: int = option(6, 'attention heads', min=1)
    kv_heads: int = option(3, 'key/value heads', min=1)
    layers: int = option(2, 'language model layers', min=1)


@dataclass
class DataConfig:
    """``data:`` section: the embedded cell-colour questions."""
    grid: int = option(3, 'merged cells per image side', min=1, max=9)
    num_colours: int = option(4, 'palette size (chance accuracy is 1 / num_colours)', min=2, max=20)
    max_filler: int = option(2, 'at most this many filler tokens before the image (varies the padding)', min=0)
    train_size: int = option(4000, 'training questions', min=1)
    val_size: int = option(256, 'validation questions', min=1)
    seed: int = option(0, 'seed of the questions and palette', min=0)
    workers: int = option(0, 'data loading worker processes per rank', min=0)
    eval_batch_size: Optional[int] = option(None, 'evaluation batch (null: 2x train.batch_size)', min=1)


@register_task('qwen_vl')
class QwenVLTask(Task):
    """Cell-colour questions with a patched transformers Qwen-VL model; ``best.pt`` by answer accuracy."""
    ModelConfig = ModelConfig
    DataConfig = DataConfig
    metric = 'accuracy'
    metric_mode = 'max'
    collate_fn = staticmethod(collate_cell_colours)

    def __init__(self, cfg: Config, rank: int = 0) -> None:
        super().__init__(cfg)
        self.rank = rank
        self.handle = None

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        m = cfg.model
        names = tuple(n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal')
        if m.scheme is not None and m.scheme not in names:
            raise ConfigError(f'model.scheme: must be null or one of {names}, got {m.scheme!r}')
        if m.hidden % m.heads or (m.hidden // m.heads) % 2 or m.heads % m.kv_heads:
            raise ConfigError(f'model: hidden ({m.hidden}) / heads ({m.heads}) must be an even head width and '
                              f'heads a multiple of kv_heads ({m.kv_heads})')

    # ------------------------------------------------------------------ model
    def _create(self, spec: Dict[str, Any]) -> nn.Module:
        model = tiny_qwen_vl(spec['family'], hidden=spec['hidden'], heads=spec['heads'],
                             kv_heads=spec['kv_heads'], layers=spec['layers'], seed=self.cfg.seed)
        try:
            pe = None if spec['scheme'] is None else {'name': spec['scheme'], **dict(spec['scheme_options'])}
            if pe is None and spec['scheme_options']:
                raise ValueError(f"options {sorted(spec['scheme_options'])} need a scheme (null is the model's own)")
            self.handle = patch_vlm(model, pe)
        except ValueError as e:
            raise ConfigError(f'model.scheme_options: {e}') from None
        return model

    def _spec(self) -> Dict[str, Any]:
        m = self.cfg.model
        return dict(family=m.family, scheme=m.scheme, scheme_options=dict(m.scheme_options), hidden=m.hidden,
                    heads=m.heads, kv_heads=m.kv_heads, layers=m.layers)

    def build_model(self) -> nn.Module:
        return self._create(self._spec())

    def model_spec(self, model: nn.Module) -> Dict[str, Any]:
        spec = self._spec()
        # the name doubles as the run label in sweeps
        return dict(name=f'{spec["family"]} / {self.handle.encoding.name}', kwargs=spec)

    def rebuild_model(self, spec: Dict[str, Any]) -> nn.Module:
        return self._create(dict(spec['kwargs']))

    # ------------------------------------------------------------------ data
    def _dataset(self, split: Literal['train', 'val'], size: int) -> Dataset:
        d = self.cfg.data
        return CellColours(size, grid=d.grid, num_colours=d.num_colours, max_filler=d.max_filler, seed=d.seed,
                           split=split)

    def train_dataset(self) -> Dataset:
        return self._dataset('train', self.cfg.data.train_size)

    def eval_dataset(self, size: Optional[int] = None) -> Dataset:
        if size is not None:
            raise ValueError('the qwen_vl task has one image size (data.grid); no resolution sweep')
        return self._dataset('val', self.cfg.data.val_size)

    # ------------------------------------------------------------------ steps
    def _last_logits(self, model: nn.Module, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != 'answer'}
        return model(**inputs, logits_to_keep=1).logits[:, -1].float()

    def train_step(self, model: nn.Module, batch: Any, step: int) -> Tuple[torch.Tensor, Dict[str, float]]:
        return F.cross_entropy(self._last_logits(model, batch), batch['answer']), {}

    def eval_step(self, model: nn.Module, batch: Any) -> Dict[str, torch.Tensor]:
        last = self._last_logits(model, batch)
        y = batch['answer']
        return dict(loss=F.cross_entropy(last, y, reduction='sum'), correct=(last.argmax(-1) == y).sum(),
                    count=torch.tensor(float(y.numel()), device=y.device))

    def summarize(self, sums: Dict[str, float]) -> Dict[str, float]:
        n = max(sums.get('count', 0.0), 1.0)
        return dict(accuracy=100.0 * sums.get('correct', 0.0) / n, loss=sums.get('loss', 0.0) / n)
