"""iRPE: bucket facts, the piecewise function, contextual / bias / value terms against brute force."""
import math

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vispe
from vispe.attention import pe_attention
from vispe.encodings.irpe import irpe_bucket_ids, piecewise_index
from vispe.registry import create_pe


# ---------------------------------------------------------------------- an independent scalar reference
def g_ref(x: float, ratio: float) -> int:
    """The paper's piecewise index function on one Python float (half-to-even rounding as torch)."""
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    if abs(x) <= alpha:
        return int(round(x))
    y = min(beta, round(alpha + math.log(abs(x) / alpha) / math.log(gamma / alpha) * (beta - alpha)))
    return int(math.copysign(1, x) * y)  # int() truncates toward zero, after the clip


def buckets_ref(pq, pk, method: str, ratio: float, prefix: bool, size: int):
    """Table indices of one (query, key) pair: [(index into the concatenated table)]."""
    b = int(2 * ratio)
    per_table = (2 * b + 1) ** 2 if method == 'product' else 2 * b + 1
    if pq is None or pk is None:
        ids = [per_table] if method != 'cross' else [per_table, size + per_table]
        return ids
    dr, dc = pq[0] - pk[0], pq[1] - pk[1]
    if method == 'product':
        return [(g_ref(dr, ratio) + b) * (2 * b + 1) + g_ref(dc, ratio) + b]
    if method == 'cross':
        return [g_ref(dr, ratio) + b, size + g_ref(dc, ratio) + b]
    sq = dr * dr + dc * dc
    d = float(round(math.sqrt(sq))) if method == 'euclidean' else float(sq)
    return [g_ref(d, ratio) + b]


def token_positions(h, w, npre):
    return [None] * npre + [(r, c) for r in range(h) for c in range(w)]


# ---------------------------------------------------------------------- facts
def test_irpe_bucket_facts_product_ratio_1_9_on_14x14():
    ids = irpe_bucket_ids(vispe.grid(14, 14), method='product', ratio=1.9)[0]
    t = lambda r, c: r * 14 + c  # noqa: E731
    assert ids[t(5, 7), t(5, 7)] == 24  # a token with itself
    assert ids[t(0, 0), t(0, 1)] == 23
    assert ids[t(0, 1), t(0, 0)] == 25
    assert ids[t(0, 0), t(1, 0)] == 17
    assert ids[t(0, 0), t(13, 13)] == 0
    assert ids[t(13, 13), t(0, 0)] == 48
    assert ids[t(0, 0), t(0, 3)] == 22
    assert torch.equal(ids.diagonal(), torch.full((196,), 24))
    with_cls = irpe_bucket_ids(vispe.grid(14, 14, num_prefix=1), method='product', ratio=1.9)[0]
    assert (with_cls[0] == 49).all() and (with_cls[:, 0] == 49).all()
    assert torch.equal(with_cls[1:, 1:], ids)


def test_irpe_ratio_1_9_maps_offsets_0_to_3_to_buckets_0_1_2_2_and_beyond_to_3():
    x = torch.arange(0, 30, dtype=torch.float32)
    g = piecewise_index(x, 1.9, 3.8, 15.2)
    assert g[:4].tolist() == [0, 1, 2, 2]
    assert (g[4:] == 3).all()
    assert torch.equal(piecewise_index(-x, 1.9, 3.8, 15.2), -g)


def test_irpe_num_buckets_product_is_7x7_plus_class_bucket():
    pe = create_pe('irpe', dim=64, num_heads=4, depth=2, grid_size=(14, 14), num_prefix_tokens=1)
    assert pe.num_buckets == 50 and pe.table_k.shape == (2, 1, 16, 50)
    cross = create_pe('irpe:method=cross,ratio=1.9', dim=64, num_heads=4, depth=2, grid_size=(14, 14),
                      num_prefix_tokens=1)
    assert cross.num_buckets == 2 * (7 + 1)
    euc = create_pe('irpe:method=euclidean,ratio=1.9', dim=64, num_heads=4, depth=2, grid_size=(14, 14))
    assert euc.num_buckets == 7


@pytest.mark.parametrize('method,ratio,used', [('product', 1.9, 50), ('cross', 20.0, 56), ('euclidean', 20.0, 20),
                                               ('quantization', 33.0, 51)])
def test_irpe_default_ratios_give_the_released_models_bucket_counts(method, ratio, used):
    # the released DeiT-S checkpoints are named by the buckets a 14x14 grid + class token reaches
    pe = create_pe(f'irpe:method={method}', dim=64, num_heads=4, depth=1, grid_size=(14, 14), num_prefix_tokens=1)
    assert pe.ratio == ratio
    assert pe.bucket_ids(vispe.grid(14, 14, num_prefix=1)).unique().numel() == used


