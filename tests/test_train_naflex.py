"""The NaFlex data path of the training script: native aspect ratios resized to a token budget, timm's NaFlex
batches, training on them, and the resolution sweep at native aspect ratios."""
import csv
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from train.cli import run
from train.config import ConfigError, load_config
from train.data import NaFlexCollate, NaFlexScenes, SpatialShapes
from train.extrapolate import extrapolation_table, main as extrapolate_main
from train.tasks import get_task
from vispe.naflex import naflex_size

REPO = Path(__file__).resolve().parents[1]
CONFIG = str(REPO / 'configs' / 'naflex_quickstart.yaml')
TINY = ['model.kwargs={patch_size: 8, embed_dim: 32, depth: 2, num_heads: 2, mlp_ratio: 2.0}', 'log.progress=off',
        'train.threads=1']


def _rows(path: Path):
    with open(path, newline='') as f:
        return list(csv.DictReader(f))


# ---------------------------------------------------------------------- config
@pytest.mark.parametrize('override, message', [
    (['data.naflex=false', 'data.max_tokens=16'], 'data.max_tokens: the token budget of NaFlex batches'),
    (['data.aug.mixup=0.8'], 'data.aug.mixup / data.aug.cutmix: images of different sizes cannot be mixed'),
    (['data.aug.cutmix=1.0'], 'data.aug.mixup / data.aug.cutmix'),
    (['data.crop_pct=0.9'], 'data.crop_pct: NaFlex evaluation resizes whole images'),
    (['data.synthetic.aspect=[2.0, 0.5]'], r'data.synthetic.aspect: \(low, high\)'),
    (['data.synthetic.aspect=[0, 2]'], r'data.synthetic.aspect: \(low, high\)'),
    (['data.max_tokens=0'], 'data.max_tokens: must be >= 1, got 0'),
    (['data.naflex=maybe'], 'data.naflex: expected'),
])
def test_invalid_naflex_settings_are_rejected_on_load_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG, override)


def test_the_naflex_config_loads_and_the_fixed_quickstart_is_unchanged():
    cfg, _ = load_config(CONFIG)
    assert cfg.data.naflex and cfg.data.max_tokens == 16 and cfg.data.synthetic.aspect == (0.5, 2.0)
    fixed, _ = load_config(str(REPO / 'configs' / 'quickstart.yaml'))
    assert not fixed.data.naflex and fixed.data.max_tokens is None


def test_a_model_naflex_cannot_batch_fails_before_the_first_step(tmp_path):
    """NaFlex patches are square (timm's format): the task names data.naflex when the model is built."""
    with pytest.raises(ConfigError, match='data.naflex: needs a ViT with square patches; vit_tiny has 8x4 patches'):
        run(CONFIG, [f'output_dir={tmp_path}', 'sweep={}', 'model.pe=none', 'data.synthetic.train_size=16',
                     'model.kwargs={patch_size: [8, 4], embed_dim: 32, depth: 1, num_heads: 2}',
                     'data.synthetic.val_size=8', 'train.batch_size=8', 'log.progress=off'])
    assert not list(tmp_path.rglob('*.pt'))


