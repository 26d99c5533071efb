"""The additive base: one `embed`, prefix rows, one bounded table cache, `encode` for coordinate
hosts, and timm's `pos_embed` taken over by the learned table."""
import math

import pytest
import torch
from timm.layers import resample_abs_pos_embed
from torch._subclasses.fake_tensor import FakeTensorMode

import vispe
from vispe.cameras import Cameras
from vispe.contract import PositionalEncoding
from vispe.contract import ATTENTION_HOOKS
from vispe._dtypes import at_least_float32, compute_dtype
from vispe.encodings.additive import AdditivePE, pad_prefix_rows

ADDITIVE = ('learned', 'sincos', 'detr_sine', 'detr_learned', 'fourier_learnable', 'nerf_freq', 'fourier_gaussian',
            'plucker')
DIM = 16


def _cameras_and_positions(num_prefix: int = 1):
    """Two 8 x 12 pixel views, 2 x 3 patches of 4 pixels each, looking down the z axis from two places."""
    K = torch.tensor([[10.0, 0.0, 6.0], [0.0, 10.0, 4.0], [0.0, 0.0, 1.0]]).repeat(2, 1, 1)
    poses = torch.eye(4).repeat(2, 1, 1)
    poses[1, :3, 3] = torch.tensor([1.0, -0.5, 2.0])
    cams = Cameras(K, cam_to_world=poses, image_size=(8, 12))
    return vispe.positions.multiview(cams, grid=(2, 3), num_prefix=num_prefix)


def _build(name: str, **ctx):
    """An additive encoding of width DIM on a 2 x 3 grid with one class token, and its positions."""
    if name == 'plucker':
        return vispe.create_pe('plucker:patch_size=4', dim=DIM), _cameras_and_positions()
    return vispe.create_pe(name, dim=DIM, grid_size=(2, 3), num_prefix_tokens=1, **ctx), vispe.grid(2, 3, num_prefix=1)


def test_every_purely_additive_encoding_derives_from_the_additive_base():
    """Encodings whose only job is an embedding; a rotary one with an optional table (comrope_ap) is not."""
    additive = set()
    for name in vispe.list_pes():
        cls = vispe.pe_info(name)['cls']
        in_attention = any(getattr(cls, h) is not getattr(PositionalEncoding, h) for h in ATTENTION_HOOKS)
        has_embedding = cls.embed is not PositionalEncoding.embed or cls.embedding is not PositionalEncoding.embedding
        if has_embedding and not in_attention:
            assert issubclass(cls, AdditivePE), name
            additive.add(name)
    assert additive >= set(ADDITIVE)


@pytest.mark.parametrize('name', ADDITIVE)
@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_embed_is_x_plus_embedding_in_the_tokens_dtype(name, dtype):
    pe, pos = _build(name)
    emb = pe.embedding(pos)
    assert emb.dim() == 3 and emb.shape[1:] == (pos.num_tokens, DIM)
    if name != 'learned':  # timm's table has a class-token row; the others give prefix tokens zeros
        assert torch.all(emb[:, 0] == 0)
    x = torch.randn(2, pos.num_tokens, DIM).to(dtype)
    out = pe.embed(x, pos)
    assert out.dtype == dtype
    torch.testing.assert_close(out, x + emb.to(dtype), rtol=0, atol=0)
    assert pe.capabilities.additive


def test_pad_prefix_rows_puts_zero_rows_in_front():
    table = torch.arange(24.0).reshape(2, 3, 4)
    padded = pad_prefix_rows(table, 2)
    assert padded.shape == (2, 5, 4)
    assert torch.all(padded[:, :2] == 0)
    assert torch.equal(padded[:, 2:], table)
    assert pad_prefix_rows(table, 0) is table
    with pytest.raises(ValueError, match='num_prefix'):
        pad_prefix_rows(table, -1)


def test_at_least_float32_keeps_float64_and_widens_half_precision():
    assert at_least_float32(torch.ones(2, dtype=torch.bfloat16)).dtype == torch.float32
    assert at_least_float32(torch.ones(2, dtype=torch.float16)).dtype == torch.float32
    x64 = torch.ones(2, dtype=torch.float64)
    assert at_least_float32(x64) is x64
    assert compute_dtype(torch.ones(2, dtype=torch.complex128)) == torch.float64
    assert compute_dtype(torch.ones(2, dtype=torch.bfloat16)) == torch.float32


