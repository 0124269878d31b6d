"""ComfyUI-GGUF's GGMLTensor (a GGUF file's weights) as a packed tensor the engine moves: its
raw bytes travel and wait in RAM as they are in the file, and it is rebuilt around the landed
bytes with its quantization type and logical shape. The class is found by probing a model's
tensors: ComfyUI-GGUF is a custom node pack, imported under whatever name ComfyUI gave it."""
from __future__ import annotations

import itertools

import torch
from torch import nn

from ...swap.layout import codec_for, register_codec

CLASS_NAME = "GGMLTensor"


class GgmlCodec:
    fresh_join = True   # ComfyUI-GGUF hangs a forward's LoRA patches on the weight tensor itself

    def __init__(self, cls: type):
        self.cls = cls

    def split(self, t, name):
        return (t.tensor_type, t.tensor_shape), [(name, t.as_subclass(torch.Tensor))]

    def join(self, spec, parts):
        tensor_type, tensor_shape = spec
        return self.cls(parts[0], tensor_type=tensor_type, tensor_shape=tensor_shape)


def register_for(module: nn.Module) -> None:
    """Register the codec for the GGMLTensor class of `module`'s tensors, if it has any."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        cls = type(t)
        if cls.__name__ == CLASS_NAME and hasattr(t, "tensor_type") and codec_for(t) is None:
            register_codec(cls, GgmlCodec(cls))