@pytest.mark.parametrize('ratio,x,expected', [
    # ratio 1.9: alpha 1.9, beta 3.8, gamma 15.2
    (1.9, 1.4, 1), (1.9, 1.6, 2), (1.9, 1.9, 2),  # |x| <= alpha: round(x)
    (1.9, 2.0, 2),  # 1.9 + ln(2/1.9)/ln(8)*1.9 = 1.947
    (1.9, 3.6, 2),  # 1.9 + ln(3.6/1.9)/ln(8)*1.9 = 2.484
    (1.9, 3.7, 3),  # 2.509
    (1.9, 15.2, 3),  # 3.8 -> round 4 -> clip 3.8 -> int 3
    (1.9, 1e4, 3), (1.9, -3.7, -3), (1.9, -3.6, -2),
    # ratio 1: alpha 1, beta 2, gamma 8; the 1 -> 2 step is at 1 + ln(x)/ln(8) = 1.5, x = sqrt(8) = 2.828
    (1.0, 0.5, 0), (1.0, 1.0, 1), (1.0, 2.82, 1), (1.0, 2.83, 2), (1.0, 100.0, 2), (1.0, -2.83, -2),
    # ratio 2.1: beta 4.2, the largest index is int(beta) = 4
    (2.1, 1e6, 4), (2.1, -1e6, -4),
])
def test_irpe_piecewise_function_at_and_around_thresholds(ratio, x, expected):
    alpha, beta, gamma = ratio, 2 * ratio, 8 * ratio
    assert piecewise_index(torch.tensor([x]), alpha, beta, gamma).item() == expected
    assert g_ref(x, ratio) == expected


def test_irpe_buckets_depend_only_on_offsets():
    pts = torch.tensor([[0., 0.], [2., 5.], [7., 1.], [3., 3.], [9., 9.]])
    a = irpe_bucket_ids(vispe.points(pts), method='product')
    b = irpe_bucket_ids(vispe.points(pts + torch.tensor([11., -4.])), method='product')
    assert torch.equal(a, b)


def test_irpe_bucket_ids_are_cached_per_grid():
    pe = create_pe('irpe:on=qkv', dim=32, num_heads=2, depth=1, grid_size=(4, 4), num_prefix_tokens=1)
    pe.train()
    s1 = pe.prepare(vispe.grid(4, 4, num_prefix=1)).state
    s2 = pe.prepare(vispe.grid(4, 4, num_prefix=1)).state
    assert s1.ids is s2.ids
    assert pe.prepare(vispe.grid(4, 5, num_prefix=1)).state.ids.shape == (1, 21, 21)


