"""Positions of a multimodal sequence: text, image and video segments in token order.

``vispe.sequence([Text(12), Image(grid=(1, 28, 28)), Text(5)])`` describes where every token of a
vision-language sequence comes from, as ``vispe.grid(14, 14)`` describes an image's patches. The
multimodal encodings (``mrope``, ``vrope``, ``v2pe``, ...: `vispe.encodings.multimodal`) turn it into
their position ids; what the ids are is the encoding's business, not the sequence's.

Grid convention (Qwen2-VL's ``*_grid_thw``): ``(T, H, W)`` is the patch grid of the vision encoder
*before* the spatial merge; the language model sees ``T x (H / merge) x (W / merge)`` tokens in raster
order (``t`` slowest, then row, then column). Every description reduces to a `SegmentTable`: one row
per maximal text run or visual block, for every sequence of a batch, in token order; the encodings
work on that table with vectorised tensor operations and never loop over tokens. Token ids in a
host library's convention (Qwen-VL's ``vision_start`` tokens, transformers' ``mm_token_type_ids``)
are read by that library's adapter (`vispe.integrations.transformers_vlm`), which builds the same
table.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import List, Literal, Optional, Sequence, Tuple, Union

import torch

from .core import Positions

__all__ = ['Text', 'Image', 'Video', 'Segment', 'Layout', 'SegmentTable', 'MultimodalPositions', 'sequence',
           'padding_mask', 'TEXT', 'IMAGE', 'VIDEO']

TEXT, IMAGE, VIDEO = 0, 1, 2
_SEGMENT_NAMES = 'vispe.Text / vispe.Image / vispe.Video'


def check_positive_int(value: int, what: str) -> int:
    """``int(value)``, or a ValueError naming ``what`` unless it is a positive integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f'{what} must be a positive integer, got {value!r}')
    return int(value)


