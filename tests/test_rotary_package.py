"""The rotary package `vispe.rotary`: the frequency-scaling table against transformers' own rope
init functions, GTA's and PRoPE's maps through the shared memory-lean dispatch against autograd of
the reference kernels, and one base class for every rotary encoding."""
import math

import pytest
import torch

import vispe
from vispe.attention import pe_attention
from vispe.cameras import Cameras
from vispe.rotary import (
    FREQUENCY_SCALING, RotationPE, apply_rotation, axial_frequencies, rotate_qk, scale_frequencies,
)
from vispe.rotary.kernels import apply_block_rotation, apply_pair_rotation
from conftest import random_intrinsics, random_poses

DT = torch.float64
HEAD_DIM, THETA = 32, 100.0
ROTARY_ENCODINGS = ('rope_axial', 'rope2d', 'rope_mixed', 'liere', 'comrope_ap', 'comrope_ld', 'string_cayley',
                    'string_circulant', 'gta', 'gta_multiview', 'prope', 'rope_golden', 'rope_spiral')


def _transformers_inv_freq(rope_type: str, max_positions: int, seq_len=None, **params):
    """transformers' own frequencies and attention factor for a Llama config of head dim 32."""
    transformers = pytest.importorskip('transformers')
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = transformers.LlamaConfig(hidden_size=2 * HEAD_DIM, num_attention_heads=2,
                                      max_position_embeddings=max_positions,
                                      rope_parameters={'rope_type': rope_type, 'rope_theta': THETA, **params})
    return ROPE_INIT_FUNCTIONS[rope_type](config, 'cpu', seq_len=seq_len)


