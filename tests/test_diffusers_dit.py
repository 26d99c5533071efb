"""`patch_dit` on tiny diffusers transformers: the host's own encoding computed by vispe equals the unpatched
transformer (native, 2x and 4x grids, 2x frames), where the host stops (SD3's table, Wan's table length,
QwenImage's text table) the formula continues, the layouts the hosts leave to users, any vispe encoding,
and what every adapter promises (copies, pickles, one patch per tree, clear errors, nothing half-patched)."""
import math

import pytest
import torch
from torch import nn

pytest.importorskip('diffusers')

from vispe.integrations import AlreadyPatchedError, UnsupportedModelError, patch_dit  # noqa: E402
from vispe.integrations.base import refuse_patched  # noqa: E402
from vispe.integrations.diffusers import kontext_ids  # noqa: E402

from adapter_checks import check_deepcopy, check_pickle  # noqa: E402
from dit_hosts import HOSTS, NATIVE, build, forward, inputs, runner, scaled  # noqa: E402

GRIDS = [(1, 1), (2, 1), (4, 1), (1, 2)]  # (spatial factor, frame factor): native, 2x, 4x, 2x frames


def _cases():
    for kind in HOSTS:
        for factor, frames in GRIDS:
            if frames > 1 and len(NATIVE[kind]) != 3:
                continue
            yield kind, factor, frames


@pytest.mark.parametrize('kind, factor, frames', list(_cases()))
def test_own_encoding_equals_the_unpatched_transformer(kind, factor, frames):
    model = build(kind)
    grid = scaled(kind, factor, frames)
    run = runner(kind, grid)
    want = run(model)
    handle = patch_dit(model)
    got = run(model)
    handle.remove()
    assert (got - want).abs().max() <= 1e-6
    torch.testing.assert_close(run(model), want, rtol=0, atol=0)  # removed: the unpatched transformer


@pytest.mark.parametrize('kind', ['flux', 'qwenimage'])
def test_text_positions_follow_the_host(kind):
    """FLUX: text ids of the caller's choosing; QwenImage: text after the image, for several lengths."""
    model = build(kind)
    for text in (1, 7):
        extra = {'txt_ids': torch.arange(3 * text, dtype=torch.float32).reshape(text, 3)} if kind == 'flux' else {}
        run = runner(kind, scaled(kind, 2), text=text, **extra)
        want = run(model)
        with patch_dit(model):
            assert (run(model) - want).abs().max() <= 1e-6


def test_flux_kontext_index_layout_is_the_pipelines_ids():
    from diffusers import FluxKontextPipeline
    latent = FluxKontextPipeline._prepare_latent_image_ids(1, 3, 4, 'cpu', torch.float32)
    reference = FluxKontextPipeline._prepare_latent_image_ids(1, 2, 5, 'cpu', torch.float32)
    reference[..., 0] = 1
    want = torch.cat([latent, reference])
    for layout in ('index', 'offset'):  # one reference: both layouts are the pipeline's
        torch.testing.assert_close(kontext_ids((3, 4), [(2, 5)], layout), want, rtol=0, atol=0)


def test_flux_kontext_layouts_of_several_references():
    ids = kontext_ids((2, 2), [(2, 3), (1, 2)], 'offset')
    second = ids[4 + 6:]
    assert second[:, 0].tolist() == [1, 1] and second[:, 2].tolist() == [3, 4]  # after the first one's 3 columns
    ids = kontext_ids((2, 2), [(2, 3), (1, 2)], 'index')
    assert ids[4 + 6:, 0].tolist() == [2, 2] and ids[4 + 6:, 2].tolist() == [0, 1]


