"""ComRoPE-AP and -LD: exact shift invariance, the paper's positions and jitter, fast paths == slow paths."""
import pytest
import timm
import torch

import vispe
from vispe.encodings._lie import linear_exp
from conftest import TINY, assert_tiny_vit_trains_and_runs_larger, random_qk, rotated_logits

VARIANTS = ['comrope_ap', 'comrope_ld']


def _pe(name, axes=2, block=2, depth=2, heads=2, head_dim=16, **kw):
    return vispe.create_pe(name, dim=heads * head_dim, num_heads=heads, depth=depth, grid_size=(4,) * axes,
                           num_prefix_tokens=1, block=block, **kw).double()


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('axes', [2, 3])
@pytest.mark.parametrize('block', [2, 4])
def test_comrope_is_shift_invariant(name, axes, block):
    pe = _pe(name, axes, block)
    coords = torch.rand(9, axes, dtype=torch.float64) * 3
    shift = torch.randn(axes, dtype=torch.float64) * 5
    q, k = random_qk(10)
    a = rotated_logits(pe, vispe.points(coords, num_prefix=1), q, k)
    b = rotated_logits(pe, vispe.points(coords + shift, num_prefix=1), q, k)
    # every logit, class token included: it sits at the points' mean, which shifts with them
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    c = rotated_logits(pe, vispe.points(coords * 1.5, num_prefix=1), q, k)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('block', [2, 4, 8])
def test_comrope_rotation_is_orthogonal(name, block):
    pe = _pe(name, block=block)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, _ = random_qk(17)
    q2, k2 = pe.qk(q, q, pe.prepare(pos), layer=1)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close((q2 * k2).sum(-1), (q * q).sum(-1))


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('axes', [2, 3])
@pytest.mark.parametrize('block', [4, 8])
def test_comrope_grid_fast_path_equals_matrix_exp(name, axes, block):
    """Grids exponentiate per-axis values only (AP: gather, LD: product of per-axis factors)."""
    pe = _pe(name, axes, block, head_dim=48)
    pos = vispe.grid(*(3, 4, 2)[:axes], num_prefix=1, train_grid=(4,) * axes)
    fast = pe.rotation(pos)
    coords, pad = pe.coordinates(pos)
    assert pad == 0 and coords.shape == (pos.num_tokens, axes)
    gens = pe.axis_generators(axes)  # (D, L, H, blocks, b, b)
    expected = torch.linalg.matrix_exp(torch.einsum('nd,dlhjab->lhnjab', coords, gens).contiguous())
    torch.testing.assert_close(fast, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(fast, linear_exp(gens, coords), rtol=0, atol=1e-10)


def test_comrope_generators_follow_the_papers_parametrisation():
    ap = _pe('comrope_ap', block=4)
    gens = ap.axis_generators(2)  # block j is driven by axis j mod 2: P_j - P_j^T there, 0 elsewhere
    p = ap.generators.detach()
    for j in range(4):
        torch.testing.assert_close(gens[j % 2, :, :, j], p[:, :, j] - p[:, :, j].transpose(-1, -2))
        assert gens[1 - j % 2, :, :, j].abs().max() == 0
    ld = _pe('comrope_ld', block=4)
    gens = ld.axis_generators(2)  # theta_ij (P_j - P_j^T), theta shared by the heads
    p, theta = ld.generators.detach(), ld.axis_scales.detach()
    assert theta.shape == (2, 2, 4)  # (layers, axes, blocks)
    for i in range(2):
        torch.testing.assert_close(gens[i], theta[:, i, None, :, None, None] * (p - p.transpose(-1, -2)))
    for gens in (ap.axis_generators(2), ld.axis_generators(2)):  # generators of one block commute
        torch.testing.assert_close(gens[0] @ gens[1], gens[1] @ gens[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize('name', VARIANTS)
def test_comrope_block2_equals_rope_mixed_with_mapped_frequencies(name):
    """b = 2: block j rotates by sum_d p_d A_dj[1, 0], a learned-frequency 2D RoPE."""
    pe = _pe(name, prefix='identity')
    rope = vispe.create_pe('rope_mixed', dim=32, num_heads=2, depth=2, grid_size=(4, 4)).double()
    with torch.no_grad():
        # rope_mixed takes the column (x) first: its axis a is ComRoPE's axis D - 1 - a
        rope.freqs.copy_(pe.axis_generators(2)[..., 1, 0].flip(0))
    coords = torch.rand(7, 2, dtype=torch.float64) * 4
    pos = vispe.points(coords, num_prefix=1)
    q, k = random_qk(8)
    for layer in range(2):
        qc, kc = pe.qk(q, k, pe.prepare(pos), layer=layer)
        qr, kr = rope.qk(q, k, rope.prepare(pos), layer=layer)
        torch.testing.assert_close(qc, qr, rtol=0, atol=1e-12)
        torch.testing.assert_close(kc, kr, rtol=0, atol=1e-12)


@pytest.mark.parametrize('name', VARIANTS)
def test_comrope_positions_are_patch_centres_and_class_token_is_grid_centre(name):
    pe = _pe(name)
    coords, pad = pe.coordinates(vispe.grid(2, 4, num_prefix=1, train_grid=(4, 4)))
    assert pad == 0
    rows = (torch.arange(2, dtype=torch.float64) + 0.5) / 2
    cols = (torch.arange(4, dtype=torch.float64) + 0.5) / 4
    torch.testing.assert_close(coords[1:], torch.cartesian_prod(rows, cols))
    torch.testing.assert_close(coords[0], torch.tensor([0.5, 0.5], dtype=torch.float64))
    coords, _ = _pe(name, normalize='train').coordinates(vispe.grid(2, 4, num_prefix=1, train_grid=(4, 4)))
    torch.testing.assert_close(coords[0], torch.tensor([0.25, 0.5], dtype=torch.float64))
    torch.testing.assert_close(coords[1:], torch.cartesian_prod(rows / 2, cols))
    # the class token is rotated like a token at the centre; prefix='identity' leaves it alone
    q, k = random_qk(9)
    q2, _ = pe.qk(q, k, pe.prepare(vispe.grid(2, 4, num_prefix=1)), layer=0)
    q3, _ = pe.qk(q[:, :, :1], k[:, :, :1], pe.prepare(vispe.points(torch.tensor([[0.5, 0.5]]).double())), 0)
    torch.testing.assert_close(q2[:, :, :1], q3)
    ident = _pe(name, prefix='identity')
    q4, _ = ident.qk(q, k, ident.prepare(vispe.grid(2, 4, num_prefix=1)), layer=0)
    torch.testing.assert_close(q4[:, :, 0], q[:, :, 0], rtol=0, atol=0)


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('block', [2, 4])
def test_comrope_jitter_only_in_training_and_per_sample(name, block):
    pe = _pe(name, block=block, jitter=1.0)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, k = random_qk(17, batch=3)
    pe.eval()
    with torch.no_grad():
        e1, e2 = pe.qk(q, k, pe.prepare(pos), 0), pe.qk(q, k, pe.prepare(pos), 0)
    torch.testing.assert_close(e1[0], e2[0], rtol=0, atol=0)
    pe.train()
    t1, t2 = pe.qk(q, k, pe.prepare(pos), 0), pe.qk(q, k, pe.prepare(pos), 0)
    assert (t1[0] - t2[0]).abs().max() > 1e-6  # fresh jitter every forward
    same = q[:1].expand_as(q)
    per_sample, _ = pe.qk(same, same, pe.prepare(pos), 0)
    assert (per_sample[0] - per_sample[1])[:, 1:].abs().max() > 1e-6  # each sample its own positions
    torch.testing.assert_close(per_sample[0, :, 0], per_sample[1, :, 0])  # class token stays at the centre
    torch.testing.assert_close(t1[0].norm(dim=-1), q.norm(dim=-1))
    assert not _pe(name, block=block, jitter=0.0).train().per_sample(pos)
    assert not pe.per_sample(vispe.points(torch.rand(5, 2)))  # no grid, no jitter


def test_comrope_jitter_stays_within_half_a_patch_and_spares_the_frame_axis():
    pe = _pe('comrope_ap', axes=3, jitter=50.0)
    pe.train()
    pos = vispe.grid(2, 4, 4)
    coords, _ = pe.coordinates(pos, batch=4)
    assert coords.shape == (4, 32, 3)
    idx = pos.coords.double()
    n = torch.tensor([2.0, 4.0, 4.0], dtype=torch.float64)
    lo, hi = idx / n, (idx + 1) / n
    assert ((coords >= lo - 1e-12) & (coords <= hi + 1e-12)).all()
    torch.testing.assert_close(coords[..., 0], ((idx[:, 0] + 0.5) / 2).expand(4, -1))
    assert coords[..., 1:].std() > 0


@pytest.mark.parametrize('name', VARIANTS)
def test_every_comrope_layer_receives_gradient_in_a_tiny_vit(name):
    model = timm.create_model('vit_tiny', pe=f'{name}:block=4', **TINY)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    for pname, p in model.pe.named_parameters():
        for layer in range(TINY['depth']):
            assert p.grad[layer].abs().sum() > 0, f'{pname} of layer {layer} got no gradient'


@pytest.mark.parametrize('spec', ['comrope_ap', 'comrope_ld', 'comrope_ap:block=8', 'comrope_ld:block=4',
                                  'comrope_ld:prefix=identity,jitter=0,normalize=train,per_layer=false'])
def test_comrope_tiny_vit_forward_backward(spec):
    assert_tiny_vit_trains_and_runs_larger(spec)


@pytest.mark.parametrize('name', VARIANTS)
def test_comrope_on_video_grids_and_point_clouds(name):
    model = timm.create_model('vit_tiny', pe=f'{name}:block=4', video=True, num_frames=4, tubelet=2, **TINY)
    model(torch.randn(2, 3, 4, 32, 32)).sum().backward()
    pe = _pe(name, axes=3, block=4)
    q, k = random_qk(9)
    xyz = torch.randn(2, 8, 3, dtype=torch.float64)  # per-sample point clouds (e.g. RGB-D tokens)
    q2, k2 = pe.qk(q, k, pe.prepare(vispe.points(xyz, num_prefix=1)), 0)
    torch.testing.assert_close(q2.norm(dim=-1), q.norm(dim=-1))


def test_comrope_rejects_bad_options():
    with pytest.raises(ValueError, match='block'):
        vispe.create_pe('comrope_ap:block=3', dim=32, num_heads=2)
    with pytest.raises(ValueError, match='prefix'):
        vispe.create_pe('comrope_ld:prefix=first', dim=32, num_heads=2)
    with pytest.raises(ValueError, match='at least one block'):
        vispe.create_pe('comrope_ap:block=16', dim=32, num_heads=2, grid_size=(2, 4, 4))
    pe = _pe('comrope_ld')
    with pytest.raises(ValueError, match='num_axes'):
        pe.prepare(vispe.points(torch.rand(4, 3, dtype=torch.float64)))


def _compiled_matches_eager(spec, backend):
    model = timm.create_model('vit_tiny', pe=spec, **TINY)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(2, 3, 32, 32)
    compiled(x).sum().backward()  # training step: jitter (per-sample rotations), memory-lean backward
    assert all(p.grad is not None for p in model.pe.parameters())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_comrope_works_under_torch_compile():
    """Graph capture and AOT autograd (the backend-independent part of torch.compile)."""
    torch._dynamo.reset()
    _compiled_matches_eager('comrope_ap', 'aot_eager')


@pytest.mark.slow
@pytest.mark.parametrize('spec', ['comrope_ap', 'comrope_ld:block=4'])
def test_comrope_works_under_torch_compile_with_inductor(spec):
    torch._dynamo.reset()
    _compiled_matches_eager(spec, 'inductor')
