"""The fold of one weight's patches into a landed block's tensors: one op class per storage.

Plain float weights follow ComfyUI's own patching (bit for bit on the CPU); per-tensor
scaled fp8 and comfy_kitchen (nvfp4) weights are dequantized, patched and requantized in
place; on CUDA plain LoRA pairs take a fused path (`addmm_`, or lora/kernels.py for
quantized weights). The slot's tensors never change shape or dtype.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

import comfy.float
import comfy.lora
import comfy.model_patcher
import comfy.utils

from . import kernels
from .checks import meta_tensors

try:
    import comfy.quant_ops as _comfy_quant_ops
    ComfyQuantizedTensor = getattr(_comfy_quant_ops, "QuantizedTensor", None)
except ImportError:   # very old ComfyUI
    ComfyQuantizedTensor = None
try:
    from comfy_kitchen.tensor import QuantizedTensor as KitchenTensor
except ImportError:
    KitchenTensor = None

log = logging.getLogger("ringswap.fold_ops")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES
MIN_SCALE = 1e-12                      # scale of an all-zero tensor
NVFP4_MAX = 448.0 * 6.0                # fp8 e4m3 max * e2m1 max

# moved from comfy.model_patcher to comfy.utils in newer ComfyUI (the old name warns there)
_string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


def _lora_pairs(patches) -> list[tuple] | None:
    """[(up, down, scale)] when every patch is a plain LoRA pair on the whole weight."""
    pairs = []
    for p in patches:
        strength, v, strength_model, offset, function = p[:5]
        if strength_model != 1.0 or offset is not None or function is not None \
                or getattr(v, "name", None) != "lora" or not hasattr(v, "weights"):
            return None
        up, down, alpha, mid, dora_scale, reshape = v.weights[:6]
        if mid is not None or dora_scale is not None or reshape is not None or up.dim() != 2 or down.dim() != 2:
            return None
        scale = float(strength) * (float(alpha) / down.shape[0] if alpha is not None else 1.0)
        pairs.append((up, down, scale))
    return pairs


class FoldOp:
    """Fold the patches of one weight into a landed block's tensors.

    On CUDA, a weight whose patches are all plain LoRA pairs (up/down, no mid, DoRA or
    reshape) is folded with one fused `addmm_` per pair in the weight's own dtype, with the
    pair kept on the device: one read and write of the weight instead of ComfyUI's float32
    round trip, so the fold stays a few % of the block's compute. The result is the exact sum
    rounded once, so it can differ from ComfyUI's (which rounds the product, the scaled
    product and the sum separately) by at most one unit in the last place of the weight's
    dtype. Quantized weights with plain LoRA pairs fold through lora/kernels.py on CUDA, the
    same math summed in another order. On the CPU the fold follows ComfyUI's steps exactly."""

    fused_devices = frozenset({"cuda"})   # device types where plain LoRA pairs fold with a fused addmm_

    def __init__(self, key: str, patches):
        self.key = key
        self.patches = list(patches)   # what comfy.lora.calculate_weight takes (it does not modify it)
        self.pairs = _lora_pairs(self.patches)
        self._on_device: dict = {}

    def fused(self, w: torch.Tensor) -> bool:
        """Does `w` fold with the fused addmm_ (plain LoRA pairs, CUDA, float dtype)?"""
        return (self.pairs is not None and w.device.type in self.fused_devices and w.dim() == 2
                and w.dtype in FUSED_DTYPES)

    def add_delta(self, w: torch.Tensor) -> torch.Tensor:
        """w + the patches' delta: fused on CUDA for plain LoRA pairs, else ComfyUI's math."""
        if not self.fused(w):
            return comfy.lora.calculate_weight(self.patches, w, self.key)
        pairs = self._on_device.get((w.device, w.dtype))
        if pairs is None:
            pairs = [(u.to(w.device, w.dtype), d.to(w.device, w.dtype), s) for u, d, s in self.pairs]
            self._on_device[(w.device, w.dtype)] = pairs
        for up, down, scale in pairs:
            w.addmm_(up, down, alpha=scale)
        return w

    def pair_bytes(self, device: torch.device) -> int:
        """Device bytes this weight's LoRA pairs are planned to keep on `device` (plain pairs on
        CUDA): the larger of the kernels' layout and the pairs in their own dtype (the addmm_'s)."""
        if not self.pairs or device.type not in self.fused_devices:
            return 0
        return max(kernels.Pairs.nbytes(self.pairs),
                   sum(u.nbytes + d.nbytes for u, d, _ in self.pairs))

    def kept_bytes(self, device: torch.device) -> int:
        """Device bytes of this weight's LoRA pairs kept on `device` now."""
        kept = 0
        for pairs in self._on_device.values():
            tensors = (pairs.up, pairs.down) if isinstance(pairs, kernels.Pairs) else [t for u, d, _ in pairs for t in (u, d)]
            kept += sum(t.nbytes for t in tensors
                        if t.device.type == device.type and device.index in (None, t.device.index))
        return kept

    def kernel_pairs(self, w: torch.Tensor) -> "kernels.Pairs | None":
        """The LoRA pairs laid out for lora/kernels.py on `w`'s device, or None where the
        fused kernels do not apply (not plain pairs, not CUDA, no Triton)."""
        if self.pairs is None or not kernels.enabled(w.device):
            return None
        key = ("kernels", w.device)
        kp = self._on_device.get(key)
        if kp is None:
            kp = self._on_device[key] = kernels.Pairs(self.pairs, w.device)
        return kp


