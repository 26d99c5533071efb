"""Native-resolution (NaFlex) batches: the batch builder against timm's own NaFlex helpers, and the
model path: each sample of a mixed batch gives what the same image gives alone."""
import math

import pytest
import timm
import torch
from timm.data.naflex_dataset import NaFlexCollator
from timm.data.naflex_transforms import Patchify, get_image_size_for_seq
from timm.models.naflexvit import calculate_naflex_grid_sizes
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

import vispe
from vispe.naflex import embed_patches, naflex_batch, naflex_positions, naflex_size

from conftest import TINY, image_pes

P = TINY['patch_size']
TRAIN_GRID = (TINY['img_size'] // P,) * 2
# non-square, three token counts, the last beyond the training grid (4x4) on both axes
SIZES = [(24, 40), (32, 32), (48, 56)]


def _images(sizes=SIZES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, h, w, generator=g) for h, w in sizes]


# ------------------------------------------------------------------ the batch builder
@pytest.mark.parametrize('size,budget', [((320, 480), 256), ((224, 224), 196), ((512, 256), 1024),
                                         ((37, 1000), 64), ((1000, 37), 64), ((10, 10), 256)])
def test_naflex_size_is_timms_largest_patch_multiple_within_the_budget(size, budget):
    p = 16
    h, w = naflex_size(size, p, budget)
    assert (h, w) == get_image_size_for_seq(size, p, budget, divisible_by_patch=True)[1]
    assert h % p == 0 and w % p == 0 and (h // p) * (w // p) <= budget
    assert ((h // p) + 1) * ((w // p) + 1) > budget  # no larger size of both sides fits
    if min(h, w) > p:  # a one-patch side is clamped; otherwise the aspect ratio holds to a patch
        assert abs(h - w * size[0] / size[1]) <= p * max(1, size[0] / size[1])


def test_naflex_batch_equals_timms_patchify_and_collator():
    images = _images()
    ours = naflex_batch(images, P, max_tokens=48, resize=False)
    theirs, _ = NaFlexCollator(max_seq_len=48)([(Patchify(P)(img), 0) for img in images])
    for key in ('patches', 'patch_coord', 'patch_valid'):
        assert ours[key].dtype == theirs[key].dtype
        assert torch.equal(ours[key], theirs[key]), key
    assert ours['patch_valid'].sum(1).tolist() == [math.prod(s) // P ** 2 for s in SIZES]


def test_naflex_batch_pads_to_the_largest_image_without_a_budget():
    batch = naflex_batch(_images(), P, resize=False)
    assert batch['patches'].shape == (3, 42, P * P * 3)  # 6 x 7 patches of the 48x56 image


def test_naflex_batch_resizes_each_image_as_timms_resize_to_its_naflex_size():
    images = _images([(50, 90), (200, 60), (31, 33)])
    batch = naflex_batch(images, P, max_tokens=20)
    assert batch['patches'].shape[:2] == (3, 20)
    for b, img in enumerate(images):
        size = naflex_size(tuple(img.shape[-2:]), P, 20)
        resized = TF.resize(img, list(size), InterpolationMode.BILINEAR, antialias=True)
        one = Patchify(P)(resized)
        n = one['patches'].shape[0]
        assert n == (size[0] // P) * (size[1] // P) <= 20
        torch.testing.assert_close(batch['patches'][b, :n], one['patches'], atol=1e-6, rtol=1e-6)
        assert torch.equal(batch['patch_coord'][b, :n], one['patch_coord'])
        assert batch['patch_valid'][b, :n].all() and not batch['patch_valid'][b, n:].any()
        assert not batch['patches'][b, n:].any() and not batch['patch_coord'][b, n:].any()


@pytest.mark.parametrize('call,match', [
    (lambda imgs: naflex_batch(imgs, P), 'max_tokens'),
    (lambda imgs: naflex_batch([torch.randn(3, 20, 24)], P, resize=False), 'patch_size=8'),
    (lambda imgs: naflex_batch(imgs, P, max_tokens=16, resize=False), 'max_tokens=16'),
    (lambda imgs: naflex_batch(imgs + [torch.randn(1, 8, 8)], P, resize=False), 'images\\[3\\]'),
    (lambda imgs: naflex_batch([torch.zeros(3, 8, 8, dtype=torch.uint8)], P, resize=False), 'float'),
    (lambda imgs: naflex_batch(imgs, 0, max_tokens=8), 'patch_size'),
    (lambda imgs: naflex_size((32, 32), 8, 0), 'max_tokens'),
])
def test_naflex_batch_refuses_bad_input_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call(_images())


def test_naflex_positions_read_each_samples_grid_from_its_coordinates():
    batch = naflex_batch(_images(), P, max_tokens=48, resize=False)
    pos = naflex_positions(batch['patch_coord'], batch['patch_valid'], num_prefix=2, train_grid=TRAIN_GRID)
    grids = [(h // P, w // P) for h, w in SIZES]
    assert pos.grids == tuple(grids) == tuple(calculate_naflex_grid_sizes(batch['patch_coord']))
    ref = vispe.positions.naflex_grid(grids, num_tokens=48, num_prefix=2, train_grid=TRAIN_GRID)
    assert torch.equal(pos.coords, ref.coords) and torch.equal(pos.key_padding_mask, ref.key_padding_mask)
    assert pos.num_tokens == 50 and pos.train_grid == TRAIN_GRID


def test_naflex_positions_refuse_a_layout_that_is_not_whole_row_major_grids():
    batch = naflex_batch(_images(), P, max_tokens=48, resize=False)
    coord, valid = batch['patch_coord'], batch['patch_valid']
    truncated = valid.clone()
    truncated[2, 40:] = False  # timm's collator truncates a sample longer than its max_seq_len
    with pytest.raises(ValueError, match='whole grid'):
        naflex_positions(coord, truncated)
    swapped = coord.clone()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    with pytest.raises(ValueError, match='row-major'):
        naflex_positions(swapped, valid)
    with pytest.raises(ValueError, match='patch_valid'):
        naflex_positions(coord, valid[:, :10])


def test_linear_patch_embedding_equals_the_convolution():
    embed = timm.layers.PatchEmbed(img_size=32, patch_size=P, in_chans=3, embed_dim=16, norm_layer=torch.nn.LayerNorm,
                                   strict_img_size=False)
    torch.nn.init.normal_(embed.norm.weight)
    img = torch.randn(1, 3, 24, 40)
    conv = embed(img)  # (1, 15, 16): conv, flatten, norm
    patches = naflex_batch([img[0]], P, resize=False)['patches']
    torch.testing.assert_close(embed_patches(embed, patches), conv, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match='192'):
        embed_patches(embed, patches[..., :-3])


# ------------------------------------------------------------------ the model path
def _assert_samples_equal_alone(model, images, max_tokens=None, atol=1e-5):
    """Logits and tokens (prefix and real patches) of each sample of a NaFlex batch against the image
    run alone through the tensor path."""
    model.eval()
    batch = naflex_batch(images, P, max_tokens=max_tokens, resize=False)
    npre = model.num_prefix_tokens
    with torch.no_grad():
        logits = model(batch)
        feats = model.forward_features(batch)
        for b, img in enumerate(images):
            n = npre + math.prod(img.shape[-2:]) // P ** 2
            torch.testing.assert_close(logits[b], model(img[None])[0], atol=atol, rtol=0)
            torch.testing.assert_close(feats['patches'][b, :n], model.forward_features(img[None])[0], atol=atol, rtol=0)


@pytest.mark.parametrize('spec', image_pes())
def test_each_sample_of_a_naflex_batch_equals_the_image_alone(spec):
    model = timm.create_model('vit_tiny', pe=spec, **TINY)
    _assert_samples_equal_alone(model, _images(), max_tokens=48)


@pytest.mark.parametrize('spec', ['rope_mixed', 'irpe', 'peg', 'learned'])
def test_what_the_padding_holds_cannot_reach_the_real_tokens(spec):
    model = timm.create_model('vit_tiny', pe=spec, global_pool='avg', **TINY).eval()
    batch = naflex_batch(_images(), P, max_tokens=48, resize=False)
    noisy = dict(batch, patches=batch['patches'].clone())
    pad = ~batch['patch_valid']
    noisy['patches'][pad] = 100 * torch.randn(int(pad.sum()), batch['patches'].shape[-1])
    with torch.no_grad():
        clean, dirty = model.forward_features(batch), model.forward_features(noisy)
        real = torch.cat([torch.ones(3, 1, dtype=torch.bool), batch['patch_valid']], 1)
        assert (clean['patches'] - dirty['patches'])[~real].abs().max() > 1  # the padded tokens did change
        torch.testing.assert_close(dirty['patches'][real], clean['patches'][real], atol=1e-5, rtol=0)
        torch.testing.assert_close(model(noisy), model(batch), atol=1e-5, rtol=0)


def _tiny_timm(name):
    model = timm.create_model(name, pretrained=False, dynamic_img_size=True, **TINY)
    with torch.no_grad():  # layer scale starts near 0 (1e-5): make every block count
        for n, p in model.named_parameters():
            if n.endswith(('gamma', 'gamma_1', 'gamma_2')):
                p.fill_(1.0)
    return model


FAMILIES = [
    'vit_base_patch14_reg4_dinov2',    # class + 4 register tokens, token pooling
    'vit_base_patch16_reg4_gap_256',   # registers, no class token, avg pooling, no_embed_class
    'vit_base_patch16_siglip_224',     # SigLIP: MAP head, no class token
    'test_vit3',                       # MAP head over the register token too (pool_include_prefix)
    'eva02_tiny_patch14_224',          # Eva with its rope (rope_timm), avg pooling
    'vit_pe_core_tiny_patch16_384',    # Perception Encoder (Eva): rope, MAP head
    'vit_dwee_patch16_reg1_gap_256',   # differential attention: the encoding on 2H q/k heads
    'vit_dpwee_patch16_reg1_gap_256',  # differential attention in the parallel scaling block
    'deit_tiny_distilled_patch16_224', # distillation token (second prefix token), two heads
]


@pytest.mark.parametrize('name', FAMILIES)
@pytest.mark.parametrize('pe', ['own', 'rope_mixed'])
def test_converted_timm_models_give_each_sample_what_it_gives_alone(name, pe):
    model = _tiny_timm(name)
    vispe.convert(model, vispe.timm_pe_spec(model) if pe == 'own' else pe)
    _assert_samples_equal_alone(model, _images())


@pytest.mark.parametrize('pool', ['token', 'avg', 'avgmax', 'max', 'map'])
def test_every_pooling_leaves_the_padding_out(pool):
    model = timm.create_model('vit_tiny', pe='rope_mixed', global_pool=pool, **TINY)
    _assert_samples_equal_alone(model, _images(), max_tokens=48)


def test_a_batch_of_timms_naflex_collator_runs_as_it_is():
    model = timm.create_model('vit_tiny', pe='learned', **TINY).eval()
    images = _images()
    collated, _ = NaFlexCollator(max_seq_len=48)([(Patchify(P)(img), 0) for img in images])
    assert 'seq_len' in collated  # an entry the host does not need
    with torch.no_grad():
        torch.testing.assert_close(model(collated), model(naflex_batch(images, P, max_tokens=48, resize=False)),
                                   atol=0, rtol=0)


def test_forward_head_pools_forward_features_of_a_naflex_batch():
    model = timm.create_model('vit_tiny', pe='irpe', global_pool='avg', **TINY).eval()
    batch = naflex_batch(_images(), P, max_tokens=48, resize=False)
    with torch.no_grad():
        feats = model.forward_features(batch)
        assert feats['patch_valid'] is not None and feats['patches'].shape == (3, 49, TINY['embed_dim'])
        torch.testing.assert_close(model.forward_head(feats), model(batch), atol=0, rtol=0)
        pre = model.forward_head(feats['patches'], pre_logits=True, patch_valid=feats['patch_valid'])
        for b, img in enumerate(_images()):
            alone = model.forward_head(model.forward_features(img[None]), pre_logits=True)
            torch.testing.assert_close(pre[b], alone[0], atol=1e-5, rtol=0)


def test_forward_intermediates_of_a_naflex_batch_are_nlc_per_sample():
    model = timm.create_model('vit_tiny', pe='peg+rope_mixed', **TINY).eval()
    images = _images()
    batch = naflex_batch(images, P, resize=False)
    with torch.no_grad():
        out = model.forward_intermediates(batch, indices=[0, 1], output_fmt='NLC', output_dict=True,
                                          return_prefix_tokens=True)
        assert torch.equal(out['patch_valid'], batch['patch_valid'])
        for b, img in enumerate(images):
            alone = model.forward_intermediates(img[None], indices=[0, 1], output_fmt='NLC', output_dict=True,
                                                return_prefix_tokens=True)
            n = math.prod(img.shape[-2:]) // P ** 2
            for y, y1 in zip(out['image_intermediates'], alone['image_intermediates']):
                torch.testing.assert_close(y[b, :n], y1[0], atol=1e-5, rtol=0)
            for y, y1 in zip(out['image_intermediates_prefix'], alone['image_intermediates_prefix']):
                torch.testing.assert_close(y[b], y1[0], atol=1e-5, rtol=0)
        with pytest.raises(ValueError, match="'NLC'"):
            model.forward_intermediates(batch, output_fmt='NCHW')


def test_a_naflex_batch_trains_with_patch_dropout():
    model = timm.create_model('vit_tiny', pe='rope_mixed', patch_drop_rate=0.5, global_pool='avg', **TINY).train()
    batch = naflex_batch(_images(), P, max_tokens=48, resize=False)
    feats = model.forward_features(batch)
    assert feats['patches'].shape[1] == 1 + 24 and feats['patch_valid'].shape == (3, 24)
    out = model.forward_head(feats)
    out.sum().backward()
    assert torch.isfinite(out).all() and model.patch_embed.proj.weight.grad is not None


def test_a_naflex_batch_needs_its_three_entries_and_a_maskable_pooling():
    model = timm.create_model('vit_tiny', pe='learned', **TINY)
    batch = naflex_batch(_images(), P, resize=False)
    with pytest.raises(ValueError, match='patch_valid'):
        model({k: v for k, v in batch.items() if k != 'patch_valid'})
    prr = timm.create_model('vit_tiny_patch16_224', global_pool='prr', **dict(TINY, dynamic_img_size=True))
    vispe.convert(prr, 'learned')
    with pytest.raises(ValueError, match='AttentionPoolPrr'):
        prr(batch)


# ------------------------------------------------------------------ the benchmark
def test_naflex_throughput_smoke_runs_both_forms(capsys):
    from benchmarks.naflex_throughput import main
    main(['--smoke', '--device', 'cpu'])
    out = capsys.readouterr().out
    for spec in ('none', 'rope_mixed', 'peg'):
        row = next(line for line in out.splitlines() if line.startswith(f'| `{spec}`'))
        cells = [c.strip() for c in row.strip('|').split('|')]
        assert float(cells[-1].rstrip('x')) > 0


def test_a_naflex_batch_compiles_with_the_positions_read_outside_the_graph():
    """Each sample's grid is read from ``patch_coord`` on the host (Python ints), so a NaFlex forward
    compiles with a graph break there (not ``fullgraph``) and equals eager."""
    model = timm.create_model('vit_small_patch16_224', pe='rope_mixed', depth=2, embed_dim=64, num_heads=2).eval()
    batch = vispe.naflex_batch([torch.rand(3, 64, 96), torch.rand(3, 48, 48)], patch_size=16, max_tokens=32)
    with torch.no_grad():
        eager = model(batch)
        compiled = torch.compile(model, backend='aot_eager')(batch)
    assert (compiled - eager).abs().max() <= 1e-5
