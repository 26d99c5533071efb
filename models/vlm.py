"""A small vision-language model built from vispe parts, and a synthetic task where position matters.

* `MLPProjector`: Qwen2-VL's patch merger (LayerNorm, concatenate each ``merge x merge`` window of
  patch features, two-layer MLP) from a vispe ViT's token grid to LM tokens.
* `Resampler`: learned queries cross-attend to the image tokens (Qwen-VL / Flamingo style); the
  *keys* carry a vispe 2D encoding: an additive one (``sincos``, ``learned``) is added to the key
  inputs only (never to the values), a rotary one (``rope_axial``, ``rope_mixed``, ...) rotates q
  and k through `vispe.pe_attention` with separate query and key positions (the queries sit on a
  lattice over the image grid).
* `DecoderLM`: a few pre-norm decoder blocks (RMSNorm, causal attention with multimodal rotary,
  SwiGLU MLP) whose position-id scheme is an option: any multimodal encoding of vispe (``mrope``,
  ``videorope``, ... : `vispe.encodings.multimodal`).
* `VLM`: ``timm.create_model('vit_tiny', pe=...)`` -> connector -> `DecoderLM`, fed the Qwen2-VL
  token convention (``vision_start``, one image token per visual token) so the ids come from
  ``rope_index(encoding, input_ids, image_grid_thw=...)`` exactly as in LLM code (transformers' rule).
* `ColourGridTask` / `ColourGridDataset`: images of ``G x G`` coloured cells and the question
  "which colour is at row r, column c?", answered with a colour token; generated on the fly (no
  download), item ``i`` reproducible from ``(seed, split, i)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Literal, Optional, Tuple

import timm
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import vispe
from vispe.encodings.multimodal import MultimodalRoPE, apply_rotary
from vispe.integrations.transformers_vlm import rope_index

__all__ = ['MLPProjector', 'Resampler', 'DecoderLM', 'DecoderBlock', 'VLM', 'ColourGridTask', 'ColourGridDataset',
           'SpecialTokens']


class MLPProjector(nn.Module):
    """Qwen2-VL patch merger: ``merge x merge`` neighbouring patches -> one LM token.

    Args:
        vision_dim: width of the vision tokens.
        lm_dim: width of the language model.
        merge: spatial merge factor (2: a 2x2 window per LM token).
    """

    def __init__(self, vision_dim: int, lm_dim: int, merge: int = 2) -> None:
        super().__init__()
        if merge < 1:
            raise ValueError(f'merge must be >= 1, got {merge}')
        self.merge = merge
        hidden = vision_dim * merge * merge
        self.norm = nn.LayerNorm(vision_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, lm_dim))

    def output_grid(self, grid: Tuple[int, int]) -> Tuple[int, int]:
        return grid[0] // self.merge, grid[1] // self.merge

    def forward(self, x: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        """``x`` ``(B, H*W, C)`` in raster order -> ``(B, H/m * W/m, D)`` in raster order of the merged grid."""
        B, N, C = x.shape
        H, W = grid
        m = self.merge
        if H * W != N or H % m or W % m:
            raise ValueError(f'token grid {grid} must hold {N} tokens and be divisible by merge={m}')
        x = self.norm(x).reshape(B, H // m, m, W // m, m, C).permute(0, 1, 3, 2, 4, 5)
        return self.mlp(x.reshape(B, (H // m) * (W // m), m * m * C))


class Resampler(nn.Module):
    """Learned queries cross-attending to image tokens whose keys carry a vispe 2D encoding.

    Args:
        vision_dim: width of the image tokens.
        lm_dim: width of the queries and outputs.
        num_queries: learned queries (a square number for rotary encodings: they sit on a lattice).
        num_heads: attention heads.
        pe: vispe encoding spec for the keys (``'sincos'``, ``'learned'``, ``'rope_axial'``, ...).
        grid_size: the image token grid at training (for grid-shaped encodings).
    """

    def __init__(self, vision_dim: int, lm_dim: int, num_queries: int = 16, num_heads: int = 4,
                 pe: vispe.registry.PESpec = 'sincos', grid_size: Tuple[int, int] = (8, 8)) -> None:
        super().__init__()
        if lm_dim % num_heads:
            raise ValueError(f'lm_dim={lm_dim} must be divisible by num_heads={num_heads}')
        self.num_heads, self.head_dim = num_heads, lm_dim // num_heads
        self.queries = nn.Parameter(torch.randn(num_queries, lm_dim) * 0.02)
        self.kv_in = nn.Linear(vision_dim, lm_dim)
        self.norm_q, self.norm_kv = nn.LayerNorm(lm_dim), nn.LayerNorm(lm_dim)
        self.q, self.k, self.v = (nn.Linear(lm_dim, lm_dim) for _ in range(3))
        self.proj = nn.Linear(lm_dim, lm_dim)
        self.pe = vispe.create_pe(pe, dim=lm_dim, num_heads=num_heads, depth=1, grid_size=tuple(grid_size))
        g = math.isqrt(num_queries)
        self.query_grid = (g, g) if g * g == num_queries else (1, num_queries)
        if self.pe.capabilities.in_attention and g * g != num_queries:
            raise ValueError(f'encoding {pe!r} acts inside attention, so the queries need positions on a square '
                             f'lattice: num_queries must be a square number, got {num_queries}')

    def output_grid(self, grid: Tuple[int, int]) -> Tuple[int, int]:
        return self.query_grid

    def query_positions(self, grid: Tuple[int, int], device: torch.device) -> vispe.Positions:
        """Queries on a ``g x g`` lattice of cell centres over the ``H x W`` token grid (row, col)."""
        gh, gw = self.query_grid
        rows = (torch.arange(gh, device=device) + 0.5) * grid[0] / gh - 0.5
        cols = (torch.arange(gw, device=device) + 0.5) * grid[1] / gw - 0.5
        return vispe.points(torch.stack(torch.meshgrid(rows, cols, indexing='ij'), -1).reshape(-1, 2))

    def forward(self, x: torch.Tensor, grid: Tuple[int, int]) -> torch.Tensor:
        B, N, _ = x.shape
        x = self.norm_kv(self.kv_in(x))
        pos_k = vispe.grid(*grid, device=x.device)
        key_in = x + self.pe.embedding(pos_k).to(x.dtype) if self.pe.capabilities.additive else x
        queries = self.norm_q(self.queries).expand(B, -1, -1)
        pe = self.pe.prepare(self.query_positions(grid, x.device), pos_k)
        # the normed queries are the attention's input tokens, for encodings that read them (PaPE)
        o = vispe.pe_attention(self._heads(self.q(queries)), self._heads(self.k(key_in)), self._heads(self.v(x)),
                               pe, layer=0, x=queries)
        return self.proj(o.transpose(1, 2).reshape(B, -1, self.num_heads * self.head_dim))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.reshape(t.shape[0], t.shape[1], self.num_heads, self.head_dim).transpose(1, 2)


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: RMSNorm -> causal attention (multimodal rotary) -> RMSNorm -> SwiGLU."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.norm1, self.norm2 = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.q_proj = nn.Linear(dim, num_heads * self.head_dim)
        self.k_proj = nn.Linear(dim, num_kv_heads * self.head_dim)
        self.v_proj = nn.Linear(dim, num_kv_heads * self.head_dim)
        self.o_proj = nn.Linear(num_heads * self.head_dim, dim, bias=False)
        hidden = int(dim * mlp_ratio)
        self.gate, self.up, self.down = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False), \
            nn.Linear(hidden, dim, bias=False)

    def attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).reshape(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).reshape(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)  # the drop-in for transformers' apply_rotary_pos_emb
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, -1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x), cos, sin, mask)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class DecoderLM(nn.Module):
    """A small decoder-only LM whose rotary position-id scheme is an option.

    Args:
        vocab_size: vocabulary size.
        dim: width.
        depth: decoder blocks.
        num_heads: query heads.
        num_kv_heads: key/value heads (GQA); default ``num_heads``.
        scheme: the multimodal encoding (a spec: ``'mrope'``, ``'videorope:delta=2'``, ...).
        scheme_options: more options of the encoding (e.g. ``{'spatial_reset': True}``, ``{'stride': 16}``).
        theta: rotary base.
        mlp_ratio: SwiGLU hidden width ratio.
    """

    def __init__(self, vocab_size: int, dim: int = 64, depth: int = 2, num_heads: int = 4,
                 num_kv_heads: Optional[int] = None, scheme: str = 'mrope',
                 scheme_options: Optional[Dict[str, Any]] = None, theta: float = 10000.0,
                 mlp_ratio: float = 4.0) -> None:
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if dim % num_heads or num_heads % num_kv_heads:
            raise ValueError(f'dim={dim} must be divisible by num_heads={num_heads}, and num_heads by '
                             f'num_kv_heads={num_kv_heads}')
        head_dim = dim // num_heads
        # heads of the encoding: the key/value heads (MHRoPE assigns them to axes; query heads follow theirs)
        self.pe = vispe.create_pe(scheme, dim=num_kv_heads * head_dim, num_heads=num_kv_heads, head_dim=head_dim,
                                  theta=theta, **(scheme_options or {}))
        if not isinstance(self.pe, MultimodalRoPE):
            raise ValueError(f'scheme must be a multimodal encoding (family multimodal), got {scheme!r}')
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(DecoderBlock(dim, num_heads, num_kv_heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    @staticmethod
    def causal_mask(attention_mask: Optional[torch.Tensor], B: int, L: int, device: torch.device) -> torch.Tensor:
        """Bool ``(B, 1, L, L)``: causal, no attention to padding (a padded query sees itself, so no NaN)."""
        causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
        if attention_mask is None:
            return causal.expand(B, 1, L, L)
        keep = attention_mask.bool()[:, None, None, :]
        return (causal & keep) | torch.eye(L, dtype=torch.bool, device=device)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, L, vocab)`` from embeddings ``(B, L, D)`` and ids ``(A, B, L)``."""
        B, L, _ = inputs_embeds.shape
        cos, sin = self.pe.cos_sin(position_ids)
        mask = self.causal_mask(attention_mask, B, L, inputs_embeds.device)
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos.to(x.dtype), sin.to(x.dtype), mask)
        return self.head(self.norm(x))


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the special tokens (Qwen2-VL roles) in the model's vocabulary."""
    pad: int = 0
    bos: int = 1
    vision_start: int = 2
    vision_end: int = 3
    image: int = 4
    video: int = 5

    @property
    def count(self) -> int:
        return 6


