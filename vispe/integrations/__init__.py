"""Adapters that put vispe's encodings into models of other libraries, one model instance at a time.

Each adapter imports its library lazily (``import vispe`` never needs it), patches one instance, and
returns a handle whose ``remove()`` restores that instance exactly.

* `patch_vlm` (`vispe.integrations.transformers_vlm`): the multimodal RoPE of transformers' Qwen2-VL,
  Qwen2.5-VL and Qwen3-VL (and Qwen3-VL-MoE) models.
* `patch_detr` (`vispe.integrations.transformers_detr`): any encoding in transformers' DETR, Conditional
  DETR, Deformable DETR and RT-DETR (v1, v2) models, each padded image at its own grid's positions.
* `use_pe` (`vispe.integrations.open_clip`): any encoding in an open_clip CLIP model's timm image tower.
"""
from .transformers_detr import DetrPatch, patch_detr
from .transformers_vlm import SUPPORTED_MODEL_TYPES, SUPPORTED_TRANSFORMERS, VLMPatch, patch_vlm

__all__ = ['patch_vlm', 'VLMPatch', 'patch_detr', 'DetrPatch', 'SUPPORTED_MODEL_TYPES', 'SUPPORTED_TRANSFORMERS']
