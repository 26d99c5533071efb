"""Under ``'auto'`` the fused Triton rotations fail safe (`vispe.rotary.trust`): the first launch of each kind,
dtype, device and variant is checked against the reference kernels on the call's first sample; a kernel that
raises or computes wrong values is reported once (a warning naming ``VISPE_FUSED`` and ``set_fused``) and
that kind runs the reference from then on; ``'on'`` raises; `vispe.rotary.fused_report` says what each kind
ran as. Faults are injected by replacing the kernel launch (`fused._launch`).

As in `test_triton_rotary.py`, the kernels run in Triton's interpreter on CPU tensors, in one child process
started with ``TRITON_INTERPRET=1``; ``'auto'`` is let onto CPU tensors there (`autograd._AUTO_DEVICES`),
which it otherwise keeps on the reference.
"""
import contextlib
import multiprocessing
import threading
import time
import warnings

import pytest
import torch

triton = pytest.importorskip('triton')

from vispe.rotary import autograd, fused as triton_kernels, fused_report, rotate_qk, rotation_table, trust  # noqa: E402

KINDS = ['table', 'half_table', 'pair', 'block', 'matrix']


@pytest.fixture(scope='module')
def run():
    """``run(check, *args)``: ``check(*args)`` in a process whose Triton runs the interpreter."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv('TRITON_INTERPRET', '1')
        pool = multiprocessing.get_context('spawn').Pool(1)
    with pool:
        yield lambda check, *args: pool.apply(check, args)


@contextlib.contextmanager
def auto_on_cpu(launch=None):
    """``'auto'`` with CPU tensors eligible, no verdicts yet, ``launch`` (if given) in place of the kernel
    launch; yields the kinds launched and the warnings raised inside the block."""
    assert type(triton_kernels._rotation_kernel).__name__ == 'InterpretedFunction'
    calls = []
    real = launch or triton_kernels._launch

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        mp.setattr(autograd, 'FUSED', 'auto')
        mp.setattr(autograd, '_AUTO_DEVICES', ('cuda', 'cpu'))
        mp.setattr(trust, '_VERDICTS', {})
        mp.setattr(trust, '_PASSED', set())
        mp.setattr(trust, '_LARGEST', {})
        mp.setattr(triton_kernels, '_launch', counted)
        yield calls, caught


def raising_launch(*args, **kwargs):
    raise RuntimeError('ptxas fatal: unsupported target (injected)')


def scaled_launch(*args, **kwargs):
    """The real launch with its output 10 % off (forward and backward)."""
    out, grad = REAL_LAUNCH(*args, **kwargs)
    return (out * 1.1 if out is not None else None), grad


def wrong_gradient_launch(kind, rot, xs, transpose, write_out, ys=()):
    """The real launch, its rotation gradient (backward with ``ys``) of the wrong sign."""
    out, grad = REAL_LAUNCH(kind, rot, xs, transpose, write_out, ys)
    return out, (-grad if grad is not None else None)


REAL_LAUNCH = triton_kernels._launch


def qk_and_rotation(kind, dtype=torch.float32, grad=False):
    """q and k ``(2, 2, 7, 16)`` as views of one qkv projection, and a rotation of ``kind`` for 7 tokens."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 7, 3 * 2 * 16, generator=g).to(dtype).requires_grad_(grad)
    q, k, _ = qkv.reshape(2, 7, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
    if kind in ('table', 'half_table'):
        rot = rotation_table(torch.randn(7, 8, generator=g))
    elif kind == 'pair':
        rot = torch.randn(7, 8, generator=g)
    else:
        a = torch.randn(7, 4, 4, 4, generator=g)
        rot = torch.linalg.matrix_exp(a - a.mT) if kind == 'block' else torch.eye(4) + 0.3 * a
    return qkv, q, k, rot.requires_grad_(grad)


def reference(kind, dtype=torch.float32):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autograd, 'FUSED', 'off')
        _, q, k, rot = qk_and_rotation(kind, dtype)
        return torch.stack(rotate_qk(q, k, rot, rot, kind))


def report_of(kind):
    return [c for c in fused_report() if c.kind == kind]


def fallback_warnings(caught):
    return [w for w in caught if issubclass(w.category, RuntimeWarning) and 'fused Triton' in str(w.message)]


