"""RingSwap Patch: turn on block swapping for any MODEL (e.g. from Load Diffusion Model)."""
from __future__ import annotations

from ..swap.coding_choice import COMPRESS_MODES
from ..loaders.comfyui_adapter.live_feed import progress_bar
from ..loaders.comfyui_adapter.load_swapped import own_model_for
from ..loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ..swap import PIN_MODES

WINDOW_TIP = ("Transformer blocks kept on the GPU. window-1 blocks stay resident for the whole run; the "
              "others stream through a small ring of GPU slots. 0 = automatic: as many as fit beside this "
              "run's activations in the free VRAM (or vram_budget_gb), planned again every run; the log's "
              "'RingSwap plan:' line says why. Values above the model's block count are clamped.")
PREFETCH_TIP = ("Blocks copied ahead of the one computing (extra GPU slots). 1 hides copies under "
                "compute on most cards; 0 uses the least VRAM.")
BUDGET_TIP = ("VRAM in GB this model may use in all (its weights on the GPU and the activations of a step), "
              "for keeping the rest of the card for other programs. 0 = whatever is free (after ComfyUI's "
              "--reserve-vram). With window 0 the window is sized to fit; a set window is kept.")
COMPRESS_TIP = ("Keep the blocks that stream from RAM losslessly compressed (bf16/fp16: their sign-and-exponent "
                "bytes coded with NVIDIA nvCOMP's ANS, about 0.7 x the bytes): less RAM and fewer bytes over the "
                "link, decoded on the GPU, bit-identical output. auto: when nvCOMP and CUDA are there and RAM is "
                "short (the plan line says; not yet for runs that are only copy-bound); on: always (an error "
                "without nvCOMP: pip install nvidia-nvcomp-cu13, or -cu12 for a CUDA 12 torch); off: never.")
PIN_TIP = ("Page-lock the host copies of streamed blocks for fast async copies. auto: pin, and fall back "
           "to pageable memory + a pinned staging ring if pinning fails; on: pin or fail; off: never pin "
           "(slow copies, for systems where pinning misbehaves).")


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
            "window": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip": WINDOW_TIP}),
            "prefetch": ("INT", {"default": 1, "min": 0, "max": 8, "tooltip": PREFETCH_TIP}),
            "pin_memory": (list(PIN_MODES), {"default": "auto", "tooltip": PIN_TIP}),
        }, "optional": {   # optional: API workflows saved before it existed keep validating
            "vram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5,
                                         "tooltip": BUDGET_TIP}),
            "compress": (list(COMPRESS_MODES), {"default": "auto", "tooltip": COMPRESS_TIP}),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    def patch(self, model, window: int, prefetch: int, pin_memory: str, vram_budget_gb: float = 0.0,
              compress: str = "auto", unique_id=None):
        settings = SwapSettings(window, prefetch, pin_memory, vram_budget_gb, compress=compress)
        # A MODEL built for dynamic VRAM is cloned onto RingSwap's own load of its file.
        return (SwapModelPatcher.wrap(model, settings, onto=own_model_for(model, progress_bar()), node=unique_id),)
