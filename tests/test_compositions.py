"""Every composition of two image encodings trains: forward, backward, finite gradients, and an eval
forward on a larger non-square input. The default run tries each unordered pair once; `-m slow`
tries both orders. A composition may also be refused at construction with an error that says why."""
import itertools

import pytest
import timm
import torch

from conftest import TINY, image_pes

PES = [p for p in image_pes() if p != 'none']


def _trains_or_is_refused(spec: str) -> None:
    try:
        model = timm.create_model('vit_tiny', pe=spec, **TINY)
    except ValueError as e:  # a refusal must say which encodings and why, not a bare shape
        assert '+' in str(e) or any(p in str(e) for p in spec.split('+')), str(e)
        return
    out = model(torch.randn(2, 3, 32, 32))
    out.square().mean().backward()
    assert torch.isfinite(out).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 48, 40))).all()


@pytest.mark.parametrize('a,b', list(itertools.combinations(PES, 2)))
def test_every_pair_of_encodings_trains(a, b):
    _trains_or_is_refused(f'{a}+{b}')


@pytest.mark.slow
@pytest.mark.parametrize('a,b', [(b, a) for a, b in itertools.combinations(PES, 2)])
def test_every_pair_of_encodings_trains_in_the_other_order_too(a, b):
    _trains_or_is_refused(f'{a}+{b}')


@pytest.mark.parametrize('other', ['irpe', 'swin_rpb', 'string_cayley', 'string_circulant', 'rope_axial', 'gta'])
@pytest.mark.parametrize('widening', ['pape', 'pape_ri'])
def test_a_widening_encoding_composes_the_same_in_either_order(widening, other):
    """PaPE appends position channels to q, k and v; the other encoding's q/k map, bias and value map
    act on the head's own channels whichever side of the '+' PaPE is written."""
    first = timm.create_model('vit_tiny', pe=f'{widening}+{other}', **TINY).eval()
    second = timm.create_model('vit_tiny', pe=f'{other}+{widening}', **TINY).eval()
    for p in first.pe.parameters():  # iRPE's tables start at zero: make them matter
        torch.nn.init.normal_(p, std=0.3)
    swapped = {k.replace('encodings.0.', 'encodings.#.').replace('encodings.1.', 'encodings.0.')
               .replace('encodings.#.', 'encodings.1.'): v for k, v in first.state_dict().items()}
    second.load_state_dict(swapped)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(first(x), second(x), atol=1e-5, rtol=1e-5)
