"""Native-resolution (NaFlex) batches for the rotary encodings: in a batch of samples with different
grids, padded to a common token count, each sample gets exactly the rotations it gets alone."""
import math

import pytest
import torch

import vispe
from vispe.positions import grid, naflex_grid
from conftest import naflex_max_error

# (encoding, options): defaults and every grid-mode / normalisation option that reads the grid
CASES = [
    ('rope_axial', {}), ('rope_axial', {'grid_mode': 'normalized'}), ('rope_axial', {'scaling': 'linear'}),
    ('rope_axial', {'scaling': 'ntk'}), ('rope_axial', {'scaling': 'yarn'}), ('rope_axial', {'scaling': 'riflex'}),
    ('rope2d', {}), ('rope2d', {'grid_mode': 'normalized'}), ('rope2d', {'scaling': 'riflex'}),
    ('rope_mixed', {}), ('rope_mixed', {'grid_mode': 'normalized'}), ('rope_mixed', {'scaling': 'linear'}),
    ('rope_mixed', {'scaling': 'yarn'}),
    ('rope_timm', {}), ('rope_timm', {'ref_feat_shape': (4, 4)}),
    ('rope_timm', {'ref_feat_shape': (6, 3), 'grid_indexing': 'xy', 'grid_offset': 0.5}),
    ('rope_timm', {'rope_type': 'dinov3', 'rotate_half': True}),
    ('rope_timm', {'rope_type': 'dinov3', 'normalize_coords': 'max'}),
    ('rope_timm', {'rope_type': 'dinov3', 'normalize_coords': 'min', 'min_period': 0.5, 'max_period': 40.0}),
    ('rope_timm', {'rope_type': 'mixed'}), ('rope_timm', {'rope_type': 'mrope', 'rotate_half': True}),
    ('liere', {}), ('liere', {'block': 2}), ('liere', {'positions': 'index'}), ('liere', {'positions': 'normalized'}),
    ('comrope_ap', {}), ('comrope_ap', {'block': 4}), ('comrope_ap', {'normalize': 'train'}),
    ('comrope_ap', {'prefix': 'identity', 'block': 8}), ('comrope_ap', {'ape': True}),
    ('comrope_ld', {}), ('comrope_ld', {'block': 4, 'normalize': 'train'}), ('comrope_ld', {'ape': True, 'block': 4}),
    ('string_cayley', {}), ('string_cayley', {'skew_init_std': 0.1, 'grid_mode': 'normalized'}),
    ('string_circulant', {}), ('string_circulant', {'grid_mode': 'normalized', 'block': 8}),
    ('gta', {}), ('gta', {'grid_mode': 'normalized'}),
    ('rope_golden', {}), ('rope_golden', {'grid_mode': 'index', 'p_zero_freqs': 0.25}),
    ('rope_spiral', {}), ('rope_spiral', {'grid_mode': 'index', 'num_directions': 8}),
    ('rope_spiral', {'corners': 'clamp'}),
]

# (grids, prefix tokens, padded token count); training grid (4, 4)
MIXES = [
    ([(3, 5), (4, 4), (1, 7), (6, 5), (6, 5)], 1, 34),  # non-square, training grid, 1xN, larger, repeated, padded
    ([(2, 3), (7, 6), (1, 1)], 4, None),  # registers, a single token
    ([(5, 2), (3, 3)], 0, None),  # no prefix token
]

# video (t, h, w): the encodings that take three axes, with their frame-axis options; training grid (2, 4, 4)
VIDEO_CASES = [
    ('rope_axial', {}), ('rope_axial', {'scaling': 'yarn'}), ('rope_axial', {'scaling': 'riflex'}), ('rope2d', {}),
    ('rope_mixed', {'grid_mode': 'normalized'}), ('liere', {}), ('comrope_ap', {}), ('comrope_ap', {'time_scale': 'frames', 'block': 4}),
    ('comrope_ld', {'block': 4}), ('comrope_ld', {'time_scale': 'frames', 'ape': True}),
    ('string_cayley', {}), ('string_circulant', {}), ('gta', {}),
]
VIDEO_GRIDS = [(2, 3, 5), (3, 4, 4), (1, 2, 6), (4, 2, 3)]


def make(name, options, grid_size=(4, 4)):
    return vispe.create_pe(name, dim=32, num_heads=2, depth=2, grid_size=grid_size, **options).eval()


def _id(case):
    name, options = case
    return name + ''.join(f',{k}={v}' for k, v in options.items())


@pytest.mark.parametrize('mix', MIXES, ids=['mixed-padded', 'registers', 'no-prefix'])
@pytest.mark.parametrize('case', CASES, ids=[_id(c) for c in CASES])
def test_each_sample_as_alone(case, mix):
    grids, num_prefix, num_tokens = mix
    assert naflex_max_error(make(*case), grids, num_prefix=num_prefix, num_tokens=num_tokens) <= 1e-5


