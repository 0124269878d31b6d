"""RingSwap LoRA and RingSwap LoRA Stack: LoRAs on a (block-swapped) MODEL.

The LoRA's patches go on the MODEL as ComfyUI's own LoRA loaders put them; on a RingSwap
MODEL each block gets its patches folded in on the GPU right after it lands, so the host
copy stays the original and a new strength needs no reload.
"""
from __future__ import annotations

import folder_paths

from ..lora.apply import LoraFileCache, apply_lora
from .widgets import LORA_MODEL_TIP, LORA_NAME_TIP, LORA_ON_TIP, STRENGTH

STACK_ROWS = 4


class RingSwapLoRA:
    CATEGORY = "RingSwap"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model with the LoRA applied (chain several of these for several LoRAs).",)
    FUNCTION = "apply"
    DESCRIPTION = ("Applies a LoRA to a diffusion model. On a RingSwap model each transformer block gets the LoRA "
                   "folded in on the GPU right after it is copied there (bf16/fp16/fp32, fp8 and nvfp4 weights); "
                   "the copy in RAM or on disk stays unchanged. Chainable.")

    def __init__(self):
        self.files = LoraFileCache(size=1)

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": LORA_MODEL_TIP}),
            "lora_name": (folder_paths.get_filename_list("loras"), {"tooltip": LORA_NAME_TIP}),
            "strength_model": STRENGTH.input(),
        }}

    def apply(self, model, lora_name: str, strength_model: float):
        if strength_model == 0:
            return (model,)
        path = folder_paths.get_full_path_or_raise("loras", lora_name)
        return (apply_lora(model, self.files.get(path), strength_model, lora_name),)


class RingSwapLoRAStack:
    CATEGORY = "RingSwap"
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("The model with every enabled LoRA applied, top row first.",)
    FUNCTION = "apply"
    DESCRIPTION = (f"Applies up to {STACK_ROWS} LoRAs to a diffusion model in one node, each with an on/off switch "
                   "and its own strength (same as chaining RingSwap LoRA nodes).")

    def __init__(self):
        self.files = LoraFileCache(size=STACK_ROWS)

    @classmethod
    def INPUT_TYPES(cls):
        names = ["None"] + folder_paths.get_filename_list("loras")
        required = {"model": ("MODEL", {"tooltip": LORA_MODEL_TIP})}
        for i in range(1, STACK_ROWS + 1):
            required[f"lora_{i}_on"] = ("BOOLEAN", {"default": True, "tooltip": f"LoRA {i}: " + LORA_ON_TIP})
            required[f"lora_{i}_name"] = (names, {"default": "None", "tooltip": f"LoRA {i}: " + LORA_NAME_TIP +
                                                  " None = no LoRA in this row."})
            required[f"lora_{i}_strength"] = STRENGTH.input(tooltip=f"LoRA {i}: " + STRENGTH.tooltip)
        return {"required": required}

    def apply(self, model, **rows):
        for i in range(1, STACK_ROWS + 1):
            on = rows.get(f"lora_{i}_on", True)
            name = rows.get(f"lora_{i}_name", "None")
            strength = rows.get(f"lora_{i}_strength", 1.0)
            if not on or not name or name == "None" or strength == 0:
                continue
            path = folder_paths.get_full_path_or_raise("loras", name)
            model = apply_lora(model, self.files.get(path), strength, name)
        return (model,)
