"""Detection data: COCO-format datasets, COCO evaluation (pycocotools), and an embedded synthetic set.

Every dataset here returns ``(image, target)`` with ``image`` a normalised ``(3, H, W)`` float
tensor and ``target`` a dict in DETR's convention:

* ``boxes``: ``(n, 4)`` normalised ``(cx, cy, w, h)`` relative to the (unpadded) image;
* ``labels``: ``(n,)`` category ids (COCO ids directly, so ``num_classes`` = largest id + 1);
* ``image_id``, ``orig_size`` ``(h, w)`` of the original image, ``size`` ``(h, w)`` after transforms.

`collate_detection` pads a batch at the bottom / right and returns the padding mask DETR expects;
`CocoEvaluator` turns `models.detr.postprocess` results into COCO AP.
"""
from __future__ import annotations

import contextlib
import io
import os
import random
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from torch.utils.data import Dataset

from vispe.extras import require

from .detr import pad_images

_cocotools = 'COCO datasets and evaluation (vispe_models.detection_data)'
COCO = require('pycocotools.coco', _cocotools).COCO
COCOeval = require('pycocotools.cocoeval', _cocotools).COCOeval

__all__ = ['SyntheticShapes', 'CocoDetection', 'DetectionTransform', 'collate_detection', 'CocoEvaluator',
           'coco_from_dict', 'IMAGENET_MEAN', 'IMAGENET_STD', 'SHAPE_CATEGORIES']

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SHAPE_CATEGORIES = [{'id': 1, 'name': 'rectangle'}, {'id': 2, 'name': 'ellipse'}, {'id': 3, 'name': 'triangle'}]

# DETR's training scales (shorter side) and maximum longer side
DETR_SCALES = (480, 512, 544, 576, 608, 640, 672, 704, 736, 768, 800)


def coco_from_dict(dataset: Dict[str, Any]) -> COCO:
    """A pycocotools `COCO` index over an in-memory COCO-format dict (no file, no console output)."""
    coco = COCO()
    coco.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        coco.createIndex()
    return coco


def _to_target(boxes_xyxy: torch.Tensor, labels: torch.Tensor, image_id: int, orig_size: Tuple[int, int],
               size: Tuple[int, int]) -> Dict[str, torch.Tensor]:
    h, w = size
    scale = torch.tensor([w, h, w, h], dtype=torch.float32)
    b = boxes_xyxy / scale
    cxcywh = torch.stack([(b[:, 0] + b[:, 2]) / 2, (b[:, 1] + b[:, 3]) / 2, b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]], 1)
    return {'boxes': cxcywh.reshape(-1, 4), 'labels': labels.long(), 'image_id': torch.tensor(image_id),
            'orig_size': torch.tensor(orig_size), 'size': torch.tensor(size)}


