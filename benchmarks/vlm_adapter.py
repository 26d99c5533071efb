"""Cost of `vispe.integrations.patch_vlm` on a transformers Qwen-VL model (CPU by default), as ratios.

Two measurements, each against transformers' own code in the same process:

* **train step**: forward + loss + backward of a small Qwen-VL model (random init, from a config) on a
  batch of text, images and videos, patched with the model's own encoding (and, for comparison, with
  ``--schemes``, encoding specs) over an identical unpatched instance; interleaved rounds, the process
  CPU clock, one thread (goal: own encoding within 5 %);
* **ids**: position ids of a ~1M-token multimodal batch (``--tokens``; images and videos among
  text) through `vispe.integrations.transformers_vlm.rope_index` over the model's ``get_rope_index``
  on the same token ids (after checking both give the same ids).

    python benchmarks/vlm_adapter.py                        # Qwen2-VL, 1M tokens for the ids
    python benchmarks/vlm_adapter.py --family qwen3_vl --schemes videorope:delta=2 mhrope
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # vispe from this checkout
import vispe  # noqa: E402
from vispe.integrations import patch_vlm  # noqa: E402
from vispe.integrations.transformers_vlm import _FAMILIES, rope_index  # noqa: E402
from vispe_models.qwen_vl import TOKENS, labels_for, qwen_vl_batch, tiny_qwen_vl  # noqa: E402
from _timing import compare, time_fn  # noqa: E402


def train_batch(family: str, samples: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    rng = random.Random(seed)
    rows = []
    for _ in range(samples):
        rows.append([('text', rng.randint(8, 24)), ('image', (8, 8)), ('text', rng.randint(4, 12)),
                     ('video', (4, 8, 8), rng.choice([0.5, 1.0])), ('text', rng.randint(8, 24))])
    return qwen_vl_batch(family, rows, seed=seed)


def train_step(model, batch):
    labels = labels_for(batch)
    model.train()

    def run():
        model.zero_grad(set_to_none=True)
        model(**batch, labels=labels).loss.backward()
    return run


def ids_batch(family: str, tokens: int, rows: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Token ids of ``rows`` sequences totalling about ``tokens``: text with images (32 x 32 patches,
    256 tokens) and videos (8 x 32 x 32 patches), about one visual token in two."""
    rng = random.Random(seed)
    samples = []
    per_row = tokens // rows
    for _ in range(rows):
        segs, n = [], 0
        while n < per_row:
            t = rng.randint(64, 512)
            segs.append(('text', t))
            n += t
            if rng.random() < 0.8:
                segs.append(('image', (32, 32)))
                n += 256
            else:
                segs.append(('video', (8, 32, 32), rng.choice([0.5, 1.0, 2.0])))
                n += 8 * 256
        samples.append(segs)
    batch = qwen_vl_batch(family, samples, seed=seed)
    batch.pop('pixel_values', None)
    batch.pop('pixel_values_videos', None)
    return batch


def main(argv: List[str] = None) -> Dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--family', default='qwen2_vl', choices=tuple(_FAMILIES))
    p.add_argument('--schemes', nargs='*', default=['videorope'],
                   help='swapped encodings (specs) to time beside the own one')
    p.add_argument('--hidden', type=int, default=256)
    p.add_argument('--layers', type=int, default=4)
    p.add_argument('--samples', type=int, default=4, help='sequences in the train batch')
    p.add_argument('--tokens', type=int, default=1_000_000, help='tokens of the ids batch')
    p.add_argument('--rows', type=int, default=4, help='sequences of the ids batch')
    p.add_argument('--rounds', type=int, default=7)
    p.add_argument('--threads', type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    fam = a.family
    results: Dict[str, float] = {}

    # ---- train step: patched vs unpatched instance of the same model
    heads = max(2, a.hidden // 32)
    base = tiny_qwen_vl(fam, hidden=a.hidden, heads=heads, kv_heads=max(1, heads // 2), layers=a.layers)
    batch = train_batch(fam, a.samples)
    fns = {'unpatched': train_step(base, batch)}
    models = {}
    for scheme in [None] + list(a.schemes):
        m = tiny_qwen_vl(fam, hidden=a.hidden, heads=heads, kv_heads=max(1, heads // 2), layers=a.layers)
        patch_vlm(m, scheme)
        name = f'patched {scheme or "own (" + _FAMILIES[fam].encoding + ")"}'
        models[name] = m
        fns[name] = train_step(m, batch)
    times = compare(fns, rounds=a.rounds, per_round=1, warmup=1, clock='process')
    tokens = int(batch['attention_mask'].sum())
    print(f'train step, {fam}, width {a.hidden}, {a.layers} layers, {tokens} tokens, {a.threads} thread(s):')
    for name, t in times.items():
        ratio = t / times['unpatched']
        results[f'train {name}'] = ratio
        print(f'  {name:32s} {1e3 * t:8.1f} ms   x {ratio:.3f} unpatched')

    # ---- ids of a ~1M-token batch: vispe vs the model's own get_rope_index
    ib = ids_batch(fam, a.tokens, a.rows)
    keys = ('mm_token_type_ids', 'image_grid_thw', 'video_grid_thw', 'attention_mask', 'second_per_grid_ts')
    kw = {k: ib[k] for k in keys if k in ib}
    fam_cfg = _FAMILIES[fam]
    tps = base.config.vision_config.tokens_per_second if fam_cfg.timed else None
    opts = {} if fam_cfg.encoding == 'mrope_interleave' else dict(tokens_per_second=tps)
    ids_kw = {k: TOKENS[k] for k in ('image_token_id', 'video_token_id', 'vision_start_token_id')}
    pe = vispe.create_pe({'name': fam_cfg.encoding, **opts}, dim=a.hidden, num_heads=heads)

    def ours():
        return rope_index(pe, ib['input_ids'], video_blocks=fam_cfg.video_blocks, spatial_merge_size=2, **ids_kw,
                          **kw)

    def theirs():
        args = dict(kw)
        if 'video_grid_thw' in args:
            args['video_grid_thw'] = args['video_grid_thw'].clone()
        with torch.no_grad():
            return base.model.get_rope_index(ib['input_ids'], **args)

    a_ids, a_d = ours()
    b_ids, b_d = theirs()
    if not (torch.equal(a_ids, b_ids) and torch.equal(a_d, b_d.to(a_d.dtype))):
        raise RuntimeError('vispe ids differ from get_rope_index on the benchmark batch')
    t_ours = time_fn(ours, warmup=1, iters=max(3, a.rounds))
    t_theirs = time_fn(theirs, warmup=0, iters=3)
    n = int(ib['attention_mask'].sum())
    results['ids speedup'] = t_theirs / t_ours
    print(f'ids, {n} tokens in {ib["input_ids"].shape[0]} rows ({fam}):')
    print(f'  vispe rope_index     {1e3 * t_ours:9.1f} ms  ({n / t_ours / 1e6:6.1f} M tokens/s)')
    print(f'  get_rope_index       {1e3 * t_theirs:9.1f} ms  ({n / t_theirs / 1e6:6.1f} M tokens/s)')
    print(f'  speedup x {t_theirs / t_ours:.1f} (ratio vispe / transformers = {t_ours / t_theirs:.4f})')
    return results


if __name__ == '__main__':
    main()
