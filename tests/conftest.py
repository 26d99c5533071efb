"""Shared fixtures: tiny model sizes and the encodings a plain image ViT can host."""
import pytest
import torch

import vispe

# a ViT small enough for every contract test to run in well under a second
TINY = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8, num_classes=5)


def image_pes():
    """Registered encodings that need nothing beyond the token grid (no cameras, no padding masks)."""
    return [p for p in vispe.list_pes() if not vispe.pe_info(p)['cls'].requires]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
