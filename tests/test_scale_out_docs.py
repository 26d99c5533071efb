"""docs/scale-out.md runs as written: FSDP2 with deferred initialisation on 2 CPU processes, the
Lightning and Accelerate recipes, the open_clip tower. Each recipe asserts what it promises; the
tests check the state it leaves."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DOC = Path(__file__).resolve().parents[1] / 'docs' / 'scale-out.md'
ROOT = DOC.parents[1]


def _blocks(heading: str) -> list:
    text = DOC.read_text()
    start = text.index(f'\n## {heading}\n')
    end = text.find('\n## ', start + 5)
    found = re.findall(r'```python\n(.*?)```', text[start:end if end > 0 else None], re.S)
    assert found, f'section {heading!r} lost its example'
    return found


def _exec(heading: str, cwd: Path, monkeypatch) -> dict:
    monkeypatch.chdir(cwd)
    namespace: dict = {'__name__': '__doc__'}
    for block in _blocks(heading):
        exec(compile(block, f'{DOC}:{heading}', 'exec'), namespace)
    return namespace


@pytest.mark.skipif(not Path('/proc/self/task').is_dir(), reason='reads thread names from /proc (Linux)')
def test_fsdp2_deferred_init_recipe_runs_on_two_processes(tmp_path):
    """The recipe runs on 2 gloo processes, and no process reaches interpreter shutdown with gloo's
    threads alive (the state in which it aborts now and then: tests/gloo_shutdown.py says why)."""
    [script] = _blocks('FSDP2 with deferred initialisation')
    path = tmp_path / 'fsdp2_example.py'
    path.write_text(script)
    reports = tmp_path / 'shutdown'
    reports.mkdir()
    probe = ROOT / 'tests' / 'gloo_shutdown.py'  # runs the script as written, as __main__
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(probe), str(reports), str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    alive = {f.name: f.read_text().split() for f in reports.iterdir()}
    assert not any(alive.values()), f'interpreter shutdown with gloo threads alive: {alive}'


@pytest.mark.slow
@pytest.mark.skipif(not Path('/proc/self/task').is_dir(), reason='reads thread names from /proc (Linux)')
def test_training_script_with_fsdp2_never_shuts_the_interpreter_down_with_gloo_threads_alive(tmp_path):
    """The page's `torchrun -m vispe_train ... train.parallel=fsdp`, on 2 gloo processes: both train and
    leave without interpreter shutdown while gloo's threads live (train.distributed.leave_process)."""
    reports = tmp_path / 'shutdown'
    reports.mkdir()
    overrides = [f'output_dir={tmp_path / "runs"}', 'train.parallel=fsdp', 'train.batch_size=8', 'sweep={}',
                 'model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}',
                 'model.pe=rope_axial', 'data.synthetic.train_size=32', 'data.synthetic.val_size=8',
                 'train.epochs=1', 'train.threads=1', 'log.progress=off', 'extrapolate.sizes=[]']
    done = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                           str(ROOT / 'tests' / 'gloo_shutdown.py'), str(reports), '-m', 'train',
                           str(ROOT / 'configs' / 'quickstart.yaml')] + overrides, cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env=dict(os.environ, OMP_NUM_THREADS='1', PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count('summary (') == 1  # it trained, and rank 0's output came out before the exit
    alive = {f.name: f.read_text().split() for f in reports.iterdir()}
    assert not any(alive.values()), f'interpreter shutdown with gloo threads alive: {alive}'


def test_lightning_recipe_trains_validates_at_another_size_reloads_and_resumes(tmp_path, monkeypatch):
    pytest.importorskip('lightning', reason='lightning not installed (pip install lightning)')
    ns = _exec('PyTorch Lightning', tmp_path, monkeypatch)
    first, resumed = ns['trainer'], ns['resumed']
    assert first.current_epoch == 1 and first.global_step == 4  # 32 samples, batch 8
    assert resumed.current_epoch == 2 and resumed.global_step == 8  # one more epoch from the checkpoint
    assert isinstance(ns['reloaded'].model.pe, type(ns['lit'].model.pe))


def test_accelerate_recipe_trains_and_restores_its_state(tmp_path, monkeypatch):
    pytest.importorskip('accelerate', reason='accelerate not installed (pip install accelerate)')
    ns = _exec('Hugging Face Accelerate', tmp_path, monkeypatch)
    assert ns['out'].shape == (2, 4) and torch.isfinite(ns['out']).all()
    assert (tmp_path / 'accelerate_state').is_dir()
    assert ns['trained'].pe.name == 'liere'


def test_open_clip_recipe_gives_the_tower_its_encoding_and_takes_it_back(tmp_path, monkeypatch):
    pytest.importorskip('open_clip', reason='open_clip_torch not installed (pip install "vispe[open_clip]")')
    import vispe
    ns = _exec('open_clip image towers', tmp_path, monkeypatch)
    assert torch.isfinite(ns['loss'])
    assert ns['handle'].tower.pe.name == 'rope_mixed'
    assert ns['handle'].tower.pe.freqs.grad is not None
    assert not isinstance(ns['model'].visual.trunk, vispe.VisionTransformer)  # removed: timm's trunk again
