"""patch_vlm on tiny transformers Qwen-VL models built from configs: parity with the model's own encoding
first (logits and generated tokens), then every scheme in every family, exact removal, isolation between
instances, explicit position ids, and the refusals."""
import sys
import types

import pytest
import torch
from torch import nn

transformers = pytest.importorskip('transformers')

import vispe  # noqa: E402
from vispe.integrations import AlreadyPatchedError, patch_vlm, transformers_vlm  # noqa: E402
from vispe_models.qwen_vl import FAMILIES, labels_for, qwen_vl_batch, tiny_qwen_vl  # noqa: E402

INPUTS = {
    'text': [[('text', 7)], [('text', 4)]],
    'image': [[('text', 3), ('image', (4, 6)), ('text', 2)]],
    'video_untimed': [[('text', 2), ('video', (3, 4, 4), None), ('text', 3)]],
    'video_timed': [[('text', 2), ('video', (4, 4, 6), 0.75), ('text', 3)]],
    'mixed_left_padded': [[('text', 3), ('image', (4, 4)), ('text', 2), ('video', (2, 4, 6), 0.5), ('text', 3)],
                          [('text', 1), ('video', (3, 4, 4), 1.5), ('text', 1)],
                          [('text', 2), ('image', (2, 4)), ('text', 1)]],
}
_MODELS = {}
ENCODINGS = tuple(n for n in vispe.list_pes() if vispe.pe_info(n)['family'] == 'multimodal')


