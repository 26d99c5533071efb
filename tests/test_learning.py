"""Every registered image encoding learns position: tiny ViTs trained on the embedded scenes.

The embedded data (`train.data.synthetic.SpatialShapes`) asks where things are, and a model without
positional information stays at chance (25 %) by construction. Each encoding is trained on a task it
can express and must end far above chance, so a change that silently stops an encoding from learning
(a lost gradient, a frozen table, a hook that no longer runs) fails here; the encodings that cannot
express position on this data stay at chance, which guards the data itself (no leak).

* ``relation``: where the red square is relative to the blue circle; relative encodings say it
  directly, absolute ones through the two positions.
* ``quadrant``: where the square is; absolute encodings say it directly, relative ones only through
  the image border or an unrotated class token.

The training budget is the quickstart's (`configs/quickstart.yaml`: patch 8 at 32 px, width 64,
3 layers, 300 AdamW steps of 64 scenes).
"""
import functools
import math
from pathlib import Path
from typing import NamedTuple, Optional

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from timm.optim import create_optimizer_v2

import vispe  # noqa: F401  (registers its ViTs in timm)
from train.config import load_config
from train.data.digits import write_digits
from train.data.synthetic import SpatialShapes
from train.tasks import get_task

from conftest import image_pes

QUICKSTART = dict(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=4, mlp_ratio=2.0)
CHANCE = 25.0


class Expect(NamedTuple):
    spec: str  # what is trained
    task: str  # 'relation' or 'quadrant'
    minimum: Optional[float]  # top-1 % it must reach; None: it must stay at chance (it cannot learn either task)


# Every image encoding and what it learns in the quickstart budget. Each minimum sits below the lowest
# top-1 seen over two to six seeds (docs/training.md, "Does every encoding learn position?").
LEARNS = {
    # relative encodings in q / k (and v): the relation directly
    'rope_axial': Expect('rope_axial', 'relation', 90),
    'rope_mixed': Expect('rope_mixed', 'relation', 90),
    'rope2d': Expect('rope2d', 'relation', 90),  # rope_axial in CroCo's channel layout
    'rope_timm': Expect('rope_timm', 'relation', 90),  # EVA-02's rope (100 % on seeds 0-2)
    'liere': Expect('liere', 'relation', 90),
    'comrope_ap': Expect('comrope_ap', 'relation', 90),
    'comrope_ld': Expect('comrope_ld', 'relation', 90),
    'string_cayley': Expect('string_cayley', 'relation', 90),
    'string_circulant': Expect('string_circulant', 'relation', 90),
    'gta': Expect('gta', 'relation', 90),
    'rope_golden': Expect('rope_golden', 'relation', 90),  # 99.6 / 100 % on seeds 0-1
    'rope_spiral': Expect('rope_spiral', 'relation', 90),  # 100 / 100 % on seeds 0-1
    # PaPE's 50 parabolas saturate the softmax at init (logit std over 30 here): it learns, erratically
    'pape': Expect('pape', 'relation', 40),
    # iRPE as released (zero tables, on K) stays at chance for 300 steps and leaves that plateau at a
    # seed-dependent time (see irpe.py); non-zero tables with a V term learn within the budget
    'irpe': Expect('irpe:on=qkv,init_std=1', 'relation', 90),
    # absolute encodings: where the square is
    'learned': Expect('learned:init_std=0.2', 'quadrant', 90),  # timm's std 0.02 is too faint for 300 steps
    'sincos': Expect('sincos', 'quadrant', 90),
    'detr_sine': Expect('detr_sine', 'quadrant', 90),
    'detr_learned': Expect('detr_learned', 'quadrant', 90),
    'nerf_freq': Expect('nerf_freq', 'quadrant', 90),
    'fourier_gaussian': Expect('fourier_gaussian', 'relation', 80),  # the quadrant is erratic (30-100 %)
    'peg': Expect('peg', 'quadrant', 90),  # the zero padding of its convolution marks the border
    # distances only, but the class token sits at the origin: the distance to the top-left corner tells
    # quadrants 0 and 3 apart, while 1 and 2 mirror each other (a 75 % ceiling)
    'pape_ri': Expect('pape_ri', 'quadrant', 50),
    # no position, or only distances (every reflection of the grid maps one class onto another)
    'none': Expect('none', 'quadrant', None),
    'alibi2d': Expect('alibi2d', 'relation', None),
    # directed heads see one side of each patch: the relation directly, erratically at this size. With the
    # default penalty (0.75 logit per patch in the first layer) relation ends at 24-100 % (seeds 0-4), with
    # a quarter of it at 47-100 % (seeds 0, 2, 4)
    'lookhere': Expect('lookhere:global_slope=0.25', 'relation', 40),
}
# Encodings that can express the tasks but leave the position-blind start too late, or too erratically,
# for a test to rely on (measured on seed 0, and seeds 0-2 where given)
TOO_SLOW = {
    'swin_rpb': 'logit biases alone: chance on relation after 300, 1,200 and 3,000 steps (init std 0.02 or 1)',
    'fourier_learnable': "a faint init, like timm's 0.02 table: chance after 300 steps; quadrant 98 / 59 / 24 % "
                         'after 1,200 steps (seeds 0-2)',
}


