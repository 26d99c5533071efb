"""The ``transformers_vision`` task of the shared training script: a transformers image classifier patched with
any vispe encoding, trained, evaluated at other sizes and rebuilt from its checkpoint."""
from pathlib import Path

import pytest
import torch

pytest.importorskip('transformers')

CONFIG = Path(__file__).resolve().parents[1] / 'configs' / 'transformers_vision.yaml'
TINY_RUN = ['name=tv', 'model.config={patch_size: 8, hidden_size: 32, num_hidden_layers: 1, num_attention_heads: 2, '
            'intermediate_size: 64}', 'data.synthetic.train_size=4', 'data.synthetic.val_size=4', 'train.epochs=1',
            'train.batch_size=2', 'sched.warmup_epochs=0', 'log.progress=off', 'log.tensorboard=off',
            'extrapolate.sizes=[32,48]']


@pytest.mark.parametrize('family, pe', [('vit', 'rope_mixed'), ('dinov2_registers', None)])
def test_task_trains_two_steps_sweeps_sizes_and_rebuilds(tmp_path, family, pe):
    from train.checkpoint import load_checkpoint
    from train.cli import run
    from train.config import load_config
    from train.tasks import get_task
    overrides = TINY_RUN + [f'output_dir={tmp_path}', f'model.family={family}', f'model.pe={pe or "null"}',
                            'sweep={}']
    result, = run(CONFIG, overrides)
    assert result.steps == 2 and 0.0 <= result.last_metrics['top1'] <= 100.0
    sweep = (tmp_path / 'tv' / 'extrapolation.csv').read_text().splitlines()  # evaluated at 32 and 48 px
    assert len(sweep) >= 3 and any(',48' in row or '48,' in row for row in sweep[1:])
    best = load_checkpoint(result.best_path)
    cfg, _ = load_config(CONFIG, overrides)
    task = get_task('transformers_vision')(cfg)
    model = task.rebuild_model(best['model_spec'])
    model.load_state_dict(best['model'])
    assert any('vispe_pe' in k for k in best['model'])
    assert model.patch.encoding.name == (pe or 'learned')
    assert result.best['metric'] == 'top1'
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 48, 40)).shape == (1, 4)


def test_config_validates_and_refuses_what_it_cannot_take():
    from train.config import ConfigError, load_config
    cfg, _ = load_config(CONFIG, [])
    assert cfg.task == 'transformers_vision' and cfg.model.pe is None
    with pytest.raises(ConfigError, match="model.family: 'bert'"):
        load_config(CONFIG, ['model.family=bert'])
    with pytest.raises(ConfigError, match='not a multiple of the patch size 8'):
        load_config(CONFIG, ['extrapolate.sizes=[36]'])
