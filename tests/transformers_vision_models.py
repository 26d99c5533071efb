"""Tiny transformers vision encoders of every family `patch_vision` supports, built from configs, and their
inputs: shared by the adapter's tests and its docs checks.

The models get larger attention projections and position tables than transformers' init (std 0.02, zeros
for DeiT's table), so that positions visibly change the outputs and a parity test can fail."""
from __future__ import annotations

import importlib
from typing import Dict, Tuple

import torch
from torch import nn

import transformers

PATCH = 8
NATIVE = (32, 32)        # image families: a 4 x 4 grid
OTHER = (48, 40)         # another, non-square size: 6 x 5
SIGLIP2_PATCH = 4
SIGLIP2_NATIVE = 16      # its table: 4 x 4
_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)

FAMILIES = ('vit', 'deit', 'dinov2', 'dinov2_registers', 'siglip', 'clip', 'siglip2', 'dinov3', 'idefics3', 'smolvlm',
            'internvl')


def _config(kind: str) -> transformers.PretrainedConfig:
    image = dict(image_size=NATIVE[0], patch_size=PATCH, **_SIZES)
    if kind == 'vit':
        return transformers.ViTConfig(**image)
    if kind == 'deit':
        return transformers.DeiTConfig(**image)
    if kind == 'dinov2':
        return transformers.Dinov2Config(**image)
    if kind == 'dinov2_registers':
        return transformers.Dinov2WithRegistersConfig(num_register_tokens=2, **image)
    if kind == 'siglip':
        return transformers.SiglipVisionConfig(**image)
    if kind == 'clip':
        return transformers.CLIPVisionConfig(**image)
    if kind == 'siglip2':
        return transformers.Siglip2VisionConfig(patch_size=SIGLIP2_PATCH, num_patches=SIGLIP2_NATIVE, **_SIZES)
    if kind == 'dinov3':
        return transformers.DINOv3ViTConfig(num_register_tokens=2, **image)
    if kind == 'idefics3':
        return transformers.Idefics3VisionConfig(**image)
    if kind == 'smolvlm':
        return transformers.SmolVLMVisionConfig(**image)
    if kind == 'internvl':
        return transformers.InternVLVisionConfig(use_qk_norm=True, use_mean_pooling=False, **image)
    raise ValueError(kind)


_MODELS = {'vit': 'ViTModel', 'deit': 'DeiTModel', 'dinov2': 'Dinov2Model',
           'dinov2_registers': 'Dinov2WithRegistersModel', 'siglip': 'SiglipVisionModel',
           'clip': 'CLIPVisionModel', 'siglip2': 'Siglip2VisionModel', 'dinov3': 'DINOv3ViTModel',
           'idefics3': 'Idefics3VisionTransformer', 'smolvlm': 'SmolVLMVisionTransformer',
           'internvl': 'InternVLVisionModel'}


def sharpen(model: nn.Module, seed: int = 1, projections: Tuple[str, str] = ('q_proj', 'k_proj')) -> nn.Module:
    """q/k projections (named ``projections``) of std 0.3 and position tables of std 1, so positions matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit('.', 2)[-2:]
            if leaf[0] in projections and leaf[1] == 'weight':
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif leaf == ['qkv', 'weight'] and '.attn.' in name:  # Qwen-VL's fused projection: its q and k rows
                qk = 2 * p.shape[0] // 3
                p[:qk].copy_(torch.randn(qk, p.shape[1], generator=g) * 0.3)
            elif 'position_embedding' in name or name.endswith('visual.pos_embed.weight') or name == 'pos_embed.weight':
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def build(kind: str) -> nn.Module:
    """The tiny encoder of family ``kind``, in eval mode."""
    torch.manual_seed(0)
    return sharpen(getattr(transformers, _MODELS[kind])(_config(kind))).eval()


def siglip2_inputs(grids, num_patches: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A SigLIP 2 batch as its processor lays it out: each image's ``h * w`` patches first, zeros after;
    ``pixel_attention_mask`` 1 on the real patches; ``spatial_shapes``."""
    g = torch.Generator().manual_seed(seed)
    width = 3 * SIGLIP2_PATCH ** 2
    pixels = torch.zeros(len(grids), num_patches, width)
    mask = torch.zeros(len(grids), num_patches, dtype=torch.long)
    for b, (h, w) in enumerate(grids):
        pixels[b, :h * w] = torch.randn(h * w, width, generator=g)
        mask[b, :h * w] = 1
    return pixels, mask, torch.tensor(grids)


