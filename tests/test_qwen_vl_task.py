"""The qwen_vl training task: a tiny transformers Qwen-VL model fine-tuned through patch_vlm with a
swapped scheme, a couple of steps of the shared training script."""
from pathlib import Path

import pytest

pytest.importorskip('transformers')


@pytest.mark.parametrize('family, scheme', [('qwen2_vl', 'videorope'), ('qwen3_vl', 'mhrope')])
def test_training_script_fine_tunes_a_patched_qwen_vl_model(tmp_path, family, scheme):
    from train.cli import run
    config = Path(__file__).resolve().parent.parent / 'configs' / 'vlm' / 'qwen_vl.yaml'
    results = run(str(config), ['sweep={}', 'data.train_size=16', 'data.val_size=8', 'train.epochs=1',
                                'train.batch_size=8', 'model.layers=1', f'model.family={family}',
                                f'model.scheme={scheme}', f'output_dir={tmp_path}', 'log.progress=off',
                                'log.tensorboard=off'])
    assert len(results) == 1 and results[0].steps == 2
    assert results[0].best['metric'] == 'accuracy' and 0 <= results[0].best['value'] <= 100
    assert results[0].label == f'{family} / {scheme}'  # the run's model carried the patched scheme


def test_bad_scheme_in_the_config_is_named():
    from train.cli import run
    from train.config import ConfigError
    config = Path(__file__).resolve().parent.parent / 'configs' / 'vlm' / 'qwen_vl.yaml'
    with pytest.raises(ConfigError, match='model.scheme: must be null or one of'):
        run(str(config), ['sweep={}', 'model.scheme=rope3d', 'output_dir=/nonexistent'])
