"""Wan VACE from a file, as a user loads it: a tiny VaceWanModel file (width 128, which
ComfyUI's stock detection accepts) through the stock UNETLoader path as the reference,
then RingSwap Patch at windows 1, 2 and all, prefetch 0-2, and the RingSwap Model Loader
with home ram and disk: bit-identical outputs on two calls, the vace blocks streamed at
window 1 and not counted as non-block weights.
"""
import dataclasses
import os

import pytest
import torch

import comfy.model_management
from safetensors.torch import save_file

from ringswap.loaders.model_loader import load_swapped_model
from ringswap.loaders.swap_patcher import SwapSettings
from ringswap.nodes.patch import RingSwapPatch
from support import family_models as fm
from wan_model import load_stock

BASE = fm.BY_NAME["wan_vace"]


def _inputs(g):
    x, sigma, _, extra = fm._vace_inputs(g)
    return x, sigma, torch.randn(1, 8, 4096, generator=g), extra   # Wan's detection: 4096-wide text


VACE = dataclasses.replace(BASE, unet_config=dict(BASE.unet_config, dim=128, ffn_dim=256, num_heads=1,
                                                  text_dim=4096), make_inputs=_inputs)
MAIN, SIDE = fm.VACE_MAIN, fm.VACE_BLOCKS


@pytest.fixture(scope="module")
def vace_file(tmp_path_factory):
    if VACE.missing():
        pytest.skip(VACE.missing())
    model = fm.build(VACE)
    path = os.path.join(tmp_path_factory.mktemp("vace"), "tiny_vace.safetensors")
    save_file({k: v.contiguous() for k, v in model.model.diffusion_model.state_dict().items()}, path)
    return path


@pytest.fixture(scope="module")
def reference(vace_file):
    stock = load_stock(vace_file)
    assert type(stock.model.diffusion_model).__name__ == "VaceWanModel"
    outs = [fm.forward(stock, *VACE.inputs(seed=s)) for s in (1, 2)]
    comfy.model_management.unload_all_models()
    return stock, outs


def check(model, outs):
    for seed, want in zip((1, 2), outs):
        assert torch.equal(fm.forward(model, *VACE.inputs(seed=seed)), want)


@pytest.mark.parametrize("window", [1, 2, MAIN + SIDE])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_patch_on_the_stock_vace_model(reference, window, prefetch):
    stock, outs = reference
    (model,) = RingSwapPatch().patch(stock, window, prefetch, "auto")
    check(model, outs)
    if window == 1:
        assert set(range(MAIN, MAIN + SIDE)) <= set(model.swap_engine.plan.streamed)
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_model_loader_on_the_vace_file(vace_file, reference, home):
    _, outs = reference
    for window in (1, 2):
        model = load_swapped_model(vace_file, SwapSettings(window, 1), home=home, disk_workers=2)
        check(model, outs)
        state = model.swap_state
        assert state.list_names == ["blocks", "vace_blocks"]
        vace = sum(t.numel() * t.element_size() for t in model.model.diffusion_model.vace_blocks.state_dict().values())
        total = sum(t.numel() * t.element_size() for t in model.model.diffusion_model.state_dict().values())
        assert state.nonblock_bytes <= total - vace
        comfy.model_management.unload_all_models()
