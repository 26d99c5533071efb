"""The learned rotations' exponentials traced (torch.compile, torch.export): the same numbers as eager.

`expm_skew` traced keeps the squaring count a tensor and takes a static maximum of masked squarings,
with a loud failure beyond it. `linear_exp` / `layerwise_exp` (the rotations at every position) are
one operator traced, ``vispe::linear_exp_blocks``, whose kernel runs the eager code: it reads the count
and takes exactly eager's squarings, with no maximum, values and gradients bit for bit eager's.

Most tests trace with the ``aot_eager`` backend (dynamo and AOT autograd, the ops run as ATen does:
the traced algorithm without the compiler's own rounding); `-m slow` compiles whole models with
inductor, in eval and in a train step, and against eager with dynamic shapes."""
import pytest
import timm
import torch

import vispe
from vispe.rotary import expm
from vispe.rotary.base import RotationPE
from vispe.rotary.expm import expm_skew, layerwise_exp, linear_exp
from conftest import TINY

SPECS = ['liere', 'liere:per_layer=false', 'comrope_ap:block=8', 'comrope_ld:block=4']


def _traced(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend='aot_eager', fullgraph=True)


def _skew(*shape, dtype=torch.float64):
    t = torch.randn(*shape, dtype=dtype)
    return t - t.transpose(-1, -2)


def _scaled_to(gen, bound, target):
    """``gen`` scaled so that its norm bound (linear in ``gen``) is ``target``."""
    return gen * (target / bound)


def _target(squarings, degree, dtype):
    """A norm bound that needs exactly ``squarings`` squarings: half-way (in log2) into its range."""
    return expm._taylor_theta(degree, dtype) * 2.0 ** (squarings - 0.5)


def _matrix_bound(a):
    a4 = torch.linalg.matrix_power(a.reshape(-1, *a.shape[-2:]), 4)
    return a4.flatten(-2).norm(dim=-1).amax().pow(0.25)


LIMIT_64 = expm._squaring_limit(expm._TAYLOR_DEGREE, torch.float64)


@pytest.mark.parametrize('spec', ['liere', 'comrope_ap:block=8', 'comrope_ld:block=4'])
def test_the_static_maximum_covers_initial_generators_at_four_times_the_grid(spec, monkeypatch):
    """The norm bounds the encodings' own initial generators reach on a grid four times the
    training grid (ViT-S: 56 x 56 for 14 x 14, a training forward, jitter included) stay a factor of
    ten below the traced maximum, room for the generators to grow in training."""
    bounds = []
    measure = expm._max_bound
    monkeypatch.setattr(expm, '_max_bound', lambda *a, **k: bounds.append(measure(*a, **k)) or bounds[-1])
    pe = vispe.create_pe(spec, dim=384, num_heads=6, depth=12, grid_size=(14, 14)).train()
    state = pe.prepare(vispe.positions.grid(56, 56, num_prefix=1, train_grid=(14, 14)))
    RotationPE.layer_state(state.state, 2)  # per-sample (jittered) rotations are built on first use
    assert bounds, 'no exponential was bounded'
    assert 10 * max(float(b.max()) for b in bounds) <= expm._TRACED_MAX_BOUND


@pytest.mark.parametrize('b', [3, 4, 8])
@pytest.mark.parametrize('scale', [0.01, 1.0, 30.0])
def test_traced_expm_skew_equals_matrix_exp_in_float64(b, scale):
    a = _skew(3, 5, b, b) * scale
    got = _traced(expm_skew)(a)
    torch.testing.assert_close(got, torch.linalg.matrix_exp(a), rtol=0, atol=1e-12 * max(1.0, scale))
    torch.testing.assert_close(got, expm_skew(a), rtol=0, atol=1e-13 * max(1.0, scale))


