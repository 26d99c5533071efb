"""Shared fixtures: tiny model sizes and the encodings a plain image ViT can host."""
import math

import pytest
import torch

import vispe

# a ViT small enough for every contract test to run in well under a second
TINY = dict(embed_dim=32, depth=2, num_heads=2, img_size=32, patch_size=8, num_classes=5)


def image_pes():
    """Registered encodings that need nothing beyond the token grid (no cameras, no padding masks)."""
    return [p for p in vispe.list_pes() if not vispe.pe_info(p)['cls'].requires]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip where no CUDA device is."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason='needs a CUDA GPU')
    for item in items:
        if 'cuda' in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def assert_tiny_vit_trains_and_runs_larger(spec: str) -> None:
    """A tiny ViT with encoding ``spec``: finite output and a backward pass at the training size, and
    an eval forward on a larger, non-square input (positions beyond the training grid)."""
    import timm
    model = timm.create_model('vit_tiny', pe=spec, **TINY)
    out = model(torch.randn(2, 3, 32, 32))
    out.sum().backward()
    assert out.shape == (2, TINY['num_classes']) and torch.isfinite(out).all()
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, 48, 40)).shape == (1, TINY['num_classes'])


# ------------------------------------------------------------------ random cameras (float64)
def random_poses(n: int, generator: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """``n`` random rigid transforms ``(n, 4, 4)``: proper rotations (QR of a Gaussian, the sign
    flipped where the determinant is negative) and translations ``scale * N(0, 1)``."""
    Q = torch.linalg.qr(torch.randn(n, 3, 3, dtype=torch.float64, generator=generator)).Q
    T = torch.eye(4, dtype=torch.float64).repeat(n, 1, 1)
    T[:, :3, :3] = Q * torch.linalg.det(Q).sign()[:, None, None]
    T[:, :3, 3] = scale * torch.randn(n, 3, dtype=torch.float64, generator=generator)
    return T


def random_intrinsics(n: int, generator: torch.Generator, size=(24, 32), skew: bool = False) -> torch.Tensor:
    """``n`` pinhole intrinsics ``(n, 3, 3)`` for ``size = (H, W)`` pixel images: focal lengths within
    +-20 % of the image size, principal points near the centre, optionally a skew term."""
    H, W = size
    K = torch.zeros(n, 3, 3, dtype=torch.float64)
    K[:, 0, 0] = W * (0.8 + 0.4 * torch.rand(n, dtype=torch.float64, generator=generator))
    K[:, 1, 1] = H * (0.8 + 0.4 * torch.rand(n, dtype=torch.float64, generator=generator))
    K[:, 0, 2] = W / 2 + torch.randn(n, dtype=torch.float64, generator=generator)
    K[:, 1, 2] = H / 2 + torch.randn(n, dtype=torch.float64, generator=generator)
    if skew:
        K[:, 0, 1] = 0.3 * torch.randn(n, dtype=torch.float64, generator=generator)
    K[:, 2, 2] = 1
    return K


# ------------------------------------------------------------------ q/k rotation helpers (float64)
def random_qk(n: int, heads: int = 2, head_dim: int = 16, batch: int = 2):
    """Random float64 ``q, k`` of shape ``(batch, heads, n, head_dim)``."""
    return (torch.randn(batch, heads, n, head_dim, dtype=torch.float64),
            torch.randn(batch, heads, n, head_dim, dtype=torch.float64))


def rotated_logits(pe, pos, q, k, layer: int = 1) -> torch.Tensor:
    """``q^T k`` after ``pe``'s q/k hook at ``pos`` (self-attention), in layer ``layer``."""
    q2, k2 = pe.prepare(pos).qk(q, k, layer=layer)
    return q2 @ k2.transpose(-2, -1)


def naflex_hooks(pe, x, q, k, v, pos):
    """The hooks' outputs on tokens ``x`` and projections ``q, k, v`` at ``pos``: the tokens after ``embed``,
    the attention output with the padded keys masked (prefix keys always attended), the tokens after
    ``between_blocks`` of block 0."""
    mask = None
    if pos.key_padding_mask is not None:
        pad = torch.cat([torch.zeros(len(x), pos.num_prefix, dtype=torch.bool), pos.key_padding_mask], 1)
        mask = ~pad[:, None, None, :]
    y = pe.embed(x, pos)
    o = vispe.pe_attention(q, k, v, pe.prepare(pos), layer=0, x=y, attn_mask=mask)
    return y, o, pe.between_blocks(y, pos, 0)


def naflex_max_error(pe, grids, num_prefix=1, num_tokens=None, seed=0):
    """Largest difference, over every sample's real tokens, between running ``pe``'s hooks (``embed``,
    ``prepare`` + `pe_attention` with the padded keys masked, ``between_blocks`` after block 0) on a
    NaFlex batch of ``grids`` and on each sample alone. A NaFlex-correct encoding gives rounding only."""
    g = torch.Generator().manual_seed(seed)
    ctx = pe.ctx
    pos = vispe.positions.naflex_grid(grids, num_tokens=num_tokens, num_prefix=num_prefix, train_grid=ctx.grid_size)
    B, N = len(grids), pos.num_tokens
    x = torch.randn(B, N, ctx.dim, generator=g)
    q, k, v = (torch.randn(B, ctx.num_heads, N, ctx.head_dim, generator=g) for _ in range(3))

    with torch.no_grad():
        together = naflex_hooks(pe, x, q, k, v, pos)
        err = 0.0
        for b, shape in enumerate(pos.grids):
            n = num_prefix + math.prod(shape)
            alone = naflex_hooks(pe, x[b:b + 1, :n], q[b:b + 1, :, :n], k[b:b + 1, :, :n], v[b:b + 1, :, :n],
                                 pos.sample(b))
            for full, one, axis in zip(together, alone, (1, 2, 1)):
                err = max(err, (full[b:b + 1].narrow(axis, 0, n) - one).abs().max().item())
    return err
