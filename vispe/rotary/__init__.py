"""The rotary core of vispe: every rotation encoding (RoPE-ViT, LieRE, ComRoPE, STRING, GTA, PRoPE)
and the multimodal rotary of LLM code build and apply their rotations here, one job per module:

* `frequencies`: geometric frequency tables and their scaling for longer inputs (a table of named
  scaling functions, `FREQUENCY_SCALING`);
* `kernels`: the reference rotations (complex pair tables in both pair layouts, ``b x b`` blocks,
  FFT blocks, Cayley-STRING's mixed pairs) and identity rows for prefix tokens;
* `autograd`: the dispatch (`rotate_qk`, `apply_rotation`): fused Triton kernels (`fused`) on CUDA,
  each kind once it has agreed with the reference there (`trust`, `fused_report`), a backward that
  keeps only the rotated output, q and k rotated in one call;
* `expm`: matrix exponentials of skew-symmetric generators (LieRE, ComRoPE);
* `base`: `RotationPE`, the one base class of the rotary encodings.

Angles and matrices are applied in float32 (float64 stays float64), results cast back to the
activation dtype.
"""
from .autograd import apply_rotation, fused_mode, fused_report, rotate_qk, set_fused
from .base import RotationPE, RotationState
from .frequencies import FREQUENCY_SCALING, axial_frequencies, riflex_frequencies, scale_frequencies
from .kernels import apply_pair_rotation, rotation_table

__all__ = [
    'RotationPE', 'RotationState', 'rotate_qk', 'set_fused', 'fused_mode', 'fused_report', 'apply_rotation',
    'apply_pair_rotation', 'rotation_table', 'axial_frequencies', 'scale_frequencies', 'riflex_frequencies',
    'FREQUENCY_SCALING',
]
