"""The fused Triton rotations (`vispe.rotary.fused`) equal the reference kernels of
`vispe.rotary`: outputs, input gradients and rotation (parameter) gradients, for q and k read
as views of a fused qkv projection. With a GPU the compiled kernels run on it; without one, Triton's
interpreter runs them on CPU tensors.

Triton chooses the interpreter when it is imported (its own library functions are jitted then, and
vispe imports it with `vispe.rotary`), so on the CPU each check runs in one child process started with
``TRITON_INTERPRET=1`` and shared by the module (a spawned `multiprocessing` pool; an assertion there
fails the test here, with the child's traceback). Each ``test_*`` below hands its check, the function
after it, to ``run``. Every comparison also counts the kernel launches, so a check cannot pass on the
reference path alone.
"""
import contextlib
import importlib.util
import multiprocessing
import sys

import pytest
import torch

triton = pytest.importorskip('triton')

import vispe  # noqa: E402
from vispe.encodings.multimodal import apply_rotary as multimodal_rotary  # noqa: E402
from vispe.attention import pe_attention  # noqa: E402
from vispe.cameras import Cameras  # noqa: E402
from vispe.rotary import apply_rotation, autograd, fused as triton_kernels, rotate_qk, rotation_table  # noqa: E402
from vispe.rotary.kernels import block_matrices, pad_identity  # noqa: E402
from conftest import random_intrinsics, random_poses  # noqa: E402


DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')


@pytest.fixture(scope='module')
def run():
    """``run(check, *args)``: ``check(*args)`` here on a GPU, else in the interpreter process."""
    if DEVICE.type == 'cuda':
        yield lambda check, *args: check(*args)
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('TRITON_INTERPRET', '1')  # inherited by the worker, which imports triton afresh
        pool = multiprocessing.get_context('spawn').Pool(1)
    with pool:
        yield lambda check, *args: pool.apply(check, args)


@contextlib.contextmanager
def fused(mode):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autograd, 'FUSED', mode)
        yield


@contextlib.contextmanager
def counted_launches():
    """The kinds of the kernel launches made inside the block (forward and backward alike)."""
    assert DEVICE.type == 'cuda' or type(triton_kernels._rotation_kernel).__name__ == 'InterpretedFunction'
    calls = []
    launch = triton_kernels._launch

    def counted(*args, **kwargs):
        calls.append(args[0])
        return launch(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_kernels, '_launch', counted)
        yield calls


def fused_qkv(B=2, H=2, N=7, hd=16, dtype=torch.float32, with_v=False):
    """q and k (and v) as timm's attention makes them: ``(B, H, N, hd)`` views of one ``(B, N, 3 H hd)`` leaf."""
    qkv = torch.randn(B, N, 3 * H * hd, dtype=dtype, device=DEVICE).requires_grad_()
    q, k, v = qkv.reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4).unbind(0)
    return (qkv, q, k, v) if with_v else (qkv, q, k)


def compare(run, leaves, expected=2, tol=1e-5):
    """``run()`` (a tuple of outputs) with the fused kernels and with the reference: equal outputs and
    gradients of ``leaves`` for random cotangents, and ``expected`` launches in the fused run."""
    results = {}
    for mode in ('off', 'on'):
        for leaf in leaves:
            leaf.grad = None
        with fused(mode), counted_launches() as launches:
            torch.manual_seed(0)  # the same jittered positions in both runs
            outs = run()
            torch.manual_seed(1)  # cotangents drawn alike whatever the outputs' layouts
            torch.autograd.backward(outs, [torch.randn(o.shape, dtype=o.dtype, device=o.device) for o in outs])
        assert len(launches) == (expected if mode == 'on' else 0)
        results[mode] = [o.detach() for o in outs] + [leaf.grad for leaf in leaves]
    for got, want in zip(results['on'], results['off']):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def grid_table(N, P, lead=(), magnitude=1.0, num_prefix=1):
    """A complex table ``(*lead, num_prefix + N, P)`` with identity rows for the prefix tokens, as
    `rope.PairRotaryPE.table` builds it (``magnitude`` != 1: YaRN)."""
    return pad_identity(rotation_table(torch.randn(*lead, N, P, device=DEVICE) * 3, magnitude), num_prefix, 'table')


