"""NeRF and coordinate MLPs: encodings by hand, volume-rendering identities, sampling, data, image fitting."""
import math

import pytest
import torch

import vispe
from vispe_models.nerf import CoordinateMLP, NeRF, coordinate_encoder, fit_image, sample_pdf, volume_render
from vispe_models.nerf_data import (
    Sphere, get_rays, load_blender, look_at, procedural_image, render_analytic, save_blender, scene_rays,
    synthetic_scene,
)


def test_nerf_frequency_encoding_values_by_hand():
    x = torch.tensor([0.3, -0.7])
    enc = coordinate_encoder('nerf_freq:levels=2', input_dim=2)
    s, c = math.sin, math.cos
    # NeRF's released code: [p, sin(2^0 p), cos(2^0 p), sin(2^1 p), cos(2^1 p)], each over both axes
    expected = [0.3, -0.7, s(0.3), s(-0.7), c(0.3), c(-0.7), s(0.6), s(-1.4), c(0.6), c(-1.4)]
    assert enc(x).tolist() == pytest.approx(expected, abs=1e-6)
    pi = coordinate_encoder('nerf_freq:levels=2,multiply_pi=true,include_input=false', input_dim=2)
    p = math.pi
    expected_pi = [s(0.3 * p), s(-0.7 * p), c(0.3 * p), c(-0.7 * p), s(0.6 * p), s(-1.4 * p), c(0.6 * p), c(-1.4 * p)]
    assert pi(x).tolist() == pytest.approx(expected_pi, abs=1e-6)
    grouped = coordinate_encoder('nerf_freq:levels=2,layout=grouped', input_dim=2)
    expected_grouped = [s(0.3), s(0.6), s(-0.7), s(-1.4), c(0.3), c(0.6), c(-0.7), c(-1.4), 0.3, -0.7]
    assert grouped(x).tolist() == pytest.approx(expected_grouped, abs=1e-6)
    linear = coordinate_encoder('nerf_freq:levels=3,log_sampling=false,include_input=false', input_dim=1)
    assert linear(torch.tensor([0.5])).tolist() == pytest.approx(
        [s(0.5), c(0.5), s(1.25), c(1.25), s(2.0), c(2.0)], abs=1e-6)  # frequencies 1, 2.5, 4


def test_nerf_encoding_widths_match_the_paper():
    nerf = NeRF(depth=2, width=16, num_coarse=4, num_fine=0)
    assert nerf.pos_encoder.out_dim == 63 and nerf.dir_encoder.out_dim == 27
    assert nerf.coarse.pts_linears[0].in_features == 63
    assert nerf.coarse.views_linears[0].in_features == 27 + 16


def test_gaussian_fourier_features_follow_the_formula_and_scale():
    enc = coordinate_encoder('fourier_gaussian:scale=3,num_features=4096,seed=0', input_dim=2).pe
    b = enc.encoder.B
    assert b.shape == (4096, 2)
    assert float(b.std()) == pytest.approx(3.0, rel=0.05)
    v = torch.tensor([[0.25, 0.5]])
    proj = 2 * math.pi * (v @ b.T)
    assert torch.allclose(enc.encode(v), torch.cat([proj.cos(), proj.sin()], -1), atol=1e-4)  # the paper's order
    notebook = coordinate_encoder('fourier_gaussian:scale=3,num_features=4096,seed=0,order=sin_cos', 2).pe
    assert torch.allclose(notebook.encode(v), torch.cat([proj.sin(), proj.cos()], -1), atol=1e-4)
    assert 'encoder.B' in enc.state_dict() and not any(p is b for p in enc.parameters())  # fixed, saved


@pytest.mark.parametrize('spec', ['fourier_gaussian:seed=0', 'nerf_freq:levels=10'])
def test_coordinate_phases_are_float32_under_autocast(spec):
    enc = coordinate_encoder(spec, input_dim=2)
    x = torch.rand(64, 2)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        mixed = enc(x)
    assert torch.equal(mixed, enc(x))  # bf16 phases would be off by a large part of a period


def test_coordinate_encodings_embed_grid_tokens_at_pixel_centres():
    pe = vispe.create_pe('fourier_gaussian:num_features=8,seed=1,project=false', dim=16, grid_size=(2, 4))
    emb = pe.embedding(vispe.grid(2, 4, num_prefix=1))
    assert emb.shape == (1, 9, 16) and bool((emb[0, 0] == 0).all())
    centres = torch.tensor([[(r + 0.5) / 2, (c + 0.5) / 4] for r in range(2) for c in range(4)])
    assert torch.allclose(emb[0, 1:], pe.encode(centres))
    with pytest.raises(ValueError, match='project'):
        vispe.create_pe('nerf_freq:project=false', dim=16).embedding(vispe.grid(2, 2))


