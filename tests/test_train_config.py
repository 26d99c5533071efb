"""Configs of the training script: YAML + base files + dotted overrides, validated with the key named."""
from pathlib import Path

import pytest

from train.config import (
    ConfigError, apply_overrides, build_config, expand_sweep, load_config, load_yaml, parse_overrides, to_dict,
)

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / 'configs'


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize('override, message', [
    ('train.epoch=3', "unknown config key 'train.epoch'. Did you mean 'train.epochs'?"),
    ('optimizer.lr=1e-3', "unknown config key 'optimizer'. Did you mean 'optim'?"),
    ('data.synthetic.train_sise=10', "unknown config key 'data.synthetic.train_sise'"),
    ('train.batch_size=big', "train.batch_size: expected an integer, got 'big'"),
    ('train.batch_size=2.5', 'train.batch_size: expected an integer'),
    ('train.batch_size=0', 'train.batch_size: must be >= 1, got 0'),
    ('optim.lr=-1', 'optim.lr: must be >= 0'),
    ('sched.name=cosin', "sched.name: 'cosin' is not allowed; allowed values: 'cosine'"),
    ('train.amp=true', "train.amp: True is not allowed"),
    ('data.aug.scale=[0.5]', 'data.aug.scale: expected 2 values'),
    ('model.pe=ropee', "model.pe: unknown encoding 'ropee'"),
    ('model.kwargs.img_size=64', 'model.kwargs.img_size: set data.img_size instead'),
    ('data.kind=folder', 'data.root: required when data.kind is folder'),
    ('task=clasification', "task: unknown task 'clasification'. Did you mean 'classification'?"),
    ('train.epochs.max=3', "cannot set 'train.epochs.max': train.epochs is 2, not a section"),
])
def test_bad_keys_and_values_are_rejected_naming_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS / 'quickstart.yaml', [override])
    assert message in str(e.value)


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match='must look like section.key=value'):
        parse_overrides(['train.epochs'])


def test_overrides_are_parsed_as_yaml_and_coerced_to_the_field_type():
    cfg, _ = load_config(CONFIGS / 'quickstart.yaml',
                         ['optim.lr=1e-3', 'train.epochs=7', 'log.progress=off', 'model.pe={name: rope_axial, theta: 10}',
                          'extrapolate.sizes=[32, 64]', 'optim.betas=[0.9, 0.95]'])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)  # YAML 1.1 reads 1e-3 as a string
    assert cfg.train.epochs == 7
    assert cfg.log.progress == 'off'  # YAML reads a bare off as False
    assert cfg.model.pe == {'name': 'rope_axial', 'theta': 10}
    assert cfg.extrapolate.sizes == [32, 64]
    assert cfg.optim.betas == (0.9, 0.95)


def test_base_files_merge_key_by_key_and_the_file_wins(tmp_path):
    _write(tmp_path / 'recipe.yaml', 'train: {epochs: 5, batch_size: 8}\noptim: {lr: 0.1}\n')
    (tmp_path / 'sub').mkdir()
    cfg_file = _write(tmp_path / 'sub' / 'exp.yaml', 'base: ../recipe.yaml\ntrain: {epochs: 2}\n')
    raw = load_yaml(cfg_file)
    assert raw['train'] == {'epochs': 2, 'batch_size': 8}
    assert raw['optim'] == {'lr': 0.1}


def test_a_base_cycle_is_reported(tmp_path):
    _write(tmp_path / 'a.yaml', 'base: b.yaml\n')
    _write(tmp_path / 'b.yaml', 'base: a.yaml\n')
    with pytest.raises(ConfigError, match='includes itself'):
        load_yaml(tmp_path / 'a.yaml')


