"""Nothing lost: a run killed with SIGKILL mid-epoch and resumed ends with the weights of an uninterrupted run."""
import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from train.checkpoint import load_checkpoint
from train.cli import run

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / 'configs' / 'quickstart.yaml')
# 10 steps per epoch, 4 epochs, a checkpoint every 3 steps (mid-epoch), and every random stream in use:
# drop path (torch RNG), EMA, shuffling, learned frequencies.
OVERRIDES = [
    'model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}', 'sweep={}',
    'model.pe=rope_mixed', 'model.drop_path_rate=0.2', 'data.synthetic.train_size=160', 'data.synthetic.val_size=16',
    'train.batch_size=16', 'train.epochs=4', 'train.checkpoint_every=3', 'train.ema.enabled=true',
    'train.ema.decay=0.9', 'train.threads=1', 'log.progress=off', 'log.every=1', 'extrapolate.sizes=[]',
]


def _cmd(out: Path, *extra: str):
    return [sys.executable, '-m', 'train', CONFIG, f'output_dir={out}', *OVERRIDES, *extra]


def _env():
    return dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(REPO))


def test_sigkill_mid_epoch_then_resume_gives_the_uninterrupted_weights(tmp_path):
    threads = torch.get_num_threads()
    try:
        [reference] = run(CONFIG, [f'output_dir={tmp_path / "reference"}'] + OVERRIDES)
    finally:
        torch.set_num_threads(threads)
    ref = load_checkpoint(reference.run_dir / 'checkpoint.pt')
    assert ref['position'] == dict(epoch=4, batch=0, step=40)

    out = tmp_path / 'killed'
    ckpt_path = out / 'quickstart' / 'checkpoint.pt'
    proc = subprocess.Popen(_cmd(out), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not ckpt_path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # right after the first checkpoint appeared
    finally:
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, f'the run ended before it could be killed: {err.decode()[-2000:]}'
    killed_at = load_checkpoint(ckpt_path)['position']
    assert 0 < killed_at['batch'] < 10 and killed_at['step'] < 40, killed_at  # mid-epoch, mid-run

    done = subprocess.run(_cmd(out, 'train.resume=auto'), cwd=REPO, env=_env(), capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert b'resumed from' in done.stdout

    final = load_checkpoint(ckpt_path)
    assert final['position'] == ref['position']
    for section in ('model', 'ema'):
        for key, value in ref[section].items():
            assert torch.equal(final[section][key], value), f'{section}.{key} differs after resume'
    for a, b in zip(ref['optimizer']['state'].values(), final['optimizer']['state'].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert final['best'] == ref['best']
    with open(out / 'quickstart' / 'train.csv', newline='') as f:
        steps = [int(r['step']) for r in csv.DictReader(f)]
    assert steps == list(range(1, 41))  # rows after the checkpoint were dropped, none repeated