# ------------------------------------------------------------------------------------------ cache
def test_table_cache_is_bounded_and_least_recently_used():
    pe = vispe.create_pe('sincos', dim=DIM, grid_size=(2, 2))
    first = pe.embedding(vispe.grid(1, 1))
    for n in range(2, 2 + pe.tensor_cache.size + 4):
        pe.embedding(vispe.grid(n, n))
        pe.embedding(vispe.grid(1, 1))  # used again each time: never the least recently used
        assert len(pe.tensor_cache) <= pe.tensor_cache.size
    assert pe.embedding(vispe.grid(1, 1)) is first
    assert pe.embedding(vispe.grid(2, 2)) is not pe.embedding(vispe.grid(3, 3))
    # the oldest other grid was evicted: a new tensor with the same values
    again = pe.embedding(vispe.grid(2, 2))
    assert torch.equal(again, pe.table(vispe.grid(2, 2).coords)[None])


@pytest.mark.parametrize('grid', [(2, 3), (4, 5)])
def test_cached_table_follows_parameter_changes(grid):
    pe = vispe.create_pe('learned', dim=DIM, grid_size=(2, 3), num_prefix_tokens=1).eval()
    pos = vispe.grid(*grid, num_prefix=1)
    with torch.no_grad():
        cached = pe.embedding(pos)
        assert pe.embedding(pos) is cached  # cached (eval, no autograd)
        first = cached.clone()  # on the training grid the table is the parameter itself
        pe.pos_embed.mul_(2.0)  # an optimiser step or a loaded state dict changes the values in place
        second = pe.embedding(pos)
    expected = resample_abs_pos_embed(pe.pos_embed.detach(), new_size=list(grid), old_size=[2, 3],
                                      num_prefix_tokens=1)
    torch.testing.assert_close(second, expected)
    torch.testing.assert_close(second, 2 * first)


def test_cache_is_cleared_by_train_clear_cache_and_moves():
    pe = vispe.create_pe('sincos', dim=DIM, grid_size=(2, 2))
    pos = vispe.grid(2, 2)
    pe.embedding(pos)
    assert len(pe.tensor_cache) == 1
    pe.train()
    assert not pe.tensor_cache
    pe.embedding(pos)
    pe.clear_cache()
    assert not pe.tensor_cache
    pe.embedding(pos)
    pe.to(torch.float64)
    assert not pe.tensor_cache
    pe.embedding(pos)
    pe.set_grid_size((3, 3))
    assert not pe.tensor_cache


def test_trainable_tables_are_not_cached_under_autograd():
    pe = vispe.create_pe('detr_learned', dim=DIM)
    pos = vispe.grid(2, 3)
    for _ in range(2):  # a cached table would backward through a freed graph the second time
        pe.embedding(pos).sum().backward()
    assert not pe.tensor_cache
    assert pe.row_embed.weight.grad is not None


def test_tables_made_in_inference_mode_stay_apart():
    pe = vispe.create_pe('sincos', dim=DIM, grid_size=(2, 2))
    pos = vispe.grid(2, 2)
    with torch.inference_mode():
        pe.embedding(vispe.grid(2, 2))
    x = torch.randn(1, 4, DIM, requires_grad=True)
    (x * pe.embedding(pos)).sum().backward()  # an inference tensor cannot be saved for backward
    assert x.grad is not None


def test_nothing_is_cached_while_tracing():
    pe = vispe.create_pe('sincos', dim=DIM, grid_size=(2, 2))
    with FakeTensorMode():
        pe.embedding(vispe.grid(2, 2))
    assert not pe.tensor_cache
    assert not isinstance(pe.embedding(vispe.grid(2, 2)), torch._subclasses.FakeTensor)


def test_padded_detr_batches_are_not_cached():
    pe = vispe.create_pe('detr_sine', dim=DIM)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[1, -3:] = True  # the second image is one row shorter
    pos = vispe.grid(2, 3).replace(key_padding_mask=mask)
    with torch.no_grad():
        emb = pe.embedding(pos)
    assert emb.shape == (2, 6, DIM) and not pe.tensor_cache
    torch.testing.assert_close(emb[0], pe.embedding(vispe.grid(2, 3))[0])


