"""NaFlex batches for the additive, bias, PEG and PaPE encodings: in a batch of samples with different
grids, padded to a common token count, every sample gets exactly what it gets alone."""
import math

import pytest
import torch

import vispe
from conftest import naflex_hooks, naflex_max_error
from vispe.registry import create_pe

TOL = 1e-5  # float32 rounding: the mixed batch and the sample alone run kernels of different shapes
# PaPE folds a bias of tens of logits into extra q.k channels: in float32 a sample alone is itself
# ~1e-5 from float64 on an Nx1 grid with 4 prefix tokens (the float64 test shows the batch exact)
TOL_FP32 = {'pape': 5e-5}
TRAIN = (4, 4)
TRAIN_3D = (2, 3, 3)

# (grids, num_tokens): mixed shapes, a 1xN and an Nx1 sample, grids larger than the training grid,
# repeated grids, and extra padding beyond the largest grid
MIXES_2D = [
    ([(3, 5), (4, 4), (2, 6)], None),
    ([(1, 7), (6, 1), (4, 4), (1, 7)], 40),
    ([(6, 9), (2, 3), (5, 5)], None),
]
MIXES_3D = [
    ([(2, 3, 4), (3, 2, 2), (1, 4, 5)], None),
    ([(1, 1, 6), (2, 3, 3), (3, 4, 2)], 30),
]

# spec -> option sets (each a spec string): the defaults and every grid-mode option
CASES_2D = [
    'learned', 'learned:interpolation=bilinear', 'learned:interpolation=nearest', 'learned:antialias=false',
    'sincos', 'sincos:grid_mode=normalized', 'sincos:layout=big_vision',
    'detr_sine', 'detr_sine:normalize=false', 'detr_learned',
    'fourier_gaussian', 'fourier_gaussian:grid_range=signed',
    'fourier_learnable', 'fourier_learnable:grid_mode=normalized', 'fourier_learnable:groups=2',
    'nerf_freq', 'nerf_freq:grid_range=unit',
    'peg', 'peg:kernel_size=5',
    'irpe', 'irpe:method=cross', 'irpe:method=euclidean', 'irpe:method=quantization', 'irpe:mode=bias,on=qk',
    'irpe:on=qkv,init_std=0.5',
    'swin_rpb', 'swin_rpb:per_layer=false',
    'alibi2d', 'alibi2d:grid_mode=normalized', 'lookhere', 'lookhere:directions=lh45',
    'pape', 'pape:grid_mode=normalized', 'pape:bias_scale=qk', 'pape_ri', 'pape_ri:grid_mode=normalized',
]
CASES_3D = [
    'learned', 'learned:interpolation=nearest', 'sincos', 'sincos:grid_mode=normalized', 'fourier_gaussian',
    'fourier_learnable:grid_mode=normalized', 'nerf_freq', 'peg', 'alibi2d:grid_mode=normalized', 'pape',
    'pape_ri:grid_mode=normalized',
]


def _pe(spec, grid, num_prefix=1, embed_prefix=True):
    dim = 48 if len(grid) == 3 else 64  # sincos needs dim divisible by 2 * axes
    pe = create_pe(spec, dim=dim, num_heads=4, depth=2, grid_size=grid, num_prefix_tokens=num_prefix,
                   embed_prefix=embed_prefix)
    if 'init_std' not in spec:  # zero-initialised tables (irpe) would hide a wrong bucket
        with torch.no_grad():
            for name, p in pe.named_parameters():
                if name.startswith('table_'):
                    p.normal_()
    return pe.eval()


# every encoding with 0, 1 and 4 prefix tokens; its options (which do not touch prefix tokens) with 1
PREFIX_CASES = [(spec, n) for spec in CASES_2D for n in ((0, 1, 4) if ':' not in spec else (1,))]


@pytest.mark.parametrize('spec, num_prefix', PREFIX_CASES)
def test_each_sample_of_a_naflex_batch_gets_what_it_gets_alone(spec, num_prefix):
    pe = _pe(spec, TRAIN, num_prefix)
    tol = TOL_FP32.get(spec.split(':')[0], TOL)
    for grids, num_tokens in MIXES_2D:
        err = naflex_max_error(pe, grids, num_prefix=num_prefix, num_tokens=num_tokens)
        assert err <= tol, f'{spec} on {grids} (num_tokens={num_tokens}): {err:.3g}'


# encodings computed in the model's dtype throughout (the others compute their phases in float32)
CASES_FP64 = ['learned', 'learned:interpolation=bilinear', 'peg', 'irpe', 'irpe:method=cross,mode=bias,on=qkv',
              'swin_rpb', 'alibi2d', 'alibi2d:grid_mode=normalized', 'lookhere', 'pape', 'pape:grid_mode=normalized',
              'pape_ri']


@pytest.mark.parametrize('spec', CASES_FP64)
def test_in_float64_a_naflex_batch_is_exact(spec):
    pe = _pe(spec, TRAIN, num_prefix=4).double()
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # the harness's tokens, q, k and v
    try:
        for grids, num_tokens in MIXES_2D:
            err = naflex_max_error(pe, grids, num_prefix=4, num_tokens=num_tokens)
            assert err <= 1e-12, f'{spec} on {grids} (num_tokens={num_tokens}): {err:.3g}'
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize('spec', CASES_3D)
def test_each_sample_of_a_naflex_video_batch_gets_what_it_gets_alone(spec):
    pe = _pe(spec, TRAIN_3D)
    for grids, num_tokens in MIXES_3D:
        err = naflex_max_error(pe, grids, num_tokens=num_tokens)
        assert err <= TOL, f'{spec} on {grids} (num_tokens={num_tokens}): {err:.3g}'


