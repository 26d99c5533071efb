"""A compiled eval forward takes a costly encoding's state (LieRE's and ComRoPE's exponentials) from
the eager cache, as eager does, instead of rebuilding it in every run of the graph; and that cache
follows what the state depends on: parameters changed in place, parameters swapped in by
`torch.func.functional_call`, new input sizes. torch.export keeps the build in the program.
"""
import copy

import pytest
import timm
import torch

from conftest import TINY

CACHED = ['liere', 'comrope_ap:block=4', 'comrope_ld:block=4']


def _vit(spec: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model('vit_tiny', pe=spec, **TINY).eval()
    with torch.no_grad():
        for p in model.pe.parameters():
            p.normal_(std=0.3)  # a wrong state (another layer's, stale parameters) shows in the logits
    return model


def _images(size=(32, 32)) -> torch.Tensor:
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize('spec', CACHED)
def test_a_compiled_eval_forward_keeps_its_state_between_runs(spec):
    torch._dynamo.reset()
    model = _vit(spec)
    twin = copy.deepcopy(model)  # eager reference with its own cache
    compiled = torch.compile(model, fullgraph=True)
    x = _images()
    with torch.no_grad():
        out = compiled(x)
        assert len(model.pe._state_cache) == 1  # filled by the graph's run, not while it was traced
        state = model.pe._state_cache[-1][-1]
        torch.testing.assert_close(out, twin(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled(x), out, atol=0, rtol=0)
        assert model.pe._state_cache[-1][-1] is state  # the second run built nothing


def test_a_parameter_changed_in_place_reaches_the_compiled_graph():
    torch._dynamo.reset()
    model = _vit('liere')
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    x = _images()
    with torch.no_grad():
        before = compiled(x)
        model.pe.generators.add_(1.0)
        after = compiled(x)
        expected = copy.deepcopy(model)(x)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(after, before, atol=1e-5, rtol=1e-5)  # the stale state would give these


@pytest.mark.parametrize('compile', [False, True], ids=['eager', 'compiled'])
def test_parameters_swapped_in_by_functional_call_are_used(compile):
    torch._dynamo.reset()
    # the same tensor versions (a cache keyed on versions alone would take the swapped ones for its own)
    model, other = _vit('liere'), _vit('liere', seed=1)
    run = torch.compile(model, fullgraph=True, backend='aot_eager') if compile else model
    x = _images()
    with torch.no_grad():
        own = run(x)  # fills the cache with the model's own rotations
        swapped = torch.func.functional_call(run, dict(other.named_parameters()), (x,))
        again = run(x)
        torch.testing.assert_close(swapped, other(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, own, atol=0, rtol=0)


def test_new_sizes_in_one_dynamic_graph_get_their_own_state():
    torch._dynamo.reset()
    model = _vit('liere')
    twin = copy.deepcopy(model)
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend='aot_eager')
    with torch.no_grad():
        for size in ((48, 32), (32, 32), (48, 64), (32, 32)):
            x = _images(size)
            torch.testing.assert_close(compiled(x), twin(x), atol=1e-5, rtol=1e-5)


def test_an_exported_program_builds_the_state_itself():
    model = _vit('liere')
    x = _images()
    with torch.no_grad():
        program = torch.export.export(model, (x,))
        targets = {str(n.target) for n in program.graph.nodes if n.op == 'call_function'}
        assert not any('cached_state' in t for t in targets)
        torch.testing.assert_close(program.module()(x), model(x), atol=1e-5, rtol=1e-5)
