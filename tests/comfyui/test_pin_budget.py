"""RingSwap's pinned memory counts in ComfyUI's own pin budget (comfy.model_management's
PINNED_MEMORY / TOTAL_PINNED_MEMORY, limited by MAX_PINNED_MEMORY: 40-45% of RAM on
Windows), and a spent budget falls back to the staging ring."""
import gc

import pytest
import torch

import comfy.model_management as mm

from ringswap.loaders.comfyui_adapter.comfy_memory import ComfyPinBudget
from ringswap.nodes.patch import RingSwapPatch
from ringswap.swap import host_pool
from wan_model import forward, inputs, load_stock, tiny_wan


def test_budget_is_comfyuis_and_is_installed():
    assert ComfyPinBudget.available()
    assert isinstance(host_pool._budget, ComfyPinBudget)


def test_reserve_counts_in_comfyui_and_refuses_over_its_limit(monkeypatch):
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", mm.TOTAL_PINNED_MEMORY + 10 * 4096)
    budget, start = ComfyPinBudget(), mm.TOTAL_PINNED_MEMORY
    assert budget.reserve(0x1000, 6 * 4096)
    assert mm.TOTAL_PINNED_MEMORY == start + 6 * 4096 and mm.PINNED_MEMORY[0x1000] == 6 * 4096
    assert not budget.reserve(0x2000, 6 * 4096), "over MAX_PINNED_MEMORY"
    assert 0x2000 not in mm.PINNED_MEMORY
    budget.release(0x1000)
    assert mm.TOTAL_PINNED_MEMORY == start and 0x1000 not in mm.PINNED_MEMORY
    budget.release(0x1000)   # twice: no change
    assert mm.TOTAL_PINNED_MEMORY == start


def test_no_pinning_where_comfyui_pins_nothing(monkeypatch):
    """--disable-pinned-memory (or a GPU ComfyUI does not pin for): MAX_PINNED_MEMORY <= 0."""
    monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", -1)
    assert not ComfyPinBudget().reserve(0x1000, 4096)


@pytest.mark.gpu
def test_pins_count_in_comfyui_and_a_spent_budget_falls_back_to_staging(tmp_path, monkeypatch):
    xi = inputs(seed=3, frames=3, size=16)
    start = mm.TOTAL_PINNED_MEMORY
    for seed, spent in ((0, False), (1, True)):
        stock = load_stock(tiny_wan(str(tmp_path), blocks=6, dim=256, ffn_dim=1024, dtype=torch.bfloat16, seed=seed))
        ref = forward(stock, *xi)
        mm.unload_all_models()
        if spent:
            monkeypatch.setattr(mm, "MAX_PINNED_MEMORY", mm.TOTAL_PINNED_MEMORY + 1)
        (model,) = RingSwapPatch().patch(stock, 2, 1, "auto")
        assert torch.equal(forward(model, *xi), ref)
        engine = model.swap_engine
        if spent:
            assert engine.memory == "staged" and engine.pool.pinned_bytes == 0
        else:
            assert engine.memory == "pinned" and engine.pool.pinned_bytes > 0
            assert mm.TOTAL_PINNED_MEMORY >= start + engine.pool.pinned_bytes, "counted in ComfyUI's total"
        mm.unload_all_models()
        del model, engine, stock
        gc.collect()
        assert mm.TOTAL_PINNED_MEMORY == start, "every pin given back with the model"