# ---------------------------------------------------------------------- scenes and sizes
def test_scenes_keep_their_aspect_ratio_and_labels_at_every_budget():
    square = SpatialShapes(40, 32, seed=3)
    wide = SpatialShapes(40, 32, seed=3, aspect=(0.5, 2.0))
    ratios = [wide.aspect_ratio(i) for i in range(40)]
    assert min(ratios) < 0.7 and max(ratios) > 1.4 and all(0.5 <= r <= 2.0 for r in ratios)
    for budget in (16, 36, 64):
        data = NaFlexScenes(wide, 8, budget)
        for i in range(40):
            img, label, unreadable = data[i]
            h, w = img.shape[-2:]
            assert h % 8 == 0 and w % 8 == 0 and (h // 8) * (w // 8) <= budget
            assert (h, w) == naflex_size(wide.shape(i), 8, budget)
            # each side is the scene's, scaled, rounded up to a whole patch: the grid's ratio is the scene's
            # within a patch on the shorter side (plus the rounding of the native size to whole pixels)
            short = min(h, w) // 8
            assert abs(math.log((w / h) / ratios[i])) < math.log(short / (short - 1)) + 0.05
            assert label == square[i][1] and unreadable == -1  # the question is the square scene's


def test_objects_stay_round_square_and_in_their_cells_on_wide_canvases():
    """Sizes are fractions of the shorter side, centres fractions of each side: the red square's extent in
    pixels is the same along both axes, and its centre is where the square scene puts it."""
    scenes = SpatialShapes(20, 32, aspect=(0.5, 2.0), object_size=(0.08, 0.09))
    for i in range(20):
        h, w = 48, 96 if scenes.aspect_ratio(i) > 1 else 24
        img = scenes.render(i, (h, w))
        red = (img[..., 0] > 0.6) & (img[..., 2] < 0.4)
        rows, cols = np.nonzero(red)
        assert abs((rows.max() - rows.min()) - (cols.max() - cols.min())) <= 1
        s = scenes.scene(i)
        assert abs(cols.mean() + 0.5 - s['square'][0] * w) < 1.0 and abs(rows.mean() + 0.5 - s['square'][1] * h) < 1.0


# ---------------------------------------------------------------------- the collate
def test_collate_builds_timm_naflex_batches_padded_to_the_budget():
    images = [torch.randn(3, 16, 40), torch.randn(3, 32, 32), torch.randn(3, 24, 8)]
    batch, labels, unreadable = NaFlexCollate(8, 20)([(img, k, -1 if k else 7) for k, img in enumerate(images)])
    assert set(batch) == {'patches', 'patch_coord', 'patch_valid'}
    assert batch['patches'].shape == (3, 20, 8 * 8 * 3) and batch['patch_coord'].shape == (3, 20, 2)
    assert labels.tolist() == [0, 1, 2] and unreadable.tolist() == [7, -1, -1]
    for b, img in enumerate(images):
        gh, gw = img.shape[1] // 8, img.shape[2] // 8
        n = gh * gw
        assert batch['patch_valid'][b].tolist() == [True] * n + [False] * (20 - n)
        rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing='ij')
        assert torch.equal(batch['patch_coord'][b, :n], torch.stack([rows.flatten(), cols.flatten()], 1))
        # patch k is the image's (row, col) block, flattened (ph, pw, C) as in timm
        for k, (r, c) in enumerate(batch['patch_coord'][b, :n].tolist()):
            block = img[:, 8 * r:8 * r + 8, 8 * c:8 * c + 8].permute(1, 2, 0).reshape(-1)
            assert torch.equal(batch['patches'][b, k], block)
        assert not batch['patches'][b, n:].any() and not batch['patch_coord'][b, n:].any()


def test_collate_refuses_an_image_over_the_budget():
    with pytest.raises(ValueError, match='max_tokens=4 is smaller than the largest image'):
        NaFlexCollate(8, 4)([(torch.randn(3, 16, 24), 0, -1)])


