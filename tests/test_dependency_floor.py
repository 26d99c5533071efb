"""The declared lowest timm and transformers hold: they are installed (from the package index) into a
scratch folder that shadows this environment's, and the zoo, contract, NaFlex and multimodal tests
run against them in a subprocess. The folder is cached in the temporary directory per pair of
versions, so reruns do not install again. Skips, saying so, only when the package index cannot be
reached."""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip('tomli')

ROOT = Path(__file__).resolve().parents[1]
UNREACHABLE = ('NewConnectionError', 'Max retries exceeded', 'Temporary failure in name resolution',
               'Network is unreachable', 'Could not fetch URL', 'ConnectTimeout', 'ReadTimeoutError')
# what the lowest versions must pass: timm's seam and contract, the zoo's parity with timm's own
# models, NaFlex against timm's patchify / collator, the multimodal ids against transformers' own
SMOKE = ['tests/test_timm_seam.py', 'tests/test_contract.py', 'tests/test_naflex.py', 'tests/test_multimodal.py',
         'tests/test_zoo.py::test_own_encoding_gives_timm_logits',
         'tests/test_zoo.py::test_rope_timm_rotates_as_timms_rope_module',
         'tests/test_zoo.py::test_convert_keeps_every_weight_name',
         'tests/test_zoo.py::test_every_encoding_builds_on_one_model_per_family',
         # torch's export and compile paths do not depend on the timm version and take most of the time
         '--deselect', 'tests/test_contract.py::test_export_matches_eager_and_leaves_plain_forwards_alone',
         '--deselect', 'tests/test_naflex.py::test_a_naflex_batch_compiles_with_the_positions_read_outside_the_graph']


def _floor(requirements, name: str) -> str:
    for req in requirements:
        m = re.fullmatch(rf'{name}\s*>=\s*([0-9.]+)(,.*)?', req.strip())
        if m:
            return m.group(1)
    raise AssertionError(f'pyproject declares no lowest {name} (">=") in {requirements}')


def floors() -> dict:
    """The lowest timm (core dependency), transformers and diffusers (their extras) that pyproject declares."""
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    extras = project['optional-dependencies']
    return dict(timm=_floor(project['dependencies'], 'timm'),
                transformers=_floor(extras['transformers'], 'transformers'),
                diffusers=_floor(extras['diffusers'], 'diffusers'))


def _ceiling(requirements, name: str) -> str:
    for req in requirements:
        m = re.fullmatch(rf'{name}\s*>=\s*[0-9.]+\s*,\s*<\s*([0-9.]+)', req.strip())
        if m:
            return m.group(1)
    raise AssertionError(f'pyproject declares no upper bound for {name} in {requirements}')


def _pip(*args: str) -> None:
    done = subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '--disable-pip-version-check', *args],
                          capture_output=True, text=True, timeout=900)
    if done.returncode:
        out = done.stdout + done.stderr
        if any(marker in out for marker in UNREACHABLE):
            pytest.skip(f'the package index cannot be reached to install {args[-1]}: {out.strip()[-300:]}')
        raise AssertionError(f'pip install {" ".join(args)} failed:\n{out[-3000:]}')


@pytest.fixture(scope='module')
def lowest(tmp_path_factory):
    """A folder holding the declared lowest timm (alone: it runs with this environment's torch) and
    the lowest transformers with the dependencies it pins (its tokenizers / hub ranges)."""
    low = floors()
    target = Path(tempfile.gettempdir()) / 'vispe-floor' / f'timm-{low["timm"]}-transformers-{low["transformers"]}'
    done = target / '.complete'
    if not done.exists():
        target.mkdir(parents=True, exist_ok=True)
        _pip('--target', str(target), '--upgrade', f'transformers=={low["transformers"]}')
        _pip('--target', str(target), '--upgrade', '--no-deps', f'timm=={low["timm"]}')
        done.write_text('installed\n')
    return target, low


def _run(target: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), str(ROOT)]))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_declared_ranges_are_what_vispe_checks():
    """pyproject's ranges and the one table every version gate reads (vispe.extras.SUPPORTED) agree."""
    from vispe.extras import SUPPORTED
    project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
    extras = project['optional-dependencies']
    declared = dict(timm=project['dependencies'], transformers=extras['transformers'], diffusers=extras['diffusers'],
                    open_clip=[r.replace('open_clip_torch', 'open_clip') for r in extras['open_clip']])
    for name, requirements in declared.items():
        floor = _floor(requirements, name)
        assert (floor, _ceiling(requirements, name)) == SUPPORTED[name], name


def test_zoo_contract_naflex_and_multimodal_pass_with_the_lowest_timm_and_transformers(lowest):
    target, low = lowest
    versions = _run(target, '-c', 'import timm, transformers, vispe; print(timm.__version__, transformers.__version__, '
                                  'vispe.__file__)')
    assert versions.returncode == 0, versions.stderr[-3000:]
    timm_version, transformers_version, where = versions.stdout.split()
    assert (Version(timm_version), Version(transformers_version)) == (Version(low['timm']), Version(low['transformers']))
    assert where.startswith(str(ROOT))  # this checkout's vispe, not an installed copy
    done = _run(target, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', '-x', *SMOKE)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ''
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert 'passed' in summary and 'skipped' not in summary, summary  # transformers' checks ran, not skipped
