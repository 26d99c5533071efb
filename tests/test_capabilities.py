"""Declared capabilities match what each encoding does, and the attention dispatch and the hosts
follow them (not hook names or classes)."""
import functools

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import config as timm_config
from timm.layers import set_fused_attn

import vispe
from vispe import PEAttention, pe_attention
from conftest import TINY, image_pes
from vispe_models.detr import DETR

B, H, HD, DIM, GRID, NPRE = 2, 2, 16, 32, (4, 4), 1
DETR_TINY = dict(hidden_dim=16, num_heads=2, enc_layers=2, dec_layers=2, dim_feedforward=32, num_queries=5)


def _build(spec) -> vispe.PositionalEncoding:
    heads = 4 if 'mhrope' in str(spec) else H  # mhrope's default gives the axes t, h, w whole heads
    pe = vispe.create_pe(spec, dim=DIM, num_heads=heads, depth=2, grid_size=GRID, num_prefix_tokens=NPRE)
    with torch.no_grad():  # zero-initialised tables (iRPE) would hide what a declared hook does
        for p in pe.parameters():
            p.normal_(std=0.5)
    return pe


def _inputs():
    n = NPRE + GRID[0] * GRID[1]
    q, k, v = (torch.randn(B, H, n, HD) for _ in range(3))
    return q, k, v, torch.randn(B, n, DIM), vispe.grid(*GRID, num_prefix=NPRE)


class _SDPARecorder:
    """Stands in for SDPA and records the mask of each call."""

    def __init__(self):
        self.masks = []
        self._sdpa = F.scaled_dot_product_attention

    def __call__(self, q, k, v, attn_mask=None, **kwargs):
        self.masks.append(attn_mask)
        return self._sdpa(q, k, v, attn_mask=attn_mask, **kwargs)


@pytest.fixture
def sdpa(monkeypatch):
    recorder = _SDPARecorder()
    monkeypatch.setattr(F, 'scaled_dot_product_attention', recorder)
    return recorder


@pytest.mark.parametrize('name', image_pes())
def test_every_declared_hook_acts_and_every_other_hook_is_the_identity(name):
    pe = _build(name)
    caps = pe.capabilities
    q, k, v, x, pos = _inputs()
    with torch.no_grad():
        state = pe.prepare(pos)
        q2, k2 = state.qk(q, k, 0, x=x)
        qk_changed = q2.shape != q.shape or not (torch.equal(q2, q) and torch.equal(k2, k))
        bias = state.bias(q, k, 0)
        v2 = state.value(v, 0)
        value_changed = v2.shape != v.shape or not torch.equal(v2, v)
        o = torch.randn(B, H, q.shape[2], v2.shape[-1])
        output_changed = not torch.equal(state.output(o, 0), o)
        embed_changed = not torch.equal(pe.embed(x, pos), x)
        between_changed = not torch.equal(pe.between_blocks(x, pos, 0), x)
    assert qk_changed == ('qk' in caps.hooks)
    assert (bias is not None) == ('bias' in caps.hooks)
    assert value_changed == ('value' in caps.hooks)
    assert output_changed == ('output' in caps.hooks)
    assert embed_changed == caps.additive
    assert between_changed == caps.between_blocks
    assert caps.changes_head_dim == (q2.shape[-1] != HD)
    assert caps.in_attention == bool(caps.hooks & {'qk', 'bias', 'value', 'output', 'weights_value'})
    assert pe.hooks == caps.hooks and pe.flash_eligible == caps.flash_eligible  # the views agree


@pytest.mark.parametrize('name', image_pes())
def test_dispatch_follows_the_declared_capabilities(name, sdpa):
    pe = _build(name)
    caps = pe.capabilities
    q, k, v, x, pos = _inputs()
    with torch.no_grad():
        pe_attention(q, k, v, pe.prepare(pos), x=x)
    if caps.flash_eligible:  # SDPA without a mask: flash / memory-efficient kernels stay eligible
        assert len(sdpa.masks) == 1 and sdpa.masks[0] is None
    if caps.needs_weights:  # the weights term needs the explicit path
        assert sdpa.masks == []
    elif 'bias' in caps.hooks:
        assert len(sdpa.masks) == 1 and sdpa.masks[0] is not None


@pytest.mark.parametrize('name', image_pes())
def test_tokens_reach_only_the_encodings_that_need_them(name):
    pe = _build(name)
    q, k, v, x, pos = _inputs()
    seen = []
    qk = pe.qk

    def recorder(q, k, state, layer, x=None):
        seen.append(x)
        return qk(q, k, state, layer, x=x)

    pe.qk = recorder
    with torch.no_grad():
        state = pe.prepare(pos)
        pe_attention(q, k, v, state, x=x)
        if pe.capabilities.needs_tokens:
            with pytest.raises(ValueError, match='x='):
                pe_attention(q, k, v, state)
    if 'qk' not in pe.capabilities.hooks:
        assert seen == []  # no q/k map runs at all
    else:
        assert len(seen) == 1 and (seen[0] is x) == pe.capabilities.needs_tokens


