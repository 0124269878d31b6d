"""On CUDA (the GPU machine): bit-exact swapping with pinned memory, and a VRAM bound."""
import pytest
import torch

import comfy.model_management

from ringswap.nodes.patch import RingSwapPatch
from wan_model import forward, inputs, static_twin

pytestmark = pytest.mark.gpu
BLOCKS = 8


def patched(model, window, prefetch, pin="auto"):
    (m,) = RingSwapPatch().patch(model, window, prefetch, pin)
    return m


def test_bit_exact_on_cuda_pinned(wan512_stock):
    x = [inputs(seed=s, frames=3, size=16) for s in range(2)]
    ref = [forward(wan512_stock, *xi) for xi in x]
    comfy.model_management.unload_all_models()
    for pin, memory in (("auto", "pinned"), ("off", "pageable")):
        for prefetch in (1, 2):
            for window in (1, 2, 3, BLOCKS // 2, BLOCKS - prefetch - 1):
                model = patched(wan512_stock, window, prefetch, pin)
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


def test_staged_fallback_is_bit_exact(wan512_stock):
    """Pageable home + pinned staging ring (what `auto` falls back to when pinning fails)."""
    xi = inputs(seed=5, frames=3, size=16)
    ref = forward(wan512_stock, *xi)
    comfy.model_management.unload_all_models()
    model = patched(wan512_stock, 2, 1)
    engine = model.swap_engine
    engine.pool.pin = lambda indices: False      # the OS refuses to page-lock memory
    try:
        for _ in range(3):
            assert torch.equal(forward(model, *xi), ref)
        assert engine.memory == "staged"
    finally:
        del engine.pool.pin
        comfy.model_management.unload_all_models()


def test_peak_vram_bound(wan512_stock):
    dev = comfy.model_management.get_torch_device()
    xi = inputs(seed=7, frames=5, size=32)
    comfy.model_management.unload_all_models()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(dev)

    resident = static_twin(wan512_stock)   # torch's allocator does not see dynamic VRAM's buffers
    forward(resident, *xi)          # warm-up, then measure the resident run
    torch.cuda.reset_peak_memory_stats(dev)
    forward(resident, *xi)
    resident_peak = torch.cuda.max_memory_allocated(dev) - base
    del resident
    engine_probe = patched(wan512_stock, 2, 1).swap_engine
    all_weights = engine_probe.total_block_bytes()
    comfy.model_management.unload_all_models()
    torch.cuda.synchronize()

    model = patched(wan512_stock, 2, 1)
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
