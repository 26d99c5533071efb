"""NeRF (Mildenhall et al., ECCV 2020) and coordinate MLPs with swappable vispe coordinate encodings.

`coordinate_encoder` turns any vispe spec into a map ``(..., D) -> (..., out_dim)``:

* ``'none'`` (no hook at all): the raw coordinates (the no-encoding baseline of the
  Fourier-features paper);
* any additive encoding: its ``encode(coords)`` / ``out_dim``: the coordinate encodings
  (``'nerf_freq'``, ``'fourier_gaussian'``) without a projection to a token width, the others
  (``'fourier_learnable'``, ...) of width ``encoding_dim``.

`NeRF` follows NeRF's released code (nerf-pytorch): an 8 x 256 ReLU MLP with the encoded position
re-injected after layer 4, density from the position only, colour from a 128-wide branch that
also sees the encoded view direction; stratified coarse samples, inverse-CDF fine samples
(`sample_pdf`) from the coarse weights, and alpha compositing (`volume_render`). `CoordinateMLP`
is the 2D image-fitting network of Tancik et al. (2020), `fit_image` its training loop with PSNR.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import vispe

from .nerf_data import get_rays

__all__ = ['coordinate_encoder', 'CoordinateEncoder', 'NeRFField', 'NeRF', 'CoordinateMLP', 'volume_render',
           'sample_pdf', 'psnr', 'image_coordinates', 'fit_image']


class CoordinateEncoder(nn.Module):
    """A vispe encoding used as a coordinate map ``(..., D) -> (..., out_dim)`` (see `coordinate_encoder`).

    The encoding is built for a host of ``D = input_dim`` coordinate axes that uses it as a map
    (``PEContext(num_axes=input_dim, coordinate_map=True)``, so nothing is projected to a token
    width): an additive encoding maps by its ``encode`` / ``out_dim``, one without any hook
    (``'none'``) is the identity, and one that acts elsewhere (in attention, between blocks) is
    refused.
    """

    def __init__(self, spec: vispe.registry.PESpec, input_dim: int, encoding_dim: int = 128) -> None:
        super().__init__()
        if len(vispe.parse_pe_spec(spec)) != 1:
            raise ValueError(f'a coordinate encoding is one encoding, got the composition {spec!r}')
        self.spec = spec
        self.input_dim = input_dim
        pe = vispe.create_pe(spec, vispe.PEContext(dim=encoding_dim, num_axes=input_dim, coordinate_map=True))
        caps = pe.capabilities
        if not caps.hooks:  # no position at all: the raw coordinates
            self.pe = None
            self.out_dim = input_dim
            return
        if not caps.additive:
            raise ValueError(f'encoding {pe.name!r} does not map coordinates to features (it acts on '
                             f'{", ".join(sorted(caps.hooks))}); use a coordinate or additive encoding, e.g. '
                             f'nerf_freq, fourier_gaussian, fourier_learnable')
        self.pe = pe
        self.out_dim = pe.out_dim

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        return coords if self.pe is None else self.pe.encode(coords)


def coordinate_encoder(spec: vispe.registry.PESpec, input_dim: int, encoding_dim: int = 128) -> CoordinateEncoder:
    """A vispe encoding as a coordinate map (``out_dim`` attribute); ``encoding_dim`` is the width of
    encodings whose output width is a free choice (``fourier_learnable``)."""
    return CoordinateEncoder(spec, input_dim, encoding_dim)


# ----------------------------------------------------------------------------------------- rendering
def volume_render(density: torch.Tensor, colour: torch.Tensor, z_vals: torch.Tensor, rays_d: torch.Tensor,
                  white_background: bool = False) -> Dict[str, torch.Tensor]:
    """NeRF's alpha compositing (``raw2outputs``) of samples along rays.

    ``delta_i = (z_{i+1} - z_i) |d|`` (the last interval 1e10: the ray ends in the last sample),
    ``alpha_i = 1 - exp(-sigma_i delta_i)``, transmittance ``T_i = prod_{j<i} (1 - alpha_j + 1e-10)``,
    weights ``w_i = T_i alpha_i``; ``rgb = sum w_i c_i`` (+ ``1 - sum w_i`` on a white background).

    Args:
        density: ``(R, S)`` non-negative densities sigma.
        colour: ``(R, S, 3)`` colours.
        z_vals: ``(R, S)`` sorted sample depths (ray parameters).
        rays_d: ``(R, 3)`` ray directions (their norm converts parameter to distance).
        white_background: composite the remaining transmittance on white.

    Returns ``rgb`` ``(R, 3)``, ``depth``, ``acc`` ``(R,)``, ``weights`` and ``transmittance`` ``(R, S)``.
    """
    dists = z_vals[..., 1:] - z_vals[..., :-1]
    dists = torch.cat([dists, torch.full_like(dists[..., :1], 1e10)], -1) * rays_d.norm(dim=-1, keepdim=True)
    alpha = 1.0 - torch.exp(-density * dists)
    trans = torch.cumprod(torch.cat([torch.ones_like(alpha[..., :1]), 1.0 - alpha + 1e-10], -1), -1)[..., :-1]
    weights = alpha * trans
    rgb = (weights[..., None] * colour).sum(-2)
    acc = weights.sum(-1)
    if white_background:
        rgb = rgb + (1.0 - acc[..., None])
    return {'rgb': rgb, 'depth': (weights * z_vals).sum(-1), 'acc': acc, 'weights': weights, 'transmittance': trans}


def sample_pdf(bins: torch.Tensor, weights: torch.Tensor, num_samples: int, deterministic: bool = False
               ) -> torch.Tensor:
    """NeRF's hierarchical sampling: ``num_samples`` depths from the piecewise-constant PDF ``weights``
    over the intervals ``bins`` (``(R, S + 1)`` edges, ``(R, S)`` weights), by inverting the CDF at
    uniform (``deterministic``: evenly spaced in [0, 1]) values. A 1e-5 floor keeps empty rays valid."""
    weights = weights + 1e-5
    pdf = weights / weights.sum(-1, keepdim=True)
    cdf = torch.cumsum(pdf, -1)
    cdf = torch.cat([torch.zeros_like(cdf[..., :1]), cdf], -1)
    shape = (*cdf.shape[:-1], num_samples)
    if deterministic:
        u = torch.linspace(0.0, 1.0, num_samples, device=cdf.device, dtype=cdf.dtype).expand(shape)
    else:
        u = torch.rand(shape, device=cdf.device, dtype=cdf.dtype)
    u = u.contiguous()
    inds = torch.searchsorted(cdf, u, right=True)
    below = (inds - 1).clamp_min(0)
    above = inds.clamp_max(cdf.shape[-1] - 1)
    cdf_lo, cdf_hi = cdf.gather(-1, below), cdf.gather(-1, above)
    bin_lo, bin_hi = bins.gather(-1, below), bins.gather(-1, above)
    denom = cdf_hi - cdf_lo
    denom = torch.where(denom < 1e-5, torch.ones_like(denom), denom)
    return bin_lo + (u - cdf_lo) / denom * (bin_hi - bin_lo)


# ----------------------------------------------------------------------------------------- NeRF
class NeRFField(nn.Module):
    """NeRF's MLP (nerf-pytorch names): encoded position -> density and feature; + encoded view
    direction -> colour. Returns raw (pre-activation) ``rgb`` ``(..., 3)`` and ``sigma`` ``(...)``."""

    def __init__(self, pos_dim: int, dir_dim: int, depth: int = 8, width: int = 256, skips: Sequence[int] = (4,),
                 use_viewdirs: bool = True) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f'depth must be >= 1, got {depth}')
        self.skips = tuple(skips)
        self.use_viewdirs = use_viewdirs
        self.pts_linears = nn.ModuleList(
            [nn.Linear(pos_dim, width)]
            + [nn.Linear(width + pos_dim if i in self.skips else width, width) for i in range(depth - 1)])
        if use_viewdirs:
            self.feature_linear = nn.Linear(width, width)
            self.alpha_linear = nn.Linear(width, 1)
            self.views_linears = nn.ModuleList([nn.Linear(dir_dim + width, width // 2)])
            self.rgb_linear = nn.Linear(width // 2, 3)
        else:
            self.output_linear = nn.Linear(width, 4)

    def forward(self, pos_feats: torch.Tensor, dir_feats: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        h = pos_feats
        for i, layer in enumerate(self.pts_linears):
            h = F.relu(layer(h))
            if i in self.skips:
                h = torch.cat([pos_feats, h], -1)
        if not self.use_viewdirs:
            out = self.output_linear(h)
            return out[..., :3], out[..., 3]
        sigma = self.alpha_linear(h)[..., 0]
        h = torch.cat([self.feature_linear(h), dir_feats], -1)
        for layer in self.views_linears:
            h = F.relu(layer(h))
        return self.rgb_linear(h), sigma


class NeRF(nn.Module):
    """NeRF with vispe coordinate encodings on 3D positions and view directions.

    Forward takes rays and returns the coarse and (with ``num_fine > 0``) fine renderings:
    ``rgb`` / ``depth`` / ``acc`` (the fine ones when there is a fine network) and ``rgb_coarse``.
    Sampling is stratified (jittered) and the density noisy (``raw_noise_std``) in training only.

    Args:
        pos_encoding: vispe spec for positions (NeRF: ``'nerf_freq:levels=10'``).
        dir_encoding: vispe spec for unit view directions (NeRF: ``'nerf_freq:levels=4'``).
        depth: MLP layers (8).
        width: MLP width (256).
        skips: layers after which the encoded position is concatenated again ((4,)).
        use_viewdirs: colour depends on the view direction.
        num_coarse: stratified samples per ray (64).
        num_fine: extra importance samples per ray for the fine network (128; 0: coarse only).
        perturb: jitter the stratified samples in training.
        raw_noise_std: Gaussian noise on the raw density in training (0 for Blender scenes).
        white_background: composite on white (Blender scenes).
        encoding_dim: output width of encodings whose width is a choice (``fourier_learnable``).
        chunk: evaluate the MLP on at most this many points at a time (memory bound at render time).
    """

    def __init__(
            self,
            pos_encoding: vispe.registry.PESpec = 'nerf_freq:levels=10',
            dir_encoding: vispe.registry.PESpec = 'nerf_freq:levels=4',
            depth: int = 8,
            width: int = 256,
            skips: Sequence[int] = (4,),
            use_viewdirs: bool = True,
            num_coarse: int = 64,
            num_fine: int = 128,
            perturb: bool = True,
            raw_noise_std: float = 0.0,
            white_background: bool = True,
            encoding_dim: int = 128,
            chunk: int = 1 << 16,
    ) -> None:
        super().__init__()
        if num_coarse < 2:
            raise ValueError(f'num_coarse must be >= 2, got {num_coarse}')
        if num_fine < 0:
            raise ValueError(f'num_fine must be >= 0, got {num_fine}')
        self.pos_encoder = coordinate_encoder(pos_encoding, 3, encoding_dim)
        self.dir_encoder = coordinate_encoder(dir_encoding, 3, encoding_dim) if use_viewdirs else None
        dir_dim = self.dir_encoder.out_dim if use_viewdirs else 0
        self.coarse = NeRFField(self.pos_encoder.out_dim, dir_dim, depth, width, skips, use_viewdirs)
        self.fine = NeRFField(self.pos_encoder.out_dim, dir_dim, depth, width, skips, use_viewdirs) \
            if num_fine > 0 else None
        self.num_coarse = num_coarse
        self.num_fine = num_fine
        self.perturb = perturb
        self.raw_noise_std = raw_noise_std
        self.white_background = white_background
        self.chunk = chunk

    def query(self, field: NeRFField, points: torch.Tensor, viewdirs: torch.Tensor
              ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Raw colour and density of ``(R, S, 3)`` points seen along ``(R, 3)`` unit directions."""
        dirs = viewdirs[:, None, :].expand_as(points)
        flat_p, flat_d = points.reshape(-1, 3), dirs.reshape(-1, 3)
        rgbs, sigmas = [], []
        for start in range(0, max(flat_p.shape[0], 1), self.chunk):  # no points: one empty chunk
            p, d = flat_p[start:start + self.chunk], flat_d[start:start + self.chunk]
            rgb, sigma = field(self.pos_encoder(p), self.dir_encoder(d) if self.dir_encoder is not None else None)
            rgbs.append(rgb)
            sigmas.append(sigma)
        return torch.cat(rgbs).reshape(*points.shape[:-1], 3), torch.cat(sigmas).reshape(points.shape[:-1])

    def _render(self, field: NeRFField, rays_o: torch.Tensor, rays_d: torch.Tensor, viewdirs: torch.Tensor,
                z_vals: torch.Tensor) -> Dict[str, torch.Tensor]:
        points = rays_o[:, None, :] + rays_d[:, None, :] * z_vals[..., None]
        raw_rgb, raw_sigma = self.query(field, points, viewdirs)
        if self.training and self.raw_noise_std > 0:
            raw_sigma = raw_sigma + torch.randn_like(raw_sigma) * self.raw_noise_std
        # compositing in float32: transmittance is a long product
        return volume_render(F.relu(raw_sigma.float()), torch.sigmoid(raw_rgb.float()), z_vals.float(),
                             rays_d.float(), self.white_background)

    def forward(self, rays_o: torch.Tensor, rays_d: torch.Tensor, near: float = 2.0, far: float = 6.0
                ) -> Dict[str, torch.Tensor]:
        """Render rays ``(..., 3)`` between ``near`` and ``far``: any leading dims (``(R, 3)``, an image's
        ``(H, W, 3)``, a batch ``(B, R, 3)``, none at all), which the outputs keep (``rgb`` ``(..., 3)``,
        ``depth`` / ``acc`` ``(...)``); no rays give empty outputs."""
        if not (torch.is_tensor(rays_o) and torch.is_tensor(rays_d)) or rays_o.shape != rays_d.shape \
                or rays_o.dim() == 0 or rays_o.shape[-1] != 3:
            shapes = [tuple(r.shape) if torch.is_tensor(r) else type(r).__name__ for r in (rays_o, rays_d)]
            raise ValueError(f'rays_o and rays_d must be tensors of one shape (..., 3) (origins and directions), '
                             f'got {shapes[0]} and {shapes[1]}')
        lead = rays_o.shape[:-1]
        out = self._forward(rays_o.reshape(-1, 3), rays_d.reshape(-1, 3), near, far)
        return {k: v.reshape(lead + v.shape[1:]) for k, v in out.items()}

    def _forward(self, rays_o: torch.Tensor, rays_d: torch.Tensor, near: float, far: float
                 ) -> Dict[str, torch.Tensor]:
        viewdirs = F.normalize(rays_d, dim=-1)
        t = torch.linspace(0.0, 1.0, self.num_coarse, device=rays_o.device, dtype=rays_o.dtype)
        z_vals = (near * (1.0 - t) + far * t).expand(rays_o.shape[0], -1)
        jitter = self.training and self.perturb
        if jitter:
            mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
            upper = torch.cat([mids, z_vals[..., -1:]], -1)
            lower = torch.cat([z_vals[..., :1], mids], -1)
            z_vals = lower + (upper - lower) * torch.rand_like(z_vals)
        coarse = self._render(self.coarse, rays_o, rays_d, viewdirs, z_vals)
        out = {'rgb_coarse': coarse['rgb'], 'rgb': coarse['rgb'], 'depth': coarse['depth'], 'acc': coarse['acc']}
        if self.fine is None:
            return out
        mids = 0.5 * (z_vals[..., 1:] + z_vals[..., :-1])
        z_fine = sample_pdf(mids, coarse['weights'][..., 1:-1], self.num_fine, deterministic=not jitter).detach()
        z_all, _ = torch.sort(torch.cat([z_vals, z_fine], -1), -1)
        fine = self._render(self.fine, rays_o, rays_d, viewdirs, z_all)
        out.update(rgb=fine['rgb'], depth=fine['depth'], acc=fine['acc'])
        return out

    @torch.no_grad()
    def render_image(self, height: int, width: int, focal: float, c2w: torch.Tensor, near: float = 2.0,
                     far: float = 6.0, batch_rays: int = 4096, pixel_offset: float = 0.0) -> torch.Tensor:
        """Render a full ``(H, W, 3)`` image from a camera-to-world pose (OpenGL axes, see `models.nerf_data`)."""
        rays_o, rays_d = get_rays(height, width, focal, c2w, pixel_offset)
        rays_o, rays_d = rays_o.reshape(-1, 3), rays_d.reshape(-1, 3)
        out = [self(rays_o[i:i + batch_rays], rays_d[i:i + batch_rays], near, far)['rgb']
               for i in range(0, rays_o.shape[0], batch_rays)]
        return torch.cat(out).reshape(height, width, 3)