def test_pape_too_wide_for_the_flash_kernels_says_so():
    narrow = vispe.create_pe('pape', dim=64, num_heads=1, grid_size=GRID).capabilities
    wide = vispe.create_pe('pape', dim=256, num_heads=1, grid_size=GRID).capabilities  # 256 + 6 channels, padded
    assert narrow.flash_eligible and narrow.needs_tokens and narrow.changes_head_dim
    assert not wide.flash_eligible and wide.hooks == narrow.hooks


@pytest.mark.parametrize('on, mode, hooks', [
    ('k', 'contextual', {'bias'}), ('q', 'bias', {'bias'}), ('v', 'contextual', {'weights_value'}),
    ('v', 'bias', {'weights_value'}), ('qkv', 'contextual', {'bias', 'weights_value'}),
])
def test_irpe_options_switch_its_hooks_off(on, mode, hooks, sdpa):
    pe = _build(f'irpe:on={on},mode={mode}')
    caps = pe.capabilities
    assert caps.hooks == hooks and not caps.flash_eligible
    assert caps.needs_weights == ('v' in on) and caps.needs_query_positions
    q, k, v, _, pos = _inputs()
    with torch.no_grad():
        state = pe.prepare(pos)
        assert (state.bias(q, k, 0) is None) == (on == 'v')
        pe_attention(q, k, v, state)
    assert len(sdpa.masks) == (0 if 'v' in on else 1)  # SDPA with the bias unless the V term needs the weights


@pytest.mark.parametrize('parts', [
    ('rope_mixed', 'learned'), ('irpe:on=v', 'sincos'), ('pape', 'alibi2d'), ('peg', 'rope_axial'),
    ('gta', 'irpe:on=k'), ('pape', 'rope_axial', 'learned'), ('none', 'liere'), ('rope_golden', 'peg'),
    ('learned', 'rope_spiral'), ('lookhere', 'rope_mixed'),
])
def test_a_composition_declares_the_union(parts):
    composed = _build('+'.join(parts)).capabilities
    each = [_build(p).capabilities for p in parts]
    assert composed.hooks == frozenset().union(*(c.hooks for c in each))
    for flag in ('additive', 'between_blocks', 'in_attention', 'needs_query_positions', 'needs_tokens',
                 'needs_weights', 'changes_head_dim'):
        assert getattr(composed, flag) == any(getattr(c, flag) for c in each), flag
    assert composed.flash_eligible == all(c.flash_eligible for c in each)


@pytest.mark.parametrize('spec, depth, cross_pe', [
    ('rope_mixed', 4, 'keys'),  # its cross-attention layers get parameters of their own
    ('irpe:on=k', 2, 'additive'),  # a relative bias needs query positions: encoder self-attention only
    ('irpe:on=v', 2, 'additive'),
    ('detr_sine', 2, 'keys'),
])
def test_detr_builds_its_encoding_once(spec, depth, cross_pe, monkeypatch):
    real, meta = [], []
    for cls in {vispe.pe_info(n)['cls'] for n, _ in vispe.parse_pe_spec(spec)}:
        init = cls.__init__

        @functools.wraps(init)  # the signature stays the constructor's (options are checked against it)
        def counted(self, ctx, *args, _init=init, **kwargs):
            (meta if torch.get_default_device().type == 'meta' else real).append(ctx.depth)
            _init(self, ctx, *args, **kwargs)

        monkeypatch.setattr(cls, '__init__', counted)
    model = DETR(num_classes=3, backbone='resnet18', pe=spec, **DETR_TINY)
    # parameters drawn once, for the layers the encoding serves; meta builds allocate nothing (DETR's
    # capability probe, create_pe's size check)
    assert real == [depth] and len(meta) <= 2
    assert model.cross_pe == cross_pe


def test_detr_keeps_its_parameter_names():
    names = {n for n in DETR(num_classes=3, backbone='resnet18', pe='rope_mixed+learned', grid_size=(4, 4),
                             **DETR_TINY).state_dict() if n.startswith('pe.')}
    assert names == {'pe.encodings.0.freqs', 'pe.encodings.1.pos_embed'}


