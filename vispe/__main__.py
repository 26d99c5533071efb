"""``python -m vispe``: build a ViT with every registered encoding and print the encoding table; ``python -m
vispe doctor``: check a model's position code (`vispe.doctor`).

    python -m vispe                 # plain-text table, parameter counts on ViT-S/16
    python -m vispe --markdown      # the encoding table of the README and the docs
    python -m vispe --model vit_base
    python -m vispe doctor vit_small_patch16_224                 # a timm (or vispe) model, random weights
    python -m vispe doctor vit_small --pe rope_mixed             # a vispe ViT with an encoding
    python -m vispe doctor configs/quickstart.yaml               # the model of a training config
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

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


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _model_args(text: Optional[str]) -> Dict[str, Any]:
    """``'a=1,b=x'`` -> ``{'a': 1, 'b': 'x'}`` (values read as JSON where they parse)."""
    if not text:
        return {}
    out = {}
    for item in text.split(','):
        key, sep, value = item.partition('=')
        if not sep or not key.strip():
            raise SystemExit(f'--model-args takes key=value pairs separated by commas, got {item!r}')
        out[key.strip()] = _value(value.strip())
    return out


def _config_model(path: Path) -> Dict[str, Any]:
    """``timm.create_model`` arguments from a training config (``model.name``, ``model.pe``, ``model.kwargs``,
    ``data.img_size``)."""
    if path.suffix == '.json':
        cfg = json.loads(path.read_text())
    else:
        try:
            import yaml
        except ImportError as e:
            raise SystemExit('reading a YAML config needs pyyaml: pip install "vispe[train]"') from e
        cfg = yaml.safe_load(path.read_text())
    model = (cfg or {}).get('model') or {}
    if 'name' not in model:
        raise SystemExit(f'{path}: a config for the doctor names its model (model.name: a timm name)')
    kwargs = dict(model.get('kwargs') or {})
    if model.get('pe') is not None:
        kwargs['pe'] = model['pe']
    img = ((cfg.get('data') or {}).get('img_size'))
    if img is not None and 'img_size' not in kwargs:
        kwargs['img_size'] = img
    return dict(name=model['name'], **kwargs)


def doctor_main(argv: Sequence[str]) -> int:
    """``python -m vispe doctor``: 0 when every check passed (or does not apply), 1 when one failed."""
    from . import doctor
    ap = argparse.ArgumentParser(prog='python -m vispe doctor',
                                 description='Check the positional encoding of a model (vispe.doctor).')
    ap.add_argument('model', help='a timm model name (vispe names too) or a training config (.yaml / .json)')
    ap.add_argument('--pe', help='the encoding of a vispe model (timm.create_model(..., pe=...))')
    ap.add_argument('--model-args', help='further timm.create_model arguments: key=value,key=value')
    ap.add_argument('--pretrained', action='store_true', help='load pretrained weights (downloads)')
    ap.add_argument('--resample-mode', help='the resampling mode the table was released with (bilinear, bicubic)')
    ap.add_argument('--no-progress', action='store_true', help='no progress bar')
    args = ap.parse_args(list(argv))
    path = Path(args.model)
    if path.suffix in ('.yaml', '.yml', '.json'):
        if not path.is_file():
            raise SystemExit(f'config {path} not found')
        kwargs = _config_model(path)
        name = kwargs.pop('name')
    else:
        name, kwargs = args.model, {}
    if args.pe is not None:
        kwargs['pe'] = args.pe
    kwargs.update(_model_args(args.model_args))
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=args.pretrained, **kwargs)
    report = doctor(model, resample_mode=args.resample_mode, progress=not args.no_progress)
    print(report)
    return 0 if report.ok else 1


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == 'doctor':
        sys.exit(doctor_main(sys.argv[2:]))
    ap = argparse.ArgumentParser(description='List vispe encodings with the facts of each; '
                                             '`python -m vispe doctor MODEL` checks a model (vispe.doctor).')
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
