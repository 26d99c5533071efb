"""The PE host: the one path by which a timm ViT-family model takes a vispe encoding.

`install_pe` makes a built timm ``VisionTransformer`` / ``Eva`` (already of its host class) use an
encoding: it builds the encoding for the model's context, hands it the model's own position
weights, swaps blocks and attention modules to their PE-aware subclasses (`vispe.layers`) and
replaces patch dropout by the one that reports the kept tokens. vispe's own ViTs (`vispe.vit`) and
every converted zoo model (`vispe.convert`) go through it.

`PEHost` is the forward they share: positions built per forward from the token grid, the encoding
prepared once (`PreparedPE`), ``embed`` once, every block given the prepared encoding,
``between_blocks`` after each block; for an image tensor and for a native-resolution (NaFlex) batch,
with timm's `forward_features`, `forward_intermediates` and pooling, and timm's contract methods
(``init_weights``, ``no_weight_decay``, ``group_matcher``, ``set_input_size``). The patch embeddings
here are timm's without its size asserts (`PatchEmbed`) and a video tubelet one.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
import torch.nn.functional as F
from timm.layers import AttentionPoolLatent, Format, PatchDropout, PatchDropoutWithIndices, is_scriptable, nchw_to
from timm.layers import PatchEmbed as TimmPatchEmbed
from torch import nn

from . import positions as P
from ._timm import checkpoint, create_attention_mask, feature_take_indices, global_pool_naflex
from .contract import PEContext, PositionalEncoding, PreparedPE
from .layers import ATTENTIONS, BLOCKS, attentions, is_differential
from .naflex import embed_patches, naflex_positions
from .registry import PESpec, create_pe
from .weights import LoadReport, adopt_own_weights

__all__ = ['PEHost', 'install_pe', 'host_context', 'PatchEmbed', 'TubeletEmbed', 'NO_TORCHSCRIPT']

NO_TORCHSCRIPT = ('vispe models do not support TorchScript (the encoding hands positions and per-forward '
                  'state objects to every attention layer); use torch.compile or torch.export instead')


# torch.fx (timm's feature_cls='fx', create_feature_extractor) traces the model with proxies for
# tensors, whose shapes it cannot read. These helpers read shapes and build positions, so they are
# wrapped: fx records each as one opaque call and runs it on real tensors.
@torch.fx.wrap
def _checked_input(x: torch.Tensor, video: bool, patch_size: Tuple[int, int], dynamic_pad: bool,
                   tubelet: int, fixed_size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """``x`` after the checks of its layout and size, timm's rules: a model of fixed input size
    (``fixed_size``, timm's ``strict_img_size``) takes exactly that size (a remainder the patch does
    not divide is cropped by the patch convolution, as in timm); a dynamic-size one any size the patch
    divides (or any size with ``dynamic_img_pad``)."""
    want = 5 if video else 4
    if x.dim() != want:
        layout = '(B, C, T, H, W)' if video else '(B, C, H, W)'
        raise ValueError(f'input must be {layout}, got shape {tuple(x.shape)}')
    ph, pw = patch_size
    h, w = x.shape[-2:]
    if fixed_size is not None:
        if (h, w) != tuple(fixed_size):
            raise ValueError(f'input size {h}x{w} does not match the model\'s fixed input size '
                             f'{fixed_size[0]}x{fixed_size[1]}; build it with dynamic_img_size=True to take any size '
                             f'that the patch size {ph}x{pw} divides')
    elif (h % ph or w % pw) and not dynamic_pad:
        raise ValueError(f'input size {h}x{w} is not divisible by the patch size {ph}x{pw}; '
                         f'use a size that is a multiple of {ph}x{pw} (or build with dynamic_img_pad=True)')
    if video and x.shape[2] % tubelet:
        raise ValueError(f'clip length {x.shape[2]} is not divisible by tubelet={tubelet}')
    return x


@torch.fx.wrap
def _token_sequence(x: torch.Tensor, prefix: Sequence[Optional[torch.Tensor]], num_prefix: int,
                    train_grid: Tuple[int, ...]) -> Tuple[torch.Tensor, P.Positions]:
    """Patch embeddings (channels-last grid ``(B, *grid, C)``, or ``(B, N, C)`` on the training grid)
    as one token sequence with the prefix tokens in front, and the positions of its tokens."""
    if x.dim() > 3:
        grid = tuple(x.shape[1:-1])
        x = x.flatten(1, -2)  # not reshape(B, -1, C): that is ambiguous for an empty batch
    else:
        grid = tuple(train_grid)
    tokens = [t.expand(x.shape[0], -1, -1) for t in prefix if t is not None]
    if tokens:
        x = torch.cat(tokens + [x], dim=1)
    return x, P.grid(*grid, num_prefix=num_prefix, train_grid=train_grid, device=x.device)


@torch.fx.wrap
def _prepared(pe: PositionalEncoding, pos: P.Positions) -> PreparedPE:
    """``pe.prepare(pos)``: an opaque call for fx, since preparing reads positions and builds state;
    the hooks are then method calls on the prepared encoding, which fx records as they are."""
    return pe.prepare(pos)


class PatchEmbed(TimmPatchEmbed):
    """timm's `PatchEmbed` (same parameters and options) without its input-size asserts, which
    format the size into their message and so pin every input size under
    ``torch.compile(dynamic=True)`` (one recompilation per size); the ViT checks the size itself
    (`_checked_input`), with a message that names the patch size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dynamic_img_pad:
            ph, pw = self.patch_size
            x = F.pad(x, (0, -x.shape[-1] % pw, 0, -x.shape[-2] % ph))
        x = self.proj(x)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        elif self.output_fmt != Format.NCHW:
            x = nchw_to(x, self.output_fmt)
        return self.norm(x)


