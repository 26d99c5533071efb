"""Multimodal position ids and rotary: the ENCODINGS.md worked example, hand-computed cases of every
multimodal encoding, a token-by-token reference of each (the slow path) against the vectorised builder,
Qwen2-VL's get_rope_index loop on token ids, padding, decoding continuation and pair layouts."""
import inspect
import math
import random

import pytest
import torch

import vispe
from vispe import Image, Text, Video, sequence
from vispe.encodings.multimodal import apply_rotary, decode_position_ids
from vispe.integrations.transformers_vlm import QWEN2_VL_TOKEN_IDS, rope_index
from vispe.positions.multimodal import padding_mask
from vispe.rotary import apply_pair_rotation

IMG, VID, VS = QWEN2_VL_TOKEN_IDS['image_token_id'], QWEN2_VL_TOKEN_IDS['video_token_id'], \
    QWEN2_VL_TOKEN_IDS['vision_start_token_id']
VE = 151653  # <|vision_end|>, text to the position ids
ALL = tuple(n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal')
_TOKEN_KEYS = ('image_grid_thw', 'video_grid_thw', 'second_per_grid_ts', 'attention_mask', 'image_token_id',
               'video_token_id', 'vision_start_token_id', 'spatial_merge_size', 'video_blocks', 'mm_token_type_ids',
               'rule', 'pad_value')


def encoding(scheme='mrope', head_dim=64, num_heads=4, **options):
    return vispe.create_pe({'name': scheme, **options}, dim=head_dim * num_heads, num_heads=num_heads,
                           head_dim=head_dim)


def position_ids(inputs, scheme='mrope', training=False, generator=None, padding_side='right', **options):
    """Ids and rope_delta of a layout, a batch of layouts (`vispe.sequence`) or Qwen-VL token ids (the
    transformers adapter's `rope_index`) under the encoding ``scheme`` with ``options``."""
    tokens = {k: options.pop(k) for k in _TOKEN_KEYS if k in options}
    pe = encoding(scheme, **options)
    if torch.is_tensor(inputs):
        return rope_index(pe, inputs, training=training, generator=generator, **tokens)
    return pe.position_ids(sequence(inputs, padding_side=padding_side), training=training, generator=generator)


def rotary(head_dim, theta=1e6, scheme='mrope', num_heads=1, **options):
    """The encoding whose ``cos_sin`` / ``table`` / ``pair_layout`` the rotary tests read."""
    return encoding(scheme, head_dim=head_dim, num_heads=num_heads, theta=theta, **options)


# ---------------------------------------------------------------------------------------------- references
def reference_ids(layout, scheme, tokens_per_second=2.0, spatial_reset=False, delta=2, stride=64, tile=256):
    """Token-by-token ids straight from the ENCODINGS.md formulas (Python loops: the slow path)."""
    rows, cur = [], 0  # cur: next free position

    for seg in layout:
        if isinstance(seg, Text):
            for i in range(seg.n):
                rows.append([cur + i] * (4 if scheme == 'vrope' else 1 if scheme in ('rope_1d', 'v2pe') else 3))
            cur += seg.n
            continue
        T, H, W = seg.merged_grid
        sec = seg.second_per_grid

        def tau(t):
            if sec is None or tokens_per_second is None:
                return t
            return math.floor(t * sec * tokens_per_second)

        if scheme == 'rope_1d':
            for i in range(T * H * W):
                rows.append([cur + i])
            cur += T * H * W
        elif scheme == 'v2pe':
            d = stride / tile
            for k in range(1, T * H * W + 1):
                rows.append([cur - 1 + k * d])
            cur = math.ceil(cur - 1 + T * H * W * d) + 1
        elif scheme == 'vrope':
            span = H + W - 1
            for t in range(T):
                for h in range(H):
                    for w in range(W):
                        u = [h + w, h + (W - 1 - w), (H - 1 - h) + w, (H - 1 - h) + (W - 1 - w)]
                        rows.append([cur + t * span + x for x in u])
            cur += T * span
        elif scheme == 'hope':  # VideoRoPE's layout with the stride 1 outside training
            for t in range(T):
                for h in range(H):
                    for w in range(W):
                        rows.append([cur + t, cur + t + h - (H - 1) // 2, cur + t + w - (W - 1) // 2])
            cur = cur + T
        elif scheme == 'circlerope':  # defaults: radius 10, alpha 0.5, centred grid, no mixing
            u = [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]
            v = [-1 / math.sqrt(6), -1 / math.sqrt(6), 2 / math.sqrt(6)]  # (1, 1, 1)/sqrt 3 x u
            pts = [(w - (W - 1) / 2, h - (H - 1) / 2) for h in range(H) for w in range(W)]
            th = [math.atan2(y, x) for x, y in pts]
            lo, hi = min(th), max(th)
            ring = []
            for k, a in enumerate(th):
                norm = (a - lo) / (hi - lo) * 2 * math.pi if hi > lo else a
                ang = 0.5 * norm + 0.5 * 2 * math.pi * k / (H * W)
                x, y = 10 * math.cos(ang), 10 * math.sin(ang)
                ring.append([x * u[2] + y * v[2], x * u[1] + y * v[1], x * u[0] + y * v[0]])  # (t, h, w)
            top = max(max(r) for r in ring) + T - 1
            for t in range(T):
                rows += [[cur + t + c for c in r] for r in ring]
            cur = cur + top + 1
        elif scheme == 'videorope':
            tmax = 0
            for t in range(T):
                tt = cur + delta * tau(t)
                tmax = max(tmax, tt)
                for h in range(H):
                    for w in range(W):
                        rows.append([tt, tt + h - (H - 1) // 2, tt + w - (W - 1) // 2])
            cur = tmax + 1
        else:  # mrope family
            m = 0
            for t in range(T):
                for h in range(H):
                    for w in range(W):
                        ids = [cur + tau(t), cur + h, cur + w]
                        m = max(m, *ids)
                        if spatial_reset:
                            ids = [cur + tau(t), h, w]
                        rows.append(ids)
            cur = m + 1
    return torch.tensor(rows, dtype=torch.float64).t(), cur


def hf_get_rope_index(input_ids, image_grid_thw, video_grid_thw, second_per_grid_ts, attention_mask,
                      merge=2, tokens_per_second=2):
    """Qwen2.5-VL's get_rope_index loop (transformers), with the interval kept as float before the floor."""
    B, L = input_ids.shape
    position_ids = torch.ones(3, B, L, dtype=torch.long)
    deltas = []
    ii = vi = 0
    for b in range(B):
        toks = input_ids[b][attention_mask[b] == 1].tolist()
        starts = [i for i, x in enumerate(toks) if x == VS]
        kinds = [toks[i + 1] for i in starts if i + 1 < len(toks)]
        n_img, n_vid = kinds.count(IMG), kinds.count(VID)
        pos, st = [], 0
        rem_i, rem_v = n_img, n_vid
        for _ in range(n_img + n_vid):
            ed_i = toks.index(IMG, st) if rem_i > 0 else len(toks) + 1
            ed_v = toks.index(VID, st) if rem_v > 0 else len(toks) + 1
            if ed_i < ed_v:
                t, h, w = image_grid_thw[ii].tolist()
                sec = 0.0
                ii += 1
                rem_i -= 1
                ed = ed_i
            else:
                t, h, w = video_grid_thw[vi].tolist()
                sec = float(second_per_grid_ts[vi]) if second_per_grid_ts is not None else 1.0
                vi += 1
                rem_v -= 1
                ed = ed_v
            h, w = h // merge, w // merge
            st_idx = max(max(p) for p in pos) + 1 if pos else 0
            for k in range(ed - st):
                pos.append([st_idx + k] * 3)
            for tt in range(t):
                for hh in range(h):
                    for ww in range(w):
                        off = st_idx + ed - st
                        pos.append([off + int(tt * sec * tokens_per_second), off + hh, off + ww])
            st = ed + t * h * w
        if st < len(toks):
            st_idx = max(max(p) for p in pos) + 1 if pos else 0
            for k in range(len(toks) - st):
                pos.append([st_idx + k] * 3)
        p = torch.tensor(pos).t()
        position_ids[:, b, attention_mask[b] == 1] = p
        deltas.append(int(p.max()) + 1 - L)
    return position_ids, torch.tensor(deltas)[:, None]


def rope_1d_cos_sin(positions, head_dim, theta):
    """Llama's rotary embedding: inv_freq = 1/theta^(arange(0, d, 2)/d), emb = cat(freqs, freqs)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x[..., :x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def random_layout(rng, n_visual=3, video=True):
    lay = [Text(rng.randint(0, 4))]
    for _ in range(n_visual):
        if video and rng.random() < 0.4:
            fps = rng.choice([None, 1.0, 2.0, 3.0, 0.5])
            lay.append(Video(grid=(rng.randint(1, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)), fps=fps))
        else:
            lay.append(Image(grid=(1, 2 * rng.randint(1, 4), 2 * rng.randint(1, 3))))
        lay.append(Text(rng.randint(0, 3)))
    return lay


def to_token_ids(layout):
    """Qwen2-VL token ids of a layout whose visual segments are each preceded by a vision_start text token."""
    toks, img, vid, secs = [], [], [], []
    for i, seg in enumerate(layout):
        if isinstance(seg, Text):
            before_visual = i + 1 < len(layout) and not isinstance(layout[i + 1], Text)
            toks += [7] * (seg.n - 1) + [VS if before_visual else 7] if seg.n else []
        else:
            assert toks and toks[-1] == VS
            tok = IMG if isinstance(seg, Image) else VID
            toks += [tok] * seg.num_tokens
            (img if tok == IMG else vid).append(list(seg.grid) if len(seg.grid) == 3 else [1, *seg.grid])
            if tok == VID:
                secs.append(seg.second_per_grid)
    return toks, img, vid, secs


def with_vision_start(layout):
    """Make every visual segment follow a text segment that ends with vision_start (ids unchanged)."""
    out = []
    for seg in layout:
        if not isinstance(seg, Text) and not (out and isinstance(out[-1], Text) and out[-1].n > 0):
            out.append(Text(1))
        out.append(seg)
    return out


def ids_of(layout, scheme, **opts):
    ids, delta = position_ids(layout, scheme=scheme, **opts)
    return ids, delta


# ---------------------------------------------------------------------------------------------- worked example
def test_mrope_worked_example_from_encodings_md():
    # text x3, vision-start, a 2x2 merged image (4x4 patches, merge 2), vision-end, text x2
    ids, delta = position_ids([Text(4), Image(grid=(1, 4, 4), merge=2), Text(3)], scheme='mrope')
    assert ids.tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8],
                            [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8],
                            [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]]
    assert int(delta) == 9 - 11


def test_mrope_worked_example_through_token_ids():
    input_ids = torch.tensor([[5, 6, 7, VS, IMG, IMG, IMG, IMG, 8, 9, 10]])
    ids, delta = position_ids(input_ids, image_grid_thw=torch.tensor([[1, 4, 4]]), scheme='mrope')
    assert ids[:, 0].tolist() == [[0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8],
                                  [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8],
                                  [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8]]
    assert delta.tolist() == [[-2]]


# ---------------------------------------------------------------------------------------------- pure text
@pytest.mark.parametrize('scheme', ALL)
def test_pure_text_ids_are_the_running_index_on_every_axis(scheme):
    ids, delta = position_ids([Text(5), Text(7)], scheme=scheme)
    assert torch.equal(ids.double(), torch.arange(12, dtype=torch.float64).expand_as(ids))
    assert float(delta) == 0


@pytest.mark.parametrize('scheme', [s for s in ALL if s != 'hope'])
def test_pure_text_rotary_equals_1d_rope_exactly(scheme):
    hd, theta = 64, 1e6
    ids, _ = position_ids([[Text(37)], [Text(20)]], scheme=scheme, padding_side='left')
    heads = dict(num_heads=4, head_sections=(1, 2, 1)) if scheme == 'mhrope' else {}  # only mhrope assigns heads
    rot = rotary(hd, theta=theta, scheme=scheme, **heads)
    cos, sin = rot.cos_sin(ids)
    ref_cos, ref_sin = rope_1d_cos_sin(ids[0], hd, theta)
    if scheme == 'mhrope':
        ref_cos, ref_sin = ref_cos[:, None].expand_as(cos), ref_sin[:, None].expand_as(sin)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, hd, generator=g)
    k = torch.randn(2, 4, 37, hd, generator=g)
    q2, k2 = apply_rotary(q, k, cos, sin)
    c, s = rope_1d_cos_sin(ids[0], hd, theta)
    assert torch.equal(q2, q * c[:, None] + rotate_half(q) * s[:, None])
    assert torch.equal(k2, k * c[:, None] + rotate_half(k) * s[:, None])


def test_hope_temporal_pairs_are_nope_and_the_rest_is_1d_rope_on_text():
    hd, theta = 64, 1e6
    ids, _ = position_ids([Text(37)], scheme='hope')
    rot = rotary(hd, theta=theta, scheme='hope')
    cos, sin = rot.cos_sin(ids)
    ref_cos, ref_sin = rope_1d_cos_sin(ids[0], hd, theta)
    nope = torch.tensor([c == '-' for c in rot.pair_layout] * 2)
    assert rot.pair_layout[0] == '-' and rot.pair_layout[1:5] == 'hwhw' and nope.sum() == 2 * (32 - 12 - 11)
    assert torch.all(cos[:, nope] == 1) and torch.all(sin[:, nope] == 0)
    assert torch.equal(cos[:, ~nope], ref_cos[:, ~nope]) and torch.equal(sin[:, ~nope], ref_sin[:, ~nope])


# ---------------------------------------------------------------------------------------------- fast == slow
@pytest.mark.parametrize('scheme', ALL)
def test_vectorised_ids_equal_token_by_token_reference(scheme):
    rng = random.Random(1)
    for _ in range(6):
        lay = random_layout(rng)
        ids, delta = position_ids(lay, scheme=scheme)
        # VideoRoPE (built on Qwen2-VL) ignores timing by default; the M-RoPE family uses Qwen2.5-VL's 2 ids/s
        ref, nxt = reference_ids(lay, scheme, tokens_per_second=None if scheme == 'videorope' else 2.0)
        if scheme == 'circlerope':  # float32 trigonometry, as the reference implementation
            torch.testing.assert_close(ids.double(), ref, rtol=0, atol=1e-4)
            assert abs(float(delta) - (nxt - ids.shape[-1])) < 1e-4
            continue
        assert torch.equal(ids.double(), ref), (scheme, lay)
        assert float(delta) == nxt - ids.shape[-1]


def test_spatial_reset_matches_reference_and_keeps_the_advance():
    rng = random.Random(2)
    for _ in range(5):
        lay = random_layout(rng)
        ids, delta = position_ids(lay, scheme='mrope_interleave', spatial_reset=True)
        ref, nxt = reference_ids(lay, 'mrope_interleave', spatial_reset=True)
        assert torch.equal(ids.double(), ref)
        assert int(delta) == int(position_ids(lay, scheme='mrope')[1])


def test_token_id_interface_matches_qwen25_get_rope_index_with_padding():
    rng = random.Random(3)
    layouts = [with_vision_start(random_layout(rng, n_visual=rng.randint(0, 3))) + [Text(2)] for _ in range(4)]
    conv = [to_token_ids(lay) for lay in layouts]
    L = max(len(c[0]) for c in conv)
    for side in ('left', 'right'):
        input_ids = torch.zeros(len(conv), L, dtype=torch.long)
        mask = torch.zeros(len(conv), L, dtype=torch.long)
        for b, (toks, *_rest) in enumerate(conv):
            sl = slice(L - len(toks), L) if side == 'left' else slice(0, len(toks))
            input_ids[b, sl] = torch.tensor(toks)
            mask[b, sl] = 1
        img = torch.tensor([g for c in conv for g in c[1]]).reshape(-1, 3)
        vid = torch.tensor([g for c in conv for g in c[2]]).reshape(-1, 3)
        secs = [s if s is not None else 1.0 for c in conv for s in c[3]]
        secs_t = torch.tensor(secs, dtype=torch.float64)
        ids, delta = position_ids(input_ids, image_grid_thw=img, video_grid_thw=vid, second_per_grid_ts=secs_t,
                                     attention_mask=mask, scheme='mrope', rule='4.x')
        ref, ref_delta = hf_get_rope_index(input_ids, img, vid, secs_t, mask)
        assert torch.equal(ids, ref), side
        assert torch.equal(delta, ref_delta), side
        # the same batch as layouts (timing given on the videos) gives the same ids
        lay_ids, lay_delta = position_ids(
            [[Video(s.grid, second_per_grid_t=s.second_per_grid if s.second_per_grid is not None else 1.0)
              if isinstance(s, Video) else s for s in lay] for lay in layouts],
            scheme='mrope', padding_side=side)
        assert torch.equal(lay_ids[:, mask.bool()], ids[:, mask.bool()])
        assert torch.equal(lay_delta, delta)


def test_token_ids_without_vision_start_are_rejected():
    input_ids = torch.tensor([[5, IMG, IMG, IMG, IMG, 8]])
    with pytest.raises(ValueError, match='image blocks'):
        position_ids(input_ids, image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match='do not match|wrong number|past the end'):
        position_ids(torch.tensor([[5, VS, IMG, IMG, 8, 9]]), image_grid_thw=torch.tensor([[1, 4, 4]]))


def qwen3vl_token_ids(rng):
    """Token ids as Qwen3-VL's processor lays them out: an image is vision_start, its pads, vision_end;
    a video of T temporal patches is T such blocks, each after a few timestamp text tokens."""
    toks, img, vid = [7] * rng.randint(1, 3), [], []
    for _ in range(rng.randint(1, 3)):
        if rng.random() < 0.6:
            T, H, W = rng.randint(1, 3), 2 * rng.randint(1, 3), 2 * rng.randint(1, 3)
            vid.append([T, H, W])
            for _ in range(T):
                toks += [8] * rng.randint(1, 3) + [VS] + [VID] * (H * W // 4) + [VE]
        else:
            H, W = 2 * rng.randint(1, 3), 2 * rng.randint(1, 2)
            img.append([1, H, W])
            toks += [VS] + [IMG] * (H * W // 4) + [VE]
        toks += [7] * rng.randint(0, 2)
    return toks, img, vid


def test_token_id_interface_matches_qwen3vl_get_rope_index_on_processor_video_rows():
    """Qwen3-VL's processor returns one video_grid_thw row (T, H, W) per video but puts each temporal patch in
    its own vision_start block; transformers' get_rope_index splits each row into T rows (1, H, W)."""
    transformers = pytest.importorskip('transformers')
    config = transformers.Qwen3VLConfig(
        text_config=dict(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                         rope_scaling=dict(rope_type='default', mrope_section=[2, 1, 1], mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                           spatial_merge_size=2, deepstack_visual_indexes=[]),
        image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS)
    model = transformers.Qwen3VLModel(config)
    rng = random.Random(4)
    conv = [qwen3vl_token_ids(rng) for _ in range(3)]
    L = max(len(c[0]) for c in conv)
    input_ids = torch.zeros(len(conv), L, dtype=torch.long)
    mask = torch.zeros(len(conv), L, dtype=torch.long)
    for b, (toks, _, _) in enumerate(conv):
        input_ids[b, L - len(toks):] = torch.tensor(toks)
        mask[b, L - len(toks):] = 1
    img = torch.tensor([g for c in conv for g in c[1]]).reshape(-1, 3)
    vid = torch.tensor([g for c in conv for g in c[2]]).reshape(-1, 3)
    assert (vid[:, 0] > 1).any()  # some videos have several temporal patches: the case that differs
    kwargs = dict(image_grid_thw=img if len(img) else None, video_grid_thw=vid.clone(), attention_mask=mask)
    type_ids = 'mm_token_type_ids' in inspect.signature(model.get_rope_index).parameters  # transformers >= 5
    if type_ids:
        kwargs['mm_token_type_ids'] = (input_ids == IMG).int() + 2 * (input_ids == VID).int()
    with torch.no_grad():
        ref, ref_delta = model.get_rope_index(input_ids, **kwargs)
    for scheme in ('mrope_interleave', 'mhrope'):  # per-frame blocks are these schemes' default
        ids, delta = position_ids(input_ids, image_grid_thw=img, video_grid_thw=vid, attention_mask=mask,
                                     scheme=scheme, rule='5.x' if type_ids else '4.x')
        assert torch.equal(ids[:, mask.bool()], ref[:, mask.bool()]), scheme
        assert torch.equal(delta, ref_delta), scheme
    # the Qwen2-VL family reads one block per row unless told otherwise
    with pytest.raises(ValueError, match="video_blocks='frame'"):
        position_ids(input_ids, image_grid_thw=img, video_grid_thw=vid, attention_mask=mask, scheme='mrope')
    ids, _ = position_ids(input_ids, image_grid_thw=img, video_grid_thw=vid, attention_mask=mask,
                             scheme='mrope', video_blocks='frame')
    assert torch.equal(ids[:, mask.bool()], ref[:, mask.bool()])


# ---------------------------------------------------------------------------------------------- scheme facts
def test_qwen25_time_index_multiplies_before_the_floor():
    # second_per_grid_t = 0.75 s (temporal patch 2 at fps 8/3), 2 ids per second: t * 1.5 -> 0, 1, 3, 4
    video = Video(grid=(4, 2, 2), second_per_grid_t=0.75)
    ids, _ = position_ids([video], scheme='mrope')
    assert ids[0].tolist() == [0, 1, 3, 4]
    # fps: second_per_grid_t = temporal_patch_size / fps = 2 / 4 = 0.5 -> interval 1 (a truncated 0.5 would be 0)
    ids, _ = position_ids([Video(grid=(3, 2, 2), fps=4.0)], scheme='mrope')
    assert ids[0].tolist() == [0, 1, 2]
    ids, _ = position_ids([Video(grid=(3, 2, 2), fps=4.0)], scheme='mrope', tokens_per_second=None)
    assert ids[0].tolist() == [0, 1, 2]
    ids, _ = position_ids([Video(grid=(3, 2, 2), fps=1.0)], scheme='mrope')  # interval 2 * 2 = 4
    assert ids[0].tolist() == [0, 4, 8]


def test_vrope_frame_span_and_text_continuation():
    # 2 frames of 2 x 3 merged tokens after 5 text tokens: span = 2 + 3 - 1 = 4
    ids, delta = position_ids([Text(5), Video(grid=(2, 4, 6)), Text(2)], scheme='vrope')
    vis = ids[:, 5:17]
    frame0 = [[5 + h + w for h in range(2) for w in range(3)],
              [5 + h + (2 - w) for h in range(2) for w in range(3)],
              [5 + (1 - h) + w for h in range(2) for w in range(3)],
              [5 + (1 - h) + (2 - w) for h in range(2) for w in range(3)]]
    assert vis[:, :6].tolist() == frame0
    assert vis[:, 6:].tolist() == [[x + 4 for x in row] for row in frame0]
    assert vis.min() == 5 and vis.max() == 5 + 2 * 4 - 1  # the two frames fill [s, s + T * span)
    assert ids[:, 17:].tolist() == [[13, 14]] * 4  # text continues at s + T * span
    assert int(delta) == 15 - 19


def test_v2pe_fractional_steps_and_ceil_rule():
    # stride 64 over 256-token tiles: delta = 1/4; 6 tokens after position 2 -> 2.25 .. 3.5, next = ceil(3.5) + 1
    ids, delta = position_ids([Text(3), Image(grid=(1, 4, 6)), Text(2)], scheme='v2pe')
    assert ids.dtype == torch.float64
    assert ids[0].tolist() == [0, 1, 2, 2.25, 2.5, 2.75, 3.0, 3.25, 3.5, 5, 6]
    assert float(delta) == 7 - 11
    # an exact landing on an integer is not bumped: 8 tokens * 1/4 = 2 -> last visual 4.0, next 5
    ids, _ = position_ids([Text(3), Image(grid=(1, 4, 8)), Text(1)], scheme='v2pe')
    assert ids[0, -2:].tolist() == [4.0, 5.0]
    # stride = tokens_per_tile is plain 1D RoPE
    lay = [Text(3), Image(grid=(1, 4, 6)), Text(2)]
    assert torch.equal(position_ids(lay, scheme='v2pe', stride=256)[0],
                       position_ids(lay, scheme='rope_1d')[0].double())


def test_v2pe_training_draws_one_stride_per_image_from_the_powers_of_two():
    lay = [Text(1)] + [seg for _ in range(40) for seg in (Image(grid=(1, 2, 8)), Text(1))]
    g = torch.Generator().manual_seed(0)
    ids, _ = position_ids(lay, scheme='v2pe', training=True, generator=g)
    steps = set()
    for i in range(40):
        start = 1 + i * 5
        block = ids[0, start:start + 4]
        d = block.diff()
        assert torch.all(d == d[0])  # one stride per image
        assert block[0] - ids[0, start - 1] == d[0]
        steps.add(float(d[0]))
    assert steps <= {s / 256 for s in (1, 2, 4, 8, 16, 32, 64, 128, 256)} and len(steps) > 3
    again, _ = position_ids(lay, scheme='v2pe', training=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ids, again)
    fixed, _ = position_ids(lay, scheme='v2pe', training=False)
    assert torch.equal(fixed.diff()[0, 1:4], torch.full((3,), 0.25, dtype=torch.float64))


def test_v2pe_float_positions_reach_the_rotary_unrounded():
    ids, _ = position_ids([Text(3), Image(grid=(1, 4, 6))], scheme='v2pe')
    cos, sin = rotary(16, theta=10000.0, scheme='v2pe').cos_sin(ids)
    ref_cos, ref_sin = rope_1d_cos_sin(ids[0], 16, 10000.0)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert not torch.equal(cos[3], rope_1d_cos_sin(torch.tensor([2.0]), 16, 10000.0)[0][0])


def test_videorope_diagonal_layout_and_temporal_spacing():
    ids, delta = position_ids([Text(2), Video(grid=(2, 6, 4)), Text(1)], scheme='videorope')
    # H = 3, W = 2 merged: centre offsets (H-1)//2 = 1, (W-1)//2 = 0; t' = 2 + 2 t
    expected = []
    for t in range(2):
        tt = 2 + 2 * t
        expected += [[tt, tt + h - 1, tt + w] for h in range(3) for w in range(2)]
    assert ids[:, 2:14].t().tolist() == expected
    assert ids[:, 14].tolist() == [5, 5, 5]  # max temporal id 4, + 1
    assert int(delta) == 6 - 15


# ---------------------------------------------------------------------------------------------- batches, decoding
@pytest.mark.parametrize('scheme', ALL)
@pytest.mark.parametrize('side', ['left', 'right'])
def test_padded_batch_equals_single_sequences(scheme, side):
    rng = random.Random(4)
    lays = [random_layout(rng, n_visual=k) for k in (1, 3, 0)]
    ids, delta = position_ids(lays, scheme=scheme, padding_side=side)
    mask = padding_mask(lays, side).bool()
    L = mask.shape[1]
    for b, lay in enumerate(lays):
        one, d1 = position_ids(lay, scheme=scheme)
        assert torch.equal(ids[:, b][:, mask[b]], one)
        assert torch.all(ids[:, b][:, ~mask[b]] == 1)
        assert float(delta[b, 0]) == float(d1) + one.shape[-1] - L


@pytest.mark.parametrize('scheme', ALL)
def test_decoding_continues_the_full_sequence_ids(scheme):
    rng = random.Random(5)
    lays = [random_layout(rng, n_visual=k) for k in (2, 1)]
    for side in ('left', 'right'):
        ids, delta = position_ids(lays, scheme=scheme, padding_side=side)
        L = ids.shape[-1]
        new = decode_position_ids(delta, L, length=3, num_axes=ids.shape[0])
        for b, lay in enumerate(lays):
            full, _ = position_ids(lay + [Text(3)], scheme=scheme)
            assert torch.equal(new[:, b].to(full.dtype), full[:, -3:]), (scheme, side, b)


def test_decode_ids_follow_transformers_cache_position_convention():
    input_ids = torch.tensor([[0, 0, 5, VS, IMG, IMG, IMG, IMG, 8], [5, 6, 7, VS, IMG, IMG, IMG, IMG, 8]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1], [1] * 9])
    ids, delta = position_ids(input_ids, image_grid_thw=torch.tensor([[1, 4, 4], [1, 4, 4]]), attention_mask=mask,
                                 rule='4.x')
    # transformers 4.x: position_ids = arange(seq_len) + cache_position[0] + rope_deltas, for every axis
    step = decode_position_ids(delta, cache_position=9)
    assert step[:, :, 0].tolist() == [[ids[0, b].max().item() + 1 for b in range(2)]] * 3


# ---------------------------------------------------------------------------------------------- rotary layout
def observed_pair_layout(rot, num_axes):
    """Which pairs follow each axis, read from sin: move one axis at a time (``(A, [H,] P)`` bool)."""
    P = rot.rotary_dim // 2
    moved = []
    for a in range(num_axes):
        ids = torch.zeros(num_axes, 1, dtype=torch.long)
        ids[a] = 1
        _, sin = rot.cos_sin(ids)
        moved.append(sin[..., 0, :P] != 0)
    stack = torch.stack(moved)  # (A, [H,] P)
    return stack


@pytest.mark.parametrize('scheme, head_dim, expected', [
    ('mrope', 128, 't' * 16 + 'h' * 24 + 'w' * 24),
    ('mrope', 32, 't' * 4 + 'h' * 6 + 'w' * 6),
    ('mrope_interleave', 128, 'thw' * 20 + 'tttt'),
    ('videorope', 128, 'hw' * 24 + 't' * 16),
    ('vrope', 32, 'abcd' * 4),
    ('rope_1d', 16, 'p' * 8),
    ('v2pe', 16, 'p' * 8),
])
def test_rotary_pair_layout_strings(scheme, head_dim, expected):
    rot = rotary(head_dim, theta=10000.0, scheme=scheme)
    assert rot.pair_layout == expected
    moved = observed_pair_layout(rot, len(rot.axes))
    observed = ''.join(rot.axes[int(moved[:, p].nonzero()[0])] if moved[:, p].sum() == 1 else '?'
                       for p in range(head_dim // 2))
    assert observed == expected


def test_mhrope_assigns_whole_heads_to_axes():
    rot = rotary(16, theta=10000.0, scheme='mhrope', num_heads=9)
    assert rot.head_layout == 'tthhhhwww'
    rot = rotary(16, theta=10000.0, scheme='mhrope', num_heads=8)
    assert rot.head_layout == 'tthhhwww'  # the paper's [2, 3, 3]
    moved = observed_pair_layout(rot, 3)[:, 0]  # (3, H, P)
    observed = ''.join('thw'[int(moved[:, h, 0].nonzero()[0])] for h in range(8))
    assert observed == 'tthhhwww'
    assert bool(moved.any(0).all())  # every pair of every head rotates with its axis (full frequency range)
    rot = rotary(16, theta=10000.0, scheme='mhrope', num_heads=8, head_sections=(1, 2, 2))
    assert rot.head_layout == 'thhww---'
    cos, sin = rot.cos_sin(torch.full((3, 2, 5), 7))
    assert torch.all(cos[:, 5:] == 1) and torch.all(sin[:, 5:] == 0)  # unassigned heads are not rotated
    cos1, _ = rot.cos_sin(torch.full((3, 5), 7))  # unbatched ids still give head-wise (1, H, N, d) tables
    assert cos1.shape == (1, 8, 5, 16) and torch.equal(cos1[0], cos[0])


def test_mhrope_head_wise_tables_with_grouped_query_heads():
    ids, _ = position_ids([[Text(2), Image(grid=(1, 4, 4)), Text(1)]], scheme='mhrope')
    rot = rotary(8, theta=100.0, scheme='mhrope', num_heads=4)
    cos, sin = rot.cos_sin(ids)
    assert cos.shape == (1, 4, 7, 8)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 8, 7, 8, generator=g), torch.randn(1, 4, 7, 8, generator=g)
    q2, k2 = apply_rotary(q, k, cos, sin)
    c_q, s_q = cos.repeat_interleave(2, 1), sin.repeat_interleave(2, 1)  # kv head j serves q heads 2j, 2j+1
    assert torch.allclose(q2, q * c_q + rotate_half(q) * s_q, atol=1e-6)
    assert torch.allclose(k2, k * cos + rotate_half(k) * sin, atol=1e-6)


@pytest.mark.parametrize('scheme', ['mrope', 'mrope_interleave', 'videorope', 'vrope'])
def test_rotary_logits_are_invariant_to_a_common_shift_of_all_ids(scheme):
    ids, _ = position_ids([Text(3), Video(grid=(2, 4, 4)), Text(2)], scheme=scheme)
    rot = rotary(32, theta=10000.0, scheme=scheme)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 2, ids.shape[-1], 32, generator=g), torch.randn(1, 2, ids.shape[-1], 32, generator=g)
    logits = []
    for shift in (0, 37):
        cos, sin = rot.cos_sin(ids + shift)
        q2, k2 = apply_rotary(q, k, cos, sin)
        logits.append(q2 @ k2.transpose(-1, -2))
    assert torch.allclose(logits[0], logits[1], atol=1e-4)


def test_partial_rotary_leaves_the_rest_and_matches_the_shared_kernel():
    ids, _ = position_ids([Text(2), Image(grid=(1, 4, 4))], scheme='mrope')
    rot = rotary(16, theta=1e4, scheme='mrope', rotary_dim=8, sections=(2, 1, 1))
    cos, sin = rot.cos_sin(ids)
    q = torch.randn(1, 2, 6, 16)
    q2, _ = apply_rotary(q, q, cos, sin)
    assert torch.equal(q2[..., 8:], q[..., 8:])
    assert torch.equal(q2, apply_pair_rotation(q, rot.table(ids), layout='half'))
    assert torch.allclose(q2[..., :8], q[..., :8] * cos + rotate_half(q[..., :8]) * sin, atol=1e-6)


def test_apply_rotary_on_bnhd_layout_and_bfloat16():
    ids, _ = position_ids([[Text(3), Image(grid=(1, 2, 4))]], scheme='mrope')
    cos, sin = rotary(8, scheme='mrope').cos_sin(ids)
    q = torch.randn(1, 2, 5, 8)
    q_bhnd, _ = apply_rotary(q, q, cos, sin)
    q_bnhd, _ = apply_rotary(q.transpose(1, 2), q.transpose(1, 2), cos, sin, unsqueeze_dim=2)
    assert torch.equal(q_bhnd, q_bnhd.transpose(1, 2))
    qb, _ = apply_rotary(q.bfloat16(), q.bfloat16(), cos, sin)
    assert qb.dtype == torch.bfloat16 and torch.allclose(qb.float(), q_bhnd, atol=3e-2)


# ---------------------------------------------------------------------------------------------- errors
def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown encoding 'm-rope'"):
        position_ids([Text(2)], scheme='m-rope')
    with pytest.raises(ValueError, match="unknown option 'delta' for encoding 'vrope'"):
        position_ids([Text(2)], scheme='vrope', delta=3)
    with pytest.raises(ValueError, match='divisible by merge'):
        Image(grid=(1, 5, 4))
    with pytest.raises(ValueError, match='padding_side'):
        position_ids([[Text(2)]], padding_side='middle')
    with pytest.raises(ValueError, match=r"video_blocks must be one of \('video', 'frame'\)"):
        position_ids(torch.tensor([[5, 6]]), video_blocks='clip')
    with pytest.raises(ValueError, match='sections'):
        rotary(16, scheme='mrope', sections=(2, 2, 2))
    with pytest.raises(ValueError, match='num_heads'):
        rotary(16, scheme='mhrope')
    with pytest.raises(ValueError, match=r'\(3, N\)'):
        rotary(16, scheme='mrope').cos_sin(torch.zeros(2, 5, dtype=torch.long))


def test_apply_rotary_is_transformers_bit_for_bit_in_float32_and_rounds_once_in_bfloat16():
    """The docstring's claim, against transformers' own apply_rotary_pos_emb."""
    llama = pytest.importorskip('transformers.models.llama.modeling_llama')
    ids, _ = position_ids([[Text(3), Image(grid=(1, 8, 8)), Text(20)]], scheme='mrope_interleave')
    cos, sin = rotary(64, theta=1e6, scheme='mrope_interleave').cos_sin(ids)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, ids.shape[-1], 64, generator=g) * 3, torch.randn(1, 2, ids.shape[-1], 64, generator=g)
    ours, theirs = apply_rotary(q, k, cos, sin), llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    qb, kb = q.bfloat16(), k.bfloat16()
    ours = apply_rotary(qb, kb, cos, sin)
    theirs = llama.apply_rotary_pos_emb(qb, kb, cos.bfloat16(), sin.bfloat16())
    once = llama.apply_rotary_pos_emb(qb.float(), kb.float(), cos, sin)  # float32, then one rounding
    assert torch.equal(ours[0], once[0].bfloat16()) and not torch.equal(ours[0], theirs[0])


# ---------------------------------------------------------------------------------------------- HoPE, Circle-RoPE
def test_circlerope_puts_each_frame_on_a_circle_orthogonal_to_the_text_axis():
    ids, _ = position_ids([Text(3), Video(grid=(2, 6, 8)), Text(2)], scheme='circlerope', radius=4.0)
    ring0, ring1 = ids[:, 3:15].t(), ids[:, 15:27].t()  # 2 frames of 3 x 4 merged tokens
    along = ring0.mean(1, keepdim=True)  # the projection on (1, 1, 1) / sqrt 3, per token
    ortho = ring0 - along
    torch.testing.assert_close(ortho.norm(dim=1), torch.full((12,), 4.0, dtype=torch.float64), rtol=0, atol=1e-5)
    torch.testing.assert_close(along.squeeze(1), torch.full((12,), 3.0, dtype=torch.float64), rtol=0, atol=1e-5)
    # the second frame is the first one moved by temporal_stride (1) on every axis
    torch.testing.assert_close(ring1, ring0 + 1, rtol=0, atol=1e-6)


def test_hope_draws_a_temporal_stride_per_video_in_training_only():
    video = [Text(1), Video(grid=(4, 2, 2)), Text(1)]
    ids, _ = position_ids(video, scheme='hope', temporal_stride=1.0)
    assert ids[0, 1:5].tolist() == [1, 2, 3, 4] and ids[0, -1].item() == 5
    g = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(40):
        tr, _ = position_ids(video, scheme='hope', training=True, generator=g)
        step = (tr[0, 2] - tr[0, 1]).item()
        assert tr[0, 1:5].tolist() == [1 + step * t for t in range(4)] and tr[0, -1].item() == 1 + 3 * step + 1
        seen.add(step)
    assert seen == {0.5, 0.75, 1.0, 1.25, 1.5}


def test_hope_and_circlerope_bad_options_are_named():
    with pytest.raises(ValueError, match="option 'temporal_strides' of encoding 'hope' must not be empty"):
        encoding('hope', temporal_strides=())
    with pytest.raises(ValueError, match="option 'radius' of encoding 'circlerope': expected float, got 'big'"):
        encoding('circlerope', radius='big')
    with pytest.raises(ValueError, match=r"option 'alpha' of encoding 'circlerope' must be in \[0, 1\]"):
        encoding('circlerope', alpha=-1)
    with pytest.raises(ValueError, match="option 'method' of encoding 'circlerope': 'spiral' is not allowed; "
                                         "allowed values: 'circle', 'no_circle'"):
        encoding('circlerope', method='spiral')
