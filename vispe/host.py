"""The PE host: the forward every vispe host of the timm ViT family shares.

`PEHost` runs the encoding's hooks around timm's blocks (``embed`` once, one ``prepare`` per
forward, every attention layer through `PEBlock`, ``between_blocks`` after each block), for an
image tensor and for a native-resolution (NaFlex) batch, with timm's `forward_features`,
`forward_intermediates` and pooling. Its hosts: vispe's `VisionTransformer` (`vispe.vit`) and the
models `vispe.convert` (`vispe.zoo`) makes of timm's own ``VisionTransformer`` and ``Eva``. The
patch embeddings here are timm's without its size asserts (`PatchEmbed`) and a video tubelet one.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from timm.layers import AttentionPoolLatent, Format, nchw_to
from timm.layers import PatchEmbed as TimmPatchEmbed
from timm.models._features import feature_take_indices
from timm.models._manipulate import checkpoint
from timm.models.naflexvit import create_attention_mask, global_pool_naflex
from timm.models.vision_transformer import Block
from torch import nn

from . import positions as P
from .encodings.base import PositionalEncoding
from .naflex import embed_patches, naflex_positions

__all__ = ['PEHost', 'PEBlock', 'PatchEmbed', 'TubeletEmbed', 'NO_TORCHSCRIPT']

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
def _pe_hook(pe: PositionalEncoding, hook: str, *args: Any) -> Any:
    """``pe.<hook>(*args)``: encodings read positions and build state, which fx cannot trace."""
    return getattr(pe, hook)(*args)


class PEBlock(Block):
    """timm's pre-norm `Block` whose attention receives the encoding, its per-forward state and the
    positions that state was prepared from (to check them against the tokens)."""

    def forward(self, x: torch.Tensor, pe: Optional[PositionalEncoding] = None, state: Any = None,
                attn_mask: Optional[torch.Tensor] = None, is_causal: bool = False,
                pos: Optional[P.Positions] = None) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), pe=pe, state=state, attn_mask=attn_mask,
                                                   is_causal=is_causal, pos=pos)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


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
    forward from the token grid and handed to every hook (``embed`` once, ``prepare`` once,
    ``between_blocks`` after each block, and through the blocks' attention ``qk`` / ``bias`` /
    ``value`` / ``output``). Mixed into vispe's `VisionTransformer` and into the hosts that
    `vispe.convert` makes of timm's own ``VisionTransformer`` and ``Eva``; it reads timm's attributes
    (``patch_embed``, ``cls_token``, ``reg_token``, ``pos_drop``, ``patch_drop``, ``norm_pre``,
    ``blocks``, ``norm``) and needs blocks that take ``(x, pe=, state=, attn_mask=, is_causal=, pos=)``.
    """
    video: bool = False

    def __prepare_scriptable__(self) -> 'PEHost':
        raise RuntimeError(NO_TORCHSCRIPT)

    def positions(self, grid: Sequence[int], device: torch.device) -> P.Positions:
        """The positions of a token grid of this model (integer indices, prefix tokens first)."""
        return P.grid(*grid, num_prefix=self.num_prefix_tokens, train_grid=self.patch_embed.grid_size,
                      device=device)

    def _prefix_tokens(self) -> List[Optional[torch.Tensor]]:
        """The learned prefix tokens in their order in the sequence (None: absent)."""
        return [self.cls_token, self.reg_token]

    def _embed_naflex(self, batch: Dict[str, torch.Tensor], attn_mask: Optional[torch.Tensor]
                      ) -> Tuple[torch.Tensor, P.Positions, torch.Tensor, torch.Tensor]:
        """A NaFlex batch (`vispe.naflex`) as tokens, their per-sample positions, the attention mask
        (padded keys masked, prefix tokens always attended, combined with ``attn_mask``) and the
        validity of the patch tokens (gathered through patch dropout)."""
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
        x = self.pos_drop(self.pe.embed(x, pos))
        if self.patch_drop is not None:
            x, keep = self.patch_drop(x)
            if keep is not None:  # the kept tokens are a point set indexing their grids; the mask follows them
                valid = valid.gather(1, keep)
                pos = pos.select(keep)
        keys = torch.cat([valid.new_ones(valid.shape[0], self.num_prefix_tokens), valid], 1)[:, None, None, :]
        if attn_mask is None:
            mask = keys
        elif attn_mask.dtype == torch.bool:
            mask = attn_mask & keys
        else:
            mask = torch.where(keys, attn_mask, float('-inf'))
        return self.norm_pre(x), pos, mask, valid

    def _embed(self, x: torch.Tensor) -> Tuple[torch.Tensor, P.Positions]:
        strict = getattr(self.patch_embed, 'strict_img_size', False) and self.patch_embed.img_size is not None
        x = _checked_input(x, self.video, tuple(self.patch_embed.patch_size),
                           getattr(self.patch_embed, 'dynamic_img_pad', False), getattr(self.patch_embed, 'tubelet', 1),
                           tuple(self.patch_embed.img_size) if strict else None)
        x, pos = _token_sequence(self.patch_embed(x), self._prefix_tokens(), self.num_prefix_tokens,
                                 tuple(self.patch_embed.grid_size))
        x = self.pos_drop(_pe_hook(self.pe, 'embed', x, pos))
        if self.patch_drop is not None:
            x, keep = self.patch_drop(x)
            if keep is not None:
                pos = pos.select(keep)
        return self.norm_pre(x), pos

    def _blocks(self, x: torch.Tensor, pos: P.Positions, attn_mask: Optional[torch.Tensor], is_causal: bool,
                take: Sequence[int] = (), stop: Optional[int] = None, norm: bool = False):
        state = _pe_hook(self.pe, 'prepare', pos)
        taken = []
        blocks = self.blocks if stop is None else self.blocks[:stop + 1]
        for i, blk in enumerate(blocks):
            if self.grad_checkpointing and not torch.jit.is_scripting():
                x = checkpoint(blk, x, self.pe, state, attn_mask, is_causal, pos)
            else:
                x = blk(x, pe=self.pe, state=state, attn_mask=attn_mask, is_causal=is_causal, pos=pos)
            x = _pe_hook(self.pe, 'between_blocks', x, pos, i)
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
            x, pos, mask, valid = self._embed_naflex(x, x.get('attn_mask', attn_mask))
            x, _ = self._blocks(x, pos, mask, is_causal)
            return {'patches': self.norm(x), 'patch_valid': valid}
        x, pos = self._embed(x)
        x, _ = self._blocks(x, pos, attn_mask, is_causal)
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
            x, pos, attn_mask, valid = self._embed_naflex(x, x.get('attn_mask', attn_mask))
        else:
            x, pos = self._embed(x)
        x, inter = self._blocks(x, pos, attn_mask, is_causal, take=take,
                                stop=max_index if stop_early else None, norm=norm)
        npre = self.num_prefix_tokens
        prefix = [y[:, :npre] for y in inter] if npre else None
        inter = [y[:, npre:] for y in inter]
        if output_fmt == 'NCHW':
            if pos.grid is None:
                raise ValueError("output_fmt='NCHW' needs the full token grid (disable patch dropout)")
            inter = [y.unflatten(1, pos.grid).movedim(-1, 1).contiguous() for y in inter]
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
