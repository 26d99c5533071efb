"""DETR (Carion et al., ECCV 2020) with a swappable vispe positional encoding.

The architecture, losses and defaults follow DETR's reference code: a torchvision ResNet, a 1x1
input projection, a post-norm transformer encoder-decoder with learned object queries, Hungarian
matching (scipy) of predictions to targets with classification + L1 + GIoU costs, and the same
three losses on the output of every decoder layer (auxiliary decoding losses).

Where positions enter (this is what vispe makes swappable, ``pe=``):

* **encoder self-attention**: an additive encoding (``'detr_sine'``, ``'detr_learned'``, any
  encoding with ``embedding(pos)``) is added to the inputs of the query and key projections of
  every layer, never to the values, as DETR does; attention-side encodings (RoPE family, iRPE,
  ...) act through `vispe.pe_attention` with the encoder's grid positions. Both may be combined
  (``'detr_sine+irpe:on=k'``).
* **decoder cross-attention** (``cross_pe``): the keys are the encoder tokens, the queries are
  object queries *without* positions. ``'additive'`` adds the additive part to the keys' input
  (DETR's arrangement); ``'keys'`` additionally runs the attention-side hooks with the queries
  placed at position zero (``pe.prepare(zeros, grid)``): a rotary encoding then rotates the
  keys only (``R(0) = I`` on the queries); ``'none'`` gives cross-attention no positions (DETR's
  ablation). An encoding with a logit bias (iRPE, ``swin_rpb``, ...) needs query positions
  (``capabilities.needs_query_positions``), which object queries do not have: ``'keys'`` refuses it
  when the model is built, and ``'auto'`` (default), which is ``'keys'`` otherwise, keeps it to
  encoder self-attention (``'additive'``), as in the iRPE paper's DETR experiments. The policy is
  `vispe.cross_attention.check_cross_pe`.
* the padding mask reaches every encoding through ``Positions.key_padding_mask`` and masks the
  padded keys of every attention (as a boolean ``attn_mask``).

Encoder layers ``0..L_enc-1`` and, with ``cross_pe='keys'``, cross-attention layers
``L_enc..L_enc+L_dec-1`` index the encoding's per-layer parameters. Parameter names follow DETR's
(``transformer.encoder.layers.0.self_attn.in_proj_weight``, ``query_embed``, ``class_embed``,
``bbox_embed``, ``input_proj``).
"""
from __future__ import annotations

import logging
from typing import Any, Dict, List, Literal, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.ops import box_convert, generalized_box_iou
from torchvision.ops.misc import FrozenBatchNorm2d

import vispe
from vispe.cross_attention import CrossPE, check_cross_pe
from vispe.extras import require

__all__ = ['DETR', 'Backbone', 'Transformer', 'HungarianMatcher', 'SetCriterion', 'postprocess', 'pad_images',
           'MLP']

_logger = logging.getLogger(__name__)

_RESNET_CHANNELS = {'resnet18': 512, 'resnet34': 512, 'resnet50': 2048, 'resnet101': 2048, 'resnet152': 2048}


