"""ComfyUI's memory picture as RingSwap reads it: free and reserved VRAM, host RAM available
and what ComfyUI keeps of it, its pin budget, its activation estimates, and the free-memory
question its batching asks. Where ComfyUI versions differ, comfy_features says which way to go.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

import comfy.cli_args
import comfy.model_management
import comfy.model_patcher

from . import comfy_features as features

CPU = torch.device("cpu")


# ----- pinned memory ------------------------------------------------------------------------
class ComfyPinBudget:
    """RingSwap's page-locked bytes counted in ComfyUI's own pin accounting
    (`PINNED_MEMORY`, `TOTAL_PINNED_MEMORY`) and held to its limit (`MAX_PINNED_MEMORY`),
    asking ComfyUI to free other pins first where it can."""

    def __init__(self, mm=comfy.model_management):
        self.mm = mm

    @staticmethod
    def available() -> bool:
        """Does this ComfyUI keep a pin budget to count in?"""
        return features.PIN_BUDGET

    def reserve(self, ptr: int, nbytes: int) -> bool:
        mm = self.mm
        if mm.MAX_PINNED_MEMORY <= 0:   # ComfyUI pins nothing here (--disable-pinned-memory, no NVIDIA/AMD)
            return False
        if mm.TOTAL_PINNED_MEMORY + nbytes > mm.MAX_PINNED_MEMORY and features.ENSURES_PIN_ROOM:
            mm.ensure_pin_registerable(nbytes)
        if mm.TOTAL_PINNED_MEMORY + nbytes > mm.MAX_PINNED_MEMORY:
            return False
        mm.PINNED_MEMORY[ptr] = nbytes
        mm.TOTAL_PINNED_MEMORY += nbytes
        return True

    def release(self, ptr: int) -> None:
        nbytes = self.mm.PINNED_MEMORY.pop(ptr, None)
        if nbytes is not None:
            self.mm.TOTAL_PINNED_MEMORY -= nbytes


# ----- host RAM (home=auto) -----------------------------------------------------------------
def ram_available() -> int:
    """Host RAM available now, as ComfyUI counts it: its cgroup-aware `comfy.system_memory`
    where it has one (newer ComfyUI), else its CPU free memory (psutil's available)."""
    if features.COUNTS_CGROUP_RAM:
        return int(features.system_memory.virtual_memory_available())
    return int(comfy.model_management.get_free_memory(CPU))


def ram_total() -> int:
    return int(comfy.model_management.get_total_memory(CPU))


def ram_kept_by_comfy() -> int:
    """RAM ComfyUI keeps available for itself: the RAM cache's headroom while a prompt runs
    (`comfy.memory_management.RAM_CACHE_HEADROOM`, 0.33 and later), else what --cache-ram
    asks for (0.33+: default min(10, max(2, 10% of RAM)) GB unless another cache is chosen;
    0.3.75: only when given)."""
    if features.HAS_RAM_CACHE_HEADROOM:
        headroom = int(features.memory_management.RAM_CACHE_HEADROOM or 0)
        if headroom > 0:
            return headroom
    args = comfy.cli_args.args
    cache_ram = getattr(args, "cache_ram", None)
    if isinstance(cache_ram, list):
        if getattr(args, "cache_classic", False) or getattr(args, "cache_none", False) \
                or (getattr(args, "cache_lru", 0) or 0) > 0:
            return 0
        gb = cache_ram[0] if cache_ram else min(10.0, max(2.0, ram_total() / 2**30 * 0.10))
        return int(gb * 2**30)
    return int(cache_ram * 2**30) if isinstance(cache_ram, (int, float)) and cache_ram > 0 else 0


# ----- VRAM ---------------------------------------------------------------------------------
def free_vram(device: torch.device) -> int:
    """Device memory free now, as ComfyUI counts it (its own and torch's caches included)."""
    return int(comfy.model_management.get_free_memory(device))


def reserved_vram(activations_measured: bool = False) -> int:
    """What ComfyUI keeps free beside a model's weights: its inference minimum, which holds
    --reserve-vram (`minimum_inference_memory`, else `extra_reserved_memory`). Once the
    activation peak is measured (what the allocator reserved, fragmentation included) the
    inference minimum's margin for activations is counted already: then only the reserve
    for others (`extra_reserved_memory`: the OS share and --reserve-vram)."""
    mm = comfy.model_management
    names = ("minimum_inference_memory", "extra_reserved_memory")
    for name in (names[::-1] if activations_measured else names):
        fn = getattr(mm, name, None)
        if fn is not None:
            return int(fn())
    return 0


# ----- activations and batching -------------------------------------------------------------
ESTIMATE_CONDS = 2   # conds a step that sampler_helpers.estimate_memory's first figure is for (cond + uncond)
BATCH_MARGIN = 1.5   # calc_cond_batch batches while memory_required(batched) * 1.5 < the free memory


def activation_estimates(patcher, noise_shape, conds) -> tuple[int, int]:
    """ComfyUI's estimates of one model call's activations: (one cond at batch
    `noise_shape[0]`, ESTIMATE_CONDS conds batched), from `sampler_helpers.estimate_memory`
    (the first is what its partial load reserves)."""
    import comfy.sampler_helpers
    estimate = getattr(comfy.sampler_helpers, "estimate_memory", None)
    if estimate is not None:
        batched, single = estimate(patcher, noise_shape, conds)
        return int(single), int(batched)
    shape = list(noise_shape)
    return (int(patcher.model.memory_required(shape)),
            int(patcher.model.memory_required([shape[0] * ESTIMATE_CONDS] + shape[1:])))


class _FreeMemoryFromPatcher:
    """comfy.model_management as comfy.samplers sees it inside one calc_cond_batch on a
    ComfyUI whose batching asks `model_management.get_free_memory` (0.3.75): that one
    question goes to the sampled patcher's `get_free_memory`, all else to the module."""

    def __init__(self, module, patcher):
        self._module, self._patcher = module, patcher

    def __getattr__(self, name):
        return getattr(self._module, name)

    def get_free_memory(self, dev=None, torch_free_too=False):
        if torch_free_too or dev is None:
            return self._module.get_free_memory(dev, torch_free_too)
        return self._patcher.get_free_memory(dev)


@contextlib.contextmanager
def batching_asks(patcher) -> Iterator[None]:
    """Within one calc_cond_batch, have ComfyUI's batching ask `patcher.get_free_memory`:
    it does by itself where PATCHER_ANSWERS_BATCHING; before that, comfy.samplers' own
    reference to model_management is swapped for the call (the only use of it there)."""
    import comfy.samplers
    module = getattr(comfy.samplers, "model_management", None)
    if features.PATCHER_ANSWERS_BATCHING or module is None or not hasattr(module, "get_free_memory"):
        yield
        return
    comfy.samplers.model_management = _FreeMemoryFromPatcher(module, patcher)
    try:
        yield
    finally:
        comfy.samplers.model_management = module


def patcher_free_memory(patcher, device: torch.device) -> int:
    """What ComfyUI's own patcher class would answer to get_free_memory (0.33: free memory
    plus what dynamic VRAM could evict), else the device's free memory."""
    if features.PATCHER_ANSWERS_BATCHING:
        return int(comfy.model_patcher.ModelPatcher.get_free_memory(patcher, device))
    return free_vram(device)
