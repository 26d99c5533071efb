"""Speed of building multimodal position ids for a long interleaved sequence (CPU by default).

The sequence: about 1M tokens of text interleaved with 64 images (64 x 64 patches, merge 2: 1024
tokens each) and 4 timed videos (16 x 64 x 64 patches: 16384 tokens each), in random order. For
every multimodal encoding it reports tokens per second through both interfaces (``vispe.sequence`` of a
layout, and Qwen2-VL token ids with ``image_grid_thw`` / ``video_grid_thw`` through the transformers
adapter's ``rope_index``), and two ratios measured in the same process:

* ``x 1D``: time divided by that of plain 1D text ids (``arange(N)`` expanded to the encoding's axes,
  what an LLM without images pays), interleaved round by round;
* ``speedup``: how much faster than a per-image Python loop in the style of transformers'
  Qwen2-VL ``get_rope_index`` (a faithful port below, timed on the same token ids).

    python benchmarks/multimodal_ids.py                   # 1M tokens, one thread
    python benchmarks/multimodal_ids.py --threads 2 --rounds 9 --tokens 4000000

Target (issue #6): >= 20M tokens/s for M-RoPE on CPU.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
import vispe  # noqa: E402
from vispe import Image, Text, Video  # noqa: E402
from vispe.integrations.transformers_vlm import QWEN2_VL_TOKEN_IDS, rope_index  # noqa: E402
from _timing import compare, time_fn  # noqa: E402

IMG, VID, VS = (QWEN2_VL_TOKEN_IDS[k] for k in ('image_token_id', 'video_token_id', 'vision_start_token_id'))
ENCODINGS = [n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal']


def encoding(spec: str):
    return vispe.create_pe(spec, dim=512, num_heads=4)


def build_layout(tokens: int, images: int, videos: int, seed: int = 0) -> List:
    rng = random.Random(seed)
    kinds = ['image'] * images + ['video'] * videos
    rng.shuffle(kinds)
    visual = images * 1024 + videos * 16 * 1024
    text = tokens - visual
    if text < len(kinds) + 1:
        raise ValueError(f'--tokens {tokens} leaves no room for text around {images} images and {videos} videos')
    per = text // (len(kinds) + 1)
    layout = []
    for k in kinds:
        layout.append(Text(per))
        layout.append(Image(grid=(1, 64, 64)) if k == 'image' else Video(grid=(16, 64, 64), fps=2.0))
    layout.append(Text(text - per * len(kinds)))
    return layout


def token_ids(layout):
    toks, img, vid, secs = [], [], [], []
    for i, seg in enumerate(layout):
        if isinstance(seg, Text):
            nxt_visual = i + 1 < len(layout) and not isinstance(layout[i + 1], Text)
            toks.append(torch.full((seg.n,), 7, dtype=torch.long))
            if nxt_visual:
                toks[-1][-1] = VS
        else:
            is_img = isinstance(seg, Image)
            toks.append(torch.full((seg.num_tokens,), IMG if is_img else VID, dtype=torch.long))
            (img if is_img else vid).append(seg.grid)
            if not is_img:
                secs.append(seg.second_per_grid)
    return (torch.cat(toks)[None], torch.tensor(img).reshape(-1, 3), torch.tensor(vid).reshape(-1, 3),
            torch.tensor(secs, dtype=torch.float64))


def loop_get_rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, merge=2, tps=2.0):
    """transformers' Qwen2.5-VL get_rope_index algorithm (per-image Python loop), batch of one, no mask."""
    ids = input_ids[0]
    starts = torch.argwhere(ids == VS).squeeze(1)
    kinds = ids[starts + 1]
    n_img, n_vid = int((kinds == IMG).sum()), int((kinds == VID).sum())
    toks = ids.tolist()
    pos, st, ii, vi = [], 0, 0, 0
    for _ in range(n_img + n_vid):
        ed_i = toks.index(IMG, st) if ii < n_img else len(toks) + 1
        ed_v = toks.index(VID, st) if vi < n_vid else len(toks) + 1
        if ed_i < ed_v:
            t, h, w = image_grid_thw[ii].tolist()
            sec, ii, ed = 0.0, ii + 1, ed_i
        else:
            t, h, w = video_grid_thw[vi].tolist()
            sec, vi, ed = float(second_per_grid_ts[vi]), vi + 1, ed_v
        h, w = h // merge, w // merge
        n = ed - st
        st_idx = int(pos[-1].max()) + 1 if pos else 0
        pos.append(torch.arange(n).view(1, -1).expand(3, -1) + st_idx)
        t_idx = (torch.arange(t).view(-1, 1).expand(-1, h * w) * sec * tps).long().flatten()
        h_idx = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
        w_idx = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
        pos.append(torch.stack([t_idx, h_idx, w_idx]) + n + st_idx)
        st = ed + t * h * w
    if st < len(toks):
        st_idx = int(pos[-1].max()) + 1 if pos else 0
        pos.append(torch.arange(len(toks) - st).view(1, -1).expand(3, -1) + st_idx)
    return torch.cat(pos, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('--tokens', type=int, default=1_000_000)
    ap.add_argument('--images', type=int, default=64)
    ap.add_argument('--videos', type=int, default=4)
    ap.add_argument('--threads', type=int, default=1)
    ap.add_argument('--rounds', type=int, default=7)
    ap.add_argument('--schemes', nargs='*', default=ENCODINGS, help='multimodal encoding specs')
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layout = build_layout(args.tokens, args.images, args.videos)
    input_ids, img, vid, secs = token_ids(layout)
    N = input_ids.shape[1]
    print(f'{N} tokens, {args.images} images, {args.videos} videos, {args.threads} thread(s)')

    ref = loop_get_rope_index(input_ids, img, vid, secs)
    fast, _ = rope_index(encoding('mrope'), input_ids, image_grid_thw=img, video_grid_thw=vid,
                         second_per_grid_ts=secs, rule='4.x')  # the port is of 4.x's get_rope_index
    if not torch.equal(ref, fast[:, 0]):
        raise RuntimeError('vectorised M-RoPE ids differ from the loop reference')
    t_loop = time_fn(lambda: loop_get_rope_index(input_ids, img, vid, secs), warmup=1, iters=3)

    print(f'{"encoding":18s} {"layout Mtok/s":>14s} {"x 1D":>6s} {"token-ids Mtok/s":>17s} {"x 1D":>6s} '
          f'{"speedup":>8s}')
    for name in args.schemes:
        pe = encoding(name)
        A = pe.num_axes
        fns = {
            '1d': lambda: torch.arange(N).expand(A, N).contiguous(),
            'layout': lambda: pe.position_ids(vispe.sequence(layout)),
            'ids': lambda: rope_index(pe, input_ids, image_grid_thw=img, video_grid_thw=vid,  # one block per video
                                      second_per_grid_ts=secs, video_blocks='video'),
        }
        t = compare(fns, rounds=args.rounds)
        print(f'{name:18s} {N / t["layout"] / 1e6:14.1f} {t["layout"] / t["1d"]:6.1f} '
              f'{N / t["ids"] / 1e6:17.1f} {t["ids"] / t["1d"]:6.1f} {t_loop / t["ids"]:8.0f}x')
    print(f'{"loop reference":18s} {"":14s} {"":6s} {N / t_loop / 1e6:17.2f}   (M-RoPE, per-image Python loop)')


if __name__ == '__main__':
    start = time.perf_counter()
    main()
    print(f'done in {time.perf_counter() - start:.1f}s')
