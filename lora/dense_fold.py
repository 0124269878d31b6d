"""The fold of a packed weight that its layer computes from in a dense form (ComfyUI-GGUF's
quantized weights; the codec's optional `quantized` / `dequantize`, swap.layout.TensorCodec):
the landed weight is dequantized by its codec into the dtype the model computes in (what the
pack's layer does every forward), patched with `comfy.lora.calculate_weight` as the pack
patches it, and bound in its place until the block's slot or buffer is refilled: once per
landing instead of once per forward of every layer. Plain LoRA pairs on CUDA are added with
FoldOp's fused addmm_, or, for the types lora/gguf_kernels.py has a kernel for (the codec's
`type_name`), dequantized and added in one kernel, within one rounding of the pack's math. The
quantized bytes are never written."""
from __future__ import annotations

import logging
import math

import torch

import comfy.lora

from ..swap.dense_arena import DenseArena
from . import gguf_kernels, kernels
from .fold_ops import FoldOp

log = logging.getLogger("ringswap.dense_fold")

WORKSPACE_FLOATS = 4   # float32 temporaries of one weight while it is dequantized and patched
# the types with a kernel, and the peak bytes a value of the pack's dequantize beyond the dense
# weight, which the kernel's fallback needs (bench/probes/dequant_peak.py, the larger of its two dtypes)
FALLBACK_BYTES = {"Q8_0": 2.2, "Q4_0": 3.2, "Q4_1": 3.3, "Q5_0": 8.7, "Q5_1": 8.8, "Q4_K": 3.6, "Q5_K": 5.5,
                  "Q6_K": 5.4}
DEQUANT_BYTES = 8.5   # the most of the types without a kernel (IQ4_XS's; each type's: bench/probes/dequant_peak.py)
_KERNEL_OK: dict = {}   # (type, dequant dtype, model dtype, device) -> the kernel equals the pack's dequantize there


def dense_codec(attr):
    """The attribute's codec where it has a dense form, else None."""
    return attr.codec if attr.codec is not None and hasattr(attr.codec, "dequantize") else None


class DenseOp(FoldOp):
    """Dequantize, patch, and hand back the dense weight the block binds instead."""

    def __init__(self, key, patches, attr: int, layout, layer: torch.nn.Module, dtype: torch.dtype,
                 shape: tuple[int, ...]):
        super().__init__(key, patches)
        a = layout.attrs[attr]
        self.attr, self.codec, self.spec, self.entries = attr, a.codec, a.spec, a.entries
        self.dtype, self.shape = dtype, tuple(shape)
        self.dequant_dtype = getattr(layer, "dequant_dtype", None)
        patch_dtype = getattr(layer, "patch_dtype", None)
        self.patch_dtype = dtype if patch_dtype == "target" else patch_dtype
        # a type with a kernel (FALLBACK_BYTES), no patches or plain LoRA pairs at the pack's patch
        # dtype: one kernel on CUDA with Triton, through the pack's dequant dtype (float16 by default,
        # "target": the model's)
        self.type_name = self.codec.type_name(self.spec) if hasattr(self.codec, "type_name") else None
        self.kernel = self.type_name in FALLBACK_BYTES and (
            not self.patches or (self.patch_dtype is None and self.pairs is not None))
        self.kernel_mid = {None: torch.float16, "target": dtype}.get(self.dequant_dtype, self.dequant_dtype)
        self.numel = math.prod(shape)
        self.nbytes = self.numel * torch.empty(0, dtype=dtype).element_size()

    def __call__(self, tensors, arena: DenseArena | None = None) -> torch.Tensor:
        """The dense weight, cut from `arena` where given and it has room (the pack's steps copy
        their result there, where it has the planned dtype and shape)."""
        parts = [tensors[i] for i in self.entries]
        out = arena.take(self.shape, self.dtype) if arena is not None else None
        if self.kernel and kernels.enabled(parts[0].device) and self._kernel_matches(parts):
            pairs = self.kernel_pairs(parts[0]) if self.patches else None
            w = gguf_kernels.dense(self.type_name, parts[0], self.shape, self.dtype, self.kernel_mid, pairs, out)
            if w is not None:
                return w
        w = self._pack_steps(parts)
        if out is None or w.dtype != out.dtype or w.shape != out.shape:
            return w
        return out.copy_(w)

    def _pack_steps(self, parts: list[torch.Tensor]) -> torch.Tensor:
        w = self.codec.dequantize(self.spec, parts, self.dtype, self.dequant_dtype)
        if not self.patches:   # made dense on landing only (GgmlCodec.dense_on_land)
            return w
        if self.patch_dtype is None and self.fused(w):   # plain LoRA pairs on CUDA: one addmm_ each
            return self.add_delta(w)
        if self.patch_dtype is None:
            return comfy.lora.calculate_weight(self.patches, w, self.key)
        return comfy.lora.calculate_weight(self.patches, w, self.key, self.patch_dtype)

    def _kernel_matches(self, parts: list[torch.Tensor]) -> bool:
        """Does this type's kernel give the pack's dequantize bit for bit on this device, for this
        dequant dtype and output dtype? Checked once per process on the first weight that asks
        (this one, without pairs): a GPU or Triton build that rounds otherwise gets the pack's
        code, with one warning, never other weights."""
        key = (self.type_name, self.kernel_mid, self.dtype, parts[0].device)
        if key not in _KERNEL_OK:
            got = gguf_kernels.dense(self.type_name, parts[0], self.shape, self.dtype, self.kernel_mid, None)
            if got is None:   # cannot run here: the caller falls back on its own
                return True
            same = torch.equal(got, self.codec.dequantize(self.spec, parts, self.dtype, self.dequant_dtype))
            _KERNEL_OK[key] = same
            if not same:
                log.warning("RingSwap: the %s kernel differs from ComfyUI-GGUF's dequantize on %s (dequant %s, "
                            "model %s); using the pack's code for these weights", self.type_name, parts[0].device,
                            self.kernel_mid, self.dtype)
        return _KERNEL_OK[key]

    def workspace_bytes(self, device: torch.device) -> int:
        """Device bytes of this fold's temporaries: where a kernel folds it on CUDA it needs none
        (planned: its fallback's, the pack's dequantize and an addmm_), else float32 ones."""
        if self.kernel and device.type in self.fused_devices:
            return math.ceil(self.numel * FALLBACK_BYTES[self.type_name])
        if not self.patches:   # the pack's dequantize alone
            return math.ceil(self.numel * DEQUANT_BYTES)
        return self.numel * 4 * WORKSPACE_FLOATS