# ----------------------------------------------------------------------------------------- 2D image fitting
class CoordinateMLP(nn.Module):
    """Tancik et al. (2020)'s coordinate network for 2D image regression.

    ``encoding`` maps ``(..., in_dim)`` coordinates in ``[0, 1)`` to features; then ``depth`` linear
    layers of ``width`` with ReLU between them and a sigmoid output (the paper: 4 layers of 256,
    Gaussian Fourier features with m = 256, sigma = 10).

    Args:
        encoding: vispe spec (``'none'`` for raw coordinates).
        in_dim: coordinate axes (2 for images).
        out_dim: output channels (3 for RGB).
        depth: linear layers including the output layer (4).
        width: hidden width (256).
        encoding_dim: output width of encodings whose width is a choice (``fourier_learnable``).
    """

    def __init__(self, encoding: vispe.registry.PESpec = 'fourier_gaussian:scale=10', in_dim: int = 2,
                 out_dim: int = 3, depth: int = 4, width: int = 256, encoding_dim: int = 256) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f'depth must be >= 1, got {depth}')
        self.encoder = coordinate_encoder(encoding, in_dim, encoding_dim)
        dims = [self.encoder.out_dim] + [width] * (depth - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        h = self.encoder(coords)
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i < len(self.layers) - 1:
                h = F.relu(h)
        return torch.sigmoid(h)


def psnr(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of images in ``[0, 1]``: ``-10 log10(MSE)``."""
    mse = F.mse_loss(pred.float(), target.float()).item()
    return math.inf if mse == 0 else -10.0 * math.log10(mse)


def image_coordinates(height: int, width: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """``(H, W, 2)`` pixel coordinates ``(i / H, j / W)`` in ``[0, 1)`` (Tancik et al.'s convention)."""
    ys = torch.arange(height, dtype=torch.float32, device=device) / height
    xs = torch.arange(width, dtype=torch.float32, device=device) / width
    return torch.stack(torch.meshgrid(ys, xs, indexing='ij'), -1)


def fit_image(model: CoordinateMLP, image: torch.Tensor, steps: int = 2000, lr: float = 1e-3,
              train_stride: int = 1, eval_every: int = 0) -> List[Dict[str, float]]:
    """Fit ``model`` to an ``(H, W, C)`` image with Adam on the MSE (full batch), as Tancik et al.

    ``train_stride=2`` trains on every other pixel and reports the held-out PSNR on all pixels too
    (the paper's generalisation protocol). Returns ``{'step', 'train_psnr', 'test_psnr'}`` records at
    step 0, every ``eval_every`` steps (0: only at the end) and after the last step.
    """
    if steps < 0 or train_stride < 1:
        raise ValueError(f'steps must be >= 0 and train_stride >= 1, got {steps}, {train_stride}')
    device = next(model.parameters()).device
    image = image.to(device)
    coords = image_coordinates(image.shape[0], image.shape[1], device)
    train_x, train_y = coords[::train_stride, ::train_stride], image[::train_stride, ::train_stride]
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def record(step: int) -> Dict[str, float]:
        with torch.no_grad():
            full = model(coords)
        stride_view = full[::train_stride, ::train_stride]
        return {'step': step, 'train_psnr': psnr(stride_view, train_y), 'test_psnr': psnr(full, image)}

    history = [record(0)]
    for step in range(1, steps + 1):
        loss = F.mse_loss(model(train_x), train_y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (eval_every and step % eval_every == 0) or step == steps:
            history.append(record(step))
    return history
