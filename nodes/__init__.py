"""RingSwap's ComfyUI nodes: read widgets, call loaders/comfyui_adapter/lora/swap, return MODEL."""
from .model_loader import RingSwapModelLoader
from .lora import RingSwapLoRA, RingSwapLoRAStack
from .patch import RingSwapPatch

NODE_CLASS_MAPPINGS = {
    "RingSwapPatch": RingSwapPatch,
    "RingSwapModelLoader": RingSwapModelLoader,
    "RingSwapLoRA": RingSwapLoRA,
    "RingSwapLoRAStack": RingSwapLoRAStack,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "RingSwapPatch": "RingSwap Patch (block swap any model)",
    "RingSwapModelLoader": "RingSwap Model Loader",
    "RingSwapLoRA": "RingSwap LoRA",
    "RingSwapLoRAStack": "RingSwap LoRA Stack",
}
