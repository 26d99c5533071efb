"""The docs' "your own model" page (docs/own-model.md, once the README's section) runs as written,
and its host gives what the hooks promise."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import vispe

PAGE = Path(__file__).resolve().parents[1] / 'docs' / 'own-model.md'


def _section_blocks() -> list:
    # the host and the capability check; the page's example encoding (registered by name) comes after
    text = PAGE.read_text()
    return re.findall(r'```python\n(.*?)```', text[:text.index('## Writing an encoding')], re.S)


@pytest.fixture(scope='module')
def readme_namespace():
    namespace: dict = {}
    blocks = _section_blocks()
    assert len(blocks) >= 3, 'the page lost its examples'
    for block in blocks:
        exec(compile(block, str(PAGE), 'exec'), namespace)
    return namespace


def test_the_readme_host_runs_at_two_resolutions(readme_namespace):
    model = readme_namespace['TinyViT']('rope_mixed')
    assert model(torch.randn(1, 3, 32, 48)).shape == (1, 64)
    assert model(torch.randn(1, 3, 64, 40)).shape == (1, 64)


def test_prepared_hooks_equal_the_encoding_hooks_with_the_state():
    # fast path (pe_attention on the prepared object) = slow path (hooks called by hand, then SDPA)
    torch.manual_seed(0)
    pe = vispe.create_pe('rope_mixed', dim=64, num_heads=4, depth=2)
    prepared = pe.prepare(vispe.grid(3, 4))
    q, k, v = torch.randn(3, 2, 4, 12, 16).unbind(0)
    qr, kr = pe.qk(q, k, prepared.state, 1)
    torch.testing.assert_close(vispe.pe_attention(q, k, v, prepared, 1), F.scaled_dot_product_attention(qr, kr, v))
    assert not torch.allclose(qr, q)

