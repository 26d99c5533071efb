"""Learnable Fourier features (Li et al. 2021): the formula with set weights, groups, the W_r init."""
import math

import pytest
import timm
import torch

import vispe
from vispe.encodings.fourier import LearnableFourierFeatures
from vispe.registry import create_pe


def _gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _set_weights(lff: LearnableFourierFeatures) -> None:
    with torch.no_grad():
        lff.Wr.weight.copy_(torch.tensor([[1.0, 0.0], [0.5, -2.0]]))  # |F|/2 = 2 frequencies, M = 2
        lff.mlp[0].weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, -1.0]]))
        lff.mlp[0].bias.copy_(torch.tensor([0.1, -0.2]))
        lff.mlp[2].weight.copy_(torch.tensor([[2.0, 0.0], [1.0, 1.0], [0.0, -1.0]]))
        lff.mlp[2].bias.copy_(torch.tensor([0.0, 0.5, 0.0]))


def _hand(x0: float, x1: float):
    """Algorithm 1 by hand for the weights of `_set_weights`, one position (x0, x1)."""
    p0, p1 = x0, 0.5 * x0 - 2.0 * x1
    f = [c / math.sqrt(4) for c in (math.cos(p0), math.cos(p1), math.sin(p0), math.sin(p1))]
    h0 = _gelu(f[0] + 0.1)
    h1 = _gelu(f[1] + f[2] - f[3] - 0.2)
    return [2.0 * h0, h0 + h1 + 0.5, -h1]


def test_learnable_fourier_features_equal_a_hand_computation():
    lff = LearnableFourierFeatures(2, 3, fourier_dim=4, hidden_dim=2)
    _set_weights(lff)
    x = torch.tensor([[[0.3, -1.2]], [[2.0, 0.5]]])  # (N=2, G=1, M=2)
    got = lff(x)
    expected = torch.tensor([_hand(0.3, -1.2), _hand(2.0, 0.5)])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


def test_learnable_fourier_groups_share_the_encoder_and_concatenate():
    lff = LearnableFourierFeatures(2, 6, groups=2, fourier_dim=4, hidden_dim=2)
    single = LearnableFourierFeatures(2, 3, fourier_dim=4, hidden_dim=2)
    _set_weights(single)
    lff.load_state_dict(single.state_dict())
    x = torch.tensor([[[0.3, -1.2], [2.0, 0.5]]])  # (N=1, G=2, M=2)
    expected = torch.tensor([_hand(0.3, -1.2) + _hand(2.0, 0.5)])
    torch.testing.assert_close(lff(x), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize('wr_init,std', [('inv_gamma', 1 / 4.0), ('inv_gamma_sq', 1 / 16.0)])
def test_learnable_fourier_wr_init_has_the_documented_std(wr_init, std):
    torch.manual_seed(0)
    lff = LearnableFourierFeatures(4, 8, fourier_dim=20000, gamma=4.0, wr_init=wr_init)
    assert abs(lff.Wr.weight.std().item() / std - 1) < 0.03
    assert abs(lff.Wr.weight.mean().item()) < 0.03 * std


def test_learnable_fourier_module_works_outside_a_vit_on_arbitrary_coordinates():
    lff = LearnableFourierFeatures(3, 16, groups=1)
    xyz = torch.randn(4, 100, 1, 3)  # e.g. NeRF sample points (batch, samples, G, M)
    assert lff(xyz).shape == (4, 100, 16)
    with pytest.raises(ValueError, match=r'\(\.\.\., G=1, M=3\)'):
        lff(torch.randn(100, 3))


def test_fourier_learnable_pe_adds_the_features_of_the_grid_and_zeros_for_prefix_tokens():
    pe = create_pe('fourier_learnable', dim=16, num_heads=2, grid_size=(3, 4), num_prefix_tokens=1)
    pos = vispe.grid(3, 4, num_prefix=1)
    emb = pe.embedding(pos)
    assert emb.shape == (1, 13, 16)
    assert torch.equal(emb[0, 0], torch.zeros(16))
    torch.testing.assert_close(emb[0, 1:], pe.features(pos.coords.unsqueeze(-2)))
    x = torch.randn(2, 13, 16)
    torch.testing.assert_close(pe.embed(x, pos), x + emb)


def test_fourier_learnable_groups_split_the_coordinate_axes():
    pe = create_pe('fourier_learnable:groups=3', dim=12, num_heads=2, grid_size=(2, 3, 3))
    pos = vispe.grid(2, 3, 3)
    expected = pe.features(pos.coords.reshape(18, 3, 1))
    torch.testing.assert_close(pe.embedding(pos)[0], expected)
    with pytest.raises(ValueError, match='groups'):
        create_pe('fourier_learnable:groups=2', dim=12, num_heads=2, grid_size=(2, 3, 3))


def test_fourier_learnable_in_a_vit_trains_and_runs_at_another_resolution():
    model = timm.create_model('vit_tiny', pe='fourier_learnable', img_size=32, patch_size=8, embed_dim=32,
                              depth=2, num_heads=2, num_classes=3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert model.pe.features.Wr.weight.grad is not None
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 64)).shape == (1, 3)


def test_fourier_phases_stay_float32_under_bf16_autocast():
    """bf16 phases would be off by ~0.5 rad at coordinate 100; float32 phases keep the features."""
    torch.manual_seed(0)
    m = LearnableFourierFeatures(pos_dim=2, dim=64, groups=1)
    x = torch.rand(16, 1, 2) * 100
    with torch.autocast('cpu', dtype=torch.bfloat16):
        phases_only = torch.cat([m.Wr(x).float().cos(), m.Wr(x).float().sin()], -1)
        out = m(x)
    ref = m(x)
    exact = torch.cat([(x.float() @ m.Wr.weight.T).cos(), (x.float() @ m.Wr.weight.T).sin()], -1)
    assert (phases_only - exact).abs().max() > 0.05  # what bf16 phases would do
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