@pytest.mark.parametrize('fused', [True, False])
def test_pe_attention_module_follows_timm_use_fused_attn(fused, monkeypatch, sdpa):
    monkeypatch.setattr(timm_config, '_USE_FUSED_ATTN', timm_config._USE_FUSED_ATTN)  # restored afterwards
    set_fused_attn(fused)
    attn = PEAttention(DIM, num_heads=H)
    model = timm.create_model('vit_tiny', pe='rope_axial', **TINY)
    assert attn.fused_attn == fused and all(blk.attn.fused_attn == fused for blk in model.blocks)
    pe = _build('rope_axial')
    _, _, _, x, pos = _inputs()
    with torch.no_grad():
        out = attn(x, pe.prepare(pos))
        attn.fused_attn = not fused
        other = attn(x, pe.prepare(pos))
    assert len(sdpa.masks) == 1  # only the fused forward runs SDPA
    torch.testing.assert_close(out, other, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ options that switch hooks off
def _option_values(name):
    """(option, value) pairs that differ from an encoding's defaults: every other value of a bool or
    Literal option (the options that can switch a part of an encoding on or off)."""
    import typing
    entry = vispe.registry._REGISTRY[name]
    for opt, default in vispe.pe_info(name)['options'].items():
        hint = entry.hints.get(opt)
        if hint is bool:
            yield opt, not default
        elif typing.get_origin(hint) is typing.Literal:
            yield from ((opt, v) for v in typing.get_args(hint) if v != default)


def _camera_positions():
    from conftest import random_intrinsics, random_poses
    g = torch.Generator().manual_seed(0)
    cams = vispe.Cameras(random_intrinsics(2, g, size=(8 * GRID[0], 8 * GRID[1])).float(),
                         cam_to_world=random_poses(2, g).float(), image_size=(8 * GRID[0], 8 * GRID[1]))
    return vispe.positions.multiview(cams, GRID, num_prefix=NPRE)


def _switch_off_pairs():
    """(encoding, option, value, hooks switched off) for every registered encoding and every option
    value that removes hooks from its defaults' capabilities."""
    pairs = []
    for name in vispe.list_pes():
        base = _build(name).capabilities.hooks
        for opt, value in _option_values(name):
            try:
                pe = _build({'name': name, opt: value})
            except ValueError:  # a value this context does not take
                continue
            off = base - pe.capabilities.hooks
            if off:
                pairs.append((name, opt, value, frozenset(off)))
    return pairs


SWITCH_OFF = _switch_off_pairs()


def test_the_options_that_switch_hooks_off_are_found():
    found = {(n, o, v): off for n, o, v, off in SWITCH_OFF}
    assert found[('gta', 'value_transform', False)] == {'value', 'output'}
    assert found[('gta_multiview', 'value_transform', False)] == {'value', 'output'}
    assert found[('prope', 'value_transform', False)] == {'value', 'output'}


def _hook_inputs(pe, name):
    pos = _camera_positions() if vispe.pe_info(name)['cls'].requires else vispe.grid(*GRID, num_prefix=NPRE)
    q, k, v = (torch.randn(B, H, pos.num_tokens, HD) for _ in range(3))
    return pos, q, k, v, torch.randn(B, pos.num_tokens, DIM)


def _run_hook(pe, hook, pos, q, k, v, x, state):
    """The hook's result, and what it would be as the identity (its input, or no term)."""
    run = {'qk': lambda: (state.qk(q, k, 0, x=x), (q, k)),
           'bias': lambda: (state.bias(q, k, 0), None),
           'value': lambda: (state.value(v, 0), v),
           'output': lambda: (state.output(v, 0), v),
           'weights_value': lambda: (state.weights_value(torch.softmax(q @ k.mT, -1), 0), None),
           'embed': lambda: (pe.embed(x, pos), x),
           'between_blocks': lambda: (pe.between_blocks(x, pos, 0), x)}
    return run[hook]()


@pytest.mark.parametrize('name,option,value,off', SWITCH_OFF,
                         ids=[f'{n}-{o}={v}' for n, o, v, _ in SWITCH_OFF])
def test_a_switched_off_hook_is_the_identity_directly_and_in_a_composition(name, option, value, off):
    torch.manual_seed(0)
    pe = _build({'name': name, option: value})
    on = _build(name)  # the same encoding with the hook on, composed after the switched-off one
    composed = vispe.create_pe([{'name': name, option: value}, name], dim=DIM, num_heads=H, depth=2,
                               grid_size=GRID, num_prefix_tokens=NPRE)
    composed.encodings[0].load_state_dict(pe.state_dict())
    composed.encodings[1].load_state_dict(on.state_dict())
    pos, q, k, v, x = _hook_inputs(pe, name)
    with torch.no_grad():
        for hook in off:
            got, identity = _run_hook(pe, hook, pos, q, k, v, x, pe.prepare(pos))
            if identity is None:
                assert got is None, hook
            else:
                torch.testing.assert_close(got, identity, rtol=0, atol=0, msg=hook)
            # in the composition only the member with the hook on acts
            got, _ = _run_hook(composed, hook, pos, q, k, v, x, composed.prepare(pos))
            want, _ = _run_hook(on, hook, pos, q, k, v, x, on.prepare(pos))
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=hook)
