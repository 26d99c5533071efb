"""The training-free extrapolation methods of `patch_dit` against their published formulas, at 2x and 4x.

Each patched table is compared with one built here by hand from the method's formula (and, where the
host library has the method, with its code): position interpolation (Chen et al. 2023, ``f / s``; diffusers'
``linear_factor``), NTK-aware scaling (bloc97 2023, base ``theta s^(d / (d - 2))``; diffusers' ``ntk_factor``),
YaRN (Peng et al. 2023: ramp ``gamma(r)`` over ``r = L f / 2 pi`` between ``alpha = 1`` and ``beta = 32``,
``f' = (1 - gamma) f / s + gamma f``, cos / sin times ``0.1 ln s + 1``), RIFLEx (Zhao et al. 2025, as
thu-ml/RIFLEx's ``get_1d_rotary_pos_embed_riflex``: the intrinsic frequency ``k`` set to ``0.9 * 2 pi / L``),
each on the axes it is given, and a schedule that changes them with the denoising step.
"""
import math

import pytest
import torch

pytest.importorskip('diffusers')

from diffusers.models.embeddings import get_1d_rotary_pos_embed  # noqa: E402

from vispe.integrations import patch_dit  # noqa: E402

from dit_hosts import build, flux_ids, forward, inputs  # noqa: E402

THETA = 10000.0
FLUX_DIMS = (4, 6, 6)
TRAIN = 4  # the tiny FLUX's training grid (train_grid=(4, 4))


def base(d: int) -> torch.Tensor:
    return 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float64) / d)


def yarn_by_hand(f: torch.Tensor, s: float, length: float, alpha: float = 1.0, beta: float = 32.0) -> torch.Tensor:
    r = length * f / (2 * math.pi)
    gamma = ((r - alpha) / (beta - alpha)).clamp(0, 1)
    return (1 - gamma) * f / s + gamma * f


def riflex_by_hand(f: torch.Tensor, test_length: float, repetition: float) -> torch.Tensor:
    """thu-ml/RIFLEx: ``freqs[k - 1] = 0.9 * 2 pi / L_test`` for the intrinsic ``k`` (period nearest the
    repetition length), when the test length exceeds that period."""
    periods = [round(2 * math.pi / v) for v in f.tolist()]
    k = min(range(len(periods)), key=lambda j: abs(periods[j] - repetition))
    out = f.clone()
    if periods[k] < test_length:
        out[k] = 0.9 * 2 * math.pi / test_length
    return out


def flux_table(h: int, w: int, **patch) -> tuple:
    model = build('flux')
    with patch_dit(model, train_grid=(TRAIN, TRAIN), **patch) as handle:
        return handle.rope(flux_ids(h, w))


def table_by_hand(ids: torch.Tensor, freqs: list, mags: list) -> tuple:
    cos, sin = [], []
    for a, (f, m) in enumerate(zip(freqs, mags)):
        angles = torch.outer(ids[:, a].double(), f)
        cos.append((m * angles.cos()).repeat_interleave(2, dim=1).float())
        sin.append((m * angles.sin()).repeat_interleave(2, dim=1).float())
    return torch.cat(cos, -1), torch.cat(sin, -1)


@pytest.mark.parametrize('s', [2, 4])
def test_position_interpolation_divides_every_frequency_as_diffusers_linear_factor(s):
    n = TRAIN * s
    cos, sin = flux_table(n, n, scaling='linear')
    ids = flux_ids(n, n)
    want = table_by_hand(ids, [base(4), base(6) / s, base(6) / s], [1, 1, 1])
    for got, hand in zip((cos, sin), want):
        torch.testing.assert_close(got, hand, rtol=0, atol=1e-6)
    dcos, dsin = get_1d_rotary_pos_embed(6, ids[:, 1], THETA, use_real=True, linear_factor=s, freqs_dtype=torch.float64)
    torch.testing.assert_close(cos[:, 4:10], dcos, rtol=0, atol=1e-6)  # the row axis: diffusers' own PI
    torch.testing.assert_close(sin[:, 4:10], dsin, rtol=0, atol=1e-6)


@pytest.mark.parametrize('s', [2, 4])
def test_ntk_changes_the_base_as_diffusers_ntk_factor(s):
    n = TRAIN * s
    cos, sin = flux_table(n, n, scaling='ntk')
    ids = flux_ids(n, n)
    d = 6
    ntk = 1.0 / (THETA * s ** (d / (d - 2))) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    want = table_by_hand(ids, [base(4), ntk, ntk], [1, 1, 1])
    for got, hand in zip((cos, sin), want):
        torch.testing.assert_close(got, hand, rtol=0, atol=1e-6)
    dcos, _ = get_1d_rotary_pos_embed(d, ids[:, 2], THETA, use_real=True, ntk_factor=s ** (d / (d - 2)),
                                      freqs_dtype=torch.float64)
    torch.testing.assert_close(cos[:, 10:], dcos, rtol=0, atol=1e-6)