@pytest.mark.parametrize('num_prefix', [1, 4])
def test_learned_without_prefix_rows_in_a_naflex_batch(num_prefix):
    pe = _pe('learned', TRAIN, num_prefix, embed_prefix=False)
    for grids, num_tokens in MIXES_2D:
        assert naflex_max_error(pe, grids, num_prefix=num_prefix, num_tokens=num_tokens) <= TOL


def test_learned_with_more_table_prefix_rows_than_prefix_tokens():
    pe = _pe('learned', TRAIN, num_prefix=4)  # rows for 4 prefix tokens; the positions have 1
    assert naflex_max_error(pe, MIXES_2D[0][0], num_prefix=1) <= TOL


def _hooks(pe, x, q, k, v, pos):
    y = pe.embed(x, pos)
    o = vispe.pe_attention(q, k, v, pe.prepare(pos), layer=0, x=y)
    return y, o, pe.between_blocks(y, pos, 0)


@pytest.mark.parametrize('spec', ['learned', 'sincos', 'sincos:grid_mode=normalized', 'detr_sine', 'detr_learned',
                                  'fourier_gaussian', 'fourier_learnable', 'nerf_freq', 'peg', 'irpe', 'swin_rpb',
                                  'alibi2d', 'lookhere', 'pape', 'pape_ri'])
def test_a_naflex_batch_at_the_training_grid_is_the_shared_grid_batch(spec):
    pe = _pe(spec, TRAIN)
    B, N, ctx = 3, 1 + math.prod(TRAIN), pe.ctx
    x = torch.randn(B, N, ctx.dim)
    q, k, v = (torch.randn(B, ctx.num_heads, N, ctx.head_dim) for _ in range(3))
    naflex = vispe.positions.naflex_grid([TRAIN] * B, num_prefix=1, train_grid=TRAIN)
    shared = vispe.grid(*TRAIN, num_prefix=1)
    with torch.no_grad():
        for a, b in zip(_hooks(pe, x, q, k, v, naflex), _hooks(pe, x, q, k, v, shared)):
            assert torch.equal(a, b)


def test_peg_padding_tokens_reach_no_real_token():
    pe = _pe('peg:kernel_size=5', TRAIN)
    grids = [(2, 3), (4, 4)]
    pos = vispe.positions.naflex_grid(grids, num_tokens=20, num_prefix=1, train_grid=TRAIN)
    x = torch.randn(2, pos.num_tokens, pe.ctx.dim)
    noisy = x.clone()
    noisy[0, 1 + 6:] = 1e6  # the padding tokens of both samples
    noisy[1, 1 + 16:] = -1e6
    with torch.no_grad():
        out, out_noisy = pe.between_blocks(x, pos, 0), pe.between_blocks(noisy, pos, 0)
    real = torch.cat([torch.zeros(2, 1, dtype=torch.bool), ~pos.key_padding_mask], 1)
    assert torch.equal(out[real], out_noisy[real])
    assert torch.equal(out_noisy[~real], noisy[~real])  # padding passes unchanged


def test_naflex_tables_are_cached_by_grids():
    pe = _pe('learned', TRAIN)
    pos = vispe.positions.naflex_grid([(3, 5), (2, 6)], num_prefix=1, train_grid=TRAIN)
    again = vispe.positions.naflex_grid([(3, 5), (2, 6)], num_prefix=1, train_grid=TRAIN)
    other = vispe.positions.naflex_grid([(2, 6), (3, 5)], num_prefix=1, train_grid=TRAIN)
    with torch.no_grad():
        table = pe.embedding(pos)
        assert pe.embedding(again) is table
        swapped = pe.embedding(other)
    assert swapped is not table and torch.equal(swapped, table.flip(0))


def _weighted_outputs(pe, x, q, k, v, pos, weights):
    """``sum(w * output)`` over the hooks' outputs (tokens after ``embed`` and ``between_blocks``,
    attention output with the padded keys masked)."""
    return sum((w * t).sum() for w, t in zip(weights, naflex_hooks(pe, x, q, k, v, pos)))


@pytest.mark.parametrize('spec', ['learned', 'peg', 'swin_rpb', 'irpe:mode=bias,on=qkv', 'pape'])
def test_naflex_gradients_are_the_sum_of_the_samples_gradients(spec):
    pe = _pe(spec, TRAIN).train()
    grids = [(3, 5), (6, 2), (3, 5)]
    pos = vispe.positions.naflex_grid(grids, num_tokens=20, num_prefix=1, train_grid=TRAIN)
    B, N, ctx = len(grids), pos.num_tokens, pe.ctx
    x = torch.randn(B, N, ctx.dim)
    q, k, v = (torch.randn(B, ctx.num_heads, N, ctx.head_dim) for _ in range(3))
    weights = [torch.randn(B, N, ctx.dim), torch.randn(B, ctx.num_heads, N, ctx.head_dim), torch.randn(B, N, ctx.dim)]
    for b, g in enumerate(grids):  # padding tokens' outputs are not read
        for w in weights:
            w[b, ..., 1 + math.prod(g):, :] = 0
    params = [p for p in pe.parameters() if p.requires_grad]
    together = torch.autograd.grad(_weighted_outputs(pe, x, q, k, v, pos, weights), params)
    alone = None
    for b, g in enumerate(grids):
        n = 1 + math.prod(g)
        loss = _weighted_outputs(pe, x[b:b + 1, :n], q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                 pos.sample(b), [w[b:b + 1, ..., :n, :] for w in weights])
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        grads = [torch.zeros_like(p) if gr is None else gr for p, gr in zip(params, grads)]
        alone = grads if alone is None else [a + gr for a, gr in zip(alone, grads)]
    for p, a, t in zip(params, alone, together):
        torch.testing.assert_close(t, a, rtol=1e-4, atol=1e-5)