@pytest.mark.parametrize('layout', ['index', 'offset'])
def test_flux_reference_layout_relays_the_reference_tokens(layout):
    """The patched transformer given references in the index layout equals the unpatched one given ``layout``."""
    model = build('flux')
    refs = [(2, 3), (1, 2)]
    n = 16 + 6 + 2
    given = inputs('flux', (4, 4), hidden_states=torch.randn(1, n, 4, generator=torch.Generator().manual_seed(3)),
                   img_ids=kontext_ids((4, 4), refs, 'index'))
    laid = dict(given, img_ids=kontext_ids((4, 4), refs, layout))
    with torch.no_grad():
        want = forward(model, laid)
        with patch_dit(model, reference_layout=layout):
            got = forward(model, given)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_sd3_grid_beyond_its_table_continues_the_formula():
    """The host refuses a grid past pos_embed_max_size; the patch continues the table, whose central
    rows and columns are the host's stored table."""
    model = build('sd3')
    max_size = model.pos_embed.pos_embed_max_size
    run = runner('sd3', (max_size + 2, max_size + 2))
    with pytest.raises(ValueError, match='cannot be greater than `pos_embed_max_size`'):
        run(model)
    with patch_dit(model) as handle:
        assert run(model).isfinite().all()
        table = handle.rope(max_size + 2, max_size + 2, torch.device('cpu')).reshape(max_size + 2, max_size + 2, -1)
    stored = model.pos_embed.pos_embed.reshape(max_size, max_size, -1)
    torch.testing.assert_close(table[1:-1, 1:-1], stored, rtol=0, atol=0)
    with patch_dit(model.to(torch.bfloat16)) as handle:  # the host's stored table follows the model to bf16
        assert model.pos_embed.pos_embed.dtype == torch.bfloat16
        assert handle.rope(4, 4, torch.device('cpu')).dtype == torch.float32


def test_wan_runs_past_its_table_and_keeps_tables_float32():
    model = build('wan')  # rope_max_seq_len = 32
    run = runner('wan', (2, 36, 2))
    with pytest.raises(RuntimeError):
        run(model)
    with patch_dit(model) as handle:
        assert run(model).shape[-2] == 72
        model.to(torch.bfloat16)
        cos, sin = model.rope(torch.zeros(1, 4, 2, 8, 8, dtype=torch.bfloat16))
        assert cos.dtype == sin.dtype == torch.float32
        assert handle.rope is model.rope
    # the host's own tables follow .to() although rope is in _keep_in_fp32_modules
    assert build('wan').to(torch.bfloat16).rope.freqs_cos.dtype == torch.bfloat16


def test_qwenimage_long_text_continues_past_the_table():
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope
    own = QwenEmbedRope(10000, [4, 6, 6], scale_rope=True)
    text = 4100
    img, txt = own([(1, 4, 4)], device=torch.device('cpu'), max_txt_seq_len=text)
    assert txt.shape[0] < text  # the host's slice of its 4,096 rows: fewer positions than text tokens
    model = build('qwenimage')
    model.pos_embed = own
    with patch_dit(model) as handle:
        img2, txt2 = model.pos_embed([(1, 4, 4)], device=torch.device('cpu'), max_txt_seq_len=text)
        assert txt2.shape[0] == text
        torch.testing.assert_close(img2, img, rtol=0, atol=0)
        torch.testing.assert_close(txt2[:txt.shape[0]], txt, rtol=0, atol=0)
        k2, k3 = torch.arange(2.0), torch.arange(3.0)  # the last row by hand: position 2 + 4099 on every axis
        angles = (2 + text - 1) * torch.cat([1 / 10000 ** (2 * k2 / 4), 1 / 10000 ** (2 * k3 / 6),
                                             1 / 10000 ** (2 * k3 / 6)])
        torch.testing.assert_close(txt2[-1], torch.polar(torch.ones_like(angles), angles), rtol=0, atol=2e-6)
        assert handle.rope.text_layout == 'continue'
    with patch_dit(model, text_layout='table'):
        with pytest.raises(ValueError, match="past QwenImage's 4096-row table"):
            model.pos_embed([(1, 4, 4)], device=torch.device('cpu'), max_txt_seq_len=text)


ENCODINGS = {'flux': 'rope_mixed', 'sd3': 'learned', 'qwenimage': 'liere', 'wan': 'rope_mixed',
             'hunyuan_video': 'liere', 'ltx_video': 'string_cayley'}


@pytest.mark.parametrize('kind', HOSTS)
def test_patched_transformer_deep_copies_and_pickles(kind):
    run = runner(kind, NATIVE[kind])
    check_deepcopy(build(kind), lambda m: patch_dit(m, ENCODINGS[kind]), run)
    check_pickle(build(kind), lambda m: patch_dit(m, scaling='yarn', train_grid=(2,) * len(NATIVE[kind])), run)


