"""A load's first call as a prompt sees it (issue 53): the run line gives the time from the
prompt's start (a RingSwap node's) to the end of its first step, and what the first call took
from the file; a file truncated before the first call gives a clear error naming it, leaves
nothing placed, and a new load of the restored file is exact. fp32 files (on the CPU their
blocks are homed in the file's own pages) and bf16 ones (cast: read into RAM homes)."""
import logging
import os
import time

import pytest
import torch

import comfy.model_management
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter import prompt_clock
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.loaders.model_file.range_reader import FileChangedError
from support.engine_plans import blocks_on_device
from wan_model import conditioning, forward, inputs, latent, load_stock, tiny_wan

BLOCKS = 6


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def wan(tmp_path_factory, request):
    path = tiny_wan(str(tmp_path_factory.mktemp("first")), blocks=BLOCKS, dtype=request.param, seed=6)
    stock = load_stock(path)
    ref = forward(stock, *inputs(seed=0))
    (out,) = comfy_nodes.KSampler().sample(stock, 3, 2, 1.0, "euler", "simple", conditioning(1), conditioning(2),
                                           latent())
    comfy.model_management.unload_all_models()
    return path, ref, out["samples"].clone()


def test_run_line_says_the_first_step_from_the_prompts_start(wan, caplog):
    path, _, want = wan
    prompt_clock.node_started()   # as the Model Loader's load does
    model = load_swapped_model(path, SwapSettings(2, 1, compress="off"), home="auto")
    time.sleep(0.3)               # the rest of the prompt before the sampler
    with caplog.at_level(logging.INFO, logger="ringswap"):
        (out,) = comfy_nodes.KSampler().sample(model, 3, 2, 1.0, "euler", "simple", conditioning(1),
                                               conditioning(2), latent())
    assert torch.equal(out["samples"], want)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap run:"))
    first = float(line.split("first step done ")[1].split(" s")[0])
    assert 0.3 <= first < 30, line
    assert "the first call computed as its blocks arrived" in line, line
    caplog.clear()
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="ringswap"):   # the next prompt: no node ran, its own clock
        comfy_nodes.KSampler().sample(model, 3, 2, 1.0, "euler", "simple", conditioning(1), conditioning(2), latent())
    took = time.perf_counter() - t0
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap run:"))
    # counted from within this prompt (not from the first one's node, 0.3 s and a prompt earlier)
    assert float(line.split("first step done ")[1].split(" s")[0]) <= took + 0.01 and "first call" not in line, line
    comfy.model_management.unload_all_models()


def test_file_truncated_before_the_first_call_is_a_clear_error_and_nothing_stays(wan, tmp_path):
    path0, ref, _ = wan
    path = os.path.join(tmp_path, "copy.safetensors")
    with open(path0, "rb") as f:
        raw = f.read()
    with open(path, "wb") as f:
        f.write(raw)
    model = load_swapped_model(path, SwapSettings(2, 1, compress="off"), home="auto")   # reads nothing yet
    os.truncate(path, len(raw) // 2)
    with pytest.raises(OSError) as err:
        forward(model, *inputs(seed=0))
    assert isinstance(err.value, FileChangedError) and path in str(err.value) and "truncated" in str(err.value)
    engine = model.swap_engine
    assert not engine.attached and not blocks_on_device(engine) and not engine.pool.filling
    with open(path, "r+b") as f:
        f.write(raw)
    comfy.model_management.unload_all_models()
    fresh = load_swapped_model(path, SwapSettings(2, 1, compress="off"), home="auto")
    assert torch.equal(forward(fresh, *inputs(seed=0)), ref)
    comfy.model_management.unload_all_models()


@pytest.mark.parametrize("home", ["auto", "ram"])
@pytest.mark.parametrize("compress", ["off", "auto"])
def test_first_call_equals_the_stock_loader_at_every_window(wan, home, compress):
    """Windows 1 to all, prefetch 0-2: a fresh load's first call (its blocks arriving) and the call
    after equal ComfyUI's own loader, bit for bit."""
    path, ref, _ = wan
    for window in (1, 2, BLOCKS):
        for prefetch in (0, 1, 2):
            model = load_swapped_model(path, SwapSettings(window, prefetch, compress=compress), home=home)
            assert torch.equal(forward(model, *inputs(seed=0)), ref), (home, compress, window, prefetch)
            assert torch.equal(forward(model, *inputs(seed=0)), ref), (home, compress, window, prefetch)
            assert not model.swap_engine.loading
            comfy.model_management.unload_all_models()
            del model
