"""The training loop end to end, in process: smoke runs of each config family, recipes, outputs."""
import csv
import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

from train.checkpoint import atomic_save, load_checkpoint
from train.cli import run
from train.config import ConfigError, load_config
from train.distributed import DistEnv
from train.engine import Trainer
from train.extrapolate import main as extrapolate_main, write_reports

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / 'configs'
TINY = 'model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}'
QUIET = ['log.progress=off', 'train.threads=1']


def _image_folder(root: Path, classes=('a', 'b', 'c'), per_class=6, size=40, corrupt=()) -> Path:
    rng = np.random.default_rng(0)
    for split in ('train', 'val'):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            for j in range(per_class if split == 'train' else 2):
                arr = rng.integers(0, 255, (size, size + 8, 3), dtype=np.uint8)
                Image.fromarray(arr).save(root / split / c / f'{j}.jpg')
    for rel in corrupt:
        (root / rel).write_bytes(b'\xff\xd8 truncated jpeg')
    return root


def _rows(path: Path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


def test_quickstart_family_trains_and_prints_the_extrapolation_table(tmp_path, capsys):
    results = run(str(CONFIGS / 'quickstart.yaml'), [
        f'output_dir={tmp_path}', TINY, 'data.synthetic.train_size=64', 'data.synthetic.val_size=32',
        'train.batch_size=16', 'train.epochs=1', 'sweep={model.pe: [none, rope_mixed]}', 'extrapolate.sizes=[32, 48]',
        'train.checkpoint_every=2'] + QUIET)
    assert [r.label for r in results] == ['none', 'rope_mixed']
    root = tmp_path / 'quickstart'
    for r in results:
        assert r.steps == 4 and r.epochs == 1
        for f in ('best.pt', 'checkpoint.pt', 'train.csv', 'eval.csv', 'log.txt', 'config.yaml'):
            assert (r.run_dir / f).is_file(), f
        assert not list(r.run_dir.glob('.*.tmp'))  # no temporary files left by atomic saves
        assert [row['step'] for row in _rows(r.run_dir / 'eval.csv')] == ['4']
        best = load_checkpoint(r.run_dir / 'best.pt')
        assert best['model_spec']['kwargs']['pe'] == r.label and best['model_spec']['name'] == 'vit_tiny'
    table = (root / 'extrapolation.md').read_text()
    assert '| none ' in table and '| rope_mixed ' in table and '32*' in table
    rows = _rows(root / 'extrapolation.csv')
    assert {(r['label'], r['size']) for r in rows} == {(p, s) for p in ('none', 'rope_mixed') for s in ('32', '48')}
    assert {r['chance'] for r in rows} == {'25.0'}  # top-1 of a guess among the 4 classes
    assert (root / 'extrapolation.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    out = capsys.readouterr().out
    assert 'resolution extrapolation' in out and 'summary' in out


def _imagenet_overrides(root: Path, out: Path):
    return [f'data.root={root}', f'output_dir={out}', 'model.pretrained=false', 'model.name=vit_tiny', TINY,
            'data.img_size=32', 'data.workers=0', 'train.batch_size=4', 'train.epochs=2', 'train.steps_per_epoch=2',
            'sched.cooldown_epochs=0', 'sched.warmup_epochs=1'] + QUIET


@pytest.mark.parametrize('config, extra', [
    ('vit_base_learned.yaml', ['train.amp=fp16', 'optim.clip_grad=1.0']),
    ('vit_base_rope_mixed.yaml', ['train.amp=bf16']),
])
def test_imagenet_recipes_train_on_a_tiny_image_folder(tmp_path, config, extra):
    """One config of each recipe family (DeiT: RandAugment, random erasing, repeated augmentation, mixup /
    cutmix, EMA; RoPE-ViT: same without repeated augmentation), with a corrupt file in the data, under
    fp16 autocast with a grad scaler and clipping, and bf16 autocast."""
    root = _image_folder(tmp_path / 'imagenet', corrupt=('train/a/broken.jpg',))
    [result] = run(str(CONFIGS / 'imagenet' / config), _imagenet_overrides(root, tmp_path / 'runs') + extra)
    assert result.steps == 4 and result.best['metric'] == 'top1'
    assert 0.0 <= result.best['value'] <= 100.0
    ckpt = load_checkpoint(result.run_dir / 'checkpoint.pt')
    assert ckpt['ema'] is not None  # both recipes keep an EMA
    assert (ckpt['scaler'] is not None) == ('train.amp=fp16' in extra)
    assert result.run_dir.name == Path(config).stem
    train_rows = _rows(result.run_dir / 'train.csv')
    assert int(train_rows[-1]['skipped']) == result.skipped


def test_unreadable_images_are_counted_in_the_summary(tmp_path):
    root = _image_folder(tmp_path / 'data', per_class=2, corrupt=('train/a/x.jpg', 'train/b/y.jpg'))
    # both epochs visit all 8 files: the 2 unreadable ones are met twice and counted once
    [result] = run(str(CONFIGS / 'imagenet' / 'vit_base_learned.yaml'), _imagenet_overrides(root, tmp_path / 'runs') + [
        'data.aug.repeated_aug=0', 'train.steps_per_epoch=null', 'data.aug.mixup=0', 'data.aug.cutmix=0'])
    assert result.skipped == 2


def test_encoding_parameters_are_not_weight_decayed(tmp_path):
    cfg, _ = load_config(CONFIGS / 'quickstart.yaml', [
        TINY, 'model.pe=rope_mixed+learned', 'sweep={}', f'output_dir={tmp_path}', 'data.synthetic.train_size=32',
        'data.synthetic.val_size=8', 'train.batch_size=8'] + QUIET)
    trainer = Trainer(cfg, DistEnv(), tmp_path / 'run')
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decay = {names[id(p)] for g in trainer.optimizer.param_groups if g['weight_decay'] > 0 for p in g['params']}
    no_decay = {names[id(p)] for g in trainer.optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    assert {'pe.encodings.0.freqs', 'pe.encodings.1.pos_embed', 'cls_token'} <= no_decay
    assert 'blocks.0.attn.qkv.weight' in decay and not any(n.startswith('pe.') for n in decay)
    assert trainer.model.no_weight_decay() >= {'pe.encodings.0.freqs', 'pe.encodings.1.pos_embed'}


@pytest.mark.parametrize('prefix', [False, True])
def test_warmup_then_cosine_per_update(tmp_path, prefix):
    cfg, _ = load_config(CONFIGS / 'quickstart.yaml', [
        TINY, 'model.pe=none', 'sweep={}', f'output_dir={tmp_path}', 'data.synthetic.train_size=80',
        'data.synthetic.val_size=8', 'train.batch_size=8', 'train.epochs=2', 'optim.lr=0.01',
        'sched.warmup_epochs=1', 'sched.warmup_lr=0.0', 'sched.min_lr=0.0', f'sched.warmup_prefix={prefix}',
        'log.every=1'] + QUIET)
    Trainer(cfg, DistEnv(), tmp_path / 'run').fit()
    lrs = [float(r['lr']) for r in _rows(tmp_path / 'run' / 'train.csv')]  # row k: the lr of update k + 1
    # timm: linear warmup over the first 10 updates, then a cosine to 0 over the 20 updates of the 2 epochs:
    # the cosine spans updates 0..20 under the warmup (timm's default, DeiT's), or follows it (prefix:
    # the run grows by the warmup epoch)
    if prefix:
        cosine = [0.005 * (1 + np.cos(np.pi * (t - 10) / 20)) for t in range(10, 31)]
    else:
        cosine = [0.005 * (1 + np.cos(np.pi * t / 20)) for t in range(10, 21)]
    assert lrs == pytest.approx([0.001 * t for t in range(1, 10)] + cosine, abs=1e-6)


def test_fine_tuning_from_a_local_timm_checkpoint_swaps_the_encoding(tmp_path):
    """A timm ViT's weights load into the vispe ViT with pe='rope_mixed': shared weights kept, the learned
    table dropped, the encoding initialised (vispe's report), the classifier resized to the data."""
    arch = dict(patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, img_size=32)
    timm_vit = timm.create_model('vit_tiny_patch16_224', pretrained=False, num_classes=1000, **arch)
    path = tmp_path / 'timm_vit.pth'
    torch.save(timm_vit.state_dict(), path)
    cfg, _ = load_config(CONFIGS / 'quickstart.yaml', [
        TINY, 'model.pe=rope_mixed', f'model.pretrained_file={path}', 'sweep={}', f'output_dir={tmp_path}',
        'data.synthetic.train_size=16', 'data.synthetic.val_size=8', 'train.batch_size=8'] + QUIET)
    trainer = Trainer(cfg, DistEnv(), tmp_path / 'run')
    model = trainer.model
    assert torch.equal(model.blocks[1].attn.qkv.weight, timm_vit.blocks[1].attn.qkv.weight)
    assert torch.equal(model.patch_embed.proj.weight, timm_vit.patch_embed.proj.weight)
    report = model.pretrained_report
    assert 'pos_embed' in report.dropped and 'pe.freqs' in report.initialized
    assert model.head.weight.shape == (4, 32)


def test_extrapolate_cli_writes_csv_markdown_and_plot(tmp_path, capsys):
    results = run(str(CONFIGS / 'quickstart.yaml'), [
        f'output_dir={tmp_path}', TINY, 'data.synthetic.train_size=32', 'data.synthetic.val_size=16',
        'train.batch_size=16', 'sweep={model.pe: [learned, rope_axial]}', 'extrapolate.sizes=[]'] + QUIET)
    paths = [str(r.run_dir / 'best.pt') for r in results]
    out = tmp_path / 'report'
    code = extrapolate_main(paths + ['--sizes', '32', '40', '64', '--out', str(out), '--progress', 'off',
                                     'data.synthetic.val_size=8'])
    assert code == 0
    rows = _rows(out / 'extrapolation.csv')
    assert [(r['label'], int(r['size'])) for r in rows] == [
        (p, s) for p in ('learned', 'rope_axial') for s in (32, 40, 64)]
    assert all(r['train_size'] == '32' for r in rows)
    assert all(0.0 <= float(r['top1']) <= 100.0 for r in rows)
    md = (out / 'extrapolation.md').read_text().splitlines()
    assert md[0].split('|')[2:5] == [' 32* ', ' 40  ', ' 64  '] or '32*' in md[0]
    assert len([line for line in md if line.startswith('| learned') or line.startswith('| rope_axial')]) == 2
    assert (out / 'extrapolation.png').stat().st_size > 1000
    assert 'rope_axial' in capsys.readouterr().out


def test_extrapolation_plot_marks_the_sizes_and_chance_and_keeps_the_legend_off_the_lines(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    figures, close = [], plt.close
    monkeypatch.setattr(plt, 'close', figures.append)  # keep the figure to inspect it
    top1 = {'none': (25.1, 25.2, 25.1), 'rope_axial': (100.0, 58.4, 34.9)}
    rows = [dict(label=pe, pe=pe, checkpoint=f'{pe}/best.pt', train_size=32, size=size, metric='top1', chance=25.0,
                 top1=value) for pe, values in top1.items() for size, value in zip((32, 48, 80), values)]
    write_reports(rows, tmp_path)
    [fig] = figures
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [32, 48, 80]  # the sizes evaluated, not matplotlib's round numbers
    chance = [line for line in ax.get_lines() if list(line.get_ydata()) == [25.0, 25.0]]
    assert len(chance) == 1 and chance[0].get_label() == 'chance (25)'
    fig.canvas.draw()
    legend = ax.get_legend()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the axes: it covers no line
    assert [t.get_text() for t in legend.get_texts()] == ['none', 'rope_axial', 'chance (25)']
    close(fig)


def test_extrapolate_rejects_a_size_the_patch_does_not_divide(tmp_path, capsys):
    [result] = run(str(CONFIGS / 'quickstart.yaml'), [
        f'output_dir={tmp_path}', TINY, 'data.synthetic.train_size=16', 'data.synthetic.val_size=8',
        'train.batch_size=16', 'sweep={}', 'model.pe=none'] + QUIET)
    assert extrapolate_main([str(result.run_dir / 'best.pt'), '--sizes', '36', '--progress', 'off']) == 2
    assert 'input size 36x36 is not divisible by the patch size 8x8' in capsys.readouterr().out


def test_atomic_save_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / 'ckpt.pt'
    atomic_save({'a': torch.ones(2)}, path)
    atomic_save({'a': torch.zeros(2)}, path)
    assert torch.equal(torch.load(path)['a'], torch.zeros(2))
    assert [p.name for p in tmp_path.iterdir()] == ['ckpt.pt']

    class Unpicklable:
        def __reduce__(self):
            raise RuntimeError('boom')

    with pytest.raises(RuntimeError, match='boom'):
        atomic_save({'a': Unpicklable()}, path)
    assert torch.equal(torch.load(path)['a'], torch.zeros(2))  # the old file survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ['ckpt.pt']


def test_resume_from_best_pt_is_refused_with_a_hint(tmp_path):
    [result] = run(str(CONFIGS / 'quickstart.yaml'), [
        f'output_dir={tmp_path}', TINY, 'data.synthetic.train_size=16', 'data.synthetic.val_size=8',
        'train.batch_size=16', 'sweep={}', 'model.pe=none'] + QUIET)
    with pytest.raises(ConfigError, match='train.resume: .* holds weights only'):
        run(str(CONFIGS / 'quickstart.yaml'), [
            f'output_dir={tmp_path}/again', TINY, 'data.synthetic.train_size=16', 'data.synthetic.val_size=8',
            'train.batch_size=16', 'sweep={}', 'model.pe=none', f'train.resume={result.run_dir / "best.pt"}'] + QUIET)
    assert json.dumps(load_checkpoint(result.run_dir / 'best.pt')['metrics'])


def test_tensorboard_is_used_when_installed_and_required_only_when_asked(tmp_path):
    import importlib.util
    args = [f'output_dir={tmp_path}', TINY, 'data.synthetic.train_size=16', 'data.synthetic.val_size=8',
            'train.batch_size=16', 'sweep={}', 'model.pe=none'] + QUIET
    if importlib.util.find_spec('tensorboard') is None:
        with pytest.raises(ConfigError, match="log.tensorboard: 'on' needs the tensorboard package"):
            run(str(CONFIGS / 'quickstart.yaml'), args + ['log.tensorboard=on'])
        [result] = run(str(CONFIGS / 'quickstart.yaml'), args + ['log.tensorboard=auto'])
        assert not (result.run_dir / 'tensorboard').exists()
    else:
        [result] = run(str(CONFIGS / 'quickstart.yaml'), args + ['log.tensorboard=on'])
        assert list((result.run_dir / 'tensorboard').glob('events.out.tfevents.*'))


def test_a_resumed_run_purges_the_tensorboard_events_it_repeats(tmp_path, monkeypatch):
    """Like the CSV logs, TensorBoard forgets the steps after the checkpoint a resumed run restarts from
    (SummaryWriter's purge_step: events at or after it are dropped), so no step is shown twice."""
    import sys
    import types
    writers = []

    class Writer:  # torch.utils.tensorboard.SummaryWriter's interface, recording what it is given
        def __init__(self, log_dir, purge_step=None):
            self.purge_step, self.steps = purge_step, []
            writers.append(self)

        def add_scalar(self, tag, value, step):
            self.steps.append(step)

        def close(self):
            pass

    monkeypatch.setitem(sys.modules, 'torch.utils.tensorboard', types.SimpleNamespace(SummaryWriter=Writer))
    monkeypatch.setattr('train.engine.tensorboard_enabled', lambda mode: True)
    args = [f'output_dir={tmp_path}', TINY, 'data.synthetic.train_size=32', 'data.synthetic.val_size=8',
            'train.batch_size=16', 'sweep={}', 'model.pe=none', 'name=tb', 'log.every=1'] + QUIET
    run(str(CONFIGS / 'quickstart.yaml'), args + ['train.epochs=1'])
    run(str(CONFIGS / 'quickstart.yaml'), args + ['train.epochs=2', 'train.resume=auto'])
    first, resumed = writers
    assert first.purge_step is None and max(first.steps) == 2  # 2 steps per epoch
    assert resumed.purge_step == 3 and min(resumed.steps) >= resumed.purge_step


@pytest.mark.slow
def test_quickstart_nope_stays_at_chance_while_positional_encodings_learn(tmp_path):
    """The README's main command as shipped (minutes on two CPU cores)."""
    results = run(str(CONFIGS / 'quickstart.yaml'), [f'output_dir={tmp_path}', 'log.progress=off'])
    top1 = {r.label.split(':')[0]: r.best['value'] for r in results}
    assert top1['none'] < 35.0, top1
    for pe in ('learned', 'rope_axial', 'rope_mixed'):
        assert top1[pe] > 90.0, top1
