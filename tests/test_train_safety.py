"""Nothing of the user's is lost or silently wrong: run folders, damaged checkpoints, file modes, bad
images, and config values that would only fail after hours of training."""
import csv
import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import train.logs
from train.checkpoint import atomic_save, load_checkpoint
from train.cli import main, run
from train.config import ConfigError, load_config, load_yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / 'configs' / 'quickstart.yaml')
# one optimizer step of a tiny model
TINY = ['model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}', 'sweep={}',
        'model.pe=none', 'data.synthetic.train_size=16', 'data.synthetic.val_size=8', 'train.batch_size=16',
        'train.epochs=1', 'extrapolate.sizes=[]', 'log.progress=off', 'log.every=1', 'train.threads=1']


def _run(out: Path, *extra: str):
    threads = torch.get_num_threads()
    try:
        return run(CONFIG, [f'output_dir={out}'] + TINY + list(extra))
    finally:
        torch.set_num_threads(threads)


def _steps(path: Path):
    with open(path, newline='') as f:
        return [int(r['step']) for r in csv.DictReader(f)]


@pytest.fixture(scope='module')
def finished_run(tmp_path_factory):
    """A finished one-step run; tests copy its folder before touching it."""
    [result] = _run(tmp_path_factory.mktemp('finished'))
    return result.run_dir