@pytest.mark.parametrize('case', VIDEO_CASES, ids=[_id(c) for c in VIDEO_CASES])
def test_each_video_sample_as_alone(case):
    pe = make(*case, grid_size=(2, 4, 4))
    assert naflex_max_error(pe, VIDEO_GRIDS, num_prefix=1, num_tokens=50) <= 1e-5


def _rotated(pe, pos, tensors):
    """Every rotation hook of ``pe`` (q/k, and v / output where it has them) at ``pos``."""
    q, k, v, o = tensors
    state = pe.prepare(pos)
    out = list(state.qk(q, k, layer=1))
    if 'value' in pe.hooks:
        out += [state.value(v, 1), state.output(o, 1)]
    return out, state


def _tensors(state):
    if torch.is_tensor(state):
        return [state]
    if isinstance(state, (tuple, list)):
        return [t for s in state for t in _tensors(s)]
    return []


@pytest.mark.parametrize('case', [c for c in CASES if not c[1]], ids=[_id(c) for c in CASES if not c[1]])
def test_one_grid_is_the_shared_grid_path(case):
    """A NaFlex batch whose samples all have the training grid rotates exactly as a plain batch, with
    rotations shared by the batch (no per-sample copy); padded, the same rotations with identity rows
    appended."""
    pe = make(*case)
    g = torch.Generator().manual_seed(0)
    B, n = 3, 1 + 16
    shared = grid(4, 4, num_prefix=1, train_grid=(4, 4))
    tensors = [torch.randn(B, 2, n, 16, generator=g) for _ in range(4)]
    with torch.no_grad():
        plain, state = _rotated(pe, shared, tensors)
        nf = naflex_grid([(4, 4)] * B, num_prefix=1, train_grid=(4, 4))
        for a, b in zip(plain, _rotated(pe, nf, tensors)[0]):
            assert torch.equal(a, b)
        padded = pe.prepare(naflex_grid([(4, 4)] * B, num_tokens=20, num_prefix=1, train_grid=(4, 4)))
    for a, b in zip(_tensors(state), _tensors(padded)):
        assert a.dim() == b.dim()  # no batch axis added
        axes = [d for d in range(a.dim()) if a.shape[d] != b.shape[d]]
        if axes:  # the token axis: the shared rows, then 4 padding rows
            assert axes == [axes[0]] and b.shape[axes[0]] == n + 4
            assert torch.equal(b.narrow(axes[0], 0, n), a)
        else:  # not per token (Cayley-STRING's P)
            assert torch.equal(a, b)


def test_per_sample_tables_only_for_different_grids():
    """Several grids: one table per sample ``(B, H', N, ...)``; the padding rows are the identity."""
    pe = make('rope_mixed', {})
    nf = naflex_grid([(3, 5), (2, 6)], num_tokens=20, num_prefix=1)
    with torch.no_grad():
        table = pe.prepare(nf).state.q[0]
    assert table.shape == (2, 2, 21, 8)
    assert torch.equal(table[0, :, 16:], torch.ones_like(table[0, :, 16:]))
    assert torch.equal(table[1, :, 13:], torch.ones_like(table[1, :, 13:]))


@pytest.mark.parametrize('name', ['comrope_ap', 'comrope_ld'])
def test_comrope_jitter_stays_per_sample(name):
    """In training each sample's grid positions are jittered on their own, also in a NaFlex batch (two
    samples of the same grid differ), around that sample's own grid (the jitter is under half a patch)."""
    pe = make(name, {'block': 4}).train()
    nf = naflex_grid([(3, 5), (3, 5), (2, 6)], num_prefix=1)
    coords, pad = pe.coordinates(nf, batch=3)
    assert pad == 0 and coords.shape == (3, 16, 2)
    assert not torch.equal(coords[0, 1:16], coords[1, 1:16])
    for b, (h, w) in enumerate(nf.grids):
        real = coords[b, 1:1 + h * w] * torch.tensor([h, w])  # (i + 0.5 + jitter) in patches
        assert (real - nf.coords[b, :h * w] - 0.5).abs().max() <= 0.5
        assert torch.allclose(coords[b, 0], torch.tensor([0.5, 0.5]))  # the class token at the centre
    state = pe.layer_state(pe.prepare(nf).state, 3)
    assert state.q[0].shape[:3] == (3, 2, 16)


def test_liere_training_matches_eval():
    """LieRE builds a NaFlex batch in one batched pass under autograd (each sample with its own
    squarings) and grid by grid without; both give each sample its own rotations."""
    pe = make('liere', {'positions': 'index'})
    nf = naflex_grid([(3, 5), (6, 7), (1, 9)], num_prefix=1, train_grid=(4, 4))
    with torch.no_grad():
        exact = pe.prepare(nf).state.q
    trained = pe.train().prepare(nf).state.q
    for b, shape in enumerate(nf.grids):
        n = 1 + math.prod(shape)
        for layer in range(2):
            assert (trained[layer][b, :, :n] - exact[layer][b, :, :n]).abs().max() <= 1e-4
    sum(t.sum() for t in trained).backward()
    assert pe.generators.grad is not None and torch.isfinite(pe.generators.grad).all()
