"""CPE / PEG: timm's PosConv operator, class-token handling, placement, any resolution, CPVT-GAP."""
import pytest
import timm
import torch
from timm.models.twins import PosConv

import vispe
from vispe.registry import create_pe


@pytest.mark.parametrize('grid', [(4, 4), (3, 5)])
def test_peg_equals_timm_posconv_with_the_same_weights(grid):
    dim = 16
    pe = create_pe('peg', dim=dim, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1)
    ref = PosConv(dim, dim, stride=1)
    with torch.no_grad():
        ref.proj[0].weight.copy_(pe.convs['0'].weight)
        ref.proj[0].bias.copy_(pe.convs['0'].bias)
    n = grid[0] * grid[1]
    x = torch.randn(2, 1 + n, dim)
    out = pe.between_blocks(x, vispe.grid(*grid, num_prefix=1), 0)
    torch.testing.assert_close(out[:, 1:], ref(x[:, 1:], size=grid))
    assert torch.equal(out[:, 0], x[:, 0])  # class token split off and re-attached unchanged


def test_peg_on_a_constant_input_the_output_varies_with_position():
    dim, h, w = 8, 5, 6
    pe = create_pe('peg', dim=dim, num_heads=2, depth=1, grid_size=(h, w))
    with torch.no_grad():
        pe.convs['0'].weight.fill_(1.0)
        pe.convs['0'].bias.zero_()
    x = torch.ones(1, h * w, dim)
    out = pe.between_blocks(x, vispe.grid(h, w), 0).reshape(h, w, dim)[..., 0]
    # 1 + number of in-grid neighbours in the 3x3 window: the zero padding reveals the borders
    assert out[0, 0] == 1 + 4 and out[0, 2] == 1 + 6 and out[2, 2] == 1 + 9
    assert out.unique().numel() == 3


def test_peg_blocks_option_places_one_conv_after_each_listed_block():
    model = timm.create_model('vit_tiny', pe='peg:blocks=0-5', img_size=32, patch_size=8, embed_dim=32,
                              num_heads=2, num_classes=3)
    pe = model.pe
    assert pe.blocks == (0, 1, 2, 3, 4, 5) and sorted(pe.convs.keys(), key=int) == [str(i) for i in range(6)]
    calls = []
    for name, conv in pe.convs.items():
        conv.register_forward_hook(lambda m, i, o, name=name: calls.append(int(name)))
    model(torch.randn(1, 3, 32, 32))
    assert calls == [0, 1, 2, 3, 4, 5]
    assert pe.no_weight_decay() == {f'convs.{i}.{p}' for i in range(6) for p in ('weight', 'bias')}
    assert {'pe.convs.0.weight', 'pe.convs.5.bias'} <= model.no_weight_decay()


def test_peg_leaves_other_blocks_unchanged():
    pe = create_pe('peg:blocks=1', dim=8, num_heads=2, depth=3, grid_size=(2, 2))
    x = torch.randn(1, 4, 8)
    assert pe.between_blocks(x, vispe.grid(2, 2), 0) is x
    assert not torch.equal(pe.between_blocks(x, vispe.grid(2, 2), 1), x)


def test_cpvt_gap_model_runs_at_any_resolution():
    model = timm.create_model('vit_tiny', pe='peg:blocks=0-5', global_pool='avg', img_size=32, patch_size=8,
                              embed_dim=32, num_heads=2, num_classes=3)
    assert model.global_pool == 'avg'
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert model.pe.convs['3'].weight.grad is not None
    model.eval()
    with torch.no_grad():
        for size in ((48, 32),):
            assert model(torch.randn(1, 3, *size)).shape == (1, 3)


def test_peg_video_grid_uses_a_depthwise_3d_conv():
    pe = create_pe('peg', dim=8, num_heads=2, depth=1, grid_size=(2, 3, 3))
    assert isinstance(pe.convs['0'], torch.nn.Conv3d) and pe.convs['0'].groups == 8
    assert pe.between_blocks(torch.randn(1, 18, 8), vispe.grid(2, 3, 3), 0).shape == (1, 18, 8)


def test_peg_rejects_bad_options():
    with pytest.raises(ValueError, match='outside 0..1'):
        create_pe('peg:blocks=0-2', dim=8, num_heads=2, depth=2, grid_size=(2, 2))
    with pytest.raises(ValueError, match='odd'):
        create_pe('peg:kernel_size=4', dim=8, num_heads=2, depth=2, grid_size=(2, 2))
    pe = create_pe('peg', dim=8, num_heads=2, depth=1, grid_size=(2, 2))
    with pytest.raises(ValueError, match='full 2D token grid'):
        pe.between_blocks(torch.randn(1, 4, 8), vispe.points(torch.randn(4, 2)), 0)
