"""Diffusion transformers of diffusers with vispe's positions: `patch_dit`.

``patch_dit(pipe.transformer)`` puts vispe's computation of the host's own encoding in place of the
transformer's position module (FLUX's ``pos_embed``, QwenImage's ``pos_embed``, the ``rope`` of Wan,
HunyuanVideo and LTX-Video, SD3's sin-cos table), equal to the unpatched transformer and open to training-free frequency
scaling for larger grids and longer videos (``scaling='yarn'``, ``'ntk'``, ``'linear'``, ``'riflex'``, per
axis, optionally scheduled over the denoising steps); ``patch_dit(transformer, 'liere')`` gives it any vispe
rotary or additive encoding to fine-tune. One instance at a time; ``handle.remove()`` restores it bit for bit.

Per forward, the host's own argument carries the positions to every block and attention processor
(``image_rotary_emb`` / ``rotary_emb``; SD3: ``joint_attention_kwargs``): the replaced position module
returns what the host's processors expect, or a `DiTState` that vispe's processors (set per attention
instance, recorded by the handle) apply through `vispe.pe_attention`. Only the denoising step's noise level,
which diffusers hands to no position module, is read by a forward pre-hook on the transformer, for a
scaling schedule, and held on the position module for that forward.
"""
from .flux import REFERENCE_LAYOUTS, kontext_ids
from .patch import HOSTS, SUPPORTED_DIFFUSERS, DiTPatch, patch_dit
from .qwenimage import TEXT_LAYOUTS
from .scaling import AxisScaling, DiTScaling
from .state import DiTState

__all__ = ['patch_dit', 'DiTPatch', 'DiTState', 'AxisScaling', 'DiTScaling', 'kontext_ids', 'HOSTS',
           'REFERENCE_LAYOUTS', 'TEXT_LAYOUTS', 'SUPPORTED_DIFFUSERS']