def test_attention_encodings_are_rejected_as_coordinate_maps():
    with pytest.raises(ValueError, match='does not map coordinates'):
        coordinate_encoder('rope_axial', input_dim=2)


def test_single_opaque_sample_returns_its_colour():
    z = torch.linspace(2, 6, 8).expand(3, 8)
    density = torch.zeros(3, 8)
    density[:, 3] = 1e6
    colour = torch.rand(3, 8, 3)
    rays_d = torch.randn(3, 3)
    for white in (False, True):
        out = volume_render(density, colour, z, rays_d, white_background=white)
        assert torch.allclose(out['rgb'], colour[:, 3], atol=1e-5)
        assert torch.allclose(out['depth'], z[:, 3], atol=1e-4)
        assert torch.allclose(out['acc'], torch.ones(3), atol=1e-6)


def test_empty_rays_show_the_background():
    z = torch.linspace(2, 6, 5).expand(2, 5)
    out = volume_render(torch.zeros(2, 5), torch.rand(2, 5, 3), z, torch.ones(2, 3), white_background=True)
    assert torch.allclose(out['rgb'], torch.ones(2, 3)) and torch.allclose(out['acc'], torch.zeros(2))


def test_transmittance_is_monotone_and_weights_compose():
    g = torch.Generator().manual_seed(0)
    z, _ = torch.sort(torch.rand(16, 32, generator=g) * 4 + 2, -1)
    density = torch.rand(16, 32, generator=g) * 3
    out = volume_render(density, torch.rand(16, 32, 3, generator=g), z, torch.randn(16, 3, generator=g))
    trans, weights = out['transmittance'], out['weights']
    assert torch.allclose(trans[:, 0], torch.ones(16))
    assert bool((trans[:, 1:] <= trans[:, :-1] + 1e-6).all())
    assert bool((weights >= 0).all() and (weights.sum(-1) <= 1 + 1e-5).all())
    alpha = weights / trans
    # T_{i+1} = T_i (1 - alpha_i): the definition of transmittance
    assert torch.allclose(trans[:, 1:], trans[:, :-1] * (1 - alpha[:, :-1] + 1e-10), atol=1e-5)


def test_sample_pdf_inverts_the_cdf():
    bins = torch.linspace(0, 1, 5).expand(2, 5)
    uniform = sample_pdf(bins, torch.ones(2, 4), 9, deterministic=True)
    assert torch.allclose(uniform, torch.linspace(0, 1, 9).expand(2, 9), atol=1e-4)
    peaked = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    samples = sample_pdf(bins[:1], peaked, 64)
    assert bool(((samples >= 0.5 - 1e-3) & (samples <= 0.75 + 1e-3)).float().mean() > 0.99)


def test_analytic_scene_depth_and_camera_axes():
    eye = (0.0, -4.0, 1.0)
    pose = look_at(eye)
    rays_o, rays_d = get_rays(8, 8, 10.0, pose)  # pixel (4, 4) looks straight ahead
    centre = rays_d[4, 4] / rays_d[4, 4].norm()
    assert torch.allclose(centre, -torch.tensor(eye) / torch.tensor(eye).norm(), atol=1e-6)
    sphere = Sphere((0.0, 0.0, 0.0), 0.5, (1.0, 0.0, 0.0))
    out = render_analytic(rays_o[4:5, 4], rays_d[4:5, 4], [sphere])
    expected = (math.sqrt(17) - 0.5) / float(rays_d[4, 4].norm())  # ray parameter of the first hit
    assert float(out['depth'][0]) == pytest.approx(expected, rel=1e-5) and float(out['alpha'][0]) == 1.0
    assert float(rays_d[0, 4, 2]) > float(rays_d[7, 4, 2])  # image row 0 is at the top (OpenGL y up)


def test_blender_format_round_trip(tmp_path):
    scene = synthetic_scene('test', num_views=2, height=12, width=16)
    save_blender(scene, str(tmp_path), 'test')
    loaded = load_blender(str(tmp_path), 'test')
    assert torch.allclose(loaded.poses, scene.poses, atol=1e-6)
    assert loaded.focal == pytest.approx(scene.focal, rel=1e-6)
    assert float((loaded.images - scene.images).abs().max()) <= 1 / 255 + 1e-6
    half = load_blender(str(tmp_path), 'test', downscale=2)
    assert half.images.shape == (2, 6, 8, 3) and half.focal == pytest.approx(scene.focal / 2, rel=1e-6)
    with pytest.raises(ValueError, match='transforms'):
        load_blender(str(tmp_path), 'train')


