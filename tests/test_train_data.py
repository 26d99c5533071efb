"""Data of the training script: the embedded position-dependent scenes, image folders, samplers."""
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform

from train.data import ImageFolderDataset, ShardSampler, SpatialShapes, TrainSampler, make_loader


def _centroid(img: np.ndarray, channel: int) -> np.ndarray:
    """(x, y) centre of the pixels dominated by one colour channel (0 red, 2 blue), in [0, 1]."""
    other = 2 - channel
    w = np.clip(img[..., channel] - img[..., other], 0, None)
    w = np.where(w > 0.3, w, 0.0)
    ys, xs = np.mgrid[0:img.shape[0], 0:img.shape[1]]
    return np.array([(w * (xs + 0.5)).sum(), (w * (ys + 0.5)).sum()]) / w.sum() / img.shape[0]


def test_scenes_are_deterministic_per_seed_and_index():
    a, b = SpatialShapes(50, 32, seed=3), SpatialShapes(50, 32, seed=3)
    for i in (0, 7, 49):
        assert torch.equal(a[i][0], b[i][0]) and a[i][1] == b[i][1]
    other_seed, val = SpatialShapes(50, 32, seed=4), SpatialShapes(50, 32, seed=3, split='val')
    assert not torch.equal(a[7][0], other_seed[7][0])
    assert not torch.equal(a[7][0], val[7][0])


def test_relation_label_matches_the_object_positions_seen_in_the_pixels():
    ds = SpatialShapes(200, 64, seed=0, task='relation')
    for i in range(200):
        img = ds.render(i, 64)
        red, blue = _centroid(img, 0), _centroid(img, 2)
        expected = 2 * int(red[0] < blue[0]) + int(red[1] < blue[1])  # square left of / above circle
        assert ds[i][1] == expected


def test_quadrant_label_matches_the_square_position_seen_in_the_pixels():
    ds = SpatialShapes(100, 64, seed=0, task='quadrant')
    for i in range(100):
        red = _centroid(ds.render(i, 64), 0)
        assert ds[i][1] == 2 * int(red[0] > 0.5) + int(red[1] > 0.5)


def test_classes_are_balanced():
    for task in ('relation', 'quadrant'):
        ds = SpatialShapes(800, 8, task=task)
        counts = np.bincount([ds.scene(i)['label'] for i in range(len(ds))], minlength=4)
        assert ds.num_classes == 4 and counts.min() > 0.8 * len(ds) / 4, (task, counts)


def test_the_same_scene_renders_at_any_resolution():
    ds = SpatialShapes(20, 32)
    for i in range(20):
        small = torch.from_numpy(ds.render(i, 32)).permute(2, 0, 1)
        large = torch.from_numpy(ds.render(i, 64)).permute(2, 0, 1)
        # box-downsampling the 64 px render gives the 32 px render up to anti-aliasing
        assert (F.avg_pool2d(large[None], 2)[0] - small).abs().mean() < 0.01
        assert ds.at_size(48)[i][1] == ds[i][1]
        assert ds.at_size(48)[i][0].shape == (3, 48, 48)


@pytest.mark.parametrize('task', ['relation', 'quadrant'])
def test_no_patch_of_the_quickstart_model_sees_both_objects(task):
    """Patch 8 at 32 px: each object lies inside one patch, alone, so the bag of patches says nothing of
    where the objects are; for the relation task they are in different patch rows and columns."""
    ds = SpatialShapes(300, 32, task=task)
    for i in range(300):
        img = ds.render(i, 32)
        red = (np.abs(img - [0.90, 0.15, 0.10]).sum(-1) < 1.2) & (img[..., 0] > img[..., 1] + 0.05)
        blue = (np.abs(img - [0.10, 0.25, 0.90]).sum(-1) < 1.2) & (img[..., 2] > img[..., 1] + 0.05)
        red_patches = np.argwhere(red.reshape(4, 8, 4, 8).any(axis=(1, 3)))
        blue_patches = np.argwhere(blue.reshape(4, 8, 4, 8).any(axis=(1, 3)))
        assert len(red_patches) == 1 and len(blue_patches) == 1, i
        if task == 'relation':
            assert (red_patches[0] != blue_patches[0]).all()
        else:
            assert (red_patches[0] != blue_patches[0]).any()


