"""`vispe.checks`: each property check passes what has the property and fails what lacks it, with the number
it measured; vispe's multimodal ids and rotary encodings checked with them."""
import math

import pytest
import torch
import torch.nn.functional as F

import vispe
from vispe import checks
from vispe.encodings.mrope import MRoPE


def _rope_logits(coords, layout='half'):
    """Logits of one query and one key vector rotated at every token by 2D axial RoPE; ``layout`` 'mismatch'
    applies interleaved tables with rotate-half (timm PR #2692)."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)
    freqs = 1 / 100 ** (torch.arange(2, dtype=torch.float64) / 2)
    angles = torch.cat([coords[:, :1] * freqs, coords[:, 1:] * freqs], -1).double()  # (N, 4)
    if layout == 'half':
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    else:
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)

    def rot(x):
        a, b = x.chunk(2, -1)
        return x * cos + torch.cat([-b, a], -1) * sin
    return rot(q.expand(len(coords), -1)) @ rot(k.expand(len(coords), -1)).T


def test_offset_invariance_passes_rope_and_fails_a_layout_mismatch():
    coords = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(5), indexing='ij'), -1).reshape(-1, 2)
    good = checks.offset_invariance(_rope_logits(coords.double()), coords, rtol=1e-12)
    assert good.passed and good.measured < 1e-12 and good.check == 'relative_logits'
    bad = checks.offset_invariance(_rope_logits(coords.double(), 'mismatch'), coords)
    assert bad.failed and bad.measured > 1e-2


def test_offset_invariance_takes_tokens_in_any_order():
    coords = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing='ij'), -1).reshape(-1, 2)
    perm = torch.randperm(16)
    logits = _rope_logits(coords.double())[perm][:, perm]
    assert checks.offset_invariance(logits, coords[perm], rtol=1e-12).passed


def test_shift_invariance_of_an_absolute_map_fails():
    coords = torch.rand(6, 2, dtype=torch.float64) * 4
    assert checks.shift_invariance(lambda c: _rope_logits(c), coords, torch.tensor([1.5, -2.0]), atol=1e-10).passed
    absolute = checks.shift_invariance(lambda c: c @ c.T, coords, torch.tensor([1.5, -2.0]))
    assert absolute.failed and absolute.measured > 1


def test_moves_output_wants_a_difference():
    a = torch.randn(3, 4)
    assert checks.moves_output(a, a.clone()).failed
    r = checks.moves_output(a, a + 0.1, check='grid_change')
    assert r.passed and r.at_least and r.check == 'grid_change' and '>=' in r.evidence()


def test_float32_tables_and_rounded_frequencies():
    freqs = 1 / 10000 ** (torch.arange(0, 16, 2) / 16)
    assert checks.float32_tables({'inv_freq': freqs}).passed
    narrow = checks.float32_tables({'inv_freq': freqs.bfloat16(), 'other': freqs})
    assert narrow.failed and narrow.measured == 1 and 'inv_freq (bfloat16)' in narrow.reason
    assert checks.geometric_frequencies(freqs).passed
    rounded = checks.geometric_frequencies(freqs.bfloat16().float())
    assert rounded.failed and rounded.measured > 1e-4
    assert not checks.geometric_frequencies(torch.linspace(1, 8, 8)).applicable  # not a progression


def test_padded_equals_alone_and_matches_reference():
    x = [torch.randn(3, 4), torch.randn(5, 4)]
    assert checks.padded_equals_alone(x, [t.clone() for t in x]).passed
    assert checks.padded_equals_alone(x, [x[0], x[1] + 1e-2]).failed
    ref = torch.randn(10)
    assert checks.matches_reference(ref + 1e-7, ref, check='float32_tables', compared='x', rtol=1e-5).passed
    assert checks.matches_reference(ref.bfloat16(), ref, check='float32_tables', compared='x', rtol=1e-5).failed


@pytest.mark.parametrize('mode', ['bicubic', 'bilinear'])
def test_resample_mode_names_the_mode_that_fits(mode):
    table = torch.randn(4, 4, 6)
    resized = F.interpolate(table.permute(2, 0, 1)[None], size=(7, 5), mode=mode, align_corners=False)[0]
    resized = resized.permute(1, 2, 0)
    other = 'bilinear' if mode == 'bicubic' else 'bicubic'
    assert checks.resample_mode(resized, table, mode).passed
    wrong = checks.resample_mode(resized, table, other)
    assert wrong.failed and wrong.reason == f'best fit: {mode}'
    with pytest.raises(ValueError, match='declared must be one of'):
        checks.resample_mode(resized, table, 'cubic')


def test_ids_checks_on_hand_built_ids():
    # M-RoPE's worked example (ENCODINGS.md): text x3, vision start, a 2x2 merged image, vision end, text x2
    t = [0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8]
    h = [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8]
    w = [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]
    ids = torch.tensor([t, h, w])
    image = [4, 5, 6, 7]
    assert checks.ids_cover_tokens(ids, 11, distinct=[image]).passed
    assert checks.ids_cover_tokens(ids, 12).failed  # ids for another token count
    assert checks.ids_follow_grid(ids[1:, image], (2, 2)).passed
    one_d = torch.arange(11).expand(3, -1)
    assert checks.ids_follow_grid(one_d[1:, image], (2, 2)).failed
    assert checks.time_ids_monotone(ids[0, image][None]).passed
    assert checks.time_ids_monotone(torch.tensor([[0, 0], [1, 1], [1, 1]])).failed  # two frames at one time
    assert checks.time_ids_monotone(torch.tensor([[0, 0], [1, 1], [1, 1]]), strict=False).passed
    assert checks.time_ids_monotone(torch.tensor([[0, 1]])).failed  # a still image with a time axis
    assert checks.head_split([16, 24, 24], 128).passed and checks.head_split([16, 24, 20], 128).failed


def test_results_refuse_unknown_checks_and_statuses():
    with pytest.raises(ValueError, match='check must be one of'):
        checks.CheckResult('shift', checks.PASSED)
    with pytest.raises(ValueError, match='status must be'):
        checks.CheckResult('head_split', 'ok')
    na = checks.not_applicable('head_split', 'x', 'no sections')
    assert not na.applicable and 'no sections' in str(na)


# ---------------------------------------------------------------------------------------------- vispe's ids
MULTIMODAL = [n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal']
SCHEMES_ON_THE_GRID = [n for n in MULTIMODAL if issubclass(vispe.pe_info(n)['cls'], MRoPE)]  # (t, h, w) on the grid


def _layout_ids(scheme, tokens_per_second=None):
    """Ids of text, a still image, text and a timed video of four frames half a second apart."""
    timed = 'tokens_per_second' in vispe.pe_info(scheme)['options']
    opts = dict(tokens_per_second=tokens_per_second) if tokens_per_second is not None and timed else {}
    heads = dict(num_heads=3) if scheme == 'mhrope' else {}
    encoding = vispe.create_pe(scheme, dim=48 * max(1, heads.get('num_heads', 1)), **heads, **opts)
    layout = [vispe.Text(3), vispe.Image(grid=(1, 4, 4), merge=2), vispe.Text(2),
              vispe.Video(grid=(4, 4, 6), fps=4.0, merge=2), vispe.Text(2)]
    ids, _ = encoding.position_ids(vispe.sequence(layout))
    return ids


@pytest.mark.parametrize('scheme', MULTIMODAL)
def test_every_scheme_gives_every_token_an_id_and_distinct_ids_per_block(scheme):
    ids = _layout_ids(scheme)
    image = list(range(3, 7))
    frames = [list(range(9 + 6 * f, 15 + 6 * f)) for f in range(4)]
    result = checks.ids_cover_tokens(ids, 3 + 4 + 2 + 24 + 2, distinct=[image] + frames)
    assert result.passed, result


@pytest.mark.parametrize('scheme', SCHEMES_ON_THE_GRID)
def test_grid_schemes_follow_the_token_grid_and_time(scheme):
    ids = _layout_ids(scheme, tokens_per_second=2.0)
    image = list(range(3, 7))
    frames = [list(range(9 + 6 * f, 15 + 6 * f)) for f in range(4)]
    assert checks.ids_follow_grid(ids[1:, image], (2, 2)).passed
    assert checks.ids_follow_grid(ids[1:, frames[0]], (2, 3)).passed
    assert checks.time_ids_monotone(ids[0, image][None]).passed
    # frames 2 / fps = 0.5 s apart, 2 ids per second: one id step per frame
    assert checks.time_ids_monotone(ids[0][torch.tensor(frames)]).passed


def test_time_truncated_before_scaling_collapses_frames():
    """transformers PR #48669, rebuilt on vispe's M-RoPE ids: frame times truncated to whole seconds before
    the scaling put frames half a second apart on one id."""
    ids = _layout_ids('mrope', tokens_per_second=2.0)
    frames = torch.tensor([list(range(9 + 6 * f, 15 + 6 * f)) for f in range(4)])
    t = ids[0][frames]
    seconds = torch.arange(4, dtype=torch.float64) * 0.5
    truncated = (seconds.long() * 2).to(t.dtype)[:, None] + t[:1, :1]
    assert checks.time_ids_monotone(t).passed
    assert checks.time_ids_monotone(truncated.expand_as(t)).failed


# ---------------------------------------------------------------------------------------------- vispe's encodings
@pytest.mark.parametrize('name', ['rope_axial', 'rope_mixed', 'comrope_ap', 'string_cayley', 'liere:block=2', 'rope2d'])
def test_rotary_encodings_have_relative_logits_on_the_grid(name):
    pe = vispe.create_pe(name, dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1).double().eval()
    pos = vispe.grid(5, 6, num_prefix=1, dtype=torch.float64)
    q = torch.randn(1, 2, 1, 16, dtype=torch.float64).expand(-1, -1, pos.num_tokens, -1)
    k = torch.randn(1, 2, 1, 16, dtype=torch.float64).expand(-1, -1, pos.num_tokens, -1)
    q2, k2 = pe.prepare(pos).qk(q, k, 1)
    logits = (q2 @ k2.transpose(-1, -2))[..., 1:, 1:]
    assert checks.offset_invariance(logits, pos.coords, rtol=1e-12).passed


def test_liere_with_dense_blocks_fails_the_relative_check():
    """LieRE with 8x8 generators does not commute: documented as not shift invariant, and the check sees it."""
    pe = vispe.create_pe('liere', dim=32, num_heads=2, depth=2, grid_size=(4, 4), num_prefix_tokens=1).double()
    pos = vispe.grid(5, 6, num_prefix=1, dtype=torch.float64)
    q = torch.randn(1, 2, 1, 16, dtype=torch.float64).expand(-1, -1, pos.num_tokens, -1)
    q2, k2 = pe.prepare(pos).qk(q, q, 1)
    result = checks.offset_invariance((q2 @ k2.transpose(-1, -2))[..., 1:, 1:], pos.coords)
    assert result.failed and not pe.shift_invariant
    assert math.isfinite(result.measured)