def _llama_table() -> torch.Tensor:
    return axial_frequencies(HEAD_DIM // 2, THETA, step=2.0, dim=HEAD_DIM)


# ------------------------------------------------------------------ frequencies and their scaling
def test_scaling_table_names_every_method_and_rejects_others():
    assert tuple(FREQUENCY_SCALING) == ('none', 'linear', 'ntk', 'yarn', 'riflex')
    with pytest.raises(ValueError, match=r"one of \('none', 'linear', 'ntk', 'yarn', 'riflex'\), got 'dynamic'"):
        scale_frequencies(_llama_table(), 2.0, 'dynamic', 16.0)
    rope_axial = vispe.pe_info('rope_axial')['cls']
    with pytest.raises(ValueError, match=r"scaling.* of encoding 'rope_axial'.*'none', 'linear', 'ntk', 'yarn', 'riflex'"):
        rope_axial(vispe.PEContext(dim=64, num_heads=2), scaling='longrope')


def test_geometric_table_is_llamas_inv_freq_bit_for_bit():
    expected = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
    assert torch.equal(_llama_table(), expected)


def test_no_scaling_and_factors_up_to_one_keep_the_frequencies():
    base = _llama_table()
    for method in FREQUENCY_SCALING:
        freqs, magnitude = scale_frequencies(base, 1.0, method, 16.0)
        assert torch.equal(freqs, base) and magnitude == 1.0
    assert torch.equal(scale_frequencies(base, 3.0, 'none', 16.0)[0], base)


def test_linear_scaling_is_transformers_linear():
    expected, factor = _transformers_inv_freq('linear', 16, factor=4.0)
    freqs, magnitude = scale_frequencies(_llama_table(), 4.0, 'linear', 16.0)
    torch.testing.assert_close(freqs, expected, rtol=1e-6, atol=0)
    assert magnitude == factor == 1.0


def test_ntk_scaling_is_transformers_dynamic_ntk_at_the_longer_length():
    """transformers' dynamic NTK with factor 1 at ``s`` times the training length raises the base to
    ``theta s^(d / (d - 2))``: the static NTK-aware scaling by ``s``."""
    expected, _ = _transformers_inv_freq('dynamic', 16, seq_len=48, factor=1.0)
    freqs, magnitude = scale_frequencies(_llama_table(), 3.0, 'ntk', 16.0)
    torch.testing.assert_close(freqs, expected, rtol=1e-5, atol=0)
    assert freqs[0] == _llama_table()[0] and magnitude == 1.0  # the highest frequency is kept


def test_yarn_scaling_matches_transformers_outside_the_ramp_and_by_hand_inside():
    """Both keep frequencies that turn more than beta_fast times over the training length and
    interpolate those under beta_slow; between them transformers ramps linearly in the pair index,
    vispe in the number of turns (checked by hand). The magnitude is transformers' attention factor."""
    train, factor, fast, slow = 16.0, 4.0, 8.0, 1.0
    expected, attention_factor = _transformers_inv_freq(
        'yarn', 64, factor=factor, original_max_position_embeddings=int(train), truncate=False,
        beta_fast=fast, beta_slow=slow)
    base = _llama_table()
    freqs, magnitude = scale_frequencies(base, factor, 'yarn', train, fast, slow)
    turns = train * base / (2 * math.pi)
    outside = (turns >= fast) | (turns <= slow)
    assert outside.any() and (~outside).any()
    torch.testing.assert_close(freqs[outside], expected[outside], rtol=1e-6, atol=0)
    ramp = (turns[~outside] - slow) / (fast - slow)
    torch.testing.assert_close(freqs[~outside], base[~outside] * (ramp + (1 - ramp) / factor))
    assert magnitude == pytest.approx(attention_factor) == pytest.approx(0.1 * math.log(factor) + 1)


def test_rope_axial_yarn_table_has_the_scaled_frequencies_and_magnitude():
    """RoPE-Axial builds its table from the scaling table: at 3x the training grid, YaRN's
    frequencies per axis and its magnitude on every rotated pair."""
    pe = vispe.create_pe('rope_axial', dim=64, num_heads=2, grid_size=(4, 4), scaling='yarn').double()
    pos = vispe.grid(12, 12, train_grid=(4, 4), dtype=DT)
    table = pe.prepare(pos).state.q[0]  # (N, hd/2): x pairs then y pairs
    base = axial_frequencies(HEAD_DIM // 4, THETA, step=2.0, dim=HEAD_DIM // 2, dtype=DT)
    freqs, magnitude = scale_frequencies(base, 3.0, 'yarn', 4.0)
    token = 1 * 12 + 2  # row 1, column 2
    angles = torch.cat([2 * freqs, 1 * freqs])
    torch.testing.assert_close(table[token], torch.polar(torch.full_like(angles, magnitude), angles))


# ------------------------------------------------------------------ one dispatch, one backward
def _saved_output_path(t: torch.Tensor) -> bool:
    """Whether ``t``'s graph runs through the shared memory-lean Function (not the plain kernels)."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == '_SavedOutputRotationBackward':
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False


def _qkv(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, 2, n, HEAD_DIM, dtype=DT, generator=g).requires_grad_() for _ in range(3))


def _grads(out: torch.Tensor, wrt) -> tuple:
    g = torch.Generator().manual_seed(7)
    # the graph is kept: the reference may share the state (rotations built from parameters) with `out`
    return torch.autograd.grad(out, wrt, torch.randn(out.shape, dtype=out.dtype, generator=g), retain_graph=True)


def _sdpa(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_gta_backward_through_the_shared_path_equals_autograd_of_the_reference():
    pe = vispe.create_pe('gta', dim=2 * HEAD_DIM, num_heads=2).double()
    pos = vispe.grid(3, 4, num_prefix=1, dtype=DT)
    q, k, v = _qkv(pos.num_tokens)
    out = pe_attention(q, k, v, pe.prepare(pos), 0)
    assert _saved_output_path(out)
    table = pe.table(pos)
    ref = apply_pair_rotation(_sdpa(apply_pair_rotation(q, table), apply_pair_rotation(k, table),
                                    apply_pair_rotation(v, table)), table.conj())
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want)


def _multiview(views: int = 2, grid=(2, 3), num_prefix: int = 1):
    g = torch.Generator().manual_seed(3)
    cams = Cameras(random_intrinsics(views, g, (16, 24)), cam_to_world=random_poses(views, g), image_size=(16, 24))
    return vispe.positions.multiview(cams, grid, num_prefix=num_prefix, dtype=DT)


def test_gta_multiview_backward_including_the_translation_scale_equals_autograd_of_the_reference():
    """SE(3) blocks with a scaled translation are not orthogonal: their map (kind ``matrix``) takes
    its gradient through the inverse, and still equals autograd of the plain kernels."""
    pe = vispe.create_pe('gta_multiview', dim=2 * HEAD_DIM, num_heads=2, depth=2,
                         translation_scale=0.7).double()
    pos = _multiview()
    q, k, v = _qkv(pos.num_tokens)
    state = pe.prepare(pos)
    out = pe_attention(q, k, v, state, 1)
    assert _saved_output_path(out)
    (se3_q, se3_k, se3_o), (so2_q, so2_k, so2_o) = state.state

    def ref_map(x, blocks, table):
        a, b = x.split([pe.se3_dims, pe.so2_dims], dim=-1)
        return torch.cat([apply_block_rotation(a, blocks[1]), apply_pair_rotation(b, table)], -1)

    ref = ref_map(_sdpa(ref_map(q, se3_q, so2_q), ref_map(k, se3_k, so2_k), ref_map(v, se3_k, so2_k)), se3_o, so2_o)
    torch.testing.assert_close(out, ref)
    wrt = (q, k, v, pe.translation_scale)
    got, want = _grads(out, wrt), _grads(ref, wrt)
    assert want[-1][1] != 0
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_prope_backward_through_the_shared_path_equals_autograd_of_the_reference():
    pe = vispe.create_pe('prope', dim=2 * HEAD_DIM, num_heads=2).double()
    pos = _multiview()
    q, k, v = _qkv(pos.num_tokens)
    state = pe.prepare(pos)
    out = pe_attention(q, k, v, state, 0)
    assert _saved_output_path(out)

    def ref_map(x, maps):
        mat, rot_x, rot_y = maps
        a, b, c = x.split(pe.split, dim=-1)
        return torch.cat([apply_block_rotation(a, mat), apply_pair_rotation(b, rot_x, 'half'),
                          apply_pair_rotation(c, rot_y, 'half')], -1)

    maps = state.state
    ref = ref_map(_sdpa(ref_map(q, maps[0]), ref_map(k, maps[1]), ref_map(v, maps[1])), maps[2])
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(got, want)


def test_matrix_kind_gradients_of_non_orthogonal_blocks_equal_autograd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=DT, generator=g).requires_grad_()
    rot = (torch.eye(4, dtype=DT) + 0.5 * torch.randn(5, 2, 4, 4, dtype=DT, generator=g)).requires_grad_()
    out = apply_rotation(x, 'matrix', rot)
    assert _saved_output_path(out)
    ref = apply_block_rotation(x, rot)
    torch.testing.assert_close(out, ref)
    for got, want in zip(_grads(out, (x, rot)), _grads(ref, (x, rot))):
        torch.testing.assert_close(got, want)


def test_half_table_kind_rotates_q_and_k_in_one_call_like_the_kernel():
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 2, 5, 12, dtype=DT, generator=g).requires_grad_() for _ in range(2))
    table = torch.polar(torch.ones(5, 4, dtype=DT), torch.randn(5, 4, dtype=DT, generator=g))  # partial rotary
    rq, rk = rotate_qk(q, k, table, table, 'half_table')
    assert _saved_output_path(rq)
    ref_q, ref_k = apply_pair_rotation(q, table, 'half'), apply_pair_rotation(k, table, 'half')
    torch.testing.assert_close(rq, ref_q)
    torch.testing.assert_close(rk, ref_k)
    out, ref = rq * rk.detach() + rk, ref_q * ref_k.detach() + ref_k
    for got, want in zip(_grads(out, (q, k)), _grads(ref, (q, k))):
        torch.testing.assert_close(got, want)


def test_unknown_rotation_kind_is_a_clear_error():
    with pytest.raises(ValueError, match=r"rotation kind must be one of \('table', .*\), got 'rope'"):
        apply_rotation(torch.randn(4, 8), 'rope', torch.randn(4, 4))


# ------------------------------------------------------------------ one base class
@pytest.mark.parametrize('name', ROTARY_ENCODINGS)
def test_every_rotary_encoding_is_a_rotation_pe(name):
    assert issubclass(vispe.pe_info(name)['cls'], RotationPE)


def test_value_hooks_follow_the_value_transform_option():
    for name in ('gta', 'gta_multiview', 'prope'):
        on = vispe.create_pe(name, dim=64, num_heads=2)
        off = vispe.create_pe(f'{name}:value_transform=false', dim=64, num_heads=2)
        assert {'qk', 'value', 'output'} <= on.hooks and off.hooks == {'qk'}