@functools.lru_cache(maxsize=None)
def scenes(task: str, split: str, size: int):
    """``size`` scenes of ``task`` as tensors ``(images, labels)``, rendered once per session."""
    ds = SpatialShapes(size, 32, split=split, task=task)
    images, labels = zip(*(ds[i][:2] for i in range(size)))
    return torch.stack(images), torch.tensor(labels)


def train_top1(spec: str, task: str, *, seed: int = 0, steps: int = 300, batch_size: int = 64,
               lr: float = 2e-3, train_size: int = 4096, val_size: int = 512, **model_kw) -> float:
    """Top-1 (%) on held-out scenes of a tiny ViT with encoding ``spec`` after ``steps`` AdamW steps."""
    x, y = scenes(task, 'train', train_size)
    x_val, y_val = scenes(task, 'val', val_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: a second thread only waits for the first
    try:
        torch.manual_seed(seed)
        model = timm.create_model('vit_tiny', pe=spec, num_classes=4, **{**QUICKSTART, **model_kw})
        opt = create_optimizer_v2(model, opt='adamw', lr=lr, weight_decay=0.05)
        warmup = max(steps // 10, 1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.5 * (
            1 + math.cos(math.pi * max(s - warmup, 0) / max(steps - warmup, 1)))))
        order = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(steps):
            idx = torch.randint(len(x), (batch_size,), generator=order)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        model.eval()
        with torch.no_grad():
            correct = sum((model(xb).argmax(-1) == yb).sum().item()
                          for xb, yb in zip(x_val.split(256), y_val.split(256)))
        return 100.0 * correct / len(y_val)
    finally:
        torch.set_num_threads(threads)


def test_every_image_encoding_has_a_learning_expectation():
    assert sorted([*LEARNS, *TOO_SLOW]) == sorted(image_pes()), 'add the new encoding to LEARNS and the table in docs/training.md'


@pytest.mark.slow
@pytest.mark.parametrize('name', sorted(LEARNS))
def test_encoding_learns_the_task_it_can_express(name):
    spec, task, minimum = LEARNS[name]
    top1 = train_top1(spec, task)
    if minimum is None:
        assert top1 < CHANCE + 10, f'{spec} learned {task} ({top1:.1f} %), which it cannot express: the data leaks'
    else:
        assert top1 >= minimum, f'{spec} reached {top1:.1f} % on {task} (chance {CHANCE:.0f} %, expected >= {minimum})'


@pytest.mark.parametrize('spec, task', [
    ('rope_axial', 'relation'),
    ('liere', 'relation'),
    ('irpe:on=qkv,init_std=1', 'relation'),
    ('learned:init_std=0.2', 'quadrant'),
    ('peg:blocks=0-2', 'quadrant'),  # one PEG (the default) needs the full 300 steps
])
def test_representative_encodings_learn_in_200_steps(spec, task):
    assert train_top1(spec, task, steps=200) >= 80


# ---------------------------------------------------------------------- real images: scikit-learn's digits
def test_digits_are_written_once_as_an_image_folder_the_classification_task_reads(tmp_path):
    datasets = pytest.importorskip('sklearn.datasets')
    digits = datasets.load_digits()
    root = write_digits(tmp_path / 'digits')
    files = sorted(root.glob('*/*/*.png'))
    assert len(files) == 1797 and len(list(root.glob('val/*/*.png'))) == 397
    assert sorted(p.name for p in (root / 'train').iterdir()) == [str(d) for d in range(10)]
    assert not set(p.name for p in (root / 'train').glob('*/*')) & set(p.name for p in (root / 'val').glob('*/*'))
    for path in files[::97]:  # <split>/<digit>/<index>.png holds image <index>, grey levels 0-16 scaled to 0-255
        i = int(path.stem)
        assert int(path.parent.name) == digits.target[i]
        assert np.array_equal(np.asarray(Image.open(path)), np.rint(digits.images[i] * 255 / 16).astype(np.uint8))
    mtime = files[0].stat().st_mtime_ns
    assert write_digits(root) == root and files[0].stat().st_mtime_ns == mtime  # written on first use only

    config = Path(__file__).parents[1] / 'configs' / 'digits.yaml'
    cfg, _ = load_config(config, [f'data.root={tmp_path / "fresh"}', 'sweep={}'])
    task = get_task(cfg.task)(cfg)  # writes the folder
    model = task.build_model()
    image, label, unreadable = task.train_dataset()[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10 and unreadable == -1
    assert len(task.eval_dataset(48)) == 397 and task.eval_dataset(48)[0][0].shape == (3, 48, 48)
    assert model.num_classes == 10 and model.patch_embed.grid_size == (8, 8)
