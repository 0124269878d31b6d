"""Getting models into ComfyUI for block swapping (ComfyUI-facing; the engine is swap/)."""