class DetectionTransform:
    """DETR's image / box transforms (without its random-crop branch), then ImageNet normalisation.

    Training: random horizontal flip and a random shorter side from ``scales`` (longer side at most
    ``max_size``); evaluation: shorter side ``scales[-1]``. ``scales=None`` keeps the size.

    Args:
        train: random flip and random scale.
        scales: shorter-side sizes (DETR's 480..800), or None.
        max_size: cap on the longer side (1333).
    """

    def __init__(self, train: bool, scales: Optional[Sequence[int]] = DETR_SCALES, max_size: Optional[int] = 1333
                 ) -> None:
        self.train = train
        self.scales = tuple(scales) if scales else None
        self.max_size = max_size

    @staticmethod
    def resized_size(w: int, h: int, size: int, max_size: Optional[int]) -> Tuple[int, int]:
        """DETR's ``get_size_with_aspect_ratio``: (h, w) with shorter side ``size``, longer <= ``max_size``."""
        if max_size is not None:
            lo, hi = float(min(w, h)), float(max(w, h))
            if hi / lo * size > max_size:
                size = int(round(max_size * lo / hi))
        if (w <= h and w == size) or (h <= w and h == size):
            return h, w
        if w < h:
            return int(size * h / w), size
        return size, int(size * w / h)

    def __call__(self, image: Image.Image, boxes: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        w, h = image.size
        if self.train and random.random() < 0.5:
            image = TF.hflip(image)
            boxes = boxes[:, [2, 1, 0, 3]] * torch.tensor([-1, 1, -1, 1]) + torch.tensor([w, 0, w, 0])
        if self.scales:
            size = random.choice(self.scales) if self.train else self.scales[-1]
            nh, nw = self.resized_size(w, h, size, self.max_size)
            if (nh, nw) != (h, w):
                image = TF.resize(image, [nh, nw])
                boxes = boxes * torch.tensor([nw / w, nh / h, nw / w, nh / h])
        tensor = TF.normalize(TF.to_tensor(image), IMAGENET_MEAN, IMAGENET_STD)
        return tensor, boxes


class SyntheticShapes(Dataset):
    """Embedded detection set: rectangles, ellipses and triangles on a noisy background.

    Generated on the fly and deterministic per ``(seed, index)``, so it needs no download and every
    worker / epoch sees the same image for an index. Image sizes vary (``image_size`` is the range
    of each side), so batches exercise the padding mask. Boxes are the exact extent of each shape;
    shapes overlap little (IoU < 0.1 between boxes). Category ids 1..3 (``num_classes=4``).

    Args:
        num_images: dataset length.
        image_size: (smallest, largest) side length in pixels.
        max_objects: objects per image are drawn uniformly from 1..max_objects.
        object_size: (smallest, largest) object side as a fraction of the image's shorter side.
        seed: base seed of the generator.
        train: random horizontal flips (and a random scale among ``scales``).
        scales: resize the shorter side to one of these (as `DetectionTransform`); None keeps the
            generated size.
        max_size: cap on the longer side after resizing.
    """
    categories = SHAPE_CATEGORIES

    def __init__(self, num_images: int = 1000, image_size: Tuple[int, int] = (64, 96), max_objects: int = 4,
                 object_size: Tuple[float, float] = (0.2, 0.5), seed: int = 0, train: bool = False,
                 scales: Optional[Sequence[int]] = None, max_size: Optional[int] = None) -> None:
        if num_images <= 0 or max_objects <= 0:
            raise ValueError(f'num_images and max_objects must be positive, got {num_images}, {max_objects}')
        if not 0 < image_size[0] <= image_size[1]:
            raise ValueError(f'image_size must be (min, max) with 0 < min <= max, got {image_size}')
        if not 0 < object_size[0] <= object_size[1] <= 1:
            raise ValueError(f'object_size must be fractions (min, max) in (0, 1], got {object_size}')
        self.num_images = num_images
        self.image_size = tuple(image_size)
        self.max_objects = max_objects
        self.object_size = tuple(object_size)
        self.seed = seed
        self.transform = DetectionTransform(train=train, scales=scales, max_size=max_size)

    def __len__(self) -> int:
        return self.num_images

    def sample(self, index: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Image ``(H, W, 3)`` uint8, boxes ``(n, 4)`` absolute ``(x0, y0, x1, y1)``, category ids ``(n,)``."""
        if not 0 <= index < self.num_images:
            raise IndexError(f'index {index} out of range for {self.num_images} images')
        rng = np.random.default_rng([self.seed, index])
        h, w = (int(s) for s in rng.integers(self.image_size[0], self.image_size[1] + 1, size=2))
        background = rng.uniform(0, 255, size=3)
        image = background + rng.normal(0, 12, size=(h, w, 3))
        ys, xs = np.mgrid[0:h, 0:w] + 0.5  # pixel centres
        boxes, labels = [], []
        for _ in range(int(rng.integers(1, self.max_objects + 1))):
            for _attempt in range(20):
                side = min(h, w)
                bw, bh = (rng.uniform(*self.object_size, size=2) * side).round().clip(4)
                x0, y0 = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
                box = np.array([x0, y0, x0 + bw, y0 + bh]).round()
                if all(_iou(box, b) < 0.1 for b in boxes):
                    break
            else:
                continue
            label = int(rng.integers(1, 4))
            colour = (background + 255 / 2 + rng.uniform(-60, 60, size=3)) % 255  # far from the background
            inside = self._shape_mask(label, box, xs, ys, rng)
            image[inside] = colour
            boxes.append(box)
            labels.append(label)
        image = image.clip(0, 255).astype(np.uint8)
        return image, np.array(boxes, dtype=np.float32).reshape(-1, 4), np.array(labels, dtype=np.int64)

    @staticmethod
    def _shape_mask(label: int, box: np.ndarray, xs: np.ndarray, ys: np.ndarray, rng: np.random.Generator
                    ) -> np.ndarray:
        x0, y0, x1, y1 = box
        if label == 1:  # rectangle
            return (xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1)
        if label == 2:  # ellipse inscribed in the box
            cx, cy, a, b = (x0 + x1) / 2, (y0 + y1) / 2, (x1 - x0) / 2, (y1 - y0) / 2
            return ((xs - cx) / a) ** 2 + ((ys - cy) / b) ** 2 <= 1
        # triangle: base along the bottom edge, apex on the top edge
        apex = rng.uniform(x0, x1)
        verts = [(x0, y1), (x1, y1), (apex, y0)]
        signs = []
        for (ax, ay), (bx, by) in zip(verts, verts[1:] + verts[:1]):
            signs.append((bx - ax) * (ys - ay) - (by - ay) * (xs - ax))
        s = np.stack(signs)
        return (s >= 0).all(0) | (s <= 0).all(0)

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        image, boxes, labels = self.sample(index)
        h, w = image.shape[:2]
        tensor, boxes_t = self.transform(Image.fromarray(image), torch.from_numpy(boxes))
        return tensor, _to_target(boxes_t, torch.from_numpy(labels), index, (h, w), tuple(tensor.shape[-2:]))

    def coco(self) -> COCO:
        """COCO-format ground truth of the whole set, for `CocoEvaluator`."""
        images, annotations = [], []
        for index in range(self.num_images):
            image, boxes, labels = self.sample(index)
            images.append({'id': index, 'height': image.shape[0], 'width': image.shape[1]})
            for (x0, y0, x1, y1), label in zip(boxes.tolist(), labels.tolist()):
                annotations.append({'id': len(annotations) + 1, 'image_id': index, 'category_id': label,
                                    'bbox': [x0, y0, x1 - x0, y1 - y0], 'area': (x1 - x0) * (y1 - y0),
                                    'iscrowd': 0})
        return coco_from_dict({'images': images, 'annotations': annotations, 'categories': self.categories})


def _iou(a: np.ndarray, b: np.ndarray) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


class CocoDetection(Dataset):
    """A COCO-format detection dataset: an image folder and an instances JSON.

    Crowd annotations are dropped and boxes clipped to the image, as in DETR. For COCO 2017:
    ``CocoDetection(root / 'train2017', root / 'annotations/instances_train2017.json', train=True)``.

    Args:
        img_folder: folder of the images (``file_name`` in the JSON is relative to it).
        ann_file: COCO instances JSON.
        train: training transforms (flip, random scale) or evaluation transforms.
        scales: shorter-side sizes (DETR's), None keeps the original size.
        max_size: cap on the longer side.
    """

    def __init__(self, img_folder: str, ann_file: str, train: bool = False,
                 scales: Optional[Sequence[int]] = DETR_SCALES, max_size: Optional[int] = 1333) -> None:
        if not os.path.isfile(ann_file):
            raise ValueError(f'ann_file {ann_file!r} does not exist')
        if not os.path.isdir(img_folder):
            raise ValueError(f'img_folder {img_folder!r} does not exist')
        with contextlib.redirect_stdout(io.StringIO()):
            self.coco_gt = COCO(ann_file)
        self.img_folder = img_folder
        self.ids = sorted(self.coco_gt.imgs.keys())
        self.transform = DetectionTransform(train, scales, max_size)
        self.categories = self.coco_gt.dataset.get('categories', [])

    def __len__(self) -> int:
        return len(self.ids)

    def coco(self) -> COCO:
        return self.coco_gt

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
        image_id = self.ids[index]
        info = self.coco_gt.imgs[image_id]
        image = Image.open(os.path.join(self.img_folder, info['file_name'])).convert('RGB')
        w, h = image.size
        anns = [a for a in self.coco_gt.imgToAnns.get(image_id, []) if not a.get('iscrowd', 0)]
        boxes = torch.tensor([a['bbox'] for a in anns], dtype=torch.float32).reshape(-1, 4)
        boxes[:, 2:] += boxes[:, :2]
        boxes[:, 0::2] = boxes[:, 0::2].clamp(0, w)
        boxes[:, 1::2] = boxes[:, 1::2].clamp(0, h)
        labels = torch.tensor([a['category_id'] for a in anns], dtype=torch.int64)
        keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        tensor, boxes = self.transform(image, boxes[keep])
        return tensor, _to_target(boxes, labels[keep], image_id, (h, w), tuple(tensor.shape[-2:]))


def collate_detection(batch: Sequence[Tuple[torch.Tensor, Dict[str, torch.Tensor]]]
                      ) -> Tuple[torch.Tensor, torch.Tensor, List[Dict[str, torch.Tensor]]]:
    """Pad images at the bottom / right: ``(images (B, 3, H, W), mask (B, H, W) True on padding, targets)``."""
    images, mask = pad_images([b[0] for b in batch])
    return images, mask, [b[1] for b in batch]


class CocoEvaluator:
    """COCO box AP of detections against a COCO ground truth (pycocotools' COCOeval, 'bbox').

    Feed it per batch with `update` (targets for the image ids, results of
    `models.detr.postprocess` at each image's ``orig_size``); `summarize` returns AP, AP50, AP75,
    APs, APm, APl (in [0, 1]; -1 where the ground truth has no object of that size, COCO's
    convention) over the images seen. In distributed runs, `summarize` gathers the
    detections of every process first.
    """
    STATS = ('AP', 'AP50', 'AP75', 'APs', 'APm', 'APl')

    def __init__(self, coco_gt: COCO) -> None:
        self.coco_gt = coco_gt
        self.results: List[Dict[str, Any]] = []
        self.image_ids: List[int] = []

    def update(self, targets: Sequence[Dict[str, torch.Tensor]], results: Sequence[Dict[str, torch.Tensor]]) -> None:
        for t, r in zip(targets, results):
            image_id = int(t['image_id'])
            self.image_ids.append(image_id)
            boxes = r['boxes'].detach().float().cpu()
            xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], 1).tolist()
            for box, score, label in zip(xywh, r['scores'].tolist(), r['labels'].tolist()):
                self.results.append({'image_id': image_id, 'category_id': int(label), 'bbox': box,
                                     'score': float(score)})

    def _gather(self) -> Tuple[List[Dict[str, Any]], List[int]]:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self.results, self.image_ids
        parts: List[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(parts, (self.results, self.image_ids))
        return [r for p in parts for r in p[0]], [i for p in parts for i in p[1]]

    def summarize(self) -> Dict[str, float]:
        results, image_ids = self._gather()
        valid_ids = set(self.coco_gt.getCatIds())
        results = [r for r in results if r['category_id'] in valid_ids]
        if not results:
            return {k: 0.0 for k in self.STATS}
        with contextlib.redirect_stdout(io.StringIO()):
            detections = self.coco_gt.loadRes(results)
            evaluator = COCOeval(self.coco_gt, detections, 'bbox')
            evaluator.params.imgIds = sorted(set(image_ids))
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
        return {k: float(v) for k, v in zip(self.STATS, evaluator.stats[:6])}
