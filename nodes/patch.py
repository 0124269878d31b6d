"""RingSwap Patch: turn on block swapping for any MODEL (e.g. from Load Diffusion Model)."""
from __future__ import annotations

from ..loaders.comfyui_adapter import prompt_clock
from ..loaders.comfyui_adapter.live_feed import progress_bar
from ..loaders.comfyui_adapter.load_swapped import own_model_for
from ..loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from .widgets import COMPRESS, PIN_MEMORY, PREFETCH, VRAM_BUDGET, WINDOW


class RingSwapPatch:
    CATEGORY = "RingSwap"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    DESCRIPTION = ("Block swapping for any diffusion transformer MODEL: keeps `window` blocks on the GPU "
                   "and streams the rest from host RAM while the GPU computes. Use with any stock sampler.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model to block-swap, e.g. from Load Diffusion Model."}),
            "window": WINDOW.input(),
            "prefetch": PREFETCH.input(),
            "pin_memory": PIN_MEMORY.input(),
        }, "optional": {   # optional: API workflows saved before it existed keep validating
            "vram_budget_gb": VRAM_BUDGET.input(),
            "compress": COMPRESS.input(),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def patch(self, model, window: int, prefetch: int, pin_memory: str, vram_budget_gb: float = 0.0,
              compress: str = "auto", unique_id=None):
        prompt_clock.node_started()
        settings = SwapSettings(window, prefetch, pin_memory, vram_budget_gb, compress=compress)
        # A MODEL built for dynamic VRAM is cloned onto RingSwap's own load of its file.
        return (SwapModelPatcher.wrap(model, settings, onto=own_model_for(model, progress_bar(), settings),
                                      node=unique_id),)