class TubeletEmbed(nn.Module):
    """Video patch embedding: a Conv3d over ``(tubelet, patch, patch)`` cubes (ViViT / VideoMAE).

    Input ``(B, C, T, H, W)``; output ``(B, T', H', W', D)`` (channels last, like timm's dynamic
    `PatchEmbed`), so the host reads the ``(t, h, w)`` grid from the shape.
    """

    def __init__(self, img_size: Tuple[int, int], patch_size: int, num_frames: int, tubelet: int,
                 in_chans: int, embed_dim: int, bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        self.patch_size = (patch_size, patch_size)
        self.tubelet = tubelet
        self.img_size = img_size
        self.grid_size = (num_frames // tubelet, img_size[0] // patch_size, img_size[1] // patch_size)
        self.num_patches = math.prod(self.grid_size)
        self.proj = nn.Conv3d(in_chans, embed_dim, (tubelet, patch_size, patch_size),
                              stride=(tubelet, patch_size, patch_size), bias=bias, device=device, dtype=dtype)

    def feat_ratio(self, as_scalar: bool = True):
        return self.patch_size[0] if as_scalar else self.patch_size

    def dynamic_feat_size(self, img_size: Tuple[int, int]) -> Tuple[int, int]:
        return img_size[0] // self.patch_size[0], img_size[1] // self.patch_size[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).permute(0, 2, 3, 4, 1)


class PEHost:
    """The forward of a timm ViT-family model whose encoding is ``self.pe``: positions built per
    forward from the token grid, the encoding prepared once for them (`PreparedPE`), ``embed`` once,
    each block given the prepared encoding, ``between_blocks`` after each block. Mixed into vispe's
    `VisionTransformer` and the hosts `vispe.convert` makes of timm's ``VisionTransformer`` and
    ``Eva`` (see `install_pe`); it reads timm's attributes (``patch_embed``, ``cls_token``,
    ``reg_token``, ``pos_drop``, ``patch_drop``, ``norm_pre``, ``blocks``, ``norm``).
    """
    video: bool = False

    def __prepare_scriptable__(self) -> 'PEHost':
        raise RuntimeError(NO_TORCHSCRIPT)

    # ------------------------------------------------------------------ timm contract
    def init_weights(self, *args: Any, **kwargs: Any) -> None:
        """timm's `init_weights`, then the encoding's own initialisation (`reset_parameters`), which
        replaces the generic init of any layer inside the encoding."""
        super().init_weights(*args, **kwargs)
        pe = getattr(self, 'pe', None)  # timm's constructor initialises before the encoding exists
        if pe is not None:
            pe.reset_parameters()

    @torch.jit.ignore
    def no_weight_decay(self) -> Set[str]:
        """timm's set without its own position weights, the prefix tokens, and the encoding's."""
        own = {n for n in super().no_weight_decay() if n != 'pos_embed' and not n.startswith('rope.')}
        return own | {'cls_token', 'reg_token'} | {f'pe.{n}' for n in self.pe.no_weight_decay()}

    @torch.jit.ignore
    def group_matcher(self, coarse: bool = False) -> Dict[str, Any]:
        """timm's groups, the encoding's parameters in the stem where ``pos_embed`` was."""
        matcher = dict(super().group_matcher(coarse))
        matcher['stem'] = matcher['stem'].replace('pos_embed', r'pe\.')
        return matcher


    # ------------------------------------------------------------------ forward
    def positions(self, grid: Sequence[int], device: torch.device) -> P.Positions:
        """The positions of a token grid of this model (integer indices, prefix tokens first)."""
        return P.grid(*grid, num_prefix=self.num_prefix_tokens, train_grid=self.patch_embed.grid_size,
                      device=device)

    def _prefix_tokens(self) -> List[Optional[torch.Tensor]]:
        """The learned prefix tokens in their order in the sequence (None: absent)."""
        return [self.cls_token, self.reg_token]

    def _embed_naflex(self, batch: Dict[str, torch.Tensor], attn_mask: Optional[torch.Tensor]
                      ) -> Tuple[torch.Tensor, PreparedPE, torch.Tensor, torch.Tensor]:
        """A NaFlex batch (`vispe.naflex`) as tokens, the encoding prepared for their per-sample
        positions, the attention mask (padded keys masked, prefix tokens always attended, combined with
        ``attn_mask``) and the validity of the patch tokens (gathered through patch dropout)."""
        if self.video:
            raise ValueError('NaFlex batches are images; this model takes video clips')
        missing = [k for k in ('patches', 'patch_coord', 'patch_valid') if k not in batch]
        if missing:
            raise ValueError(f'a NaFlex batch is a dict with patches, patch_coord and patch_valid '
                             f'(vispe.naflex_batch, timm\'s NaFlex loader); missing {missing}')
        valid = batch['patch_valid'].bool()
        pos = naflex_positions(batch['patch_coord'], valid, self.num_prefix_tokens,
                               tuple(self.patch_embed.grid_size))
        x = embed_patches(self.patch_embed, batch['patches'])
        prefix = [t.expand(x.shape[0], -1, -1) for t in self._prefix_tokens() if t is not None]
        if prefix:
            x = torch.cat(prefix + [x], dim=1)
        pe = _prepared(self.pe, pos)
        x = self.pos_drop(pe.embed(x))
        if self.patch_drop is not None:
            x, keep = self.patch_drop(x)
            if keep is not None:  # the kept tokens are a point set indexing their grids; the mask follows them
                valid = valid.gather(1, keep)
                pe = pe.select(keep)
        keys = torch.cat([valid.new_ones(valid.shape[0], self.num_prefix_tokens), valid], 1)[:, None, None, :]
        if attn_mask is None:
            mask = keys
        elif attn_mask.dtype == torch.bool:
            mask = attn_mask & keys
        else:
            mask = torch.where(keys, attn_mask, float('-inf'))
        return self.norm_pre(x), pe, mask, valid

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, PreparedPE]:
        strict = getattr(self.patch_embed, 'strict_img_size', False) and self.patch_embed.img_size is not None
        x = _checked_input(x, self.video, tuple(self.patch_embed.patch_size),
                           getattr(self.patch_embed, 'dynamic_img_pad', False), getattr(self.patch_embed, 'tubelet', 1),
                           tuple(self.patch_embed.img_size) if strict else None)
        x, pos = _token_sequence(self.patch_embed(x), self._prefix_tokens(), self.num_prefix_tokens,
                                 tuple(self.patch_embed.grid_size))
        pe = _prepared(self.pe, pos)
        x = self.pos_drop(pe.embed(x))
        if self.patch_drop is not None:
            x, keep = self.patch_drop(x)
            if keep is not None:
                pe = pe.select(keep)
        return self.norm_pre(x), pe

    def _blocks(self, x: torch.Tensor, pe: PreparedPE, attn_mask: Optional[torch.Tensor], is_causal: bool,
                take: Sequence[int] = (), stop: Optional[int] = None, norm: bool = False):
        taken = []
        blocks = self.blocks if stop is None else self.blocks[:stop + 1]
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, pe, attn_mask, is_causal)
            else:
                x = blk(x, pe=pe, attn_mask=attn_mask, is_causal=is_causal)
            x = pe.between_blocks(x, i)
            if i in take:
                taken.append(self.norm(x) if norm else x)
        return x, taken

    def forward_features(self, x: Union[torch.Tensor, Dict[str, torch.Tensor]],
                         attn_mask: Optional[torch.Tensor] = None,
                         is_causal: bool = False) -> Union[torch.Tensor, Dict[str, torch.Tensor]]:
        """timm's `forward_features`; a NaFlex batch (dict, `vispe.naflex_batch`) gives, as timm's
        NaFlexVit, ``{'patches': tokens (B, prefix + N, C), 'patch_valid': (B, N)}``, which
        `forward_head` pools over the real patches only."""
        if isinstance(x, dict):
            x, pe, mask, valid = self._embed_naflex(x, x.get('attn_mask', attn_mask))
            x, _ = self._blocks(x, pe, mask, is_causal)
            return {'patches': self.norm(x), 'patch_valid': valid}
        x, pe = self._embed(x)
        x, _ = self._blocks(x, pe, attn_mask, is_causal)
        return self.norm(x)

    def _pool_keeps_prefix(self, attn_pool: bool) -> bool:
        """Whether pooling reads the prefix tokens (timm's ViT: ``pool_include_prefix``, for both)."""
        return self.pool_include_prefix

    def pool(self, x: torch.Tensor, pool_type: Optional[str] = None,
             patch_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's `pool`; with ``patch_valid`` ``(B, N)`` (a NaFlex batch) the padded tokens are left
        out: masked mean / max (timm's `global_pool_naflex`), and the MAP head's attention with the
        padded keys masked (timm's `create_attention_mask`)."""
        if patch_valid is None:
            return super().pool(x, pool_type)
        npre = self.num_prefix_tokens
        if self.attn_pool is not None:
            if not isinstance(self.attn_pool, AttentionPoolLatent):
                raise ValueError(f'NaFlex batches need a pooling that can mask padding: '
                                 f'{type(self.attn_pool).__name__} attends over every token; use global_pool '
                                 f"'token', 'avg', 'avgmax', 'max' or 'map'")
            keep = self._pool_keeps_prefix(attn_pool=True)
            mask = create_attention_mask(patch_valid, num_prefix_tokens=npre if keep else 0, symmetric=False,
                                         q_len=1, dtype=x.dtype)
            return self.attn_pool(x if keep else x[:, npre:], attn_mask=mask)
        pool_type = self.global_pool if pool_type is None else pool_type
        return global_pool_naflex(x, patch_valid, pool_type=pool_type, num_prefix_tokens=npre,
                                  reduce_include_prefix=self._pool_keeps_prefix(attn_pool=False))

    def forward_head(self, x: Union[torch.Tensor, Dict[str, torch.Tensor]], pre_logits: bool = False,
                     patch_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """timm's `forward_head`; it also takes `forward_features`' NaFlex output (or ``patch_valid``)
        and pools over the real patches only."""
        if isinstance(x, dict):
            x, patch_valid = x['patches'], x['patch_valid']
        if patch_valid is None:
            return super().forward_head(x, pre_logits)
        x = self.head_drop(self.fc_norm(self.pool(x, patch_valid=patch_valid)))
        return x if pre_logits else self.head(x)

    def forward_intermediates(
            self,
            x: Union[torch.Tensor, Dict[str, torch.Tensor]],
            indices: Optional[Union[int, List[int]]] = None,
            return_prefix_tokens: bool = False,
            norm: bool = False,
            stop_early: bool = False,
            output_fmt: str = 'NCHW',
            intermediates_only: bool = False,
            output_dict: bool = False,
            attn_mask: Optional[torch.Tensor] = None,
            is_causal: bool = False,
    ):
        """timm's `forward_intermediates` (same arguments and outputs). A NaFlex batch (dict) takes
        ``output_fmt='NLC'`` (its samples have different grids), as timm's NaFlexVit, and
        ``output_dict=True`` then adds the ``patch_valid`` of the intermediates' patch tokens."""
        if output_fmt not in ('NCHW', 'NLC'):
            raise ValueError(f"output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        take, max_index = feature_take_indices(len(self.blocks), indices)
        valid = None
        if isinstance(x, dict):
            if output_fmt != 'NLC':
                raise ValueError("output_fmt must be 'NLC' for a NaFlex batch: its samples have different grids "
                                 "(each sample's first h*w patch tokens are its grid in row-major order)")
            x, pe, attn_mask, valid = self._embed_naflex(x, x.get('attn_mask', attn_mask))
        else:
            x, pe = self._embed(x)
        x, inter = self._blocks(x, pe, attn_mask, is_causal, take=take,
                                stop=max_index if stop_early else None, norm=norm)
        npre = self.num_prefix_tokens
        prefix = [y[:, :npre] for y in inter] if npre else None
        inter = [y[:, npre:] for y in inter]
        if output_fmt == 'NCHW':
            grid = pe.pos_q.grid
            if grid is None:
                raise ValueError("output_fmt='NCHW' needs the full token grid (disable patch dropout)")
            inter = [y.unflatten(1, grid).movedim(-1, 1).contiguous() for y in inter]
        if output_dict:
            out: Dict[str, Any] = {'image_intermediates': inter}
            if prefix is not None and return_prefix_tokens:
                out['image_intermediates_prefix'] = prefix
            if valid is not None:
                out['patch_valid'] = valid
            if not intermediates_only:
                out['image_features'] = self.norm(x)
            return out
        if return_prefix_tokens and prefix is not None:
            inter = list(zip(inter, prefix))
        if intermediates_only:
            return inter
        return self.norm(x), inter

    def set_input_size(self, img_size: Optional[Tuple[int, int]] = None,
                       patch_size: Optional[Tuple[int, int]] = None) -> None:
        if self.video:
            raise NotImplementedError('set_input_size is not supported for video models')
        super().set_input_size(img_size=img_size, patch_size=patch_size)
        self.pe.set_grid_size(tuple(self.patch_embed.grid_size))
        self.pe_context = self.pe.ctx


def host_context(model: nn.Module) -> PEContext:
    """The encoding's context in a timm ViT / Eva: width, the heads its q/k maps see (differential
    attention: 2H of width hd), depth, training grid, prefix tokens."""
    first = attentions(model.blocks[0])[0] if len(model.blocks) else None
    num_heads = first.num_heads if first is not None else 1
    if first is not None and is_differential(first):
        num_heads *= 2
    return PEContext(dim=model.embed_dim, num_heads=num_heads,
                     head_dim=first.head_dim if first is not None else model.embed_dim, depth=len(model.blocks),
                     grid_size=tuple(model.patch_embed.grid_size), num_prefix_tokens=model.num_prefix_tokens,
                     embed_prefix=not model.no_embed_class)


def _check_differential(enc: PositionalEncoding, pe: PESpec, label: str) -> None:
    """Refuse an encoding that cannot act on a differential attention's pair of softmax maps."""
    caps = enc.capabilities
    why = [what for what, bad in (
        ('acts on v', 'value' in caps.hooks), ('acts on the attention output', 'output' in caps.hooks),
        ('adds a term from the attention weights', caps.needs_weights), ('widens the head', caps.changes_head_dim),
    ) if bad]
    if why:
        raise ValueError(f'{label}: pe={pe!r} cannot apply to differential attention: the encoding '
                         f'{" and ".join(why)}, while the two softmax maps of a head pair share one value and '
                         'one output; only q/k maps, logit biases and token embeddings apply')


def check_hostable(model: nn.Module, label: str) -> None:
    """Refuse, naming the block and module, a model whose blocks or attention modules `install_pe`
    has no PE-aware subclass for."""
    for i, block in enumerate(model.blocks):
        if type(block) not in BLOCKS:
            raise ValueError(f'{label}: block {i} is a {type(block).__name__}, which vispe cannot host '
                             f'(not a known timm block)')
        for attn in attentions(block):
            if attn is not block and type(attn) not in ATTENTIONS:
                raise ValueError(f'{label}: block {i} has a {type(attn).__name__}, which vispe cannot host '
                                 f'(not a known timm attention)')


def install_pe(model: nn.Module, pe: PESpec, *, label: str, loaded_grid: Optional[Tuple[int, ...]] = None,
               device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None, **options: Any
               ) -> LoadReport:
    """Give a built timm ViT / Eva model (already of its `PEHost` class, its blocks timm's own) the
    encoding ``pe``, in place: the one path of vispe's own ViTs and of `vispe.convert`.

    The encoding is built for the model's context (`host_context`; ``device`` / ``dtype``: timm's
    factory kwargs, default the model's), takes over the model's own position weights
    (`adopt_own_weights`), and replaces ``pos_embed`` (and an Eva's ``rope``); blocks and attention
    modules become their PE-aware subclasses with their layer index; patch dropout becomes the one
    that returns the kept indices. Returns what was dropped, initialised and resampled.

    Raises:
        ValueError: an encoding that cannot apply to this model (one that needs cameras, one that
            acts on v or the output of a differential attention, one acting between blocks with patch
            dropout), naming the model (``label``) and the reason; TorchScript mode (``scriptable``).
    """
    if is_scriptable():
        raise ValueError(f'{label} was built with scriptable=True: {NO_TORCHSCRIPT}')
    check_hostable(model, label)
    ctx = host_context(model)
    if device is None and dtype is None:
        ref = next(iter(model.parameters()), None)
        device, dtype = (ref.device, ref.dtype) if ref is not None else (None, None)
    try:
        enc = create_pe(pe, ctx, device=device, dtype=dtype, **options)
    except ValueError as e:
        raise ValueError(f'{label}: pe={pe!r} cannot apply to this model: {e}') from e
    caps = enc.capabilities
    if caps.requires:
        where = ('a multimodal sequence: language-model code, with vispe.sequence' if 'segments' in caps.requires
                 else 'a camera-aware host')
        raise ValueError(f'{label}: pe={pe!r} needs {sorted(caps.requires)} in its positions, which an image '
                         f'ViT does not supply (use {where})')
    if any(is_differential(a) for b in model.blocks for a in attentions(b)):
        _check_differential(enc, pe, label)
    drop_rate = getattr(model.patch_drop, 'prob', 0.0) if model.patch_drop is not None else 0.0
    if drop_rate > 0 and caps.between_blocks:
        raise ValueError(f'{label}: pe={pe!r} acts between blocks on the full token grid, which patch dropout '
                         f'(patch_drop_rate={drop_rate}) removes')
    entries, report = adopt_own_weights(model, enc, loaded_grid)
    with torch.no_grad():
        _, unexpected = enc.load_state_dict(entries, strict=False)
    if unexpected:
        raise ValueError(f'{label}: the encoding has no entries {unexpected} that it adopted')  # a hook's bug

    for i, block in enumerate(model.blocks):
        block.__class__ = BLOCKS[type(block)]
        for attn in attentions(block):
            if attn is not block:
                attn.__class__ = ATTENTIONS[type(attn)]
            attn.layer_index = i
    if isinstance(model.patch_drop, PatchDropout):  # timm's: one that also returns the kept indices
        model.patch_drop = PatchDropoutWithIndices(model.patch_drop.prob, model.num_prefix_tokens,
                                                   ordered=model.patch_drop.ordered)
    elif not isinstance(model.patch_drop, PatchDropoutWithIndices):
        model.patch_drop = None
    model.pos_embed = None
    if hasattr(model, 'rope'):  # an Eva: the encoding replaces its rope
        model.rope = None
        model.rope_mixed = False
    model.pe = enc
    model.pe_context = ctx
    return report