def test_masked_squarings_are_eagers_products_for_each_count():
    """`_square_repeatedly` with a tensor count: exactly the ``s`` products of the eager loop, for one
    count and for a count per matrix, at 0, a few and the maximum."""
    y = torch.linalg.matrix_exp(_skew(3, 4, 4)) * 1.01  # not orthogonal: every product changes it
    counts = [0, 3, LIMIT_64]
    for s in counts:
        got = expm._square_repeatedly(y, torch.tensor(float(s), dtype=y.dtype), LIMIT_64)
        assert torch.equal(got, expm._square_repeatedly(y, s, LIMIT_64)), s
    per_matrix = torch.tensor(counts, dtype=y.dtype)[:, None, None]
    got = expm._square_repeatedly(y, per_matrix, LIMIT_64)
    for i, s in enumerate(counts):
        assert torch.equal(got[i], expm._square_repeatedly(y[i:i + 1], s, LIMIT_64)[0]), s
        assert not torch.equal(got[i], expm._square_repeatedly(y[i:i + 1], s + 1, LIMIT_64)[0]), s


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
@pytest.mark.parametrize('squarings', ['none', 'few', 'max'])
def test_traced_expm_skew_takes_eagers_squarings(dtype, squarings):
    """At norm bounds that need 0, 3 and the maximum of squarings: the traced count is eager's and
    so is the exponential (float64: also torch.linalg.matrix_exp's)."""
    limit = expm._squaring_limit(expm._TAYLOR_DEGREE, dtype)
    s = {'none': 0, 'few': 3, 'max': limit}[squarings]
    a = _skew(4, 6, 8, 8)
    a = _scaled_to(a, _matrix_bound(a), _target(s, expm._TAYLOR_DEGREE, dtype)).to(dtype)
    bound = _matrix_bound(a)
    assert expm._num_squarings(bound, expm._TAYLOR_DEGREE, dtype) == s
    assert expm._traced_squarings(bound, expm._TAYLOR_DEGREE, dtype).item() == s
    got = _traced(expm_skew)(a)
    torch.testing.assert_close(got, expm_skew(a), rtol=0, atol=1e-6 if dtype == torch.float32 else 1e-13)
    if dtype == torch.float64:
        torch.testing.assert_close(got, torch.linalg.matrix_exp(a), rtol=0, atol=1e-12 * 2 ** s)


def _gen_coords(axes=2, batched=False, dtype=torch.float64):
    gen = _skew(axes, 2, 3, 2, 8, 8, dtype=dtype)  # (D, L, H, blocks, b, b)
    gen[:, 1] *= 0.05  # layers of different norms: one count for all of them, as eagerly
    coords = torch.rand((3, 10, axes) if batched else (10, axes), dtype=dtype)
    return gen, coords


@pytest.mark.parametrize('axes', [2, 3])
@pytest.mark.parametrize('squarings', ['none', 'few', 'max'])
def test_traced_linear_exp_takes_eagers_squarings(axes, squarings):
    gen, coords = _gen_coords(axes)
    degree = expm._poly_degree(axes)
    limit = expm._squaring_limit(degree, gen.dtype)
    s = {'none': 0, 'few': 3, 'max': limit}[squarings]
    gen = _scaled_to(gen, expm._max_bound(gen, coords), _target(s, degree, gen.dtype))
    assert expm._squarings(gen, coords) == s
    assert expm._traced_count(gen, coords, per_sample=False).item() == s
    got = _traced(lambda g, c: linear_exp(g, c, num_prefix=1))(gen, coords)
    torch.testing.assert_close(got, linear_exp(gen, coords, num_prefix=1), rtol=0, atol=1e-12 * 2 ** s)
    exponent = torch.einsum('nd,dlhjxy->lhnjxy', coords, gen)
    expected = torch.linalg.matrix_exp(exponent.contiguous())
    torch.testing.assert_close(got[..., 1:, :, :, :], expected, rtol=0, atol=1e-12 * 2 ** s)


@pytest.mark.parametrize('beyond', ['count', 'nan'])
def test_traced_expm_skew_fails_loudly_beyond_its_maximum(beyond):
    a = _skew(4, 8, 8)
    args = _scaled_to(a, _matrix_bound(a), _target(LIMIT_64 + 1, expm._TAYLOR_DEGREE, a.dtype))
    below = args * 1e-3
    if beyond == 'nan':
        args[0, 0, 1] = float('nan')
    else:
        expm_skew(args)  # eagerly: no maximum
    traced = _traced(expm_skew)
    with pytest.raises(RuntimeError, match='squarings a traced graph takes'):
        traced(args)
    torch.testing.assert_close(traced(below), expm_skew(below), rtol=0, atol=1e-13)  # the graph runs below it


def test_traced_linear_exp_has_no_maximum():
    """Norm bounds that need three squarings more than `expm_skew`'s traced maximum: the traced
    rotations are eager's, bit for bit, and torch.linalg.matrix_exp's."""
    gen, coords = _gen_coords()
    s = LIMIT_64 + 3
    gen = _scaled_to(gen, expm._max_bound(gen, coords), _target(s, 12, gen.dtype))
    assert expm._squarings(gen, coords) == s
    got = _traced(lambda g, c: linear_exp(g, c, num_prefix=1))(gen, coords)
    assert torch.equal(got, linear_exp(gen, coords, num_prefix=1))
    expected = torch.linalg.matrix_exp(torch.einsum('nd,dlhjxy->lhnjxy', coords, gen).contiguous())
    torch.testing.assert_close(got[..., 1:, :, :, :], expected, rtol=0, atol=1e-12 * 2 ** s)