def test_nerf_training_smoke_reduces_the_loss():
    torch.manual_seed(0)
    rays = scene_rays(synthetic_scene('train', num_views=2, height=16, width=16))
    model = NeRF(depth=3, width=32, skips=(1,), num_coarse=12, num_fine=12)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    idx = torch.randperm(rays['rgb'].shape[0])[:256]
    losses = []
    for _ in range(30):
        out = model(rays['rays_o'][idx], rays['rays_d'][idx])
        loss = ((out['rgb'] - rays['rgb'][idx]) ** 2).mean() + ((out['rgb_coarse'] - rays['rgb'][idx]) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]
    model.eval()
    image = model.render_image(4, 5, 8.0, look_at((0.0, -4.0, 1.0)), batch_rays=7)
    assert image.shape == (4, 5, 3) and bool(((image >= 0) & (image <= 1)).all())


def test_nerf_accepts_learnable_fourier_features():
    model = NeRF(pos_encoding='fourier_learnable:gamma=0.5', dir_encoding='nerf_freq:levels=4', depth=2, width=16,
                 num_coarse=4, num_fine=0, encoding_dim=24)
    assert model.pos_encoder.out_dim == 24
    out = model(torch.zeros(3, 3), torch.randn(3, 3))
    out['rgb'].sum().backward()
    assert model.pos_encoder.pe.features.Wr.weight.grad is not None


def test_fourier_features_fit_an_image_better_than_raw_coordinates():
    image = procedural_image(32, 32, seed=0)
    final = {}
    for encoding in ('none', 'fourier_gaussian:scale=10,num_features=64,seed=0'):
        torch.manual_seed(0)
        model = CoordinateMLP(encoding, depth=4, width=64)
        history = fit_image(model, image, steps=200, lr=1e-3)
        final[encoding.split(':')[0]] = history[-1]['train_psnr']
        if encoding != 'none':
            assert history[-1]['train_psnr'] > history[0]['train_psnr'] + 10
    assert final['fourier_gaussian'] > final['none'] + 6


def _nerf_run(tmp_path, epochs, resume=None):
    from train.cli import run
    overrides = [
        'task=nerf', 'name=nerf', f'output_dir={tmp_path}', 'model.depth=2', 'model.width=16', 'model.skips=[0]',
        'model.num_coarse=6', 'model.num_fine=6', 'data.synthetic.train_views=2', 'data.synthetic.eval_views=1',
        'data.synthetic.height=8', 'data.synthetic.width=8', 'train.batch_size=32', 'train.steps_per_epoch=2',
        f'train.epochs={epochs}', 'optim.opt=adam', 'optim.lr=1e-3', 'optim.weight_decay=0',
        'sched.name=none', 'log.progress=off', 'log.tensorboard=off']  # constant lr: 1 + 1 epochs == 2 epochs
    if resume:
        overrides.append(f'train.resume={resume}')
    return run(None, overrides)[0]


def test_nerf_task_reports_psnr_and_resumes_exactly(tmp_path):
    from train.checkpoint import load_checkpoint
    straight = _nerf_run(tmp_path / 'a', epochs=2)
    assert straight.best['metric'] == 'psnr' and math.isfinite(straight.last_metrics['psnr'])
    _nerf_run(tmp_path / 'b', epochs=1)
    resumed = _nerf_run(tmp_path / 'b', epochs=2, resume='auto')
    assert resumed.steps == straight.steps == 4
    a = load_checkpoint(straight.run_dir / 'checkpoint.pt')['model']
    b = load_checkpoint(resumed.run_dir / 'checkpoint.pt')['model']
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_pixel_rays_match_full_image_rays():
    from vispe_models.nerf_data import pixel_rays
    scene = synthetic_scene('train', num_views=3, height=6, width=7)
    rays = scene_rays(scene, pixel_offset=0.5)
    index = torch.tensor([0, 5, 41, 42, 100, 125])
    origins, dirs = pixel_rays(scene.poses, 6, 7, scene.focal, index, pixel_offset=0.5)
    assert torch.allclose(origins, rays['rays_o'][index]) and torch.allclose(dirs, rays['rays_d'][index], atol=1e-6)


@pytest.mark.parametrize('name', ['synthetic', 'blender'])
def test_nerf_configs_validate(name):
    from pathlib import Path

    from train.config import load_config
    path = Path(__file__).parent.parent / 'configs' / 'nerf' / f'{name}.yaml'
    cfg, _ = load_config(path, ['data.root=/data/nerf_synthetic/lego'])
    assert cfg.task == 'nerf' and cfg.name == f'nerf_{name}'
