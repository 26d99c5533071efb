"""Golden-Gate RoPE and Spiral RoPE (`vispe.encodings.directional_rope`): their frequency vectors and
positions against hand computations of the published formulas, Spiral RoPE's released angle images
against torch's own resampling of them, the promised properties (shift invariance, uniform
directions, axial RoPE as a special case), compile, composition and the released-checkpoint loader."""
import math

import pytest
import timm
import torch
import torch.nn.functional as F

import vispe
from conftest import TINY
from vispe.encodings.directional_rope import GOLDEN_SPACING, golden_gate_frequencies, spiral_frequencies
from vispe.positions import grid, points
from vispe.released import DeitRMSNorm, spiral_rope_deit, spiral_rope_deit_state_dict


def _pe(spec, heads=2, head_dim=16, grid_size=(4, 4), **kw):
    return vispe.create_pe(spec, dim=heads * head_dim, num_heads=heads, depth=2, grid_size=grid_size, **kw).double()


def _angles(pe, pos):
    """Angles ``(H', N_total, P)`` of the (shared) rotation table of ``pos``."""
    return pe.table(pos)[0].angle()


# ---------------------------------------------------------------------- Golden-Gate RoPE
def test_golden_frequencies_are_the_blog_formula():
    """Hand computation: 2 heads x 4 pairs, a quarter of the pairs at frequency 0, the other three
    log-spaced 0.2 -> 20 (0.2, 2, 20), pair k of head h along (h * 4 + k) * pi / phi."""
    f = golden_gate_frequencies(2, 8, min_freq=0.2, max_freq=20.0, p_zero_freqs=0.25)
    magnitude = torch.tensor([0.0, 0.2, 2.0, 20.0], dtype=torch.float64)
    phi = (1 + math.sqrt(5)) / 2
    for h in range(2):
        for k in range(4):
            a = (h * 4 + k) * math.pi / phi
            expected = magnitude[k] * torch.tensor([math.cos(a), math.sin(a)], dtype=torch.float64)
            torch.testing.assert_close(f[:, h, k], expected, rtol=1e-12, atol=1e-12)
    assert GOLDEN_SPACING == pytest.approx(math.pi / phi, rel=1e-15)


def test_golden_image_positions_are_centred_with_unit_area():
    """Released positions on a 3 x 5 grid: x in linspace(-sqrt(5/3), sqrt(5/3), 5), y in
    linspace(-sqrt(3/5), sqrt(3/5), 3), the class token not rotated."""
    pe = _pe('rope_golden', grid_size=(3, 5))
    pos = grid(3, 5, num_prefix=1, dtype=torch.float64)
    xs = [-math.sqrt(5 / 3) + i * 2 * math.sqrt(5 / 3) / 4 for i in range(5)]
    ys = [-math.sqrt(3 / 5) + j * 2 * math.sqrt(3 / 5) / 2 for j in range(3)]
    expected = torch.tensor([[x, y] for y in ys for x in xs], dtype=torch.float64)
    torch.testing.assert_close(pe.coordinates(pos), expected, rtol=0, atol=1e-12)
    f = pe.freqs  # (2, 1, H, P)
    angle = torch.einsum('nd,dhp->hnp', expected, f[:, 0])
    table = pe.table(pos)[0]  # (H, 1 + N, P)
    assert torch.equal(table[:, 0], torch.ones_like(table[:, 0]))  # class token: identity
    torch.testing.assert_close(table[:, 1:], torch.polar(torch.ones_like(angle), angle), rtol=0, atol=1e-12)


def test_golden_directions_differ_between_every_pair_and_head():
    """Golden-angle steps modulo pi never repeat: all H * hd/2 directions are distinct lines."""
    f = golden_gate_frequencies(6, 64)
    lines = torch.remainder(torch.atan2(f[1], f[0]), math.pi).flatten().sort().values
    assert lines.diff().min() > 1e-3