# ------------------------------------------------------------------------------------------ encode
@pytest.mark.parametrize('name', ADDITIVE)
def test_encode_maps_coordinates_to_out_dim_features(name):
    pe, _ = _build(name)
    width = pe.num_features if name == 'plucker' else 2  # Plücker rays are its coordinates
    coords = torch.rand(2, 5, width)
    if name == 'detr_learned':  # row and column indices
        coords = torch.randint(0, 3, (2, 5, width)).float()
    out = pe.encode(coords)
    assert out.shape == (2, 5, pe.out_dim)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize('name', ['sincos', 'detr_learned', 'fourier_learnable'])
def test_encode_equals_the_embedding_of_a_points_batch(name):
    pe = vispe.create_pe(name, dim=DIM)
    coords = torch.randint(0, 7, (2, 5, 2)).float()  # integer: detr_learned indexes its tables
    torch.testing.assert_close(pe.encode(coords), pe.embedding(vispe.points(coords)))


@pytest.mark.parametrize('name', ['nerf_freq', 'fourier_gaussian'])
def test_coordinate_encoding_embeds_the_projection_of_encode(name):
    pe = vispe.create_pe(name, dim=DIM)
    coords = torch.rand(2, 5, 2)
    torch.testing.assert_close(pe.embedding(vispe.points(coords)), pe.proj(pe.encode(coords)))


@pytest.mark.parametrize('interpolation', ['bicubic', 'bilinear', 'nearest'])
def test_learned_encode_samples_the_table_at_grid_coordinates(interpolation):
    pe = vispe.create_pe(f'learned:interpolation={interpolation}', dim=DIM, grid_size=(3, 4), num_prefix_tokens=1)
    pos = vispe.grid(3, 4)
    table = pe.pos_embed.detach()[0, 1:]
    torch.testing.assert_close(pe.encode(pos.coords), table)
    grid = table.reshape(3, 4, DIM)
    out = pe.encode(torch.tensor([[1.0, 2.5], [9.0, -3.0]]))
    torch.testing.assert_close(out[1], grid[2, 0])  # outside the grid: the border row
    if interpolation == 'bilinear':
        torch.testing.assert_close(out[0], (grid[1, 2] + grid[1, 3]) / 2)


def test_detr_sine_encode_gives_the_grid_embedding_from_normalised_positions():
    pe = vispe.create_pe('detr_sine', dim=DIM)
    h, w = 3, 4
    ys = torch.arange(1, h + 1).float() / (h + 1e-6) * 2 * math.pi  # DETR's normalised cumulative counts
    xs = torch.arange(1, w + 1).float() / (w + 1e-6) * 2 * math.pi
    yx = torch.stack(torch.meshgrid(ys, xs, indexing='ij'), -1).reshape(-1, 2)
    torch.testing.assert_close(pe.encode(yx), pe.embedding(vispe.grid(h, w))[0])


def test_plucker_encode_projects_the_ray_features():
    pe = vispe.create_pe('plucker:patch_size=4', dim=DIM)
    pos = _cameras_and_positions(num_prefix=1)
    torch.testing.assert_close(pe.encode(pe.ray_features(pos)), pe.embedding(pos)[0, 1:])
    with pytest.raises(ValueError, match='ray features'):
        pe.encode(torch.rand(4, 6))


@pytest.mark.parametrize('name', ['nerf_freq', 'fourier_gaussian'])
def test_coordinate_map_hosts_get_no_projection_and_their_axes(name):
    ctx = vispe.PEContext(dim=64, num_axes=3, coordinate_map=True)
    pe = vispe.create_pe(name, ctx)
    assert pe.proj is None and pe.encoder.input_dim == 3
    assert pe.encode(torch.rand(5, 3)).shape == (5, pe.out_dim)
    explicit = vispe.create_pe(f'{name}:project=true,input_dim=3', ctx)
    assert explicit.proj is not None and explicit.encoder.input_dim == 3
    with pytest.raises(ValueError, match='option input_dim=2 .* does not match the host'):
        vispe.create_pe(f'{name}:input_dim=2', ctx)  # the host's points have 3 axes
    token_host = vispe.create_pe(name, vispe.PEContext(dim=64, grid_size=(2, 3)))
    assert token_host.proj is not None and token_host.encoder.input_dim == 2