@pytest.mark.parametrize('where', ['nan', 'inf'])
@pytest.mark.parametrize('traced', [False, True])
def test_linear_exp_refuses_a_non_finite_bound(where, traced):
    """A NaN or infinite generator has no squaring count: a clear error, eagerly and traced (not an
    integer conversion's)."""
    gen, coords = _gen_coords()
    gen[0, 1, 2, 1, 0, 3] = float(where)
    call = _traced(lambda g, c: linear_exp(g, c, num_prefix=1)) if traced else linear_exp
    with pytest.raises(RuntimeError, match='norm bound of a learned rotation is not finite'):
        call(gen, coords)


def test_loud_failure_in_an_inductor_graph():
    a = _skew(4, 8, 8)
    compiled = torch.compile(expm_skew, fullgraph=True)
    torch.testing.assert_close(compiled(a), torch.linalg.matrix_exp(a), rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match='squarings a traced graph takes'):
        compiled(_scaled_to(a, _matrix_bound(a), _target(LIMIT_64 + 1, expm._TAYLOR_DEGREE, a.dtype)))


@pytest.mark.parametrize('batched', [False, True])
def test_traced_layerwise_exp_gradients_equal_eagers(batched):
    """In training the traced blocks are checkpointed per layer: values and gradients of generators
    and coordinates as eager's memory-lean Function gives them."""
    gen, coords = _gen_coords(batched=batched)
    gen = (gen * 4).requires_grad_()
    coords.requires_grad_()
    weights = torch.randn(2, *((3,) if batched else ()), 3, 11, 2, 8, 8, dtype=gen.dtype)
    traced = _traced(lambda g, c: torch.stack(list(layerwise_exp(g, c, num_prefix=1))))
    got, eager = traced(gen, coords), torch.stack(list(layerwise_exp(gen, coords, num_prefix=1)))
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-12)
    for g, e in zip(torch.autograd.grad((got * weights).sum(), (gen, coords)),
                    torch.autograd.grad((eager * weights).sum(), (gen, coords))):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_traced_sample_counts_are_eagers_groups():
    """A NaFlex batch (``sample_squarings``): each sample's own count, as eager groups the samples, so
    that each gets the rotations it gets alone."""
    gen, coords = _gen_coords(batched=True)
    coords = coords * torch.tensor([0.02, 1.0, 8.0], dtype=coords.dtype)[:, None, None]
    groups = expm._sample_groups(gen, coords)
    assert len(groups) == 3
    counts = expm._traced_count(gen, coords, per_sample=True)
    assert counts.shape == (3, 1, 1)
    assert {int(s): [b] for b, s in enumerate(counts.flatten().tolist())} == groups
    traced = _traced(lambda g, c: linear_exp(g, c, num_prefix=1, sample_squarings=True))
    got = traced(gen, coords)
    torch.testing.assert_close(got, linear_exp(gen, coords, num_prefix=1, sample_squarings=True), rtol=0,
                               atol=1e-12)
    for b in range(3):
        alone = linear_exp(gen, coords[b], num_prefix=1)
        torch.testing.assert_close(got[:, b], alone, rtol=0, atol=1e-12)


@pytest.mark.parametrize('fn', ['linear_exp', 'layerwise_exp'])
@pytest.mark.parametrize('batch', ['shared', 'per_sample'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float64])
def test_traced_rotations_and_gradients_are_eagers_bit_for_bit(fn, batch, dtype):
    """Traced by AOT autograd (ATen's arithmetic: no compiler rounding around the operator), the
    rotations and the gradients of generators and coordinates equal eager's exactly: one count for
    all positions, and a NaFlex batch whose samples need different counts."""
    gen, coords = _gen_coords(batched=batch == 'per_sample', dtype=dtype)
    if batch == 'per_sample':
        coords = coords * torch.tensor([0.02, 1.0, 8.0], dtype=dtype)[:, None, None]
        assert len(expm._sample_groups(gen, coords)) == 3
    gen, coords = (gen * 4).requires_grad_(), coords.requires_grad_()

    def rotations(g, c):
        if fn == 'linear_exp':
            return linear_exp(g, c, num_prefix=1, sample_squarings=True)
        return torch.stack(list(layerwise_exp(g, c, num_prefix=1, sample_squarings=True)))

    got, eager = _traced(rotations)(gen, coords), rotations(gen, coords)
    assert torch.equal(got, eager)
    weights = torch.randn(got.shape, dtype=dtype)
    # gradients: the same formulas, summed over sample groups and through the traced coefficients'
    # backward in another order, so equal to the rounding of the sums
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for g, e in zip(torch.autograd.grad((got * weights).sum(), (gen, coords)),
                    torch.autograd.grad((eager * weights).sum(), (gen, coords))):
        torch.testing.assert_close(g, e, rtol=tol, atol=tol * e.abs().max().item())