@pytest.mark.parametrize('s', [2, 4])
def test_yarn_keeps_fast_interpolates_slow_and_applies_its_temperature(s):
    n = TRAIN * s
    cos, sin = flux_table(n, n, scaling='yarn')
    ids = flux_ids(n, n)
    mag = 0.1 * math.log(s) + 1
    f = yarn_by_hand(base(6), s, TRAIN)
    want = table_by_hand(ids, [base(4), f, f], [1, mag, mag])
    for got, hand in zip((cos, sin), want):
        torch.testing.assert_close(got, hand, rtol=0, atol=1e-6)
    # the temperature: q and k at the origin are scaled by the magnitude, their logit by its square
    assert cos[0, 4:].tolist() == pytest.approx([mag] * 12)


def test_yarn_with_other_betas_and_per_axis_methods():
    n = TRAIN * 2
    cos, sin = flux_table(n, n, scaling={'h': {'scaling': 'yarn', 'yarn_beta_fast': 4.0, 'yarn_beta_slow': 0.5},
                                         'w': 'linear'})
    mag = 0.1 * math.log(2) + 1
    want = table_by_hand(flux_ids(n, n), [base(4), yarn_by_hand(base(6), 2, TRAIN, 0.5, 4.0), base(6) / 2],
                         [1, mag, 1])
    torch.testing.assert_close((cos, sin), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize('s', [2, 4])
def test_riflex_lowers_only_the_intrinsic_frequency_of_the_time_axis(s):
    """Wan (head_dim 12: time 4 channels, periods 6 and 628; rows and columns 4 each), 4 latent frames
    trained and repeating after 6, run on 4s frames: only time's intrinsic frequency changes; rows and
    columns at their trained size stay."""
    model = build('wan')
    frames = 4 * s
    with patch_dit(model, scaling={'t': 'riflex'}, train_grid=(4, 4, 4), riflex_repetition=6) as handle:
        cos, sin = handle.rope(torch.zeros(1, 4, frames, 8, 8))
    t = torch.arange(frames, dtype=torch.float64)
    ft = riflex_by_hand(base(4), frames, 6)
    assert (ft != base(4)).sum() == 1
    got = cos.reshape(frames, 4, 4, -1)[:, 0, 0, :4]
    torch.testing.assert_close(got, torch.outer(t, ft).cos().repeat_interleave(2, 1).float(), rtol=0, atol=1e-6)
    spatial = cos.reshape(frames, 4, 4, -1)[0, :, :, 4:]
    with torch.no_grad():
        own = build('wan').rope(torch.zeros(1, 4, frames, 8, 8))[0].reshape(frames, 4, 4, -1)[0, :, :, 4:]
    torch.testing.assert_close(spatial, own, rtol=0, atol=0)


def test_riflex_on_hunyuan_video_table_is_the_papers_example():
    """The paper's HunyuanVideo numbers (base 256, 16 time channels, N = 48 frames, L = 66) through the
    same per-axis call the hosts make: k = 4 (1-based)."""
    from vispe.integrations.diffusers.scaling import AxisScaling
    f = 1.0 / 256.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    got, mag = AxisScaling('riflex', riflex_repetition=48).frequencies(f, 66.0, 33.0)
    torch.testing.assert_close(got, riflex_by_hand(f, 66, 48), rtol=0, atol=0)
    assert int((got != f).nonzero()) == 3 and mag == 1.0


def test_target_fixes_the_factor_in_pixels():
    """FLUX: 16 pixels per token, so 128 px over a 4-token training grid is factor 2 at every grid."""
    cos, _ = flux_table(4, 4, scaling='linear', target=(128, 128))
    want = table_by_hand(flux_ids(4, 4), [base(4), base(6) / 2, base(6) / 2], [1, 1, 1])[0]
    torch.testing.assert_close(cos, want, rtol=0, atol=1e-6)


def test_nothing_changes_at_or_below_the_training_grid():
    model = build('flux')
    kw = inputs('flux', (TRAIN, TRAIN))
    with torch.no_grad():
        want = forward(model, kw)
        for method in ('linear', 'ntk', 'yarn', 'riflex'):
            with patch_dit(model, scaling=method, train_grid=(TRAIN, TRAIN)):
                torch.testing.assert_close(forward(model, kw), want, rtol=0, atol=1e-6)


def test_sd3_scaling_acts_on_its_sincos_frequencies():
    """SD3's table: per axis [sin | cos] of coordinate r * base / M; position interpolation at 2x divides
    the per-token frequencies by 2 (the coordinates of a 2x grid fall where the trained ones did)."""
    model = build('sd3')  # base 4, M 16
    with patch_dit(model, scaling='linear') as handle:
        table = handle.rope(8, 8, torch.device('cpu')).reshape(8, 8, -1)
    half = 4  # C / 4 with C = 16
    omega = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    rows = torch.arange(8, dtype=torch.float64) + (16 - 8) // 2
    angles = torch.outer(rows, omega * (4 / 16) / 2)
    torch.testing.assert_close(table[:, 0, 8:], torch.cat([angles.sin(), angles.cos()], 1).float(), rtol=0, atol=1e-6)


def test_a_schedule_changes_the_scaling_with_the_denoising_step():
    calls = []

    def schedule(t, axis):
        calls.append((round(t, 3), axis))
        return 'yarn' if t < 0.5 else 'none'

    model = build('flux')
    early, late = inputs('flux', (8, 8), timestep=0.9), inputs('flux', (8, 8), timestep=0.2)
    with torch.no_grad():
        plain_early = forward(model, early)
        with patch_dit(model, scaling='yarn', train_grid=(TRAIN, TRAIN)):
            yarn_late = forward(model, late)
        with patch_dit(model, schedule=schedule, train_grid=(TRAIN, TRAIN)):
            torch.testing.assert_close(forward(model, early), plain_early, rtol=0, atol=1e-6)
            torch.testing.assert_close(forward(model, late), yarn_late, rtol=0, atol=1e-6)
    assert calls == [(0.9, 'h'), (0.9, 'w'), (0.2, 'h'), (0.2, 'w')]
    assert model.pos_embed.__class__.__name__ == 'FluxPosEmbed'


def test_a_schedule_reads_wans_timestep_in_thousandths_and_refuses_mixed_steps():
    seen = []
    model = build('wan')
    with patch_dit(model, schedule=lambda t, axis: seen.append(t), train_grid=(2, 4, 4)):
        with torch.no_grad():
            forward(model, inputs('wan', (2, 4, 4), timestep=0.25))
        assert seen == [0.25] * 3
        with pytest.raises(ValueError, match='one timestep per forward'):
            forward(model, dict(inputs('wan', (2, 4, 4), batch=2), timestep=torch.tensor([100.0, 900.0])))
        assert model.rope.noise_level is None  # nothing of the failed forward stays
    with pytest.raises(ValueError, match='unknown scaling options'):
        with patch_dit(model, schedule=lambda t, axis: {'factr': 2.0}, train_grid=(2, 4, 4)):
            forward(model, inputs('wan', (2, 4, 4)))


def _ltx_table(patch, frames, rows, cols):
    model = build('ltx_video')
    with patch_dit(model, train_grid=(2, 4, 4), **patch) as handle:
        return handle.rope(torch.zeros(1, 1, 4), frames, rows, cols, (8 / 25, 32, 32))


def _ltx_by_hand(freqs, frames, rows, cols):
    """LTX's table by its formula: coordinate ``i * s_a * p_a / base_a``, angle ``f (2c - 1)``, the three
    axes interleaved per frequency, 2 leftover channels first (cos 1, sin 0)."""
    scale, base = (8 / 25, 32, 32), (20, 2048, 2048)
    axes = [torch.arange(n, dtype=torch.float64) * s / b for n, s, b in zip((frames, rows, cols), scale, base)]
    coords = torch.stack(torch.meshgrid(*axes, indexing='ij'), -1).reshape(-1, 3)
    angles = freqs[None] * (2 * coords[..., None] - 1)            # (N, 3, F)
    cos = angles.cos().transpose(1, 2).flatten(1).repeat_interleave(2, -1)
    return torch.cat([torch.ones(cos.shape[0], 2, dtype=torch.float64), cos], -1).float()


def test_ltx_video_scales_its_per_token_frequencies_from_high_to_low():
    """LTX's frequencies increase with k; NTK keeps the highest per-token frequency (the last) and divides
    the lowest (the first) by s; position interpolation divides all. (LTX computes angles up to
    10^4 pi / 2 in float32, so its own table carries ~1e-3 of rounding against this float64 one.)"""
    f = (10000.0 ** torch.linspace(0, 1, 5, dtype=torch.float64)) * math.pi / 2
    want_base = _ltx_by_hand(f.expand(3, -1), 4, 8, 8)
    cos, _ = _ltx_table({}, 4, 8, 8)
    torch.testing.assert_close(cos[0], want_base, rtol=0, atol=5e-3)
    cos, _ = _ltx_table({'scaling': 'linear'}, 4, 8, 8)
    torch.testing.assert_close(cos[0], _ltx_by_hand(f.expand(3, -1) / 2, 4, 8, 8), rtol=0, atol=5e-3)
    cos, _ = _ltx_table({'scaling': 'ntk'}, 4, 8, 8)
    k = torch.arange(5, dtype=torch.float64)
    ntk = f * 2.0 ** (-(4 - k) / 4)   # descending index 4 - k: the highest kept, the lowest halved
    torch.testing.assert_close(cos[0], _ltx_by_hand(ntk.expand(3, -1), 4, 8, 8), rtol=0, atol=5e-3)
