"""The file side of loaders/: safetensors headers, positioned block reads, per-block file ranges
and quantized-weight codecs (torch and safetensors; ComfyUI only for its tensor classes)."""