def test_sweep_expands_to_one_validated_config_per_value():
    cfg, raw = load_config(CONFIGS / 'quickstart.yaml')
    runs = expand_sweep(raw)
    assert [s for s, _ in runs] == ['none', 'learned_init_std_0.2', 'rope_axial', 'rope_mixed']
    assert [c.model.pe for _, c in runs] == ['none', 'learned:init_std=0.2', 'rope_axial', 'rope_mixed']
    assert all(c.train.epochs == cfg.train.epochs for _, c in runs)


def test_a_bad_sweep_value_is_rejected_naming_the_key():
    with pytest.raises(ConfigError, match="model.pe: unknown encoding 'nope'"):
        load_config(CONFIGS / 'quickstart.yaml', ['sweep={model.pe: [none, nope]}'])
    with pytest.raises(ConfigError, match="unknown config key 'model.peee'"):
        load_config(CONFIGS / 'quickstart.yaml', ['sweep={model.peee: [none]}'])
    with pytest.raises(ConfigError, match="sweep.model: expected a non-empty list of values for the dotted key"):
        load_config(CONFIGS / 'quickstart.yaml', ['sweep.model.pe=[none, learned]'])


def test_config_round_trips_through_plain_dicts():
    cfg, _ = load_config(CONFIGS / 'quickstart.yaml')
    again = build_config(to_dict(cfg))
    assert to_dict(again) == to_dict(cfg)


def _my_configs():
    files = [CONFIGS / 'quickstart.yaml', CONFIGS / 'digits.yaml', CONFIGS / 'naflex_quickstart.yaml',
             CONFIGS / 'extrapolation_lookhere.yaml'] + sorted(
        (CONFIGS / 'imagenet').glob('[!_]*.yaml'))
    return [pytest.param(f, id=str(f.relative_to(CONFIGS))) for f in files]


@pytest.mark.parametrize('path', _my_configs())
def test_shipped_configs_validate(path):
    import vispe
    try:
        cfg, raw = load_config(path)
    except ConfigError as e:  # encodings of other families may not be installed in a partial checkout
        if 'unknown encoding' in str(e):
            pytest.skip(f'{path.name}: {e}')
        raise
    assert cfg.name
    for _, run_cfg in expand_sweep(raw):
        for name, _ in vispe.parse_pe_spec(run_cfg.model.pe):
            assert name in vispe.list_pes()


def test_imagenet_configs_follow_their_papers_recipes():
    deit, _ = load_config(CONFIGS / 'imagenet' / 'vit_base_learned.yaml')
    assert (deit.optim.lr_base, deit.optim.weight_decay, deit.sched.min_lr, deit.train.epochs) == \
        (5e-6, 1e-8, 5e-6, 30)  # DeiT README fine-tuning command
    assert deit.data.aug.repeated_aug == 3 and deit.data.aug.re_prob == 0.25 and deit.loss.label_smoothing == 0.1
    assert deit.model.pe == 'learned' and deit.model.pretrained and deit.model.name == 'vit_base'
    assert load_yaml(CONFIGS / 'imagenet' / 'vit_base_irpe.yaml')['model']['pe'] == 'irpe+learned'  # iRPE DeiT tables
    rope, _ = load_config(CONFIGS / 'imagenet' / 'vit_base_rope_mixed.yaml')
    assert (rope.optim.lr, rope.optim.weight_decay, rope.train.epochs, rope.model.drop_path_rate) == \
        (1e-5, 0.1, 20, 0.2)  # naver-ai/rope-vit deit/README ViT-B fine-tuning
    assert rope.data.aug.repeated_aug == 0 and rope.data.crop_pct == 1.0


def test_data_file_for_extrapolation_is_a_data_section():
    raw = load_yaml(CONFIGS / 'data' / 'imagenet_val.yaml')
    cfg, base = load_config(CONFIGS / 'quickstart.yaml')
    merged = apply_overrides(to_dict(cfg), [('data', {**to_dict(cfg.data), **raw['data']})])
    merged['sweep'] = {}
    assert build_config(merged).data.kind == 'folder'


