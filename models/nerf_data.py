"""NeRF data: Blender-format scenes (``transforms_*.json``), an embedded ray-traced scene, and images.

Camera convention (NeRF's Blender scenes): ``pose`` is camera-to-world ``(4, 4)`` with OpenGL camera
axes (x right, y up, the camera looks along -z); a pixel at column ``i``, row ``j`` has direction
``((i + o - W/2) / f, -(j + o - H/2) / f, -1)`` in camera axes, with ``o = pixel_offset`` (0 in
NeRF's code, 0.5 for pixel centres as nerfstudio uses).

`synthetic_scene` renders an analytic scene (spheres and boxes, Lambert shading, white background)
with known cameras on the upper hemisphere, exactly the layout of NeRF's Blender scenes (radius 4,
``near = 2``, ``far = 6``); `save_blender` writes any scene in the Blender format, `load_blender`
reads it back. `procedural_image` is the embedded target of 2D image fitting.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from PIL import Image

__all__ = ['SceneData', 'get_rays', 'pixel_rays', 'scene_rays', 'load_blender', 'save_blender', 'look_at', 'Sphere',
           'Box', 'DEFAULT_OBJECTS', 'render_analytic', 'synthetic_scene', 'procedural_image']


@dataclass
class SceneData:
    """Posed images of one split.

    Attributes:
        images: ``(N, H, W, 3)`` float in ``[0, 1]`` (composited on the background).
        poses: ``(N, 4, 4)`` camera-to-world, OpenGL camera axes.
        focal: focal length in pixels.
        near, far: ray bounds.
        alphas: ``(N, H, W)`` opacity when known.
    """
    images: torch.Tensor
    poses: torch.Tensor
    focal: float
    near: float = 2.0
    far: float = 6.0
    alphas: Optional[torch.Tensor] = None

    @property
    def height(self) -> int:
        return self.images.shape[1]

    @property
    def width(self) -> int:
        return self.images.shape[2]

    @property
    def camera_angle_x(self) -> float:
        return 2 * math.atan(0.5 * self.width / self.focal)


def get_rays(height: int, width: int, focal: float, c2w: torch.Tensor, pixel_offset: float = 0.0
             ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Origins and (unnormalised, z = -1 in camera axes) directions ``(H, W, 3)`` of every pixel."""
    c2w = c2w.float()
    i, j = torch.meshgrid(torch.arange(width, dtype=torch.float32, device=c2w.device),
                          torch.arange(height, dtype=torch.float32, device=c2w.device), indexing='xy')
    dirs = torch.stack([(i + pixel_offset - width * 0.5) / focal, -(j + pixel_offset - height * 0.5) / focal,
                        -torch.ones_like(i)], -1)
    rays_d = dirs @ c2w[:3, :3].T
    return c2w[:3, 3].expand(rays_d.shape), rays_d


