"""`patch_dit`: one diffusers diffusion transformer instance with vispe's positions."""
from __future__ import annotations

import functools
import numbers
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from ...contract import PositionalEncoding
from ...extras import SUPPORTED, require
from ...registry import PESpec, create_pe
from ..base import ModelPatch, UnsupportedModelError, refuse_patched
from .flux import REFERENCE_LAYOUTS, FluxHost
from .host import Host
from .hunyuan_video import HunyuanVideoHost
from .ltx_video import LTXVideoHost
from .qwenimage import TEXT_LAYOUTS, QwenImageHost
from .scaling import DiTScaling, Schedule, ScalingSpec, noise_level, tokens_of
from .sd3 import SD3Host
from .state import TimestepSlot, argument, prepare_state, with_argument
from .wan import WanHost

__all__ = ['patch_dit', 'DiTPatch', 'HOSTS', 'SUPPORTED_DIFFUSERS']

SUPPORTED_DIFFUSERS = SUPPORTED['diffusers']
HOSTS: Dict[str, Host] = {name: host for host in (FluxHost(), SD3Host(), QwenImageHost(), WanHost(),
                                                   HunyuanVideoHost(), LTXVideoHost()) for name in host.classes}
"""The diffusers transformer classes `patch_dit` takes, by class name."""