# ----------------------------------------------------------------------------------------- backbone
class Backbone(nn.Module):
    """A torchvision ResNet up to ``layer4`` (stride 32, or 16 with ``dilation``), and its padding mask.

    Args:
        name: ``resnet18`` / ``34`` / ``50`` / ``101`` / ``152``.
        weights: path of a torchvision ResNet state dict (e.g. ``resnet50-0676ba61.pth``); None
            builds it randomly initialised (nothing is downloaded).
        norm: ``'frozen'`` (DETR's FrozenBatchNorm2d, for pretrained weights) or ``'batch'``;
            default: frozen with weights, batch without.
        train_backbone: train the backbone at all. With loaded weights the stem and ``layer1`` stay
            frozen, as in DETR.
        dilation: dilate ``layer4`` instead of striding (DETR-DC5).
    """

    def __init__(self, name: str = 'resnet50', weights: Optional[str] = None,
                 norm: Optional[Literal['frozen', 'batch']] = None, train_backbone: bool = True,
                 dilation: bool = False) -> None:
        super().__init__()
        if name not in _RESNET_CHANNELS:
            raise ValueError(f'backbone must be one of {sorted(_RESNET_CHANNELS)}, got {name!r}')
        if dilation and _RESNET_CHANNELS[name] == 512:
            raise ValueError(f'dilation (DC5) needs a bottleneck ResNet (resnet50 / 101 / 152), got backbone {name!r}')
        norm = norm or ('frozen' if weights else 'batch')
        if norm not in ('frozen', 'batch'):
            raise ValueError(f"backbone_norm must be 'frozen' or 'batch', got {norm!r}")
        body = getattr(torchvision.models, name)(
            weights=None, norm_layer=FrozenBatchNorm2d if norm == 'frozen' else nn.BatchNorm2d,
            replace_stride_with_dilation=[False, False, dilation])
        if weights:
            self._load(body, weights)
        del body.fc, body.avgpool
        self.body = body
        self.num_channels = _RESNET_CHANNELS[name]
        for pname, p in body.named_parameters():
            in_trained_stage = any(s in pname for s in ('layer2', 'layer3', 'layer4')) or not weights
            if not train_backbone or not in_trained_stage:
                p.requires_grad_(False)

    @staticmethod
    def _load(body: nn.Module, path: str) -> None:
        state = torch.load(path, map_location='cpu', weights_only=True)
        for key in ('model', 'state_dict'):
            if isinstance(state, dict) and key in state and isinstance(state[key], dict):
                state = state[key]
        state = {k.removeprefix('module.'): v for k, v in state.items()}
        result = body.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.startswith('fc.')]
        if missing:
            raise ValueError(f'backbone_weights {path!r} lacks {len(missing)} ResNet keys, e.g. {missing[:4]}')
        unexpected = [k for k in result.unexpected_keys if not k.endswith('num_batches_tracked')]
        _logger.info('loaded backbone weights from %s (%d tensors; ignored: %s)', path, len(state),
                     unexpected or 'none')

    def forward(self, images: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        b = self.body
        x = b.maxpool(b.relu(b.bn1(b.conv1(images))))
        x = b.layer4(b.layer3(b.layer2(b.layer1(x))))
        mask = F.interpolate(mask[None].float(), size=x.shape[-2:]).to(torch.bool)[0]
        return x, mask


# ----------------------------------------------------------------------------------------- transformer
class Attention(nn.Module):
    """Multi-head attention with separate query / key / value inputs and vispe's hooks.

    Parameter names equal `torch.nn.MultiheadAttention`'s (``in_proj_weight``, ``in_proj_bias``,
    ``out_proj``), which DETR uses. The logits go through `vispe.pe_attention`, so an encoding's
    attention-side hooks apply and SDPA keeps the fastest kernel they allow.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'hidden_dim={dim} must be divisible by num_heads={num_heads}')
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.dropout = dropout
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * dim))
        self.out_proj = nn.Linear(dim, dim)
        nn.init.xavier_uniform_(self.in_proj_weight)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor, i: int) -> torch.Tensor:
        dim = x.shape[-1]
        w, b = self.in_proj_weight[i * dim:(i + 1) * dim], self.in_proj_bias[i * dim:(i + 1) * dim]
        return F.linear(x, w, b).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                pe: Optional[vispe.PreparedPE] = None, layer: int = 0,
                attn_mask: Optional[torch.Tensor] = None, tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
        q, k, v = self._heads(query, 0), self._heads(key, 1), self._heads(value, 2)
        o = vispe.pe_attention(q, k, v, pe, layer, x=tokens, attn_mask=attn_mask,
                               dropout_p=self.dropout if self.training else 0.0)
        return self.out_proj(o.transpose(1, 2).flatten(2))


class EncoderLayer(nn.Module):
    """DETR's post-norm encoder layer; the additive encoding goes to the q/k inputs only."""

    def __init__(self, dim: int, num_heads: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = Attention(dim, num_heads, dropout)
        self.linear1 = nn.Linear(dim, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, src: torch.Tensor, pos_embed: Optional[torch.Tensor], pe: Optional[vispe.PreparedPE],
                layer: int, attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        qk = src if pos_embed is None else src + pos_embed
        src = self.norm1(src + self.dropout1(self.self_attn(qk, qk, src, pe, layer, attn_mask, tokens=src)))
        src2 = self.linear2(self.dropout(F.relu(self.linear1(src))))
        return self.norm2(src + self.dropout2(src2))


class DecoderLayer(nn.Module):
    """DETR's post-norm decoder layer: query self-attention, cross-attention to the encoder, FFN."""

    def __init__(self, dim: int, num_heads: int, dim_feedforward: int, dropout: float) -> None:
        super().__init__()
        self.self_attn = Attention(dim, num_heads, dropout)
        self.multihead_attn = Attention(dim, num_heads, dropout)
        self.linear1 = nn.Linear(dim, dim_feedforward)
        self.linear2 = nn.Linear(dim_feedforward, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor, query_pos: torch.Tensor,
                key_embed: Optional[torch.Tensor], pe: Optional[vispe.PreparedPE], layer: int,
                attn_mask: Optional[torch.Tensor]) -> torch.Tensor:
        q = tgt + query_pos
        tgt = self.norm1(tgt + self.dropout1(self.self_attn(q, q, tgt)))
        key = memory if key_embed is None else memory + key_embed
        tgt2 = self.multihead_attn(tgt + query_pos, key, memory, pe, layer, attn_mask, tokens=tgt)
        tgt = self.norm2(tgt + self.dropout2(tgt2))
        tgt2 = self.linear2(self.dropout(F.relu(self.linear1(tgt))))
        return self.norm3(tgt + self.dropout3(tgt2))


class Transformer(nn.Module):
    """Containers with DETR's names (``encoder.layers``, ``decoder.layers``, ``decoder.norm``);
    `DETR` drives the layers, because positions and encoding state flow between them."""

    def __init__(self, dim: int = 256, num_heads: int = 8, enc_layers: int = 6, dec_layers: int = 6,
                 dim_feedforward: int = 2048, dropout: float = 0.1) -> None:
        super().__init__()
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            EncoderLayer(dim, num_heads, dim_feedforward, dropout) for _ in range(enc_layers))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList(
            DecoderLayer(dim, num_heads, dim_feedforward, dropout) for _ in range(dec_layers))
        self.decoder.norm = nn.LayerNorm(dim)
        for p in self.parameters():  # DETR's Transformer._reset_parameters
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)


class MLP(nn.Module):
    """DETR's box head: ``num_layers`` linear layers with ReLU between them."""

    def __init__(self, input_dim: int, hidden_dim: int, output_dim: int, num_layers: int) -> None:
        super().__init__()
        hidden = [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(n, k) for n, k in zip([input_dim] + hidden, hidden + [output_dim]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == len(self.layers) - 1 else F.relu(layer(x))
        return x


def pad_images(images: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pad ``(3, H_i, W_i)`` images at the bottom / right to one batch; mask True on padding (DETR's
    ``nested_tensor_from_tensor_list``)."""
    if len(images) == 0:
        raise ValueError('images is an empty list: a batch needs at least one (3, H, W) image')
    h = max(im.shape[-2] for im in images)
    w = max(im.shape[-1] for im in images)
    batch = images[0].new_zeros(len(images), images[0].shape[0], h, w)
    mask = torch.ones(len(images), h, w, dtype=torch.bool, device=images[0].device)
    for i, im in enumerate(images):
        batch[i, :, :im.shape[-2], :im.shape[-1]] = im
        mask[i, :im.shape[-2], :im.shape[-1]] = False
    return batch, mask


# ----------------------------------------------------------------------------------------- DETR
class DETR(nn.Module):
    """DETR with any vispe encoding in encoder self-attention and on the cross-attention keys.

    Outputs ``pred_logits`` ``(B, Q, num_classes + 1)`` (the last class is "no object"),
    ``pred_boxes`` ``(B, Q, 4)`` normalised ``(cx, cy, w, h)`` relative to each unpadded image, and
    with ``aux_loss`` the same for every earlier decoder layer (``aux_outputs``).

    Args:
        num_classes: largest category id + 1 (91 for COCO, as DETR).
        backbone: torchvision ResNet name.
        pe: vispe encoding spec for the encoder (see the module docstring), e.g. ``'detr_sine'``,
            ``'irpe:on=k'``, ``'rope_axial'``, ``'detr_sine+irpe:on=k'``.
        cross_pe: positions in decoder cross-attention: ``'auto'``, ``'keys'``, ``'additive'``, ``'none'``
            (`vispe.cross_attention.check_cross_pe`; ``'keys'`` refuses an encoding with a logit bias).
        hidden_dim: transformer width (256).
        num_heads: attention heads (8).
        enc_layers: encoder layers (6).
        dec_layers: decoder layers (6).
        dim_feedforward: FFN width (2048).
        dropout: dropout in attention and FFN (0.1).
        num_queries: object queries (100).
        aux_loss: return the intermediate decoder outputs for auxiliary losses.
        backbone_weights: path of a torchvision ResNet state dict to load (no download ever).
        backbone_norm: ``'frozen'`` or ``'batch'`` (default: frozen with weights, batch without).
        train_backbone: train the backbone (lr set by the optimiser's groups, see `param_groups`).
        dilation: DC5 variant (dilated ``layer4``).
        grid_size: nominal training feature grid, for encodings with grid-shaped parameters
            (``800 x 1216 / 32``); inputs of any size work.
    """

    def __init__(
            self,
            num_classes: int = 91,
            backbone: str = 'resnet50',
            pe: vispe.registry.PESpec = 'detr_sine',
            cross_pe: CrossPE = 'auto',
            hidden_dim: int = 256,
            num_heads: int = 8,
            enc_layers: int = 6,
            dec_layers: int = 6,
            dim_feedforward: int = 2048,
            dropout: float = 0.1,
            num_queries: int = 100,
            aux_loss: bool = True,
            backbone_weights: Optional[str] = None,
            backbone_norm: Optional[Literal['frozen', 'batch']] = None,
            train_backbone: bool = True,
            dilation: bool = False,
            grid_size: Tuple[int, int] = (25, 38),
    ) -> None:
        super().__init__()
        if num_classes <= 0:
            raise ValueError(f'num_classes must be positive, got {num_classes}')
        # what the encoding does decides how many attention layers it serves; read from a build on the
        # meta device (nothing allocated, initialised or drawn from the random state) before anything is
        # built, then the encoding is built once for real
        ctx = vispe.PEContext(dim=hidden_dim, num_heads=num_heads, depth=enc_layers, grid_size=grid_size)
        caps = vispe.create_pe(pe, ctx, device='meta').capabilities
        if caps.requires:
            raise ValueError(f"pe={pe!r} reads the positions' {', '.join(sorted(caps.requires))}, which DETR's images "
                             f"do not have; choose an image encoding (vispe.list_pes())")
        self.cross_pe = check_cross_pe(caps, cross_pe, encoding=vispe.format_pe_spec(pe))
        self.cross_hooks = self.cross_pe == 'keys' and caps.in_attention
        self.num_classes = num_classes
        self.num_queries = num_queries
        self.aux_loss = aux_loss
        self.backbone = Backbone(backbone, backbone_weights, backbone_norm, train_backbone, dilation)
        self.input_proj = nn.Conv2d(self.backbone.num_channels, hidden_dim, kernel_size=1)
        self.transformer = Transformer(hidden_dim, num_heads, enc_layers, dec_layers, dim_feedforward, dropout)
        self.query_embed = nn.Embedding(num_queries, hidden_dim)
        self.class_embed = nn.Linear(hidden_dim, num_classes + 1)
        self.bbox_embed = MLP(hidden_dim, hidden_dim, 4, 3)

        # cross-attention layers get their own per-layer parameters after the encoder's
        depth = enc_layers + dec_layers if self.cross_hooks else enc_layers
        self.pe = vispe.create_pe(pe, ctx, depth=depth)

    # -- optimisation helpers ------------------------------------------------------------------
    def no_weight_decay(self) -> set:
        """Parameter names the encoding excludes from weight decay (timm's convention)."""
        return {f'pe.{n}' for n in self.pe.no_weight_decay()}

    def group_matcher(self, coarse: bool = False) -> Dict[str, str]:
        """timm's parameter grouping: the backbone, then everything else. With timm's layer-wise lr
        scaling (``layer_decay=0.1``) the backbone trains at DETR's ``lr / 10``."""
        return {'backbone': r'^backbone\.', 'transformer': r'^(?!backbone\.)'}

    def param_groups(self, lr: float = 1e-4, lr_backbone: float = 1e-5, weight_decay: float = 1e-4
                     ) -> List[Dict[str, Any]]:
        """AdamW groups as DETR: backbone at ``lr_backbone``; encoding parameters it names in
        ``no_weight_decay()`` without weight decay."""
        no_decay = self.no_weight_decay()
        groups: Dict[Tuple[float, float], List[nn.Parameter]] = {}
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            key = (lr_backbone if name.startswith('backbone.') else lr, 0.0 if name in no_decay else weight_decay)
            groups.setdefault(key, []).append(p)
        return [dict(params=ps, lr=g_lr, weight_decay=wd) for (g_lr, wd), ps in groups.items()]

    # -- forward -------------------------------------------------------------------------------
    def features(self, images: Union[torch.Tensor, Sequence[torch.Tensor]], mask: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, vispe.Positions]:
        """Backbone + input projection: tokens ``(B, h*w, C)`` and their grid positions (with the
        padding mask). ``images`` is a padded batch with ``mask`` (True on padding) or a list."""
        if not torch.is_tensor(images):
            if mask is not None:
                raise ValueError('mask is for a padded batch of images; a list of images is padded (and masked) here')
            images, mask = pad_images(images)
        if images.dim() != 4 or images.shape[0] == 0:
            raise ValueError(f'images must be (B, 3, H, W) with B >= 1 or a non-empty list of (3, H, W), got '
                             f'{tuple(images.shape)}')
        if mask is None:
            mask = torch.zeros(images.shape[0], *images.shape[-2:], dtype=torch.bool, device=images.device)
        elif not torch.is_tensor(mask) or mask.dtype != torch.bool:
            raise ValueError(f'mask must be a bool tensor, True on padding (DETR\'s convention; transformers\' '
                             f'pixel_mask is the opposite: pass ~pixel_mask.bool()), got '
                             f'{mask.dtype if torch.is_tensor(mask) else type(mask).__name__}')
        elif mask.shape != (images.shape[0], *images.shape[-2:]):
            raise ValueError(f'mask must be (B, H, W) = {(images.shape[0], *images.shape[-2:])} like images '
                             f'{tuple(images.shape)} (True on padding), got {tuple(mask.shape)}')
        feats, mask = self.backbone(images, mask)
        src = self.input_proj(feats)
        h, w = src.shape[-2:]
        pos = vispe.grid(h, w, train_grid=self.pe.ctx.grid_size, device=src.device).replace(
            key_padding_mask=mask.flatten(1))
        return src.flatten(2).transpose(1, 2), pos

    @staticmethod
    def attention_mask(pos: vispe.Positions) -> Optional[torch.Tensor]:
        """Boolean ``(B, 1, 1, N)`` mask (True = attend) of the real keys, None without padding."""
        pad = pos.key_padding_mask
        if pad is None or not bool(pad.any()):
            return None
        return ~pad[:, None, None, :]

    def encode(self, src: torch.Tensor, pos: vispe.Positions) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The encoder: memory ``(B, N, C)`` and the additive embedding it used (None if none).

        A padded batch (``pos.key_padding_mask``) runs with each image at its own grid's positions
        (`vispe.positions.pack_padded_grid`), so an image gets the output it gets alone; the outputs come
        back in ``src``'s token order."""
        packed = vispe.positions.pack_padded_grid(pos)
        if packed is None:
            return self._encode(src, pos)
        memory, pos_embed = self._encode(packed.pack(src), packed.positions)
        return packed.unpack(memory), None if pos_embed is None else packed.unpack(pos_embed)

    def decode(self, memory: torch.Tensor, pos: vispe.Positions, pos_embed: Optional[torch.Tensor]) -> torch.Tensor:
        """The decoder: normed outputs of every layer ``(L_dec, B, Q, C)``; ``memory`` and ``pos_embed`` as
        `encode` returns them."""
        packed = vispe.positions.pack_padded_grid(pos)
        if packed is None:
            return self._decode(memory, pos, pos_embed)
        return self._decode(packed.pack(memory), packed.positions,
                            None if pos_embed is None else packed.pack(pos_embed))

    def _encode(self, src: torch.Tensor, pos: vispe.Positions) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        caps = self.pe.capabilities
        pos_embed = self.pe.embedding(pos).to(src.dtype) if caps.additive else None
        pe = self.pe.prepare(pos) if caps.in_attention else None
        attn_mask = self.attention_mask(pos)
        for i, layer in enumerate(self.transformer.encoder.layers):
            src = layer(src, pos_embed, pe, i, attn_mask)
            if caps.between_blocks:
                src = self.pe.between_blocks(src, pos, i)
        return src, pos_embed

    def _decode(self, memory: torch.Tensor, pos: vispe.Positions, pos_embed: Optional[torch.Tensor]) -> torch.Tensor:
        b = memory.shape[0]
        query_pos = self.query_embed.weight.unsqueeze(0).expand(b, -1, -1)
        tgt = torch.zeros_like(query_pos)
        key_embed = pos_embed if self.cross_pe in ('keys', 'additive') else None
        pe = None
        if self.cross_hooks:  # object queries have no position: place them at the origin
            queries = vispe.points(torch.zeros(self.num_queries, pos.ndim, device=memory.device))
            pe = self.pe.prepare(queries, pos)
        attn_mask = self.attention_mask(pos)
        offset = len(self.transformer.encoder.layers)
        norm = self.transformer.decoder.norm
        outputs = []
        for i, layer in enumerate(self.transformer.decoder.layers):
            tgt = layer(tgt, memory, query_pos, key_embed, pe, offset + i, attn_mask)
            outputs.append(norm(tgt))
        return torch.stack(outputs)

    def forward(self, images: Union[torch.Tensor, Sequence[torch.Tensor]], mask: Optional[torch.Tensor] = None
                ) -> Dict[str, Any]:
        src, pos = self.features(images, mask)
        packed = vispe.positions.pack_padded_grid(pos)  # each image at its own grid's positions
        if packed is not None:
            src, pos = packed.pack(src), packed.positions
        memory, pos_embed = self._encode(src, pos)
        hs = self._decode(memory, pos, pos_embed)
        logits = self.class_embed(hs)
        boxes = self.bbox_embed(hs).sigmoid()
        out: Dict[str, Any] = {'pred_logits': logits[-1], 'pred_boxes': boxes[-1]}
        if self.aux_loss:
            out['aux_outputs'] = [{'pred_logits': a, 'pred_boxes': c} for a, c in zip(logits[:-1], boxes[:-1])]
        return out


# ----------------------------------------------------------------------------------------- matching and losses
def _xyxy(boxes: torch.Tensor) -> torch.Tensor:
    return box_convert(boxes, 'cxcywh', 'xyxy')


class HungarianMatcher(nn.Module):
    """DETR's bipartite matcher: per image, the assignment of targets to queries of least total cost.

    ``cost = cost_bbox * L1(boxes) - cost_class * p(target class) - cost_giou * GIoU(boxes)``,
    solved exactly with `scipy.optimize.linear_sum_assignment`.

    Args:
        cost_class: weight of the classification cost (1).
        cost_bbox: weight of the L1 box cost (5).
        cost_giou: weight of the GIoU cost (2).
    """

    def __init__(self, cost_class: float = 1.0, cost_bbox: float = 5.0, cost_giou: float = 2.0) -> None:
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError('all matcher costs are 0 (cost_class, cost_bbox, cost_giou)')
        self.cost_class = cost_class
        self.cost_bbox = cost_bbox
        self.cost_giou = cost_giou

    @torch.no_grad()
    def cost_matrices(self, outputs: Dict[str, torch.Tensor], targets: Sequence[Dict[str, torch.Tensor]]
                      ) -> List[torch.Tensor]:
        """Per image, the ``(Q, T_i)`` cost of assigning each target to each query (float32, CPU)."""
        bs, nq = outputs['pred_logits'].shape[:2]
        prob = outputs['pred_logits'].flatten(0, 1).float().softmax(-1)
        out_bbox = outputs['pred_boxes'].flatten(0, 1).float()
        tgt_ids = torch.cat([t['labels'] for t in targets]).long()
        tgt_bbox = torch.cat([t['boxes'] for t in targets]).float()
        sizes = [len(t['boxes']) for t in targets]
        if tgt_ids.numel() == 0:
            return [out_bbox.new_zeros(nq, 0).cpu() for _ in targets]
        cost = (self.cost_bbox * torch.cdist(out_bbox, tgt_bbox, p=1)
                - self.cost_class * prob[:, tgt_ids]
                - self.cost_giou * generalized_box_iou(_xyxy(out_bbox), _xyxy(tgt_bbox)))
        cost = cost.view(bs, nq, -1).cpu()
        return [c[i] for i, c in enumerate(cost.split(sizes, -1))]

    @torch.no_grad()
    def forward(self, outputs: Dict[str, torch.Tensor], targets: Sequence[Dict[str, torch.Tensor]]
                ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        """Per image ``(query indices, target indices)``, sorted by query."""
        linear_sum_assignment = require('scipy.optimize', "DETR's Hungarian matching").linear_sum_assignment
        matches = []
        for c in self.cost_matrices(outputs, targets):
            i, j = linear_sum_assignment(c.numpy())
            matches.append((torch.as_tensor(i, dtype=torch.int64), torch.as_tensor(j, dtype=torch.int64)))
        return matches


class SetCriterion(nn.Module):
    """DETR's losses: cross-entropy (no-object class down-weighted by ``eos_coef``), L1 and GIoU on
    the matched boxes (normalised by the number of target boxes across processes), on the final and
    every auxiliary decoder output.

    Args:
        num_classes: as `DETR`'s (the no-object class is index ``num_classes``).
        matcher: the matcher (default DETR's costs).
        eos_coef: weight of the no-object class (0.1).
        weight_dict: loss weights (``loss_ce`` 1, ``loss_bbox`` 5, ``loss_giou`` 2).
    """

    def __init__(self, num_classes: int, matcher: Optional[HungarianMatcher] = None, eos_coef: float = 0.1,
                 weight_dict: Optional[Dict[str, float]] = None) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.matcher = matcher or HungarianMatcher()
        self.weight_dict = dict(weight_dict or {'loss_ce': 1.0, 'loss_bbox': 5.0, 'loss_giou': 2.0})
        empty_weight = torch.ones(num_classes + 1)
        empty_weight[-1] = eos_coef
        self.register_buffer('empty_weight', empty_weight)

    def _check_targets(self, targets: Sequence[Dict[str, torch.Tensor]]) -> None:
        for i, t in enumerate(targets):
            boxes, labels = t['boxes'], t['labels']
            if boxes.dim() != 2 or boxes.shape[-1] != 4:
                raise ValueError(f"targets[{i}]['boxes'] must be (T, 4) normalised (cx, cy, w, h), got "
                                 f"{tuple(boxes.shape)}")
            if labels.shape != boxes.shape[:1] or labels.is_floating_point() or (
                    len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= self.num_classes)):
                raise ValueError(f"targets[{i}]['labels'] must be ({len(boxes)},) integer class ids in "
                                 f"[0, {self.num_classes}), got {labels.tolist()}")
            if len(boxes) and (not bool(torch.isfinite(boxes).all()) or bool((boxes[:, 2:] < 0).any())):
                raise ValueError(f"targets[{i}]['boxes'] must be finite (cx, cy, w, h) with non-negative width and "
                                 f"height, got {boxes.tolist()}")

    def _losses(self, outputs: Dict[str, torch.Tensor], targets: Sequence[Dict[str, torch.Tensor]],
                num_boxes: float) -> Dict[str, torch.Tensor]:
        indices = self.matcher(outputs, targets)
        logits = outputs['pred_logits']
        batch_idx = torch.cat([torch.full_like(src, i) for i, (src, _) in enumerate(indices)]).to(logits.device)
        src_idx = torch.cat([src for src, _ in indices]).to(logits.device)
        target_classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
        target_classes[batch_idx, src_idx] = torch.cat(
            [t['labels'][j] for t, (_, j) in zip(targets, indices)]).long().to(logits.device)
        loss_ce = F.cross_entropy(logits.float().transpose(1, 2), target_classes, self.empty_weight)
        src_boxes = outputs['pred_boxes'][batch_idx, src_idx].float()
        tgt_boxes = torch.cat([t['boxes'][j] for t, (_, j) in zip(targets, indices)]).float().to(logits.device)
        loss_bbox = F.l1_loss(src_boxes, tgt_boxes, reduction='sum') / num_boxes
        giou = torch.diag(generalized_box_iou(_xyxy(src_boxes), _xyxy(tgt_boxes)))
        loss_giou = (1 - giou).sum() / num_boxes
        return {'loss_ce': loss_ce, 'loss_bbox': loss_bbox, 'loss_giou': loss_giou}

    def forward(self, outputs: Dict[str, Any], targets: Sequence[Dict[str, torch.Tensor]],
                num_boxes: Optional[float] = None) -> Dict[str, torch.Tensor]:
        """All losses (``loss_ce``, ``loss_bbox``, ``loss_giou`` and ``_i``-suffixed auxiliary ones) and
        their weighted sum ``loss``. The box losses are normalised by ``num_boxes``, by default the
        mean number of target boxes per process (an all-reduce in distributed runs, as DETR)."""
        if num_boxes is None:
            total = torch.tensor(float(sum(len(t['labels']) for t in targets)), device=outputs['pred_logits'].device)
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.all_reduce(total)
                total = total / torch.distributed.get_world_size()
            num_boxes = float(total)
        self._check_targets(targets)
        num_boxes = max(num_boxes, 1.0)
        losses = self._losses(outputs, targets, num_boxes)
        for i, aux in enumerate(outputs.get('aux_outputs', [])):
            losses.update({f'{k}_{i}': v for k, v in self._losses(aux, targets, num_boxes).items()})
        losses['loss'] = sum(v * self.weight_dict[k.rsplit('_', 1)[0] if k[-1].isdigit() else k]
                             for k, v in losses.items())
        return losses


@torch.no_grad()
def postprocess(outputs: Dict[str, torch.Tensor], target_sizes: torch.Tensor) -> List[Dict[str, torch.Tensor]]:
    """DETR's ``PostProcess``: per image ``scores``, ``labels`` (best real class of each query) and
    ``boxes`` in absolute ``(x0, y0, x1, y1)`` pixels of ``target_sizes`` ``(B, 2)`` = (h, w)."""
    prob = outputs['pred_logits'].float().softmax(-1)
    scores, labels = prob[..., :-1].max(-1)
    h, w = target_sizes.float().unbind(1)
    scale = torch.stack([w, h, w, h], dim=1)[:, None, :].to(prob.device)
    boxes = _xyxy(outputs['pred_boxes'].float()) * scale
    return [{'scores': s, 'labels': l, 'boxes': b} for s, l, b in zip(scores, labels, boxes)]
