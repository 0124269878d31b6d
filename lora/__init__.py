"""LoRA for block-swapped models: ComfyUI's patches folded into each block on the device."""