def orthogonal_blocks(*lead, b):
    a = torch.randn(*lead, b, b, device=DEVICE)
    return torch.linalg.matrix_exp(a - a.mT)


def invertible_blocks(*lead, b):
    """Well-conditioned ``b x b`` matrices far from orthogonal (rows scaled by 1-2, off-diagonal noise),
    so that a gradient taking ``R^-1`` for ``R^T`` shows."""
    scale = 1 + torch.rand(*lead, b, 1, device=DEVICE)
    return scale * torch.eye(b, device=DEVICE) + 0.3 * torch.randn(*lead, b, b, device=DEVICE)


# ------------------------------------------------------------------ pair rotations
@pytest.mark.parametrize('hd,grid', [(16, 6), (64, 6), (72, 6), (80, 6), (128, 40)])
def test_yarn_table_with_prefix_rows_matches_reference_on_fused_qkv_views(run, hd, grid):
    run(yarn_table_with_prefix_rows, hd, grid)


def yarn_table_with_prefix_rows(hd, grid):
    """A class token and a 2 x 3 (or 5 x 8: several token blocks per program grid) grid."""
    qkv, q, k = fused_qkv(N=1 + grid, hd=hd)
    table = grid_table(grid, hd // 2, magnitude=1.3).requires_grad_()
    compare(lambda: rotate_qk(q, k, table, table, 'table'), [qkv, table])


@pytest.mark.parametrize('lead', [(2, 1), (2,)], ids=['per_sample', 'per_head'])
def test_partial_rotary_table_matches_reference(run, lead):
    run(partial_rotary_table, lead)


def partial_rotary_table(lead):
    qkv, q, k = fused_qkv(hd=20)
    table = grid_table(6, 7, lead).requires_grad_()  # 14 of 20 channels rotated, 6 pass through
    compare(lambda: rotate_qk(q, k, table, table, 'table'), [qkv, table])


def test_angles_match_reference_with_gradients(run):
    run(angles_with_gradients)


def angles_with_gradients():
    qkv, q, k = fused_qkv(hd=16)
    angles = torch.cat([torch.zeros(2, 1, 8), torch.randn(2, 6, 8)], 1).to(DEVICE).requires_grad_()  # (H, N, P)
    compare(lambda: rotate_qk(q, k, angles, angles, 'pair'), [qkv, angles])


def test_unit_table_of_angles_matches_reference(run):
    run(unit_table_of_angles)


def unit_table_of_angles():
    qkv, q, k = fused_qkv(hd=16)
    table = rotation_table(torch.randn(2, 7, 8, device=DEVICE))  # eval's cached tables (`angle_tables`)
    compare(lambda: rotate_qk(q, k, table, table, 'pair'), [qkv])


@pytest.mark.parametrize('kind', ['table', 'half_table'])
def test_bfloat16_matches_reference_to_its_rounding(run, kind):
    run(bfloat16_table, kind)


def bfloat16_table(kind):
    qkv, q, k = fused_qkv(hd=16, dtype=torch.bfloat16)
    table = grid_table(6, 8).requires_grad_()
    compare(lambda: rotate_qk(q, k, table, table, kind), [qkv, table], tol=2e-2)


@pytest.mark.parametrize('hd,pairs,lead,grid', [(64, 32, (), (2, 3)), (72, 24, (2, 1), (2, 3)),
                                                (80, 40, (2, 2), (3, 2)), (128, 48, (2, 1), (5, 8))],
                         ids=['shared', 'partial_per_sample', 'per_sample_and_head', 'partial_token_blocks'])
def test_rotate_half_table_matches_reference_on_fused_qkv_views(run, hd, pairs, lead, grid):
    """Pairs ``(j, j + P)`` of the first ``2 P`` channels (LLM layout, timm's rotate_half, PRoPE), YaRN
    magnitudes, a class token: one table for the batch, or per sample ``(B, 1, N, P)`` (M-RoPE) or per
    sample and head (MHRoPE); partial rotary (48 of 72, 96 of 128 channels); a 5 x 8 grid spans token blocks."""
    run(rotate_half_table, hd, pairs, lead, grid)


def rotate_half_table(hd, pairs, lead, grid):
    qkv, q, k = fused_qkv(N=1 + grid[0] * grid[1], hd=hd)
    table = grid_table(grid[0] * grid[1], pairs, lead, magnitude=1.3).requires_grad_()
    compare(lambda: rotate_qk(q, k, table, table, 'half_table'), [qkv, table])


def test_cross_attention_rotates_q_and_k_in_their_own_launches(run):
    run(cross_attention)


def cross_attention():
    q = torch.randn(2, 2, 5, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 2, 7, 16, device=DEVICE, requires_grad=True)
    tq, tk = grid_table(4, 8).requires_grad_(), grid_table(6, 8).requires_grad_()
    compare(lambda: rotate_qk(q, k, tq, tk, 'table'), [q, k, tq, tk], expected=4)


# ------------------------------------------------------------------ block rotations
@pytest.mark.parametrize('b,hd', [(2, 16), (4, 16), (8, 16), (8, 20), (4, 18), (8, 128)])
def test_position_major_blocks_match_reference(run, b, hd):
    """LieRE / ComRoPE's layout: ``(H, N, nb, b, b)`` over ``(N, H, ...)`` memory; channels beyond
    whole blocks (hd 20 with b 8, hd 18 with b 4) pass through; hd 128 with b 8: two token blocks."""
    run(position_major_blocks, b, hd)


def position_major_blocks(b, hd):
    qkv, q, k = fused_qkv(hd=hd)
    rot = orthogonal_blocks(7, 2, hd // b, b=b).transpose(0, 1).requires_grad_()
    compare(lambda: rotate_qk(q, k, rot, rot, 'block'), [qkv, rot])


@pytest.mark.parametrize('lead', [(2, 2), (1,), ()], ids=['per_sample', 'shared_head', 'shared'])
def test_broadcast_blocks_match_reference(run, lead):
    run(broadcast_blocks, lead)


def broadcast_blocks(lead):
    qkv, q, k = fused_qkv(hd=16)
    rot = orthogonal_blocks(*lead, 7, 4, b=4).requires_grad_()
    compare(lambda: rotate_qk(q, k, rot, rot, 'block'), [qkv, rot])


@pytest.mark.parametrize('case', ['b4_expanded', 'b4_per_sample', 'b2_per_head', 'b8'])
def test_invertible_matrices_match_reference(run, case):
    """Kind ``matrix``: GTA's / PRoPE's per-token 4 x 4 maps as `block_matrices` builds them (one matrix
    expanded over the blocks at stride 0, identity rows for a class token, shared or per sample
    ``(B, 1, N, nb, 4, 4)``; head dim 18: 2 channels pass through), and dense per-head blocks; the
    gradient reaches the matrices through ``R^-T``, the input gradient through ``R^T``."""
    run(invertible_matrices, case)


def invertible_matrices(case):
    qkv, q, k = fused_qkv(hd=18 if case == 'b4_per_sample' else 16)
    b, batched = int(case[1]), case == 'b4_per_sample'
    if b == 4:  # per-token maps (N, 4, 4) or (B, N, 4, 4), expanded over 16 channels
        mats = invertible_blocks(*((2,) if batched else ()), 6, b=4).requires_grad_()
    else:
        mats = invertible_blocks(2, 7, 16 // b, b=b).requires_grad_()  # (H, N, nb, b, b)

    def rotated():
        rot = block_matrices(mats, 16, batched, num_prefix=1) if b == 4 else mats
        return rotate_qk(q, k, rot, rot, 'matrix')
    compare(rotated, [qkv, mats], tol=1e-4)


# ------------------------------------------------------------------ encodings end to end
@pytest.mark.parametrize('spec', ['rope_axial:scaling=yarn', 'rope2d', 'rope_mixed', 'liere:block=2', 'liere:block=8',
                                  'comrope_ap:block=4', 'comrope_ld:block=8', 'rope_timm:rotate_half=true',
                                  'rope_timm:rope_type=dinov3,rotate_half=true', 'rope_golden',
                                  'rope_spiral:corners=clamp'])
def test_encoding_trains_identically_with_fused_kernels(run, spec):
    """The q / k hook on a non-square grid larger than the training grid, with a class token; gradients
    reach q, k and the encoding's parameters alike (LieRE block 8 on head dim 20: 4 channels pass through;
    ComRoPE: per-sample jittered rotations; timm's rotate-half layout: kind ``half_table``; rope2d: a
    ``half_table`` rotation of each axis' channel group)."""
    run(encoding_trains_identically, spec)


def encoding_trains_identically(spec):
    H, hd = 2, 20 if spec == 'liere:block=8' else 16
    pe = vispe.create_pe(spec, dim=H * hd, num_heads=H, depth=1, grid_size=(2, 3)).to(DEVICE)
    pos = vispe.positions.grid(3, 4, num_prefix=1, train_grid=(2, 3), device=DEVICE)
    qkv, q, k = fused_qkv(H=H, N=pos.num_tokens, hd=hd)
    # q and k share one rotation: one launch forward, one backward (per axis group in rope2d's layout)
    launches = 4 if spec == 'rope2d' else 2
    compare(lambda: pe.prepare(pos).qk(q, k, layer=0), [qkv, *pe.parameters()], launches, tol=1e-4)


@pytest.mark.parametrize('grid_mode', ['index', 'normalized'])
def test_string_cayley_rope_part_trains_identically_with_fused_kernels(run, grid_mode):
    """Cayley-STRING's ``RoPE(r) P x``: the dense ``P`` stays a batched product, its RoPE part is one
    launch for q and k forward, and three in backward (``RoPE^T grad`` for the input's gradient, then
    ``RoPE^T grad`` and ``RoPE^T y`` for ``P``'s, as the reference computes them); in eval one launch."""
    run(string_cayley_rope_part, grid_mode)


def string_cayley_rope_part(grid_mode):
    pe = vispe.create_pe(f'string_cayley:skew_init_std=0.1,grid_mode={grid_mode}', dim=32, num_heads=2, depth=1,
                         grid_size=(2, 3)).to(DEVICE)
    pos = vispe.positions.grid(3, 4, num_prefix=1, train_grid=(2, 3), device=DEVICE)
    qkv, q, k = fused_qkv(H=2, N=pos.num_tokens, hd=16)
    compare(lambda: pe.prepare(pos).qk(q, k, layer=0), [qkv, *pe.parameters()], 4, tol=1e-4)
    with torch.no_grad():
        pe.eval()
        want = pe.prepare(pos).qk(q, k, layer=0)
        with fused('on'), counted_launches() as launches:
            got = pe.prepare(pos).qk(q, k, layer=0)
    assert launches == ['table']
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('spec,launches', [('gta', 6), ('gta_multiview:se3_dims=8,so2_dims=8,translation_scale=1', 16),
                                            ('prope', 24)], ids=['gta', 'gta_multiview', 'prope'])
def test_attention_trains_identically_with_fused_kernels(run, spec, launches):
    """Every hook (q / k, value, output) of the encodings that map v and the attention output too, in
    attention with a class token: GTA's tables on a 3 x 4 grid; on three 2 x 3 views, gta_multiview's
    SE(3) maps (kind ``matrix``, channels 4-12 of 20 after 4 passed through) and SO(2) table, PRoPE's
    projective maps from per-sample cameras and its rotate-half quarters. The gradient reaches the
    cameras (and gta_multiview's translation scale) through ``R^-T``. Channel groups are rotated one
    launch each, q and k apart (``rotate_channels``): ``launches`` counts forward and backward."""
    run(attention_trains_identically, spec, launches)


def camera_leaves(batch, intrinsics):
    """float32 poses (and intrinsics) of three views, per sample with ``batch``, as leaves wanting a gradient."""
    g = torch.Generator().manual_seed(0)
    shape = (batch, 3) if batch else (3,)
    n = 3 * max(batch, 1)
    c2w = random_poses(n, g, scale=1.0).reshape(*shape, 4, 4)
    K = random_intrinsics(n, g, (16, 24)).reshape(*shape, 3, 3)
    return [t.float().to(DEVICE).requires_grad_() for t in ((c2w, K) if intrinsics else (c2w,))]


def attention_trains_identically(spec, launches):
    hd = 20 if spec.startswith('gta_multiview') else 16
    pe = vispe.create_pe(spec, dim=2 * hd, num_heads=2, depth=1, grid_size=(3, 4)).to(DEVICE)
    cameras = [] if spec == 'gta' else camera_leaves(2 if spec == 'prope' else 0, intrinsics=spec == 'prope')

    def positions():  # built afresh in each run: the cameras' graph is backpropagated once per run
        if not cameras:
            return vispe.positions.grid(3, 4, num_prefix=1, device=DEVICE)
        cams = Cameras(*cameras[1:], cam_to_world=cameras[0], image_size=(16, 24))
        return vispe.positions.multiview(cams, (2, 3), num_prefix=1)
    qkv, q, k, v = fused_qkv(N=positions().num_tokens, hd=hd, with_v=True)
    compare(lambda: (pe_attention(q, k, v, pe.prepare(positions()), layer=0),), [qkv, *pe.parameters(), *cameras],
            launches, tol=1e-4)


@pytest.mark.parametrize('unsqueeze_dim', [1, 2])
def test_multimodal_apply_rotary_trains_identically_with_fused_kernels(run, unsqueeze_dim):
    """`vispe.encodings.multimodal.apply_rotary` (rotate-half tables) in the LLM layout ``(B, H, N, hd)``
    (``unsqueeze_dim=1``) and the tokens-first one ``(B, N, H, hd)`` (``unsqueeze_dim=2``, which the
    kernels take as swapped views, their output in the inputs' layout): M-RoPE's per-sample tables of
    two image-and-text sequences, partial rotary (48 of 64 channels), and MHRoPE's head-wise tables."""
    run(multimodal_apply_rotary, unsqueeze_dim)


def multimodal_apply_rotary(unsqueeze_dim):
    layouts = [[vispe.Text(3), vispe.Image(grid=(1, 4, 6)), vispe.Text(2)],
               [vispe.Text(5), vispe.Image(grid=(1, 4, 4)), vispe.Text(2)]]
    for scheme, rotary_dim in (('mrope', 48), ('mhrope', 64)):
        encoding = vispe.create_pe(scheme, dim=256, num_heads=4, rotary_dim=rotary_dim).to(DEVICE)
        ids, _ = encoding.position_ids(vispe.sequence(layouts))
        cos, sin = encoding.cos_sin(ids.to(DEVICE))
        qkv, q, k = fused_qkv(H=4, N=ids.shape[-1], hd=64)
        if unsqueeze_dim == 2:  # q and k as (B, N, H, hd) views of the projection
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        compare(lambda: multimodal_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim), [qkv])
        with fused('on'):
            out_q, out_k = multimodal_rotary(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        assert out_q.shape == q.shape and out_q.transpose(1, 2).is_contiguous() == (unsqueeze_dim == 1)


# ------------------------------------------------------------------ layouts and dispatch
def test_output_is_laid_out_like_the_fused_projection(run):
    run(output_layout)


def output_layout():
    _, q, k = fused_qkv()
    table = grid_table(6, 8)
    with fused('on'), counted_launches() as launches:
        out_q, out_k = rotate_qk(q, k, table, table, 'table')
    assert len(launches) == 1
    assert out_q._base is out_k._base and out_q.transpose(1, 2).is_contiguous()  # stacked, (B, N, H, hd) memory


def test_backward_takes_expanded_and_missing_gradients(run):
    """A sum's gradient is expanded (stride 0) and k gets none at all: still one launch each way."""
    run(expanded_and_missing_gradients)


def expanded_and_missing_gradients():
    qkv, q, k = fused_qkv()
    angles = torch.randn(7, 8, device=DEVICE, requires_grad=True)
    compare(lambda: (rotate_qk(q, k, angles, angles, 'pair')[0].sum(),), [qkv, angles])


def test_single_tensor_with_strided_channels_matches_reference(run):
    run(single_tensor_with_strided_channels)


def single_tensor_with_strided_channels():
    x = torch.randn(16, 7, device=DEVICE).mT.requires_grad_()  # (N, hd), channels at stride 7
    rot = orthogonal_blocks(7, 2, b=8).requires_grad_()
    compare(lambda: (apply_rotation(x, 'block', rot),), [x, rot])


@pytest.mark.parametrize('case', ['float64', 'half_table_float64', 'block_3', 'matrix_3', 'fourier'])
def test_unsupported_rotations_use_the_reference(run, case):
    run(unsupported_rotation, case)


def unsupported_rotation(case):
    x = torch.randn(2, 2, 6, 12, dtype=torch.float64 if 'float64' in case else torch.float32, device=DEVICE)
    kind, rot = {'float64': ('pair', torch.randn(6, 6, dtype=torch.float64, device=DEVICE)),
                 'half_table_float64': ('half_table', rotation_table(torch.randn(6, 6, dtype=torch.float64,
                                                                                  device=DEVICE))),
                 'block_3': ('block', orthogonal_blocks(6, 4, b=3)),
                 'matrix_3': ('matrix', invertible_blocks(6, 4, b=3)),
                 'fourier': ('fourier', rotation_table(torch.randn(6, 8, device=DEVICE)))}[case]
    with fused('on'), counted_launches() as launches:
        out = apply_rotation(x, kind, rot, block=6)
    assert not launches
    torch.testing.assert_close(out, apply_rotation(x, kind, rot, block=6))


def test_auto_keeps_cpu_tensors_on_the_reference():
    q, k = torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    calls = []
    with fused('auto'), pytest.MonkeyPatch.context() as mp:
        mp.setattr(triton_kernels, '_launch', lambda *args, **kwargs: calls.append(args))
        rotate_qk(q, k, torch.randn(7, 8), torch.randn(7, 8), 'pair')
    assert not calls


@pytest.mark.cuda
def test_auto_runs_cuda_tensors_fused():
    _, q, k = fused_qkv()
    table = grid_table(6, 8)
    with fused('auto'), counted_launches() as launches:
        rotate_qk(q, k, table, table, 'table')
    assert launches == ['table']


@pytest.mark.slow
@pytest.mark.parametrize('kind,blk,half', [(0, 2, False), (0, 2, True), (1, 2, False), (2, 2, False), (2, 4, False),
                                           (2, 8, False)],
                         ids=['table', 'half_table', 'angles', 'block2', 'block4', 'block8'])
def test_kernel_compiles_for_a_hopper_gpu_without_one(kind, blk, half):
    """What the interpreter does not check (constexpr branches, types, register allocation by ptxas):
    the forward and the backward with parameter gradients, compiled for sm_90 (H100 / H200). Kind
    ``matrix`` launches the ``block`` variants (it differs only after the kernel)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    kernel = triton_kernels._rotation_kernel
    constexprs = ('KIND', 'BLK', 'HALF', 'S', 'TRANSPOSE', 'WRITE_OUT', 'PARAM_GRAD', 'BLOCK_N', 'BLOCK_C')
    signature = {name: '*bf16' if name in ('X0', 'X1', 'Y0', 'Y1', 'OUT') else '*fp32' if name in ('ROT', 'PARTIAL')
                 else 'constexpr' if name in constexprs else 'i32' for name in kernel.arg_names}
    for backward in (False, True):
        values = dict(KIND=kind, BLK=blk, HALF=half, S=2, TRANSPOSE=backward, WRITE_OUT=True, PARAM_GRAD=backward,
                      BLOCK_N=8 // blk, BLOCK_C=64)
        compiled = triton.compile(ASTSource(kernel, signature, values), target=GPUTarget('cuda', 90, 32))
        assert compiled.asm['cubin']


def test_kernel_module_imports_without_triton(monkeypatch):
    for name in ('triton', 'triton.language'):
        monkeypatch.setitem(sys.modules, name, None)  # `import triton` raises ImportError
    spec = importlib.util.spec_from_file_location('_triton_rotary_without_triton', triton_kernels.__file__)
    module = importlib.util.module_from_spec(spec)  # a separate module object: vispe's own is untouched
    spec.loader.exec_module(module)
    assert not module.AVAILABLE
    assert not module.supported('pair', [torch.randn(2, 7, 16)], torch.randn(7, 8))


def test_unknown_fused_setting_is_an_error():
    with fused('yes'), pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        apply_rotation(torch.randn(4, 8), 'pair', torch.randn(4, 4))


def test_fused_setting_changes_at_run_time_and_follows_the_environment(monkeypatch):
    from vispe.rotary import fused_mode, set_fused
    before = set_fused(None)
    try:
        monkeypatch.setenv('VISPE_FUSED', 'off')
        assert fused_mode() == 'off'  # read when a rotation runs, not at import
        assert set_fused('on') is None and fused_mode() == 'on'  # an explicit setting wins
        assert set_fused(None) == 'on' and fused_mode() == 'off'
        monkeypatch.setenv('VISPE_FUSED', 'sometimes')
        with pytest.raises(ValueError, match="VISPE_FUSED must be 'auto', 'on' or 'off'"):
            fused_mode()
        with pytest.raises(ValueError, match="set_fused takes 'auto', 'on', 'off' or None"):
            set_fused('yes')
    finally:
        set_fused(before)
