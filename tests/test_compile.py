"""torch.compile(fullgraph=True): every registered encoding compiles without a graph break, in eval and
in a train step, and gives eager's numbers; with ``dynamic=True`` new input sizes (and new camera
rigs) reuse the one graph.

The default run compiles a representative handful (one per mechanism; a train step on new sizes for
one of them) and every camera encoding on new rigs (dynamo alone); `-m slow` runs each check that
the default run makes on a subset, and the camera encodings under inductor, with every registered
image encoding, the learned block rotations, the compositions the README and the docs name and every camera encoding. Parity with eager is checked under inductor. The
dynamic-shape tests count compilations under lighter backends (dynamo alone in eval; AOT autograd
with inductor's decompositions for a train step, so the backward is traced with symbolic shapes
too): whether a size recompiles is decided by dynamo's guards, before any code is generated.

Camera encodings run in `MultiViewHost`, a small multi-view transformer whose cameras come in with
the images (`vispe.positions.multiview` positions as a forward argument), as they change from batch
to batch; a graph taking them as inputs serves every rig.
"""
import re
from pathlib import Path
from typing import Any, Callable, List, Sequence, Set, Tuple

import pytest
import timm
import torch
from torch import nn

import vispe
from conftest import TINY, image_pes, random_intrinsics, random_poses

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
DOC_PAGES = [README, *sorted((ROOT / 'docs').rglob('*.md'))]  # the README and the docs name compositions

# one encoding per mechanism: a table added to the tokens, a pair rotation, a learned block
# rotation, a logit bias, a conv between blocks, a q/k/v/output map, a widening q/k map
REPRESENTATIVE = ['learned', 'rope_axial', 'liere', 'irpe', 'peg', 'gta', 'pape_ri']
# ComRoPE's default block of 2 is a pair rotation; larger blocks take the learned-exponential path
BLOCK_ROTATIONS = ['comrope_ap:block=4', 'comrope_ld:block=4']
# the compositions of the README and the docs (`test_the_readme_compositions_are_compiled`) and the converted
# timm models' own encodings (the zoo table's learned+rope_timm:cat / :mixed)
COMPOSITIONS = ['rope_mixed+learned', 'rope_axial+learned', 'irpe+learned', 'sincos+rope_axial', 'detr_sine+irpe',
                'detr_sine+irpe:on=k', 'irpe+pape', 'pape+irpe', 'learned+rope_timm:rope_type=cat',
                'learned+rope_timm:rope_type=mixed', 'rope_golden+peg', 'learned+rope_spiral', 'detr_sine+rope_mixed',
                'learned+irpe', 'rope2d+peg', 'rope_mixed+peg']
ALL = image_pes() + BLOCK_ROTATIONS + COMPOSITIONS
CAMERA = [p for p in vispe.list_pes() if 'cameras' in vispe.pe_info(p)['cls'].requires]

# input sizes of the dynamic-shape tests: the training size (32, 32) among others; the first is not
# square, as dynamo's duck sizing would give height and width one symbol (a recompile for the next)
SIZES = ((40, 48), (32, 32), (56, 40))
# (views, image size) of the camera rigs: the first view count equals no other size of the inputs
# (batch 2, 3 channels, 4 x 4 poses), which duck sizing would tie it to
RIGS = ((5, (32, 48)), (7, (48, 32)), (6, (32, 64)))
PATCH = 16  # the multi-view host's patch size: also Plücker's default patch_size
BATCH = 2

Inputs = Tuple[Any, ...]


class CompileCounter:
    """A torch.compile backend that hands each graph on to ``backend`` and counts compilations: the
    distinct compile ids (frame, recompilation) of the graphs it gets. Dynamo restarting its analysis
    of a frame (the same id, a later attempt) is no new compilation."""

    def __init__(self, backend: str) -> None:
        self.backend = torch._dynamo.lookup_backend(backend)
        self.ids: Set[Tuple[int, int]] = set()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: List[torch.Tensor]) -> Callable:
        cid = torch._guards.CompileContext.current_compile_id()
        self.ids.add((cid.frame_id, cid.frame_compile_id))
        return self.backend(gm, example_inputs)

    @property
    def compilations(self) -> int:
        return len(self.ids)