def model_of(family, **kw):
    key = (family, tuple(sorted(kw.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_qwen_vl(family, **kw)
    return _MODELS[key]


def logits(model, batch, **kw):
    with torch.no_grad():
        return model(**batch, **kw).logits


# ---------------------------------------------------------------------------------------------- parity first
@pytest.mark.parametrize('family', FAMILIES)
def test_own_scheme_gives_the_unpatched_logits_on_every_input_kind(family):
    model = model_of(family)
    for kind, samples in INPUTS.items():
        for side in (('left', 'right') if kind == 'mixed_left_padded' else ('left',)):
            batch = qwen_vl_batch(family, samples, padding_side=side)
            ref = logits(model, batch)
            with patch_vlm(model):
                out = logits(model, batch)
            mask = batch['attention_mask'].bool()
            assert (out - ref)[mask].abs().max().item() <= 1e-6, (family, kind, side)


@pytest.mark.parametrize('family', FAMILIES)
def test_own_scheme_generates_the_unpatched_tokens(family):
    model = model_of(family)
    batch = qwen_vl_batch(family, INPUTS['mixed_left_padded'])
    with torch.no_grad():
        ref = model.generate(**batch, max_new_tokens=5, do_sample=False)
        with patch_vlm(model):
            out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize('family', ['qwen2_5_vl', 'qwen3_vl'])
def test_explicit_position_ids_from_transformers_give_the_same_logits(family):
    model = model_of(family)
    batch = qwen_vl_batch(family, INPUTS['mixed_left_padded'])
    keys = ('mm_token_type_ids', 'image_grid_thw', 'video_grid_thw', 'attention_mask', 'second_per_grid_ts')
    with torch.no_grad():
        ids, _ = model.model.get_rope_index(batch['input_ids'], **{k: batch[k] for k in keys if k in batch})
    ref = logits(model, batch)
    with patch_vlm(model):
        out = logits(model, batch, position_ids=ids)
    mask = batch['attention_mask'].bool()
    assert (out - ref)[mask].abs().max().item() <= 1e-6


# ---------------------------------------------------------------------------------------------- every scheme
@pytest.mark.parametrize('family', ['qwen2_5_vl', 'qwen3_vl'])
@pytest.mark.parametrize('scheme', ENCODINGS)
def test_every_scheme_trains_and_cached_decoding_continues_the_full_sequence(family, scheme):
    """A train step has finite gradients; each cached decoding step's logits equal an uncached forward on
    the whole generated sequence, so prefill ids and the rope_deltas of decoding agree."""
    model = model_of(family)
    batch = qwen_vl_batch(family, INPUTS['mixed_left_padded'])
    with patch_vlm(model, scheme):
        model.train()
        try:
            loss = model(**batch, labels=labels_for(batch)).loss
            loss.backward()
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)
        finally:
            model.zero_grad(set_to_none=True)
            model.eval()
        with torch.no_grad():
            gen = model.generate(**batch, max_new_tokens=3, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
            seq = gen.sequences
            n = len(gen.logits)
            full = dict(batch, input_ids=seq, attention_mask=torch.cat(
                [batch['attention_mask'], torch.ones(seq.shape[0], n, dtype=torch.long)], 1),
                mm_token_type_ids=torch.cat([batch['mm_token_type_ids'], torch.zeros(seq.shape[0], n,
                                                                                     dtype=torch.long)], 1))
            whole = model(**full).logits
    L = batch['input_ids'].shape[1]
    for i, step in enumerate(gen.logits):
        torch.testing.assert_close(step, whole[:, L - 1 + i], rtol=0, atol=1e-4)


@pytest.mark.parametrize('scheme', ['vrope', 'v2pe', 'videorope', 'mhrope'])
def test_explicit_position_ids_from_the_handle_equal_computed_ones(scheme):
    model = model_of('qwen2_vl')
    batch = qwen_vl_batch('qwen2_vl', INPUTS['mixed_left_padded'])
    with patch_vlm(model, scheme) as handle:
        ref = logits(model, batch)
        keys = ('mm_token_type_ids', 'image_grid_thw', 'video_grid_thw')
        ids = handle.position_ids(batch['input_ids'], batch['attention_mask'], **{k: batch[k] for k in keys})
        out = logits(model, batch, position_ids=ids)
    assert ids.shape[0] == {'vrope': 5, 'v2pe': 2}.get(scheme, 3)
    assert torch.equal(out, ref)


def test_vrope_four_rows_are_refused_with_the_five_row_form():
    model = model_of('qwen2_vl')
    batch = qwen_vl_batch('qwen2_vl', INPUTS['image'])
    with patch_vlm(model, 'vrope') as handle:
        ids, _ = handle.rope_index(batch['input_ids'], batch['mm_token_type_ids'], batch['image_grid_thw'])
        assert ids.shape[0] == 4
        with pytest.raises(ValueError, match=r'4-row position_ids as \[text; t; h; w\].*5 rows'):
            logits(model, batch, position_ids=ids)


def test_mhrope_with_fewer_kv_heads_than_axes_needs_head_sections():
    model = model_of('qwen2_vl', heads=4, kv_heads=2, hidden=64)
    batch = qwen_vl_batch('qwen2_vl', INPUTS['image'])
    with pytest.raises(ValueError, match=r'2 key/value heads: pass head_sections=\(t, h, w\)'):
        patch_vlm(model, 'mhrope')
    ref = logits(model, batch)
    with patch_vlm(model, 'mhrope:head_sections=0|1|1') as handle:
        assert handle.encoding.head_layout == 'hw'
        out = logits(model, batch)
    assert not torch.equal(out, ref)
    assert torch.equal(logits(model, batch), ref)


# ---------------------------------------------------------------------------------------------- the handle
def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {n: (id(m), dict(m.__dict__), dict(m._forward_hooks)) for n, m in model.named_modules()})


@pytest.mark.parametrize('scheme', [None, 'mhrope', 'vrope'])
def test_remove_restores_the_instance_bit_for_bit(scheme):
    model = model_of('qwen3_vl')
    batch = qwen_vl_batch('qwen3_vl', INPUTS['mixed_left_padded'])
    ref = logits(model, batch)
    state, modules = _snapshot(model)
    deltas = model.model.rope_deltas
    handle = patch_vlm(model, scheme)
    assert handle.replaced and handle.active
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=2, do_sample=False)
    handle.remove()
    state2, modules2 = _snapshot(model)
    assert state.keys() == state2.keys() and all(torch.equal(state[k], state2[k]) for k in state)
    assert modules.keys() == modules2.keys()
    for name, (ident, attrs, hooks) in modules.items():
        ident2, attrs2, hooks2 = modules2[name]
        assert ident == ident2 and attrs.keys() == attrs2.keys() and hooks.keys() == hooks2.keys(), name
    assert 'get_rope_index' not in model.model.__dict__ and model.model.rope_deltas is deltas
    assert torch.equal(logits(model, batch), ref)
    handle.remove()  # idempotent


def test_two_instances_carry_different_schemes():
    a, b = tiny_qwen_vl('qwen2_vl', seed=1), tiny_qwen_vl('qwen2_vl', seed=1)
    batch = qwen_vl_batch('qwen2_vl', INPUTS['mixed_left_padded'])
    ref = logits(b, batch)
    with patch_vlm(a, 'videorope'):
        assert torch.equal(logits(b, batch), ref)  # b untouched while a is patched
        with patch_vlm(b):
            assert not torch.equal(logits(a, batch), logits(b, batch))
            assert (logits(b, batch) - ref).abs().max() <= 1e-6
    with pytest.raises(RuntimeError, match='already patched'):
        with patch_vlm(a):
            patch_vlm(a)


# ---------------------------------------------------------------------------------------------- refusals
def test_unsupported_models_and_versions_are_refused(monkeypatch):
    text_only = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1))
    with pytest.raises(TypeError, match='qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe'):
        patch_vlm(text_only)
    thinker = nn.Module()
    thinker.config = types.SimpleNamespace(model_type='qwen2_5_omni')
    with pytest.raises(TypeError, match='interleaves audio positions'):
        patch_vlm(thinker)
    model = model_of('qwen2_vl')
    with pytest.raises(ValueError, match="pe must be None .the model's own. or one multimodal encoding"):
        patch_vlm(model, 'rope3d')
    with pytest.raises(ValueError, match='rule must be one of'):
        patch_vlm(model, rule='6.x')
    with pytest.raises(ValueError, match="unknown option 'stride' for encoding 'videorope'"):
        patch_vlm(model, 'videorope:stride=3')
    monkeypatch.setattr(sys.modules['transformers'], '__version__', '4.57.1')  # the module transformers left there
    with pytest.raises(ImportError, match=r'patch_vlm supports transformers >= 5.25, < 6; transformers 4.57.1 is '
                                          r'installed: pip install "vispe\[transformers\]"'):
        patch_vlm(model)


