"""Tiny diffusers transformers (built from configs, nothing downloaded) and one forward of each on fixed
inputs, shared by the diffusion-transformer tests and the benchmark."""
from __future__ import annotations

from typing import Callable, Dict, Sequence, Tuple

import torch
from torch import nn

HOSTS = ('flux', 'sd3', 'qwenimage', 'wan', 'hunyuan_video', 'ltx_video')
NATIVE = {'flux': (4, 4), 'sd3': (4, 4), 'qwenimage': (4, 4), 'wan': (2, 4, 4), 'hunyuan_video': (2, 4, 4),
          'ltx_video': (2, 4, 4)}
TEXT = 3


def build(kind: str, seed: int = 0) -> nn.Module:
    from diffusers import FluxTransformer2DModel, HunyuanVideoTransformer3DModel, LTXVideoTransformer3DModel, \
        QwenImageTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel
    torch.manual_seed(seed)
    if kind == 'flux':
        model = FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                       attention_head_dim=16, num_attention_heads=2, joint_attention_dim=8,
                                       pooled_projection_dim=8, axes_dims_rope=(4, 6, 6))
    elif kind == 'sd3':  # a 4 x 4 token native grid (sample_size 8, patch 2) and a table of 16 (4x)
        model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                                      num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16,
                                      pooled_projection_dim=8, out_channels=4, pos_embed_max_size=16,
                                      dual_attention_layers=(0,))
    elif kind == 'qwenimage':
        model = QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=16,
                                            axes_dims_rope=(4, 6, 6))
    elif kind == 'wan':
        model = WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                      in_channels=4, out_channels=4, text_dim=8, freq_dim=8, ffn_dim=16, num_layers=2,
                                      rope_max_seq_len=32)
    elif kind == 'hunyuan_video':
        model = HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2,
                                               attention_head_dim=12, num_layers=1, num_single_layers=1,
                                               num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=8,
                                               pooled_projection_dim=8, rope_axes_dim=(4, 4, 4))
    elif kind == 'ltx_video':  # inner width 32: 5 frequencies per axis, 2 channels unrotated
        model = LTXVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
                                           cross_attention_dim=32, num_layers=2, caption_channels=8)
    else:
        raise ValueError(kind)
    return model.eval()


def flux_ids(h: int, w: int) -> torch.Tensor:
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None]
    return ids.reshape(-1, 3)


def inputs(kind: str, grid: Sequence[int], text: int = TEXT, batch: int = 1, timestep: float = 0.5,
           seed: int = 1, **extra) -> Dict[str, object]:
    """Keyword arguments of one forward at a token ``grid`` (video: ``(t, h, w)``), ``timestep`` the noise
    level in [0, 1]."""
    g = torch.Generator().manual_seed(seed)
    if kind == 'flux':
        h, w = grid
        kw = dict(hidden_states=torch.randn(batch, h * w, 4, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 8, generator=g),
                  pooled_projections=torch.randn(batch, 8, generator=g), timestep=torch.full((batch,), timestep),
                  img_ids=flux_ids(h, w), txt_ids=torch.zeros(text, 3))
    elif kind == 'sd3':
        h, w = grid
        kw = dict(hidden_states=torch.randn(batch, 4, 2 * h, 2 * w, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 8, generator=g),
                  pooled_projections=torch.randn(batch, 8, generator=g), timestep=torch.full((batch,), 1000 * timestep))
    elif kind == 'qwenimage':
        h, w = grid
        kw = dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                  encoder_hidden_states_mask=torch.ones(batch, text, dtype=torch.bool),
                  timestep=torch.full((batch,), timestep), img_shapes=[[(1, h, w)]] * batch)
    elif kind == 'wan':
        t, h, w = grid
        kw = dict(hidden_states=torch.randn(batch, 4, t, 2 * h, 2 * w, generator=g),
                  timestep=torch.full((batch,), 1000 * timestep),
                  encoder_hidden_states=torch.randn(batch, text, 8, generator=g))
    elif kind == 'hunyuan_video':
        t, h, w = grid
        mask = torch.ones(batch, text)
        mask[:, -1] = 0  # the last text token is padding
        kw = dict(hidden_states=torch.randn(batch, 4, t, 2 * h, 2 * w, generator=g),
                  timestep=torch.full((batch,), 1000 * timestep),
                  encoder_hidden_states=torch.randn(batch, text, 8, generator=g), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(batch, 8, generator=g), guidance=torch.full((batch,), 3.0))
    elif kind == 'ltx_video':
        t, h, w = grid
        kw = dict(hidden_states=torch.randn(batch, t * h * w, 4, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 8, generator=g),
                  timestep=torch.full((batch,), 1000 * timestep), encoder_attention_mask=torch.ones(batch, text),
                  num_frames=t, height=h, width=w, rope_interpolation_scale=(8 / 25, 32, 32))
    else:
        raise ValueError(kind)
    kw.update(extra)
    return kw


def target_of(kind: str, kw: Dict[str, object]) -> Tuple[torch.Tensor, torch.Tensor]:
    """A flow-matching pair for the latents of ``kw``: (noisy input at the forward's noise level, velocity
    target ``noise - x0``), x0 and noise drawn from fixed generators."""
    x0 = kw['hidden_states']
    g = torch.Generator().manual_seed(2)
    noise = torch.randn(x0.shape, generator=g)
    t = kw['timestep'].float() / (1000.0 if kind in ('sd3', 'wan', 'hunyuan_video', 'ltx_video') else 1.0)
    shape = (-1,) + (1,) * (x0.dim() - 1)
    return (1 - t.view(shape)) * x0 + t.view(shape) * noise, noise - x0


def forward(model: nn.Module, kw: Dict[str, object]) -> torch.Tensor:
    return model(**kw).sample


def runner(kind: str, grid: Sequence[int], **extra) -> Callable[[nn.Module], torch.Tensor]:
    kw = inputs(kind, grid, **extra)

    def run(model: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            return forward(model, kw)
    return run


def scaled(kind: str, factor: int, frames: int = 1) -> Tuple[int, ...]:
    """The native grid with height and width times ``factor`` (video: frames times ``frames``)."""
    native = NATIVE[kind]
    if len(native) == 3:
        return (native[0] * frames, native[1] * factor, native[2] * factor)
    return (native[0] * factor, native[1] * factor)
