"""What every adapter into another library promises, written once and used by each adapter's tests.

Each check takes the model, a ``patch(model) -> handle`` function and a ``run(model) -> tensor`` function
(an eval forward on fixed inputs), so the same property is tested for every host:

* `check_deepcopy`: a deep copy of a patched model is an independent, correctly patched model: it gives
  the same outputs, its encoding's parameters are its own, and removing its patch restores the copy
  (the original stays patched);
* `check_pickle`: ``torch.save(model)`` / ``torch.load`` round-trips a patched model with its outputs, and
  the loaded model's patch removes;
* `check_one_patch_per_tree`: a second patch of the model, of a module inside it, or of a module holding
  it is refused, and nothing is changed by the refused call.
"""
from __future__ import annotations

import copy
import io
from typing import Callable

import pytest
import torch
from torch import nn

from vispe.integrations import AlreadyPatchedError


def _state(model: nn.Module) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def check_deepcopy(model: nn.Module, patch: Callable[[nn.Module], object], run: Callable[[nn.Module], torch.Tensor],
                   ) -> None:
    unpatched = run(model)
    handle = patch(model)
    patched = run(model)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(run(twin), patched, rtol=0, atol=0)
    # the copy's encoding is its own: changing it moves the copy only
    params = [p for n, p in twin.named_parameters() if 'vispe' in n or 'pe.' in n]
    if params:
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p))
        torch.testing.assert_close(run(model), patched, rtol=0, atol=0)
    twin_handle = next(m.__dict__['_vispe_patch'] for m in twin.modules() if '_vispe_patch' in m.__dict__)
    assert twin_handle is not handle and twin_handle.model is twin
    twin_handle.remove()
    torch.testing.assert_close(run(twin), unpatched, rtol=0, atol=0)
    torch.testing.assert_close(run(model), patched, rtol=0, atol=0)  # the original is still patched
    handle.remove()
    torch.testing.assert_close(run(model), unpatched, rtol=0, atol=0)


def check_pickle(model: nn.Module, patch: Callable[[nn.Module], object], run: Callable[[nn.Module], torch.Tensor]
                 ) -> None:
    unpatched = run(model)
    handle = patch(model)
    patched = run(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    torch.testing.assert_close(run(loaded), patched, rtol=0, atol=0)
    loaded_handle = next(m.__dict__['_vispe_patch'] for m in loaded.modules() if '_vispe_patch' in m.__dict__)
    loaded_handle.remove()
    torch.testing.assert_close(run(loaded), unpatched, rtol=0, atol=0)
    handle.remove()


def check_one_patch_per_tree(model: nn.Module, child: nn.Module, patch_model: Callable[[nn.Module], object],
                             patch_child: Callable[[nn.Module], object]) -> None:
    """``child`` is a module inside ``model`` that an adapter also accepts (a VLM's tower, a pipeline's
    transformer inside a wrapper, ...); ``patch_child`` patches it."""
    before = _state(model)
    handle = patch_model(model)
    with pytest.raises(AlreadyPatchedError, match='already patched'):
        patch_model(model)
    with pytest.raises(AlreadyPatchedError, match='already patched'):
        patch_child(child)
    handle.remove()
    _assert_same_state(_state(model), before)
    handle = patch_child(child)
    with pytest.raises(AlreadyPatchedError, match='its submodule .* is already patched'):
        patch_model(model)
    handle.remove()
    _assert_same_state(_state(model), before)