# ---------------------------------------------------------------------------------------------- one mechanism
def _eval_logits(batch):
    def run(model):
        model.eval()
        return logits(model, batch)
    return run


@pytest.mark.parametrize('spec', [None, 'mhrope', 'vrope'])
def test_patched_vlm_deep_copies_into_an_independent_patched_model(spec):
    from adapter_checks import check_deepcopy
    family = 'qwen3_vl' if spec is None else 'qwen2_vl'
    model = tiny_qwen_vl(family, layers=1)
    batch = qwen_vl_batch(family, INPUTS['mixed_left_padded'])
    check_deepcopy(model, lambda m: patch_vlm(m, spec), _eval_logits(batch))


@pytest.mark.parametrize('spec', ['mhrope', 'v2pe'])
def test_patched_vlm_pickles_with_torch_save(spec):
    from adapter_checks import check_pickle
    model = tiny_qwen_vl('qwen2_5_vl', layers=1)
    check_pickle(model, lambda m: patch_vlm(m, spec), _eval_logits(qwen_vl_batch('qwen2_5_vl', INPUTS['image'])))


def test_vlm_refuses_a_second_patch_on_the_model_or_inside_it():
    from adapter_checks import check_one_patch_per_tree
    model = tiny_qwen_vl('qwen2_vl', layers=1)
    check_one_patch_per_tree(model, model.model, lambda m: patch_vlm(m, 'mhrope'), lambda m: patch_vlm(m, 'vrope'))
    # the case: the child patched while the parent is, then removed in the wrong order
    batch = qwen_vl_batch('qwen2_vl', INPUTS['image'])
    ref = logits(model, batch)
    outer = patch_vlm(model, 'videorope')
    with pytest.raises(AlreadyPatchedError, match='already patched'):
        patch_vlm(model.model, 'mhrope')
    outer.remove()
    assert torch.equal(logits(model, batch), ref)


