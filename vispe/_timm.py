"""timm's internals, in one place: what vispe takes from timm's private modules (``timm.models._*``,
underscore names such as ``_apply_coord_augs``, the registry's entrypoint table) and the check of the
supported timm versions.

Private names move between timm releases; every other vispe module imports them from here, so a new
timm release is adapted to in one file (tests/test_timm_seam.py checks that no other module imports a
private name). Public names (``timm.layers``, the model classes and checkpoint filters of
``timm.models.<model>``) are imported where they are used; the forwards vispe copies from them are
checked against the installed timm by tests/test_drift.py. Importing this module checks the installed
timm against `SUPPORTED` (`vispe.extras.check_version`).
"""
from __future__ import annotations

import timm

from .extras import SUPPORTED as _SUPPORTED, check_version as _check_version

SUPPORTED = _SUPPORTED['timm']
"""The timm versions vispe supports: ``SUPPORTED[0] <= version < SUPPORTED[1]`` (the lowest is tested in CI)."""


def check_version(version: str = timm.__version__) -> None:
    """Raise `vispe.extras.UnsupportedVersionError` (an ImportError) naming the supported range when
    ``version`` (default: the installed timm) is outside it."""
    _check_version('timm', version, 'vispe')


check_version()

# the imports below are the private names (or names timm's top level does not export) vispe uses
from timm.data.naflex_transforms import get_image_size_for_seq, patchify_image  # noqa: E402
from timm.layers.pos_embed_sincos import (  # noqa: E402
    RotaryEmbeddingCat, RotaryEmbeddingDinoV3, RotaryEmbeddingMixed, RotaryEmbeddingMRope, _apply_coord_augs,
    freq_bands, init_random_2d_freqs,
)
from timm.models import _registry  # noqa: E402
from timm.models._builder import build_model_with_cfg, load_pretrained, pretrained_cfg_for_features  # noqa: E402
from timm.models._features import FeatureGetterNet, feature_take_indices  # noqa: E402
from timm.models._manipulate import checkpoint  # noqa: E402
from timm.models.naflexvit import create_attention_mask, global_pool_naflex  # noqa: E402

__all__ = [
    'SUPPORTED', 'check_version', 'model_entrypoints', 'apply_coord_augs',
    'RotaryEmbeddingCat', 'RotaryEmbeddingDinoV3', 'RotaryEmbeddingMixed', 'RotaryEmbeddingMRope', 'freq_bands',
    'init_random_2d_freqs', 'build_model_with_cfg', 'load_pretrained', 'pretrained_cfg_for_features',
    'FeatureGetterNet', 'feature_take_indices', 'checkpoint', 'create_attention_mask', 'global_pool_naflex',
    'get_image_size_for_seq', 'patchify_image',
]

apply_coord_augs = _apply_coord_augs


def model_entrypoints() -> dict:
    """timm's registry of model entrypoints (name -> function): timm has no public call that replaces one."""
    return _registry._model_entrypoints
