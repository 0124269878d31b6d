"""RingSwap Model Loader: a diffusion model whose blocks stream from RAM or from the file."""
from __future__ import annotations

import folder_paths

from ..loaders.comfyui_adapter.gguf_file import model_names
from ..loaders.comfyui_adapter import prompt_clock
from ..loaders.comfyui_adapter.live_feed import progress_bar
from ..loaders.comfyui_adapter.load_swapped import cached_swapped_base
from ..loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ..loaders.model_file.range_reader import file_identity
from .widgets import (COMPRESS, DISK_WORKERS, HOME, PIN_MEMORY, PREFETCH, RAM_BUDGET, UNET_NAME_TIP, VRAM_BUDGET,
                      WINDOW)


class RingSwapModelLoader:
    CATEGORY = "RingSwap"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    DESCRIPTION = ("Loads a diffusion model (Wan first) from diffusion_models for block swapping: only "
                   "`window` blocks live on the GPU, the others stream from RAM or straight from the file.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "unet_name": (model_names(), {"tooltip": UNET_NAME_TIP}),
            "window": WINDOW.input(),
            "prefetch": PREFETCH.input(),
            "home": HOME.input(),
            "pin_memory": PIN_MEMORY.input(),
            "disk_workers": DISK_WORKERS.input(),
        }, "optional": {   # optional: API workflows saved before it existed keep validating
            "vram_budget_gb": VRAM_BUDGET.input(),
            "ram_budget_gb": RAM_BUDGET.input(),
            "compress": COMPRESS.input(),
        }, "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def IS_CHANGED(cls, unet_name: str, **_inputs) -> str:
        """The file's identity: a file changed on disk is loaded again on the next prompt (the
        model loaded before refuses to read blocks from it)."""
        path = folder_paths.get_full_path("diffusion_models", unet_name)
        try:
            return "%d:%d:%d" % file_identity(path) if path else ""
        except OSError:
            return ""   # load() names the problem

    def load(self, unet_name: str, window: int, prefetch: int, home: str, pin_memory: str, disk_workers: int,
             vram_budget_gb: float = 0.0, ram_budget_gb: float = 0.0, compress: str = "auto", unique_id=None):
        prompt_clock.node_started()
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        settings = SwapSettings(window, prefetch, pin_memory, vram_budget_gb, ram_budget_gb, compress)
        base = cached_swapped_base(path, home, disk_workers, progress=progress_bar(), settings=settings)
        return (SwapModelPatcher.wrap(base, settings, node=unique_id),)
