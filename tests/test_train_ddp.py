"""Scale-out: the same command under torchrun (2 CPU processes, gloo) trains the same model as one
process with the global batch, and only rank 0 writes."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import torch

from train.checkpoint import load_checkpoint
from train.cli import run

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / 'configs' / 'quickstart.yaml')
COMMON = [
    'model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}', 'sweep={}',
    'model.pe=rope_axial', 'data.synthetic.train_size=96', 'data.synthetic.val_size=22', 'train.epochs=1',
    'optim.opt=sgd', 'optim.lr=0.05', 'sched.name=none', 'train.threads=1', 'log.progress=off',
    'extrapolate.sizes=[]',
]


def _eval_rows(path: Path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def test_two_process_ddp_matches_one_process_with_the_global_batch(tmp_path):
    threads = torch.get_num_threads()
    try:
        [single] = run(CONFIG, [f'output_dir={tmp_path / "single"}', 'train.batch_size=16'] + COMMON)
    finally:
        torch.set_num_threads(threads)
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '-m', 'train', CONFIG,
           f'output_dir={tmp_path / "ddp"}', 'train.batch_size=8'] + COMMON
    done = subprocess.run(cmd, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(REPO)),
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    ddp_dir = tmp_path / 'ddp' / 'quickstart'
    ddp = load_checkpoint(ddp_dir / 'checkpoint.pt')
    ref = load_checkpoint(single.run_dir / 'checkpoint.pt')
    assert ddp['position'] == ref['position'] == dict(epoch=1, batch=0, step=6)
    assert len(ddp['rng']) == 2 and ddp['world_size'] == 2  # each rank's random streams are kept
    # rank r takes every second sample of the shared shuffle and gradients are averaged: the same updates
    for key, value in ref['model'].items():
        torch.testing.assert_close(ddp['model'][key], value, rtol=1e-4, atol=1e-6, msg=key)
    # evaluation is sharded without padding: the same counts, hence the same accuracy
    assert _eval_rows(ddp_dir / 'eval.csv')[0]['top1'] == _eval_rows(single.run_dir / 'eval.csv')[0]['top1']
    out = done.stdout.decode()
    assert out.count('summary (') == 1  # the summary (and every log line) comes from rank 0 only
    assert '[rank 1]' not in out


def test_two_process_fsdp2_matches_one_process_and_resumes(tmp_path):
    """train.parallel=fsdp: FSDP2 (each block, then the root) over 2 CPU processes trains the same
    weights as one process with the global batch; the evaluation shards differ in length (11 and 10
    images, batches of 5: 3 and 2 batches), the shorter rank pads with empty batches and the counts
    stay exact; the checkpoint holds the full model and resumes under FSDP2."""
    common = [c for c in COMMON if not c.startswith('data.synthetic.val_size')] + [
        'data.synthetic.val_size=21', 'data.eval_batch_size=5', 'model.pe=liere']
    threads = torch.get_num_threads()
    try:
        [single] = run(CONFIG, [f'output_dir={tmp_path / "single"}', 'train.batch_size=16'] + common)
    finally:
        torch.set_num_threads(threads)
    env = dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(REPO))
    base = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', '-m', 'train',
            CONFIG, f'output_dir={tmp_path / "fsdp"}', 'train.batch_size=8', 'train.parallel=fsdp'] + common
    done = subprocess.run(base, cwd=REPO, env=env, capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    run_dir = tmp_path / 'fsdp' / 'quickstart'
    got = load_checkpoint(run_dir / 'checkpoint.pt')
    ref = load_checkpoint(single.run_dir / 'checkpoint.pt')
    assert got['parallel'] == 'fsdp' and got['position'] == ref['position'] == dict(epoch=1, batch=0, step=6)
    assert got['model'].keys() == ref['model'].keys()
    for key, value in ref['model'].items():  # unsharded tensors, the one-process run's values
        assert not hasattr(got['model'][key], 'full_tensor'), key
        torch.testing.assert_close(got['model'][key], value, rtol=1e-4, atol=1e-6, msg=key)
    assert _eval_rows(run_dir / 'eval.csv')[0]['top1'] == _eval_rows(single.run_dir / 'eval.csv')[0]['top1']
    best = load_checkpoint(run_dir / 'best.pt')
    torch.testing.assert_close(best['model'], got['model'])
    # one more epoch from the FSDP2 checkpoint, on 2 processes
    done = subprocess.run(base + ['train.epochs=2', 'train.resume=auto'], cwd=REPO, env=env, capture_output=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert load_checkpoint(run_dir / 'checkpoint.pt')['position'] == dict(epoch=2, batch=0, step=12)