# ---------------------------------------------------------------------- Spiral RoPE
def test_spiral_frequencies_follow_the_released_layout():
    """Hand computation, head_dim 16, K = 4 (the released rotate=2): pairs 0-3 measure along y, 4-7
    along x; in each run of four pairs the last two are turned by 45 degrees (y towards +x, x towards
    -y); magnitudes 1.5 * 10000^(-k/4) per half."""
    s = math.sqrt(0.5)
    w = [1.5 * 10000 ** (-k / 4) for k in range(4)]
    expected = torch.tensor([
        [0, 0, s * w[2], s * w[3], w[0], w[1], s * w[2], s * w[3]],  # x components
        [w[0], w[1], s * w[2], s * w[3], 0, 0, -s * w[2], -s * w[3]],  # y components
    ], dtype=torch.float64)
    torch.testing.assert_close(spiral_frequencies(16, 4), expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize('k', [2, 4, 6, 8])
def test_spiral_directions_are_uniform_over_a_half_turn(k):
    """K lines at multiples of pi / K, each carrying the same number of pairs."""
    f = spiral_frequencies(4 * k * 2, k)
    lines = torch.remainder(torch.atan2(f[1], f[0]) / (math.pi / k), k).round().long()
    assert torch.bincount(lines, minlength=k).tolist() == [f.shape[1] // k] * k


def test_spiral_with_two_directions_is_axial_rope():
    """K = 2 turns nothing: RoPE-ViT's axial table with theta 10000 (times max_freq), its halves in
    the other order (Spiral puts y first, rope_axial x)."""
    spiral = _pe('rope_spiral:num_directions=2,max_freq=1.0,grid_mode=index', head_dim=32)
    axial = _pe('rope_axial:theta=10000', head_dim=32)
    pos = grid(4, 5, num_prefix=1, dtype=torch.float64)
    a, b = spiral.table(pos)[0, 0], axial.table(pos)
    # both tables hold float32 frequencies, rounded from float64 (Spiral) and computed in float32 (axial)
    torch.testing.assert_close(a, torch.cat([b[..., 8:], b[..., :8]], -1), rtol=0, atol=1e-6)


def _released_angle_images(head_dim, k, max_freq, n):
    """The released recipe, written with torch's resampling: per pair an n x n angle image (rows for
    the y half, columns for the x half) turned about its centre by grid_sample (bilinear, border)."""
    w = torch.tensor([max_freq * 10000 ** (-j / (head_dim // 4)) for j in range(head_dim // 4)])
    idx = torch.arange(n, dtype=torch.float32)
    images = [w[p % (head_dim // 4)] * (idx[:, None] if p < head_dim // 4 else idx[None, :]).expand(n, n)
              for p in range(head_dim // 2)]
    turned = []
    for p, image in enumerate(images):
        deg = ((p % k) // 2) * 180 / k
        a = math.radians(deg)
        theta = torch.tensor([[math.cos(a), -math.sin(a), 0.0], [math.sin(a), math.cos(a), 0.0]]).unsqueeze(0)
        g = F.affine_grid(theta, (1, 1, n, n), align_corners=True)
        turned.append(F.grid_sample(image[None, None], g, mode='bilinear', padding_mode='border',
                                    align_corners=True)[0, 0])
    return torch.stack(turned, -1).reshape(n * n, -1)  # (N, P)


@pytest.mark.parametrize('k, n', [(4, 6), (8, 7)])
def test_spiral_clamp_is_the_released_turned_angle_image(k, n):
    pe = vispe.create_pe('rope_spiral', dim=64, num_heads=2, grid_size=(n, n), num_directions=k, corners='clamp')
    ours = pe.table(grid(n, n))[0, 0]
    ref = _released_angle_images(32, k, 1.5, n)
    torch.testing.assert_close(ours, torch.polar(torch.ones_like(ref), ref), rtol=0, atol=2e-5)


def test_spiral_clamp_and_linear_give_the_same_logits_inside_the_grid():
    """The released angle is u.p plus a constant per pair wherever the turned position stays in the
    grid: the patch-to-patch logits of those tokens are the shift-invariant form's."""
    n, k = 8, 4
    lin, clamp = (_pe(f'rope_spiral:corners={c}', head_dim=32, grid_size=(n, n)) for c in ('linear', 'clamp'))
    pos = grid(n, n, dtype=torch.float64)
    q, key = torch.randn(2, 1, 2, n * n, 32, dtype=torch.float64)
    logits = [torch.einsum('bhnd,bhmd->bhnm', *p.prepare(pos).qk(q, key, 0)) for p in (lin, clamp)]
    c = (n - 1) / 2
    y, x = torch.meshgrid(torch.arange(n) - c, torch.arange(n) - c, indexing='ij')
    a = math.pi / k
    inside = ((math.cos(a) * y + math.sin(a) * x).abs() <= c) & ((math.cos(a) * x - math.sin(a) * y).abs() <= c)
    inside = inside.flatten()
    assert 0 < inside.sum() < n * n
    sub = [lg[..., inside, :][..., inside] for lg in logits]
    # the two forms multiply float32 directions and magnitudes in different orders: logits of size ~30
    torch.testing.assert_close(sub[0], sub[1], rtol=0, atol=1e-5)
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # the corners differ


# ---------------------------------------------------------------------- shared properties
@pytest.mark.parametrize('spec', ['rope_golden:grid_mode=index', 'rope_spiral:grid_mode=index',
                                  'rope_spiral:num_directions=8,same_freqs=true,grid_mode=index'])
def test_logits_depend_on_position_differences_only(spec):
    pe = _pe(spec, head_dim=32)
    g = torch.Generator().manual_seed(0)
    coords = torch.rand(9, 2, generator=g, dtype=torch.float64) * 6
    shift = torch.tensor([2.5, -1.25], dtype=torch.float64)
    q, k = torch.randn(2, 1, 2, 9, 32, generator=g, dtype=torch.float64)
    a = torch.einsum('bhnd,bhmd->bhnm', *pe.prepare(points(coords)).qk(q, k, 0))
    b = torch.einsum('bhnd,bhmd->bhnm', *pe.prepare(points(coords + shift)).qk(q, k, 0))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize('spec', ['rope_golden', 'rope_spiral'])
def test_fixed_frequencies_add_no_parameters_and_no_state(spec):
    pe = _pe(spec)
    assert not list(pe.parameters()) and not pe.state_dict()


@pytest.mark.parametrize('spec, match', [
    ('rope_golden:max_freq=0.1', 'max_freq'), ('rope_golden:p_zero_freqs=1.5', 'p_zero_freqs'),
    ('rope_golden:grid_mode=polar', 'grid_mode'), ('rope_spiral:num_directions=3', 'num_directions'),
    ('rope_spiral:num_directions=0', 'num_directions'), ('rope_spiral:truncate=1', 'truncate'),
    ('rope_spiral:corners=wrap', 'corners'), ('rope_spiral:num_directions=6', 'head_dim divisible by 12'),
])
def test_bad_options_name_the_option(spec, match):
    with pytest.raises(ValueError, match=match):
        vispe.create_pe(spec, dim=32, num_heads=2, grid_size=(4, 4))


@pytest.mark.parametrize('spec', ['rope_golden', 'rope_spiral'])
def test_a_video_grid_is_refused(spec):
    with pytest.raises(ValueError, match='2D plane'):
        vispe.create_pe(spec, dim=32, num_heads=2, grid_size=(2, 4, 4))


# ---------------------------------------------------------------------- in a ViT: compile, composition
def _vit(spec):
    torch.manual_seed(0)
    return timm.create_model('vit_tiny', pe=spec, **TINY)


# rope_spiral's default takes rope_golden's path (MixedAnglePE angles); corners='clamp' its own
@pytest.mark.parametrize('spec', ['rope_golden', 'rope_spiral:corners=clamp'])
def test_compiles_fullgraph_in_eval_and_a_train_step(spec):
    torch._dynamo.reset()
    x = torch.randn(2, 3, 32, 32)
    model = _vit(spec).eval()
    compiled = torch.compile(model, fullgraph=True, backend='aot_eager')
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    eager, twin = _vit(spec).train(), _vit(spec).train()
    compiled = torch.compile(twin, fullgraph=True, backend='aot_eager')
    eager(x).square().mean().backward()
    compiled(x).square().mean().backward()
    for (name, a), b in zip(eager.named_parameters(), twin.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize('spec', ['rope_golden+peg', 'rope_spiral+irpe:init_std=0.1'])
def test_composition_trains(spec):
    model = _vit(spec).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    for _ in range(2):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.pe.parameters())


# ---------------------------------------------------------------------- the released DeiT checkpoints
def _released_state_dict(embed=64, depth=2, heads=2, grid=4, patch=16, classes=5, max_freq=1.5):
    """A state dict with the keys and shapes of the released models_v2 vit_models (rope=True,
    qkv_bias=True, LayerScale, RMSNorm ``scale``), random values; the rope buffer as released:
    ``max_freq * 10000^(-2k / E)``, E = head_dim / 2, one copy per block."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    hd = embed // heads
    freqs = torch.tensor([max_freq * 10000 ** (-2 * k / (hd // 2)) for k in range(hd // 4)])
    sd = {'cls_token': r(1, 1, embed), 'pos_embed': r(1, grid * grid, embed),
          'patch_embed.proj.weight': r(embed, 3, patch, patch), 'patch_embed.proj.bias': r(embed),
          'norm.scale': r(embed), 'head.weight': r(classes, embed), 'head.bias': r(classes)}
    for i in range(depth):
        b = f'blocks.{i}.'
        sd.update({b + 'gamma_1': r(embed), b + 'gamma_2': r(embed), b + 'norm1.scale': r(embed),
                   b + 'norm2.scale': r(embed), b + 'attn.qkv.weight': r(3 * embed, embed),
                   b + 'attn.qkv.bias': r(3 * embed), b + 'attn.proj.weight': r(embed, embed),
                   b + 'attn.proj.bias': r(embed), b + 'attn.rope.freqs': freqs.clone(),
                   b + 'mlp.fc1.weight': r(4 * embed, embed), b + 'mlp.fc1.bias': r(4 * embed),
                   b + 'mlp.fc2.weight': r(embed, 4 * embed), b + 'mlp.fc2.bias': r(embed)})
    return sd


def test_released_checkpoint_maps_every_weight(tmp_path):
    sd = _released_state_dict()
    path = tmp_path / 'checkpoint.pth'
    torch.save({'model': sd, 'epoch': 3}, path)
    model = spiral_rope_deit(str(path)).eval()
    ours = model.state_dict()
    renamed = {'gamma_1': 'ls1.gamma', 'gamma_2': 'ls2.gamma', 'norm1.scale': 'norm1.weight',
               'norm2.scale': 'norm2.weight'}
    for key, value in sd.items():
        if key.endswith('rope.freqs'):
            continue
        if key == 'pos_embed':
            assert torch.equal(model.pe.encodings[0].pos_embed.reshape(-1, value.shape[-1]), value[0])
            continue
        target = 'norm.weight' if key == 'norm.scale' else key
        for old, new in renamed.items():
            target = target.replace(old, new)
        assert torch.equal(ours[target], value), key
    spiral = model.pe.encodings[1]
    assert (spiral.name, spiral.num_directions, spiral.corners, spiral.max_freq) == ('rope_spiral', 4, 'clamp', 1.5)
    assert model.blocks[0].attn.num_heads == 2
    assert all(isinstance(m, DeitRMSNorm) for m in (model.norm, model.blocks[0].norm1))
    assert torch.isfinite(model(torch.randn(1, 3, 64, 64))).all()


def test_deit_rms_norm_keeps_eps_outside_the_root():
    """The released RMSNorm: scale * x / (||x|| / sqrt(d) + eps); at a small scale this differs from
    eps inside the root (timm's RMSNorm)."""
    norm = DeitRMSNorm(4, eps=1e-2)
    x = torch.tensor([[0.03, -0.04, 0.0, 0.0]])  # rms 0.025
    torch.testing.assert_close(norm(x), x / (0.025 + 1e-2))


def test_released_checkpoint_with_other_frequencies_is_refused():
    sd = _released_state_dict()
    with pytest.raises(ValueError, match='theta'):
        spiral_rope_deit_state_dict(sd, theta=100.0)
    with pytest.raises(ValueError, match='not a Spiral RoPE DeiT checkpoint'):
        spiral_rope_deit_state_dict({k: v for k, v in sd.items() if 'rope' not in k})
