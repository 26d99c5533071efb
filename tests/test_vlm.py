"""The VLM connector and small LM: merge windows, positions on the resampler keys, pure text equal to
1D RoPE through the whole LM, causality, padding, and a 20-step training smoke of the end-to-end model."""
from pathlib import Path

import pytest
import torch

from vispe_models.vlm import VLM, ColourGridDataset, ColourGridTask, DecoderLM, MLPProjector, Resampler
import vispe
from vispe import Image, Text

MULTIMODAL = tuple(n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal')


def ids_of(layout, scheme):
    """Ids of a `vispe.sequence` (one layout or a batch) under a multimodal encoding."""
    return vispe.create_pe(scheme, dim=64, num_heads=4).position_ids(vispe.sequence(layout))


def test_mlp_projector_merges_each_2x2_window_into_one_token():
    torch.manual_seed(0)
    proj = MLPProjector(8, 16, merge=2)
    x = torch.randn(2, 4 * 6, 8)
    y = proj(x, (4, 6))
    assert y.shape == (2, 2 * 3, 16)
    x2 = x.clone()
    x2[:, 1 * 6 + 3] += 1.0  # patch (row 1, col 3) lies in merged window (0, 1)
    changed = (proj(x2, (4, 6)) - y).abs().amax(-1) > 0
    assert changed[0].tolist() == [False, True, False, False, False, False]


@pytest.mark.parametrize('pe', ['sincos', 'rope_axial', 'pape', 'irpe:on=v,init_std=1'])
def test_resampler_keys_carry_position(pe):
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8)
    perm = torch.randperm(16)
    with_pe = Resampler(8, 16, num_queries=4, num_heads=2, pe=pe, grid_size=(4, 4)).eval()
    no_pe = Resampler(8, 16, num_queries=4, num_heads=2, pe='none', grid_size=(4, 4)).eval()
    # without an encoding, attention over the image tokens is permutation-invariant; with one it is not
    assert torch.allclose(no_pe(x, (4, 4)), no_pe(x[:, perm], (4, 4)), atol=1e-5)
    assert not torch.allclose(with_pe(x, (4, 4)), with_pe(x[:, perm], (4, 4)), atol=1e-3)


def test_resampler_additive_encoding_reaches_keys_not_values():
    torch.manual_seed(0)
    res = Resampler(8, 16, num_queries=4, num_heads=2, pe='sincos', grid_size=(2, 2)).eval()
    x = torch.randn(1, 4, 8)
    # make every key identical: attention is uniform, so the output is the mean of the values, which
    # would carry the sin-cos table had it been added to them
    with torch.no_grad():
        res.k.weight.zero_()
        res.k.bias.zero_()
    out = res(x, (2, 2))
    kv = res.norm_kv(res.kv_in(x))
    expected = res.proj(res.v(kv).mean(1, keepdim=True)).expand_as(out)
    assert torch.allclose(out, expected, atol=1e-5)


@pytest.mark.parametrize('pe', ['rope_axial', 'irpe:on=v', 'pape'])
def test_resampler_with_an_attention_encoding_needs_a_square_query_lattice(pe):
    with pytest.raises(ValueError, match='square number'):
        Resampler(8, 16, num_queries=6, num_heads=2, pe=pe, grid_size=(4, 4))
    Resampler(8, 16, num_queries=6, num_heads=2, pe='sincos', grid_size=(4, 4))  # keys only: any number


@pytest.mark.parametrize('scheme', [s for s in MULTIMODAL if s != 'hope'])  # HoPE: temporal pairs are NoPE
def test_lm_on_pure_text_equals_1d_rope_for_every_scheme(scheme):
    torch.manual_seed(0)
    ref = DecoderLM(20, dim=32, depth=2, num_heads=4, num_kv_heads=4, scheme='rope_1d').eval()
    lm = DecoderLM(20, dim=32, depth=2, num_heads=4, num_kv_heads=4, scheme=scheme).eval()
    lm.load_state_dict(ref.state_dict())
    tokens = torch.randint(20, (2, 9))
    ids_ref, _ = ids_of([[Text(9)]] * 2, 'rope_1d')
    ids, _ = ids_of([[Text(9)]] * 2, scheme)
    with torch.no_grad():
        assert torch.equal(lm(lm.embed(tokens), ids), ref(ref.embed(tokens), ids_ref))


def test_lm_is_causal():
    torch.manual_seed(0)
    lm = DecoderLM(20, dim=48, depth=2, num_heads=6, num_kv_heads=3, scheme='mhrope').eval()  # GQA
    tokens = torch.randint(20, (1, 8))
    ids, _ = ids_of([[Text(8)]], 'mhrope')
    other = tokens.clone()
    other[0, 5:] = (other[0, 5:] + 1) % 20
    with torch.no_grad():
        a, b = lm(lm.embed(tokens), ids), lm(lm.embed(other), ids)
    assert torch.allclose(a[:, :5], b[:, :5], atol=1e-6) and not torch.allclose(a[:, 5:], b[:, 5:])