# ---------------------------------------------------------------------- terms vs brute force
def _random_tables(pe, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pe.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


@pytest.mark.parametrize('method', ['product', 'cross', 'euclidean', 'quantization'])
@pytest.mark.parametrize('mode', ['contextual', 'bias'])
@pytest.mark.parametrize('shared', [True, False])
def test_irpe_logit_terms_equal_brute_force_per_pair(method, mode, shared):
    h, w, npre, heads, hd, ratio = 3, 4, 1, 2, 8, 1.2
    pe = create_pe({'name': 'irpe', 'method': method, 'mode': mode, 'on': 'qk', 'ratio': ratio,
                    'shared_heads': shared}, dim=heads * hd, num_heads=heads, depth=2, grid_size=(h, w),
                   num_prefix_tokens=npre)
    _random_tables(pe)
    pos = vispe.grid(h, w, num_prefix=npre)
    n = npre + h * w
    q, k = torch.randn(2, heads, n, hd), torch.randn(2, heads, n, hd)
    layer = 1
    got = pe.prepare(pos).bias(q, k, layer).expand(2, heads, n, n)
    toks = token_positions(h, w, npre)
    size = pe.num_buckets // pe.num_tables
    scale = hd ** -0.5
    expected = torch.zeros(2, heads, n, n)
    for i in range(n):
        for j in range(n):
            for hh in range(heads):
                th = 0 if shared else hh
                for u in buckets_ref(toks[i], toks[j], method, ratio, npre > 0, size):  # K: query-minus-key
                    if mode == 'contextual':
                        expected[:, hh, i, j] += q[:, hh, i] @ pe.table_k[layer, th, :, u] * scale
                    else:
                        expected[:, hh, i, j] += pe.table_k[layer, th, u]
                for u in buckets_ref(toks[j], toks[i], method, ratio, npre > 0, size):  # Q: key-minus-query
                    if mode == 'contextual':
                        expected[:, hh, i, j] += k[:, hh, j] @ pe.table_q[layer, th, :, u] * scale
                    else:
                        expected[:, hh, i, j] += pe.table_q[layer, th, u]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('method', ['product', 'cross', 'euclidean'])
@pytest.mark.parametrize('batched', [False, True])
def test_irpe_value_term_equals_brute_force(method, batched):
    h, w, npre, heads, hd, ratio = 3, 3, 1, 2, 4, 1.9
    pe = create_pe({'name': 'irpe', 'method': method, 'on': 'v', 'ratio': ratio, 'shared_heads': False}, dim=heads * hd,
                   num_heads=heads, depth=1, grid_size=(h, w), num_prefix_tokens=npre)
    _random_tables(pe)
    pos = vispe.grid(h, w, num_prefix=npre)
    if batched:  # per-sample coordinates (e.g. after token dropping)
        pos = vispe.points(pos.coords.unsqueeze(0).expand(2, -1, -1).clone(), num_prefix=npre)
    state = pe.prepare(pos)
    n = npre + h * w
    attn = torch.randn(2, heads, n, n).softmax(-1)
    got = state.weights_value(attn, 0)
    toks = token_positions(h, w, npre)
    size = pe.num_buckets // pe.num_tables
    expected = torch.zeros(2, heads, n, hd)
    for i in range(n):
        for j in range(n):
            for u in buckets_ref(toks[i], toks[j], method, ratio, True, size):
                expected[:, :, i] += attn[:, :, i, j, None] * pe.table_v[0, :, u]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('spec', ['irpe', 'irpe:mode=bias', 'irpe:on=qk,shared_heads=false',
                                  'irpe:method=cross,mode=bias,on=qk'])
def test_irpe_sdpa_with_mask_equals_explicit_path(spec):
    heads, hd = 2, 8
    pe = create_pe(spec, dim=heads * hd, num_heads=heads, depth=1, grid_size=(3, 5), num_prefix_tokens=1)
    _random_tables(pe)
    assert 'weights_value' not in pe.hooks  # K / Q terms keep SDPA
    state = pe.prepare(vispe.grid(3, 5, num_prefix=1))
    q, k, v = torch.randn(3, 2, heads, 16, hd).unbind(0)
    fast = pe_attention(q, k, v, state, 0)
    slow = pe_attention(q, k, v, state, 0, force_explicit=True)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_irpe_qkv_attention_equals_brute_force_attention():
    heads, hd, h, w = 2, 4, 2, 3
    pe = create_pe('irpe:on=qkv,method=cross,ratio=1.9', dim=heads * hd, num_heads=heads, depth=1, grid_size=(h, w),
                   num_prefix_tokens=1)
    _random_tables(pe)
    assert 'weights_value' in pe.hooks
    state = pe.prepare(vispe.grid(h, w, num_prefix=1))
    n = 1 + h * w
    q, k, v = torch.randn(3, 1, heads, n, hd).unbind(0)
    got = pe_attention(q, k, v, state, 0)
    scale = hd ** -0.5
    toks = token_positions(h, w, 1)
    size = pe.num_buckets // 2
    logits = (q @ k.transpose(-1, -2)) * scale
    for i in range(n):
        for j in range(n):
            for u in buckets_ref(toks[i], toks[j], 'cross', 1.9, True, size):
                logits[..., i, j] += (q[..., i, :] @ pe.table_k[0, 0, :, u]) * scale
            for u in buckets_ref(toks[j], toks[i], 'cross', 1.9, True, size):
                logits[..., i, j] += (k[..., j, :] @ pe.table_q[0, 0, :, u]) * scale
    attn = logits.softmax(-1)
    expected = attn @ v
    for i in range(n):
        for j in range(n):
            for u in buckets_ref(toks[i], toks[j], 'cross', 1.9, True, size):
                expected[..., i, :] += attn[..., i, j, None] * pe.table_v[0, 0, u]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize('on', ['k', 'qk'])
def test_irpe_contextual_k_qk_never_materialises_an_n_n_hd_tensor(on):
    heads, hd, g = 1, 64, 8
    n = 1 + g * g
    pe = create_pe(f'irpe:on={on}', dim=heads * hd, num_heads=heads, depth=1, grid_size=(g, g), num_prefix_tokens=1)
    _random_tables(pe)
    q = torch.randn(1, heads, n, hd, requires_grad=True)
    k = torch.randn(1, heads, n, hd, requires_grad=True)
    with _LargestTensor() as probe:
        state = pe.prepare(vispe.grid(g, g, num_prefix=1))
        pe_attention(q, k, k, state, 0).sum().backward()
    assert probe.largest <= n * n * heads * 2  # the logits-sized mask, nothing like n * n * hd
    assert probe.largest < n * n * hd // 16


# ---------------------------------------------------------------------- in a ViT
def test_irpe_zero_initialised_tables_leave_the_vit_unchanged():
    kw = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    torch.manual_seed(0)
    base = timm.create_model('vit_tiny', pe='learned', **kw).eval()
    irpe = timm.create_model('vit_tiny', pe='irpe:on=qkv+learned', **kw).eval()
    sd = {k.replace('pe.pos_embed', 'pe.encodings.1.pos_embed'): v for k, v in base.state_dict().items()}
    missing = irpe.load_state_dict(sd, strict=False).missing_keys
    assert sorted(missing) == ['pe.encodings.0.table_k', 'pe.encodings.0.table_q', 'pe.encodings.0.table_v']
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(irpe(x), base(x), atol=1e-5, rtol=1e-5)


def test_irpe_spec_options_and_vit_at_other_resolutions():
    model = timm.create_model('vit_tiny', pe='irpe:method=cross,mode=bias,on=qkv,shared_heads=false',
                              img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    pe = model.pe
    assert (pe.method, pe.mode, pe.on, pe.shared_heads) == ('cross', 'bias', 'qkv', False)
    assert pe.ratio == 20.0  # the released cross models' ratio: 2 tables x (2 * 40 + 1 + class bucket)
    assert pe.table_k.shape == (2, 2, 164) and pe.table_v.shape == (2, 2, 164, 16)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    assert pe.table_k.grad is not None and pe.table_v.grad is not None
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 32)).shape == (1, 5)


