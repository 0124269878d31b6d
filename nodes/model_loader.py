"""RingSwap Model Loader: a diffusion model whose blocks stream from RAM or from the file."""
from __future__ import annotations

import folder_paths

from ..swap.coding_choice import COMPRESS_MODES
from ..loaders.comfyui_adapter.gguf_file import model_names
from ..loaders.comfyui_adapter.live_feed import progress_bar
from ..loaders.comfyui_adapter.load_swapped import cached_swapped_base
from ..loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ..loaders.model_file.range_reader import file_identity
from ..swap import PIN_MODES
from .patch import BUDGET_TIP, COMPRESS_TIP, PIN_TIP, PREFETCH_TIP, WINDOW_TIP

HOME_TIP = ("Where blocks that are not on the GPU live. auto: the blocks that stream every step get RAM "
            "first (as much as ram_budget_gb or the free RAM allows), the rest is read from the file each "
            "step; blocks kept on the GPU hold no RAM; the plan line says the split. ram: the whole model "
            "is read once into (pinned) host RAM at load. disk: every streamed block is read from the file "
            "ahead of need on every step; host RAM stays at a few blocks, speed is bound by the disk.")
RAM_BUDGET_TIP = ("home=auto: host RAM (GB) this model's streamed blocks may hold. 0 = automatic: the RAM "
                  "available when sampling starts, less a margin of 10% of it (at least 2 GB) and what ComfyUI "
                  "keeps for its RAM cache.")
WORKERS_TIP = ("Reader threads for the file (positioned reads, one file handle each). More helps on NVMe; "
               "a disk that reads slower with parallel streams (HDD, some network/virtual disks) may do "
               "better with 1-2. With home=disk, host RAM for blocks is about this many blocks.")


class RingSwapModelLoader:
    CATEGORY = "RingSwap"
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    DESCRIPTION = ("Loads a diffusion model (Wan first) from diffusion_models for block swapping: only "
                   "`window` blocks live on the GPU, the others stream from RAM or straight from the file.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "unet_name": (model_names(),
                          {"tooltip": "A .safetensors diffusion model (bf16, fp16, fp32, fp8, scaled fp8), or a "
                                      ".gguf one (read with the ComfyUI-GGUF pack's loader, which must be "
                                      "installed)."}),
            "window": ("INT", {"default": 0, "min": 0, "max": 1000, "tooltip": WINDOW_TIP}),
            "prefetch": ("INT", {"default": 1, "min": 0, "max": 8, "tooltip": PREFETCH_TIP}),
            "home": (["auto", "ram", "disk"], {"default": "auto", "tooltip": HOME_TIP}),
            "pin_memory": (list(PIN_MODES), {"default": "auto", "tooltip": PIN_TIP}),
            "disk_workers": ("INT", {"default": 4, "min": 1, "max": 16, "tooltip": WORKERS_TIP}),
        }, "optional": {   # optional: API workflows saved before it existed keep validating
            "vram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1024.0, "step": 0.5,
                                         "tooltip": BUDGET_TIP}),
            "ram_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 4096.0, "step": 1.0,
                                        "tooltip": RAM_BUDGET_TIP}),
            "compress": (list(COMPRESS_MODES), {"default": "auto", "tooltip": COMPRESS_TIP}),
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
        path = folder_paths.get_full_path_or_raise("diffusion_models", unet_name)
        settings = SwapSettings(window, prefetch, pin_memory, vram_budget_gb, ram_budget_gb, compress)
        base = cached_swapped_base(path, home, disk_workers, progress=progress_bar())
        return (SwapModelPatcher.wrap(base, settings, node=unique_id),)
