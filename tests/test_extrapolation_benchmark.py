"""The resolution-extrapolation benchmark (`train.benchmark`): the reduced config runs end to end, its
statistics are those of the per-seed numbers each run wrote, and the protocol's knobs do what they say."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

import vispe
from train.benchmark import (
    DOCS_BEGIN, DOCS_END, PUBLISHED_ORDERINGS, BenchmarkTrainer, ProtocolConfig, _MixedResolution, _ranks,
    _same_function, docs_block, effective_spec, load_benchmark, protocol_sizes, run_benchmark, select_encodings,
)
from train.config import ConfigError
from train.distributed import DistEnv
from train.extrapolate import evaluate_checkpoints

ROOT = Path(__file__).resolve().parents[1]
CI = str(ROOT / 'configs' / 'benchmark' / 'extrapolation_ci.yaml')
FULL = str(ROOT / 'configs' / 'benchmark' / 'extrapolation.yaml')


def _run_records(root: Path):
    """What each run wrote into its folder: ``result.json``, keyed by (task, encoding, seed)."""
    out = {}
    for path in root.rglob('result.json'):
        r = json.loads(path.read_text())
        out[(r['task'], r['encoding'], r['seed'])] = r
    return out


def _check_outputs(results, out: Path, name: str) -> None:
    stem = out / name
    for ext in ('json', 'csv', 'md', 'png'):
        assert stem.with_suffix(f'.{ext}').is_file(), ext
    data = json.loads(stem.with_suffix('.json').read_text())
    assert data['environment']['date'] and data['environment']['hardware']
    assert {'python', 'torch', 'timm', 'vispe'} <= set(data['environment']['versions'])
    assert data['config']['benchmark']['seeds'] == data['seeds']
    assert set(data['config']['tasks']) == set(data['tasks'])
    sizes = data['sizes']
    assert sizes == [round(s * data['train_size']) for s in data['config']['benchmark']['protocol']['test_scales']]

    # every statistic comes from the per-seed numbers the runs wrote into their own folders
    runs = _run_records(stem)
    labels = data['encodings'] + [v['encoding'] for v in data['variants']]
    assert len(runs) == len(labels) * len(data['tasks']) * len(data['seeds'])
    summary = {(r['task'], r['encoding'], r['size']): r for r in data['summary']}
    for task in data['tasks']:
        for size in sizes:
            means = {}
            for label in labels:
                values = [runs[(task, label, s)]['top1'][str(size)] for s in data['seeds']]
                row = summary[(task, label, size)]
                assert row['values'] == values
                assert row['mean'] == pytest.approx(np.mean(values), abs=1e-9)
                if len(values) > 1:
                    assert row['std'] == pytest.approx(np.std(values, ddof=1), abs=1e-9)
                else:
                    assert row['std'] is None
                if label in data['encodings']:
                    means[label] = row['mean']
            for label, mean in means.items():  # rank 1 = best mean, ties share the better rank
                assert summary[(task, label, size)]['rank'] == 1 + sum(m > mean for m in means.values())
        none_cpu = np.mean([runs[(task, 'none', s)]['train_cpu_s'] for s in data['seeds']])
        for c in (c for c in data['cost'] if c['task'] == task):
            cpu = np.mean([runs[(task, c['encoding'], s)]['train_cpu_s'] for s in data['seeds']])
            assert c['ratio_to_none'] == pytest.approx(cpu / none_cpu)

    with open(stem.with_suffix('.csv'), newline='') as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(data['summary'])
    for row in rows:
        r = summary[(row['task'], row['encoding'], int(row['size']))]
        values = [float(row[f'seed{s}']) for s in data['seeds']]
        assert values == pytest.approx(r['values']) and float(row['mean']) == pytest.approx(np.mean(values))

    md = stem.with_suffix('.md').read_text()
    for task in data['tasks']:
        assert f'Task `{task}`' in md
    for label in labels:
        assert f'`{label}`' in md


def test_reduced_benchmark_statistics_are_those_of_the_per_seed_runs(tmp_path):
    """The reduced config on the shapes task with two seeds: outputs, mean / std / rank against numpy on
    the numbers every run wrote, a weight-sharing variant equal to its base at the training size."""
    out = tmp_path / 'bench'
    # three sizes (below, at and above the training size) keep the default run short
    quick = ['benchmark.seeds=[0, 1]', 'benchmark.tasks={shapes: _shapes_ci.yaml}',
             'benchmark.protocol.test_scales=[0.75, 1.0, 2.0]']
    results = run_benchmark(CI, [f'benchmark.output_dir={out}', *quick])
    _check_outputs(results, out, 'extrapolation_ci')
    runs = _run_records(out / 'extrapolation_ci')
    train = str(results['train_size'])
    for seed in (0, 1):  # NTK scaling acts only beyond the training grid: the same function there
        variant = runs[('shapes', 'rope_axial:scaling=ntk', seed)]
        assert variant['identical_at_train_size'] is True
        assert variant['top1'][train] == runs[('shapes', 'rope_axial', seed)]['top1'][train]
    # a run's numbers are the resolution sweep of its own checkpoint
    best = out / 'extrapolation_ci' / 'shapes' / 'rope_axial' / 'seed1' / 'best.pt'
    again = evaluate_checkpoints([best], [results['sizes'][-1]], progress_mode='off')[0]
    assert again['top1'] == runs[('shapes', 'rope_axial', 1)]['top1'][str(results['sizes'][-1])]
    # a second start refuses to overwrite, and resumes when asked (nothing is trained again)
    with pytest.raises(ConfigError, match='benchmark.resume'):
        run_benchmark(CI, [f'benchmark.output_dir={out}', *quick])
    resumed = run_benchmark(CI, [f'benchmark.output_dir={out}', *quick, 'benchmark.resume=true'])
    assert resumed['summary'] == results['summary']


@pytest.mark.slow
def test_reduced_benchmark_as_shipped_runs_both_tasks(tmp_path):
    """The CI config as shipped (both tasks, one seed), through the training command line."""
    from train.cli import main
    out = tmp_path / 'bench'
    assert main([CI, f'benchmark.output_dir={out}']) == 0
    data = json.loads((out / 'extrapolation_ci.json').read_text())
    assert data['tasks'] == ['shapes', 'digits']
    _check_outputs(data, out, 'extrapolation_ci')


def test_full_config_covers_every_image_encoding_and_leaves_out_the_others_with_the_reason():
    cfg, tasks = load_benchmark(FULL)
    specs, excluded = select_encodings(cfg)
    names = [vispe.parse_pe_spec(s)[0][0] for s in specs]
    assert 'none' in names and len(cfg.seeds) >= 3 and set(tasks) == {'shapes', 'digits'}
    for name in vispe.list_pes():
        needs = getattr(vispe.pe_info(name)['cls'], 'requires', ())
        assert (name in excluded) == bool(needs), name
        assert (name in names) != (name in excluded), name
    for name, reason in excluded.items():  # the reason names what the image ViT does not supply
        assert all(field in reason for field in vispe.pe_info(name)['cls'].requires), (name, reason)
    p = cfg.protocol
    assert [s / p.train_size for s in protocol_sizes(p)] == [0.75, 1.0, 1.5, 2.0, 3.0, 4.0]
    for claim in PUBLISHED_ORDERINGS:  # every published pair is measured by the full benchmark
        assert claim.better in names and claim.worse in names and claim.scale in cfg.protocol.test_scales
    for v in cfg.variants:  # every weight-sharing variant shares its base's parameters
        base = vispe.create_pe(effective_spec(v.weights_of, p), dim=64, num_heads=4, depth=3, grid_size=(4, 4),
                               num_prefix_tokens=1)
        var = vispe.create_pe(effective_spec(v.pe, p), dim=64, num_heads=4, depth=3, grid_size=(4, 4),
                              num_prefix_tokens=1)
        assert {k: t.shape for k, t in base.state_dict().items()} == {k: t.shape for k, t in var.state_dict().items()}


def test_protocol_sizes_must_be_multiples_of_the_patch():
    assert protocol_sizes(ProtocolConfig(train_size=32, patch_size=8)) == [24, 32, 48, 64, 96, 128]
    with pytest.raises(ConfigError, match='test_scales: 1.25 x 32 px = 40 px is not a positive multiple of the '
                                          'patch size 16'):
        protocol_sizes(ProtocolConfig(train_size=32, patch_size=16, test_scales=[1.0, 1.25]))
    with pytest.raises(ConfigError, match='mixed_resolution: 36 px'):
        protocol_sizes(ProtocolConfig(mixed_resolution=[32, 36]))


def test_learned_resample_reaches_the_learned_tables_unless_the_spec_sets_it():
    p = ProtocolConfig(learned_resample='bilinear')
    assert vispe.parse_pe_spec(effective_spec('learned:init_std=0.2', p), typed=True) == \
        vispe.parse_pe_spec('learned:init_std=0.2,interpolation=bilinear', typed=True)
    assert 'nearest' in effective_spec('learned:interpolation=nearest', p)
    assert 'bilinear' in effective_spec('swin_rpb', p)
    assert effective_spec('rope_mixed', p) == 'rope_mixed'


def test_ranks_share_the_better_rank_on_ties():
    assert _ranks({'a': 90.0, 'b': 95.0, 'c': 90.0, 'd': 10.0}) == {'b': 1, 'a': 2, 'c': 2, 'd': 4}


def test_mixed_resolution_draws_a_side_per_step_from_the_seed_and_resizes_the_batch():
    seen = []

    class Task:
        def train_step(self, model, batch, step):
            seen.append(tuple(batch[0].shape[-2:]))
            return batch[0].sum(), {}

    task = _MixedResolution(Task(), [24, 32, 48], seed=3)
    sides = [task.side(s) for s in range(200)]
    assert sides == [_MixedResolution(Task(), [24, 32, 48], seed=3).side(s) for s in range(200)]  # resumable
    assert set(sides) == {24, 32, 48}
    assert sides != [_MixedResolution(Task(), [24, 32, 48], seed=4).side(s) for s in range(200)]
    x = torch.rand(2, 3, 32, 32)
    for step in range(5):
        task.train_step(None, (x, torch.zeros(2)), step)
    assert seen == [(s, s) for s in sides[:5]]


def test_frozen_encoding_parameters_stay_at_their_initialisation(tmp_path):
    """``pe_trainable: false``: RoPE-Mixed trains with fixed frequencies, everything else learns."""
    cfg, tasks = load_benchmark(CI)
    from train.benchmark import run_config
    p = ProtocolConfig(pe_trainable=False)
    run_cfg = run_config(tasks['shapes'], p, 'rope_mixed', 0, tmp_path / 'run', False)
    trainer = BenchmarkTrainer(run_cfg, DistEnv(), tmp_path / 'run', p)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.fit()
    after = trainer.model.state_dict()
    assert torch.equal(before['pe.freqs'], after['pe.freqs'])
    assert not torch.equal(before['head.weight'], after['head.weight'])


def test_a_variant_must_hold_the_parameters_of_the_weights_it_uses(tmp_path):
    def ckpt(pe):
        model = timm.create_model('vit_tiny', pe=pe, img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4,
                                  num_classes=4)
        return dict(model_spec=dict(name='vit_tiny', kwargs=dict(pe=pe, img_size=32, patch_size=8, embed_dim=64,
                                                                  depth=3, num_heads=4, num_classes=4)),
                    model=model.state_dict(), config=dict(data=dict(img_size=32)))
    base = ckpt('rope_axial')
    assert _same_function(base, dict(base, model_spec=ckpt('rope_axial:scaling=yarn')['model_spec'])) is True
    lowered = ckpt('lookhere')
    assert _same_function(lowered, dict(lowered, model_spec=ckpt('lookhere:global_slope=0.5')['model_spec'])) is False
    with pytest.raises(ConfigError, match='does not hold the parameters'):
        _same_function(base, dict(base, model_spec=ckpt('rope_mixed')['model_spec']))


def test_benchmark_config_refuses_training_keys_and_unknown_benchmark_keys(tmp_path):
    bad = tmp_path / 'bad.yaml'
    bad.write_text('benchmark: {tasks: {shapes: x.yaml}}\ntrain: {epochs: 3}\n')
    with pytest.raises(ConfigError, match='holds only a benchmark: section'):
        load_benchmark(str(bad))
    bad.write_text('benchmark: {seedz: [0]}\n')
    with pytest.raises(ConfigError, match="unknown config key 'benchmark.seedz'"):
        load_benchmark(str(bad))


def test_the_docs_page_results_are_made_from_the_shipped_results_file():
    """docs/extrapolation-benchmark.md shows exactly what `docs_block` makes of the shipped JSON."""
    page = (ROOT / 'docs' / 'extrapolation-benchmark.md').read_text()
    results = json.loads((ROOT / 'docs' / 'figures' / 'extrapolation_benchmark.json').read_text())
    shown = page[page.index(DOCS_BEGIN):page.index(DOCS_END) + len(DOCS_END)]
    assert shown == docs_block(results, 'figures/extrapolation_benchmark.png'), \
        'run python -m train.benchmark --docs RESULTS_JSON'
    assert (ROOT / 'docs' / 'figures' / 'extrapolation_benchmark.png').is_file()


def test_swin_rpb_resampling_mode_bilinear_stays_within_the_table_where_bicubic_overshoots():
    """The table's resampling option: the identity on the training grid in every mode; on a larger grid,
    bilinear stays within the trained values (bicubic overshoots a step) and nearest repeats them."""
    pes = {m: vispe.create_pe(f'swin_rpb:per_layer=false,init_std=0,interpolation={m}', dim=16, num_heads=1,
                              depth=1, grid_size=(4, 4)) for m in ('bicubic', 'bilinear', 'nearest')}
    step = torch.zeros(1, 7 * 7, 1)
    step.view(7, 7)[:, 4:] = 1.0  # a step along the column offset
    for pe in pes.values():
        pe.relative_position_bias_table.data.copy_(step)
    train = {m: pe.prepare(vispe.grid(4, 4)).state for m, pe in pes.items()}
    assert torch.equal(train['bilinear'], train['bicubic']) and torch.equal(train['nearest'], train['bicubic'])
    big = {m: pe.prepare(vispe.grid(9, 9, train_grid=(4, 4))).state for m, pe in pes.items()}
    assert big['bicubic'].max() > 1.0 + 1e-3 and big['bicubic'].min() < -1e-3
    assert big['bilinear'].min() >= 0.0 and big['bilinear'].max() <= 1.0
    assert set(big['nearest'].unique().tolist()) == {0.0, 1.0}
    pes['bilinear'].set_grid_size((9, 9))  # the parameter itself, resized the same way
    assert pes['bilinear'].relative_position_bias_table.min() >= 0.0


def test_position_interpolation_is_the_normalized_grid_above_the_training_size():
    """The sweep's two ways of interpolating RoPE-Axial agree on a larger grid (and so the docs can say
    that grid_mode=normalized is position interpolation for the angle-linear rotations)."""
    kw = dict(dim=64, num_heads=4, depth=1, grid_size=(4, 4), num_prefix_tokens=1)
    linear = vispe.create_pe('rope_axial:scaling=linear', **kw)
    normalized = vispe.create_pe('rope_axial:grid_mode=normalized', **kw)
    q, k = torch.randn(2, 4, 1 + 12 * 8, 16), torch.randn(2, 4, 1 + 12 * 8, 16)
    pos = vispe.grid(12, 8, num_prefix=1, train_grid=(4, 4))
    for a, b in zip(linear.prepare(pos).qk(q, k, 0), normalized.prepare(pos).qk(q, k, 0)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