def test_irpe_rejects_bad_options():
    with pytest.raises(ValueError, match="allowed values: 'euclidean'"):
        create_pe('irpe:method=polar', dim=32, num_heads=2, grid_size=(4, 4))
    with pytest.raises(ValueError, match='2D'):
        create_pe('irpe', dim=32, num_heads=2, grid_size=(2, 4, 4))
    pe = create_pe('irpe', dim=32, num_heads=2, grid_size=(4, 4))
    with pytest.raises(ValueError, match='prefix'):
        pe.prepare(vispe.grid(4, 4, num_prefix=1))


def test_irpe_tables_are_zeros_by_default_and_drawn_with_init_std():
    kw = dict(dim=64, num_heads=4, depth=2, grid_size=(4, 4), num_prefix_tokens=1)
    assert all((t == 0).all() for t in create_pe('irpe:on=qkv', **kw).parameters())
    drawn = create_pe('irpe:on=qkv,init_std=0.5', **kw)
    assert len(list(drawn.parameters())) == 3
    for t in drawn.parameters():
        assert 0.45 < t.std() < 0.55 and t.abs().max() <= 2  # timm's trunc_normal_: cut at +-2
    with pytest.raises(ValueError, match="'init_std'"):
        create_pe('irpe:init_std=-1', **kw)


class _Attention(torch.nn.Module):
    def __init__(self, pe, pos, layer):
        super().__init__()
        self.pe, self.pos, self.layer = pe, pos, layer

    def forward(self, q, k, v):
        return pe_attention(q, k, v, self.pe.prepare(self.pos), self.layer)


@pytest.mark.parametrize('on', ['k', 'q', 'v', 'qk', 'kv', 'qv', 'qkv'])
@pytest.mark.parametrize('mode', ['contextual', 'bias'])
@pytest.mark.parametrize('method', ['product', 'cross', 'euclidean', 'quantization'])
def test_irpe_gradients_match_finite_differences(method, mode, on):
    heads, hd, h, w = 2, 3, 2, 3
    shared = method in ('product', 'euclidean')  # both table layouts, each with two mappings
    spec = f'irpe:method={method},mode={mode},on={on},ratio=1.9,shared_heads={str(shared).lower()}'
    # depth 2, layer 1: a gradient that reached the wrong layer's table would show
    pe = create_pe(spec, dim=heads * hd, num_heads=heads, depth=2, grid_size=(h, w), num_prefix_tokens=1).double()
    _random_tables(pe)
    n = 1 + h * w
    q, k, v = torch.randn(3, 2, heads, n, hd, dtype=torch.float64).unbind(0)
    names = [name for name, _ in pe.named_parameters()]
    host = _Attention(pe, vispe.grid(h, w, num_prefix=1), layer=1)

    def attention(q, k, v, *tables):  # the tables enter as gradcheck inputs, swapped in by functional_call
        return torch.func.functional_call(host, {f'pe.{n}': t for n, t in zip(names, tables)}, (q, k, v))

    inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    inputs += [getattr(pe, n).detach().clone().requires_grad_(True) for n in names]
    assert torch.autograd.gradcheck(attention, tuple(inputs), fast_mode=True)
