"""The core install is enough for `vispe`; every optional import fails naming the extra to install.

A subprocess hides the optional packages (a None entry in ``sys.modules`` makes their import raise
ModuleNotFoundError, as an environment without them does) and imports every vispe module, then calls what needs each extra."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ('scipy', 'pycocotools', 'matplotlib', 'sklearn', 'open_clip', 'transformers', 'tensorboard', 'lightning',
            'accelerate', 'diffusers')

SCRIPT = textwrap.dedent('''
    import importlib, pkgutil, sys
    for hidden in sys.argv[1:]:  # an import of these now fails as if they were not installed
        sys.modules[hidden] = None
    import vispe
    for m in pkgutil.walk_packages(vispe.__path__, 'vispe.'):
        if not m.name.endswith('.__main__'):
            importlib.import_module(m.name)
    import vispe_train  # the training script itself needs only the [train] packages

    def message(call):
        try:
            call()
        except ImportError as e:
            return str(e)
        return 'no error'

    def detection_data():
        import vispe_models.detection_data

    def matching():
        import torch
        from vispe_models.detr import HungarianMatcher
        HungarianMatcher()({'pred_logits': torch.zeros(1, 2, 3), 'pred_boxes': torch.rand(1, 2, 4)},
                           [{'labels': torch.tensor([1]), 'boxes': torch.rand(1, 4)}])

    def plot():
        from vispe_train.extrapolate import _plot
        _plot([{'metric': 'top1'}], None)

    def digits():
        from vispe_train.data.digits import write_digits
        write_digits('unused')

    def open_clip():
        from vispe.integrations.open_clip import use_pe
        use_pe(None, 'rope_mixed')

    def hf_detr():
        from vispe.integrations import patch_detr
        patch_detr(None, 'detr_sine')

    def dit():
        from vispe.integrations import patch_dit
        patch_dit(None)

    for name, call in [('detection_data', detection_data), ('matching', matching), ('plot', plot),
                       ('digits', digits), ('open_clip', open_clip), ('hf_detr', hf_detr), ('dit', dit)]:
        print(name, '|', message(call))
''')


def test_core_imports_and_each_optional_import_names_its_extra():
    done = subprocess.run([sys.executable, '-c', SCRIPT, *OPTIONAL], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get('PYTHONPATH', '')])))
    assert done.returncode == 0, done.stderr[-3000:]
    got = dict(line.split(' | ', 1) for line in done.stdout.strip().splitlines())
    assert got == {
        'detection_data': 'COCO datasets and evaluation (vispe_models.detection_data) needs pycocotools, which is '
                          'not installed: pip install "vispe[detection]" (or pip install pycocotools)',
        'matching': 'DETR\'s Hungarian matching needs scipy, which is not installed: pip install "vispe[detection]" '
                    '(or pip install scipy)',
        'plot': 'the extrapolation plot needs matplotlib, which is not installed: pip install "vispe[train]" '
                '(or pip install matplotlib)',
        'digits': 'the digits data set needs scikit-learn, which is not installed: pip install "vispe[digits]" '
                  '(or pip install scikit-learn)',
        'open_clip': 'vispe.integrations.open_clip needs open_clip_torch, which is not installed: '
                     'pip install "vispe[open_clip]" (or pip install "open_clip_torch>=3.3,<4")',
        'hf_detr': 'patch_detr needs transformers, which is not installed: pip install "vispe[transformers]" '
                   '(or pip install "transformers>=5.25,<6")',
        'dit': 'patch_dit needs diffusers, which is not installed: pip install "vispe[diffusers]" '
               '(or pip install "diffusers>=0.42,<0.43")',
    }
