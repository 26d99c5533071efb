"""FSDP2 (``fully_shard``) with every registered encoding, on 2 CPU ranks (gloo).

The deferred-initialisation path of large models: build on ``device='meta'``, ``fully_shard`` each
block then the root, ``to_empty``, ``init_weights``. Per encoding, in one spawned job (process start
and ``import vispe`` paid once):

* ``reset_parameters`` on the sharded (DTensor) encoding gives, gathered, exactly the tensors a CPU
  construction (and a CPU encoding's ``reset_parameters``) gives from the same random state, and
  ``init_weights`` the same spread as a CPU build (not its values: docs/scale-out.md says why);
* a full state dict of a CPU model loaded into the sharded model (``set_model_state_dict``,
  ``full_state_dict=True, broadcast_from_rank0=True``) gives the CPU model's weights bit for bit, its
  outputs, forward and gradients of the encoding's parameters.

Encodings that need cameras (no image ViT hosts them) are sharded as their own unit and checked on
their tensors. Each worker leaves without interpreter shutdown (``gloo_shutdown.leave`` says why).
"""
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import TINY
from gloo_shutdown import leave, watch_shutdown

pytestmark = pytest.mark.skipif(not dist.is_available(), reason='torch built without torch.distributed')

WORLD = 2
X = (2, 3, TINY['img_size'], TINY['img_size'])


def _tensors(module: torch.nn.Module) -> dict:
    return dict(list(module.named_parameters()) + list(module.named_buffers()))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, 'full_tensor') else t


def _vit(pe: str, **kwargs):
    import timm
    return timm.create_model('vit_tiny', pe=pe, **TINY, **kwargs)


