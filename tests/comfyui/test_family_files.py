"""DiT families from files, as a user loads them: Wan VACE, HunyuanVideo, LTX-Video, Flux
(where this ComfyUI's detection takes a tiny width), Wan 2.1 i2v and Wan 2.2 TI2V-5B.

Tiny files (support/family_files.py: width 128, the shapes ComfyUI's stock detection accepts)
go through the stock UNETLoader path as the reference, and detection must build the intended
classes; then RingSwap Patch at windows 1, 2 and all, prefetch 0-2, and the RingSwap Model
Loader with home ram and disk: bit-identical outputs on two calls; VACE's vace blocks are
streamed at window 1 and no block list is counted as non-block weights.
"""
import os

import pytest
import torch

import comfy.model_management

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.nodes.patch import RingSwapPatch
from support import family_files as ffs
from support import family_models as fm
from wan_model import load_stock

SEEDS = (1, 2)   # two consecutive calls, on different inputs


@pytest.fixture(scope="module", autouse=True)
def _fast_and_quiet(fast_and_quiet):
    yield


def assert_detected(ff, model):
    """ComfyUI built the intended config, BaseModel and diffusion model classes."""
    family = ff.family
    got = (type(model.model.model_config).__name__, type(model.model).__name__,
           type(model.model.diffusion_model).__name__)
    assert got == (family.config, ff.model_class, family.dm_class), f"{ff.name}: detection built {got}"
    for path, want in ff.attrs.items():
        assert ffs.attr(model.model, path) == want, f"{ff.name}: {path} is {ffs.attr(model.model, path)!r}"


@pytest.fixture(scope="module", params=[ff.name for ff in ffs.FILES])
def reference(request, tmp_path_factory):
    ff = ffs.BY_NAME[request.param]
    if ff.family.missing():
        pytest.skip(ff.family.missing())
    path = ffs.write(ff, os.path.join(tmp_path_factory.mktemp(ff.name), f"tiny_{ff.name}.safetensors"))
    reason = ffs.unsupported(ff, path)
    if reason:
        pytest.skip(f"{ff.name}: {reason}")
    stock = load_stock(path)
    assert_detected(ff, stock)
    outs = [fm.forward(stock, *ff.family.inputs(seed=s)) for s in SEEDS]
    comfy.model_management.unload_all_models()
    for out in outs:
        assert torch.isfinite(out).all() and out.abs().max() > 0
    assert not torch.equal(outs[0], outs[1])
    return ff, path, stock, outs


def check(ff, model, outs, what):
    for seed, want in zip(SEEDS, outs):
        got = fm.forward(model, *ff.family.inputs(seed=seed))
        assert torch.equal(got, want), (f"{ff.name} {what}: seed {seed} differs from the stock loader "
                                        f"(max abs diff {(got - want).abs().max().item():.3g})")


@pytest.mark.parametrize("window", [1, 2, 99])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_patch_on_the_stock_model(reference, window, prefetch):
    ff, _, stock, outs = reference
    (model,) = RingSwapPatch().patch(stock, window, prefetch, "auto")
    check(ff, model, outs, f"Patch window {window} prefetch {prefetch}")
    plan, n = model.swap_engine.plan, model.swap_engine.num_blocks
    if window == 1:
        assert tuple(plan.streamed) == tuple(range(n)), "at window 1 every block of every list streams"
    elif window + prefetch < n:
        assert len(plan.streamed) == n - window + 1
    else:
        assert tuple(plan.streamed) == ()
    comfy.model_management.unload_all_models()
    assert not model.swap_engine.attached


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_model_loader_on_the_file(reference, home):
    ff, path, _, outs = reference
    for window in (1, 2):
        model = load_swapped_model(path, SwapSettings(window, 1), home=home, disk_workers=2)
        assert_detected(ff, model)
        check(ff, model, outs, f"Model Loader home {home} window {window}")
        state = model.swap_state
        assert state.list_names == list(ff.family.lists)
        dm = model.model.diffusion_model
        listed = sum(fm.block_bytes(getattr(dm, n)) for n in ff.family.lists)
        assert state.nonblock_bytes <= fm.block_bytes(dm) - listed
        if window == 1:
            assert len(model.swap_engine.plan.streamed) == model.swap_engine.num_blocks
        comfy.model_management.unload_all_models()
