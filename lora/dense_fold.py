"""The fold of a packed weight that its layer can compute from in dense form (ComfyUI-GGUF's
quantized GGMLTensor): the landed weight is dequantized with the pack's own
`dequantize_tensor` into the dtype the model computes in (what the pack's layer does every
forward), patched with `comfy.lora.calculate_weight` as the pack patches it, and bound in its
place until the block's slot or buffer is refilled: once per landing instead of once per
forward of every layer. Plain LoRA pairs on CUDA are added with FoldOp's fused addmm_ (within
one rounding of the pack's math). The quantized bytes are never written."""
from __future__ import annotations

import math
import sys

import torch

import comfy.lora

from .checks import meta_tensors
from .fold_ops import FoldOp

PACKED_CLASS = "GGMLTensor"
WORKSPACE_FLOATS = 4   # float32 temporaries of one weight while it is dequantized and patched


def pack_module(t: torch.Tensor):
    """The module of the pack that defines `t`'s class (ComfyUI-GGUF's ops, imported under
    whatever name ComfyUI gave the pack); it holds the pack's dequantize functions."""
    return sys.modules.get(type(t).__module__)


def is_dense_packed(layout, attr) -> bool:
    """A GGMLTensor attribute whose bytes are quantized (the pack's `is_quantized`), not F32/F16."""
    if attr.codec is None:
        return False
    joined = attr.codec.join(attr.spec, meta_tensors(layout.entries, attr.entries))
    if type(joined).__name__ != PACKED_CLASS:
        return False
    pack = pack_module(joined)
    is_quantized = getattr(pack, "is_quantized", None)
    return is_quantized(joined) if callable(is_quantized) else True


def is_plain_packed(layout, attr) -> bool:
    """A GGMLTensor attribute holding plain F32/F16 values (patched in place, as the pack does)."""
    if attr.codec is None:
        return False
    joined = attr.codec.join(attr.spec, meta_tensors(layout.entries, attr.entries))
    return type(joined).__name__ == PACKED_CLASS and not is_dense_packed(layout, attr)


class DenseOp(FoldOp):
    """Dequantize, patch, and hand back the dense weight the block binds instead."""

    def __init__(self, key, patches, attr: int, layout, layer: torch.nn.Module, dtype: torch.dtype):
        super().__init__(key, patches)
        a = layout.attrs[attr]
        self.attr, self.codec, self.spec, self.entries = attr, a.codec, a.spec, a.entries
        self.dtype = dtype
        self.dequant_dtype = getattr(layer, "dequant_dtype", None)
        patch_dtype = getattr(layer, "patch_dtype", None)
        self.patch_dtype = dtype if patch_dtype == "target" else patch_dtype
        shape = self.codec.join(self.spec, meta_tensors(layout.entries, self.entries)).shape
        self.numel = math.prod(shape)
        self.nbytes = self.numel * torch.empty(0, dtype=dtype).element_size()

    def _patches_on(self, device: torch.device, pack) -> list:
        moved = self._on_device.get(("dense", device))
        if moved is None:
            moved = self._on_device[("dense", device)] = pack.move_patch_to_device(list(self.patches), device)
        return moved

    def __call__(self, tensors) -> torch.Tensor:
        t = self.codec.join(self.spec, [tensors[i] for i in self.entries])
        pack = pack_module(t)
        w = pack.dequantize_tensor(t, self.dtype, self.dequant_dtype)
        if type(w) is not torch.Tensor:
            w = w.as_subclass(torch.Tensor)
        if self.patch_dtype is None and self.fused(w):   # plain LoRA pairs on CUDA: one addmm_ each
            return self.add_delta(w)
        patches = self._patches_on(w.device, pack)
        if self.patch_dtype is None:
            return comfy.lora.calculate_weight(patches, w, self.key)
        return comfy.lora.calculate_weight(patches, w, self.key, self.patch_dtype)