def _shard(model: torch.nn.Module, mesh) -> None:
    from torch.distributed.fsdp import fully_shard
    for block in getattr(model, 'blocks', []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _check(pe: str, mesh) -> dict:
    """One encoding's figures on this rank (every rank computes the same gathered values)."""
    import vispe
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    cameras = bool(vispe.pe_info(pe)['cls'].requires)  # cameras, or a multimodal sequence: no ViT host

    def build(**kwargs):
        if cameras:
            heads = 4 if pe == 'mhrope' else TINY['num_heads']  # mhrope's default gives t, h, w whole heads
            return vispe.create_pe(pe, dim=TINY['embed_dim'], num_heads=heads, depth=TINY['depth'], **kwargs)
        return _vit(pe, **kwargs)

    torch.manual_seed(0)
    ref = build().eval()
    model = build(device='meta')
    _shard(model, mesh)
    model.to_empty(device='cpu')
    enc = model if cameras else model.pe
    sharded = [n for n, p in enc.named_parameters() if hasattr(p, 'full_tensor')]

    # init_weights on DTensors: finite, and drawn with the construction's spread
    torch.manual_seed(1)
    (model.reset_parameters if cameras else model.init_weights)()
    spread = []
    for name, t in _tensors(ref if cameras else ref.pe).items():
        got = _full(_tensors(enc)[name])
        assert torch.isfinite(got).all() if got.is_floating_point() else True, (pe, name)
        if got.is_floating_point() and got.numel() > 1 and float(t.std()) > 0:
            spread.append(float(got.std()) / float(t.std()))
    # reset_parameters() alone: what a one-process construction, and its reset_parameters(), give
    torch.manual_seed(2)
    enc.reset_parameters()
    got = {n: _full(t) for n, t in _tensors(enc).items()}
    torch.manual_seed(2)
    one = vispe.create_pe(pe, enc.ctx)
    built = {n: t.clone() for n, t in _tensors(one).items()}
    torch.manual_seed(2)
    one.reset_parameters()
    init_diff = max((float((t.double() - want[n].double()).abs().max()) for want in (built, _tensors(one))
                     for n, t in got.items() if t.is_floating_point() and t.numel()), default=0.0)
    assert all(torch.equal(t, want[n]) for want in (built, _tensors(one)) for n, t in got.items()), pe

    # a full state dict from rank 0 into the sharded model: the CPU model's weights, outputs and gradients
    full = ref.state_dict() if dist.get_rank() == 0 else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    enc.init_non_persistent_buffers()
    want = ref.state_dict()
    state_exact = [torch.equal(_full(t), want[n]) for n, t in model.state_dict().items()]  # every rank gathers
    model.eval()
    if cameras:
        loaded = max((float((_full(t).double() - _tensors(ref)[n].double()).abs().max())
                      for n, t in _tensors(enc).items() if t.is_floating_point() and t.numel()), default=0.0)
        grad_diff = 0.0
    else:
        torch.manual_seed(3)
        x = torch.randn(*X)
        out, want = model(x), ref(x)
        loaded = float((out - want).abs().max())
        out.square().sum().backward()
        want.square().sum().backward()
        grads = {n: p.grad for n, p in ref.pe.named_parameters() if p.grad is not None}
        grad_diff = max((float((_full(p.grad) - grads[n]).abs().max()) for n, p in model.pe.named_parameters()
                         if p.grad is not None), default=0.0)
        with torch.no_grad():  # eval forwards reuse the prepared state between forwards: still the CPU model's
            x = torch.randn(1, 3, 40, 48)
            for _ in range(2):
                loaded = max(loaded, float((model(x) - ref(x)).abs().max()))
    return dict(sharded=len(sharded), spread=(min(spread), max(spread)) if spread else None, init_diff=init_diff,
                loaded=loaded, grad=grad_diff, state_exact=all(state_exact))


def _worker(rank: int, port: int, names, out_path: str) -> None:
    watch_shutdown(Path(out_path).with_name(f'shutdown{rank}.txt'))
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group('gloo', rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh('cpu', (WORLD,))
        rows = {}
        for pe in names:
            try:
                rows[pe] = _check(pe, mesh)
            except Exception as e:  # reported per encoding, so one failure names itself
                rows[pe] = dict(error=f'{type(e).__name__}: {e}'[:800])
        if rank == 0:
            torch.save(rows, out_path)
    except BaseException:
        dist.destroy_process_group()
        raise
    leave()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


@pytest.fixture(scope='module')
def fsdp_job(tmp_path_factory):
    import vispe
    names = vispe.list_pes()
    out = tmp_path_factory.mktemp('fsdp') / 'rows.pt'
    mp.spawn(_worker, args=(_free_port(), names, str(out)), nprocs=WORLD, join=True)
    alive = {f.name: f.read_text().split() for f in out.parent.glob('shutdown*.txt')}
    return torch.load(out, weights_only=False), alive


@pytest.mark.skipif(not Path('/proc/self/task').is_dir(), reason='reads thread names from /proc (Linux)')
def test_workers_never_shut_the_interpreter_down_with_gloo_threads_alive(fsdp_job):
    """The state in which a worker aborts now and then at exit (SIGABRT, "terminate called without an
    active exception"): gloo's threads outlive destroy_process_group (tests/gloo_shutdown.py)."""
    _, alive = fsdp_job
    assert not any(alive.values()), f'interpreter shutdown with gloo threads alive: {alive}'


def test_every_encoding_initialises_sharded_and_loads_a_full_state_dict(fsdp_job):
    import vispe
    fsdp_rows, _ = fsdp_job
    assert sorted(fsdp_rows) == sorted(vispe.list_pes())
    errors = {pe: r['error'] for pe, r in fsdp_rows.items() if 'error' in r}
    assert not errors, errors
    for pe, r in fsdp_rows.items():
        assert r['init_diff'] == 0.0, pe  # exactly a construction's values, whatever the sharding
        if r['spread'] is not None:  # init_weights draws from the construction's distribution
            assert 0.5 < r['spread'][0] and r['spread'][1] < 2.0, (pe, r['spread'])
        assert r['state_exact'], pe  # the loaded weights are the full model's, bit for bit
        assert r['loaded'] <= 1e-5 and r['grad'] <= 1e-5, (pe, r)
    # the test shards something: every encoding with parameters has DTensor parameters
    assert sum(r['sharded'] for r in fsdp_rows.values()) > 0