class MultiViewHost(nn.Module):
    """A tiny multi-view transformer around a camera encoding: the class token, then the patch
    embeddings of every view; the encoding's ``embed`` (Plücker rays) and one ``prepare`` per forward;
    pre-norm residual `vispe.PEAttention` layers. ``images (B, V, 3, H, W)`` and their positions
    (`vispe.positions.multiview` of the rig, one class token) -> tokens ``(B, 1 + V h w, dim)``."""

    def __init__(self, spec: str, dim: int = 32, heads: int = 2, depth: int = 2) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, PATCH, PATCH)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.pe = vispe.create_pe(spec, dim=dim, num_heads=heads, depth=depth)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.layers = nn.ModuleList(vispe.PEAttention(dim, heads, qkv_bias=True, layer_index=i) for i in range(depth))

    def forward(self, images: torch.Tensor, pos: vispe.Positions) -> torch.Tensor:
        x = self.patch(images.flatten(0, 1)).flatten(2).transpose(1, 2)  # (B V, h w, dim)
        x = x.reshape(images.shape[0], -1, x.shape[-1])
        x = self.pe.embed(torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1), pos)
        state = self.pe.prepare(pos)
        for norm, attn in zip(self.norms, self.layers):
            x = x + attn(norm(x), pe=state)
        return x


def _randomised(model: nn.Module) -> nn.Module:
    """``model`` with its encoding's parameters drawn from N(0, 0.2): zero-initialised tables (iRPE)
    would hide a wrong path."""
    for p in model.pe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model


def _vit(spec: str) -> nn.Module:
    """The tiny timm ViT with encoding ``spec``, the same for the same spec."""
    torch.manual_seed(0)
    return _randomised(timm.create_model('vit_tiny', pe=spec, **TINY))


def _camera_host(spec: str) -> nn.Module:
    """`MultiViewHost` with camera encoding ``spec``, the same for the same spec."""
    torch.manual_seed(0)
    return _randomised(MultiViewHost(spec))


def _images(size: Tuple[int, int] = (32, 32)) -> Inputs:
    """The ViT's input: a batch of ``size`` images."""
    return (torch.randn(BATCH, 3, *size),)