@pytest.mark.parametrize('kind', HOSTS)
def test_vispe_encoding_changes_the_output_and_remove_restores(kind):
    model = build(kind)
    run = runner(kind, NATIVE[kind])
    want = run(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with patch_dit(model, 'rope_axial') as handle:
        assert not torch.allclose(run(model), want)
        assert handle.encoding.name == 'rope_axial'
    torch.testing.assert_close(run(model), want, rtol=0, atol=0)
    assert model.state_dict().keys() == state.keys() and all(torch.equal(model.state_dict()[k], v)
                                                             for k, v in state.items())


def test_one_patch_per_transformer_tree():
    model = build('flux')
    holder = nn.Sequential(model)
    handle = patch_dit(model)
    with pytest.raises(AlreadyPatchedError, match='already patched'):
        patch_dit(model, 'liere')
    with pytest.raises(AlreadyPatchedError, match='its submodule'):
        refuse_patched(holder, 'another adapter')
    handle.remove()
    patch_dit(model, 'liere').remove()


def test_bad_input_is_refused_naming_the_argument():
    model = build('flux')
    with pytest.raises(UnsupportedModelError, match='patch_dit supports the diffusers classes'):
        patch_dit(nn.Linear(2, 2))
    with pytest.raises(ValueError, match='scaling must be one of'):
        patch_dit(model, scaling='dynamic')
    with pytest.raises(ValueError, match=r"scaling names axes \['t'\]"):
        patch_dit(model, scaling={'t': 'riflex'})
    with pytest.raises(ValueError, match='target must be 2 positive integers'):
        patch_dit(model, scaling='yarn', target=(1024,))
    with pytest.raises(ValueError, match='a vispe encoding takes its own options'):
        patch_dit(model, 'rope_axial', scaling='yarn')
    with pytest.raises(ValueError, match='reference_layout is an option of FLUX'):
        patch_dit(build('wan'), reference_layout='offset')
    with pytest.raises(ValueError, match='text_layout is an option of QwenImage'):
        patch_dit(model, text_layout='table')
    with pytest.raises(ValueError, match="reads \\['cameras'"):
        patch_dit(model, 'prope')
    with pytest.raises(ValueError, match='acts between blocks'):
        patch_dit(model, 'peg')
    with pytest.raises(ValueError, match='unknown options'):
        patch_dit(model, theta=3.0)
    assert not any('_vispe_patch' in m.__dict__ for m in model.modules())  # nothing patched half-way
    assert type(model.pos_embed).__name__ == 'FluxPosEmbed'


def test_unsupported_diffusers_version_names_the_extra(monkeypatch):
    import diffusers
    monkeypatch.setattr(diffusers, '__version__', '0.30.0')
    with pytest.raises(ImportError, match=r'patch_dit supports diffusers >= 0.42, < 0.43.*vispe\[diffusers\]'):
        patch_dit(build('flux'))


def test_a_vispe_encoding_refuses_flux_reference_images():
    model = build('flux')
    kw = inputs('flux', (4, 4), hidden_states=torch.randn(1, 22, 4), img_ids=kontext_ids((4, 4), [(2, 3)]))
    with patch_dit(model, 'rope_axial'), pytest.raises(ValueError, match='reference images'):
        forward(model, kw)


def test_batched_forward_equals_each_sample_alone():
    model = build('flux')
    both = inputs('flux', (4, 4), batch=2)
    with patch_dit(model, scaling='ntk', train_grid=(2, 2)), torch.no_grad():
        out = forward(model, both)
        for b in range(2):
            one = dict(both, **{k: both[k][b:b + 1] for k in ('hidden_states', 'encoder_hidden_states',
                                                               'pooled_projections', 'timestep')})
            torch.testing.assert_close(forward(model, one), out[b:b + 1], rtol=0, atol=1e-6)
    assert math.isfinite(float(out.abs().sum()))


def _rotary_or_additive() -> list:
    """Every registered encoding that rotates q / k or adds an embedding, reads only grid positions and
    acts inside the blocks (the "rotary and additive image encodings")."""
    from vispe.contract import PEContext
    from vispe.registry import create_pe, list_pes
    names = []
    for name in list_pes():
        try:
            caps = create_pe(name, PEContext(dim=32, num_heads=2, grid_size=(4, 4)), device='meta').capabilities
        except ValueError:
            continue
        if (('qk' in caps.hooks) or caps.additive) and not caps.requires and not caps.between_blocks:
            names.append(name)
    return names


def _flow_matching_step(kind: str, spec: str) -> None:
    """One training step of a tiny transformer with ``spec``: a finite flow-matching loss whose gradients
    reach the encoding's parameters (if it has any) and the transformer's."""
    from dit_hosts import target_of
    model = build(kind).train()
    try:
        handle = patch_dit(model, spec, train_grid=NATIVE[kind])
    except ValueError as e:  # a 2D-only encoding in a video host: refused with the reason, before any change
        assert kind in ('wan', 'hunyuan_video', 'ltx_video') and any(w in str(e) for w in ('2D', 'plane', 'divisible'))
        assert not any('_vispe_patch' in m.__dict__ for m in model.modules())  # nothing patched
        return
    kw = inputs(kind, NATIVE[kind], batch=2)
    noisy, velocity = target_of(kind, kw)
    loss = (forward(model, dict(kw, hidden_states=noisy)) - velocity).pow(2).mean()
    loss.backward()
    assert torch.isfinite(loss)
    for p in handle.encoding.parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0 and p.grad.isfinite().all(), spec
    projections = [p for n, p in model.named_parameters() if n.endswith('to_q.weight')]
    assert projections and all(p.grad is not None and p.grad.isfinite().all() for p in projections)
    handle.remove()


@pytest.mark.parametrize('kind', HOSTS)
@pytest.mark.parametrize('spec', ['rope_mixed', 'learned'])
def test_a_learned_encoding_trains_one_flow_matching_step(kind, spec):
    _flow_matching_step(kind, spec)


@pytest.mark.slow
@pytest.mark.parametrize('kind', HOSTS)
@pytest.mark.parametrize('spec', _rotary_or_additive())
def test_every_rotary_and_additive_encoding_trains_in_every_host(kind, spec):
    _flow_matching_step(kind, spec)


@pytest.mark.parametrize('patch', [{}, {'scaling': 'yarn', 'target': (128, 128), 'train_grid': (4, 4)}])
def test_patched_flux_compiles_to_one_graph(patch):
    """torch.compile(fullgraph=True) (no graph break) of FLUX with its own encoding, scaled for a fixed
    target (the graph of the compiler's front end, checked against the eager forward)."""
    model = build('flux')
    kw = inputs('flux', (8, 8))
    with patch_dit(model, **patch), torch.no_grad():
        want = forward(model, kw)
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend='eager')(**kw).sample
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _attentions(kind, model):
    """(attention module, vispe processor, call keywords) of each kind of attention the patch replaces."""
    from vispe.integrations.diffusers.flux import FluxProcessor
    from vispe.integrations.diffusers.hunyuan_video import HunyuanVideoProcessor
    from vispe.integrations.diffusers.ltx_video import LTXVideoProcessor
    from vispe.integrations.diffusers.qwenimage import QwenImageProcessor
    from vispe.integrations.diffusers.sd3 import SD3Processor
    from vispe.integrations.diffusers.wan import WanProcessor
    g = torch.Generator().manual_seed(5)
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    x, text = torch.randn(2, 16, dim, generator=g), torch.randn(2, 3, dim, generator=g)
    if kind == 'flux':
        return [(model.transformer_blocks[0].attn, FluxProcessor(0), dict(encoder_hidden_states=text)),
                (model.single_transformer_blocks[0].attn, FluxProcessor(1), {})]
    if kind == 'sd3':
        block = model.transformer_blocks[0]
        return [(block.attn, SD3Processor(0, 'joint'), dict(encoder_hidden_states=text)),
                (block.attn2, SD3Processor(2, 'image'), {})]
    if kind == 'qwenimage':
        mask = torch.tensor([[True, True, False], [True, True, True]])
        return [(model.transformer_blocks[0].attn, QwenImageProcessor(0),
                 dict(encoder_hidden_states=text, encoder_hidden_states_mask=mask))]
    if kind == 'wan':
        return [(model.blocks[0].attn1, WanProcessor(0), {})]
    if kind == 'ltx_video':
        return [(model.transformer_blocks[0].attn1, LTXVideoProcessor(0), {})]
    mask = torch.ones(2, 1, 1, 19, dtype=torch.bool)
    mask[0, ..., -1] = False
    return [(model.transformer_blocks[0].attn, HunyuanVideoProcessor(0),
             dict(encoder_hidden_states=text, attention_mask=mask)),
            (model.single_transformer_blocks[0].attn, HunyuanVideoProcessor(1),
             dict(encoder_hidden_states=text, attention_mask=mask))]


