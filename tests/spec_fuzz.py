"""Random encoding specs through a tiny ViT: every outcome is a clear error or a finite output.

`run(n, seed)` draws ``n`` specs (one to two encodings, each with up to three options, values drawn
from valid ones, range edges, absurd sizes, non-finite numbers and wrong types, written as spec
text), builds ``timm.create_model('vit_tiny', pe=spec)`` at a tiny size, and runs a train forward
and backward at the training size and an eval forward at a larger, non-square size. Each spec ends
in one outcome:

* ``ok``: finite outputs;
* ``clear at build`` / ``clear at forward`` / ``clear at a larger input``: a ``ValueError`` or
  ``TypeError`` raised by vispe's own code (its message names what was wrong); at build is the goal
  for everything the model's options and host decide, a larger input may meet limits that only it
  reaches (a learned table's rows);
* ``unclear``: any other exception (an error from deep inside torch, an IndexError, ...);
* ``non-finite``: the model ran and gave NaN or inf (a silent failure).

``python tests/spec_fuzz.py [n] [seed]`` prints the counts; `tests/test_validation.py` runs a share.
"""
from __future__ import annotations

import collections
import os
import random
import sys
import traceback
import typing
from typing import Dict, List, Tuple

import timm
import torch

import vispe

TINY = dict(img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2, num_classes=3)
_VISPE = os.path.dirname(os.path.abspath(vispe.__file__))
_INT = ['0', '1', '2', '3', '4', '-1', '7', '64', '100000', '99999999999', '1e9', '2.5', 'x', '']
_FLOAT = ['0', '-1', '1e-30', '1e30', 'inf', '-inf', 'nan', '0.5', '100', '2', 'x']
_BOOL = ['true', 'false', 'maybe']
_TUPLE = ['0', '0|1', '5', '-1', '0-1', '1|1', 'x']


def _values(hint) -> List[str]:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        return ['none'] + (_values(inner[0]) if inner else [])
    if origin is typing.Literal:
        return [str(a) for a in args] + ['bogus']
    if origin in (tuple, typing.Tuple, list):
        return _TUPLE
    return {bool: _BOOL, int: _INT, float: _FLOAT}.get(hint, ['x'])


def random_spec(rng: random.Random) -> str:
    parts = []
    names = [n for n in vispe.list_pes() if n != 'none']
    for name in rng.sample(names, rng.choice([1, 1, 1, 2])):
        hints = {k: v for k, v in vispe.registry._REGISTRY[name].hints.items() if k != 'ctx'}
        chosen = rng.sample(sorted(hints), min(len(hints), rng.choice([0, 1, 2, 3])))
        opts = [f'{k}={rng.choice(_values(hints[k]))}' for k in chosen]
        parts.append(name + (':' + ','.join(opts) if opts else ''))
    return '+'.join(parts)


def _raised_by_vispe(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and frames[-1].filename.startswith(_VISPE)


def outcome(spec: str) -> Tuple[str, str]:
    """(outcome, detail) of one spec (see the module docstring)."""
    stage = 'build'
    try:
        model = timm.create_model('vit_tiny', pe=spec, **TINY)
        stage = 'forward'
        out = model(torch.randn(2, 3, 32, 32))
        out.sum().backward()
        stage = 'a larger input'
        model.eval()
        with torch.no_grad():
            big = model(torch.randn(1, 3, 48, 40))
    except (ValueError, TypeError, NotImplementedError) as e:
        if _raised_by_vispe(e):
            return f'clear at {stage}', str(e).splitlines()[0][:160]
        return 'unclear', f'{type(e).__name__} at {stage}: {str(e).splitlines()[0][:160]}'
    except Exception as e:  # anything else is an unclear error
        return 'unclear', f'{type(e).__name__} at {stage}: {str(e).splitlines()[0][:160] if str(e) else ""}'
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not (torch.isfinite(out).all() and torch.isfinite(big).all() and all(torch.isfinite(g).all() for g in grads)):
        return 'non-finite', 'output or gradient not finite'
    return 'ok', ''


def run(n: int, seed: int = 0) -> Dict[str, List[Tuple[str, str]]]:
    """Outcome -> [(spec, detail)] for ``n`` random specs."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    results: Dict[str, List[Tuple[str, str]]] = collections.defaultdict(list)
    for _ in range(n):
        spec = random_spec(rng)
        kind, detail = outcome(spec)
        results[kind].append((spec, detail))
    return results


if __name__ == '__main__':
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    res = run(n, seed)
    for kind in ('ok', 'clear at build', 'clear at forward', 'clear at a larger input', 'unclear', 'non-finite'):
        print(f'{kind:24s} {len(res.get(kind, []))}')
    for kind in ('unclear', 'non-finite', 'clear at forward', 'clear at a larger input'):
        for spec, detail in res.get(kind, [])[:40]:
            print(f'  {kind}: {spec!r}: {detail}')
