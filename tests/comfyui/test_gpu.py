"""On CUDA (the GPU machine): bit-exact swapping with pinned memory, and a VRAM bound."""
import pytest
import torch

import comfy.model_management

from ringswap.nodes.patch import RingSwapPatch
from wan_model import forward, inputs, load_stock, static_twin, tiny_wan

pytestmark = pytest.mark.gpu
BLOCKS = 8


@pytest.fixture(scope="module")
def wan_file(tmp_path_factory):
    return tiny_wan(str(tmp_path_factory.mktemp("wan")), blocks=BLOCKS, dim=512, ffn_dim=2048, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def stock(wan_file):
    return load_stock(wan_file)


def patched(model, window, prefetch, pin="auto"):
    (m,) = RingSwapPatch().patch(model, window, prefetch, pin)
    return m


def test_bit_exact_on_cuda_pinned(stock):
    x = [inputs(seed=s, frames=3, size=16) for s in range(2)]
    ref = [forward(stock, *xi) for xi in x]
    comfy.model_management.unload_all_models()
    for pin, memory in (("auto", "pinned"), ("off", "pageable")):
        for prefetch in (1, 2):
            for window in (1, 2, 3, BLOCKS // 2, BLOCKS - prefetch - 1):
                model = patched(stock, window, prefetch, pin)
                for _ in range(2):
                    for k, xi in enumerate(x):
                        out = forward(model, *xi)
                        assert torch.equal(out, ref[k]), (pin, window, prefetch, k)
                assert model.swap_engine.memory == memory
                stats = model.swap_engine.end_run()
                # one attachment for all four calls: the blocks stay between loads of the same MODEL
                assert stats.forwards == 2 * len(x) * len(model.swap_engine.plan.streamed) > 0
                assert stats.bytes_copied > 0 and stats.copy_s > 0
                comfy.model_management.unload_all_models()


def test_staged_fallback_is_bit_exact(stock):
    """Pageable home + pinned staging ring (what `auto` falls back to when pinning fails)."""
    xi = inputs(seed=5, frames=3, size=16)
    ref = forward(stock, *xi)
    comfy.model_management.unload_all_models()
    model = patched(stock, 2, 1)
    engine = model.swap_engine
    engine.pool.pin = lambda indices: False      # the OS refuses to page-lock memory
    try:
        for _ in range(3):
            assert torch.equal(forward(model, *xi), ref)
        assert engine.memory == "staged"
    finally:
        del engine.pool.pin
        comfy.model_management.unload_all_models()


def test_peak_vram_bound(stock):
    dev = comfy.model_management.get_torch_device()
    xi = inputs(seed=7, frames=5, size=32)
    comfy.model_management.unload_all_models()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)

    resident = static_twin(stock)   # torch's allocator does not see dynamic VRAM's buffers
    forward(resident, *xi)          # warm-up, then measure the resident run
    torch.cuda.reset_peak_memory_stats(dev)
    forward(resident, *xi)
    resident_peak = torch.cuda.max_memory_allocated(dev) - base
    del resident
    engine_probe = patched(stock, 2, 1).swap_engine
    all_weights = engine_probe.total_block_bytes()
    comfy.model_management.unload_all_models()
    torch.cuda.synchronize()

    model = patched(stock, 2, 1)
    forward(model, *xi)
    torch.cuda.reset_peak_memory_stats(dev)
    forward(model, *xi)
    swapped_peak = torch.cuda.max_memory_allocated(dev) - base
    engine = model.swap_engine
    nonblock = model.swap_state.nonblock_bytes
    activations = resident_peak - all_weights - nonblock
    bound = nonblock + (2 + 1) * engine.block_bytes() + activations
    assert swapped_peak <= 1.1 * bound, (swapped_peak, bound, resident_peak)
    assert swapped_peak < resident_peak


def test_compressed_homes_are_bit_exact_on_cuda(stock, wan_file, caplog):
    """compress=on with nvCOMP (RingSwap Model Loader, homes ram and auto): the streamed blocks'
    homes are coded, each landing decoded on the GPU; outputs bit-identical to the stock model at
    every window and prefetch; the plan line gives the ratio and the GB saved."""
    from ringswap.loaders.comfyui_adapter import compress_choice
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    if compress_choice.nvcomp_missing():
        pytest.skip("needs nvCOMP (scripts/prepare_nvcomp_wheels.sh)")
    x = [inputs(seed=s, frames=3, size=16) for s in range(2)]
    ref = [forward(stock, *xi) for xi in x]
    comfy.model_management.unload_all_models()
    for home in ("ram", "auto"):
        for prefetch in (0, 1, 2):
            for window in (1, 3, BLOCKS - prefetch - 1):
                model = load_swapped_model(wan_file, SwapSettings(window, prefetch, compress="on"), home=home)
                with caplog.at_level("INFO", logger="ringswap.patcher"):
                    for _ in range(2):
                        for k, xi in enumerate(x):
                            assert torch.equal(forward(model, *xi), ref[k]), (home, window, prefetch, k)
                engine = model.swap_engine
                assert set(engine.plan.streamed) <= set(engine.pool.coded) and engine.memory == "pinned"
                assert "compress on: " in caplog.text and "blocks coded to 0." in caplog.text
                comfy.model_management.unload_all_models()


def test_compress_widens_home_autos_ram_split_on_the_first_load(stock, wan_file, caplog):
    """home=auto with a RAM budget that holds only part of the streamed blocks raw: once the first
    ones are coded, the load gives RAM homes to more of them (counted at their coded size);
    outputs stay bit-identical to the stock model."""
    from ringswap.loaders.comfyui_adapter import compress_choice, ram_room
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    if compress_choice.nvcomp_missing():
        pytest.skip("needs nvCOMP (scripts/prepare_nvcomp_wheels.sh)")
    xi = inputs(seed=3, frames=3, size=16)
    ref = forward(stock, *xi)
    comfy.model_management.unload_all_models()
    sizing = load_swapped_model(wan_file, SwapSettings(2, 1, compress="off"), home="auto")
    staging = sizing.swap_engine.read_buffers   # the read-ahead's buffers, counted where blocks stream from the file
    budget = (staging + 2) * sizing.swap_engine.states[0].layout.nbytes / 1e9   # 2 of 7 streamed blocks raw
    del sizing
    raw_only = load_swapped_model(wan_file, SwapSettings(2, 1, ram_budget_gb=budget, compress="off"), home="auto")
    assert torch.equal(forward(raw_only, *xi), ref)
    raw_split = ram_room.split_for(raw_only.swap_engine, raw_only.swap_engine.plan, budget)
    comfy.model_management.unload_all_models()
    model = load_swapped_model(wan_file, SwapSettings(2, 1, ram_budget_gb=budget, compress="on"), home="auto")
    assert torch.equal(forward(model, *xi), ref)
    engine = model.swap_engine
    assert raw_split.file_blocks and len(engine.att.ram_homes) > len(raw_split.ram_blocks)
    assert set(engine.att.ram_homes) <= set(engine.pool.coded)
    comfy.model_management.unload_all_models()