def test_image_folders_keep_their_aspect_ratio_through_timm_transforms(tmp_path):
    for split in ('train', 'val'):
        for c, (h, w) in (('a', (30, 90)), ('b', (80, 40))):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.zeros((h, w, 3), np.uint8)).save(tmp_path / split / c / '0.png')
    cfg, _ = load_config(CONFIG, [f'data.root={tmp_path}', 'data.kind=folder', 'data.max_tokens=24'] + TINY)
    task = get_task('classification')(cfg)
    task.build_model()
    val = task.eval_dataset()
    shapes = sorted(tuple(val[i][0].shape[-2:]) for i in range(len(val)))
    # 1:3 -> 3x8 patches; 2:1 -> 6x3 (7x4, the next grid of whole patches, is over 24)
    assert shapes == sorted([naflex_size((30, 90), 8, 24), naflex_size((80, 40), 8, 24)]) == [(24, 64), (48, 24)]
    train = task.train_dataset()
    for i in range(len(train)):
        h, w = train[i][0].shape[-2:]
        assert h % 8 == 0 and w % 8 == 0 and (h // 8) * (w // 8) <= 24
    batch, _, _ = task.collate_fn([val[i] for i in range(len(val))])
    assert batch['patches'].shape[:2] == (2, 24)


# ---------------------------------------------------------------------- training and the sweep
@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp('naflex')
    threads = torch.get_num_threads()
    try:
        [result] = run(CONFIG, [f'output_dir={out}', 'sweep={}', 'model.pe=rope_mixed', 'data.synthetic.train_size=64',
                                'data.synthetic.val_size=24', 'train.batch_size=16', 'train.epochs=1',
                                'extrapolate.max_tokens=[16, 36]'] + TINY)
    finally:
        torch.set_num_threads(threads)
    return out / 'naflex_quickstart', result


def test_the_quickstart_trains_on_naflex_batches(trained):
    root, result = trained
    assert result.steps == 4 and result.best_path.is_file()
    [row] = _rows(result.run_dir / 'eval.csv')
    assert 0.0 <= float(row['top1']) <= 100.0 and math.isfinite(float(row['loss']))
    assert 12 <= float(row['tokens']) <= 16  # the 16-token budget, grids 4x4, 3x5, 5x3
    assert 3 <= float(row['grid_h']) <= 5 and 3 <= float(row['grid_w']) <= 5


def test_the_sweep_evaluates_at_native_aspect_ratios_per_token_budget(trained, capsys):
    root, _ = trained
    rows = _rows(root / 'extrapolation.csv')
    assert [(r['size'], r['max_tokens'], r['train_max_tokens']) for r in rows] == [('', '16', '16'),
                                                                                  ('', '36', '16')]
    assert float(rows[0]['tokens']) <= 16 < float(rows[1]['tokens']) <= 36
    md = (root / 'extrapolation.md').read_text()
    assert md.splitlines()[0].split('|')[2:4] == [' 16*       ', ' 36        ']
    assert '| mean grid (h x w)' in md and 'training budget (16 tokens)' in md
    # --max-tokens: any budgets, the table and plot in tokens
    out = root / 'budgets'
    assert extrapolate_main([str(root / 'best.pt'), '--max-tokens', '8', '24', '--out', str(out), '--progress', 'off',
                             'data.synthetic.val_size=8']) == 0
    rows = _rows(out / 'extrapolation.csv')
    assert [r['max_tokens'] for r in rows] == ['8', '24'] and all(r['size'] == '' for r in rows)
    assert all(float(r['tokens']) <= int(r['max_tokens']) for r in rows)
    assert (out / 'extrapolation.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert '| rope_mixed' in capsys.readouterr().out


def test_a_fixed_size_checkpoint_is_evaluated_at_native_aspect_ratios_with_max_tokens(tmp_path):
    [result] = run(str(REPO / 'configs' / 'quickstart.yaml'), [
        f'output_dir={tmp_path}', 'sweep={}', 'model.pe=rope_axial', 'data.synthetic.train_size=16',
        'data.synthetic.val_size=8', 'train.batch_size=16', 'train.epochs=1', 'extrapolate.sizes=[]'] + TINY)
    out = tmp_path / 'report'
    assert extrapolate_main([str(result.best_path), '--max-tokens', '16', '--out', str(out), '--progress',
                             'off']) == 0
    [row] = _rows(out / 'extrapolation.csv')
    assert row['max_tokens'] == '16' and float(row['grid_h']) * float(row['grid_w']) > 0
    # --sizes keeps the square evaluation of a fixed-size checkpoint
    assert extrapolate_main([str(result.best_path), '--sizes', '32', '--out', str(out), '--progress', 'off']) == 0
    [row] = _rows(out / 'extrapolation.csv')
    assert row['size'] == '32' and 'max_tokens' not in row


def test_native_aspect_table_marks_the_training_budget_and_reports_grids():
    rows = [dict(label=pe, max_tokens=b, train_max_tokens=16, metric='top1', top1=v, tokens=g[0] * g[1] - 0.5,
                 grid_h=g[0], grid_w=g[1], aspect=g[1] / g[0])
            for pe, vals in (('none', (25.0, 24.0)), ('rope_mixed', (99.0, 70.5)))
            for b, v, g in zip((16, 64), vals, ((3.5, 4.5), (7.0, 9.0)))]
    lines = extrapolation_table(rows).splitlines()
    assert [c.strip() for c in lines[0].split('|')[1:-1]] == ['encoding (top1) / tokens', '16*', '64']
    assert [c.strip() for c in lines[3].split('|')[1:-1]] == ['rope_mixed', '99.0', '70.5']
    assert [c.strip() for c in lines[4].split('|')[1:-1]] == ['mean tokens', '15.2', '62.5']
    assert [c.strip() for c in lines[5].split('|')[1:-1]] == ['mean grid (h x w)', '3.5 x 4.5', '7.0 x 9.0']
    assert [c.strip() for c in lines[6].split('|')[1:-1]] == ['mean aspect (w / h)', '1.29', '1.29']


def test_a_model_that_refuses_naflex_batches_fails_before_the_first_step(tmp_path, monkeypatch):
    """The task runs a two-grid batch through the built model: whatever it raises comes back naming the key."""
    import vispe.vit

    def refuse(self, batch, attn_mask):
        raise ValueError('per-sample grids are not supported')
    monkeypatch.setattr(vispe.vit.VisionTransformer, '_embed_naflex', refuse)
    with pytest.raises(ConfigError, match=r"data.naflex: vit_tiny with model.pe='rope_mixed' does not take NaFlex "
                                          r'batches \(ValueError: per-sample grids are not supported\)'):
        run(CONFIG, [f'output_dir={tmp_path}', 'sweep={}', 'model.pe=rope_mixed', 'data.synthetic.train_size=16',
                     'data.synthetic.val_size=8', 'train.batch_size=8'] + TINY)
    assert not list(tmp_path.rglob('*.pt'))


def test_extrapolate_takes_square_sizes_or_token_budgets_not_both():
    with pytest.raises(ConfigError, match='extrapolate.max_tokens: .*give one of them'):
        load_config(CONFIG, ['extrapolate.sizes=[32]'])
    cfg, _ = load_config(CONFIG, [])
    assert cfg.extrapolate.max_tokens == [16, 36, 64] and cfg.extrapolate.sizes == []