def pixel_rays(poses: torch.Tensor, height: int, width: int, focal: float, index: torch.Tensor,
               pixel_offset: float = 0.0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rays ``(K, 3)`` of flat pixel indices ``index`` into ``(N, H, W)`` views (as `get_rays`), without
    building every ray: what a training step samples."""
    view, rem = index // (height * width), index % (height * width)
    row, col = (rem // width).to(poses.dtype), (rem % width).to(poses.dtype)
    dirs = torch.stack([(col + pixel_offset - width * 0.5) / focal, -(row + pixel_offset - height * 0.5) / focal,
                        -torch.ones_like(col)], -1)
    c2w = poses[view]
    return c2w[:, :3, 3], (c2w[:, :3, :3] @ dirs[..., None])[..., 0]


def scene_rays(scene: SceneData, pixel_offset: float = 0.0) -> Dict[str, torch.Tensor]:
    """All rays of a scene flattened: ``rays_o``, ``rays_d``, ``rgb`` each ``(N * H * W, 3)``."""
    origins, dirs = zip(*(get_rays(scene.height, scene.width, scene.focal, p, pixel_offset) for p in scene.poses))
    return {'rays_o': torch.stack(origins).reshape(-1, 3), 'rays_d': torch.stack(dirs).reshape(-1, 3),
            'rgb': scene.images.reshape(-1, 3)}


# ----------------------------------------------------------------------------------------- Blender format
def load_blender(root: str, split: str = 'train', downscale: int = 1, white_background: bool = True,
                 near: float = 2.0, far: float = 6.0) -> SceneData:
    """Read ``root/transforms_<split>.json`` and its RGBA images (NeRF's Blender synthetic scenes).

    Args:
        root: scene folder (e.g. ``nerf_synthetic/lego``).
        split: ``train``, ``val`` or ``test``.
        downscale: integer factor, area-averaged (2 is NeRF's ``half_res``).
        white_background: composite RGBA on white (NeRF's ``white_bkgd``), else on black.
        near, far: ray bounds (NeRF uses 2 and 6 for these scenes).
    """
    path = os.path.join(root, f'transforms_{split}.json')
    if not os.path.isfile(path):
        raise ValueError(f'no Blender transforms file for split {split!r}: {path} does not exist')
    if downscale < 1:
        raise ValueError(f'downscale must be a positive integer, got {downscale}')
    with open(path) as f:
        meta = json.load(f)
    images, poses = [], []
    for frame in meta['frames']:
        file = os.path.join(root, frame['file_path'])
        if not os.path.splitext(file)[1]:
            file += '.png'
        image = Image.open(file).convert('RGBA')
        if downscale > 1:
            image = image.resize((image.width // downscale, image.height // downscale), Image.BOX)
        images.append(np.asarray(image, dtype=np.float32) / 255.0)
        poses.append(np.asarray(frame['transform_matrix'], dtype=np.float32))
    rgba = torch.from_numpy(np.stack(images))
    alpha = rgba[..., 3]
    background = 1.0 if white_background else 0.0
    rgb = rgba[..., :3] * alpha[..., None] + background * (1 - alpha[..., None])
    width = rgba.shape[2]
    focal = 0.5 * width / math.tan(0.5 * float(meta['camera_angle_x']))
    return SceneData(images=rgb, poses=torch.from_numpy(np.stack(poses)), focal=focal, near=near, far=far,
                     alphas=alpha)


def save_blender(scene: SceneData, root: str, split: str = 'train') -> None:
    """Write a scene as ``root/transforms_<split>.json`` + ``root/<split>/r_<i>.png`` (RGBA, 8 bit)."""
    os.makedirs(os.path.join(root, split), exist_ok=True)
    frames = []
    alphas = scene.alphas if scene.alphas is not None else torch.ones(scene.images.shape[:3])
    for i, (image, alpha, pose) in enumerate(zip(scene.images, alphas, scene.poses)):
        # un-composite from white so that loading (which composites on white) returns the image
        a = alpha[..., None].clamp_min(1e-6)
        rgb = ((image - (1 - alpha[..., None])) / a).clamp(0, 1)
        rgba = torch.cat([rgb, alpha[..., None]], -1)
        Image.fromarray((rgba.numpy() * 255).round().astype(np.uint8), 'RGBA').save(
            os.path.join(root, split, f'r_{i}.png'))
        frames.append({'file_path': f'./{split}/r_{i}', 'transform_matrix': pose.tolist()})
    with open(os.path.join(root, f'transforms_{split}.json'), 'w') as f:
        json.dump({'camera_angle_x': scene.camera_angle_x, 'frames': frames}, f, indent=1)


# ----------------------------------------------------------------------------------------- analytic scene
@dataclass(frozen=True)
class Sphere:
    """A sphere of one colour."""
    center: Tuple[float, float, float]
    radius: float
    colour: Tuple[float, float, float]


@dataclass(frozen=True)
class Box:
    """An axis-aligned box of one colour, between its ``lower`` and ``upper`` corners."""
    lower: Tuple[float, float, float]
    upper: Tuple[float, float, float]
    colour: Tuple[float, float, float]


DEFAULT_OBJECTS: Tuple = (
    Sphere((0.0, 0.0, 0.35), 0.55, (0.85, 0.25, 0.2)),
    Sphere((0.75, -0.55, 0.2), 0.3, (0.2, 0.45, 0.9)),
    Box((-1.1, -0.4, -0.6), (-0.45, 0.5, 0.3), (0.25, 0.75, 0.3)),
    Box((-0.9, -0.9, -0.7), (0.9, 0.9, -0.55), (0.8, 0.75, 0.55)),
)


def _hit_sphere(o: torch.Tensor, d: torch.Tensor, s: Sphere) -> Tuple[torch.Tensor, torch.Tensor]:
    c = torch.tensor(s.center, dtype=o.dtype)
    oc = o - c
    a = (d * d).sum(-1)
    b = (d * oc).sum(-1)
    disc = b * b - a * ((oc * oc).sum(-1) - s.radius ** 2)
    t = (-b - disc.clamp_min(0).sqrt()) / a
    t = torch.where((disc >= 0) & (t > 0), t, torch.full_like(t, math.inf))
    normal = (o + t[..., None] * d - c) / s.radius
    return t, normal


def _hit_box(o: torch.Tensor, d: torch.Tensor, box: Box) -> Tuple[torch.Tensor, torch.Tensor]:
    lo, hi = torch.tensor(box.lower, dtype=o.dtype), torch.tensor(box.upper, dtype=o.dtype)
    safe = torch.where(d.abs() < 1e-12, torch.full_like(d, 1e-12), d)
    t1, t2 = (lo - o) / safe, (hi - o) / safe
    tnear, tfar = torch.minimum(t1, t2), torch.maximum(t1, t2)
    t_enter, axis = tnear.max(-1)
    t_exit = tfar.min(-1).values
    t = torch.where((t_exit >= t_enter) & (t_enter > 0), t_enter, torch.full_like(t_enter, math.inf))
    normal = torch.zeros_like(o).scatter(-1, axis[..., None], 1.0)
    normal = normal * -torch.sign(safe.gather(-1, axis[..., None]))  # faces the incoming ray
    return t, normal


def render_analytic(rays_o: torch.Tensor, rays_d: torch.Tensor, objects: Sequence = DEFAULT_OBJECTS,
                    light: Tuple[float, float, float] = (0.4, -0.3, 0.85), ambient: float = 0.35
                    ) -> Dict[str, torch.Tensor]:
    """Ray-trace spheres and boxes: ``rgb`` (on white), ``alpha`` (1 on a hit) and ``depth`` (ray parameter t).

    Shading: ``colour * (ambient + (1 - ambient) * max(0, n . l))`` with a directional light.
    """
    shape = rays_o.shape[:-1]
    o, d = rays_o.reshape(-1, 3).double(), rays_d.reshape(-1, 3).double()
    best = torch.full(o.shape[:1], math.inf, dtype=o.dtype)
    normal = torch.zeros_like(o)
    colour = torch.ones_like(o)
    for obj in objects:
        t, n = _hit_sphere(o, d, obj) if isinstance(obj, Sphere) else _hit_box(o, d, obj)
        closer = t < best
        best = torch.where(closer, t, best)
        normal = torch.where(closer[:, None], n, normal)
        colour = torch.where(closer[:, None], torch.tensor(obj.colour, dtype=o.dtype), colour)
    hit = torch.isfinite(best)
    l_dir = torch.tensor(light, dtype=o.dtype)
    shade = ambient + (1 - ambient) * (normal @ (l_dir / l_dir.norm())).clamp_min(0)
    rgb = torch.where(hit[:, None], colour * shade[:, None], torch.ones_like(o))
    return {'rgb': rgb.float().reshape(*shape, 3), 'alpha': hit.float().reshape(shape),
            'depth': torch.where(hit, best, torch.zeros_like(best)).float().reshape(shape)}


def look_at(eye: Sequence[float], target: Sequence[float] = (0.0, 0.0, 0.0), up: Sequence[float] = (0.0, 0.0, 1.0)
            ) -> torch.Tensor:
    """Camera-to-world ``(4, 4)`` (OpenGL axes) of a camera at ``eye`` looking at ``target``."""
    eye_t, target_t, up_t = (torch.tensor(v, dtype=torch.float64) for v in (eye, target, up))
    forward = target_t - eye_t
    forward = forward / forward.norm()
    right = torch.linalg.cross(forward, up_t)
    if right.norm() < 1e-8:
        raise ValueError(f'look_at: the viewing direction {forward.tolist()} is parallel to up={list(up)}')
    right = right / right.norm()
    cam_up = torch.linalg.cross(right, forward)
    c2w = torch.eye(4, dtype=torch.float64)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = right, cam_up, -forward, eye_t
    return c2w.float()


def synthetic_scene(split: str = 'train', num_views: int = 20, height: int = 64, width: int = 64,
                    camera_angle_x: float = 0.6911112070083618, radius: float = 4.0, seed: int = 0,
                    objects: Sequence = DEFAULT_OBJECTS) -> SceneData:
    """The embedded scene rendered from known cameras (deterministic per split and seed).

    Training views: random azimuth, elevation in [15, 65] degrees; other splits: a ring at 30 degrees
    elevation (the layout of NeRF's Blender test renders). ``camera_angle_x`` is the Blender scenes'.
    """
    if num_views <= 0:
        raise ValueError(f'num_views must be positive, got {num_views}')
    if split == 'train':
        rng = np.random.default_rng(seed)
        azimuth = rng.uniform(0, 2 * math.pi, num_views)
        elevation = np.radians(rng.uniform(15, 65, num_views))
    else:
        azimuth = np.linspace(0, 2 * math.pi, num_views, endpoint=False) + (0.3 if split == 'val' else 0.1)
        elevation = np.full(num_views, math.radians(30))
    focal = 0.5 * width / math.tan(0.5 * camera_angle_x)
    images, alphas, poses = [], [], []
    for az, el in zip(azimuth, elevation):
        eye = radius * np.array([math.cos(el) * math.cos(az), math.cos(el) * math.sin(az), math.sin(el)])
        pose = look_at(eye.tolist())
        rays_o, rays_d = get_rays(height, width, focal, pose)
        out = render_analytic(rays_o, rays_d, objects)
        images.append(out['rgb'])
        alphas.append(out['alpha'])
        poses.append(pose)
    return SceneData(images=torch.stack(images), poses=torch.stack(poses), focal=focal, near=2.0, far=6.0,
                     alphas=torch.stack(alphas))


def procedural_image(height: int = 256, width: int = 256, seed: int = 0) -> torch.Tensor:
    """An ``(H, W, 3)`` image in ``[0, 1]`` with detail at many scales, the embedded image-fitting target:
    smooth colour gradients, oriented gratings of increasing frequency and sharp-edged discs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / np.array([height, width])[:, None, None]
    image = np.stack([0.5 + 0.3 * np.sin(2 * math.pi * (x * rng.uniform(0.5, 1.5) + rng.uniform()))
                      for _ in range(3)], -1)
    for k in range(6):
        freq = 2.0 * 1.6 ** k
        theta = rng.uniform(0, math.pi)
        phase = np.cos(theta) * x + np.sin(theta) * y
        image += 0.08 * np.sin(2 * math.pi * freq * phase + rng.uniform(0, 2 * math.pi))[..., None] \
            * rng.uniform(-1, 1, size=3)
    for _ in range(8):
        cx, cy, r = rng.uniform(0.1, 0.9), rng.uniform(0.1, 0.9), rng.uniform(0.04, 0.15)
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
        image[inside] = rng.uniform(0, 1, size=3)
    return torch.from_numpy(image.clip(0, 1)).float()