def inputs(kind: str, size: Tuple[int, int] = NATIVE, batch: int = 2, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Keyword inputs of one forward at ``size`` (pixels; a SigLIP 2 grid of ``size / 8`` patches of 4)."""
    if kind == 'siglip2':
        grid = (size[0] // 8, size[1] // 8)
        pixels, mask, shapes = siglip2_inputs([grid] * batch, grid[0] * grid[1], seed)
        return dict(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=shapes)
    g = torch.Generator().manual_seed(seed)
    return dict(pixel_values=torch.randn(batch, 3, *size, generator=g))


def canvas_inputs(seed: int = 0) -> Dict[str, torch.Tensor]:
    """An Idefics3 / SmolVLM batch of three images of different sizes padded on one 48 x 56 canvas (6 x 7
    patches): ``patch_attention_mask`` True on each image's top-left rectangle of patches."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(CANVAS_GRIDS), 6, 7, dtype=torch.bool)
    for b, (h, w) in enumerate(CANVAS_GRIDS):
        mask[b, :h, :w] = True
    return dict(pixel_values=torch.randn(len(CANVAS_GRIDS), 3, 48, 56, generator=g), patch_attention_mask=mask)


CANVAS_GRIDS = [(6, 7), (3, 5), (6, 2)]


def host_kwargs(kind: str, size: Tuple[int, int]) -> Dict[str, bool]:
    """What the unpatched model needs to take ``size``: ``interpolate_pos_encoding=True`` where it has it."""
    if kind in ('vit', 'deit', 'siglip', 'clip') and size != NATIVE:
        return dict(interpolate_pos_encoding=True)
    return {}


# ------------------------------------------------------------------ packed towers (Qwen-VL): one sequence of images
QWEN_PATCH = 8
QWEN_FAMILIES = ('qwen2_vl', 'qwen2_5_vl', 'qwen3_vl')
QWEN_NATIVE = (1, 4, 4)             # Qwen3-VL's table: 4 x 4
QWEN_OTHER = (1, 6, 8)              # another size the 2 x 2 merge divides
QWEN_PACKED = [(1, 4, 4), (1, 6, 4), (2, 2, 8), (1, 8, 6)]   # images of different sizes and a 2-frame video
_QWEN = dict(depth=2, num_heads=2, patch_size=QWEN_PATCH, spatial_merge_size=2, temporal_patch_size=2)


def qwen_config(kind: str) -> transformers.PretrainedConfig:
    if kind == 'qwen2_vl':
        return transformers.Qwen2VLVisionConfig(embed_dim=32, hidden_size=32, mlp_ratio=2, **_QWEN)
    if kind == 'qwen2_5_vl':  # windows of 2 x 2 merge blocks (4 x 4 patches); block 1 attends globally
        return transformers.Qwen2_5_VLVisionConfig(hidden_size=32, intermediate_size=64, out_hidden_size=32,
                                                   window_size=32, fullatt_block_indexes=[1], **_QWEN)
    if kind == 'qwen3_vl':
        return transformers.Qwen3VLVisionConfig(hidden_size=32, intermediate_size=64, out_hidden_size=32,
                                                num_position_embeddings=16, deepstack_visual_indexes=[0], **_QWEN)
    raise ValueError(kind)


_QWEN_MODELS = {'qwen2_vl': 'qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel',
                'qwen2_5_vl': 'qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel',
                'qwen3_vl': 'qwen3_vl.modeling_qwen3_vl.Qwen3VLVisionModel'}


def build_qwen(kind: str) -> nn.Module:
    """The tiny Qwen-VL vision tower of ``kind``, in eval mode."""
    module, name = _QWEN_MODELS[kind].rsplit('.', 1)
    cls = getattr(importlib.import_module(f'transformers.models.{module}'), name)
    torch.manual_seed(0)
    return sharpen(cls(qwen_config(kind))).eval()


def qwen_inputs(grids, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A Qwen-VL tower's inputs for images / videos of ``grids`` ``[(t, h, w), ...]`` (patches): their
    flattened patches one after the other (``hidden_states``) and ``grid_thw``."""
    g = torch.Generator().manual_seed(seed)
    total = sum(t * h * w for t, h, w in grids)
    width = 3 * 2 * QWEN_PATCH ** 2
    return dict(hidden_states=torch.randn(total, width, generator=g), grid_thw=torch.tensor(grids))


_QWEN_VLM = {'qwen2_vl': ('Qwen2VLForConditionalGeneration', 'Qwen2VLConfig'),
             'qwen2_5_vl': ('Qwen2_5_VLForConditionalGeneration', 'Qwen2_5_VLConfig'),
             'qwen3_vl': ('Qwen3VLForConditionalGeneration', 'Qwen3VLConfig')}
QWEN_IMAGE_TOKEN = 60


def build_qwen_vlm(kind: str) -> nn.Module:
    """A whole tiny Qwen-VL model (vision tower, merger, one-layer language model), in eval mode."""
    model_cls, config_cls = (getattr(transformers, n) for n in _QWEN_VLM[kind])
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                intermediate_size=64, vocab_size=64,
                rope_parameters=dict(rope_type='default', rope_theta=10000.0, mrope_section=[2, 3, 3]))
    config = config_cls(vision_config=qwen_config(kind).to_dict(), text_config=text, image_token_id=QWEN_IMAGE_TOKEN,
                        video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)
    torch.manual_seed(0)
    return sharpen(model_cls(config)).eval()


def qwen_vlm_inputs(grids, seed: int = 0) -> Dict[str, torch.Tensor]:
    """A prompt with the images of ``grids`` (each ``t * h * w / 4`` image tokens between start / end tokens)."""
    x = qwen_inputs(grids, seed)
    ids = [1]
    for t, h, w in grids:
        ids += [62] + [QWEN_IMAGE_TOKEN] * (t * h * w // 4) + [63, 2]
    ids = torch.tensor([ids])
    return dict(input_ids=ids, pixel_values=x['hidden_states'], image_grid_thw=x['grid_thw'],
                mm_token_type_ids=(ids == QWEN_IMAGE_TOKEN).long())


# ------------------------------------------------------------------ Pixtral: images of their own sizes on one sequence
PIXTRAL_SIZES = {'native': [(32, 32), (32, 32)], 'other': [(48, 40)], 'packed': [(48, 56), (24, 40), (48, 16), (8, 8)]}


def build_pixtral() -> nn.Module:
    """The tiny Pixtral vision encoder (a 4 x 4 training grid of patches of 8), in eval mode."""
    torch.manual_seed(0)
    config = transformers.PixtralVisionConfig(image_size=NATIVE[0], patch_size=PATCH, head_dim=16, **_SIZES)
    return sharpen(transformers.PixtralVisionModel(config)).eval()


def pixtral_inputs(sizes, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Images of ``sizes`` (pixels) padded at the bottom / right to one canvas, and their ``image_sizes``."""
    g = torch.Generator().manual_seed(seed)
    canvas = (max(h for h, _ in sizes), max(w for _, w in sizes))
    return dict(pixel_values=torch.randn(len(sizes), 3, *canvas, generator=g), image_sizes=torch.tensor(sizes))


PACKED_FAMILIES = QWEN_FAMILIES + ('pixtral',)


def build_packed(kind: str) -> nn.Module:
    return build_pixtral() if kind == 'pixtral' else build_qwen(kind)


def packed_inputs(kind: str, which: str, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Inputs of a packed tower: ``which`` is ``'native'`` (the training grid), ``'other'`` (another size) or
    ``'packed'`` (images of different sizes, for Qwen-VL a video among them)."""
    if kind == 'pixtral':
        return pixtral_inputs(PIXTRAL_SIZES[which], seed)
    return qwen_inputs({'native': [QWEN_NATIVE] * 2, 'other': [QWEN_OTHER], 'packed': QWEN_PACKED}[which], seed)


def packed_images(kind: str, batch: Dict[str, torch.Tensor]):
    """Each image of a packed batch: its ``(start, end)`` in the sequence of tokens and its inputs alone."""
    start = 0
    if kind == 'pixtral':
        for b, (h, w) in enumerate(batch['image_sizes'].tolist()):
            end = start + (h // PATCH) * (w // PATCH)
            yield (start, end), dict(pixel_values=batch['pixel_values'][b:b + 1, :, :h, :w])
            start = end
        return
    for t, h, w in batch['grid_thw'].tolist():
        end = start + t * h * w
        yield (start, end), dict(hidden_states=batch['hidden_states'][start:end], grid_thw=torch.tensor([(t, h, w)]))
        start = end


# ------------------------------------------------------------------ video: VideoMAE's tubelets
VIDEO_NATIVE = (4, 32, 32)          # frames, height, width: a 2 x 4 x 4 grid of tubelets 2 x 8 x 8
VIDEO_OTHER = (6, 40, 24)           # 3 x 5 x 3


def build_videomae() -> nn.Module:
    """The tiny VideoMAE encoder (width 48: a 3D sin-cos table splits it in 6), in eval mode."""
    torch.manual_seed(0)
    config = transformers.VideoMAEConfig(image_size=NATIVE[0], patch_size=PATCH, num_frames=VIDEO_NATIVE[0],
                                         tubelet_size=2, **{**_SIZES, 'hidden_size': 48})  # 3 axes x sin, cos
    return sharpen(transformers.VideoMAEModel(config)).eval()


def video_inputs(size=VIDEO_NATIVE, batch: int = 2, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    frames, h, w = size
    return dict(pixel_values=torch.randn(batch, frames, 3, h, w, generator=g))


# ------------------------------------------------------------------ video: V-JEPA 2's tubelets and its own 3D q/k map
def vjepa2_config(heads: int = 2) -> transformers.VJEPA2Config:
    """A tiny V-JEPA 2 (the VideoMAE clip: a 2 x 4 x 4 grid of tubelets 2 x 8 x 8; width 48; ``heads=2``: head
    width 24, three axis groups of 8 channels; ``heads=3``: 16, groups of 4 and 4 channels that pass through)."""
    return transformers.VJEPA2Config(patch_size=PATCH, crop_size=NATIVE[0], frames_per_clip=VIDEO_NATIVE[0],
                                     tubelet_size=2, hidden_size=48, num_attention_heads=heads, num_hidden_layers=2,
                                     mlp_ratio=2.0, pred_hidden_size=24, pred_num_attention_heads=2,
                                     pred_num_hidden_layers=1, num_pooler_layers=1)


def build_vjepa2(cls: str = 'VJEPA2Model', heads: int = 2) -> nn.Module:
    """A tiny V-JEPA 2 model (encoder and predictor; or its classifier), q/k projections sharpened, in eval mode."""
    torch.manual_seed(0)
    return sharpen(getattr(transformers, cls)(vjepa2_config(heads)), projections=('query', 'key')).eval()


def vjepa2_inputs(size=VIDEO_NATIVE, batch: int = 2, seed: int = 0) -> Dict[str, torch.Tensor]:
    return dict(pixel_values_videos=video_inputs(size, batch, seed)['pixel_values'])
