"""``python -m vispe``: build a ViT with every registered encoding and print the encoding table.

    python -m vispe                 # plain-text table, parameter counts on ViT-S/16
    python -m vispe --markdown      # the encoding table of the README and the docs
    python -m vispe --model vit_base
"""
from __future__ import annotations

import argparse
import functools
from typing import Dict, List

import timm
import torch

from . import list_pes, pe_info
from .contract import PositionalEncoding

_WHERE = {
    'embed': 'tokens', 'between_blocks': 'between blocks', 'qk': 'q, k', 'bias': 'logit bias',
    'value': 'v', 'output': 'attn output', 'weights_value': 'v (attn weights)',
}


def _acts_on(pe: PositionalEncoding) -> str:
    hooks = pe.capabilities.hooks
    return ', '.join(_WHERE[h] for h in _WHERE if h in hooks) or '-'


def _standalone(name: str) -> PositionalEncoding:
    """Encodings that need camera / padding inputs are described without a ViT host."""
    from . import create_pe
    return create_pe(name, dim=384, num_heads=6, depth=12, grid_size=(14, 14), num_prefix_tokens=1)


def encoding_rows(model: str = 'vit_small') -> List[Dict[str, str]]:
    """One row per registered encoding: its facts and its parameter count in ``model``."""
    rows = []
    for name in list_pes():
        info = pe_info(name)
        cls = info['cls']
        if cls.requires:
            pe = _standalone(name)
            params = f'{sum(p.numel() for p in pe.parameters()):,} (standalone)'
        else:
            # on the meta device: the facts and parameter counts without allocating or initialising weights
            net = timm.create_model(model, pe=name, num_classes=0, device='meta')
            pe = net.pe
            params = f'{sum(p.numel() for p in pe.parameters()):,}'
        inv = cls.shift_invariant
        rows.append(dict(
            name=name, family=info['family'], acts_on=_acts_on(pe),
            shift_invariant='n/a' if inv is None else ('yes' if inv else 'no'),
            larger_input=cls.larger_input, flash='yes' if pe.capabilities.flash_eligible else 'no',
            params=params, paper=cls.paper))
    return rows


_COLUMNS = (('name', 'encoding'), ('family', 'family'), ('acts_on', 'acts on'), ('shift_invariant', 'shift-inv.'),
            ('larger_input', 'larger input'), ('flash', 'flash'), ('params', 'params ({model})'), ('paper', 'paper'))


@functools.lru_cache(maxsize=None)
def markdown_table(model: str = 'vit_small') -> str:
    """The encoding table in markdown, one row per registered encoding (the README's and the docs').
    Cached: building a model per encoding takes seconds, and the docs build asks several times."""
    torch.manual_seed(0)
    rows = encoding_rows(model)
    lines = ['| ' + ' | '.join(h.format(model=model) for _, h in _COLUMNS) + ' |',
             '|' + '|'.join('---' for _ in _COLUMNS) + '|']
    lines += ['| ' + ' | '.join(f'`{r[k]}`' if k == 'name' else r[k] for k, _ in _COLUMNS) + ' |' for r in rows]
    return '\n'.join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description='List vispe encodings with the facts of each.')
    ap.add_argument('--model', default='vit_small', help='host model for parameter counts')
    ap.add_argument('--markdown', action='store_true', help='print the table of the README and the docs')
    args = ap.parse_args()
    if args.markdown:
        print(markdown_table(args.model))
        return
    torch.manual_seed(0)
    rows = encoding_rows(args.model)
    cols = [(k, h.format(model=args.model)) for k, h in _COLUMNS]
    widths = {k: max(len(h), *(len(r[k]) for r in rows)) for k, h in cols if k != 'paper'}
    print('  '.join(h.ljust(widths[k]) for k, h in cols if k != 'paper'))
    for r in rows:
        print('  '.join(r[k].ljust(widths[k]) for k, _ in cols if k != 'paper'))
    print(f'\n{len(rows)} encodings; every one builds inside timm.create_model({args.model!r}, pe=...) '
          f'except those marked standalone (they need camera inputs).')


if __name__ == '__main__':
    main()
