"""RIFLEx (Zhao et al., ICML 2025) as a frequency scaling: only the intrinsic frequency is lowered.

The expected tables are computed by hand from the formula: periods ``round(2 pi / f_j)``, the index
``k`` whose period is nearest the repetition length ``N`` (the first on a tie), and, when the test
length ``L`` exceeds that period, ``f_k = 0.9 * 2 pi / L``. The paper's HunyuanVideo example (base 256,
16 channels, N = 48) gives k = 4 (1-based) with period 50.
"""
import math

import pytest
import timm
import torch

import vispe
from vispe.positions import grid
from vispe.rotary import axial_frequencies, riflex_frequencies, scale_frequencies

# HunyuanVideo's temporal table: 1 / 256^(2j / 16) = 2^-j, periods 2 pi 2^j rounded
HUNYUAN = torch.tensor([2.0 ** -j for j in range(8)])
HUNYUAN_PERIODS = [6, 13, 25, 50, 101, 201, 402, 804]


def _with(freqs: torch.Tensor, index: int, value: float) -> torch.Tensor:
    out = freqs.clone()
    out[index] = value
    return out


def test_hand_table_of_the_hunyuan_example():
    assert [round(2 * math.pi / f) for f in HUNYUAN.tolist()] == HUNYUAN_PERIODS
    assert torch.equal(axial_frequencies(8, 256.0, step=2.0, dim=16), HUNYUAN)


def test_paper_example_lowers_the_fourth_frequency_for_66_frames():
    expected = _with(HUNYUAN, 3, 0.9 * 2 * math.pi / 66)
    torch.testing.assert_close(riflex_frequencies(HUNYUAN, 66, 48), expected, atol=0, rtol=0)


def test_nothing_changes_while_the_test_length_fits_in_the_intrinsic_period():
    assert torch.equal(riflex_frequencies(HUNYUAN, 50, 48), HUNYUAN)  # period 50: not exceeded
    assert torch.equal(scale_frequencies(HUNYUAN, 1.0, 'riflex', 33.0)[0], HUNYUAN)  # no longer than training


def test_table_entry_takes_the_training_length_as_repetition_length():
    """33 -> 66 positions: periods 25 and 50 are 8 and 17 from 33, so the third frequency drops."""
    freqs, magnitude = scale_frequencies(HUNYUAN, 2.0, 'riflex', 33.0)
    torch.testing.assert_close(freqs, _with(HUNYUAN, 2, 0.9 * 2 * math.pi / 66), atol=0, rtol=0)
    assert magnitude == 1.0


def test_a_tie_takes_the_first_frequency():
    """9.5 is 3.5 from both 6 and 13."""
    torch.testing.assert_close(riflex_frequencies(HUNYUAN, 19, 9.5), _with(HUNYUAN, 0, 0.9 * 2 * math.pi / 19),
                               atol=0, rtol=0)


def test_the_lowered_frequency_turns_less_than_once_over_the_test_length():
    base = axial_frequencies(16, 100.0, step=2.0, dim=32)
    for length in (20, 40, 64, 200):
        freqs = scale_frequencies(base, length / 16, 'riflex', 16.0)[0]
        changed = (freqs != base).nonzero().flatten().tolist()
        assert len(changed) == 1  # one component only
        assert freqs[changed[0]] * length == pytest.approx(0.9 * 2 * math.pi)


def test_rope_axial_lowers_only_the_time_axis_of_a_longer_video():
    """48 channels over (t, y, x) give each axis 8 pairs with base 256: HunyuanVideo's temporal table.
    Trained on 33 frames, run on 66 with riflex_repetition=48: the paper's k = 4 on t alone."""
    pe = vispe.create_pe('rope_axial:theta=256,scaling=riflex,riflex_repetition=48', dim=96, num_heads=2,
                         grid_size=(33, 2, 2)).double()
    pos = grid(66, 2, 2, train_grid=(33, 2, 2), dtype=torch.float64)
    q, k = (torch.randn(1, 2, pos.num_tokens, 48, dtype=torch.float64) for _ in range(2))
    q2, _ = pe.prepare(pos).qk(q, k, 0)
    freqs = {'x': HUNYUAN, 'y': HUNYUAN, 't': _with(HUNYUAN, 3, 0.9 * 2 * math.pi / 66)}
    coords = pos.coords.to(torch.float64)  # (t, y, x)
    angles = torch.cat([coords[:, 2:3] * freqs['x'], coords[:, 1:2] * freqs['y'], coords[:, 0:1] * freqs['t']], -1)
    pairs = torch.view_as_complex(q.unflatten(-1, (-1, 2)).contiguous()) * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(q2, torch.view_as_real(pairs).flatten(-2), atol=1e-6, rtol=0)


def test_riflex_repetition_is_checked():
    with pytest.raises(ValueError, match=r"option 'riflex_repetition' of encoding 'rope_axial' must be a finite number > 0"):
        vispe.create_pe('rope_axial:scaling=riflex,riflex_repetition=0', dim=64, num_heads=2)


def test_rope2d_and_rope_axial_take_riflex_and_compile():
    """The option reaches every axial encoding; a larger input (the scaled path) compiles without a graph break
    (dynamo alone: no code generation needed to find one)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = timm.create_model('vit_tiny', pe='rope2d:scaling=riflex', embed_dim=32, depth=1, num_heads=2, img_size=32,
                              patch_size=8, num_classes=5, dynamic_img_size=True).eval()
    x = torch.randn(1, 3, 64, 48)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(model, fullgraph=True, backend='eager')(x), model(x), atol=1e-5, rtol=1e-5)