def _rig(views: int, size: Tuple[int, int], seed: int) -> Inputs:
    """Images of ``views`` random cameras (float32) and their multi-view positions, a class token first."""
    g = torch.Generator().manual_seed(seed)
    cams = vispe.Cameras(random_intrinsics(views, g, size).float(), cam_to_world=random_poses(views, g).float(),
                         image_size=size)
    pos = vispe.positions.multiview(cams, (size[0] // PATCH, size[1] // PATCH), num_prefix=1)
    return torch.randn(BATCH, views, 3, *size, generator=g), pos


def _eval_matches_eager(build: Callable[[], nn.Module], inputs: Sequence[Inputs], backend: str = 'inductor',
                        dynamic: bool = False) -> int:
    """Compile ``build()`` in eval mode and check it against eager on every input, twice (a compiled
    graph's first and a later run, the eval cache of `prepare` filled by the eager forward); returns
    the number of compilations."""
    torch._dynamo.reset()
    model = build().eval()
    counter = CompileCounter(backend)
    compiled = torch.compile(model, fullgraph=True, dynamic=dynamic, backend=counter)
    with torch.no_grad():
        for args in inputs:
            expected = model(*args)
            for _ in range(2):
                torch.testing.assert_close(compiled(*args), expected, atol=1e-5, rtol=1e-5)
    return counter.compilations


def _train_step_matches_eager(build: Callable[[], nn.Module], inputs: Sequence[Inputs], backend: str = 'inductor',
                              dynamic: bool = False) -> int:
    """A forward and backward of a compiled twin of ``build()`` against eager on every input: outputs
    and every gradient; returns the number of compilations."""
    torch._dynamo.reset()
    eager, other = build(), build()
    counter = CompileCounter(backend)
    compiled = torch.compile(other, fullgraph=True, dynamic=dynamic, backend=counter)
    for args in inputs:
        eager.zero_grad(set_to_none=True)
        other.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same training jitter (ComRoPE) in both: inductor draws with torch's RNG
        expected = eager(*args)
        expected.square().mean().backward()
        torch.manual_seed(1)
        with torch._inductor.config.patch(fallback_random=True):
            out = compiled(*args)
            out.square().mean().backward()
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        for (name, a), b in zip(eager.named_parameters(), other.parameters()):
            if a.grad is not None:
                _assert_grad_close(b.grad, a.grad, name)
    return counter.compilations


def _assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, name: str) -> None:
    """Gradients are sums over the batch and the tokens, which a compiled graph may add up in another
    order: they agree to float32 rounding of their largest entry (atol 1e-5 per unit of it)."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, atol=1e-5 * scale, rtol=1e-4, msg=name)


def _dynamic_eval(build: Callable[[], nn.Module], inputs: Sequence[Inputs]) -> None:
    """Compiled with ``dynamic=True`` (dynamo alone), eval on every input equals eager, in one compilation."""
    compilations = _eval_matches_eager(build, inputs, backend='eager', dynamic=True)
    assert compilations == 1, f'{compilations} compilations for {len(inputs)} input sizes'


def _dynamic_train_step(build: Callable[[], nn.Module], inputs: Sequence[Inputs]) -> None:
    """Compiled with ``dynamic=True`` (AOT autograd, inductor's decompositions), a train step on every
    input equals eager, in one compilation."""
    compilations = _train_step_matches_eager(build, inputs, backend='aot_eager_decomp_partition', dynamic=True)
    assert compilations == 1, f'{compilations} compilations for {len(inputs)} input sizes'


def _readme_compositions() -> Set[str]:
    """The composed specs the README and the docs name (``a+b``, every part a registered encoding), canonical.
    Shorthand that is no spec (the zoo table's ``learned+rope_timm:cat``) is left out."""
    names = set(vispe.list_pes())
    found = set()
    text = ' '.join(page.read_text() for page in DOC_PAGES if page.is_file())
    for word in re.split(r"[\s'\"`|()\[\]{}]+", text):
        word = word.strip('.,;:')
        parts = word.split('+')
        if len(parts) > 1 and all(p.split(':')[0] in names for p in parts):
            try:
                found.add(vispe.format_pe_spec(word))
            except ValueError:
                continue
    return found


# ------------------------------------------------------------------ default run
@pytest.mark.parametrize('spec', REPRESENTATIVE)
def test_compiled_eval_equals_eager(spec):
    assert _eval_matches_eager(lambda: _vit(spec), [_images()]) == 1


@pytest.mark.parametrize('spec', ['rope_axial', 'irpe'])
def test_compiled_train_step_equals_eager(spec):
    assert _train_step_matches_eager(lambda: _vit(spec), [_images()]) == 1


@pytest.mark.parametrize('spec', REPRESENTATIVE)
def test_dynamic_shapes_take_new_sizes_without_recompiling(spec):
    _dynamic_eval(lambda: _vit(spec), [_images(s) for s in SIZES])


@pytest.mark.parametrize('spec', ['learned'])
def test_dynamic_train_step_takes_new_sizes_without_recompiling(spec):
    _dynamic_train_step(lambda: _vit(spec), [_images(s) for s in SIZES])


@pytest.mark.parametrize('name', CAMERA)
def test_dynamic_shapes_take_new_camera_rigs_without_recompiling(name):
    """New cameras, view counts and image sizes reuse the graph: the rig is an input, not a constant."""
    _dynamic_eval(lambda: _camera_host(name), [_rig(v, s, seed=i) for i, (v, s) in enumerate(RIGS)])


@pytest.mark.skipif(not README.is_file(), reason='README not shipped')
def test_the_readme_compositions_are_compiled():
    shown = _readme_compositions()
    assert shown, 'no composition found in the README and the docs'
    missing = shown - {vispe.format_pe_spec(s) for s in COMPOSITIONS}
    assert not missing, f'add the documented compositions {sorted(missing)} to COMPOSITIONS'


# ------------------------------------------------------------------ -m slow: every encoding
@pytest.mark.slow
@pytest.mark.parametrize('spec', ALL)
def test_every_encoding_compiles_in_eval(spec):
    assert _eval_matches_eager(lambda: _vit(spec), [_images()]) == 1


@pytest.mark.slow
@pytest.mark.parametrize('spec', ALL)
def test_every_encoding_compiles_in_a_train_step(spec):
    assert _train_step_matches_eager(lambda: _vit(spec), [_images()]) == 1


@pytest.mark.slow
@pytest.mark.parametrize('spec', ALL)
def test_every_encoding_takes_new_sizes_without_recompiling(spec):
    _dynamic_eval(lambda: _vit(spec), [_images(s) for s in SIZES])


@pytest.mark.slow
@pytest.mark.parametrize('spec', ALL)
def test_every_encoding_trains_on_new_sizes_without_recompiling(spec):
    _dynamic_train_step(lambda: _vit(spec), [_images(s) for s in SIZES])


@pytest.mark.slow
@pytest.mark.parametrize('name', CAMERA)
def test_every_camera_encoding_compiles_in_eval(name):
    assert _eval_matches_eager(lambda: _camera_host(name), [_rig(*RIGS[0], seed=0)]) == 1


@pytest.mark.slow
@pytest.mark.parametrize('name', CAMERA)
def test_every_camera_encoding_compiles_in_a_train_step(name):
    assert _train_step_matches_eager(lambda: _camera_host(name), [_rig(*RIGS[0], seed=0)]) == 1


@pytest.mark.slow
@pytest.mark.parametrize('name', CAMERA)
def test_every_camera_encoding_trains_on_new_rigs_without_recompiling(name):
    _dynamic_train_step(lambda: _camera_host(name), [_rig(v, s, seed=i) for i, (v, s) in enumerate(RIGS)])
