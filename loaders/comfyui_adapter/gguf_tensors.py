"""ComfyUI-GGUF's GGMLTensor (a GGUF file's weights) as a packed tensor the engine moves: its
raw bytes travel and wait in RAM as they are in the file, and it is rebuilt around the landed
bytes with its quantization type and logical shape. The class is found by probing a model's
tensors: ComfyUI-GGUF is a custom node pack, imported under whatever name ComfyUI gave it.
Quantized weights outside the blocks get their LoRA patches as the pack's own patcher hangs
them (applied at each forward by its layers), since RingSwap's patcher is not the pack's."""
from __future__ import annotations

import functools
import inspect
import itertools
import sys

import torch
from torch import nn

import comfy.utils

from ...swap.layout import codec_for, register_codec

CLASS_NAME = "GGMLTensor"


@functools.cache
def _copies_a_list(fn) -> bool:
    """Does the pack's dequantize function `fn` build a device tensor from a Python list (a
    blocking copy)? Without source to read: no (the pack's own way stays)."""
    try:
        return "torch.tensor(" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


class GgmlCodec:
    """Also the dense-form interface a LoRA fold uses (swap.layout.TensorCodec's optional
    `quantized` / `dequantize`): the pack's own `is_quantized` and `dequantize_tensor`."""
    fresh_join = True   # ComfyUI-GGUF hangs a forward's LoRA patches on the weight tensor itself

    def __init__(self, cls: type):
        self.cls = cls
        self.pack = sys.modules.get(cls.__module__)   # the pack's ops module, under ComfyUI's name for it
        self.dequant = sys.modules.get(self.pack.dequantize_tensor.__module__)   # its dequant module

    def quantized(self, spec) -> bool:
        """Whether a tensor of this spec holds quantized bytes (F32/F16 hold plain values)."""
        return bool(self.pack.is_quantized(self.join(spec, [torch.empty(0, dtype=torch.uint8)])))

    def type_name(self, spec) -> str:
        """The GGML quantization type's name ("Q8_0", "Q4_K", "F16", ...)."""
        return getattr(spec[0], "name", str(spec[0]))

    def dense_on_land(self, spec) -> bool:
        """Whether this type's weights are better made dense when their block lands, with or
        without a LoRA: the pack's dequantize of the type builds a small table on the device from
        a Python list (`torch.tensor(..., device=)`, a blocking copy), which in a layer's forward
        makes the host wait for all the compute queued before it, at every weight. Probed in the
        installed pack's code (Q4_0/Q5_0/K-quants: yes; Q8_0, BF16: no)."""
        fn = self.dequant.dequantize_functions.get(spec[0])
        return fn is not None and self.quantized(spec) and _copies_a_list(fn)

    def dequantize(self, spec, parts, dtype: torch.dtype, dequant_dtype=None) -> torch.Tensor:
        """The dense weight of the packed one, as the pack's layer computes it each forward
        (`dequantize_tensor`'s steps for a quantized type, on the plain bytes: the same
        kernels without a tensor subclass's overhead on each of the many small ops)."""
        tensor_type, tensor_shape = spec
        if tensor_type in self.dequant.dequantize_functions:
            dequant_dtype = dtype if dequant_dtype == "target" else dequant_dtype
            return self.dequant.dequantize(parts[0], tensor_type, tensor_shape, dtype=dequant_dtype).to(dtype)
        w = self.pack.dequantize_tensor(self.join(spec, parts), dtype, dequant_dtype)
        return w if type(w) is torch.Tensor else w.as_subclass(torch.Tensor)

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


def hang_patches(patcher, key: str, device_to, inplace_update: bool) -> bool:
    """ComfyUI-GGUF's GGUFModelPatcher.patch_weight_to_device for a quantized weight: the
    weight moves to `device_to` carrying its patches, which the pack's layer applies when it
    dequantizes. False (nothing done) for any other weight."""
    weight = comfy.utils.get_attr(patcher.model, key)
    codec = codec_for(weight)
    if not isinstance(codec, GgmlCodec) or not codec.pack.is_quantized(weight):
        return False
    out = weight.to(device_to)
    out.patches = [(codec.pack.move_patch_to_device(patcher.patches[key], patcher.offload_device), key)]
    if inplace_update:
        comfy.utils.copy_to_param(patcher.model, key, out)
    else:
        comfy.utils.set_attr_param(patcher.model, key, out)
    return True


def holds_ggml(model: nn.Module) -> bool:
    """Does `model` hold any of the pack's GGMLTensors (a GGUF MODEL)?"""
    return any(type(p).__name__ == CLASS_NAME for p in model.parameters())


def drop_patches(model: nn.Module) -> None:
    """Take the hung patches off every GGMLTensor (as the pack's unpatch_model does)."""
    for p in model.parameters():
        if type(p).__name__ == CLASS_NAME and getattr(p, "patches", None):
            p.patches = []
