"""Qwen-VL token ids and transformers' position-id rules, for the multimodal encodings.

transformers' Qwen-VL models hold a sequence as token ids: a ``vision_start`` token, then one image
(video) placeholder token per merged visual token, with the grids in ``image_grid_thw`` /
``video_grid_thw`` (patch grids before the merge); transformers 5.x processors also return
``mm_token_type_ids`` (0 text, 1 image, 2 video). `token_positions` reads them into the segments of a
`vispe.sequence`; `rope_index` gives a multimodal encoding's ids and ``rope_deltas`` as transformers'
``get_rope_index`` returns them, under its 5.x rule (the default) or its 4.x one. They differ for the
M-RoPE family:

========================  =================================================  ==========================
(M-RoPE family)           5.x                                                4.x (vispe's own)
========================  =================================================  ==========================
text after a visual block ``s + max(H, W)`` (merged grid; time ignored)      max over all axes + 1
``rope_delta``            ``max id + 1 - real tokens`` (decode: ``(number    ``next - L`` (decode:
                          of real tokens so far) + rope_delta``)             ``cache_position + delta``)
padding ids               0                                                  1
timed video (Qwen2.5-VL)  ``(t * (tokens_per_second * second_per_grid)).     ``floor`` of the product
                          long()`` in ``second_per_grid_ts``' dtype;         in float64; untimed: ``t``
                          untimed: 1 s per temporal patch
visual blocks             runs of one type in ``mm_token_type_ids`` when     ``vision_start`` + image /
                          given, else ``vision_start`` + image/video token   video token
========================  =================================================  ==========================

For the other encodings the rule sets the padding ids and the ``rope_delta`` convention only. These
facts are transformers' (read from ``get_rope_index`` of 4.57 and 5.25); they live here, in the
adapter, and vispe's encodings follow the published rule.
"""
from __future__ import annotations

import math
from typing import Dict, Literal, Optional, Tuple

import torch

from ..encodings.mrope import MRoPE
from ..encodings.multimodal import IdRule, MultimodalRoPE
from ..positions.multimodal import TEXT, IMAGE, VIDEO, MultimodalPositions, SegmentTable, check_positive_int, \
    positions_from_table

__all__ = ['QWEN2_VL_TOKEN_IDS', 'RULES', 'VideoBlocks', 'Transformers5Rule', 'table_from_token_ids',
           'token_positions', 'rope_index']

Tensor = torch.Tensor

# Qwen2-VL / Qwen2.5-VL special token ids (``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``).
QWEN2_VL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)

# How the rows of ``video_grid_thw`` map to vision-start blocks of the token ids: ``'video'``, one block per
# row (Qwen2-VL, Qwen2.5-VL); ``'frame'``, one block per temporal patch, a row ``(T, H, W)`` standing for T
# blocks ``(1, H, W)`` (Qwen3-VL, whose processor separates frames by timestamp text).
VideoBlocks = Literal['video', 'frame']
Rule = Literal['5.x', '4.x']
RULES = ('5.x', '4.x')


class Transformers5Rule(IdRule):
    """transformers 5.x's ``get_rope_index`` for the M-RoPE family: a visual block advances the running
    position by ``max(H, W)`` of its merged grid whatever its time span, and a timed video's temporal index
    is ``(t * (tokens_per_second * second_per_grid)).long()`` in the dtype ``second_per_grid_ts`` came in,
    an untimed one counting 1 s per temporal patch."""

    def time_index(self, t, seconds, tokens_per_second, seconds_dtype):
        if tokens_per_second is None:
            return t
        interval = torch.nan_to_num(seconds, nan=1.0).to(seconds_dtype) * tokens_per_second
        return (t * interval).long()

    def mrope_extent(self, seg, t_last):
        return torch.maximum(seg['H'], seg['W'])


_RULES: Dict[str, Optional[IdRule]] = {'5.x': Transformers5Rule(), '4.x': None}


def _grid_rows(grid_thw: Optional[Tensor], what: str, device: torch.device) -> Tensor:
    if grid_thw is None:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    g = torch.as_tensor(grid_thw, device=device)
    if g.dim() != 2 or g.shape[-1] != 3:
        raise ValueError(f'{what} must be a (num, 3) tensor of (T, H, W) rows, got shape {tuple(g.shape)}')
    if g.dtype == torch.bool or g.is_complex():
        raise ValueError(f'{what} must hold integer (T, H, W) patch counts, got dtype {g.dtype}')
    if g.is_floating_point():
        bad = ~torch.isfinite(g) | (g != g.round())
        if bool(bad.any()):
            raise ValueError(f'{what} must hold whole (T, H, W) patch counts, got {g[bad.any(1)][0].tolist()} '
                             '(a fractional grid is no patch grid)')
    return g.long()


