"""Token dropping (patch dropout) keeps every kept token's position: attention over the kept tokens equals
attention over the whole sequence with the dropped keys masked, at the kept queries.

`Positions.select` turns a grid (or a NaFlex batch's grids) into a point set of the kept tokens' indices
and keeps the grid(s) they index (`Positions.selected_from`), so conventions that rescale indices by
their grid (normalised coordinates, LieRE's linspace, scaled RoPE frequencies, PaPE's axis order) give
the kept tokens what they had in the full image, also at a grid other than the training grid and for
each sample of a mixed-size batch. Before, the kept tokens fell back to the training grid (or to raw
indices).
"""
import pytest
import torch

import vispe
from conftest import image_pes
from vispe.registry import create_pe

TRAIN = (4, 4)
DIM, HEADS = 64, 4
IN_ATTENTION = {'qk', 'bias', 'value', 'output'}
# every image encoding acting in attention, plus the options that rescale positions by their grid
VARIANTS = ['rope_axial:grid_mode=normalized', 'rope_axial:scaling=yarn', 'rope_axial:scaling=ntk',
            'rope_axial:scaling=riflex', 'rope2d:scaling=riflex',
            'rope_mixed:scaling=linear', 'rope_timm:rope_type=dinov3', 'liere:positions=normalized',
            'liere:positions=index', 'liere:block=2', 'comrope_ap:block=4', 'comrope_ld:normalize=grid',
            'gta:grid_mode=normalized', 'irpe:method=euclidean', 'alibi2d:grid_mode=normalized',
            'pape:grid_mode=normalized', 'rope_golden:grid_mode=index', 'rope_spiral:corners=clamp']
SPECS = [p for p in image_pes() if create_pe(p, dim=DIM, num_heads=HEADS, depth=2, grid_size=TRAIN,
                                               num_prefix_tokens=1).capabilities.hooks & IN_ATTENTION] + VARIANTS


def _pe(spec: str) -> vispe.PositionalEncoding:
    torch.manual_seed(0)
    pe = create_pe(spec, dim=DIM, num_heads=HEADS, depth=2, grid_size=TRAIN, num_prefix_tokens=1)
    with torch.no_grad():
        for p in pe.parameters():  # zero-initialised tables (iRPE) would hide a wrong bucket
            p.add_(0.2 * torch.randn_like(p))
    return pe.eval()  # no training jitter: the same rotations with and without dropping


def _attention(pe, pos, q, k, v, x, dropped=None):
    """Attention with every hook, the padded (and ``dropped``) keys masked, prefix keys always attended."""
    pad = pos.key_padding_mask
    if dropped is not None:
        pad = dropped if pad is None else pad | dropped
    mask = None
    if pad is not None:
        mask = ~torch.cat([torch.zeros(len(x), pos.num_prefix, dtype=torch.bool), pad], 1)[:, None, None, :]
    with torch.no_grad():
        return vispe.pe_attention(q, k, v, pe.prepare(pos), layer=1, x=x, attn_mask=mask)


def _tolerance(spec: str) -> float:
    # LieRE's and ComRoPE's squaring counts follow the positions present: float32 rounding of another chain
    return 5e-5 if spec.startswith(('liere', 'comrope')) else 2e-5


def _max_error(pe, pos, real, keep_count, seed=0):
    """Largest difference at the kept queries between attention over the kept tokens (``pos.select``) and
    over all tokens with the others masked. ``real``: (B, N) which tokens may be kept (not padding)."""
    g = torch.Generator().manual_seed(seed)
    B, N = real.shape
    T = pos.num_prefix + N
    q, k, v = (torch.randn(B, HEADS, T, DIM // HEADS, generator=g) for _ in range(3))
    x = torch.randn(B, T, DIM, generator=g)
    # a random subset of each sample's real tokens, in random order (timm's PatchDropout, ordered=False)
    keep = torch.stack([r.nonzero()[:, 0][torch.randperm(int(r.sum()), generator=g)[:keep_count]] for r in real])
    dropped = torch.ones(B, N, dtype=torch.bool).scatter(1, keep, False)
    full = _attention(pe, pos, q, k, v, x, dropped)
    rows = torch.cat([torch.arange(pos.num_prefix).expand(B, -1), keep + pos.num_prefix], 1)  # (B, P + K)

    def gather(t, axis):
        index = rows.view(B, *([1] * (axis - 1)), -1, *([1] * (t.dim() - axis - 1)))
        return t.gather(axis, index.expand(*t.shape[:axis], -1, *t.shape[axis + 1:]))

    kept = _attention(pe, pos.select(keep), gather(q, 2), gather(k, 2), gather(v, 2), gather(x, 1))
    return (kept - gather(full, 2)).abs().max().item()


@pytest.mark.parametrize('spec', SPECS)
@pytest.mark.parametrize('grid', [(4, 6), (3, 3)], ids=['wider', 'smaller'])
def test_kept_tokens_keep_their_positions_on_a_grid_other_than_the_training_grid(spec, grid):
    pos = vispe.positions.grid(*grid, num_prefix=1, train_grid=TRAIN)
    real = torch.ones(2, pos.coords.shape[0], dtype=torch.bool)
    assert _max_error(_pe(spec), pos, real, keep_count=5) < _tolerance(spec)


@pytest.mark.parametrize('spec', SPECS)
def test_kept_tokens_keep_their_own_grid_in_a_naflex_batch(spec):
    pos = vispe.positions.naflex_grid([(3, 5), (4, 4), (6, 2)], num_tokens=18, num_prefix=1, train_grid=TRAIN)
    assert _max_error(_pe(spec), pos, ~pos.key_padding_mask, keep_count=6) < _tolerance(spec)


def test_selection_keeps_the_grids_the_tokens_index():
    pos = vispe.positions.naflex_grid([(3, 5), (4, 4)], num_prefix=1, train_grid=TRAIN)
    kept = pos.select(torch.tensor([[0, 4], [15, 3]]))
    assert (kept.grid, kept.grids, kept.index_grid, kept.index_grids) == (None, None, None, ((3, 5), (4, 4)))
    assert kept.key_padding_mask.tolist() == [[False, False], [False, False]]
    assert kept.sample(1).index_grid == (4, 4) and kept.select(torch.tensor([[1], [0]])).index_grids == ((3, 5), (4, 4))
    plain = vispe.positions.grid(4, 6, train_grid=TRAIN).select(torch.tensor([[0, 23]]))
    assert (plain.index_grid, plain.index_grids) == ((4, 6), None)
    torch.testing.assert_close(vispe.positions.grid_coordinates(plain, 'normalized'), torch.tensor([[[0, 0], [3, 5 * 4 / 6]]]))