def _visual_grid(grid: Sequence[int], merge: int, what: str, image: bool) -> Tuple[int, int, int]:
    grid = tuple(grid)
    if image and len(grid) == 2:
        grid = (1,) + grid
    if len(grid) != 3:
        raise ValueError(f'{what}.grid must be (T, H, W){" or (H, W)" if image else ""}, got {grid!r}')
    t, h, w = (check_positive_int(g, f'{what}.grid entries') for g in grid)
    check_positive_int(merge, f'{what}.merge')
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
        """Grid of language-model tokens ``(T, H / merge, W / merge)``."""
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
    given directly or through ``fps``. Without either, encodings that use time fall back to the frame
    index (Qwen2-VL).
    """
    grid: Tuple[int, int, int]
    fps: Optional[float] = None
    merge: int = 2
    temporal_patch_size: int = 2
    second_per_grid_t: Optional[float] = None

    def __post_init__(self) -> None:
        _visual_grid(self.grid, self.merge, 'Video', image=False)
        check_positive_int(self.temporal_patch_size, 'Video.temporal_patch_size')
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
        seconds_dtype: dtype the seconds were given in (a host library may compute time in it).
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

    def tensors(self) -> Tuple[torch.Tensor, ...]:
        return self.batch, self.kind, self.grid, self.num_tokens, self.token_start, self.seconds, self.lengths

    def equal(self, other: 'SegmentTable') -> bool:
        """True when both tables describe the same segments (NaN seconds equal NaN)."""
        if self is other:
            return True
        if self.seconds_dtype != other.seconds_dtype:
            return False
        return all(a.shape == b.shape and a.device == b.device and torch.equal(torch.nan_to_num(a, -1.0),
                                                                               torch.nan_to_num(b, -1.0))
                   for a, b in zip(self.tensors(), other.tensors()))

    def sample(self, index: int) -> 'SegmentTable':
        """The table of sequence ``index`` alone."""
        rows = self.batch == index
        start = self.token_start[rows]
        first = start[:1].clone()
        return SegmentTable(torch.zeros_like(self.batch[rows]), self.kind[rows], self.grid[rows], self.num_tokens[rows],
                            start - first if first.numel() else start, self.seconds[rows],
                            self.lengths[index:index + 1], self.seconds_dtype)


def _is_segment(x) -> bool:
    return isinstance(x, (Text, Image, Video))


def normalise_layouts(layouts) -> Tuple[List[List[Segment]], bool]:
    """``(list of layouts, batched)`` from one layout or a batch of them; an item that is neither a
    segment nor a layout is named by its index."""
    if not isinstance(layouts, (list, tuple)):
        raise ValueError(f'a layout must be a list of {_SEGMENT_NAMES} segments, got {type(layouts).__name__}')
    if len(layouts) == 0:
        return [[]], False
    nested = [isinstance(s, (list, tuple)) for s in layouts]
    if not any(nested):  # one layout: every item must be a segment
        for i, seg in enumerate(layouts):
            if not _is_segment(seg):
                raise ValueError(f'layout[{i}] must be a {_SEGMENT_NAMES} segment, got {seg!r}')
        return [list(layouts)], False
    out = []
    for i, lay in enumerate(layouts):
        if not nested[i]:
            raise ValueError(f'layouts[{i}] must be a list of {_SEGMENT_NAMES} segments (the other items are '
                             f'layouts), got {lay!r}')
        for j, seg in enumerate(lay):
            if not _is_segment(seg):
                raise ValueError(f'layouts[{i}][{j}] must be a {_SEGMENT_NAMES} segment, got {seg!r}')
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
    return SegmentTable(
        batch=torch.tensor(batch, dtype=torch.long, device=device),
        kind=torch.tensor(kind, dtype=torch.long, device=device),
        grid=torch.tensor(grid, dtype=torch.long, device=device).reshape(-1, 3),
        num_tokens=ntok_t,
        token_start=torch.cumsum(ntok_t, 0) - ntok_t,
        seconds=torch.tensor(secs, dtype=torch.float64, device=device),
        lengths=torch.tensor(lengths, dtype=torch.long, device=device),
    )


def mask_from_lengths(lengths: torch.Tensor, padding_side: str, length: Optional[int] = None) -> torch.Tensor:
    """``(B, L)`` mask, 1 on the real tokens of sequences of ``lengths`` padded on ``padding_side``."""
    L = (int(lengths.max()) if lengths.numel() else 0) if length is None else length
    ar = torch.arange(L, device=lengths.device)
    if padding_side == 'right':
        return (ar[None] < lengths[:, None]).long()
    return (ar[None] >= (L - lengths)[:, None]).long()


def _check_side(padding_side: str) -> None:
    if padding_side not in ('right', 'left'):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")


def padding_mask(layouts: Sequence[Layout], padding_side: Literal['right', 'left'] = 'right',
                 device: Optional[torch.device] = None) -> torch.Tensor:
    """``(B, L)`` attention mask (1 = real token, 0 = padding) of a batch of layouts."""
    _check_side(padding_side)
    lays, _ = normalise_layouts(layouts)
    lengths = torch.tensor([sum(s.num_tokens for s in lay) for lay in lays], dtype=torch.long, device=device)
    return mask_from_lengths(lengths, padding_side)


@dataclass(frozen=True, eq=False)
class MultimodalPositions(Positions):
    """`Positions` of a text / image / video sequence (or a padded batch of them): built by `sequence`.

    ``coords`` ``(N, 1)`` (or ``(B, L, 1)``) is each token's index in its own sequence (padding: 0,
    marked in ``key_padding_mask``); where the tokens come from is ``segments``, from which a multimodal
    encoding computes its ids.

    Attributes:
        segments: the `SegmentTable` of the real tokens, in token order.
        offset: ``(B,)`` the position each sequence starts at (0 for a new sequence; a decoding step
            continues at ``cache position + rope_delta``), or None for 0.
    """
    segments: Optional[SegmentTable] = None
    offset: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.segments, SegmentTable):
            raise ValueError('MultimodalPositions.segments must be a SegmentTable: build them with vispe.sequence')
        B = self.coords.shape[0] if self.batched else 1
        if self.segments.batch_size != B:
            raise ValueError(f'MultimodalPositions: {self.segments.batch_size} sequences in segments, {B} in coords')
        if self.offset is not None and (not torch.is_tensor(self.offset) or self.offset.shape != (B,)):
            raise ValueError(f'MultimodalPositions.offset must be a ({B},) tensor, got {self.offset!r}')

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` real tokens of each sequence."""
        return self.segments.lengths

    def same_as(self, other: Positions) -> bool:
        if other is self:
            return True
        if not isinstance(other, MultimodalPositions) or not super().same_as(other):
            return False
        if (self.offset is None) != (other.offset is None) or (
                self.offset is not None and not torch.equal(self.offset, other.offset)):
            return False
        return self.segments.equal(other.segments)

    def sample(self, index: int) -> 'MultimodalPositions':
        if not self.batched:
            return self
        seg = self.segments.sample(index)
        n = int(seg.lengths[0])
        coords = torch.arange(n, device=self.device, dtype=self.coords.dtype)[:, None]
        offset = None if self.offset is None else self.offset[index:index + 1]
        return MultimodalPositions(coords=coords, segments=seg, offset=offset)

    def select(self, keep: torch.Tensor) -> Positions:
        raise ValueError('token dropping keeps a subset of the tokens of a grid; a multimodal sequence\'s ids '
                         'depend on every segment before a token: build the positions of the kept sequence with '
                         'vispe.sequence instead')