def table_from_token_ids(
        input_ids: Tensor,
        image_grid_thw: Optional[Tensor],
        video_grid_thw: Optional[Tensor],
        second_per_grid_ts: Optional[Tensor],
        attention_mask: Optional[Tensor],
        image_token_id: int,
        video_token_id: int,
        vision_start_token_id: int,
        spatial_merge_size: int,
        video_blocks: VideoBlocks = 'video',
        mm_token_type_ids: Optional[Tensor] = None,
) -> SegmentTable:
    """The segment table of a ``(B, L)`` batch of token ids in the Qwen2-VL convention.

    A visual block starts at an image (video) token that follows ``vision_start_token_id``; its length is
    ``T * H * W / merge^2`` of the next unused row of ``image_grid_thw`` (``video_grid_thw``), rows being
    consumed in order across the whole batch, as Qwen2-VL does. With ``video_blocks='frame'`` each video
    row ``(T, H, W)`` first becomes T rows ``(1, H, W)``, one per block (Qwen3-VL's ``get_rope_index``
    splits them the same way); ``second_per_grid_ts`` still has one value per video. Padding
    (``attention_mask == 0``) is skipped.

    With ``mm_token_type_ids`` (``(B, L)``: 0 text, 1 image, 2 video; what transformers 5.x processors
    return and its ``get_rope_index`` reads) a block is instead a maximal run of one non-zero type, and
    the token ids themselves are not inspected.
    """
    if video_blocks not in ('video', 'frame'):
        raise ValueError(f"video_blocks must be one of ('video', 'frame'), got {video_blocks!r}")
    if not torch.is_tensor(input_ids) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
        raise ValueError(f'input_ids must be a (B, L) tensor, got {shape}')
    if input_ids.dtype not in (torch.long, torch.int32, torch.int16):
        raise ValueError(f'token ids must be an integer tensor, got {input_ids.dtype}')
    check_positive_int(spatial_merge_size, 'spatial_merge_size')
    device = input_ids.device
    B, L = input_ids.shape
    if attention_mask is not None:
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f'attention_mask shape {tuple(attention_mask.shape)} != input_ids shape '
                             f'{tuple(input_ids.shape)}')
        keep = attention_mask.to(device) != 0
        flat = input_ids[keep]
        lengths = keep.sum(1)
    else:
        flat = input_ids.reshape(-1)
        lengths = torch.full((B,), L, dtype=torch.long, device=device)
    N = flat.numel()
    seq_start = torch.cumsum(lengths, 0) - lengths

    if mm_token_type_ids is not None:
        types = torch.as_tensor(mm_token_type_ids, device=device)
        if types.shape != input_ids.shape:
            raise ValueError(f'mm_token_type_ids shape {tuple(types.shape)} != input_ids shape '
                             f'{tuple(input_ids.shape)}')
        flat_kind = (types[keep] if attention_mask is not None else types.reshape(-1)).long()
        if ((flat_kind < 0) | (flat_kind > 2)).any():
            raise ValueError('mm_token_type_ids must hold 0 (text), 1 (image) or 2 (video)')
        # transformers 5.x: a block is a maximal run of one non-text type inside a sequence
        change = torch.ones(N, dtype=torch.bool, device=device)
        change[1:] = flat_kind[1:] != flat_kind[:-1]
        change[seq_start[lengths > 0]] = True
        block_start = torch.nonzero(change & (flat_kind != 0)).squeeze(1)
        block_is_img = flat_kind[block_start] == 1
        what_block = 'image-type run'
    else:
        flat_kind = (flat == image_token_id).long() + 2 * (flat == video_token_id).long()
        # a block starts at an image/video token right after vision_start (Qwen2-VL's rule)
        cand = torch.nonzero(flat[:-1] == vision_start_token_id).squeeze(1) + 1
        cand = cand[~torch.isin(cand, seq_start[lengths > 0])]  # not across a sequence boundary
        cand_kind = flat_kind[cand]
        block_start = cand[cand_kind > 0]
        block_is_img = cand_kind[cand_kind > 0] == 1
        what_block = 'image blocks (vision_start + image token)'

    m = spatial_merge_size
    img_g = _grid_rows(image_grid_thw, 'image_grid_thw', device)
    vid_g = _grid_rows(video_grid_thw, 'video_grid_thw', device)
    for g, what in ((img_g, 'image_grid_thw'), (vid_g, 'video_grid_thw')):
        if g.numel() and ((g[:, 1:] % m).any() or (g <= 0).any()):
            raise ValueError(f'{what} rows must be positive with H and W divisible by spatial_merge_size={m}')
    num_videos = vid_g.shape[0]
    secs_vid = torch.full((num_videos,), math.nan, dtype=torch.float64, device=device)
    seconds_dtype = torch.float64
    if second_per_grid_ts is not None:
        s = torch.as_tensor(second_per_grid_ts, device=device).reshape(-1)
        seconds_dtype = s.dtype if s.is_floating_point() else torch.float64
        s = s.double()
        if s.numel() != num_videos:
            raise ValueError(f'second_per_grid_ts has {s.numel()} values but there are {num_videos} videos')
        secs_vid = s
    frames = vid_g[:, 0]
    if video_blocks == 'frame':
        vid_g = torch.cat([torch.ones_like(vid_g[:, :1]), vid_g[:, 1:]], 1).repeat_interleave(frames, dim=0)
        secs_vid = secs_vid.repeat_interleave(frames)
    n_img, n_vid = int(block_is_img.sum()), int((~block_is_img).sum())
    if n_img != img_g.shape[0]:
        raise ValueError(f'input_ids hold {n_img} {what_block} but image_grid_thw '
                         f'has {img_g.shape[0]} rows')
    if n_vid != vid_g.shape[0]:
        other = {'video': ('frame', int(frames.sum())), 'frame': ('video', num_videos)}[video_blocks]
        hint = (f"; they match one block per {other[0]}: pass video_blocks='{other[0]}'"
                if n_vid == other[1] else '')
        raise ValueError(f'input_ids hold {n_vid} {what_block.replace("image", "video")} but video_grid_thw '
                         f'gives {vid_g.shape[0]} with one block per {video_blocks} '
                         f'(video_blocks={video_blocks!r}){hint}')

    # the k-th image block takes image row k (videos alike); boolean-mask assignment keeps that order
    K = block_start.numel()
    block_grid = torch.empty(K, 3, dtype=torch.long, device=device)
    block_grid[block_is_img] = torch.cat([img_g[:, :1], img_g[:, 1:] // m], 1)
    block_grid[~block_is_img] = torch.cat([vid_g[:, :1], vid_g[:, 1:] // m], 1)
    block_secs = torch.full((K,), math.nan, dtype=torch.float64, device=device)
    block_secs[~block_is_img] = secs_vid
    block_len = block_grid.prod(1)
    block_end = block_start + block_len

    # every block must be placeholder tokens of its kind inside its own sequence, and no placeholder outside
    is_vis = flat_kind != 0
    count = torch.cumsum(is_vis, 0, dtype=torch.int32)
    n_vis = int(count[-1]) if N else 0
    if block_start.numel():
        seq_of_block = torch.searchsorted(seq_start, block_start, right=True) - 1
        if (block_end > (seq_start + lengths)[seq_of_block]).any():
            raise ValueError('a visual block runs past the end of its sequence: the grid_thw rows do not match '
                             'the number of image/video tokens')
        kind_tok = torch.where(block_is_img, 1, 2)
        inside = count[block_end - 1] - count[block_start] + 1
        if (inside != block_len).any() or (flat_kind[block_end - 1] != kind_tok).any():
            raise ValueError('image/video placeholder tokens do not match image_grid_thw / video_grid_thw: a visual '
                             'block has the wrong number of tokens')
    if n_vis != int(block_len.sum()):
        raise ValueError(f'input_ids hold {n_vis} image/video tokens but the grids account for '
                         f'{int(block_len.sum())} (each block must follow vision_start_token_id)')

    # segments: maximal runs between sequence starts, block starts and block ends
    bounds = torch.unique(torch.cat([seq_start, block_start, block_end,
                                     torch.tensor([N], dtype=torch.long, device=device)]))
    starts, ends = bounds[:-1], bounds[1:]
    is_block = torch.isin(starts, block_start)
    # empty sequences share their start with the next sequence; searchsorted(right=True) picks the last one
    seg_batch = torch.searchsorted(seq_start, starts, right=True) - 1
    ntok = ends - starts
    kind = torch.full_like(starts, TEXT)
    grid = torch.stack([torch.ones_like(ntok), torch.ones_like(ntok), ntok], 1)
    secs = torch.full(starts.shape, math.nan, dtype=torch.float64, device=device)
    if block_start.numel():
        bi = torch.searchsorted(block_start, starts[is_block])
        kind[is_block] = torch.where(block_is_img[bi], IMAGE, VIDEO)
        grid[is_block] = block_grid[bi]
        secs[is_block] = block_secs[bi]
    return SegmentTable(batch=seg_batch, kind=kind, grid=grid, num_tokens=ntok, token_start=starts,
                        seconds=secs, lengths=lengths, seconds_dtype=seconds_dtype)


def token_positions(
        input_ids: Tensor,
        *,
        image_grid_thw: Optional[Tensor] = None,
        video_grid_thw: Optional[Tensor] = None,
        second_per_grid_ts: Optional[Tensor] = None,
        attention_mask: Optional[Tensor] = None,
        mm_token_type_ids: Optional[Tensor] = None,
        image_token_id: int = QWEN2_VL_TOKEN_IDS['image_token_id'],
        video_token_id: int = QWEN2_VL_TOKEN_IDS['video_token_id'],
        vision_start_token_id: int = QWEN2_VL_TOKEN_IDS['vision_start_token_id'],
        spatial_merge_size: int = 2,
        video_blocks: VideoBlocks = 'video',
) -> MultimodalPositions:
    """The `vispe.sequence` positions ``(B, L)`` (padding from ``attention_mask``) of Qwen-VL token ids
    (`table_from_token_ids`)."""
    table = table_from_token_ids(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                                 image_token_id, video_token_id, vision_start_token_id, spatial_merge_size,
                                 video_blocks, mm_token_type_ids)
    real = (attention_mask.to(input_ids.device) != 0 if attention_mask is not None
            else torch.ones(input_ids.shape, dtype=torch.bool, device=input_ids.device))
    return positions_from_table(table, real)


def rope_index(
        pe: MultimodalRoPE,
        input_ids: Tensor,
        *,
        rule: Rule = '5.x',
        video_blocks: Optional[VideoBlocks] = None,
        training: bool = False,
        generator: Optional[torch.Generator] = None,
        pad_value: Optional[int] = None,
        **tokens,
) -> Tuple[Tensor, Tensor]:
    """Ids ``(A, B, L)`` and ``rope_deltas`` ``(B, 1)`` of Qwen-VL token ids under a multimodal encoding, as
    transformers' ``get_rope_index`` returns them under ``rule`` (module docstring).

    Args:
        pe: a multimodal encoding (``vispe.create_pe('mrope', ...)``).
        input_ids: ``(B, L)`` token ids; ``tokens``: the keywords of `token_positions` (grids, mask, ...).
        rule: ``'5.x'`` or ``'4.x'``: whose ``get_rope_index`` to follow.
        video_blocks: how the token ids hold a video (`VideoBlocks`); default the encoding's.
        training: V2PE and HoPE draw random strides when True (with ``generator``).
        pad_value: ids of padding tokens; default 0 under the 5.x rule, else 1.
    """
    if not isinstance(pe, MultimodalRoPE):
        raise ValueError(f'rope_index needs a multimodal encoding (family multimodal), got {type(pe).__name__}')
    if rule not in RULES:
        raise ValueError(f'rule must be one of {RULES}, got {rule!r}')
    pos = token_positions(input_ids, video_blocks=pe.video_blocks if video_blocks is None else video_blocks,
                          **tokens)
    hf5 = rule == '5.x'
    table = pos.segments
    flat, nxt = pe.build(table, training, generator, rule=_RULES[rule])
    B, L = input_ids.shape
    pad = (0 if hf5 else 1) if pad_value is None else pad_value
    if pos.key_padding_mask is not None and bool(pos.key_padding_mask.any()):
        ids = torch.full((pe.num_axes, B, L), pad, dtype=flat.dtype, device=flat.device)
        ids[:, ~pos.key_padding_mask] = flat
    else:
        ids = flat.reshape(pe.num_axes, B, L)
    if not hf5:
        return ids, (nxt - L)[:, None]
    if isinstance(pe, MRoPE) and flat.numel():  # transformers 5.x: the largest id of the sequence + 1
        seq = torch.repeat_interleave(torch.arange(B, device=flat.device), table.lengths, output_size=flat.shape[1])
        nxt = torch.zeros(B, dtype=flat.dtype, device=flat.device).scatter_reduce(
            0, seq, flat.amax(0), 'amax', include_self=False) + 1
    return ids, (nxt - table.lengths.to(nxt.dtype))[:, None]
