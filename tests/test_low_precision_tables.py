"""An encoding converted to bfloat16 / float16 (``module.to(dtype)``) keeps its fixed tables in float32
(`PositionalEncoding.float32_buffers`): at a 96 x 96 grid, where a table rounded to the dtype puts the
far positions' phases and biases visibly off, it computes positions as the float32 encoding with the
same (rounded) learned parameters does. `benchmarks/low_precision_tables.py` prints the errors as a
table (docs/performance.md)."""
import copy

import pytest
import torch

import vispe
from benchmarks.low_precision_tables import (UNIT_ROUNDOFF, build, grid_pes, hook_inputs, relative_error, run_hooks,
                                             with_rounded_parameters)

DTYPES = [torch.bfloat16, torch.float16]
# one set of generators for every layer: the 96 x 96 exponentials once instead of once per layer
FAST = {'liere': {'per_layer': False}}
POSITION_HOOKS = ('qk', 'bias', 'value', 'output')  # maps of q, k, v and logits: any float dtype goes in
TOKEN_HOOKS = ('embed', 'between_blocks')  # learned layers on the tokens: the tokens' dtype goes in


@pytest.fixture(scope='module')
def inputs():
    return hook_inputs()


def converted_errors(dtype, inputs, hooks, feed):
    """name -> {hook: relative error} of every grid encoding converted to ``dtype`` against the float32
    encoding with its parameters rounded alike, both given ``inputs`` rounded to ``dtype`` as ``feed``."""
    errors = {}
    for name in grid_pes():
        pe = build(name, FAST.get(name))
        got = run_hooks(copy.deepcopy(pe).to(dtype), inputs, dtype, feed or dtype, hooks)
        want = run_hooks(with_rounded_parameters(pe, dtype), inputs, dtype, torch.float32, hooks)
        if got:
            errors[name] = {hook: relative_error(got[hook], want[hook]) for hook in got}
    return errors


@pytest.mark.parametrize('dtype', DTYPES, ids=['bf16', 'fp16'])
def test_converted_encodings_rotate_and_bias_float32_inputs_as_in_float32(dtype, inputs):
    """Rotations, biases and value / output maps: computed from positions alone, so a converted encoding
    given float32 q, k, v gives the float32 encoding's result (the same rounded parameters)."""
    errors = converted_errors(dtype, inputs, POSITION_HOOKS, torch.float32)
    assert {'rope_golden', 'lookhere', 'rope_axial', 'alibi2d'} <= set(errors)
    off = {name: e for name, e in errors.items() if max(e.values()) > 1e-6}
    assert not off, off


@pytest.mark.parametrize('dtype', DTYPES, ids=['bf16', 'fp16'])
def test_converted_encodings_embed_within_two_roundings_of_float32(dtype, inputs):
    """Additive and conv encodings: tokens in the dtype, the position part computed in float32, so the
    result is within two roundings to the dtype (the embedding's and the sum's) of the float32 one."""
    errors = converted_errors(dtype, inputs, TOKEN_HOOKS, None)
    assert {'fourier_gaussian', 'sincos', 'learned', 'peg'} <= set(errors)
    off = {name: e for name, e in errors.items() if max(e.values()) > 2 * UNIT_ROUNDOFF[dtype]}
    assert not off, off


def test_declared_tables_stay_float32_under_half_casts_and_follow_float64():
    pe = vispe.create_pe('rope_golden+lookhere', dim=64, num_heads=4, depth=2, grid_size=(4, 4))
    golden, lookhere = pe.encodings
    freqs = golden.freqs.clone()
    pe.to(torch.bfloat16)
    assert golden.freqs.dtype == torch.float32 and torch.equal(golden.freqs, freqs)
    assert {b.dtype for b in lookhere.buffers()} == {torch.float32}
    pe.half()
    assert golden.freqs.dtype == torch.float32 and torch.equal(golden.freqs, freqs)
    pe.double()  # float64 exactness checks keep working: a float64 table is at least float32
    assert golden.freqs.dtype == torch.float64 and torch.equal(golden.freqs, freqs.double())
    # a submodule's buffer, named with a dot, and a saved (persistent) one
    gauss = vispe.create_pe('fourier_gaussian', dim=64, num_heads=4, grid_size=(4, 4)).to(torch.bfloat16)
    assert gauss.encoder.B.dtype == torch.float32 and gauss.proj.weight.dtype == torch.bfloat16
    assert gauss.state_dict()['encoder.B'].dtype == torch.float32
