"""ComRoPE-AP and -LD: exact shift invariance, the paper's positions and jitter, fast paths == slow paths."""
import pytest
import timm
import torch

import vispe
from vispe import checks
from vispe.rotary.expm import linear_exp
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

    def logits(c):  # every logit, class token included: it sits at the points' mean, which shifts with them
        return rotated_logits(pe, vispe.points(c, num_prefix=1), q, k)
    assert checks.shift_invariance(logits, coords, shift, atol=1e-10, rtol=0).passed
    assert checks.moves_output(logits(coords), logits(coords * 1.5), at_least=1e-3, relative=False).passed


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('block', [2, 4, 8])
def test_comrope_rotation_is_orthogonal(name, block):
    pe = _pe(name, block=block)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, _ = random_qk(17)
    q2, k2 = pe.prepare(pos).qk(q, q, layer=1)
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
        qc, kc = pe.prepare(pos).qk(q, k, layer=layer)
        qr, kr = rope.prepare(pos).qk(q, k, layer=layer)
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
    q2, _ = pe.prepare(vispe.grid(2, 4, num_prefix=1)).qk(q, k, layer=0)
    q3, _ = pe.prepare(vispe.points(torch.tensor([[0.5, 0.5]]).double())).qk(q[:, :, :1], k[:, :, :1], 0)
    torch.testing.assert_close(q2[:, :, :1], q3)
    ident = _pe(name, prefix='identity')
    q4, _ = ident.prepare(vispe.grid(2, 4, num_prefix=1)).qk(q, k, layer=0)
    torch.testing.assert_close(q4[:, :, 0], q[:, :, 0], rtol=0, atol=0)


@pytest.mark.parametrize('name', VARIANTS)
@pytest.mark.parametrize('block', [2, 4])
def test_comrope_jitter_only_in_training_and_per_sample(name, block):
    pe = _pe(name, block=block, jitter=1.0)
    pos = vispe.grid(4, 4, num_prefix=1)
    q, k = random_qk(17, batch=3)
    pe.eval()
    with torch.no_grad():
        e1, e2 = pe.prepare(pos).qk(q, k, 0), pe.prepare(pos).qk(q, k, 0)
    torch.testing.assert_close(e1[0], e2[0], rtol=0, atol=0)
    pe.train()
    t1, t2 = pe.prepare(pos).qk(q, k, 0), pe.prepare(pos).qk(q, k, 0)
    assert (t1[0] - t2[0]).abs().max() > 1e-6  # fresh jitter every forward
    same = q[:1].expand_as(q)
    per_sample, _ = pe.prepare(pos).qk(same, same, 0)
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
    n = torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64)  # frames in spatial patches, as the original
    lo, hi = idx / n, (idx + 1) / n
    assert ((coords >= lo - 1e-12) & (coords <= hi + 1e-12)).all()
    torch.testing.assert_close(coords[..., 0], ((idx[:, 0] + 0.5) / 4).expand(4, -1))
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
    q2, k2 = pe.prepare(vispe.points(xyz, num_prefix=1)).qk(q, k, 0)
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


@pytest.mark.parametrize('name', VARIANTS)
def test_comrope_video_frames_are_scaled_by_the_patches_per_side(name):
    """The original's get_positions divides every axis, frames included, by the patches per side n:
    3 frames of 4 x 4 patches give t = (f + 0.5) / 4 (not / 3); the class token sits at (0.5, 0.5, 0.5)."""
    pos = vispe.grid(3, 4, 4, num_prefix=1)
    coords, pad = _pe(name, axes=3).coordinates(pos)
    assert pad == 0
    t = torch.tensor([0.125, 0.375, 0.625], dtype=torch.float64)
    s = torch.tensor([0.125, 0.375, 0.625, 0.875], dtype=torch.float64)
    torch.testing.assert_close(coords[1:], torch.cartesian_prod(t, s, s), rtol=0, atol=1e-15)
    torch.testing.assert_close(coords[0], torch.full((3,), 0.5, dtype=torch.float64), rtol=0, atol=0)
    # time_scale='frames': frames in [0, 1] whatever the clip length
    coords, _ = _pe(name, axes=3, time_scale='frames').coordinates(pos)
    torch.testing.assert_close(coords[1:], torch.cartesian_prod(t * 4 / 3, s, s), rtol=0, atol=1e-15)
    torch.testing.assert_close(coords[0], torch.full((3,), 0.5, dtype=torch.float64), rtol=0, atol=0)
    # the per-axis fast path of larger blocks uses the same coordinates
    pe = _pe(name, axes=3, block=4)
    coords, _ = pe.coordinates(pos)
    gens = pe.axis_generators(3)
    expected = torch.linalg.matrix_exp(torch.einsum('nd,dlhjab->lhnjab', coords, gens).contiguous())
    torch.testing.assert_close(pe.rotation(pos), expected, rtol=0, atol=1e-10)


def _linear_table(pe, weights):
    """Set channel 0 of the APE table to ``sum_a weights[a] * index_a`` (bilinear sampling is exact on it)."""
    grid = pe.ctx.grid_size
    idx = torch.cartesian_prod(*[torch.arange(n, dtype=torch.float64) for n in grid]).reshape(-1, len(grid))
    with torch.no_grad():
        pe.pos_embed[0, :, 0] = idx @ torch.tensor(weights, dtype=torch.float64)


