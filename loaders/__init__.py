"""Getting models into ComfyUI for block swapping, in two rooms: `model_file/` the file side
(safetensors headers, positioned reads, per-block file ranges, quantized-weight codecs) and
`comfyui_adapter/` the ComfyUI side (the model skeleton, the ModelPatcher subclass, run plans,
version probes, the live feed). The engine is swap/."""