def _offsets(offset: Union[None, int, float, torch.Tensor], B: int, device: torch.device) -> Optional[torch.Tensor]:
    if offset is None:
        return None
    if isinstance(offset, bool):
        raise ValueError(f'offset must be a number or a (B,) tensor, got {offset!r}')
    t = torch.as_tensor(offset, device=device)
    if t.is_complex() or t.dtype == torch.bool:
        raise ValueError(f'offset must be a real number or a (B,) tensor, got dtype {t.dtype}')
    t = t.reshape(-1).to(torch.float64)
    if t.numel() == 1:
        t = t.expand(B).clone()
    if t.numel() != B:
        raise ValueError(f'offset must be one number or one per sequence ({B}), got {t.numel()} values')
    if not torch.isfinite(t).all():
        raise ValueError('offset must be finite')
    return t


def positions_from_table(table: SegmentTable, real: Optional[torch.Tensor] = None,
                         offset: Union[None, int, float, torch.Tensor] = None) -> MultimodalPositions:
    """The positions of a segment table: one sequence (``real`` None), or a padded batch whose real tokens
    are ``real`` ``(B, L)`` (bool, True on a real token), as a host's attention mask gives them."""
    device = table.device
    if real is None:
        if table.batch_size != 1:
            raise ValueError('a batch of sequences needs its padding layout (real tokens of (B, L))')
        coords = torch.arange(table.total_tokens, device=device, dtype=torch.float32)[:, None]
        return MultimodalPositions(coords=coords, segments=table, offset=_offsets(offset, 1, device))
    index = (real.long().cumsum(-1) - 1).clamp(min=0).masked_fill(~real, 0)
    return MultimodalPositions(coords=index.to(torch.float32)[..., None], key_padding_mask=~real, segments=table,
                               offset=_offsets(offset, real.shape[0], device))


def sequence(
        layout: Union[Layout, Sequence[Layout]],
        *,
        padding_side: Literal['right', 'left'] = 'right',
        offset: Union[None, int, float, torch.Tensor] = None,
        device: Optional[torch.device] = None,
) -> MultimodalPositions:
    """Positions of a multimodal sequence, or of a padded batch of them.

    Args:
        layout: a list of `Text` / `Image` / `Video` segments (one sequence: ``coords`` ``(N, 1)``), or a
            list of such lists (a batch padded to its longest sequence: ``(B, L, 1)`` with
            ``key_padding_mask``).
        padding_side: where a batch's padding goes, ``'right'`` or ``'left'``.
        offset: the position each sequence starts at, one number or one per sequence (0: a new sequence;
            decoding continues a prefilled one at ``cache position + rope_delta``).
        device: device of the positions.

    Example:
        >>> pos = sequence([Text(3), Image(grid=(1, 4, 4)), Text(2)])
        >>> pos.num_tokens
        9
    """
    _check_side(padding_side)
    layouts, batched = normalise_layouts(layout)
    table = table_from_layouts(layouts, device)
    if not batched:
        return positions_from_table(table, offset=offset)
    real = mask_from_lengths(table.lengths, padding_side).bool()
    return positions_from_table(table, real, offset)