@pytest.mark.parametrize('kind', HOSTS)
def test_vispe_processors_follow_the_installed_hosts_processors(kind):
    """Where vispe copies a host's attention processor: with no encoding it gives the host processor's
    outputs (without its rotary) on the installed diffusers; a change in diffusers fails here, by host."""
    model = build(kind)
    g = torch.Generator().manual_seed(5)
    dim = model.config.num_attention_heads * model.config.attention_head_dim
    x = torch.randn(2, 16, dim, generator=g)
    for attn, processor, kw in _attentions(kind, model):
        with torch.no_grad():
            want = attn(x, **kw)
            got = processor(attn, x, **kw)
        for a, b in zip(want if isinstance(want, tuple) else (want,), got if isinstance(got, tuple) else (got,)):
            torch.testing.assert_close(b, a, rtol=0, atol=2e-6, msg=lambda m: f'{kind} {type(attn).__name__}: {m}')


@pytest.mark.parametrize('kind', ['flux', 'qwenimage', 'wan'])
def test_gradient_checkpointing_passes_the_state_positionally_and_gives_the_same_gradients(kind):
    """With gradient checkpointing diffusers calls each block positionally: the first block's hook still
    finds the image tokens and the state, and the loss and the encoding's gradients are unchanged."""
    def step(checkpointing):
        model = build(kind).train()
        if checkpointing:
            model.enable_gradient_checkpointing()
        handle = patch_dit(model, 'rope_mixed+learned', train_grid=NATIVE[kind])
        torch.manual_seed(3)
        handle.encoding.reset_parameters()
        loss = forward(model, inputs(kind, NATIVE[kind])).pow(2).mean()
        loss.backward()
        return loss.detach(), [p.grad for p in handle.encoding.parameters()]
    loss, grads = step(False)
    loss_ckpt, grads_ckpt = step(True)
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads_ckpt, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize('kind', HOSTS)
@pytest.mark.parametrize('pe', [None, 'rope_axial'])
def test_every_patched_host_compiles_to_one_graph(kind, pe):
    """fullgraph=True for every host with its own encoding and, except FLUX (whose grid is read from the
    values of its ids), with a vispe encoding."""
    if kind == 'flux' and pe is not None:
        pytest.skip('FLUX hands its positions as id values: a vispe encoding reads the grid from them')
    model = build(kind)
    kw = inputs(kind, NATIVE[kind])
    with patch_dit(model, pe), torch.no_grad():
        want = forward(model, kw)
        torch._dynamo.reset()
        got = torch.compile(model, fullgraph=True, backend='eager')(**kw).sample
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_flux_pipeline_calls_the_patched_transformer_and_hands_its_steps_to_the_schedule():
    """A FluxPipeline (tiny VAE, text embeddings given, no text encoders) with the patched transformer: the
    own encoding gives the unpatched images, and a schedule sees each denoising step's noise level."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=1, block_out_channels=(8,), layers_per_block=1,
                        down_block_types=('DownEncoderBlock2D',), up_block_types=('UpDecoderBlock2D',),
                        norm_num_groups=4, shift_factor=0.0)
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None, tokenizer=None,
                        text_encoder_2=None, tokenizer_2=None, transformer=build('flux'))
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(prompt_embeds=torch.ones(1, 3, 8), pooled_prompt_embeds=torch.ones(1, 8), height=16, width=16,
                    num_inference_steps=3, output_type='pt', generator=torch.Generator().manual_seed(0)).images
    want = generate()
    with patch_dit(pipe.transformer):
        torch.testing.assert_close(generate(), want, rtol=0, atol=1e-6)
    seen = []
    with patch_dit(pipe.transformer, schedule=lambda t, axis: seen.append(t) or 'yarn', train_grid=(4, 4)):
        scaled_images = generate()
    assert not torch.allclose(scaled_images, want)
    steps = (pipe.scheduler.timesteps / 1000).tolist()
    assert seen == pytest.approx([t for t in steps for _ in ('h', 'w')], abs=1e-6)
