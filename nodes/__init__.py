"""RingSwap's ComfyUI nodes: read widgets, call loaders/lora/swap, return MODEL."""
from .patch import RingSwapPatch

NODE_CLASS_MAPPINGS = {
    "RingSwapPatch": RingSwapPatch,
}

NODE_DISPLAY_NAME_MAPPINGS = {
    "RingSwapPatch": "RingSwap Patch (block swap any model)",
}