class DiTPatch(ModelPatch):
    """What `patch_dit` did to one transformer instance; ``remove()`` (or leaving a ``with`` block) undoes it.

    Attributes:
        host: the host description (``host.label``: ``'FLUX'``, ``'SD3'``, ...).
        encoding: the vispe encoding, or None (the host's own, computed by vispe).
        scaling: the frequency scaling of the host's own rotary (`DiTScaling`).
        train_grid: the training token grid of the scaled axes.
        rope: the module now in the host's position-module slot (None where the host has none).
        replaced: ``(owner, attribute)`` of everything replaced or hooked.
    """
    adapter = 'patch_dit'

    def __init__(self, model: nn.Module, host: Host, encoding: Optional[PositionalEncoding], scaling: DiTScaling,
                 train_grid: Tuple[int, ...], options: Dict[str, Any]) -> None:
        super().__init__(model)
        self.host, self.encoding, self.scaling, self.train_grid = host, encoding, scaling, train_grid
        self.options = options
        self.rope: Optional[TimestepSlot] = None

    # ------------------------------------------------------------------ per-forward hooks
    def _begin(self, index: int, module: nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        """The transformer's forward pre-hook: the noise level of this forward, for the scaling schedule."""
        self.rope.begin(noise_level(argument(args, kwargs, 'timestep', index), self.host.timestep_scale))

    def _end(self, module: nn.Module, args: Tuple[Any, ...], output: Any) -> None:
        """The transformer's forward hook (also on error): nothing of this forward stays."""
        self.rope.end()

    def _embed(self, hidden: Tuple[str, int], state: Tuple[str, int], module: nn.Module, args: Tuple[Any, ...],
               kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The first block's forward pre-hook: the encoding's embedding added to the image tokens."""
        st = argument(args, kwargs, *state)
        x = argument(args, kwargs, *hidden)
        return with_argument(args, kwargs, *hidden, x + st.embedding.to(x.dtype))

    def add_embedding_hook(self, block: nn.Module, hidden_name: str, hidden_index: int, state_name: str,
                           state_index: int) -> None:
        """Add the encoding's embedding to the image tokens ``hidden_name`` entering ``block``, read from the
        `DiTState` the block is handed as ``state_name`` (keyword, or positional at the given indices)."""
        self.add_hook(block, functools.partial(self._embed, (hidden_name, hidden_index), (state_name, state_index)),
                      'forward_pre', with_kwargs=True, label='first block')

    def _install(self) -> None:
        self.host.install(self)
        if self.scaling.schedule is not None and self.rope is not None:
            index = Host.timestep_index(self.model)
            self.add_hook(self.model, functools.partial(self._begin, index), 'forward_pre', with_kwargs=True)
            self.add_hook(self.model, self._end, always_call=True)
        self.activate()

    def __repr__(self) -> str:
        what = self.encoding.name if self.encoding is not None else f'own ({self.scaling.describe()})'
        return f'DiTPatch({self.host.label}, {what}, active={self._active}, replaced={len(self.replaced)})'


def _host(transformer: nn.Module) -> Host:
    name = type(transformer).__name__
    host = HOSTS.get(name)
    module = type(transformer).__module__
    if host is None or not module.startswith('diffusers.'):
        raise UnsupportedModelError(f'patch_dit supports the diffusers classes {", ".join(HOSTS)}; got {name} '
                                    f'(from {module})')
    return host


def _check_grid(value: Any, axes: Sequence[str], name: str) -> Tuple[int, ...]:
    if not isinstance(value, (tuple, list)) or len(value) != len(axes) or not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in value):
        raise ValueError(f'{name} must be {len(axes)} positive integers (axes {axes}), got {value!r}')
    return tuple(int(v) for v in value)


def patch_dit(transformer: nn.Module, pe: Optional[PESpec] = None, *, scaling: ScalingSpec = 'none',
              target: Optional[Sequence[int]] = None, train_grid: Optional[Sequence[int]] = None,
              schedule: Optional[Schedule] = None, yarn_beta_fast: float = 32.0, yarn_beta_slow: float = 1.0,
              riflex_repetition: Optional[float] = None, reference_layout: Optional[str] = None,
              text_layout: str = 'continue', **options: Any) -> DiTPatch:
    """Give one diffusers diffusion transformer instance vispe's positions; returns the `DiTPatch`.

    Args:
        transformer: a diffusers ``FluxTransformer2DModel``, ``SD3Transformer2DModel``,
            ``QwenImageTransformer2DModel``, ``WanTransformer3DModel``, ``HunyuanVideoTransformer3DModel`` or
            ``LTXVideoTransformer3DModel`` (e.g. ``pipe.transformer``).
        pe: None: the host's own encoding, computed by vispe (the axial rotary of FLUX, QwenImage, Wan,
            HunyuanVideo and LTX-Video, SD3's sin-cos table), equal to the unpatched transformer and open to
            ``scaling``; or any vispe rotary / additive encoding spec (``'rope_axial'``, ``'liere'``,
            ``'sincos'``, ...), to fine-tune.
        scaling: frequency scaling of the host's own encoding for larger grids (longer videos):
            ``'linear'``, ``'ntk'``, ``'yarn'``, ``'riflex'`` for every scaled axis, or ``{axis: method or
            options}`` (axes ``'h'``, ``'w'``; ``'t'`` for video).
        target: a fixed output size to scale for, in pixels ``(height, width)`` (video: ``(frames, height,
            width)``); default: each forward's own grid against ``train_grid``.
        train_grid: the training token grid of the scaled axes (default: the released model's native one).
        schedule: ``schedule(t, axis) -> method | options | None``: the scaling of each axis at noise level
            ``t`` in [0, 1] (1 = pure noise), called once per forward and axis.
        yarn_beta_fast, yarn_beta_slow, riflex_repetition: options of the methods, for every axis.
        reference_layout: FLUX: re-lay reference-image tokens (image index > 0) ``'index'`` or ``'offset'``.
        text_layout: QwenImage: ``'continue'`` (text positions past the host's 4,096-row table follow its
            formula) or ``'table'`` (refuse text beyond the table, which the host shrinks silently).
        options: options of the vispe encoding (override the spec's).

    Raises:
        vispe.integrations.UnsupportedModelError: an unsupported transformer class (a TypeError).
        vispe.extras.UnsupportedVersionError: an unsupported diffusers version (an ImportError).
        vispe.integrations.AlreadyPatchedError: the transformer or a module in its tree is already patched.
        ValueError: options the host or the method cannot take (the message says which and why); nothing is
            patched then.
    """
    require('diffusers', 'patch_dit')
    host = _host(transformer)
    refuse_patched(transformer, 'patch_dit')
    host.check(transformer)
    grid = _check_grid(train_grid, host.axes, 'train_grid') if train_grid is not None else host.train_grid(transformer)
    if reference_layout is not None and (not isinstance(host, FluxHost) or reference_layout not in REFERENCE_LAYOUTS):
        raise ValueError(f'reference_layout is an option of FLUX (Kontext) and one of {REFERENCE_LAYOUTS}; got '
                         f'{reference_layout!r} for {host.label}')
    if text_layout not in TEXT_LAYOUTS:
        raise ValueError(f'text_layout must be one of {TEXT_LAYOUTS}, got {text_layout!r}')
    if text_layout != 'continue' and not isinstance(host, QwenImageHost):
        raise ValueError(f'text_layout is an option of QwenImage, whose text positions follow its image; {host.label} '
                         f'has none')
    tokens = tokens_of(target, host.pixels(transformer), 'frames, height, width' if host.video else 'height, width')
    plan = DiTScaling(host.axes, grid, scaling, tokens, schedule, yarn_beta_fast=yarn_beta_fast,
                      yarn_beta_slow=yarn_beta_slow, riflex_repetition=riflex_repetition)
    encoding = None
    if pe is not None:
        if plan.active or target is not None:
            raise ValueError("scaling, target and schedule scale the host's own rotary (pe=None); a vispe encoding "
                             "takes its own options, e.g. pe='rope_axial:scaling=yarn'")
        encoding = _encoding(transformer, host, pe, grid, options)
    elif options:
        raise ValueError(f'patch_dit got unknown options {sorted(options)}; encoding options need pe=<spec>')
    handle = DiTPatch(transformer, host, encoding, plan, grid,
                      {'reference_layout': reference_layout, 'text_layout': text_layout})
    try:
        handle._install()
    except BaseException:
        handle._active = True  # undo what was installed before the error: nothing patched half-way
        handle.remove()
        raise
    return handle


def _encoding(transformer: nn.Module, host: Host, pe: PESpec, grid: Tuple[int, ...], options: Dict[str, Any]
              ) -> PositionalEncoding:
    ctx = host.context(transformer, grid)
    caps = create_pe(pe, ctx, device='meta', **options).capabilities
    if caps.requires:
        raise ValueError(f'encoding {pe!r} reads {sorted(caps.requires)} from its positions, which a diffusion '
                         f'transformer\'s latent grid does not have')
    if caps.between_blocks:
        raise ValueError(f'encoding {pe!r} acts between blocks, which the {host.label} blocks (several token streams '
                         f'per block) do not expose; rotary, bias and additive encodings apply')
    if caps.needs_weights:
        raise ValueError(f'encoding {pe!r} needs the attention weights; {host.label}\'s attention runs fused kernels')
    device = next(iter(transformer.parameters())).device
    encoding = create_pe(pe, ctx, device=device, **options)
    encoding.train(transformer.training)
    try:  # a small grid after two text tokens: what every forward asks of the encoding, refused now if it cannot
        with torch.no_grad():
            prepare_state(encoding, (1, 2, 2) if host.video else (2, 2), 2 if host.joint_text else 0, grid, device)
    except (ValueError, NotImplementedError) as e:
        text = 'text tokens first, then ' if host.joint_text else ''
        raise ValueError(f'encoding {pe!r} cannot position {host.label}\'s tokens ({text}a {len(grid)}D latent grid '
                         f'whose size changes with the output): {e}') from None
    encoding.clear_cache()
    return encoding
