"""The benchmark helpers measure what they claim (the scripts' figures rest on them)."""
import pytest
import torch

from benchmarks._timing import TensorMemory, peak_memory, train_step


def test_tensor_memory_counts_new_storage_once_and_frees_it():
    before = torch.zeros(1000)  # allocated outside: never counted, nor its views
    with TensorMemory() as mem:
        a = torch.empty(256, dtype=torch.float32)  # 1 KiB
        view = before[:10] * 1  # a new 40-byte tensor; the slice itself is a view of `before`
        b = a.view(16, 16)  # a view: no new storage
        assert mem.live == 1024 + 40
        del a, b
        c = torch.empty(128, dtype=torch.float64)  # 1 KiB again, after the first was freed
        assert mem.live == 40 + 1024
    assert mem.peak == 1024 + 40
    del view, c


def test_peak_memory_of_a_train_step_counts_gradients_and_activations():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    grads = sum(p.numel() * 4 for p in model.parameters())
    hidden = 32 * 256 * 4  # the activation the second layer saves for backward
    peak = peak_memory(train_step(model, x, y))
    assert grads + hidden <= peak <= grads + 4 * hidden + 32 * 10 * 4 * 4


def test_rotation_overhead_runs_and_checks_the_dense_baseline(capsys):
    from benchmarks.rotation_overhead import main
    main(['--model', 'vit_tiny', '--batch', '2', '--img', '32', '--quick', '--encodings', 'liere,comrope_ld'])
    out = capsys.readouterr().out
    ratios = out.split('BASELINE')[0].split('ratios')[1]
    assert 'string_cayley' not in ratios  # only what was asked
    assert 'none (control)' in ratios  # the run's noise floor, next to the encodings
    for spec in ('liere', 'comrope_ld'):
        row = next(line for line in out.split('BASELINE')[1].splitlines() if line.startswith(spec))
        assert float(row.split()[-1]) < 1e-4  # the dense per-sample baseline computes the same function


def test_cuda_check_smoke_runs_on_the_cpu(capsys):
    from benchmarks.cuda_check import main
    main(['--device', 'cpu', '--model', 'vit_tiny', '--batch', '1', '--rounds', '1', '--pes', 'rope_axial,alibi2d',
          '--modes', 'eager'])
    out = capsys.readouterr().out
    assert '| `rope_axial` | yes | yes | yes | 0 |' in out  # no fused kernel on the CPU
    assert '| `alibi2d` | no |' in out  # a bias encoding claims no flash
    assert 'eval x (e1) | train x (e1) | mem x (e1) |' in out and 'skipped' not in out


def test_cuda_check_keeps_to_its_budget_by_skipping_whole_timing_groups(capsys):
    from benchmarks.cuda_check import main
    main(['--device', 'cpu', '--model', 'vit_tiny', '--batch', '1,2', '--rounds', '1', '--pes', 'rope_axial',
          '--budget-min', '0'])
    out = capsys.readouterr().out
    assert 'skipped to keep the 0 min budget: eager, batch 1; compiled, batch 1; eager, batch 2; compiled, batch 2' in out
    assert '| `rope_axial` | yes | yes | yes | 0 |' in out and 'eval x' not in out


def test_cuda_check_compiles_model_by_model_within_its_budget(capsys, monkeypatch):
    """A compiled group times the models whose compilation fits and lists the others, none first: here
    each 'compilation' (a stand-in's first call) takes 60 s of a clock that stands still otherwise."""
    from types import SimpleNamespace

    from benchmarks import cuda_check
    now = [0.0]

    class FirstCallCosts(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.compiled = model, False

        def forward(self, x):
            if not self.compiled:
                now[0] += 60.0
                self.compiled = True
            return self.model(x)

    monkeypatch.setattr(cuda_check, 'time', SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(cuda_check, 'compile_models', lambda models: {n: FirstCallCosts(m) for n, m in models.items()})
    cuda_check.main(['--device', 'cpu', '--model', 'vit_tiny', '--batch', '1', '--rounds', '1',
                     '--pes', 'rope_axial,sincos', '--modes', 'compiled', '--budget-min', '2.5'])
    out = capsys.readouterr().out
    # none (0 + 60 s) and rope_axial (60 + 60 <= 150 s) fit, sincos (120 + 60 > 150 s) does not
    assert 'skipped to keep the 2.5 min budget: compiled, batch 1 of sincos' in out
    assert 'compile seconds (first eval forward + train step, all batches): none 60, rope_axial 60' in out
    rows = {line.split(' | ')[0]: line for line in out.splitlines() if line.startswith('| `')}
    assert rows['| `rope_axial`'].endswith('| 1.00 |') and rows['| `sincos`'].endswith('| - | - | - |')


@pytest.mark.slow  # compiles FlexAttention (~20 s on the CPU)
def test_lookhere_flex_prints_both_kernels_against_no_encoding(capsys):
    from benchmarks.lookhere_flex import SPECS, main
    main(['--model', 'vit_tiny', '--img', '32', '--batch', '1', '--rounds', '1'])
    out = capsys.readouterr().out
    assert "(N = 5)" in out and all(f'\n{spec} ' in out for spec in SPECS)


def test_profile_step_reports_each_encoding_against_no_encoding(capsys):
    from benchmarks.profile_step import main
    main(['--model', 'vit_tiny', '--batch', '1', '--img', '32', '--pes', 'liere', '--rows', '3'])
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith('== ')]
    assert [h.split(':')[0] for h in heads] == ['== none', '== liere']
    assert all('host syncs' in h for h in heads)


def test_ab_overhead_measures_ratios_of_the_given_checkout():
    from benchmarks.ab_overhead import ROOT, measure
    ratios = measure(ROOT, ['rope_axial'], 'vit_tiny', batch=2, img=32, rounds=1, train=True, evaluate=True)
    assert set(ratios) == {'eval', 'train'} and set(ratios['train']) == {'rope_axial'}
    assert all(0 < r < 100 for row in ratios.values() for r in row.values())


@pytest.mark.parametrize('compiled', [False, pytest.param(True, marks=pytest.mark.slow)])
def test_pe_overhead_prints_ratios_against_no_encoding(capsys, compiled):
    from benchmarks.pe_overhead import main
    main(['--models', 'vit_tiny', '--pes', 'rope_axial', '--batch', '1', '--size', '32', '--rounds', '1',
          '--no-memory'] + (['--compile'] if compiled else []))
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[3:] if line.strip()}
    assert float(rows['none'][0]) == 1.0 and float(rows['none'][1]) == 1.0  # the reference row
    assert all(float(v) > 0 for v in rows['rope_axial'][:2])



