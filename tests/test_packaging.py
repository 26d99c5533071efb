"""A non-editable install works from any directory: vispe, the downstream models (`vispe_models`)
and the training script (`vispe_train`, also the `vispe-train` command), without shadowing a user's
own top-level `models` or `train` package."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope='module')
def installed(tmp_path_factory):
    """The project installed (as a wheel, no dependencies: they are this environment's) into a folder
    of its own, nothing of the repository on the path."""
    target = tmp_path_factory.mktemp('site')
    subprocess.run([sys.executable, '-m', 'pip', 'install', '--no-deps', '--no-build-isolation', '--quiet',
                    '--target', str(target), str(REPO)], check=True, capture_output=True)
    return target


def _run(installed: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, 'PYTHONPATH': str(installed)}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_every_module_imports_from_a_fresh_directory(installed, tmp_path):
    code = ('import importlib, pkgutil\n'
            'for name in ("vispe", "vispe_models", "vispe_train"):\n'
            '    pkg = importlib.import_module(name)\n'
            '    assert pkg.__file__.startswith(%r), pkg.__file__\n'
            '    for m in pkgutil.walk_packages(pkg.__path__, name + "."):\n'
            '        if not m.name.endswith(".__main__"):  # an entry point: runs on import\n'
            '            importlib.import_module(m.name)\n'
            'from vispe_models.detr import DETR\n'
            'DETR(num_classes=3, backbone="resnet18", hidden_dim=32, num_heads=4, enc_layers=1, dec_layers=1,\n'
            '     dim_feedforward=64, num_queries=4)\n' % str(installed))
    result = _run(installed, tmp_path, sys.executable, '-c', code)
    assert result.returncode == 0, result.stderr


def test_installed_packages_leave_a_users_models_and_train_packages_alone(installed, tmp_path):
    for name in ('models', 'train'):
        (tmp_path / name).mkdir()
        (tmp_path / name / '__init__.py').write_text(f'OWNER = "user {name}"\n')
    code = 'import models, train, vispe_train, vispe_models; print(models.OWNER, "|", train.OWNER)'
    result = _run(installed, tmp_path, sys.executable, '-c', code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == 'user models | user train'


def test_training_command_trains_from_a_fresh_directory(installed, tmp_path):
    config = tmp_path / 'tiny.yaml'
    config.write_text((REPO / 'configs' / 'quickstart.yaml').read_text())
    overrides = ['sweep={}', 'model.pe=rope_axial', 'train.epochs=1', 'data.synthetic.train_size=16',
                 'data.synthetic.val_size=8', 'train.batch_size=8', 'extrapolate.sizes=[32]',
                 f'output_dir={tmp_path / "runs"}']
    result = _run(installed, tmp_path, sys.executable, '-m', 'vispe_train', str(config), *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / 'runs').rglob('*.pt')), 'no checkpoint written'
    script = installed / 'bin' / 'vispe-train'
    assert script.exists()
    result = _run(installed, tmp_path, sys.executable, str(script), '--help')
    assert result.returncode == 0 and 'config' in result.stdout.lower(), result.stderr