# ------------------------------------------------------------------ a kernel that raises
def test_auto_falls_back_once_when_a_kernel_raises(run):
    run(kernel_that_raises)


def kernel_that_raises():
    with auto_on_cpu(raising_launch) as (calls, caught):
        for _ in range(3):
            _, q, k, rot = qk_and_rotation('table')
            out = torch.stack(rotate_qk(q, k, rot, rot, 'table'))
            torch.testing.assert_close(out, reference('table'), rtol=0, atol=0)
        assert calls == ['table']  # the check's launch; never again after it
        (warning,) = fallback_warnings(caught)
        message = str(warning.message)
        assert 'VISPE_FUSED' in message and "vispe.rotary.set_fused('off')" in message and 'ptxas' in message
        (check,) = report_of('table')
        assert (check.status, check.dtype, check.device) == ('fell back', torch.float32, 'cpu')
        assert check.detail.startswith('raised RuntimeError: ptxas fatal')
        assert all(c.status == 'not tried' for c in fused_report() if c.kind != 'table')


def test_on_raises_what_the_kernel_raises(run):
    run(on_raises)


def on_raises():
    with auto_on_cpu(raising_launch) as (calls, caught):
        autograd.FUSED = 'on'  # restored with the rest on leaving the block
        _, q, k, rot = qk_and_rotation('table')
        with pytest.raises(RuntimeError, match='ptxas fatal'):
            rotate_qk(q, k, rot, rot, 'table')
        assert not fallback_warnings(caught) and report_of('table')[0].status == 'not tried'


# ------------------------------------------------------------------ a kernel that computes wrong values
def test_auto_falls_back_when_a_kernel_computes_wrong_values(run):
    run(kernel_that_is_wrong)


def kernel_that_is_wrong():
    with auto_on_cpu(scaled_launch) as (calls, caught):
        for _ in range(2):
            _, q, k, rot = qk_and_rotation('block')
            out = torch.stack(rotate_qk(q, k, rot, rot, 'block'))
            torch.testing.assert_close(out, reference('block'), rtol=0, atol=0)
        assert calls == ['block']
        assert len(fallback_warnings(caught)) == 1
        (check,) = report_of('block')
        assert check.status == 'fell back' and 'differs from the reference kernels by 1.0' in check.detail


def test_auto_catches_a_wrong_gradient_on_the_first_training_launch(run):
    run(gradient_that_is_wrong)


def gradient_that_is_wrong():
    with auto_on_cpu(wrong_gradient_launch) as (calls, caught):
        _, q, k, rot = qk_and_rotation('pair')
        with torch.no_grad():  # eval: the forward variant, which is right
            rotate_qk(q, k, rot, rot, 'pair')
        assert report_of('pair')[0].status == 'trusted' and not caught
        qkv, q, k, rot = qk_and_rotation('pair', grad=True)  # training: the backward variant is checked too
        torch.stack(rotate_qk(q, k, rot, rot, 'pair')).square().sum().backward()
        assert report_of('pair')[0].status == 'fell back' and len(fallback_warnings(caught)) == 1
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(autograd, 'FUSED', 'off')
            qkv_ref, q, k, rot_ref = qk_and_rotation('pair', grad=True)
            torch.stack(rotate_qk(q, k, rot_ref, rot_ref, 'pair')).square().sum().backward()
        torch.testing.assert_close(rot.grad, rot_ref.grad, rtol=0, atol=0)
        torch.testing.assert_close(qkv.grad, qkv_ref.grad, rtol=0, atol=0)


def test_auto_falls_back_when_a_trusted_kind_raises_later(run):
    run(trusted_kind_raises_later)


def trusted_kind_raises_later():
    with auto_on_cpu() as (calls, caught):
        _, q, k, rot = qk_and_rotation('half_table')
        rotate_qk(q, k, rot, rot, 'half_table')
        assert report_of('half_table')[0].status == 'trusted'
        triton_kernels._launch = raising_launch  # say, a head dim whose kernel fails to compile
        out = torch.stack(rotate_qk(q, k, rot, rot, 'half_table'))
        torch.testing.assert_close(out, reference('half_table'), rtol=0, atol=0)
        assert report_of('half_table')[0].status == 'fell back' and len(fallback_warnings(caught)) == 1


