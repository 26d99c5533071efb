"""Pretrained weights for vispe hosts: a timm checkpoint's position weights handed to the encoding.

timm's ``pos_embed`` goes to the encoding's ``adopt_pos_embed`` (a ``learned`` table takes it,
resampled to its grid), a learned timm rope's frequencies to ``adopt_timm_rope``; everything else
loads under timm's own names. `LoadReport` says, key by key, what was dropped, initialised and
resampled; it never silently loads nothing.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
from timm.models.eva import Eva
from timm.models.eva import checkpoint_filter_fn as timm_eva_checkpoint_filter_fn
from timm.models.vision_transformer import checkpoint_filter_fn as timm_checkpoint_filter_fn
from torch import nn

from .contract import PositionalEncoding

__all__ = ['LoadReport', 'adopt_pos_embed', 'adopt_own_weights', 'checkpoint_filter_fn', 'load_timm_checkpoint']

_logger = logging.getLogger(__name__)


@dataclass
class LoadReport:
    """What loading a timm checkpoint into a vispe ViT did, key by key."""
    dropped: List[str]
    initialized: List[str]
    resampled: List[str]

    def __str__(self) -> str:
        return (f'dropped {self.dropped or "nothing"}; initialised {self.initialized or "nothing"}; '
                f'resampled {self.resampled or "nothing"}')


def adopt_pos_embed(pe: PositionalEncoding, table: torch.Tensor, num_prefix_tokens: int,
                    grid: Optional[Sequence[int]] = None, embed_prefix: bool = True, prefix: str = 'pe.'
                    ) -> Tuple[Dict[str, torch.Tensor], List[str]]:
    """A checkpoint's timm ``pos_embed`` handed to ``pe.adopt_pos_embed``: the state-dict entries it
    fills (names prefixed with ``prefix``) and those among them that were resampled.

    The table's prefix rows are read from its size: ``num_prefix_tokens`` rows when the rest form
    ``grid`` (or a square grid), none when the table itself does (timm's ``no_embed_class``); where
    both fit, ``embed_prefix`` (the model's ``not no_embed_class``) decides.
    """
    rows = table.shape[1]
    candidates = [(num_prefix_tokens, rows - num_prefix_tokens), (0, rows)] if num_prefix_tokens else [(0, rows)]
    if not embed_prefix:
        candidates.reverse()
    for npre, n in candidates:
        if grid is not None and math.prod(grid) == n:
            shape = tuple(grid)
        elif grid is None and n > 0 and math.isqrt(n) ** 2 == n:
            shape = (math.isqrt(n),) * 2
        else:
            continue
        entries, resampled = pe.adopt_pos_embed(table, npre, shape)
        return {prefix + k: v for k, v in entries.items()}, [prefix + k for k in resampled]
    raise ValueError(f'checkpoint pos_embed has {rows} rows: neither {num_prefix_tokens} prefix rows plus '
                     f'{"a square grid" if grid is None else f"the grid {tuple(grid)}"} nor the grid alone')


class _RopeWeights:
    """A timm rope module's learned frequencies read from a state dict (what `adopt_timm_rope` reads)."""

    def __init__(self, entries: Dict[str, torch.Tensor]) -> None:
        self.freqs = entries['rope.freqs']


def checkpoint_filter_fn(state_dict: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Adapt a timm ViT / Eva state dict to a vispe host (vispe's ViT, a converted timm model) with any
    encoding, and validate it.

    timm's own filter for the model's family converts the formats it knows (patch-embed resampling,
    CLIP / DINOv2 / EVA layouts); a learned rope's frequencies go to the encoding that takes them;
    then ``pos_embed`` moves into the learned encoding (resampled to its grid) or is dropped, and the
    encoding's parameters are marked as initialised. The classifier (``head.*``) is kept where the
    model has one of the same shape, else dropped (a headless ``num_classes=0`` backbone, another
    number of classes), and a model classifier the checkpoint does not fill is marked as
    initialised. Other keys that the model lacks, or model weights the checkpoint lacks outside the
    encoding and the classifier, raise: that is a different architecture. The report is logged and
    stored as ``model.pretrained_report``.
    """
    sd = (timm_eva_checkpoint_filter_fn if isinstance(model, Eva) else timm_checkpoint_filter_fn)(state_dict, model)
    dropped, resampled = [], []
    rope = {k: sd.pop(k) for k in [k for k in sd if k.startswith('rope.')]}
    if rope:  # an Eva's rope: a learned one (RoPE-Mixed) hands its frequencies to the encoding
        taken = model.pe.adopt_timm_rope(_RopeWeights(rope)) if 'rope.freqs' in rope else {}
        sd.update({f'pe.{k}': v for k, v in taken.items()})
        if not taken:
            dropped += sorted(rope)
    table = sd.pop('pos_embed', None)
    if table is not None:
        entries, resampled = adopt_pos_embed(model.pe, table, model.num_prefix_tokens,
                                             embed_prefix=not model.no_embed_class)
        sd.update(entries)
        if not entries:
            dropped.append('pos_embed')
    model_sd = model.state_dict()
    model_keys = set(model_sd)
    for key in sorted(k for k in sd if k.startswith('head.')):
        if key not in model_sd or sd[key].shape != model_sd[key].shape:
            dropped.append(key)
            del sd[key]
    unexpected = sorted(k for k in sd if k not in model_keys)
    missing = sorted(k for k in model_keys - set(sd) if not k.startswith('pe.') and not k.startswith('head.'))
    if unexpected or missing:
        raise ValueError(
            'checkpoint does not match this architecture (other depth, width or layout?): '
            f'unexpected keys {unexpected[:8]}{"..." if len(unexpected) > 8 else ""}, '
            f'missing keys {missing[:8]}{"..." if len(missing) > 8 else ""}')
    initialized = sorted(k for k in model_keys if k.startswith(('pe.', 'head.')) and k not in sd)
    report = LoadReport(dropped=dropped, initialized=initialized, resampled=resampled)
    model.pretrained_report = report
    _logger.info('vispe: loaded timm checkpoint into pe=%s: %s', model.pe.name, report)
    return sd


def load_timm_checkpoint(model: nn.Module, checkpoint: Union[str, Dict[str, torch.Tensor]]) -> LoadReport:
    """Load a timm ViT checkpoint (path or state dict) into ``model``; returns what was dropped / initialised.

    The classifier is kept when its shape matches and left initialised (and reported) otherwise;
    see `checkpoint_filter_fn`.
    """
    if isinstance(checkpoint, str):
        from timm.models import load_state_dict
        checkpoint = load_state_dict(checkpoint)
    # the filter checked that the model's keys absent here are exactly the report's initialised ones
    model.load_state_dict(checkpoint_filter_fn(dict(checkpoint), model), strict=False)
    return model.pretrained_report


def adopt_own_weights(model: nn.Module, pe: PositionalEncoding, loaded_grid: Optional[Tuple[int, ...]] = None
           ) -> Tuple[Dict[str, torch.Tensor], LoadReport]:
    """What of a timm model's own position weights (its ``pos_embed``, an Eva's ``rope``) the encoding
    ``pe`` takes over, and the report; a table the loader resampled from ``loaded_grid`` counts as
    resampled."""
    entries: Dict[str, torch.Tensor] = {}
    dropped: List[str] = []
    resampled: List[str] = []
    table = model.pos_embed
    if table is not None:
        found, resampled = adopt_pos_embed(pe, table.detach(), model.num_prefix_tokens,
                                           grid=tuple(model.patch_embed.grid_size),
                                           embed_prefix=not model.no_embed_class, prefix='')
        entries.update(found)
        if not found:
            dropped.append('pos_embed')
        elif loaded_grid is not None and tuple(loaded_grid) != tuple(model.patch_embed.grid_size):
            resampled = sorted(set(resampled) | set(found))
    rope = getattr(model, 'rope', None)
    if rope is not None:
        taken = pe.adopt_timm_rope(rope)
        entries.update(taken)
        rope_keys = [f'rope.{k}' for k in rope.state_dict()]
        if not taken:
            dropped += rope_keys
    initialized = sorted(f'pe.{k}' for k in pe.state_dict() if k not in entries)
    return entries, LoadReport(dropped=dropped, initialized=initialized, resampled=[f'pe.{k}' for k in resampled])