def test_bad_scene_arguments_are_rejected():
    with pytest.raises(ValueError, match='task must be'):
        SpatialShapes(10, 32, task='where')
    with pytest.raises(ValueError, match='object_size'):
        SpatialShapes(10, 32, object_size=(0.05, 0.2))
    with pytest.raises(ValueError, match='cells'):
        SpatialShapes(10, 32, cells=3)


def _image_folder(root: Path, classes=('cat', 'dog'), per_class=3, size=20, corrupt=()) -> Path:
    rng = np.random.default_rng(0)
    for c in classes:
        (root / c).mkdir(parents=True)
        for j in range(per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / c / f'{j}.png')
    for rel in corrupt:
        (root / rel).write_bytes(b'not an image at all')
    return root


def test_unreadable_images_are_skipped_and_reported_by_index(tmp_path):
    root = _image_folder(tmp_path / 'train', corrupt=('cat/bad.png',))
    ds = ImageFolderDataset(root, create_transform(16))
    bad = [i for i, (p, _) in enumerate(ds.samples) if p.endswith('bad.png')][0]
    img, label, unreadable = ds[bad]
    assert unreadable == bad and img.shape == (3, 16, 16)
    assert label == ds.samples[bad + 1][1]  # the next readable image takes its place
    assert ds[bad - 1][2] == -1
    loader = make_loader(ds, ShardSampler(ds, 0, 1), 3, 0, torch.device('cpu'), drop_last=False)
    assert [i for b in loader for i in b[2].tolist() if i >= 0] == [bad]


def test_augmentation_depends_on_seed_epoch_and_index_only(tmp_path):
    root = _image_folder(tmp_path / 'train', per_class=4)
    ds = ImageFolderDataset(root, create_transform(16, is_training=True, auto_augment='rand-m9-mstd0.5'), seed=5)
    ds.set_epoch(2)
    first = ds[3][0]
    torch.rand(10)  # global random state must not matter
    assert torch.equal(ds[3][0], first)
    ds.set_epoch(3)
    assert not torch.equal(ds[3][0], first)
    ds.set_epoch(2)
    in_workers = next(iter(make_loader(ds, ShardSampler(ds, 0, 1), 8, 2, torch.device('cpu'), False)))[0]
    in_process = next(iter(make_loader(ds, ShardSampler(ds, 0, 1), 8, 0, torch.device('cpu'), False)))[0]
    assert torch.equal(in_workers, in_process) and torch.equal(in_process[3], first)


def test_train_sampler_resumes_mid_epoch_and_shards_by_rank():
    data = list(range(40))
    full = TrainSampler(data, 0, 1, seed=1)
    full.set_epoch(3)
    order = list(full)
    assert sorted(order) == data
    full.set_epoch(3, skip=12)
    assert list(full) == order[12:]
    full.set_epoch(4)
    assert list(full) != order
    ranks = []
    for r in range(2):
        s = TrainSampler(data, r, 2, seed=1)
        s.set_epoch(3)
        ranks.append(list(s))
    assert sorted(ranks[0] + ranks[1]) == data
    # one shared permutation: rank r takes every second item of the single-process order
    assert ranks[0] == order[0::2] and ranks[1] == order[1::2]


def test_repeated_augmentation_shows_each_image_on_several_ranks():
    data = list(range(24))
    per_rank = []
    for r in range(3):
        s = TrainSampler(data, r, 3, seed=0, repeats=3)
        s.set_epoch(0)
        per_rank.append(list(s))
    # DeiT's RASampler: len / world items per rank; an image drawn in an epoch comes 3 times, once per rank
    assert all(len(p) == 8 for p in per_rank)
    assert set(per_rank[0]) == set(per_rank[1]) == set(per_rank[2])
    assert all(len(set(p)) == 8 for p in per_rank)