def _copy_run(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / 'runs' / 'quickstart'
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------- 5. existing run folders
def test_rerunning_into_a_run_folder_is_refused_and_leaves_the_run_untouched(finished_run, tmp_path, capsys):
    run_dir = _copy_run(finished_run, tmp_path)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    code = main([CONFIG, f'output_dir={tmp_path / "runs"}'] + TINY)
    err = capsys.readouterr().err
    assert code == 2
    assert str(run_dir) in err and 'already holds a run' in err
    assert 'train.resume=auto' in err and 'output_dir=' in err  # how to continue it, how to start elsewhere
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_a_sweep_is_refused_before_its_first_run_trains(tmp_path):
    taken = tmp_path / 'quickstart' / 'rope_mixed'
    taken.mkdir(parents=True)
    (taken / 'train.csv').write_text('epoch,step,loss\n0,1,1.0\n')
    with pytest.raises(ConfigError, match=r"train.resume: .*rope_mixed' already holds a run \(train.csv\)"):
        _run(tmp_path, 'sweep={model.pe: [none, rope_mixed]}')
    assert not (tmp_path / 'quickstart' / 'none').exists()


def test_resume_auto_without_a_checkpoint_starts_over_with_fresh_logs(tmp_path):
    """A run killed before its first checkpoint left rows behind; starting it again must not keep them."""
    run_dir = tmp_path / 'quickstart'
    run_dir.mkdir()
    (run_dir / 'train.csv').write_text('epoch,step,loss,lr,samples_per_s,skipped\n0,1,9.0,0.1,1,0\n0,2,9.0,0.1,1,0\n')
    (run_dir / 'eval.csv').write_text('epoch,step,top1,loss\n0,2,50.0,1.0\n')
    [result] = _run(tmp_path, 'train.resume=auto')
    assert result.steps == 1
    assert _steps(run_dir / 'train.csv') == [1] and _steps(run_dir / 'eval.csv') == [1]


# ---------------------------------------------------------------------- 6. checkpoints
@pytest.mark.parametrize('damage', ['truncated', 'garbage', 'empty'])
def test_a_damaged_checkpoint_on_resume_names_the_file_and_the_way_out(finished_run, tmp_path, damage):
    run_dir = _copy_run(finished_run, tmp_path)
    ckpt = run_dir / 'checkpoint.pt'
    data = ckpt.read_bytes()
    garbage = np.random.default_rng(0).bytes(4096)
    ckpt.write_bytes({'truncated': data[:len(data) // 2], 'garbage': garbage, 'empty': b''}[damage])
    with pytest.raises(ConfigError) as e:
        _run(tmp_path / 'runs', 'train.resume=auto', 'train.epochs=2')
    msg = str(e.value)
    assert msg.startswith('train.resume: ') and f"checkpoint '{ckpt}' is damaged" in msg
    assert 'train.resume=PATH' in msg and 'delete' in msg


def test_stale_temporaries_of_an_interrupted_write_are_removed(finished_run, tmp_path):
    run_dir = _copy_run(finished_run, tmp_path)
    stale = [run_dir / '.checkpoint.pt.0123abcd.tmp', run_dir / '.best.pt.89ef.tmp']
    for p in stale:
        p.write_bytes(b'half a checkpoint')
    unrelated = run_dir / '.notes.tmp'
    unrelated.write_text('mine')
    [result] = _run(tmp_path / 'runs', 'train.resume=auto', 'train.epochs=2')
    assert result.steps == 2
    assert not any(p.exists() for p in stale) and unrelated.exists()


@pytest.mark.parametrize('umask', [0o022, 0o027, 0o002])
def test_checkpoints_get_the_mode_the_umask_gives_new_files(tmp_path, umask):
    old = os.umask(umask)
    try:
        path = atomic_save({'a': torch.ones(2)}, tmp_path / 'ckpt.pt')
        atomic_save({'a': torch.zeros(2)}, path)  # replacing keeps the usual mode too
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


# ---------------------------------------------------------------------- 7. unreadable images
def _folder(root: Path, bad=(), bombs=()) -> Path:
    """Two classes of 4x4 images; ``bad`` files are not images, ``bombs`` are 64x64 images."""
    rng = np.random.default_rng(0)
    for c in ('cat', 'dog'):
        (root / c).mkdir(parents=True)
        for j in range(3):
            Image.fromarray(rng.integers(0, 255, (4, 4, 3), dtype=np.uint8)).save(root / c / f'{j}.png')
    for rel in bad:
        (root / rel).write_bytes(b'not an image at all')
    for rel in bombs:
        Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(root / rel)
    return root


def test_a_decompression_bomb_is_skipped_like_any_unreadable_image(tmp_path, monkeypatch):
    from timm.data import create_transform

    from train.data import ImageFolderDataset
    # PIL refuses images over twice MAX_IMAGE_PIXELS with DecompressionBombError: 64 x 64 is a bomb here
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 1000)
    ds = ImageFolderDataset(_folder(tmp_path / 'train', bombs=('cat/bomb.png',)), create_transform(16))
    bomb = [i for i, (p, _) in enumerate(ds.samples) if p.endswith('bomb.png')][0]
    img, label, unreadable = ds[bomb]
    assert unreadable == bomb and img.shape == (3, 16, 16)
    assert label == ds.samples[bomb + 1][1]  # the next readable image takes its place


def _tiny_folder_run(root: Path, out: Path, epochs: int):
    overrides = [
        f'data.root={root}', f'output_dir={out}', 'model.pretrained=false', 'model.name=vit_tiny',
        'model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}', 'data.img_size=16',
        'data.workers=0', 'train.batch_size=2', f'train.epochs={epochs}', 'train.steps_per_epoch=null',
        'sched.cooldown_epochs=0', 'sched.warmup_epochs=0', 'data.aug.repeated_aug=0', 'data.aug.mixup=0',
        'data.aug.cutmix=0', 'log.progress=off', 'log.every=1', 'train.threads=1']
    threads = torch.get_num_threads()
    try:
        return run(str(REPO / 'configs' / 'imagenet' / 'vit_base_learned.yaml'), overrides)
    finally:
        torch.set_num_threads(threads)


def test_each_unreadable_file_is_counted_once(tmp_path, monkeypatch):
    """Three bad files in a row and a bomb, over two epochs: 4 unreadable files, not 4 per epoch nor one
    per attempt to read them."""
    monkeypatch.setattr(Image, 'MAX_IMAGE_PIXELS', 1000)
    root = tmp_path / 'data'
    _folder(root / 'train', bad=('cat/bad0.png', 'cat/bad1.png', 'cat/bad2.png'), bombs=('dog/bomb.png',))
    _folder(root / 'val')
    [result] = _tiny_folder_run(root, tmp_path / 'runs', epochs=2)
    assert result.steps == 10  # 10 files, batch 2: every file is visited in both epochs
    assert result.skipped == 4
    with open(result.run_dir / 'train.csv', newline='') as f:
        assert int(list(csv.DictReader(f))[-1]['skipped']) == 4
    assert load_checkpoint(result.run_dir / 'checkpoint.pt')['unreadable'] == [3, 4, 5, 9]


# ---------------------------------------------------------------------- 8. config values caught early
def test_non_positive_extrapolation_sizes_are_rejected_on_load():
    with pytest.raises(ConfigError, match=r'extrapolate.sizes\[0\]: must be >= 1, got 0'):
        load_config(CONFIG, ['extrapolate.sizes=[0]'])
    with pytest.raises(ConfigError, match=r'extrapolate.sizes\[1\]: must be >= 1, got -32'):
        load_config(CONFIG, ['extrapolate.sizes=[32, -32]'])


@pytest.mark.parametrize('override, message', [
    ('extrapolate.sizes=[32, 36]', 'extrapolate.sizes: 36 px is not a multiple of the patch size 8x8 of vit_tiny; '
                                   'use multiples of 8 (e.g. 32 or 40)'),
    ('data.img_size=36', 'data.img_size: 36 px is not a multiple of the patch size 8x8'),
])
def test_sizes_the_patch_does_not_divide_fail_before_the_first_step(tmp_path, override, message):
    with pytest.raises(ConfigError) as e:
        _run(tmp_path, override)
    assert str(e.value).startswith(message)
    assert not list(tmp_path.glob('**/*.csv')) and not list(tmp_path.glob('**/*.pt'))


def test_a_missing_gpu_is_reported_naming_train_device(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert main([CONFIG, f'output_dir={tmp_path}', 'train.device=cuda'] + TINY) == 2
    assert "config error: train.device: 'cuda', but this machine has no usable CUDA GPU" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="train.device: 'gpu' is not allowed; allowed values: 'auto', 'cpu'"):
        load_config(CONFIG, ['train.device=gpu'])


def test_gpu_indices_are_checked_against_the_machine(monkeypatch):
    from train.distributed import init_distributed
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    monkeypatch.setenv('LOCAL_RANK', '3')
    assert init_distributed('cuda').device == torch.device('cuda', 1)  # local rank 3 of 2 GPUs per node
    assert init_distributed('cuda:1').device == torch.device('cuda', 1)
    with pytest.raises(ConfigError, match="train.device: 'cuda:2', but this machine has 2 GPU"):
        init_distributed('cuda:2')
    with pytest.raises(ConfigError, match="--device: 'cuda:x' is not allowed"):
        init_distributed('cuda:x', key='--device')


@pytest.mark.parametrize('value', ['on', 'true'])
def test_tensorboard_on_without_the_package_fails_before_anything_is_written(tmp_path, monkeypatch, value):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(train.logs.importlib.util, 'find_spec',
                        lambda name, *a: None if name == 'tensorboard' else find_spec(name, *a))
    with pytest.raises(ConfigError, match="log.tensorboard: 'on' needs the tensorboard package"):
        _run(tmp_path, f'log.tensorboard={value}')
    assert not list(tmp_path.glob('**/log.txt'))


def _laughs() -> str:
    """``{a: &a [lol x 10], b: &b [*a x 10], ..., i: &i [*h x 10]}``: 10^9 strings once written out."""
    items = [f'a: &a [{", ".join(["lol"] * 10)}]']
    items += [f'{k}: &{k} [{", ".join([f"*{p}"] * 10)}]' for p, k in zip('abcdefgh', 'bcdefghi')]
    return '{' + ', '.join(items) + '}'


def test_yaml_aliases_cannot_blow_a_config_up(tmp_path):
    path = tmp_path / 'lol.yaml'
    path.write_text(f'model:\n  kwargs: {_laughs()}\n')
    assert path.stat().st_size < 500
    with pytest.raises(ConfigError, match=f"config '{path}': YAML aliases expand the document to more than 100000"):
        load_config(path)
    with pytest.raises(ConfigError, match='override .*: YAML aliases expand'):
        load_config(CONFIG, [f'model.kwargs={_laughs()}'])
    (tmp_path / 'loop.yaml').write_text('model:\n  kwargs: {a: &a [1, *a]}\n')
    with pytest.raises(ConfigError, match='line 2, column 15 contains an alias to itself'):
        load_yaml(tmp_path / 'loop.yaml')


def test_yaml_anchors_of_a_normal_size_still_work(tmp_path):
    path = tmp_path / 'anchors.yaml'
    path.write_text('optim: &recipe {lr: 0.1, weight_decay: 0.0}\nsweep: {optim: [*recipe, *recipe]}\n')
    assert load_yaml(path)['sweep']['optim'] == [{'lr': 0.1, 'weight_decay': 0.0}] * 2