IMG_SIZE = 16  # 4 x 4 patches of 4 px: 2 x 2 LM tokens after the merge (or 4 resampler queries)


def small_task_and_model(connector='mlp', scheme='mrope', vision_pe='rope_axial', **kw):
    torch.manual_seed(0)
    task = ColourGridTask(grid=4, num_colours=4)
    model = VLM(task.vocab_size, img_size=IMG_SIZE, patch_size=4, vision_pe=vision_pe, vision_dim=32,
                vision_depth=1, vision_heads=2, connector=connector, num_queries=4, lm_dim=32, lm_depth=2,
                lm_heads=4, scheme=scheme, **kw)
    assert model.visual_grid((IMG_SIZE, IMG_SIZE)) == (2, 2)
    return task, model


def sample(task, n, seed):
    return task.sample(n, IMG_SIZE, 4, torch.Generator().manual_seed(seed))


def test_vlm_ids_are_the_layout_ids_of_the_prompt():
    task, model = small_task_and_model()
    batch = sample(task, 3, 0)
    ids = model.position_ids(batch['input_ids'], (2, 2), batch['attention_mask'])
    for b in range(3):
        n_real = int(batch['attention_mask'][b].sum())
        # [bos, filler.., vision_start], 2x2 merged image tokens, [vision_end, Q, row, col]
        layout = [Text(n_real - 4 - 4), Image(grid=(1, 4, 4), merge=2), Text(4)]
        expected, _ = ids_of(layout, 'mrope')
        assert torch.equal(ids[:, b, -n_real:], expected)


@pytest.mark.parametrize('connector, scheme', [('mlp', 'mrope'), ('resampler', 'vrope'), ('mlp', 'v2pe')])
def test_vlm_left_padding_does_not_change_the_real_tokens(connector, scheme):
    task, model = small_task_and_model(connector, scheme, resampler_pe='rope_axial')
    model.eval()
    batch = sample(task, 4, 1)
    with torch.no_grad():
        logits = model(batch['images'], batch['input_ids'], batch['attention_mask'])
        for b in range(4):
            keep = batch['attention_mask'][b].bool()
            alone = model(batch['images'][b:b + 1], batch['input_ids'][b:b + 1, keep])
            assert torch.allclose(logits[b, keep], alone[0], atol=1e-4)


def test_vlm_training_smoke_20_steps():
    task, model = small_task_and_model('mlp', 'mrope_interleave')
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(20):
        batch = task.sample(8, IMG_SIZE, 4, g)
        loss = task.loss(model(batch['images'], batch['input_ids'], batch['attention_mask']), batch['labels'])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5
    for part in ('vision.', 'connector.', 'lm.'):
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters() if n.startswith(part)), part


def test_vlm_training_step_with_v2pe_random_strides_and_resampler():
    task, model = small_task_and_model('resampler', 'v2pe', resampler_pe='sincos')
    batch = sample(task, 4, 0)
    model.train()
    loss = task.loss(model(batch['images'], batch['input_ids'], batch['attention_mask']), batch['labels'])
    loss.backward()
    assert torch.isfinite(loss) and model.connector.queries.grad.abs().sum() > 0


def test_colour_grid_items_are_reproducible_and_answer_the_question():
    task = ColourGridTask(grid=4, num_colours=4)
    ds = ColourGridDataset(task, size=10, img_size=16, visual_tokens=4, seed=3, split='val')
    a, b = ds[7], ds[7]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(ds[7]['images'], ColourGridDataset(task, 10, 16, 4, seed=3, split='train')[7]['images'])
    r = int(a['input_ids'][-2]) - task.row0
    c = int(a['input_ids'][-1]) - task.col0
    cell = a['images'][:, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4].mean((1, 2)) * 0.5 + 0.5  # undo the normalisation
    colour = int((task.PALETTE[:task.num_colours] - cell).abs().sum(1).argmin())
    assert int(a['labels']) == task.colour0 + colour
    keep = a['attention_mask'].bool()
    assert a['input_ids'][keep][0] == task.tokens.bos and bool(keep[-1])  # left padding


def test_training_script_runs_the_vlm_task_and_its_resolution_sweep(tmp_path):
    from train.cli import run
    config = Path(__file__).resolve().parent.parent / 'configs' / 'vlm' / 'synthetic.yaml'
    results = run(str(config), ['sweep={}', 'data.train_size=32', 'data.val_size=8', 'train.epochs=1',
                                'train.batch_size=16', 'model.vision_depth=1', 'model.lm_depth=1',
                                'model.scheme=v2pe', f'output_dir={tmp_path}', 'extrapolate.sizes=[32,48]',
                                'log.progress=off', 'log.tensorboard=off'])
    assert len(results) == 1 and results[0].steps == 2
    assert results[0].best['metric'] == 'accuracy' and 0 <= results[0].best['value'] <= 100
    table = (tmp_path / 'vlm_synthetic' / 'extrapolation.md').read_text()
    assert 'v2pe / vit rope_axial' in table and '48' in table
