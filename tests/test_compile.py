"""torch.compile(fullgraph=True): every image encoding compiles without a graph break, in eval and in a
train step, and gives eager's numbers; dynamic shapes take new input sizes without recompiling.

The default run compiles a representative handful (one per mechanism) with the inductor backend;
`-m slow` compiles every registered image encoding and the README's compositions."""
import pytest
import timm
import torch

from conftest import TINY, image_pes

# one encoding per mechanism: a table added to the tokens, a pair rotation, a learned block
# rotation, a logit bias, a conv between blocks, a q/k/v/output map, a widening q/k map
REPRESENTATIVE = ['learned', 'rope_axial', 'liere', 'irpe', 'peg', 'gta', 'pape_ri']
COMPOSITIONS = ['rope_mixed+learned', 'irpe+learned', 'sincos+rope_axial', 'detr_sine+irpe']
ALL = [p for p in image_pes()] + COMPOSITIONS


def _model(spec: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny', pe=spec, **TINY)
    for p in model.pe.parameters():  # zero-initialised tables (iRPE) would hide a wrong path
        torch.nn.init.normal_(p, std=0.2)
    return model


def _eval_matches_eager(spec: str) -> None:
    torch._dynamo.reset()
    model = _model(spec).eval()
    compiled = torch.compile(model, fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)  # the eval cache, warm


def _train_step_matches_eager(spec: str) -> None:
    torch._dynamo.reset()
    eager, other = _model(spec), _model(spec)
    compiled = torch.compile(other, fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    torch.manual_seed(1)  # the same training jitter (ComRoPE) in both: inductor draws with torch's RNG
    eager(x).square().mean().backward()
    torch.manual_seed(1)
    with torch._inductor.config.patch(fallback_random=True):
        compiled(x).square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), other.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize('spec', REPRESENTATIVE)
def test_compiled_eval_equals_eager(spec):
    _eval_matches_eager(spec)


@pytest.mark.parametrize('spec', ['rope_axial', 'irpe'])
def test_compiled_train_step_equals_eager(spec):
    _train_step_matches_eager(spec)


def test_dynamic_shapes_take_new_sizes_without_recompiling():
    """After the first dynamic compile, more input sizes reuse the graph (frame count stays)."""
    torch._dynamo.reset()
    model = _model('rope_axial').eval()
    counts = []

    def backend(gm, example_inputs):
        counts.append(1)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    with torch.no_grad():
        for size in (32, 48, 64, 40):
            x = torch.randn(1, 3, size, size + 8)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert len(counts) == 1, f'{len(counts)} compilations for 4 input sizes'


@pytest.mark.slow
@pytest.mark.parametrize('spec', ALL)
def test_every_encoding_compiles_in_eval(spec):
    _eval_matches_eager(spec)


@pytest.mark.slow
@pytest.mark.parametrize('spec', ALL)
def test_every_encoding_compiles_in_a_train_step(spec):
    _train_step_matches_eager(spec)