class _Forwarding(nn.Module):
    """PEFT's attribute forwarding: what a module lacks, the module it wraps answers."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__(self.wrapped), name)

    def forward(self, *args, **kwargs):
        return getattr(self, self.wrapped)(*args, **kwargs)


class _LoraModel(_Forwarding):  # peft's LoraModel: the transformers model as .model
    wrapped = 'model'

    def __init__(self, model):
        super().__init__()
        self.model = model


class _PeftModel(_Forwarding):  # peft's PeftModel: the LoraModel as .base_model, the model by get_base_model()
    wrapped = 'base_model'

    def __init__(self, model):
        super().__init__()
        self.base_model = _LoraModel(model)

    def get_base_model(self):
        return self.base_model.model


def test_patch_vlm_finds_the_model_inside_a_peft_wrapper():
    model = tiny_qwen_vl('qwen2_vl', layers=1)
    wrapped = _PeftModel(model)
    batch = qwen_vl_batch('qwen2_vl', INPUTS['mixed_left_padded'])
    ref = logits(wrapped, batch)
    with patch_vlm(wrapped) as handle:
        assert handle.model is model
        assert (logits(wrapped, batch) - ref).abs().max() <= 1e-6
        with pytest.raises(AlreadyPatchedError, match='already patched'):
            patch_vlm(wrapped, 'vrope')
    with patch_vlm(wrapped, 'videorope'):
        assert not torch.equal(logits(wrapped, batch), ref)
    assert torch.equal(logits(wrapped, batch), ref)


def test_patch_vlm_refuses_a_list_with_a_clear_error():
    model = model_of('qwen2_vl')
    with pytest.raises(ValueError, match=r"patch_vlm takes one multimodal encoding: None .*, a spec string such as "
                                         r"'videorope:delta=2' or a dict .*got list \['mrope'\]"):
        patch_vlm(model, ['mrope'])
    with pytest.raises(ValueError, match=r"pe must be None .* or one multimodal encoding .*got 'mrope\+vrope'"):
        patch_vlm(model, 'mrope+vrope')
    with pytest.raises(ValueError, match=r"pe must be None .* or one multimodal encoding .*got 'rope_axial'"):
        patch_vlm(model, 'rope_axial')


def test_the_old_spelling_works_for_one_release_with_a_deprecation_warning():
    model = model_of('qwen2_vl')
    batch = qwen_vl_batch('qwen2_vl', INPUTS['mixed_left_padded'])
    with patch_vlm(model, 'videorope:delta=3'):
        want = logits(model, batch)
    with pytest.warns(DeprecationWarning, match='patch_vlm.model, scheme, .*options. is deprecated'):
        handle = patch_vlm(model, scheme='videorope', delta=3)
    with handle:
        assert handle.encoding.delta == 3 and torch.equal(logits(model, batch), want)
    with pytest.warns(DeprecationWarning, match="the scheme name 'rope' is deprecated: its encoding is 'rope_1d'"):
        handle = patch_vlm(model, 'rope')
    with handle:
        assert handle.encoding.name == 'rope_1d'
        with pytest.warns(DeprecationWarning, match='VLMPatch.scheme is deprecated'):
            assert handle.scheme is handle.encoding


# ---------------------------------------------------------------------------------------------- drift guard
class _Cache:
    """What compute_3d_position_ids reads of a cache: its length."""

    def __init__(self, length):
        self.length = length

    def get_seq_length(self, layer_idx=0):
        return self.length


@pytest.mark.parametrize('family', ['qwen2_5_vl', 'qwen3_vl'])
def test_compute_3d_position_ids_copy_follows_the_installed_transformers(family):
    """vispe's copy (`VLMPatch.compute_3d_position_ids`, under the model's own encoding) against the installed
    library's method on every branch: prefill, decoding from rope_deltas with and without a mask, embeddings
    only, text only, and the refusal of multimodal inputs without mm_token_type_ids."""
    import inspect
    model = model_of(family)
    inner = model.model
    original = type(inner).compute_3d_position_ids
    takes = inspect.signature(original).parameters
    batch = qwen_vl_batch(family, INPUTS['mixed_left_padded'])
    B, L = batch['input_ids'].shape
    embeds = torch.randn(B, L, 8)
    step = torch.randn(B, 1, 8)
    grids = {k: batch.get(k) for k in ('image_grid_thw', 'video_grid_thw', 'second_per_grid_ts') if k in takes}
    no_grids = dict.fromkeys(grids)
    mask_next = torch.cat([batch['attention_mask'], torch.ones(B, 1, dtype=torch.long)], 1)
    cases = {
        'prefill': (None, dict(input_ids=batch['input_ids'], inputs_embeds=embeds, cache=None, **grids,
                               attention_mask=batch['attention_mask'], mm_token_type_ids=batch['mm_token_type_ids'])),
        'decoding with a mask': ('prefill', dict(input_ids=batch['input_ids'][:, :1], inputs_embeds=step,
                                                 attention_mask=mask_next, cache=_Cache(L), **grids,
                                                 mm_token_type_ids=batch['mm_token_type_ids'])),
        'decoding without a mask': ('prefill', dict(input_ids=batch['input_ids'][:, :1], inputs_embeds=step,
                                                    attention_mask=None, cache=_Cache(L), **no_grids)),
        'embeddings only': ('prefill', dict(input_ids=None, inputs_embeds=embeds, attention_mask=None, cache=None,
                                            **no_grids)),
        'text only': (None, dict(input_ids=batch['input_ids'], inputs_embeds=embeds, attention_mask=None, cache=None,
                                 **no_grids)),
    }
    copy_name = 'vispe.integrations.transformers_vlm.VLMPatch.compute_3d_position_ids'
    deltas = {}
    with patch_vlm(model) as handle:
        for case, (after, kwargs) in cases.items():
            results = []
            for fn in (lambda **kw: original(inner, **kw), handle.compute_3d_position_ids):
                inner.rope_deltas = deltas.get(after)
                with torch.no_grad():
                    results.append((fn(**kwargs), inner.rope_deltas))
            (theirs, their_delta), (ours, our_delta) = results
            same = (theirs is None and ours is None) or (
                theirs is not None and ours is not None and torch.equal(ours, theirs.to(ours.dtype)))
            assert same and (their_delta is None) == (our_delta is None), \
                f'{copy_name} differs from transformers\' {type(inner).__name__}.compute_3d_position_ids ({case})'
            if their_delta is not None:
                assert torch.equal(our_delta, their_delta.to(our_delta.dtype)), f'{copy_name}: rope_deltas ({case})'
            deltas[case] = their_delta
        no_types = dict(cases['prefill'][1], mm_token_type_ids=None)
        outcomes = []
        for fn in (lambda **kw: original(inner, **kw), handle.compute_3d_position_ids):
            inner.rope_deltas = None
            try:
                outcomes.append(('returns', fn(**no_types)))
            except ValueError as e:
                outcomes.append(('raises', str(e)))
        assert outcomes[0] == outcomes[1], f'{copy_name} must treat multimodal inputs without mm_token_type_ids as ' \
                                           f'transformers does: {outcomes[0][0]} there'
    if family != 'qwen2_5_vl':  # Qwen2.5-VL's leaves them to the language model's default instead
        assert outcomes[0][0] == 'raises'


# ---------------------------------------------------------------------------------------------- docs, benchmark
def test_the_docs_page_examples_run():
    import re
    from pathlib import Path
    page = Path(__file__).resolve().parents[1] / 'docs' / 'vlm.md'
    blocks = re.findall(r'```python\n(.*?)```', page.read_text(), re.S)
    assert len(blocks) == 3
    for block in blocks:
        exec(compile(block, str(page), 'exec'), {})


def test_the_benchmark_runs_and_checks_its_ids_against_get_rope_index():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / 'benchmarks' / 'vlm_adapter.py'
    spec = importlib.util.spec_from_file_location('vlm_adapter_bench', path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = bench.main(['--family', 'qwen2_5_vl', '--hidden', '32', '--layers', '1', '--samples', '1',
                      '--tokens', '3000', '--rounds', '1', '--schemes'])
    assert set(out) == {'train unpatched', 'train patched own (mrope)', 'ids speedup'}
    assert out['train unpatched'] == 1.0 and out['ids speedup'] > 0


# ---------------------------------------------------------------------------------------------- both sides
@pytest.mark.parametrize('family', ['qwen2_vl', 'qwen3_vl'])
def test_vision_pe_none_gives_both_sides_their_own_encodings_and_the_unpatched_logits(family):
    model = tiny_qwen_vl(family, layers=1)
    batch = qwen_vl_batch(family, INPUTS['mixed_left_padded'])
    ref = logits(model, batch)
    with patch_vlm(model, vision_pe=None) as handle:
        assert handle.vision is not None and handle.vision.encoding is not None
        out = logits(model, batch)
    mask = batch['attention_mask'].bool()
    assert (out - ref)[mask].abs().max().item() <= 1e-5


def test_both_sides_in_one_call_change_both_and_remove_together():
    family = 'qwen2_vl'
    model = tiny_qwen_vl(family, layers=1)
    batch = qwen_vl_batch(family, INPUTS['image'])
    ref = logits(model, batch)
    state, modules = _snapshot(model)
    with torch.no_grad():
        language_only = patch_vlm(model, 'videorope')
        a = logits(model, batch)
        language_only.remove()
    handle = patch_vlm(model, 'videorope', vision_pe='rope_mixed')
    assert handle.vision.encoding.name == 'rope_mixed' and 'vispe_pe' in dict(model.model.visual.named_children())
    both = logits(model, batch)
    assert (both - a).abs().max() > 1e-4  # the tower's encoding moved the image tokens' features
    from vispe.integrations import patch_vision
    with pytest.raises(AlreadyPatchedError, match='already patched'):
        patch_vision(model.model.visual, 'liere')  # the tower belongs to this model's one patch
    handle.remove()
    assert not handle.vision.active
    state2, modules2 = _snapshot(model)
    assert all(torch.equal(state[k], state2[k]) for k in state) and modules.keys() == modules2.keys()
    for name, (ident, attrs, hooks) in modules.items():
        assert attrs.keys() == modules2[name][1].keys() and hooks.keys() == modules2[name][2].keys(), name
    assert torch.equal(logits(model, batch), ref)


def test_both_sides_patched_model_deep_copies_and_pickles():
    from adapter_checks import check_deepcopy, check_pickle
    batch = qwen_vl_batch('qwen2_5_vl', INPUTS['image'])
    check_deepcopy(tiny_qwen_vl('qwen2_5_vl', layers=1), lambda m: patch_vlm(m, 'mrope', vision_pe='liere'),
                   _eval_logits(batch))
    check_pickle(tiny_qwen_vl('qwen2_5_vl', layers=1), lambda m: patch_vlm(m, vision_pe='rope_mixed'),
                 _eval_logits(batch))


def test_a_vision_pe_the_tower_cannot_take_leaves_the_model_unpatched():
    model = tiny_qwen_vl('qwen2_vl', layers=1)
    state, modules = _snapshot(model)
    with pytest.raises(ValueError):
        patch_vlm(model, 'mrope', vision_pe='prope')  # needs cameras
    state2, modules2 = _snapshot(model)
    assert all(torch.equal(state[k], state2[k]) for k in state)
    assert {n: (a.keys(), h.keys()) for n, (_, a, h) in modules.items()} == \
        {n: (a.keys(), h.keys()) for n, (_, a, h) in modules2.items()}
