"""The transformers adapter's rope_index (a multimodal encoding's ids of Qwen-VL token ids) against the
installed transformers' own get_rope_index, family by family, on random batches (images, timed and untimed
videos, left and right padding): ids of real tokens, ids of pads and rope_deltas, exactly."""
import random

import pytest
import torch

transformers = pytest.importorskip('transformers')

import vispe  # noqa: E402
from vispe.integrations.transformers_vlm import rope_index  # noqa: E402
from vispe_models.qwen_vl import FAMILIES, TOKENS, qwen_vl_batch, tiny_qwen_vl  # noqa: E402

OWN = {'qwen2_vl': dict(scheme='mrope', tokens_per_second=None, video_blocks='video'),
       'qwen2_5_vl': dict(scheme='mrope', tokens_per_second=2, video_blocks='video'),
       'qwen3_vl': dict(scheme='mrope_interleave', video_blocks='frame'),
       'qwen3_vl_moe': dict(scheme='mrope_interleave', video_blocks='frame')}
IDS = {k: v for k, v in TOKENS.items() if k in ('image_token_id', 'video_token_id', 'vision_start_token_id')}
_MODELS = {}


def random_samples(rng, B=3):
    out = []
    for _ in range(B):
        segs = [('text', rng.randint(1, 4))]
        for _ in range(rng.randint(0, 3)):
            if rng.random() < 0.5:
                segs.append(('image', (2 * rng.randint(1, 3), 2 * rng.randint(1, 3))))
            else:  # seconds per temporal patch: untimed, or values whose products are not integers
                secs = rng.choice([None, 0.5, 0.75, 1.0 / 3, 2.0, 1.25])
                segs.append(('video', (rng.randint(1, 5), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)), secs))
            segs.append(('text', rng.randint(0, 3)))
        out.append(segs)
    return out


def hf_rope_index(family, batch):
    if family not in _MODELS:
        _MODELS[family] = tiny_qwen_vl(family, layers=1)
    keys = ('mm_token_type_ids', 'image_grid_thw', 'video_grid_thw', 'attention_mask', 'second_per_grid_ts')
    args = {k: batch[k] for k in keys if k in batch}
    if 'video_grid_thw' in args:
        args['video_grid_thw'] = args['video_grid_thw'].clone()  # Qwen3-VL edits it in place
    with torch.no_grad():
        return _MODELS[family].model.get_rope_index(batch['input_ids'], **args)


def position_ids(input_ids, scheme='mrope', tokens_per_second=2.0, **kw):
    """Ids and rope_deltas of token ids under the encoding ``scheme`` (with ``tokens_per_second`` where it
    takes one), by the transformers adapter's `rope_index`."""
    pe = vispe.create_pe({'name': scheme, 'tokens_per_second': tokens_per_second}, dim=64, num_heads=4)
    return rope_index(pe, input_ids, **kw)


def vispe_rope_index(family, batch, **kw):
    own = dict(OWN[family])
    return position_ids(batch['input_ids'], image_grid_thw=batch.get('image_grid_thw'),
                        video_grid_thw=batch.get('video_grid_thw'), second_per_grid_ts=batch.get('second_per_grid_ts'),
                        attention_mask=batch['attention_mask'], spatial_merge_size=2, **IDS, **own, **kw)


@pytest.mark.parametrize('family', FAMILIES)
@pytest.mark.parametrize('side', ['left', 'right'])
def test_token_ids_equal_transformers_get_rope_index_with_padding(family, side):
    rng = random.Random(10 * FAMILIES.index(family) + (side == 'left'))
    for trial in range(8):
        batch = qwen_vl_batch(family, random_samples(rng), seed=trial, padding_side=side)
        if 'image_grid_thw' not in batch and 'video_grid_thw' not in batch:
            continue
        ref, ref_delta = hf_rope_index(family, batch)
        ids, delta = vispe_rope_index(family, batch)
        assert torch.equal(ids, ref), (family, side, trial)  # real tokens and pads (0)
        assert torch.equal(delta, ref_delta.to(delta.dtype)), (family, side, trial)


@pytest.mark.parametrize('family', ['qwen2_vl', 'qwen2_5_vl'])
def test_mm_token_type_ids_and_vision_start_find_the_same_blocks(family):
    batch = qwen_vl_batch(family, random_samples(random.Random(7), B=4), seed=3)
    by_type = vispe_rope_index(family, batch, mm_token_type_ids=batch['mm_token_type_ids'])
    by_start = vispe_rope_index(family, batch)
    assert torch.equal(by_type[0], by_start[0]) and torch.equal(by_type[1], by_start[1])


def test_text_after_a_video_follows_each_rule():
    """The issue's case: T=4 temporal patches of 4x4 merged tokens (8x8 patches) after 2 text tokens."""
    ids = torch.tensor([[5, 6, 58] + [61] * 64 + [59, 7]])
    grid = torch.tensor([[4, 8, 8]])
    kw = dict(video_grid_thw=grid, spatial_merge_size=2, **IDS, scheme='mrope', video_blocks='video')
    five, d5 = position_ids(ids, tokens_per_second=None, **kw)
    four, d4 = position_ids(ids, tokens_per_second=None, rule='4.x', **kw)
    # 5.x: vision_end at start 3 + max(H, W) = 7; 4.x: max over axes (3 + 3 on t, h, w) + 1 = 7 as well
    assert five[0, 0, 67].item() == 7 and four[0, 0, 67].item() == 7
    timed, dt = position_ids(ids, tokens_per_second=2, second_per_grid_ts=torch.tensor([1.0]), **kw)
    timed4, _ = position_ids(ids, tokens_per_second=2, second_per_grid_ts=torch.tensor([1.0]), rule='4.x', **kw)
    # timed (2 ids per temporal patch): t reaches 3 + 6 = 9; 5.x still continues at 3 + 4, 4.x at 10
    assert timed[0, 0, 66].item() == 9 and timed[0, 0, 67].item() == 7 and timed4[0, 0, 67].item() == 10
    # 5.x rope_delta: largest id + 1 - real tokens = 10 - 69
    assert dt.item() == 10 - 69


def test_pads_and_deltas_under_each_rule():
    ids = torch.tensor([[0, 0, 5, 58, 60, 60, 60, 60, 59], [5, 6, 7, 58, 60, 60, 60, 60, 59]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
    kw = dict(image_grid_thw=grid, attention_mask=mask, spatial_merge_size=2, **IDS)
    five, d5 = position_ids(ids, **kw)
    four, d4 = position_ids(ids, rule='4.x', **kw)
    assert five[:, 0, :2].eq(0).all() and four[:, 0, :2].eq(1).all()
    # next position: 2 text + 2 image extent + 1 text = 5 (row 0) and 7 (row 1)
    assert d5.tolist() == [[5 - 7], [7 - 9]] and d4.tolist() == [[5 - 9], [7 - 9]]