def test_detr_padding_reports_per_sample_and_patched_ratios(capsys):
    pytest.importorskip('transformers')
    from benchmarks.detr_padding import main
    results = main(['--smoke', '--pes', 'detr_sine', 'rope_mixed', '--hf-pes', 'detr_sine'])
    out = capsys.readouterr().out
    assert set(results['encoder per-sample / shared']) == {'detr_sine', 'rope_mixed'}
    assert set(results['transformers patched / unpatched']) == {'unpatched', 'patched detr_sine'}
    assert results['transformers patched / unpatched']['unpatched'] == 1.0
    assert all(r > 0 for row in results.values() for r in row.values())
    assert '| `rope_mixed` |' in out and '| patched detr_sine |' in out

def _script(*args, env=None):
    """Run a benchmark script in a child process (Triton's interpreter is chosen when triton is
    imported, so it cannot be switched on in this one); its stdout."""
    import os
    import subprocess
    import sys
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_fused_numerics_table_compares_fused_and_reference_against_float64(tmp_path):
    pytest.importorskip('triton')
    _script('benchmarks/fused_numerics.py', '--device', 'cpu', '--cases', 'matrix b4 hd64', '--dtypes', 'fp32',
            '--out', str(tmp_path / 'numerics.md'))
    rows = [line for line in (tmp_path / 'numerics.md').read_text().splitlines() if line.startswith('| matrix')]
    assert len(rows) == 1 and rows[0].endswith('| 2 | yes |')  # one launch forward, one backward
    fused, reference = (float(v) for v in rows[0].split(' | ')[2].split(' / '))
    assert 0 < fused < 1e-5 and 0 < reference < 1e-5  # both near the float64 truth, neither equal to it


def test_rotation_bandwidth_times_every_kind_and_path(tmp_path):
    pytest.importorskip('triton')
    _script('benchmarks/rotation_bandwidth.py', '--device', 'cpu', '--batch', '1', '--heads', '2', '--grid', '3',
            '--head-dim', '16', '--no-compile', '--out', str(tmp_path / 'bw.md'))
    rows = [line.split(' | ') for line in (tmp_path / 'bw.md').read_text().splitlines() if line.startswith('| ') and
            '(' in line.split(' | ')[0]]
    assert [(r[0][2:], r[1]) for r in rows[::2]] == [(f'{k} (qkv views)', 'fwd') for k in
                                                     ('table', 'pair', 'half_table', 'block', 'matrix')] + [
        ('half_table (tokens-first)', 'fwd')]
    assert all(float(r[3].split()[0]) > 0 and float(r[4].split()[0]) > 0 for r in rows)  # fused and reference ran


@pytest.mark.slow
def test_gpu_check_runs_its_stages_on_the_cpu(tmp_path):
    import subprocess
    import sys
    subprocess.run(['bash', 'benchmarks/gpu_check.sh', str(tmp_path), str(tmp_path / 'no_wheels'), '600'], check=True,
                   env={**__import__('os').environ, 'GPU_CHECK_DEVICE': 'cpu', 'PYTHON': sys.executable}, timeout=900)
    log = (tmp_path / 'gpu_check.log').read_text()
    for stage in ('fused kernels on CUDA (pytest)', 'numerics table', 'rotation bandwidth',
                  'transformers vision towers: own encoding vs unpatched',
                  'transformers DINOv3 rope: own encoding vs unpatched',
                  'diffusion transformers: own encoding vs unpatched', 'cuda_check'):
        assert f'== {stage}: exit 0' in log
    assert {p.name for p in tmp_path.iterdir()} >= {'numerics.md', 'bandwidth.md', 'cuda_check.md', 'pytest.log',
                                                     'hosts.log'}
