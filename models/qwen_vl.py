"""Tiny transformers Qwen-VL-family models built from configs, and token-id batches laid out as their processors do.

`tiny_qwen_vl(family)` builds a randomly initialised Qwen2-VL / Qwen2.5-VL / Qwen3-VL /
Qwen3-VL-MoE ``*ForConditionalGeneration`` small enough for CPU tests (no download).
`qwen_vl_batch(family, samples)` turns samples, each a list of segments (``('text', n)``,
``('image', (h, w))``, ``('video', (T, h, w), seconds_per_grid or None)``, grids in patches before the
2x2 merge), into the keyword arguments of the model's forward: ``input_ids``, ``attention_mask``
(left padding), ``mm_token_type_ids``, ``pixel_values`` / ``image_grid_thw``,
``pixel_values_videos`` / ``video_grid_thw`` and, for Qwen2.5-VL, ``second_per_grid_ts``. Videos follow
each family's processor: one vision-start block per video (Qwen2-VL, Qwen2.5-VL) or one per
temporal patch behind timestamp text (Qwen3-VL).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

import torch

__all__ = ['FAMILIES', 'TOKENS', 'tiny_qwen_vl', 'qwen_vl_batch', 'timed', 'labels_for', 'CellColours',
           'collate_cell_colours']

FAMILIES = ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl', 'qwen3_vl_moe')
# a 64-token vocabulary: 0..55 text, then the special tokens
TOKENS = dict(vocab_size=64, vision_start_token_id=58, vision_end_token_id=59, image_token_id=60, video_token_id=61)
PATCH, TEMPORAL, MERGE = 2, 2, 2


def tiny_qwen_vl(family: str, *, hidden: int = 96, heads: int = 6, kv_heads: int = 3, layers: int = 2,
                 seed: int = 0, **text_overrides: Any):
    """A randomly initialised ``*ForConditionalGeneration`` of ``family`` (fp32, eager attention, eval mode)."""
    import transformers
    if family not in FAMILIES:
        raise ValueError(f'family must be one of {FAMILIES}, got {family!r}')
    head_dim = hidden // heads
    pairs = head_dim // 2
    qwen3 = family.startswith('qwen3')
    if qwen3:
        h = (5 * pairs) // 16
        section = [pairs - 2 * h, h, h]
    else:
        t = pairs // 4
        section = [t, (pairs - t) // 2, pairs - t - (pairs - t) // 2]
    text = dict(vocab_size=TOKENS['vocab_size'], hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                rope_parameters=dict(rope_type='default', rope_theta=1e6 if not qwen3 else 5e6,
                                     mrope_section=section, **({'mrope_interleaved': True} if qwen3 else {})))
    if qwen3:
        text['head_dim'] = head_dim
    if family == 'qwen3_vl_moe':
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden, decoder_sparse_step=1)
    text.update(text_overrides)
    vision = dict(depth=1, num_heads=2, patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL)
    if family == 'qwen2_vl':
        vision.update(embed_dim=32, hidden_size=hidden, mlp_ratio=2)
        cls, cfg_cls = transformers.Qwen2VLForConditionalGeneration, transformers.Qwen2VLConfig
    elif family == 'qwen2_5_vl':
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=8,
                      fullatt_block_indexes=[0], tokens_per_second=2)
        cls, cfg_cls = transformers.Qwen2_5_VLForConditionalGeneration, transformers.Qwen2_5_VLConfig
    else:
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden, num_position_embeddings=64,
                      deepstack_visual_indexes=[])
        if family == 'qwen3_vl':
            cls, cfg_cls = transformers.Qwen3VLForConditionalGeneration, transformers.Qwen3VLConfig
        else:
            cls, cfg_cls = transformers.Qwen3VLMoeForConditionalGeneration, transformers.Qwen3VLMoeConfig
    ids = {k: v for k, v in TOKENS.items() if k != 'vocab_size'}
    config = cfg_cls(text_config=text, vision_config=vision, **ids)
    config._attn_implementation = 'eager'
    torch.manual_seed(seed)
    model = cls(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def _patches(t: int, h: int, w: int, g: torch.Generator) -> torch.Tensor:
    return torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=g)


def qwen_vl_batch(family: str, samples: Sequence[Sequence[Tuple]], seed: int = 0,
                  padding_side: str = 'left') -> Dict[str, torch.Tensor]:
    """Forward keyword arguments for a batch of samples (module docstring); text tokens are random."""
    g = torch.Generator().manual_seed(seed)
    vs, ve, img_tok, vid_tok = (TOKENS[k] for k in ('vision_start_token_id', 'vision_end_token_id',
                                                    'image_token_id', 'video_token_id'))
    rows: List[List[int]] = []
    img_g, vid_g, secs, img_px, vid_px = [], [], [], [], []
    per_frame = family.startswith('qwen3')
    for sample in samples:
        toks: List[int] = []
        for seg in sample:
            kind = seg[0]
            if kind == 'text':
                toks += torch.randint(1, 56, (seg[1],), generator=g).tolist()
            elif kind == 'image':
                h, w = seg[1]
                img_g.append([1, h, w])
                img_px.append(_patches(1, h, w, g))
                toks += [vs] + [img_tok] * (h * w // MERGE ** 2) + [ve]
            elif kind == 'video':
                T, h, w = seg[1]
                vid_g.append([T, h, w])
                vid_px.append(_patches(T, h, w, g))
                secs.append(seg[2] if len(seg) > 2 and seg[2] is not None else 1.0)
                if per_frame:  # Qwen3-VL: "<t seconds>" text, then one block per temporal patch
                    for _ in range(T):
                        toks += torch.randint(1, 56, (2,), generator=g).tolist()
                        toks += [vs] + [vid_tok] * (h * w // MERGE ** 2) + [ve]
                else:
                    toks += [vs] + [vid_tok] * (T * h * w // MERGE ** 2) + [ve]
            else:
                raise ValueError(f"segments are ('text', n), ('image', (h, w)) or ('video', (T, h, w)[, s]), got {seg!r}")
        rows.append(toks)
    L = max(len(r) for r in rows)
    B = len(rows)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        sl = slice(L - len(r), L) if padding_side == 'left' else slice(0, len(r))
        input_ids[b, sl] = torch.tensor(r)
        mask[b, sl] = 1
    out: Dict[str, Any] = dict(input_ids=input_ids, attention_mask=mask,
                               mm_token_type_ids=((input_ids == img_tok).long() + 2 * (input_ids == vid_tok).long()))
    if img_g:
        out.update(pixel_values=torch.cat(img_px), image_grid_thw=torch.tensor(img_g))
    if vid_g:
        out.update(pixel_values_videos=torch.cat(vid_px), video_grid_thw=torch.tensor(vid_g))
        if family == 'qwen2_5_vl':
            out['second_per_grid_ts'] = torch.tensor(secs, dtype=torch.float32)
    return out


def timed(family: str) -> bool:
    """Whether the family reads video timing (``second_per_grid_ts``)."""
    return family == 'qwen2_5_vl'


def labels_for(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token labels: the text tokens, -100 on padding and visual placeholders."""
    labels = batch['input_ids'].clone()
    labels[(batch['attention_mask'] == 0) | (batch['mm_token_type_ids'] != 0)] = -100
    return labels


