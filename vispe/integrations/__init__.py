"""Adapters that put vispe's encodings into models of other libraries, one model instance at a time.

Every adapter goes through one mechanism (`vispe.integrations.base`): it imports its library lazily and
checks the version (`vispe.extras.SUPPORTED`), patches one instance, refuses a second patch anywhere in
the same module tree, and returns a `ModelPatch` handle whose ``remove()`` restores the instance exactly.
A patched model deep-copies and pickles. ``pe=None`` is the model's own encoding, computed by vispe;
``'none'`` is the NoPE baseline.

* `patch_vlm` (`vispe.integrations.transformers_vlm`): the multimodal RoPE of transformers' Qwen2-VL,
  Qwen2.5-VL and Qwen3-VL (and Qwen3-VL-MoE) models, and with ``vision_pe=`` their vision tower's too.
* `patch_detr` (`vispe.integrations.transformers_detr`): any encoding in transformers' DETR, Conditional
  DETR, Deformable DETR and RT-DETR (v1, v2) models, each padded image at its own grid's positions.
* `patch_vision` (`vispe.integrations.transformers_vision`): any encoding in transformers' vision encoders
  (ViT, DeiT, DINOv2, DINOv3-ViT, SigLIP, SigLIP 2 (NaFlex), CLIP, Idefics3 / SmolVLM, the Qwen2 / 2.5 / 3-VL
  towers, Pixtral, InternVL) and video encoders (VideoMAE), alone or inside a model that holds one (a
  classifier, CLIP / SigLIP, a Qwen-VL, LLaVA, PaliGemma, InternVL or Mistral3 model).
* `patch_dit` (`vispe.integrations.diffusers`): diffusers' FLUX, SD3, QwenImage, Wan, HunyuanVideo and
  LTX-Video transformers: their own encoding computed by vispe (with training-free frequency scaling for
  larger grids and longer videos) or any vispe rotary / additive encoding.
* `use_pe` (`vispe.integrations.open_clip`): any encoding in an open_clip CLIP model's timm image tower.
"""
from .base import AlreadyPatchedError, ModelPatch, UnsupportedModelError, find_patch
from .diffusers import DiTPatch, patch_dit
from .open_clip import OpenClipPE, use_pe
from .transformers_detr import DetrPatch, patch_detr
from .transformers_vision import VisionPatch, patch_vision
from .transformers_vlm import SUPPORTED_MODEL_TYPES, SUPPORTED_TRANSFORMERS, VLMPatch, patch_vlm

__all__ = ['ModelPatch', 'AlreadyPatchedError', 'UnsupportedModelError', 'find_patch',
           'patch_vlm', 'VLMPatch', 'patch_detr', 'DetrPatch', 'patch_vision', 'VisionPatch', 'patch_dit', 'DiTPatch',
           'use_pe', 'OpenClipPE',
           'SUPPORTED_MODEL_TYPES', 'SUPPORTED_TRANSFORMERS']