@pytest.mark.parametrize('name', VARIANTS)
def test_comrope_ape_samples_its_table_like_the_release(name):
    """The release samples its table with grid_sample(bilinear, align_corners=True, border) at 2 p - 1:
    patch centres p = (i + 0.5) / n land at (i + 0.5) (n - 1) / n table cells, p = i / (n - 1) on cell i."""
    pe = _pe(name, ape=True)
    assert pe.pos_embed.shape == (1, 16, 32) and 'embed' in pe.hooks and 'embed' not in _pe(name).hooks
    _linear_table(pe, [10.0, 1.0])
    emb = pe.embedding(vispe.grid(4, 4, num_prefix=1))
    assert emb.shape == (1, 17, 32)
    u = (torch.arange(4, dtype=torch.float64) + 0.5) * 3 / 4  # table coordinates of the patch centres
    torch.testing.assert_close(emb[0, 1:, 0], (10 * u[:, None] + u[None, :]).flatten())
    torch.testing.assert_close(emb[0, 0, 0], torch.tensor(16.5, dtype=torch.float64))  # class token: the centre
    cells = torch.cartesian_prod(*[torch.arange(4, dtype=torch.float64) / 3] * 2)
    torch.testing.assert_close(pe.embedding(vispe.points(cells))[0], pe.pos_embed[0], rtol=0, atol=1e-12)
    # outside [0, 1] the border entries repeat; an identity class token gets no embedding
    far = pe.embedding(vispe.points(torch.tensor([[2.0, -1.0]], dtype=torch.float64)))
    torch.testing.assert_close(far[0, 0], pe.pos_embed[0, 12])
    ident = _pe(name, ape=True, prefix='identity')
    assert ident.embedding(vispe.grid(4, 4, num_prefix=1))[0, 0].abs().max() == 0
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    torch.testing.assert_close(pe.eval().embed(x, vispe.grid(4, 4, num_prefix=1)), x + emb)  # no jitter in eval


def test_comrope_ape_on_video_follows_the_time_axis_scaling():
    pe = _pe('comrope_ap', axes=3, ape=True)  # table 4 x 4 x 4 (t, row, col)
    _linear_table(pe, [100.0, 10.0, 1.0])
    emb = pe.embedding(vispe.grid(2, 4, 4))[0, :, 0]
    # frames (f + 0.5) / 4 (patches per side) -> table frame coordinate (f + 0.5) / 4 * 3
    t = (torch.arange(2, dtype=torch.float64) + 0.5) * 3 / 4
    s = (torch.arange(4, dtype=torch.float64) + 0.5) * 3 / 4
    expected = 100 * t[:, None, None] + 10 * s[None, :, None] + s[None, None, :]
    torch.testing.assert_close(emb, expected.flatten())


def test_comrope_ape_and_rotations_share_the_jittered_positions():
    """In training the table is sampled at the same jittered positions that drive the rotations."""
    pe = _pe('comrope_ap', ape=True, jitter=1.0)
    _linear_table(pe, [10.0, 1.0])
    with torch.no_grad():  # block j rotates by exactly p_(j mod 2) radians
        pe.generators.zero_()
        pe.generators[..., 1, 0] = 1.0
    pe.train()
    pos = vispe.grid(4, 4, num_prefix=1)
    x = torch.zeros(3, 17, 32, dtype=torch.float64)
    prepared = pe.prepare(pos)  # the forward's jitter travels in the prepared encoding
    emb = prepared.embed(x)[..., 0]
    q = torch.zeros(3, 2, 17, 16, dtype=torch.float64)
    q[..., 0::2] = 1.0
    rotated, _ = prepared.qk(q, q, layer=0)
    p = torch.atan2(rotated[:, 0, :, 1::2], rotated[:, 0, :, 0::2])[..., :2]  # (B, N, axes)
    assert (p[:, 1:] - p[:1, 1:]).abs().max() > 1e-3  # jittered, per sample
    torch.testing.assert_close(emb, 10 * 3 * p[..., 0] + 3 * p[..., 1])


def test_comrope_ape_trains_in_a_tiny_vit():
    model = timm.create_model('vit_tiny', pe='comrope_ap:ape=true', **TINY)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert model.pe.pos_embed.grad.abs().sum() > 0
    assert_tiny_vit_trains_and_runs_larger('comrope_ld:ape=true,block=4')
    # set_input_size resamples the table like timm's pos_embed (align_corners=True: a linear table stays linear)
    _linear_table(model.pe, [10.0, 1.0])
    before = model.pe.eval().embedding(vispe.grid(6, 6))
    model.set_input_size(img_size=48)
    assert model.pe.pos_embed.shape == (1, 36, 32)
    torch.testing.assert_close(model.pe.embedding(vispe.grid(6, 6))[..., 0], before[..., 0], rtol=0, atol=1e-5)
    assert model(torch.randn(1, 3, 48, 48)).shape == (1, 5)
