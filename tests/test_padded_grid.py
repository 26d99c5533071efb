"""Padded canvas batches repacked as per-sample grids (`vispe.positions.pack_padded_grid`)."""
import pytest
import torch

import vispe
from vispe.positions import pack_padded_grid, unpadded_extents


def _canvas(extents, shape):
    pad = torch.ones(len(extents), *shape, dtype=torch.bool)
    for b, (h, w) in enumerate(extents):
        pad[b, :h, :w] = False
    return pad


def test_packing_puts_each_image_first_in_its_own_raster_order():
    extents, shape = [(2, 3), (3, 1), (3, 4)], (3, 4)
    pad = _canvas(extents, shape)
    packed = pack_padded_grid(vispe.grid(*shape).replace(key_padding_mask=pad.flatten(1)))
    assert packed.positions.grids == tuple(extents)
    rows, cols = torch.meshgrid(torch.arange(3), torch.arange(4), indexing='ij')
    canvas_coords = torch.stack([rows, cols], -1).flatten(0, 1).float().expand(3, -1, -1)
    coords = packed.pack(canvas_coords)
    for b, (h, w) in enumerate(extents):
        n = h * w
        # the packed real tokens are the image's own grid, and they sit where the image put them
        assert torch.equal(coords[b, :n], vispe.grid(h, w).coords)
        assert torch.equal(packed.positions.coords[b, :n], vispe.grid(h, w).coords)
        assert not packed.positions.key_padding_mask[b, :n].any() and packed.positions.key_padding_mask[b, n:].all()


def test_unpack_inverts_pack_along_any_token_dim():
    pad = _canvas([(1, 2), (2, 2)], (2, 3))
    packed = pack_padded_grid(vispe.grid(2, 3).replace(key_padding_mask=pad.flatten(1)))
    x = torch.randn(2, 6, 5)
    heads = torch.randn(2, 4, 6, 8)
    assert torch.equal(packed.unpack(packed.pack(x)), x)
    assert torch.equal(packed.unpack(packed.pack(heads, dim=2), dim=2), heads)
    with pytest.raises(ValueError, match='expected 6 tokens along dim 1'):
        packed.pack(torch.randn(2, 5, 3))


def test_nothing_to_repack_without_padding():
    assert pack_padded_grid(vispe.grid(2, 3)) is None
    assert pack_padded_grid(vispe.grid(2, 3).replace(key_padding_mask=torch.zeros(4, 6, dtype=torch.bool))) is None


def test_masks_that_are_not_bottom_right_padding_are_refused():
    with pytest.raises(ValueError, match=r'\(B, H, W\) bool tensor'):
        unpadded_extents(torch.zeros(2, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match=r'\(B, H, W\) bool tensor'):
        unpadded_extents(torch.zeros(1, 2, 3))
    pad = _canvas([(2, 3), (1, 2)], (2, 3))
    pad[1, 1, 0] = False  # an L-shaped image
    with pytest.raises(ValueError, match='bottom and right'):
        unpadded_extents(pad)
    with pytest.raises(ValueError, match=r'images \[1\] of the batch are all padding'):
        unpadded_extents(_canvas([(2, 3), (0, 0)], (2, 3)))
    assert unpadded_extents(_canvas([(2, 3), (1, 2)], (2, 3))) == ((2, 3), (1, 2))
