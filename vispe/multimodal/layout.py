"""Where the tokens of a multimodal sequence come from: segments, and the segment table both interfaces build.

A sequence is text and visual blocks in order. Users describe it either as a *layout*
(``[Text(12), Image(grid=(1, 28, 28)), Text(5)]``) or as LLM code has it: token ids with
``image_grid_thw`` / ``video_grid_thw`` (Qwen2-VL convention: a ``vision_start`` token, then one
image/video placeholder token per merged visual token). Both reduce to a `SegmentTable`: one row
per maximal text run or visual block, for every sequence of a batch, in token order. The position-id
schemes work on that table with vectorised tensor operations; nothing loops over tokens.

Grid convention (Qwen2-VL's ``*_grid_thw``): ``(T, H, W)`` is the patch grid of the vision encoder
*before* the spatial merge; the LLM sees ``T x (H / merge) x (W / merge)`` tokens in raster order
(``t`` slowest, then row, then column). How a video's tokens sit in the token ids depends on the
model family (`VideoBlocks`): Qwen2-VL and Qwen2.5-VL put the whole video in one vision-start block;
Qwen3-VL's processor returns the same one row per video but puts each temporal patch in a block of
its own, with timestamp text between them.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence, Tuple, Union

import torch

__all__ = ['Text', 'Image', 'Video', 'Segment', 'Layout', 'SegmentTable', 'TEXT', 'IMAGE', 'VIDEO',
           'VideoBlocks', 'table_from_layouts', 'table_from_token_ids', 'padding_mask', 'QWEN2_VL_TOKEN_IDS']

TEXT, IMAGE, VIDEO = 0, 1, 2

# How the rows of ``video_grid_thw`` map to vision-start blocks of the token ids: ``'video'``, one block
# per row (Qwen2-VL, Qwen2.5-VL); ``'frame'``, one block per temporal patch, a row ``(T, H, W)`` standing
# for T blocks ``(1, H, W)`` (Qwen3-VL, whose processor separates frames by timestamp text).
VideoBlocks = Literal['video', 'frame']

# Qwen2-VL / Qwen2.5-VL special token ids (``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``).
QWEN2_VL_TOKEN_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652)


def _check_positive_int(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f'{what} must be a positive integer, got {value!r}')
    return int(value)


def _visual_grid(grid: Sequence[int], merge: int, what: str, image: bool) -> Tuple[int, int, int]:
    grid = tuple(grid)
    if image and len(grid) == 2:
        grid = (1,) + grid
    if len(grid) != 3:
        raise ValueError(f'{what}.grid must be (T, H, W){" or (H, W)" if image else ""}, got {grid!r}')
    t, h, w = (_check_positive_int(g, f'{what}.grid entries') for g in grid)
    _check_positive_int(merge, f'{what}.merge')
    if h % merge or w % merge:
        raise ValueError(f'{what}.grid {grid}: H and W must be divisible by merge={merge}')
    return t, h // merge, w // merge


@dataclass(frozen=True)
class Text:
    """``n`` text tokens (special tokens such as ``<vision_start>`` count as text)."""
    n: int

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, numbers.Integral) or self.n < 0:
            raise ValueError(f'Text.n must be a non-negative integer, got {self.n!r}')

    @property
    def num_tokens(self) -> int:
        return self.n


@dataclass(frozen=True)
class Image:
    """An image: patch grid ``(1, H, W)`` (or ``(H, W)``) before a ``merge x merge`` spatial merge."""
    grid: Tuple[int, ...]
    merge: int = 2

    def __post_init__(self) -> None:
        _visual_grid(self.grid, self.merge, 'Image', image=True)

    @property
    def merged_grid(self) -> Tuple[int, int, int]:
        """Grid of LLM tokens ``(T, H / merge, W / merge)``."""
        return _visual_grid(self.grid, self.merge, 'Image', image=True)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.merged_grid)

    @property
    def second_per_grid(self) -> Optional[float]:
        return None


@dataclass(frozen=True)
class Video:
    """A video: patch grid ``(T, H, W)`` (``T`` temporal patches) before the spatial merge.

    Timing (Qwen2.5-VL): ``second_per_grid = temporal_patch_size / fps`` seconds per temporal patch,
    given directly or through ``fps``. Without either, schemes that use time fall back to the frame
    index (Qwen2-VL).
    """
    grid: Tuple[int, int, int]
    fps: Optional[float] = None
    merge: int = 2
    temporal_patch_size: int = 2
    second_per_grid_t: Optional[float] = None

    def __post_init__(self) -> None:
        _visual_grid(self.grid, self.merge, 'Video', image=False)
        _check_positive_int(self.temporal_patch_size, 'Video.temporal_patch_size')
        if self.fps is not None and self.second_per_grid_t is not None:
            raise ValueError('Video: give fps or second_per_grid_t, not both')
        if self.fps is not None and not self.fps > 0:
            raise ValueError(f'Video.fps must be > 0, got {self.fps!r}')
        if self.second_per_grid_t is not None and not self.second_per_grid_t >= 0:
            raise ValueError(f'Video.second_per_grid_t must be >= 0, got {self.second_per_grid_t!r}')

    @property
    def merged_grid(self) -> Tuple[int, int, int]:
        return _visual_grid(self.grid, self.merge, 'Video', image=False)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.merged_grid)

    @property
    def second_per_grid(self) -> Optional[float]:
        if self.second_per_grid_t is not None:
            return float(self.second_per_grid_t)
        if self.fps is not None:
            return self.temporal_patch_size / self.fps
        return None


Segment = Union[Text, Image, Video]
Layout = Sequence[Segment]


@dataclass(frozen=True)
class SegmentTable:
    """Segments of a (flattened) batch, in token order; every tensor has one row per segment.

    Attributes:
        batch: ``(S,)`` sequence index of each segment.
        kind: ``(S,)`` `TEXT`, `IMAGE` or `VIDEO`.
        grid: ``(S, 3)`` merged ``(T, H, W)`` of visual segments; ``(1, 1, n)`` for text.
        num_tokens: ``(S,)`` tokens of each segment.
        token_start: ``(S,)`` offset of the first token in the flattened real tokens.
        seconds: ``(S,)`` float64 seconds per temporal patch, NaN when untimed (images, text).
        lengths: ``(B,)`` real tokens of each sequence.
        seconds_dtype: dtype the caller gave ``second_per_grid_ts`` in (transformers 5.x computes the
            time index in it).
    """
    batch: torch.Tensor
    kind: torch.Tensor
    grid: torch.Tensor
    num_tokens: torch.Tensor
    token_start: torch.Tensor
    seconds: torch.Tensor
    lengths: torch.Tensor
    seconds_dtype: torch.dtype = torch.float64

    @property
    def batch_size(self) -> int:
        return self.lengths.numel()

    @property
    def total_tokens(self) -> int:
        return int(self.num_tokens.sum()) if self.num_tokens.numel() else 0

    @property
    def device(self) -> torch.device:
        return self.lengths.device


def _is_segment(x) -> bool:
    return isinstance(x, (Text, Image, Video))


def normalise_layouts(layouts) -> Tuple[List[List[Segment]], bool]:
    """``(list of layouts, batched)`` from one layout or a batch of them."""
    if not isinstance(layouts, (list, tuple)):
        raise ValueError(f'a layout must be a list of mm.Text / mm.Image / mm.Video, got {type(layouts).__name__}')
    if len(layouts) == 0 or all(_is_segment(s) for s in layouts):
        return [list(layouts)], False
    out = []
    for i, lay in enumerate(layouts):
        if not isinstance(lay, (list, tuple)) or not all(_is_segment(s) for s in lay):
            raise ValueError(f'layouts[{i}] must be a list of mm.Text / mm.Image / mm.Video segments, got {lay!r}')
        out.append(list(lay))
    return out, True


def table_from_layouts(layouts: Sequence[Layout], device: Optional[torch.device] = None) -> SegmentTable:
    """The segment table of a batch of layouts (a loop over segments, never over tokens)."""
    batch, kind, grid, ntok, secs, lengths = [], [], [], [], [], []
    for b, layout in enumerate(layouts):
        total = 0
        for seg in layout:
            n = seg.num_tokens
            if n == 0:
                continue
            if isinstance(seg, Text):
                kind.append(TEXT)
                grid.append((1, 1, n))
                secs.append(math.nan)
            else:
                kind.append(IMAGE if isinstance(seg, Image) else VIDEO)
                grid.append(seg.merged_grid)
                sec = seg.second_per_grid
                secs.append(math.nan if sec is None else sec)
            batch.append(b)
            ntok.append(n)
            total += n
        lengths.append(total)
    device = torch.device(device or 'cpu')
    ntok_t = torch.tensor(ntok, dtype=torch.long, device=device)
    lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
    return SegmentTable(
        batch=torch.tensor(batch, dtype=torch.long, device=device),
        kind=torch.tensor(kind, dtype=torch.long, device=device),
        grid=torch.tensor(grid, dtype=torch.long, device=device).reshape(-1, 3),
        num_tokens=ntok_t,
        token_start=torch.cumsum(ntok_t, 0) - ntok_t,
        seconds=torch.tensor(secs, dtype=torch.float64, device=device),
        lengths=lengths_t,
    )


def padding_mask(layouts: Sequence[Layout], padding_side: Literal['right', 'left'] = 'right',
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """``(B, L)`` attention mask (1 = real token, 0 = padding) of a batch of layouts."""
    if padding_side not in ('right', 'left'):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    lays, _ = normalise_layouts(layouts)
    lengths = torch.tensor([sum(s.num_tokens for s in lay) for lay in lays], dtype=torch.long, device=device)
    return _mask_from_lengths(lengths, padding_side)


def _mask_from_lengths(lengths: torch.Tensor, padding_side: str) -> torch.Tensor:
    L = int(lengths.max()) if lengths.numel() else 0
    ar = torch.arange(L, device=lengths.device)
    if padding_side == 'right':
        return (ar[None] < lengths[:, None]).long()
    return (ar[None] >= (L - lengths)[:, None]).long()


def _grid_rows(grid_thw: Optional[torch.Tensor], what: str, device: torch.device) -> torch.Tensor:
    if grid_thw is None:
        return torch.zeros(0, 3, dtype=torch.long, device=device)
    g = torch.as_tensor(grid_thw, device=device)
    if g.dim() != 2 or g.shape[-1] != 3:
        raise ValueError(f'{what} must be a (num, 3) tensor of (T, H, W) rows, got shape {tuple(g.shape)}')
    return g.long()


def table_from_token_ids(
        input_ids: torch.Tensor,
        image_grid_thw: Optional[torch.Tensor],
        video_grid_thw: Optional[torch.Tensor],
        second_per_grid_ts: Optional[torch.Tensor],
        attention_mask: Optional[torch.Tensor],
        image_token_id: int,
        video_token_id: int,
        vision_start_token_id: int,
        spatial_merge_size: int,
        video_blocks: VideoBlocks = 'video',
        mm_token_type_ids: Optional[torch.Tensor] = None,
) -> SegmentTable:
    """The segment table of a ``(B, L)`` batch of token ids in the Qwen2-VL convention.

    A visual block starts at an image (video) token that follows ``vision_start_token_id``; its
    length is ``T * H * W / merge^2`` of the next unused row of ``image_grid_thw``
    (``video_grid_thw``), rows being consumed in order across the whole batch, as Qwen2-VL does.
    With ``video_blocks='frame'`` each video row ``(T, H, W)`` first becomes T rows ``(1, H, W)``, one
    per block (Qwen3-VL's ``get_rope_index`` splits them the same way); ``second_per_grid_ts`` still
    has one value per video. Padding (``attention_mask == 0``) is skipped.

    With ``mm_token_type_ids`` (``(B, L)``: 0 text, 1 image, 2 video; what transformers 5.x processors
    return and its ``get_rope_index`` reads) a block is instead a maximal run of one non-zero type,
    and the token ids themselves are not inspected.
    """
    if video_blocks not in ('video', 'frame'):
        raise ValueError(f"video_blocks must be one of ('video', 'frame'), got {video_blocks!r}")
    if input_ids.dim() != 2:
        raise ValueError(f'input_ids must be (B, L), got shape {tuple(input_ids.shape)}')
    _check_positive_int(spatial_merge_size, 'spatial_merge_size')
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
            raise ValueError(f'mm_token_type_ids shape {tuple(types.shape)} != input_ids shape {tuple(input_ids.shape)}')
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
    seg_batch = torch.searchsorted(seq_start, starts, right=True) - 1
    # empty sequences share their start with the next sequence; searchsorted(right=True) picks the last one
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