class CellColours(torch.utils.data.Dataset):
    """Embedded questions for a tiny Qwen-VL model: "which colour is the cell at row r, column c?".

    An image of ``grid x grid`` merged cells (each 2x2 patches of one palette colour plus noise) after
    0..``max_filler`` filler tokens, then ``r``, ``c`` tokens; the answer is the colour token. Reading
    the cell at (r, c) needs the visual tokens' positions. Items are drawn from ``(seed, split, index)``.
    Token ids: filler 1..9, rows 10.., columns 20.., colours 30.. (within `TOKENS`' text range).
    """
    ROW0, COL0, COLOUR0 = 10, 20, 30

    def __init__(self, size: int, grid: int = 3, num_colours: int = 4, max_filler: int = 2, seed: int = 0,
                 split: str = 'train') -> None:
        if not 1 <= grid <= 9 or not 2 <= num_colours <= 20:
            raise ValueError(f'grid must be in [1, 9] and num_colours in [2, 20], got {grid}, {num_colours}')
        self.size, self.grid, self.num_colours, self.max_filler = size, grid, num_colours, max_filler
        self.seed = seed * 2 + (split != 'train')
        self.palette = torch.randn(num_colours, 3 * TEMPORAL * PATCH * PATCH,
                                   generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        G = self.grid
        colours = torch.randint(self.num_colours, (G, G), generator=g)
        r, c = (int(x) for x in torch.randint(G, (2,), generator=g))
        # patches in the processor's order: merged cells in raster order, each cell's 2x2 patches together
        px = self.palette[colours.reshape(-1)].repeat_interleave(MERGE * MERGE, 0)
        px = px + 0.1 * torch.randn(px.shape, generator=g)
        filler = torch.randint(1, 10, (int(torch.randint(self.max_filler + 1, (1,), generator=g)),), generator=g)
        ids = torch.cat([filler, torch.tensor([TOKENS['vision_start_token_id']] + [TOKENS['image_token_id']] * G * G
                                              + [TOKENS['vision_end_token_id'], self.ROW0 + r, self.COL0 + c])])
        return dict(input_ids=ids, pixel_values=px, answer=torch.tensor(self.COLOUR0 + int(colours[r, c])))


def collate_cell_colours(items: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Left-padded forward arguments plus ``answer`` ``(B,)``, predicted at the last position."""
    L = max(len(it['input_ids']) for it in items)
    B = len(items)
    input_ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for b, it in enumerate(items):
        n = len(it['input_ids'])
        input_ids[b, L - n:] = it['input_ids']
        mask[b, L - n:] = 1
    G = round((items[0]['pixel_values'].shape[0] // MERGE ** 2) ** 0.5)
    return dict(input_ids=input_ids, attention_mask=mask,
                mm_token_type_ids=(input_ids == TOKENS['image_token_id']).long(),
                pixel_values=torch.cat([it['pixel_values'] for it in items]),
                image_grid_thw=torch.tensor([[1, MERGE * G, MERGE * G]] * B),
                answer=torch.stack([it['answer'] for it in items]))