# ------------------------------------------------------------------------------------------ adopt
@pytest.mark.parametrize('interpolation,antialias', [('bicubic', True), ('bilinear', False), ('nearest', False)])
def test_adopt_pos_embed_resamples_like_timm(interpolation, antialias):
    spec = f'learned:interpolation={interpolation},antialias={antialias}'
    pe = vispe.create_pe(spec, dim=DIM, grid_size=(4, 6), num_prefix_tokens=1)
    table = torch.randn(1, 1 + 3 * 5, DIM)  # a non-square 3 x 5 checkpoint grid
    entries, resampled = pe.adopt_pos_embed(table, 1, (3, 5))
    expected = resample_abs_pos_embed(table, new_size=[4, 6], old_size=[3, 5], num_prefix_tokens=1,
                                      interpolation=interpolation, antialias=antialias)
    assert resampled == ['pos_embed']
    assert torch.equal(entries['pos_embed'], expected)


def test_adopt_pos_embed_is_the_identity_on_the_same_grid():
    pe = vispe.create_pe('learned', dim=DIM, grid_size=(2, 3), num_prefix_tokens=1)
    table = torch.arange(7 * DIM, dtype=torch.float32).reshape(1, 7, DIM)
    entries, resampled = pe.adopt_pos_embed(table, 1, (2, 3))
    assert resampled == [] and torch.equal(entries['pos_embed'], table)
    pe.load_state_dict(entries)
    assert torch.equal(pe.embedding(vispe.grid(2, 3, num_prefix=1)), table)


def test_adopt_pos_embed_keeps_or_drops_prefix_rows():
    table = torch.arange(8 * DIM, dtype=torch.float32).reshape(1, 8, DIM)  # 2 prefix rows, then a 2 x 3 grid
    no_prefix = vispe.create_pe('learned', dim=DIM, grid_size=(2, 3), num_prefix_tokens=1, embed_prefix=False)
    assert torch.equal(no_prefix.adopt_pos_embed(table, 2, (2, 3))[0]['pos_embed'], table[:, 2:])
    one = vispe.create_pe('learned', dim=DIM, grid_size=(2, 3), num_prefix_tokens=1)
    kept = torch.cat([table[:, :1], table[:, 2:]], dim=1)  # the class row kept, the register row dropped
    assert torch.equal(one.adopt_pos_embed(table, 2, (2, 3))[0]['pos_embed'], kept)
    three = vispe.create_pe('learned', dim=DIM, grid_size=(2, 3), num_prefix_tokens=3)
    adopted = three.adopt_pos_embed(table, 2, (2, 3))[0]['pos_embed']
    assert torch.equal(adopted[:, :2], table[:, :2])
    assert torch.equal(adopted[:, 2], three.pos_embed.detach()[:, 2])  # the row the checkpoint lacks
    assert torch.equal(adopted[:, 3:], table[:, 2:])


def test_adopt_pos_embed_names_a_bad_table():
    pe = vispe.create_pe('learned', dim=DIM, grid_size=(2, 3), num_prefix_tokens=1)
    with pytest.raises(ValueError, match='pos_embed'):
        pe.adopt_pos_embed(torch.randn(1, 8, DIM), 1, (2, 3))
    with pytest.raises(ValueError, match='dim=16'):
        pe.adopt_pos_embed(torch.randn(1, 7, 8), 1, (2, 3))
    with pytest.raises(ValueError, match='3D grid'):
        pe.adopt_pos_embed(torch.randn(1, 13, DIM), 1, (2, 2, 3))


def test_composition_adopts_into_its_learned_table():
    pe = vispe.create_pe('rope_axial+learned', dim=DIM, num_heads=2, grid_size=(2, 3), num_prefix_tokens=1)
    table = torch.randn(1, 1 + 3 * 3, DIM)
    entries, resampled = pe.adopt_pos_embed(table, 1, (3, 3))
    assert resampled == ['encodings.1.pos_embed'] and set(entries) == {'encodings.1.pos_embed'}
    expected = resample_abs_pos_embed(table, new_size=[2, 3], old_size=[3, 3], num_prefix_tokens=1)
    assert torch.equal(entries['encodings.1.pos_embed'], expected)