def _train_imports():
    """``module -> train modules it imports`` for every module of train/, read with ``ast``."""
    import ast
    root = REPO / 'train'
    graph = {}
    for path in sorted(root.rglob('*.py')):
        parts = path.relative_to(REPO).with_suffix('').parts
        module = '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)
        package = parts[:-1]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else ()
                target = '.'.join(base + tuple(filter(None, (node.module or '').split('.'))))
                names = [f'{target}.{a.name}' for a in node.names]
                deps |= {n for n in names + [target] if (REPO / n.replace('.', '/')).with_suffix('.py').is_file()
                         or (REPO / n.replace('.', '/') / '__init__.py').is_file()}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split('.')[0] == 'train'}
        graph[module] = sorted(d for d in deps if d.startswith('train') and d != module)
    return graph


def test_train_imports_have_no_cycle():
    graph = _train_imports()
    assert 'train.config' in graph['train.cli'] and 'train.schema' in graph['train.tasks.base']
    state = {}

    def visit(module, path):
        if state.get(module) == 'open':
            raise AssertionError(f'import cycle: {" -> ".join(path + [module])}')
        if state.get(module) == 'done':
            return
        state[module] = 'open'
        for dep in graph.get(module, ()):
            visit(dep, path + [module])
        state[module] = 'done'

    for module in graph:
        visit(module, [])


def test_model_sections_are_the_model_constructors_arguments():
    import dataclasses
    import inspect

    from train.tasks import get_task
    from vispe_models.detr import DETR
    from vispe_models.nerf import NeRF
    from vispe_models.vlm import VLM
    owned = {'detection': (DETR, set()), 'nerf': (NeRF, {'white_background'}),
             'vlm': (VLM, {'vocab_size', 'img_size', 'tokens'})}
    for task, (model, elsewhere) in owned.items():
        section = get_task(task).ModelConfig
        args = [p for p in list(inspect.signature(model.__init__).parameters.values())[1:]]
        assert [f.name for f in dataclasses.fields(section)] == [p.name for p in args if p.name not in elsewhere]
        defaults = section()
        for p in args:
            if p.name not in elsewhere and p.name != 'num_classes':  # null: from the data
                assert getattr(defaults, p.name) == p.default, (task, p.name)


def test_a_new_constructor_argument_is_a_new_key_with_its_type_and_default():
    from typing import Literal, Optional, Tuple

    from train.schema import ConfigError, constructor_kwargs, constructor_section, option, validate_section

    class Model:
        def __init__(self, width: int = 8, mode: Literal['a', 'b'] = 'a', sizes: Tuple[int, ...] = (1, 2),
                     extra: Optional[float] = None) -> None:
            pass

    section = constructor_section('ModelConfig', Model, module=__name__, width=option(min=2))
    cfg = validate_section(section, {'mode': 'b', 'sizes': [3], 'extra': '1e-3'}, 'model')
    assert constructor_kwargs(cfg) == dict(width=8, mode='b', sizes=(3,), extra=1e-3)
    with pytest.raises(ConfigError, match="model.mode: 'c' is not allowed; allowed values: 'a', 'b'"):
        validate_section(section, {'mode': 'c'}, 'model')
    with pytest.raises(ConfigError, match='model.width: must be >= 2, got 1'):
        validate_section(section, {'width': 1}, 'model')
    with pytest.raises(ConfigError, match="unknown config key 'model.widht'. Did you mean 'model.width'?"):
        validate_section(section, {'widht': 1}, 'model')


def test_an_encoding_spec_key_is_checked_down_to_its_options():
    with pytest.raises(ConfigError, match="model.pe: option 'theta' of encoding 'rope_axial': expected float"):
        load_config(CONFIGS / 'quickstart.yaml', ['model.pe=rope_axial:theta=big', 'sweep={}'])
    with pytest.raises(ConfigError, match="model.pos_encoding: unknown option 'levles' for encoding 'nerf_freq'"):
        load_config(None, ['task=nerf', 'model.pos_encoding=nerf_freq:levles=3'])
