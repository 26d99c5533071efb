"""The ``dit`` task of the shared training script: a tiny diffusers transformer with a vispe encoding
trained by flow matching on generated scenes, evaluated, checkpointed and rebuilt."""
from pathlib import Path

import pytest
import torch

pytest.importorskip('diffusers')

CONFIG = Path(__file__).resolve().parents[1] / 'configs' / 'dit.yaml'
TINY_RUN = ['name=dit_test', 'data.grid=4', 'data.train_size=4', 'data.val_size=2', 'train.epochs=1',
            'train.batch_size=2', 'sched.warmup_epochs=0', 'log.progress=off', 'log.tensorboard=off', 'sweep={}',
            'extrapolate.sizes=[]']


@pytest.mark.parametrize('host, pe', [('flux', 'rope_mixed'), ('wan', 'liere')])
def test_dit_task_trains_evaluates_and_rebuilds_through_the_shared_script(tmp_path, host, pe):
    from train.checkpoint import load_checkpoint
    from train.cli import run
    from train.config import load_config
    from train.tasks import get_task
    overrides = TINY_RUN + [f'model.host={host}', f'model.pe={pe}', f'output_dir={tmp_path}']
    result, = run(CONFIG, overrides)
    assert result.steps == 2 and result.best['metric'] == 'loss'
    assert torch.isfinite(torch.tensor(result.last_metrics['loss']))
    best = load_checkpoint(result.best_path)
    cfg, _ = load_config(CONFIG, overrides)
    task = get_task('dit')(cfg)
    model = task.rebuild_model(best['model_spec'])
    model.load_state_dict(best['model'])
    assert model.patch.encoding.name == pe
    assert model.no_weight_decay() and all('transformer.' in n for n in model.no_weight_decay())


def test_scenes_are_the_same_at_every_grid():
    """A scene rendered on a 2x grid, averaged over 2 x 2 cells, is the scene on the 1x grid up to the
    sampling of its edges (every kind)."""
    from train.tasks.dit import render_scene
    kinds = set()
    for index in range(8):
        small, kind = render_scene(index, 0, 4, 3, 32)
        large, _ = render_scene(index, 0, 4, 3, 64)
        pooled = torch.nn.functional.avg_pool2d(large[None], 2)[0]
        assert (pooled - small).abs().mean() < 0.05 * small.abs().mean()
        kinds.add(kind)
    assert kinds == {0, 1, 2, 3}


def test_dit_config_validates_and_scaling_needs_the_own_encoding():
    from train.config import ConfigError, load_config
    cfg, _ = load_config(CONFIG, [])
    assert cfg.task == 'dit' and cfg.model.host == 'flux' and cfg.model.pe == 'own'
    with pytest.raises(ConfigError, match="model.scaling: scales the host's own encoding"):
        load_config(CONFIG, ['model.pe=liere', 'model.scaling=yarn', 'sweep={}'])


@pytest.mark.parametrize('host', ['flux', 'sd3', 'qwenimage', 'wan', 'hunyuan_video', 'ltx_video'])
def test_every_host_of_the_task_takes_a_training_and_an_evaluation_step(host):
    from train.config import load_config
    from train.tasks import get_task
    cfg, _ = load_config(CONFIG, TINY_RUN + [f'model.host={host}', 'model.pe=rope_mixed'])
    task = get_task('dit')(cfg)
    model = task.build_model()
    batch = next(iter(torch.utils.data.DataLoader(task.train_dataset(), batch_size=2)))
    loss, _ = task.train_step(model, batch, 0)
    loss.backward()
    assert torch.isfinite(loss) and model.patch.encoding.freqs.grad is not None
    larger = next(iter(torch.utils.data.DataLoader(task.eval_dataset(6), batch_size=2)))
    with torch.no_grad():
        sums = task.eval_step(model.eval(), larger)
    assert sums['count'] == 2 and torch.isfinite(sums['loss'])
