"""``vispe.doctor(model)``: the position properties of `vispe.checks`, run on any model, read only.

Position bugs rarely raise: a rounded frequency table, a table that is not resampled, ids built for
another grid, a rotation applied in the wrong pair layout, an encoding whose output nobody reads. The
model runs and is quietly worse. The doctor finds the position code of a model and holds it to the
properties that code promises (`vispe.checks.CHECKS`), reporting for each what it compared and the
number it measured.

How it finds the position code. A *host* is a small function that recognises one kind of position code
in a module tree (by the attributes and class names the library gives it, so its library is never
imported for a model that does not use it) and returns *probes*: callables that run checks. Hosts:

* ``vispe``: every vispe encoding in the tree (vispe's ViTs, converted timm models, models patched by an
  adapter), and the encoding an adapter's handle holds (`register_adapter`);
* ``timm``: a timm ViT's learned table (resampled through the model's own ``_pos_embed``) and an Eva's
  rotary module, with the attention's pair layout;
* ``transformers``: ViT / DeiT / DINOv2 / CLIP / SigLIP tables (``interpolate_pos_encoding``), SigLIP 2's
  NaFlex table and padded batches, DINOv3's rotary, the Qwen-VL vision towers' rotary and packed images,
  the Qwen-VL language side's multimodal ids (``get_rope_index``) and ``mrope_section``;
* ``diffusers``: FLUX's ``pos_embed`` (ids, axes split) and Wan's ``rope`` (t / h / w split);
* ``images``: a model that takes images and returns one token per patch (timm, vispe, transformers
  vision encoders): the position path must move the output (patches permuted) and the grid must matter
  at an equal token count.

A new host is one `register_host` call; an adapter that keeps its encoding on its handle is one
`register_adapter` call. The doctor never changes the model: it runs under ``no_grad`` in eval mode
(each module's mode is restored afterwards), adds no hooks, and works on copies of the position modules
where a check needs another dtype.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import checks as C
from .attention import pe_attention
from .contract import PositionalEncoding
from .integrations.base import find_patch
from .positions import Positions, grid, naflex_grid

__all__ = ['doctor', 'Report', 'Probe', 'register_host', 'register_adapter', 'HOSTS', 'ADAPTERS']

log = logging.getLogger(__name__)

EQUAL_COUNT_GRIDS = ((2, 8), (4, 4))
"""Two token grids with one token count (timm PR #2737: a table not resampled between them)."""
MOVES_AT_LEAST = 1e-5
"""Relative difference wanted where positions differ: a dead path gives float32 rounding only (~1e-7); a live
one, even at a random initialisation's near-uniform attention, gives 1e-4 and more. Model-level checks of a
half-precision model run on a float32 copy."""
BF16_RTOL = 2e-2
"""Position outputs in bfloat16 against float64: bf16 rounds outputs by 2^-9 of their scale; angles
computed in bf16 err by position * 2^-8 radians, which the large grids here make far bigger."""


# ====================================================================== report
@dataclass
class Report:
    """What the doctor found: one `vispe.checks.CheckResult` per check and subject.

    Attributes:
        model: the model's class name.
        results: every result, in the order the checks ran.
        hosts: the hosts that recognised position code in the model.
        seconds: wall time of the whole check.
    """
    model: str
    results: List[C.CheckResult]
    hosts: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def failed(self) -> List[C.CheckResult]:
        return [r for r in self.results if r.failed]

    @property
    def passed(self) -> List[C.CheckResult]:
        return [r for r in self.results if r.passed]

    @property
    def not_applicable(self) -> List[C.CheckResult]:
        return [r for r in self.results if not r.applicable]

    @property
    def ok(self) -> bool:
        """True when no check failed."""
        return not self.failed

    def flagged(self, check: str) -> bool:
        """Whether check ``check`` (a name of `vispe.checks.CHECKS`) failed anywhere."""
        if check not in C.CHECKS:
            raise ValueError(f'check must be one of {sorted(C.CHECKS)}, got {check!r}')
        return any(r.failed and r.check == check for r in self.results)

    def __str__(self) -> str:
        head = (f'vispe.doctor: {self.model}: {len(self.failed)} failed, {len(self.passed)} passed, '
                f'{len(self.not_applicable)} not applicable ({self.seconds:.1f} s; hosts: '
                f'{", ".join(self.hosts) or "none"})')
        order = {C.FAILED: 0, C.PASSED: 1, C.NOT_APPLICABLE: 2}
        lines = [str(r) for r in sorted(self.results, key=lambda r: order[r.status])]
        return '\n'.join([head] + ['  ' + line for line in lines])


# ====================================================================== hosts
@dataclass(frozen=True)
class Probe:
    """One piece of position code a host found: ``run()`` returns its check results."""
    subject: str
    run: Callable[[], List[C.CheckResult]]


@dataclass
class _Context:
    """What every host may read: the model, the example inputs, its dtype and device, the options."""
    model: nn.Module
    inputs: Any
    dtype: torch.dtype
    device: torch.device
    resample_mode: Optional[str]
    generator: torch.Generator

    def randn(self, *shape: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(
            device=self.device, dtype=dtype or self.dtype)


Host = Callable[[_Context], List[Probe]]
HOSTS: Dict[str, Host] = {}
"""The hosts by name, in the order they look (`register_host`)."""
ADAPTERS: Dict[str, str] = {}
"""Adapter name (its handle's ``adapter``) -> the handle attribute holding the vispe encoding it installed."""


def register_host(name: str, host: Host) -> Host:
    """Add a host: ``host(ctx)`` returns the `Probe` list of the position code it recognises in
    ``ctx.model`` (an empty list when there is none). Recognise by attributes and class names; import a
    library only once its model is recognised."""
    HOSTS[name] = host
    return host


def register_adapter(adapter: str, attribute: str = 'encoding') -> None:
    """An adapter whose handle (``vispe.integrations.find_patch(model)``) keeps the vispe encoding it
    installed in ``handle.<attribute>``: the doctor checks that encoding as any other."""
    ADAPTERS[adapter] = attribute


for _name in ('patch_detr', 'patch_vision', 'patch_dit'):
    register_adapter(_name, 'encoding')


def _named(model: nn.Module, cls_names: Sequence[str]) -> Iterator[Tuple[str, nn.Module]]:
    """The modules of these classes whose own forward still runs (a vispe patch that replaced a module's
    forward is checked through the encoding it installed, not through the module it bypasses)."""
    patch = find_patch(model)
    for name, m in model.named_modules():
        if type(m).__name__ in cls_names and not (patch is not None and patch.replaces_forward(m)):
            yield name or type(m).__name__, m


def _library(module: nn.Module) -> str:
    return type(module).__module__.split('.')[0]


def _namespace(module: nn.Module) -> Any:
    """The Python module that defines ``module``'s class (its library's functions that go with it)."""
    return sys.modules[type(module).__module__]


# ====================================================================== vispe encodings
def _hook_outputs(pe: PositionalEncoding, pos: Positions, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """Every hook's output on tokens ``x`` and projections ``q, k, v`` at ``pos``: the tokens after ``embed``,
    the attention output, the tokens after ``between_blocks`` of block 0."""
    prepared = pe.prepare(pos)
    y = prepared.embed(x)
    o = pe_attention(q, k, v, prepared, layer=0, x=y, attn_mask=attn_mask)
    return [y, o.transpose(1, 2).flatten(2), prepared.between_blocks(y, 0)]


def _tokens(ctx: _Context, pe: PositionalEncoding, n: int, batch: int = 1, dtype: torch.dtype = torch.float64
            ) -> Tuple[torch.Tensor, ...]:
    c = pe.ctx
    return (ctx.randn(batch, n, c.dim, dtype=dtype),) + tuple(
        ctx.randn(batch, c.num_heads, n, c.head_dim, dtype=dtype) for _ in range(3))


def _grid_shapes(axes: int) -> Tuple[Tuple[int, ...], Tuple[int, ...], Tuple[int, ...]]:
    """(a grid for the relative check, the two equal-count grids) with ``axes`` axes."""
    lead = (2,) * (axes - 2)
    a, b = EQUAL_COUNT_GRIDS
    return lead + (5, 6), lead + a, lead + b


def _encoding_checks(ctx: _Context, subject: str, pe: PositionalEncoding) -> List[C.CheckResult]:
    caps = pe.capabilities
    if caps.requires:
        reason = f'the encoding needs {sorted(caps.requires)} beyond a token grid'
        return [C.not_applicable(c, subject, reason) for c in C.CHECKS]
    if not caps.hooks:
        return [C.not_applicable(c, subject, 'the encoding has no position path (NoPE)') for c in C.CHECKS]
    pc = pe.ctx
    axes = len(pc.grid_size) if pc.grid_size else (pc.num_axes or 2)
    if axes < 2:
        return [C.not_applicable(c, subject, f'{axes}-axis positions have no grid') for c in C.CHECKS]
    rel_grid, g28, g44 = _grid_shapes(axes)
    P, train = pc.num_prefix_tokens, pc.grid_size
    pe64 = copy.deepcopy(pe).double()
    note = _wake(pe64, ctx)
    out = []

    # relative logits: one query and one key vector at every token, logits between positioned tokens
    if pe.shift_invariant is not True:
        out.append(C.not_applicable('relative_logits', subject, 'the encoding does not claim shift invariance '
                                    f'(shift_invariant={pe.shift_invariant})'))
    elif not caps.hooks & {'qk', 'bias'}:
        out.append(C.not_applicable('relative_logits', subject, 'the encoding adds no q/k map or logit bias'))
    else:
        pos = grid(*rel_grid, num_prefix=P, train_grid=train, dtype=torch.float64)
        n = pos.num_tokens
        x, q, k, _ = _tokens(ctx, pe, 1)
        x, q, k = x.expand(1, n, -1), q.expand(-1, -1, n, -1), k.expand(-1, -1, n, -1)
        prepared = pe64.prepare(pos)
        q2, k2 = prepared.qk(q, k, 0, x=x) if 'qk' in caps.hooks else (q, k)
        logits = q2 @ k2.transpose(-1, -2) * pc.head_dim ** -0.5
        bias = prepared.bias(q, k, 0) if 'bias' in caps.hooks else None
        if bias is not None:
            logits = logits + bias
        out.append(C.offset_invariance(logits[..., P:, P:], pos.coords, rtol=1e-6, subject=subject))

    # float32: the tables as given, and the computation of a bfloat16 copy against float64 on a large grid
    buffers = {n: b for n, b in pe.named_buffers()}
    if buffers:
        out.append(C.float32_tables(buffers, subject=subject))
    big = (2,) * (axes - 2) + (16, 16)
    pos = grid(*big, num_prefix=P, train_grid=train)
    bf = copy.deepcopy(pe64).to(torch.bfloat16)
    ref = copy.deepcopy(bf).double()
    x, q, k, _ = _tokens(ctx, pe, pos.num_tokens, dtype=torch.float64)
    got, want = _position_maps(bf, pos, x, q, k, torch.bfloat16), _position_maps(ref, pos, x, q, k, torch.float64)
    for what in got:
        out.append(C.matches_reference(got[what], want[what], check='float32_tables', rtol=BF16_RTOL, subject=subject,
                                       compared=f'{what} of a bfloat16 copy against float64 on a {big} grid'))

    # the encoding moves the output: tokens permuted at fixed positions, outputs permuted back
    pos = grid(*rel_grid, num_prefix=P, train_grid=train, dtype=torch.float64)
    n = pos.num_tokens
    x, q, k, v = _tokens(ctx, pe, n)
    perm = torch.cat([torch.arange(P), P + torch.randperm(n - P, generator=ctx.generator)])
    inv = torch.argsort(perm)
    a = _hook_outputs(pe64, pos, x, q, k, v)
    b = _hook_outputs(pe64, pos, x[:, perm], q[:, :, perm], k[:, :, perm], v[:, :, perm])
    out.append(C.moves_output(torch.cat([t.flatten() for t in a]), torch.cat([t[:, inv].flatten() for t in b]),
                              at_least=MOVES_AT_LEAST, what='hook outputs against those of the tokens permuted '
                              'at fixed positions and permuted back', subject=subject))

    # the grid matters at an equal token count
    n = P + math.prod(g28)
    x, q, k, v = _tokens(ctx, pe, n)
    a = _hook_outputs(pe64, grid(*g28, num_prefix=P, train_grid=train, dtype=torch.float64), x, q, k, v)
    b = _hook_outputs(pe64, grid(*g44, num_prefix=P, train_grid=train, dtype=torch.float64), x, q, k, v)
    out.append(C.moves_output(torch.cat([t.flatten() for t in a]), torch.cat([t.flatten() for t in b]),
                              at_least=MOVES_AT_LEAST, check='grid_change',
                              what=f'hook outputs of one token sequence on grids {g28} and {g44}', subject=subject))

    out.append(_encoding_padded(ctx, subject, pe64, axes))
    out.append(_encoding_resample(ctx, subject, pe64))
    out.append(C.not_applicable('head_split', subject, 'the encoding declares no per-axis sections'))
    out.append(C.not_applicable('ids_cover', subject, 'grid positions, no position ids'))
    return [_noted(r, note) for r in out]


def _noted(result: C.CheckResult, note: str) -> C.CheckResult:
    if not note or not result.applicable:
        return result
    return dataclasses.replace(result, reason='; '.join(x for x in (result.reason, note) if x))


def _wake(module: nn.Module, ctx: _Context, names: Optional[Sequence[str]] = None) -> str:
    """Parameters that are all zero (an untrained zero initialisation, as iRPE's tables) make every position
    path look dead: on this copy they get small random values, and the checks say so."""
    params = [p for n, p in module.named_parameters() if names is None or n in names]
    if not params or any(bool(p.detach().ne(0).any()) for p in params):
        return ''
    with torch.no_grad():
        for p in params:
            p.copy_(0.5 * torch.randn(p.shape, generator=ctx.generator, dtype=torch.float64).to(p.dtype))
    return 'position parameters all zero (untrained): checked with random values on a copy'


def _position_maps(pe: PositionalEncoding, pos: Positions, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   dtype: torch.dtype) -> Dict[str, torch.Tensor]:
    """What the encoding makes of positions: the embedding, rotated q and k, the logit bias."""
    caps, out = pe.capabilities, {}
    x, q, k = x.to(dtype), q.to(dtype), k.to(dtype)
    prepared = pe.prepare(pos)
    if caps.additive:
        out['embedding'] = prepared.embed(torch.zeros_like(x)).float()
    if 'qk' in caps.hooks:
        q2, k2 = prepared.qk(q, k, 0, x=x)
        out['rotated q and k'] = torch.cat([q2.flatten(), k2.flatten()]).float()
    if 'bias' in caps.hooks:
        bias = prepared.bias(q, k, 0)
        if bias is not None:  # masked logits (a dtype's lowest value, -inf) compared as a mask
            masked = bias <= torch.finfo(bias.dtype).min / 2
            out['logit bias'] = bias.masked_fill(masked, 0).float()
            out['logit mask'] = masked.float()
    return out


def _encoding_padded(ctx: _Context, subject: str, pe: PositionalEncoding, axes: int) -> C.CheckResult:
    grids = [(3, 4), (2, 2)] if axes == 2 else [(2, 2, 3), (1, 2, 2)]
    P = pe.ctx.num_prefix_tokens
    pos = naflex_grid(grids, num_prefix=P, train_grid=pe.ctx.grid_size, dtype=torch.float64)
    B, N = len(grids), pos.num_tokens
    x, q, k, v = _tokens(ctx, pe, N, batch=B)
    pad = torch.cat([torch.zeros(B, P, dtype=torch.bool), pos.key_padding_mask], 1)
    try:
        together = _hook_outputs(pe, pos, x, q, k, v, attn_mask=~pad[:, None, None, :])
        parts, alone = [], []
        for b, shape in enumerate(grids):
            n = P + math.prod(shape)
            one = _hook_outputs(pe, pos.sample(b), x[b:b + 1, :n], q[b:b + 1, :, :n], k[b:b + 1, :, :n],
                                v[b:b + 1, :, :n])
            parts.append(torch.cat([t[b:b + 1, :n].flatten() for t in together]))
            alone.append(torch.cat([t.flatten() for t in one]))
    except (NotImplementedError, ValueError) as e:
        return C.not_applicable('padded_alone', subject, f'the encoding takes no per-sample grids ({e})')
    return C.padded_equals_alone(parts, alone, atol=1e-9, rtol=1e-9, subject=subject)


def _encoding_resample(ctx: _Context, subject: str, pe: PositionalEncoding) -> C.CheckResult:
    table = getattr(pe, 'pos_embed', None)
    mode = ctx.resample_mode or getattr(pe, 'interpolation', None)
    if not isinstance(table, torch.Tensor) or mode is None or not pe.ctx.grid_size or len(pe.ctx.grid_size) != 2:
        return C.not_applicable('resample_mode', subject, 'no learned 2D table with a declared resampling mode')
    h, w = pe.ctx.grid_size
    stored = table.detach()[0, table.shape[1] - h * w:].reshape(h, w, -1)
    new = (h + 3, w + 1)
    pos = grid(*new, num_prefix=0, train_grid=(h, w), dtype=stored.dtype)
    resized = pe.embedding(pos)
    resized = resized.reshape(-1, resized.shape[-1])[-math.prod(new):].reshape(*new, -1)
    return C.resample_mode(resized, stored, mode, subject=subject)


def _top_encodings(model: nn.Module) -> List[Tuple[str, PositionalEncoding]]:
    """The vispe encodings of ``model``'s tree that no other encoding holds (a composition's parts are
    checked through the composition), and the one an adapter's handle keeps."""
    found: List[Tuple[str, PositionalEncoding]] = []
    inner: set = set()
    for name, m in model.named_modules():
        if isinstance(m, PositionalEncoding) and id(m) not in inner:
            found.append((name or type(m).__name__, m))
            inner.update(id(s) for s in m.modules() if s is not m)
    handle = find_patch(model)
    if handle is not None:
        attr = ADAPTERS.get(getattr(handle, 'adapter', ''))
        enc = getattr(handle, attr, None) if attr else None
        if isinstance(enc, PositionalEncoding) and all(e is not enc for _, e in found):
            found.append((f'{handle.adapter}.{attr}', enc))
    return found


def _vispe_host(ctx: _Context) -> List[Probe]:
    probes = []
    for name, pe in _top_encodings(ctx.model):
        subject = f'{name} ({pe.name or type(pe).__name__})'
        probes.append(Probe(subject, lambda s=subject, p=pe: _encoding_checks(ctx, s, p)))
    return probes


# ====================================================================== foreign rotary modules
@dataclass
class RotarySite:
    """A rotary position module of another library, as the doctor calls it.

    Attributes:
        subject: where it is.
        module: the module that computes the tables.
        tables: ``(module, grid, activation dtype) -> tables`` for the tokens of ``grid``.
        coords: ``grid -> (N, D)`` integer coordinates of those tokens, in the tables' order.
        apply: ``(q, k, tables) -> (q, k)`` as the host's attention applies them (q, k ``(B, H, N, hd)``).
        head_dim: the rotated width.
        sections: the per-axis split ``(sections, per_pair)`` the module uses, if it has one.
        fixed_grid: the one grid the module computes tables for (cached tables), else None.
        axes: coordinate axes of its grids.
        multiple: what every grid side must be a multiple of (a merge window).
        max_side: the longest grid side it has tables for (48 at most is used).
    """
    subject: str
    module: nn.Module
    tables: Callable[[nn.Module, Tuple[int, ...], torch.dtype], Any]
    coords: Callable[[Tuple[int, ...]], torch.Tensor]
    apply: Callable[[torch.Tensor, torch.Tensor, Any], Tuple[torch.Tensor, torch.Tensor]]
    head_dim: int
    sections: Optional[Tuple[Sequence[int], bool]] = None
    fixed_grid: Optional[Tuple[int, ...]] = None
    axes: int = 2
    multiple: int = 1
    max_side: int = 48


def _raster(shape: Sequence[int]) -> torch.Tensor:
    axes = [torch.arange(s) for s in shape]
    return torch.stack(torch.meshgrid(*axes, indexing='ij'), -1).reshape(-1, len(shape))


def _flat(t: Any) -> torch.Tensor:
    if isinstance(t, (tuple, list)):
        return torch.cat([_flat(x) for x in t])
    return t.detach().double().flatten()


def _rotary_checks(ctx: _Context, site: RotarySite) -> List[C.CheckResult]:
    s, m, out = site.subject, site.module, []
    rel, g28, g44 = (tuple(-(-x // site.multiple) * site.multiple for x in g) for g in _grid_shapes(site.axes))
    rel = site.fixed_grid or rel
    n = math.prod(rel)
    tabs = site.tables(m, rel, torch.float32)
    q, k = ctx.randn(1, 1, 1, site.head_dim, dtype=torch.float32), ctx.randn(1, 1, 1, site.head_dim,
                                                                               dtype=torch.float32)
    q2, k2 = site.apply(q.expand(1, 1, n, -1), k.expand(1, 1, n, -1), tabs)
    logits = q2.double() @ k2.double().transpose(-1, -2)
    out.append(C.offset_invariance(logits, site.coords(rel), rtol=1e-4, subject=s))

    named = {n_: b for n_, b in m.named_buffers()} | {n_: p for n_, p in m.named_parameters()}
    out.append(C.float32_tables(named, subject=s) if named else
               C.not_applicable('float32_tables', s, 'the module holds no tables (computed per call)'))
    for n_, b in named.items():
        if 'freq' in n_ and b.dim() == 1 and not isinstance(b, nn.Parameter):
            out.append(C.geometric_frequencies(b, subject=f'{s}.{n_}'))
    side = min(48, site.max_side) // site.multiple * site.multiple
    big = site.fixed_grid or (2,) * (site.axes - 2) + (side, side)
    ref = copy.deepcopy(m).double()
    got = site.tables(m, big, torch.bfloat16)
    want = site.tables(ref, big, torch.float64)
    out.append(C.matches_reference(_flat(got), _flat(want), check='float32_tables', rtol=BF16_RTOL, subject=s,
                                   compared=f'tables for bfloat16 activations against a float64 copy on a {big} grid'))

    qq, kk = ctx.randn(1, 1, n, site.head_dim, dtype=torch.float32), ctx.randn(1, 1, n, site.head_dim,
                                                                                 dtype=torch.float32)
    perm = torch.randperm(n, generator=ctx.generator)
    a = site.apply(qq, kk, tabs)
    b = site.apply(qq[:, :, perm], kk[:, :, perm], tabs)
    inv = torch.argsort(perm)
    out.append(C.moves_output(_flat([a[0], a[1]]), _flat([b[0][:, :, inv], b[1][:, :, inv]]), at_least=MOVES_AT_LEAST,
                              what='rotated q, k against those of the tokens permuted and permuted back', subject=s))
    if site.fixed_grid is not None:
        out.append(C.not_applicable('grid_change', s, f'the module computes tables for one grid {site.fixed_grid}'))
    else:
        nn_ = math.prod(g28)
        qq, kk = ctx.randn(1, 1, nn_, site.head_dim, dtype=torch.float32), ctx.randn(1, 1, nn_, site.head_dim,
                                                                                       dtype=torch.float32)
        a = site.apply(qq, kk, site.tables(m, g28, torch.float32))
        b = site.apply(qq, kk, site.tables(m, g44, torch.float32))
        out.append(C.moves_output(_flat(a), _flat(b), at_least=MOVES_AT_LEAST, check='grid_change', subject=s,
                                  what=f'rotated q, k of one token sequence on grids {g28} and {g44}'))
    if site.sections is not None:
        out.append(C.head_split(site.sections[0], site.head_dim, per_pair=site.sections[1], subject=s))
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


# ---------------------------------------------------------------------- timm
def _timm_host(ctx: _Context) -> List[Probe]:
    model, probes = ctx.model, []
    rope = getattr(model, 'rope', None)
    blocks = getattr(model, 'blocks', None)
    if rope is not None and _library(rope) == 'timm' and hasattr(rope, 'get_embed') and blocks is not None:
        from timm.layers import apply_rot_embed_cat
        halves = sorted({bool(getattr(b.attn, 'rotate_half', False)) for b in blocks if hasattr(b, 'attn')})
        embed = model.patch_embed
        fixed = None if getattr(model, 'dynamic_img_size', False) else tuple(embed.grid_size)
        head_dim = blocks[0].attn.head_dim if hasattr(blocks[0].attn, 'head_dim') else \
            model.embed_dim // blocks[0].attn.num_heads

        def tables(mod: nn.Module, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            emb = mod.get_embed(shape=list(shape))
            return emb[0] if emb.dim() == 4 else emb  # RoPE-Mixed: per layer; layer 0

        for half in halves:
            def apply(q, k, emb, half=half):
                emb = emb.to(q.dtype) if emb.dtype != q.dtype else emb
                return apply_rot_embed_cat(q, emb, half=half), apply_rot_embed_cat(k, emb, half=half)
            site = RotarySite(f'rope ({type(rope).__name__}, rotate_half={half})', rope, tables, _raster, apply,
                              head_dim, fixed_grid=fixed)
            probes.append(Probe(site.subject, lambda site=site: _rotary_checks(ctx, site)))
    table = getattr(model, 'pos_embed', None)
    if isinstance(table, nn.Parameter) and hasattr(model, '_pos_embed') and hasattr(model, 'patch_embed') \
            and _library(model) == 'timm':
        probes.append(Probe('pos_embed (timm)', lambda: [_timm_table(ctx)]))
    return probes


def _timm_table(ctx: _Context) -> C.CheckResult:
    model = ctx.model
    s = 'pos_embed (timm _pos_embed)'
    if not getattr(model, 'dynamic_img_size', False):
        return C.not_applicable('resample_mode', s, 'the model takes one input size (dynamic_img_size=False): its '
                                'table is never resampled in forward')
    h, w = model.patch_embed.grid_size
    npt = 0 if getattr(model, 'no_embed_class', False) else model.num_prefix_tokens
    stored = model.pos_embed.detach()[0, npt:].reshape(h, w, -1)
    new = (h + 3, w + 1)
    resized = _timm_resized(model, new)
    return C.resample_mode(resized, stored, ctx.resample_mode or 'bicubic', subject=s)


def _timm_resized(model: nn.Module, size: Tuple[int, int]) -> torch.Tensor:
    """The table the model's own ``_pos_embed`` adds to a grid of ``size`` (zero tokens in)."""
    dim = model.pos_embed.shape[-1]
    x = torch.zeros(1, *size, dim, dtype=model.pos_embed.dtype, device=model.pos_embed.device)
    y = model._pos_embed(x)
    y = y[0] if isinstance(y, tuple) else y  # Eva: (tokens, rotary embedding)
    return y[0, model.num_prefix_tokens:].reshape(*size, dim)


# ---------------------------------------------------------------------- transformers
_HF_TABLES = ('ViTEmbeddings', 'DeiTEmbeddings', 'Dinov2Embeddings', 'Dinov2WithRegistersEmbeddings',
              'CLIPVisionEmbeddings', 'SiglipVisionEmbeddings')


def _transformers_host(ctx: _Context) -> List[Probe]:
    model, probes = ctx.model, []
    for name, emb in _named(model, _HF_TABLES):
        probes.append(Probe(f'{name} (table)', lambda n=name, e=emb: [_hf_table(ctx, n, e)]))
    for name, emb in _named(model, ('Siglip2VisionEmbeddings',)):
        probes.append(Probe(f'{name} (NaFlex table)', lambda n=name, e=emb: _siglip2_table(ctx, n, e)))
    for name, rope in _named(model, ('DINOv3ViTRopePositionEmbedding',)):
        probes.append(Probe(name, lambda n=name, r=rope: _rotary_checks(ctx, _dinov3_site(n, r))))
    for name, tower in model.named_modules():
        rot = getattr(tower, 'rotary_pos_emb', None)
        # a vision tower with a merge window and an axial rotary over its patches (Qwen2 / 2.5 / 3-VL and kin)
        if rot is not None and 'VisionRotary' in type(rot).__name__ and hasattr(tower, 'spatial_merge_size'):
            name = name or type(tower).__name__
            probes.append(Probe(f'{name}.rotary_pos_emb', lambda n=name, t=tower: _rotary_checks(
                ctx, _qwen_vision_site(n, t))))
            probes.append(Probe(f'{name} (packed images)', lambda n=name, t=tower: [_qwen_vision_packed(ctx, n, t)]))
    for name, inner in model.named_modules():
        if callable(getattr(inner, 'get_rope_index', None)) and hasattr(inner, 'config') \
                and hasattr(getattr(inner, 'config', None), 'vision_config'):
            probes.append(Probe(f'{name or type(inner).__name__}.get_rope_index',
                                lambda n=name or type(inner).__name__, i=inner: _vlm_ids(ctx, n, i)))
            break
    return probes


def _hf_table(ctx: _Context, name: str, emb: nn.Module) -> C.CheckResult:
    s = f'{name}.interpolate_pos_encoding'
    table = getattr(emb, 'position_embeddings', None)
    if table is None:
        table = emb.position_embedding.weight[None]
    table = table.detach()
    dim = table.shape[-1]
    n = table.shape[1]
    side = int(math.isqrt(n))
    prefix = n - side * side
    stored = table[0, prefix:].reshape(side, side, dim)
    patch = getattr(emb, 'patch_size', None) or emb.config.patch_size
    patch = patch if isinstance(patch, int) else patch[0]
    new = (side + 3, side + 1)
    tokens = torch.zeros(1, prefix + math.prod(new), dim, dtype=table.dtype, device=table.device)
    resized = emb.interpolate_pos_encoding(tokens, new[0] * patch, new[1] * patch)
    resized = resized.reshape(-1, dim)[prefix:].reshape(*new, dim)
    return C.resample_mode(resized, stored, ctx.resample_mode or 'bicubic', subject=s)


def _siglip2_table(ctx: _Context, name: str, emb: nn.Module) -> List[C.CheckResult]:
    s = f'{name}.resize_positional_embeddings'
    w = emb.position_embedding.weight.detach()
    side = int(math.isqrt(w.shape[0]))
    stored = w.reshape(side, side, -1)
    new = (side + 3, side + 1)
    n = math.prod(new)
    resized = emb.resize_positional_embeddings(stored, torch.tensor([new]), n)[0].reshape(*new, -1)
    out = [C.resample_mode(resized, stored, ctx.resample_mode or 'bilinear', subject=s)]
    a, b = EQUAL_COUNT_GRIDS
    ta = emb.resize_positional_embeddings(stored, torch.tensor([a]), math.prod(a))[0]
    tb = emb.resize_positional_embeddings(stored, torch.tensor([b]), math.prod(b))[0]
    out.append(C.moves_output(ta, tb, at_least=MOVES_AT_LEAST, check='grid_change', subject=s,
                              what=f'tables for grids {a} and {b}'))
    return out


def _dinov3_site(name: str, rope: nn.Module) -> RotarySite:
    ns = _namespace(rope)
    patch = rope.config.patch_size if isinstance(rope.config.patch_size, int) else rope.config.patch_size[0]

    def tables(mod, shape, dtype):
        px = torch.zeros(1, 1, shape[0] * patch, shape[1] * patch, dtype=dtype, device=mod.inv_freq.device)
        return mod(px)

    def apply(q, k, cs):
        cos, sin = cs
        return ns.apply_rotary_pos_emb(q, k, cos.to(q.dtype), sin.to(q.dtype))
    return RotarySite(name, rope, tables, _raster, apply, rope.head_dim)


def _qwen_vision_site(name: str, tower: nn.Module) -> RotarySite:
    ns, rot = _namespace(tower), tower.rotary_pos_emb
    merge = tower.spatial_merge_size
    get_ids = getattr(ns, 'get_vision_position_ids')

    def ids(shape):
        return get_ids(torch.tensor([[1, *shape]]), merge)

    def tables(mod, shape, dtype):
        pid = ids(shape).to(mod.inv_freq.device)
        x = torch.zeros(pid.shape[0], 1, dtype=dtype, device=pid.device)
        return mod(x, pid)

    def apply(q, k, cs):
        cos, sin = cs
        q2, k2 = ns.apply_rotary_pos_emb_vision(q[0].transpose(0, 1), k[0].transpose(0, 1), cos, sin)
        return q2.transpose(0, 1)[None], k2.transpose(0, 1)[None]

    head_dim = rot.inv_freq.numel() * 4
    return RotarySite(f'{name}.rotary_pos_emb', rot, tables, lambda shape: ids(shape), apply, head_dim,
                      multiple=merge)


def _even_grid(shape: Tuple[int, int], merge: int) -> Tuple[int, int]:
    return tuple(max(merge, s - s % merge) for s in shape)


def _qwen_vision_packed(ctx: _Context, name: str, tower: nn.Module) -> C.CheckResult:
    s = f'{name} (packed images)'
    tower = copy.deepcopy(tower).double().eval()  # float64: rounding far below any position error
    ctx = dataclasses.replace(ctx, dtype=torch.float64)
    cfg = tower.config
    merge = tower.spatial_merge_size
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    grids = [[1, 2 * merge, 2 * merge], [1, merge, 3 * merge]]
    n = [math.prod(g) for g in grids]
    x = ctx.randn(sum(n), width)
    together = tower(x, grid_thw=torch.tensor(grids)).last_hidden_state
    alone, parts, start = [], [], 0
    for g, k in zip(grids, n):
        alone.append(tower(x[start:start + k], grid_thw=torch.tensor([g])).last_hidden_state)
        parts.append(together[start:start + k])
        start += k
    return C.padded_equals_alone(parts, alone, atol=1e-9, rtol=1e-9, subject=s)


# ---------------------------------------------------------------------- multimodal ids (Qwen-VL language side)
def _vlm_ids(ctx: _Context, name: str, inner: nn.Module) -> List[C.CheckResult]:
    """Ids of one sample: text, a still image, text, a video of four frames, text, in the Qwen-VL token
    convention, from the model's own ``get_rope_index`` (a patched model's included)."""
    cfg = inner.config
    vc = cfg.vision_config
    merge = vc.spatial_merge_size
    tok = {k: getattr(cfg, k) for k in ('image_token_id', 'video_token_id', 'vision_start_token_id')}
    end = getattr(cfg, 'vision_end_token_id', tok['vision_start_token_id'] + 1)
    per_frame = 'qwen3' in getattr(cfg, 'model_type', '')
    img, vid = (1, 2 * merge, 2 * merge), (4, 2 * merge, 3 * merge)
    img_n, frame_n = img[1] * img[2] // merge ** 2, vid[1] * vid[2] // merge ** 2
    text = [5, 6, 7]
    seq: List[int] = list(text) + [tok['vision_start_token_id']]
    img_at = list(range(len(seq), len(seq) + img_n))
    seq += [tok['image_token_id']] * img_n + [end] + text
    frames = []
    if per_frame:
        for _ in range(vid[0]):
            seq += [8, 9, tok['vision_start_token_id']]
            frames.append(list(range(len(seq), len(seq) + frame_n)))
            seq += [tok['video_token_id']] * frame_n + [end]
    else:
        seq.append(tok['vision_start_token_id'])
        for _ in range(vid[0]):
            frames.append(list(range(len(seq), len(seq) + frame_n)))
            seq += [tok['video_token_id']] * frame_n
        seq.append(end)
    tail = len(seq)
    seq += text
    input_ids = torch.tensor([seq], device=ctx.device)
    types = (input_ids == tok['image_token_id']).long() + 2 * (input_ids == tok['video_token_id']).long()
    kwargs = dict(mm_token_type_ids=types, image_grid_thw=torch.tensor([img]), video_grid_thw=torch.tensor([vid]),
                  attention_mask=torch.ones_like(input_ids))
    tps = getattr(vc, 'tokens_per_second', None)
    if tps:  # frames 1 / tokens_per_second apart: one id step each (an int cast before scaling collapses them)
        kwargs['second_per_grid_ts'] = torch.tensor([1.0 / tps])
    ids, _ = inner.get_rope_index(input_ids, **kwargs)
    ids = ids[:, 0].double()
    s = f'{name}.get_rope_index'
    distinct = [img_at] + frames
    out = [C.ids_cover_tokens(ids, len(seq), distinct=distinct, subject=s)]
    if ids.shape[0] >= 3:
        hw = merge
        out.append(C.ids_follow_grid(ids[1:3, img_at], (img[1] // hw, img[2] // hw), subject=f'{s} (image)'))
        out.append(C.ids_follow_grid(ids[1:3, frames[0]], (vid[1] // hw, vid[2] // hw), subject=f'{s} (video frame)'))
        out.append(C.time_ids_monotone(ids[0, img_at][None], subject=f'{s} (still image)'))
        out.append(C.time_ids_monotone(ids[0][torch.tensor(frames)], subject=f'{s} (video)'))
    ok = bool((ids[:, tail:].min() > ids[:, :tail].max()))
    out.append(C.CheckResult('ids_cover', C.PASSED if ok else C.FAILED, 'text after the visual blocks against every '
                             'earlier id: later text ids not above them', 0.0 if ok else 1.0, 0.0, s))
    text_cfg = getattr(cfg, 'text_config', cfg)
    rope = dict(getattr(text_cfg, 'rope_parameters', None) or {})
    section = rope.get('mrope_section')
    head_dim = getattr(text_cfg, 'head_dim', None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    out.append(C.head_split(section, head_dim, subject=f'{s} (mrope_section)') if section else
               C.not_applicable('head_split', s, 'the text config has no mrope_section'))
    return out


# ---------------------------------------------------------------------- diffusers
def _diffusers_host(ctx: _Context) -> List[Probe]:
    model, probes = ctx.model, []
    cfg = getattr(model, 'config', None)
    for name, pe in _named(model, ('FluxPosEmbed',)):
        head_dim = getattr(cfg, 'attention_head_dim', sum(pe.axes_dim))
        probes.append(Probe(name, lambda n=name, p=pe, hd=head_dim: _flux_checks(ctx, n, p, hd)))
    for name, rope in _named(model, ('WanRotaryPosEmbed',)):
        probes.append(Probe(name, lambda n=name, r=rope: _rotary_checks(ctx, _wan_site(n, r))))
    return probes


def _interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotation of consecutive channel pairs with repeat-interleaved tables (diffusers' FLUX / Wan layout)."""
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    rot = torch.stack([-b, a], -1).flatten(-2)
    return (x.double() * cos.double() + rot.double() * sin.double()).to(x.dtype)


def _flux_checks(ctx: _Context, name: str, pe: nn.Module, head_dim: int) -> List[C.CheckResult]:
    apply_fn = getattr(_namespace(pe), 'apply_rotary_emb', None)  # what FLUX's attention processor calls

    def tables(mod, shape, dtype):  # ids (index, row, column), as the pipeline builds them; no activations read
        return mod(torch.cat([torch.zeros(math.prod(shape), 1), _raster(shape).float()], -1))

    def apply(q, k, cs):
        if apply_fn is not None:  # the library's own, as its attention processor calls it
            return (apply_fn(q, cs, sequence_dim=2), apply_fn(k, cs, sequence_dim=2))
        return _interleaved(q, *cs), _interleaved(k, *cs)

    out = _rotary_checks(ctx, RotarySite(name, pe, tables, _raster, apply, sum(pe.axes_dim)))
    out.append(C.head_split(pe.axes_dim, head_dim, per_pair=False, subject=name))
    return out + _flux_ids(ctx, name)


def _flux_ids(ctx: _Context, name: str) -> List[C.CheckResult]:
    """The image ids of the example inputs (``img_ids``) against its tokens (``hidden_states``)."""
    inputs = ctx.inputs if isinstance(ctx.inputs, dict) else {}
    ids, tokens = inputs.get('img_ids'), inputs.get('hidden_states')
    s = f'{name} (img_ids)'
    if ids is None or tokens is None:
        return [C.not_applicable('ids_cover', s, 'no img_ids and hidden_states in the example inputs')]
    ids = ids[0] if ids.dim() == 3 else ids
    n = tokens.shape[1]
    out = [C.ids_cover_tokens(ids.T.double(), n, distinct=[range(min(n, ids.shape[0]))], subject=s)]
    if ids.shape[0] == n:
        h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        out.append(C.ids_follow_grid(ids[:, 1:3].T, (h, w), subject=s) if h * w == n else C.CheckResult(
            'ids_cover', C.FAILED, f'rows x columns of the ids ({h} x {w}) against {n} tokens', abs(h * w - n), 0, s))
    return out


def _wan_site(name: str, rope: nn.Module) -> RotarySite:
    pt, ph, pw = rope.patch_size

    def tables(mod, shape, dtype):
        x = torch.zeros(1, 1, shape[0] * pt, shape[1] * ph, shape[2] * pw, dtype=dtype, device=mod.freqs_cos.device)
        cos, sin = mod(x)
        return cos[0, :, 0], sin[0, :, 0]

    def apply(q, k, cs):
        return _interleaved(q, *cs), _interleaved(k, *cs)
    split = (rope.t_dim, rope.h_dim, rope.w_dim)
    return RotarySite(name, rope, tables, _raster, apply, rope.attention_head_dim, sections=(split, False), axes=3,
                      max_side=rope.max_seq_len)


# ====================================================================== model level: images in, tokens out
@dataclass
class ImageRunner:
    """How to run a model that takes images and returns one output per patch (after its prefix tokens).

    ``run(images)`` -> ``(B, prefix + N, C)`` in raster order; ``dynamic``: takes sizes other than ``native``."""
    subject: str
    run: Callable[[torch.Tensor], torch.Tensor]
    patch: int
    channels: int
    prefix: int
    native: Tuple[int, int]
    dynamic: bool


_POSITION_NAMES = ('pos_embed', 'position_embedding', 'rope', 'rotary')


def _images_host(ctx: _Context) -> List[Probe]:
    if _image_runner(ctx.model) is None:
        return []
    return [Probe(f'{type(ctx.model).__name__} (images)', lambda: _image_checks(ctx))]


MODEL_MOVES_AT_LEAST = 1e-10
"""Relative difference wanted of a float64 model's outputs where positions differ (`_image_checks`)."""


def _image_model(ctx: _Context, dtype: torch.dtype) -> Tuple[nn.Module, str]:
    """The model to run images through in ``dtype``: the model itself where it has that dtype, else a copy; all-zero
    position parameters (an untrained zero initialisation, as DeiT's table in transformers) get random values
    on a copy."""
    model = ctx.model
    vispe = tuple(f'{n}.' for n, _ in _top_encodings(model) if n in dict(model.named_modules()))
    names = [n for n, _ in model.named_parameters() if any(k in n for k in _POSITION_NAMES) or n.startswith(vispe)]
    zero = bool(names) and all(not bool(p.detach().ne(0).any()) for n, p in model.named_parameters() if n in names)
    if ctx.dtype == dtype and not zero:
        return model, ''
    model = copy.deepcopy(model).to(dtype).eval()
    return model, _wake(model, ctx, names) if zero else ''


def _image_runner(model: nn.Module) -> Optional[ImageRunner]:
    embed = getattr(model, 'patch_embed', None)
    if embed is not None and hasattr(model, 'forward_features') and hasattr(embed, 'patch_size'):
        p = embed.patch_size[0] if isinstance(embed.patch_size, (tuple, list)) else embed.patch_size
        chans = getattr(embed.proj, 'in_channels', 3) if hasattr(embed, 'proj') else 3
        dynamic = bool(getattr(model, 'dynamic_img_size', False))
        native = tuple(embed.img_size) if embed.img_size is not None else (4 * p, 4 * p)
        run = model.forward_features
        return ImageRunner(type(model).__name__, run, p, chans, getattr(model, 'num_prefix_tokens', 0), native, dynamic)
    cfg = getattr(model, 'config', None)
    if cfg is None or _library(model) != 'transformers' or not hasattr(cfg, 'patch_size') \
            or not hasattr(cfg, 'image_size') or 'Siglip2' in type(model).__name__:
        return None
    forward_args = inspect.signature(model.forward).parameters
    if 'pixel_values' not in forward_args:
        return None
    p = cfg.patch_size if isinstance(cfg.patch_size, int) else cfg.patch_size[0]
    size = cfg.image_size if isinstance(cfg.image_size, (tuple, list)) else (cfg.image_size, cfg.image_size)
    interp = 'interpolate_pos_encoding' in forward_args
    prefix = _hf_prefix(model, cfg)

    def run(x: torch.Tensor) -> torch.Tensor:
        kw = dict(interpolate_pos_encoding=True) if interp and tuple(x.shape[-2:]) != tuple(size) else {}
        return model(pixel_values=x, **kw).last_hidden_state
    # any size: an interpolate_pos_encoding argument, a table that is always interpolated (DINOv2), a rotary
    dynamic = interp or any(callable(getattr(m, 'interpolate_pos_encoding', None)) or 'Rope' in type(m).__name__
                            for m in model.modules())
    return ImageRunner(type(model).__name__, run, p, getattr(cfg, 'num_channels', 3), prefix, tuple(size), dynamic)


def _hf_prefix(model: nn.Module, cfg: Any) -> int:
    name = type(model).__name__
    if name.startswith('Siglip'):
        return 0
    regs = getattr(cfg, 'num_register_tokens', 0) or 0
    return 1 + regs + (1 if name.startswith('DeiT') else 0)


def _patches_image(patches: torch.Tensor, shape: Tuple[int, int], p: int) -> torch.Tensor:
    """Patches ``(B, N, C, p, p)`` laid out as an image of ``shape`` patches, raster order."""
    B, N, Cc = patches.shape[:3]
    h, w = shape
    return patches.reshape(B, h, w, Cc, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, Cc, h * p, w * p)


def _image_checks(ctx: _Context) -> List[C.CheckResult]:
    """In float32 first; where a difference stays below `MOVES_AT_LEAST` (a random initialisation attends almost
    uniformly, layer scales may be 1e-5), again on a float64 copy, where a dead position path moves the outputs
    by rounding only (~1e-15) and a live one by `MODEL_MOVES_AT_LEAST` and more."""
    encodings = _top_encodings(ctx.model)
    if encodings and not any(pe.capabilities.hooks for _, pe in encodings):
        s = f'{type(ctx.model).__name__} (images)'
        return [C.not_applicable(c, s, "the model's encoding is the NoPE baseline ('none')")
                for c in ('moves_output', 'grid_change')]
    out = _image_results(ctx, *_image_model(ctx, torch.float32), at_least=MOVES_AT_LEAST)
    if any(r.failed for r in out):
        model, note = _image_model(ctx, torch.float64)
        again = f'below {MOVES_AT_LEAST:g} in float32: run on a float64 copy'
        out = _image_results(ctx, model, '; '.join(x for x in (note, again) if x), at_least=MODEL_MOVES_AT_LEAST)
    return out


def _image_results(ctx: _Context, model: nn.Module, note: str, at_least: float) -> List[C.CheckResult]:
    r = _image_runner(model)
    s, out = f'{r.subject} (images)', []
    p = r.patch
    randn = functools.partial(ctx.randn, dtype=next(model.parameters()).dtype)
    shape = EQUAL_COUNT_GRIDS[1] if r.dynamic else (r.native[0] // p, r.native[1] // p)
    n = math.prod(shape)
    patches = randn(1, n, r.channels, p, p)
    perm = torch.randperm(n, generator=ctx.generator)
    a = r.run(_patches_image(patches, shape, p))[:, r.prefix:]
    b = r.run(_patches_image(patches[:, perm], shape, p))[:, r.prefix:]
    out.append(C.moves_output(a, b[:, torch.argsort(perm)], at_least=at_least, subject=s,
                              what=f'patch outputs of an image against those of its {n} patches permuted, permuted '
                              'back'))
    if not r.dynamic:
        out.append(C.not_applicable('grid_change', s, f'the model takes one input size {r.native}'))
        return [_noted(x, note) for x in out]
    g28, g44 = EQUAL_COUNT_GRIDS  # the same patches in raster order: only the grid differs from `a`
    b = r.run(_patches_image(patches, g28, p))[:, r.prefix:]
    out.append(C.moves_output(a, b, at_least=at_least, check='grid_change', subject=s,
                              what=f'outputs of one patch sequence as a {g44} and a {g28} grid'))
    return [_noted(x, note) for x in out]


def _siglip2_host(ctx: _Context) -> List[Probe]:
    model = ctx.model
    if type(model).__name__ not in ('Siglip2VisionModel', 'Siglip2VisionTransformer'):
        return []
    return [Probe(f'{type(model).__name__} (NaFlex batches)', lambda: _siglip2_checks(ctx, model))]


def _siglip2_checks(ctx: _Context, model: nn.Module) -> List[C.CheckResult]:
    s = f'{type(model).__name__} (NaFlex batches)'
    model = copy.deepcopy(model).double().eval()  # as `_image_model`
    ctx = dataclasses.replace(ctx, dtype=torch.float64)
    cfg = model.config
    width = cfg.num_channels * cfg.patch_size ** 2
    grids = [(3, 4), (2, 2)]
    N = 12

    def run(px, mask, shapes):
        return model(pixel_values=px, pixel_attention_mask=mask, spatial_shapes=torch.tensor(shapes)).last_hidden_state
    px = torch.zeros(len(grids), N, width, dtype=ctx.dtype, device=ctx.device)
    mask = torch.zeros(len(grids), N, dtype=torch.long, device=ctx.device)
    for b, (h, w) in enumerate(grids):
        px[b, :h * w] = ctx.randn(h * w, width)
        mask[b, :h * w] = 1
    together = run(px, mask, grids)
    parts, alone = [], []
    for b, (h, w) in enumerate(grids):
        n = h * w
        alone.append(run(px[b:b + 1, :n], mask[b:b + 1, :n], [(h, w)])[0])
        parts.append(together[b, :n])
    out = [C.padded_equals_alone(parts, alone, atol=1e-9, rtol=1e-9, subject=s)]
    perm = torch.randperm(12, generator=ctx.generator)
    one, ones = px[:1], mask[:1]
    a = run(one, ones, [grids[0]])
    bb = run(one[:, perm], ones, [grids[0]])
    out.append(C.moves_output(a, bb[:, torch.argsort(perm)], at_least=MODEL_MOVES_AT_LEAST, subject=s,
                              what='patch outputs against those of the patches permuted, permuted back'))
    g28, g44 = EQUAL_COUNT_GRIDS
    x16 = ctx.randn(1, 16, width)
    m16 = torch.ones(1, 16, dtype=torch.long, device=ctx.device)
    out.append(C.moves_output(run(x16, m16, [g28]), run(x16, m16, [g44]), at_least=MODEL_MOVES_AT_LEAST,
                              check='grid_change',
                              subject=s, what=f'outputs of one patch sequence as a {g28} and a {g44} grid'))
    return out


register_host('vispe', _vispe_host)
register_host('timm', _timm_host)
register_host('transformers', _transformers_host)
register_host('siglip2', _siglip2_host)
register_host('diffusers', _diffusers_host)
register_host('images', _images_host)


# ====================================================================== entry point
def _progress(total: int, desc: str) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False)


def doctor(model: nn.Module, example_inputs: Any = None, *, resample_mode: Optional[str] = None,
           progress: bool = True, seed: int = 0) -> Report:
    """Check the position code of ``model`` against the properties it promises (`vispe.checks.CHECKS`).

    Args:
        model: a vispe, timm, transformers or diffusers model (patched by a vispe adapter or not). It is
            not changed: eval mode and ``no_grad`` during the checks, each module's mode restored after,
            no hooks, copies of the position modules where another dtype is needed.
        example_inputs: what the model is called with (a tensor or a dict of keyword arguments); read for
            the ids a host cannot build itself (a FLUX transformer's ``img_ids`` against its
            ``hidden_states``). Images are built by the doctor, tiny.
        resample_mode: the resampling mode the model's learned table was released with (``'bilinear'``,
            ``'bicubic'``, ...), where it differs from what the model declares (None: the model's own).
        progress: show progress (tqdm when installed, else logging at INFO).
        seed: the seed of the doctor's own random inputs (the global random state is left alone).

    Returns:
        A `Report`: ``print(report)`` lists every check, ``report.ok``, ``report.failed``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f'model must be a torch.nn.Module, got {type(model).__name__}')
    start = time.perf_counter()
    first = next((t for t in list(model.parameters()) + list(model.buffers()) if t.is_floating_point()), None)
    ctx = _Context(model, example_inputs, first.dtype if first is not None else torch.float32,
                   first.device if first is not None else torch.device('cpu'), resample_mode,
                   torch.Generator().manual_seed(seed))
    modes = [(m, m.training) for m in model.modules()]
    results: List[C.CheckResult] = []
    hosts: List[str] = []
    try:
        model.eval()
        with torch.no_grad():
            probes: List[Probe] = []
            for name, host in HOSTS.items():
                found = host(ctx)
                if found:
                    hosts.append(name)
                    probes += found
            bar = _progress(len(probes), f'vispe.doctor {type(model).__name__}') if progress else None
            for i, probe in enumerate(probes):
                if progress and bar is None:
                    log.info('vispe.doctor: %d/%d %s', i + 1, len(probes), probe.subject)
                results += probe.run()
                if bar is not None:
                    bar.update(1)
            if bar is not None:
                bar.close()
    finally:
        for m, mode in modes:  # each module's own flag, as it was (train() would recurse into children)
            m.training = mode
    covered = {r.check for r in results}
    for check in C.CHECKS:
        if check not in covered:
            results.append(C.not_applicable(check, type(model).__name__, 'no position code of the model that this '
                                            'check applies to was found'))
    return Report(type(model).__name__, results, hosts, time.perf_counter() - start)