class VLM(nn.Module):
    """vispe ViT -> connector (MLP projector with 2x2 merge, or resampler) -> small decoder LM.

    Args:
        vocab_size: LM vocabulary (special tokens included).
        img_size: input image size.
        patch_size: ViT patch size.
        vision_pe: the ViT's vispe encoding spec.
        vision_dim, vision_depth, vision_heads: ViT size (``vit_tiny`` with these dims).
        connector: ``'mlp'`` (2x2 merge) or ``'resampler'``.
        merge: the MLP projector's merge factor.
        num_queries: resampler queries.
        resampler_pe: encoding on the resampler keys.
        lm_dim, lm_depth, lm_heads, lm_kv_heads: LM size.
        scheme: the LM's multimodal encoding (spec); ``scheme_options`` more of its options.
        theta: LM rotary base.
        tokens: special token ids.
    """

    def __init__(
            self,
            vocab_size: int,
            *,
            img_size: int = 32,
            patch_size: int = 4,
            vision_pe: vispe.registry.PESpec = 'rope_axial',
            vision_dim: int = 64,
            vision_depth: int = 2,
            vision_heads: int = 2,
            connector: Literal['mlp', 'resampler'] = 'mlp',
            merge: int = 2,
            num_queries: int = 16,
            resampler_pe: vispe.registry.PESpec = 'sincos',
            lm_dim: int = 64,
            lm_depth: int = 2,
            lm_heads: int = 4,
            lm_kv_heads: Optional[int] = None,
            scheme: str = 'mrope',
            scheme_options: Optional[Dict[str, Any]] = None,
            theta: float = 10000.0,
            tokens: SpecialTokens = SpecialTokens(),
    ) -> None:
        super().__init__()
        if connector not in ('mlp', 'resampler'):
            raise ValueError(f"connector must be 'mlp' or 'resampler', got {connector!r}")
        self.tokens = tokens
        self.vision = timm.create_model('vit_tiny', pe=vision_pe, img_size=img_size, patch_size=patch_size,
                                        embed_dim=vision_dim, depth=vision_depth, num_heads=vision_heads,
                                        num_classes=0, class_token=False, global_pool='avg')
        grid = tuple(self.vision.patch_embed.grid_size)
        if connector == 'mlp':
            self.connector: nn.Module = MLPProjector(vision_dim, lm_dim, merge)
            self.merge = merge
        else:
            self.connector = Resampler(vision_dim, lm_dim, num_queries, lm_heads, resampler_pe, grid)
            self.merge = 1  # the resampler's query lattice is the LM-side grid
        self.lm = DecoderLM(vocab_size, lm_dim, lm_depth, lm_heads, lm_kv_heads, scheme, scheme_options, theta)

    def visual_grid(self, img_size: Tuple[int, int]) -> Tuple[int, int]:
        """LM-side token grid of an image of this size."""
        ph, pw = self.vision.patch_embed.patch_size
        return self.connector.output_grid((img_size[0] // ph, img_size[1] // pw))

    def position_ids(self, input_ids: torch.Tensor, grid: Tuple[int, int],
                     attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """Ids ``(A, B, L)`` of token ids with one image per sample, as LLM code builds them."""
        m = self.merge
        grid_thw = torch.tensor([[1, grid[0] * m, grid[1] * m]], device=input_ids.device).expand(
            input_ids.shape[0], 3)
        ids, _ = rope_index(
            self.lm.pe, input_ids, image_grid_thw=grid_thw, attention_mask=attention_mask,
            image_token_id=self.tokens.image, video_token_id=self.tokens.video,
            vision_start_token_id=self.tokens.vision_start, spatial_merge_size=m, training=self.training)
        return ids

    def forward(self, images: torch.Tensor, input_ids: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits ``(B, L, vocab)``; ``input_ids`` hold ``vision_start`` then one image token per visual token."""
        feats = self.vision.forward_features(images)[:, self.vision.num_prefix_tokens:]
        ph, pw = self.vision.patch_embed.patch_size
        patch_grid = (images.shape[-2] // ph, images.shape[-1] // pw)
        visual = self.connector(feats, patch_grid)
        is_img = input_ids == self.tokens.image
        if int(is_img.sum()) != visual.shape[0] * visual.shape[1]:
            raise ValueError(f'input_ids hold {int(is_img.sum())} image tokens but the images give '
                             f'{visual.shape[0]} x {visual.shape[1]}')
        emb = self.lm.embed(input_ids).masked_scatter(is_img[..., None], visual.to(self.lm.embed.weight.dtype))
        ids = self.position_ids(input_ids, self.connector.output_grid(patch_grid), attention_mask)
        return self.lm(emb, ids, attention_mask)


class ColourGridTask:
    """"Which colour is at row r, column c?" over images of ``G x G`` coloured cells.

    Each cell is a square of one of ``num_colours`` palette colours (plus a little noise). The
    prompt is ``[pad..] bos [filler..] vision_start image*n vision_end Q row_r col_c``, left-padded
    (0 to ``max_filler`` filler tokens vary the length), and the answer is the colour token
    predicted at the last position. Answering needs the LM to tell the visual tokens apart by
    where they are: the question names a cell, and the colours are spread at random.

    Args:
        grid: cells per side ``G``.
        num_colours: palette size.
        max_filler: at most this many filler tokens before the image.
        tokens: special token ids.
    """

    PALETTE = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1],
                            [0.5, 0.5, 0.5]], dtype=torch.float32)

    def __init__(self, grid: int = 4, num_colours: int = 4, max_filler: int = 2,
                 tokens: SpecialTokens = SpecialTokens()) -> None:
        if not 2 <= num_colours <= len(self.PALETTE):
            raise ValueError(f'num_colours must be in [2, {len(self.PALETTE)}], got {num_colours}')
        if grid < 1 or max_filler < 0:
            raise ValueError(f'grid must be >= 1 and max_filler >= 0, got grid={grid}, max_filler={max_filler}')
        self.grid, self.num_colours, self.max_filler, self.tokens = grid, num_colours, max_filler, tokens
        base = tokens.count
        self.filler, self.question = base, base + 1
        self.row0 = base + 2
        self.col0 = self.row0 + grid
        self.colour0 = self.col0 + grid
        self.vocab_size = self.colour0 + num_colours

    def prompt_length(self, visual_tokens: int) -> int:
        """Padded prompt length: bos, fillers, vision_start, image tokens, vision_end, Q, row, col."""
        return 1 + self.max_filler + 1 + visual_tokens + 4

    def sample(self, batch_size: int, img_size: int, visual_tokens: int,
               generator: Optional[torch.Generator] = None) -> Dict[str, torch.Tensor]:
        """``images (B, 3, S, S)``, ``input_ids (B, L)``, ``attention_mask (B, L)``, ``labels (B,)``.

        ``img_size`` must be a multiple of ``grid``; ``visual_tokens`` is the model's number of
        LM-side tokens per image (`VLM.visual_grid`).
        """
        G, g = self.grid, generator
        if img_size % G:
            raise ValueError(f'img_size={img_size} must be a multiple of grid={G}')
        cell = img_size // G
        colours = torch.randint(self.num_colours, (batch_size, G, G), generator=g)
        img = self.PALETTE[colours].permute(0, 3, 1, 2).repeat_interleave(cell, 2).repeat_interleave(cell, 3)
        img = (img - 0.5) / 0.5 + 0.1 * torch.randn(img.shape, generator=g)
        r = torch.randint(G, (batch_size,), generator=g)
        c = torch.randint(G, (batch_size,), generator=g)
        labels = self.colour0 + colours[torch.arange(batch_size), r, c]
        fill = torch.randint(self.max_filler + 1, (batch_size,), generator=g)
        t = self.tokens
        tail = torch.tensor([t.vision_start] + [t.image] * visual_tokens + [t.vision_end, self.question]
                            ).expand(batch_size, -1)
        body = torch.cat([tail, (self.row0 + r)[:, None], (self.col0 + c)[:, None]], 1)
        # left padding: [pad * (max_filler - fill)] bos [filler * fill] body
        pos = torch.arange(1 + self.max_filler)
        pad = pos[None] < (self.max_filler - fill)[:, None]
        head = torch.where(pad, t.pad, torch.where(pos[None] == (self.max_filler - fill)[:, None], t.bos,
                                                    self.filler))
        input_ids = torch.cat([head, body], 1)
        mask = torch.cat([(~pad).long(), torch.ones_like(body)], 1)
        return {'images': img, 'input_ids': input_ids, 'attention_mask': mask, 'labels': labels}

    @staticmethod
    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of the answer predicted at the last (left-padded) position."""
        return F.cross_entropy(logits[:, -1].float(), labels)

    @staticmethod
    def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
        return float((logits[:, -1].argmax(-1) == labels).float().mean())


class ColourGridDataset(Dataset):
    """``size`` items of `ColourGridTask`; item ``i`` is drawn from a generator seeded by ``(seed, split, i)``.

    Items are dicts of ``images (3, S, S)``, ``input_ids (L,)``, ``attention_mask (L,)``,
    ``labels ()``; the default collate stacks them. The same item can be drawn at any ``img_size``
    (with that size's ``visual_tokens``) for the resolution sweep.
    """
    SPLITS = {'train': 0, 'val': 1}

    def __init__(self, task: ColourGridTask, size: int, img_size: int, visual_tokens: int, seed: int = 0,
                 split: Literal['train', 'val'] = 'train') -> None:
        if split not in self.SPLITS:
            raise ValueError(f"split must be one of {tuple(self.SPLITS)}, got {split!r}")
        self.task, self.size, self.img_size, self.visual_tokens = task, size, img_size, visual_tokens
        self.seed, self.split = seed, split

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed((self.seed * 2 + self.SPLITS[self.split]) * 1_000_003 + index)
        item = self.task.sample(1, self.img_size, self.visual_tokens, g)
        return {k: v[0] for k, v in item.items()}