# ------------------------------------------------------------------ a correct kernel
# eval: the check's forward, then the call's; the first training step: the check's forward and backward, then
# the call's; the second training step: the call's alone. Every kind in bfloat16 (the tolerance's hardest case),
# its first training step.
@pytest.mark.parametrize('dtype,kinds,steps', [(torch.float32, ('table', 'block'), ((False, 2), (True, 4), (True, 2))),
                                               (torch.bfloat16, KINDS, ((True, 4),))], ids=['fp32', 'bf16'])
def test_auto_trusts_correct_kernels_after_one_check_per_variant(run, dtype, kinds, steps):
    run(correct_kernels, dtype, kinds, steps)


def correct_kernels(dtype, kinds, steps):
    with auto_on_cpu() as (calls, caught):
        for kind in kinds:
            for grad, launches in steps:
                del calls[:]
                _, q, k, rot = qk_and_rotation(kind, dtype, grad)
                outs = rotate_qk(q, k, rot, rot, kind)
                if grad:
                    torch.stack(outs).float().square().sum().backward()
                assert calls == [kind] * launches, (kind, grad, calls)
            (check,) = report_of(kind)
            assert (check.status, check.dtype, check.device) == ('trusted', dtype, 'cpu'), check
            assert f'in {len({grad for grad, _ in steps})} check' in check.detail  # one per variant
        assert not caught


def test_auto_trusts_a_correct_kernel_checked_on_a_diverged_step(run):
    run(correct_kernel_on_non_finite_inputs)


def correct_kernel_on_non_finite_inputs():
    """inf and NaN in q (a diverged step) reach both kernels alike: no reason to fall back."""
    with auto_on_cpu() as (calls, caught):
        qkv, _, _, rot = qk_and_rotation('table', grad=True)
        qkv = qkv.detach().index_put((torch.tensor(0), torch.tensor(3), torch.arange(4)),
                                     torch.tensor([float('nan'), float('inf'), -float('inf'), 1e30])).requires_grad_()
        q, k, _ = qkv.reshape(2, 7, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        torch.stack(rotate_qk(q, k, rot, rot, 'table')).sum().backward()
        assert report_of('table')[0].status == 'trusted' and not fallback_warnings(caught)


# ------------------------------------------------------------------ threads
def test_threads_launching_a_new_kind_at_once_check_it_once(run):
    run(concurrent_first_launches)


def concurrent_first_launches():
    def slow_and_wrong(*args, **kwargs):
        time.sleep(0.05)  # long enough for every thread to reach the check
        return scaled_launch(*args, **kwargs)
    with auto_on_cpu(slow_and_wrong) as (calls, caught):
        _, q, k, rot = qk_and_rotation('table')
        barrier, outs = threading.Barrier(4), [None] * 4

        def worker(i):
            barrier.wait()
            outs[i] = torch.stack(rotate_qk(q, k, rot, rot, 'table'))
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert calls == ['table'] and len(fallback_warnings(caught)) == 1
        for out in outs:
            torch.testing.assert_close(out, reference('table'), rtol=0, atol=0)


# ------------------------------------------------------------------ tracing
def test_compiled_and_exported_rotations_skip_the_check(monkeypatch):
    """Traced, the reference runs as it is (torch.compile fuses it): no check, no graph break."""
    monkeypatch.setattr(autograd, 'FUSED', 'auto')
    monkeypatch.setattr(autograd, '_AUTO_DEVICES', ('cuda', 'cpu'))
    monkeypatch.setattr(trust, '_VERDICTS', {})
    monkeypatch.setattr(trust, '_PASSED', set())
    monkeypatch.setattr(triton_kernels, '_launch', raising_launch)
    _, q, k, rot = qk_and_rotation('table')
    q, k = q.detach(), k.detach()

    def rotate(q, k):
        return torch.stack(rotate_qk(q, k, rot, rot, 'table'))
    compiled = torch.compile(rotate, fullgraph=True, backend='eager')
    torch.testing.assert_close(compiled(q, k), reference('table'), rtol=0, atol=0)

    class Rotate(torch.nn.Module):
        def forward(self, q, k):
            return rotate(q, k)
    exported = torch.export.export(Rotate(), (q, k))
    torch.testing.assert_close(exported.module()(q, k), reference('table'), rtol=0, atol=0)
    assert all(c.status == 'not tried' for c in fused_report())
