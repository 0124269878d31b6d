"""Wan VACE and HunyuanVideo from files, as a user loads them: tiny files (width 128, the
shapes ComfyUI's stock detection accepts) through the stock UNETLoader path as the
reference, then RingSwap Patch at windows 1, 2 and all, prefetch 0-2, and the RingSwap
Model Loader with home ram and disk: bit-identical outputs on two calls; VACE's vace blocks
are streamed at window 1 and not counted as non-block weights.
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


def _vace_inputs(g):
    x, sigma, _, extra = fm._vace_inputs(g)
    return x, sigma, torch.randn(1, 8, 4096, generator=g), extra   # Wan's detection: 4096-wide text


def _hunyuan_inputs(g):
    x, sigma, ctx, extra = fm._hunyuan_inputs(g)
    return x, sigma, ctx, dict(extra, y=torch.randn(1, 768, generator=g))   # its detection: 768-wide vector


VACE = dataclasses.replace(BASE, unet_config=dict(BASE.unet_config, dim=128, ffn_dim=256, num_heads=1,
                                                  text_dim=4096), make_inputs=_vace_inputs)
HUNYUAN = dataclasses.replace(fm.BY_NAME["hunyuan_video"], make_inputs=_hunyuan_inputs, unet_config=dict(
    fm.BY_NAME["hunyuan_video"].unet_config, hidden_size=128, num_heads=1, axes_dim=[16, 56, 56], vec_in_dim=768,
    mlp_ratio=4.0))
FILES = {"wan_vace": VACE, "hunyuan_video": HUNYUAN}


@pytest.fixture(scope="module", params=sorted(FILES))
def family_file(request, tmp_path_factory):
    family = FILES[request.param]
    if family.missing():
        pytest.skip(family.missing())
    model = fm.build(family)
    path = os.path.join(tmp_path_factory.mktemp(family.name), f"tiny_{family.name}.safetensors")
    save_file({k: v.contiguous() for k, v in model.model.diffusion_model.state_dict().items()}, path)
    return family, path


@pytest.fixture(scope="module")
def reference(family_file):
    family, path = family_file
    stock = load_stock(path)
    assert type(stock.model.diffusion_model).__name__ == family.dm_class
    outs = [fm.forward(stock, *family.inputs(seed=s)) for s in (1, 2)]
    comfy.model_management.unload_all_models()
    return family, path, stock, outs


def check(family, model, outs):
    for seed, want in zip((1, 2), outs):
        assert torch.equal(fm.forward(model, *family.inputs(seed=seed)), want)


@pytest.mark.parametrize("window", [1, 2, 99])
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_patch_on_the_stock_model(reference, window, prefetch):
    family, _, stock, outs = reference
    (model,) = RingSwapPatch().patch(stock, window, prefetch, "auto")
    check(family, model, outs)
    if window == 1:
        assert len(model.swap_engine.plan.streamed) == model.swap_engine.num_blocks
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_model_loader_on_the_file(reference, home):
    family, path, _, outs = reference
    for window in (1, 2):
        model = load_swapped_model(path, SwapSettings(window, 1), home=home, disk_workers=2)
        check(family, model, outs)
        state = model.swap_state
        assert state.list_names == list(family.lists)
        dm = model.model.diffusion_model
        listed = sum(t.numel() * t.element_size() for n in family.lists for t in getattr(dm, n).state_dict().values())
        total = sum(t.numel() * t.element_size() for t in dm.state_dict().values())
        assert state.nonblock_bytes <= total - listed
        comfy.model_management.unload_all_models()