def test_traced_rotations_ignore_the_callers_autocast():
    """Under bf16 autocast the traced rotations are still taken in float32: bit for bit eager's
    without autocast (eager code gets this from `prepare`, which turns autocast off)."""
    gen, coords = _gen_coords(dtype=torch.float32)
    traced = _traced(lambda g, c: linear_exp(g, c, num_prefix=1))
    with torch.autocast('cpu', dtype=torch.bfloat16):
        got = traced(gen, coords)
    assert got.dtype == torch.float32
    assert torch.equal(got, linear_exp(gen, coords, num_prefix=1))


@pytest.mark.parametrize('train', [False, True])
def test_traced_rotations_take_eagers_squarings_only(train, monkeypatch):
    """The traced graph squares exactly as often as eager code (a few times at small norms), not a
    static maximum of masked squarings: the cost the compiled model used to pay."""
    gen, coords = _gen_coords()
    gen = _scaled_to(gen, expm._max_bound(gen, coords), _target(3, 12, gen.dtype)).requires_grad_(train)
    taken = []
    squarings = expm._squarings_soa
    monkeypatch.setattr(expm, '_squarings_soa', lambda y, s, keep=False: taken.append(s) or squarings(y, s, keep))

    def rotations(g, c):
        return torch.stack(list(layerwise_exp(g, c, num_prefix=1)))

    for run in (rotations, _traced(rotations)):
        rot = run(gen, coords)
        if train:
            rot.square().sum().backward()
    eager, traced = taken[:len(taken) // 2], taken[len(taken) // 2:]
    # in training each layer's forward takes 3 squarings and its backward recomputes the 2 factors
    # before the last; in eval one exponential covers all layers
    assert eager == traced == ([3] * gen.shape[1] + [2] * gen.shape[1] if train else [3])


# ------------------------------------------------------------------ whole models
def _model(spec):
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny', pe=spec, **TINY)
    for p in model.pe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return model


def _train_step_matches(spec, backend, autocast=False):
    torch._dynamo.reset()
    eager, other = _model(spec), _model(spec)
    compiled = torch.compile(other, backend=backend, fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    mixed = torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast)
    torch.manual_seed(1)  # the same jitter (ComRoPE) in both
    with mixed:
        loss = eager(x).float().square().mean()
    loss.backward()
    torch.manual_seed(1)
    with torch._inductor.config.patch(fallback_random=True), mixed:
        loss = compiled(x).float().square().mean()
    loss.backward()
    for (name, a), b in zip(eager.named_parameters(), other.parameters()):
        if a.grad is not None:
            # bf16: the two graphs round the model's products differently, within 2 % of each gradient's scale
            tol = dict(rtol=1e-2, atol=1e-2 * (1 + a.grad.abs().max().item())) if autocast else dict(atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(b.grad, a.grad, **tol, msg=name)


def _eval_matches(spec, backend):
    torch._dynamo.reset()
    model = _model(spec).eval()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('spec', ['liere', 'comrope_ap:block=8'])
def test_traced_model_train_step_equals_eager(spec):
    _train_step_matches(spec, 'aot_eager')


@pytest.mark.parametrize('spec', ['liere', 'comrope_ap:block=8'])
def test_traced_model_train_step_under_bf16_autocast_equals_eager(spec):
    """Mixed precision: the exponentials are taken in float32 in both (autocast off inside the
    operator, as in eager `prepare`), and the traced backward runs."""
    _train_step_matches(spec, 'aot_eager', autocast=True)


@pytest.mark.slow
@pytest.mark.parametrize('spec', SPECS)
def test_compiled_model_eval_equals_eager(spec):
    _eval_matches(spec, 'inductor')


@pytest.mark.slow
@pytest.mark.parametrize('spec', SPECS)
def test_compiled_model_train_step_equals_eager(spec):
    _train_step_matches(spec, 'inductor')


@pytest.mark.parametrize('spec', ['liere', 'comrope_ap:block=8'])
def test_dynamic_shapes_compile_once(spec):
    """Three input sizes (positions beyond the training grid: more squarings) through one graph."""
    torch._dynamo.reset()
    model = _model(spec).eval()
    counts = []

    def backend(gm, example_inputs):
        counts.append(1)
        return gm.forward

    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=backend)
    with torch.no_grad():
        for size in (32, 48, 64):
            x = torch.randn(1, 3, size, size + 8)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert len(counts) == 1, f'{len(counts)} compilations for 3 input sizes'