class PlainOp(FoldOp):
    """ComfyUI's patch_weight_to_device, on the slot's tensor: plain float (fp32/bf16/fp16,
    and fp8 without a scale) to float32 (ComfyUI 0.33: its `lora_compute_dtype` of the
    device, float16 on most GPUs), `comfy.lora.calculate_weight`,
    `comfy.float.stochastic_rounding(out, dtype, seed=string_to_seed(key))` (for fp32/bf16/
    fp16 a plain round-to-nearest cast; for fp8 ComfyUI's seeded stochastic rounding), so
    the folded weights equal ComfyUI's own patching bit for bit."""

    def __init__(self, key, patches, entry: int, patch_dtype: torch.dtype = torch.float32):
        super().__init__(key, patches)
        self.entry, self.patch_dtype = entry, patch_dtype
        self.seed = _string_to_seed(key)

    def __call__(self, tensors):
        t = tensors[self.entry]
        if self.fused(t):
            self.add_delta(t)
            return
        w = t.to(self.patch_dtype, copy=True)
        out = comfy.lora.calculate_weight(self.patches, w, self.key)
        t.copy_(comfy.float.stochastic_rounding(out, t.dtype, seed=self.seed))


def requantize_fp8(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(data, scale): per-tensor scaled fp8 with a fresh scale amax / fp8_max."""
    fmax = torch.finfo(dtype).max
    scale = (w.abs().amax() / fmax).clamp_min(MIN_SCALE)
    return (w / scale).clamp_(-fmax, fmax).to(dtype), scale


class ScaledFp8Op(FoldOp):
    """fp8 data + a per-tensor float scale: dequantize, patch, fresh scale.

    ComfyUI's scaled-fp8 ops (fp8 `weight` + `scale_weight`) or an fp8 `QuantizedTensor`
    (data + scale, ComfyUI 0.3.75's own or comfy_kitchen's as 0.33 builds it): dequantize to
    float32, patch, requantize with a fresh scale amax/fp8_max (round to nearest), written
    into the scale tensor in place. With plain LoRA pairs on CUDA: lora/kernels.py, two
    passes over the quantized bytes."""

    def __init__(self, key, patches, data: int, scale: int):
        super().__init__(key, patches)
        self.data, self.scale = data, scale

    def __call__(self, tensors):
        q, s = tensors[self.data], tensors[self.scale]
        kp = self.kernel_pairs(q)
        if kp is not None and kernels.fold_fp8_(q, s, kp, MIN_SCALE):
            return
        w = q.to(torch.float32) * s.to(torch.float32)
        out = self.add_delta(w)
        nq, ns = requantize_fp8(out, q.dtype)
        q.copy_(nq)
        s.copy_(ns.reshape(s.shape))


class KitchenOp(FoldOp):
    """comfy_kitchen QuantizedTensor other than per-tensor fp8 (that one is a ScaledFp8Op):
    dequantize in float32, patch, from_float (nvfp4 with
    plain LoRA pairs on CUDA: one lora/kernels.py fold in place).

    `QuantizedTensor.from_float` gives fresh global and block scales; its data and scale
    tensors are copied into the slot's. With plain LoRA pairs on CUDA, nvfp4 is dequantized,
    added and requantized in two passes over the quantized bytes; other kitchen layouts get
    the pairs added to the dequantized float32 weight with its amax in one pass."""

    def __init__(self, key, patches, entries, layout_cls: str, params, fields):
        super().__init__(key, patches)
        self.entries, self.layout_cls, self.params, self.fields = tuple(entries), layout_cls, params, tuple(fields)
        self._in_place: bool | None = None   # nvfp4 stored unpadded: kernels.fold_nvfp4_ applies

    def __call__(self, tensors):
        parts = [tensors[i] for i in self.entries]
        if self._in_place is None:
            self._in_place = (self.layout_cls == "TensorCoreNVFP4Layout" and self.fields == ("scale", "block_scale")
                              and tuple(self.params.orig_shape) == (parts[0].shape[0], 2 * parts[0].shape[1]))
        if self._in_place:
            kp = self.kernel_pairs(parts[0])
            if kp is not None and kernels.fold_nvfp4_(parts[0], parts[1], parts[2], kp, NVFP4_MAX, MIN_SCALE):
                return
        params = dataclasses.replace(self.params, orig_dtype=torch.float32, **dict(zip(self.fields, parts[1:])))
        q = KitchenTensor(parts[0], self.layout_cls, params)
        w = _kitchen_eager_fallback("dequantize", self.layout_cls, parts[0].device, q.dequantize).contiguous()
        kp = self.kernel_pairs(w)
        amax = kernels.add_pairs_(w, kp) if kp is not None else None
        out = w if amax is not None else self.add_delta(w)
        kwargs = {}
        if self.layout_cls == "TensorCoreNVFP4Layout":
            amax = out.abs().amax() if amax is None else amax
            kwargs["scale"] = (amax / NVFP4_MAX).clamp_min(MIN_SCALE)
        q = kitchen_from_float(out, self.layout_cls, **kwargs)
        new = [q._qdata] + [getattr(q._params, f) for f in self.fields]
        for dst, src in zip(parts, new):
            if src.numel() != dst.numel():
                raise RuntimeError(f"RingSwap LoRA: requantizing '{self.key}' ({self.layout_cls}) gave a part of "
                                   f"shape {tuple(src.shape)} for a slot tensor of shape {tuple(dst.shape)}")
            dst.copy_(src.reshape(dst.shape))


_KITCHEN_EAGER: set = set()   # (what, layout, device) where kitchen's chosen backend failed


def _kitchen_eager_fallback(what: str, layout_cls: str, device: torch.device, fn):
    """fn() with comfy_kitchen's chosen backend; its eager one where that cannot run here
    (e.g. its triton nvfp4 quantize needs sm_100+, its CUDA kernels take fp16/bf16 only).
    The failure is logged once per (what, layout, device)."""
    key = (what, layout_cls, device)
    if key not in _KITCHEN_EAGER:
        try:
            return fn()
        except Exception as e:   # noqa: BLE001 - a backend that cannot compile/run here
            log.warning("RingSwap LoRA: comfy_kitchen's %s %s failed on %s (%s); using its eager backend",
                        layout_cls, what, device, str(e).strip().splitlines()[0][:200])
            _KITCHEN_EAGER.add(key)
    from comfy_kitchen.registry import registry
    with registry.use_backend("eager"):
        return fn()


def kitchen_from_float(w: torch.Tensor, layout_cls: str, **kwargs):
    """comfy_kitchen's quantize of `w`, with its eager backend as the fallback."""
    return _kitchen_eager_fallback("quantize", layout_cls, w.device,
                                   lambda: KitchenTensor.from_float(w, layout_cls, **kwargs))


def make_op(key, patches, layout, attr, attrs_by_name, patch_dtype: torch.dtype = torch.float32) -> FoldOp:
    entries = layout.entries
    if attr.codec is None:
        e = entries[attr.entries[0]]
        if e.dtype not in FLOAT_DTYPES:
            raise ValueError(f"RingSwap LoRA: cannot patch '{key}': it is stored as {e.dtype}")
        if e.dtype in FP8_DTYPES and attr.name == "weight":
            sib = attrs_by_name.get((attr.path + "." if attr.path else "") + "scale_weight")
            if sib is not None:
                s = layout.attrs[sib]
                se = entries[s.entries[0]] if s.codec is None else None
                if se is not None and se.dtype in (torch.float32, torch.float16, torch.bfloat16) \
                        and torch.Size(se.shape).numel() == 1:
                    return ScaledFp8Op(key, patches, attr.entries[0], s.entries[0])
        return PlainOp(key, patches, attr.entries[0], patch_dtype)
    joined = attr.codec.join(attr.spec, meta_tensors(entries, attr.entries))
    if KitchenTensor is not None and isinstance(joined, KitchenTensor):
        layout_cls, params, fields = attr.spec
        if getattr(params, "transposed", False):
            raise ValueError(f"RingSwap LoRA: cannot patch '{key}': a transposed {layout_cls} weight")
        if tuple(fields) == ("scale",) and entries[attr.entries[0]].dtype in FP8_DTYPES \
                and torch.Size(entries[attr.entries[1]].shape).numel() == 1:
            # per-tensor fp8 (TensorCoreFP8Layout, 0.33's TensorCoreFP8E4M3Layout / E5M2): data + scale
            return ScaledFp8Op(key, patches, attr.entries[0], attr.entries[1])
        return KitchenOp(key, patches, attr.entries, layout_cls, params, fields)
    if ComfyQuantizedTensor is not None and isinstance(joined, ComfyQuantizedTensor):
        layout_type, _static, tensor_keys = attr.spec
        qdtype = entries[attr.entries[0]].dtype
        if layout_type == "TensorCoreFP8Layout" and tuple(tensor_keys) == ("scale",) and qdtype in FP8_DTYPES:
            return ScaledFp8Op(key, patches, attr.entries[0], attr.entries[1])
        raise ValueError(f"RingSwap LoRA: cannot patch '{key}': quantized layout {layout_type} is not supported")
    raise ValueError(f"RingSwap LoRA: cannot patch '{key}': unknown packed tensor {type(joined).__name__}")

