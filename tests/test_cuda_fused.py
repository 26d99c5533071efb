"""On a GPU, the compiled fused rotations (`vispe.rotary.fused`) against the reference kernels for every
kernel kind, in float32 and bfloat16, forward and gradients, on the odd shapes users meet (head dims 64,
72, 80, 128, prefix tokens, non-square grids, partial rotary, per-sample NaFlex tables): each fused
error against the float64 truth is at most a few times the reference's in the same dtype
(`benchmarks/fused_numerics.py`, which prints the same cases as a table). The interpreter tests of
`test_triton_rotary.py` check the same kernels on the CPU; these run only where CUDA is (marker
``cuda``), since only there are the kernels compiled."""
import pytest
import torch

from benchmarks.fused_numerics import CASES, DTYPES, measure, within_bound

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize('dtype', list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize('case', CASES, ids=[c.name.replace(' ', '_') for c in CASES])
def test_fused_rotation_matches_reference_on_cuda(case, dtype):
    errors = measure(case, DTYPES[dtype], torch.device('cuda'))
    assert errors['launches'] >= 2, 'the fused kernels did not run forward and backward'
    assert within_bound(errors, DTYPES[dtype]), errors
