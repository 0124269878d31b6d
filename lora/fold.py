"""Fold ComfyUI's weight patches (LoRA & co.) into each block as it lands on the device.

ComfyUI keeps every patch of a MODEL in `patcher.patches` (weight key -> list of patch
tuples, from `add_patches`, e.g. by `comfy.sd.load_lora_for_models`). ComfyUI applies the
patches of everything but the transformer blocks itself; for the blocks, `block_folder`
turns the patches into per-block fold work once, and the swap engine runs it on the
device copy of a block right after its bytes land (a ring slot or a resident buffer),
before the block computes. The host home is never written: nothing is written back, and
a strength change or a removed LoRA only needs a new fold plan.

Per weight, by storage:
- plain float (fp32/bf16/fp16, and fp8 without a scale): exactly ComfyUI's
  `ModelPatcher.patch_weight_to_device`: to float32 (ComfyUI 0.33: its `lora_compute_dtype`
  of the device, float16 on most GPUs), `comfy.lora.calculate_weight`,
  `comfy.float.stochastic_rounding(out, dtype, seed=string_to_seed(key))` (for fp32/bf16/
  fp16 a plain round-to-nearest cast; for fp8 ComfyUI's seeded stochastic rounding), so
  the folded weights equal ComfyUI's own patching bit for bit;
- per-tensor scaled fp8 (ComfyUI's scaled-fp8 ops: fp8 `weight` + `scale_weight`, or
  an fp8 `QuantizedTensor`: data + scale, ComfyUI 0.3.75's own or comfy_kitchen's as 0.33
  builds it): dequantize to float32, patch, requantize with a fresh scale amax/fp8_max
  (round to nearest), written into the scale tensor in place;
- other comfy_kitchen `QuantizedTensor`s (nvfp4): dequantize to float32,
  patch, `QuantizedTensor.from_float` (fresh global and block scales) and copy its data and
  scale tensors into the slot's.
On CUDA, a weight whose patches are all plain LoRA pairs (up/down, no mid, DoRA or
reshape) is folded with one fused `addmm_` per pair in the weight's own dtype, with the
pair kept on the device: one read and write of the weight instead of ComfyUI's float32
round trip, so the fold stays a few % of the block's compute. The result is the exact sum
rounded once, so it can differ from ComfyUI's (which rounds the product, the scaled
product and the sum separately) by at most one unit in the last place of the weight's
dtype. Quantized weights with plain LoRA pairs fold through lora/kernels.py on CUDA (per-
tensor fp8 and nvfp4: dequantize, add and requantize in two passes over the quantized
bytes; other kitchen layouts: the pairs added to the dequantized float32 weight with its
amax in one pass), the same math summed in another order. On the CPU the fold follows ComfyUI's steps exactly.
The slot's tensors never change shape or dtype. Like ComfyUI's own loader, the fold
leaves out patches on buffers and on parameters of non-leaf modules (Wan's
`blocks.N.modulation`): ComfyUI 0.3.75 and later never apply those either, so results match.
Block patches are checked once, when the fold plan is made: a patch that does not fit its
weight (ComfyUI would log and skip it) is a ValueError naming the key and both shapes.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from contextlib import contextmanager
from typing import Callable

import torch

import comfy.float
import comfy.lora
import comfy.model_patcher
import comfy.utils

from . import kernels

try:
    import comfy.quant_ops as _comfy_quant_ops
    ComfyQuantizedTensor = getattr(_comfy_quant_ops, "QuantizedTensor", None)
except ImportError:   # very old ComfyUI
    ComfyQuantizedTensor = None
try:
    from comfy_kitchen.tensor import QuantizedTensor as KitchenTensor
except ImportError:
    KitchenTensor = None

log = logging.getLogger("ringswap.lora")

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16) + FP8_DTYPES
MIN_SCALE = 1e-12                      # scale of an all-zero tensor
NVFP4_MAX = 448.0 * 6.0                # fp8 e4m3 max * e2m1 max
_BLOCK_KEY = re.compile(r"^(.*?\.\d+\.)(.+)$")

FoldFn = Callable[[int, list[torch.Tensor]], None]

# moved from comfy.model_patcher to comfy.utils in newer ComfyUI (the old name warns there)
_string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


# ----- what a patch list does -------------------------------------------------------------
def _effective(patches) -> tuple:
    """The patches that change a weight: a patch at strength 0 adds exactly nothing (a
    `set` patch ignores its strength, so it stays)."""
    out = []
    for p in patches:
        v = p[1]
        is_set = isinstance(v, tuple) and len(v) == 2 and v[0] == "set"
        if p[0] == 0.0 and p[2] == 1.0 and not is_set:
            continue
        out.append(p)
    return tuple(out)


def patch_shape(v) -> tuple[int, ...] | None:
    """The shape of the weight a patch was made for, where it can be told."""
    try:
        name = getattr(v, "name", None)
        if name is not None:
            w = v.weights
            if name == "lora":
                up, down, mid = w[0], w[1], w[3]
                return (up.shape[0], down.shape[1], *mid.shape[2:]) if mid is not None \
                    else (up.shape[0], *down.shape[1:])
            if name == "loha":
                return (w[0].shape[0], w[1].shape[1])
            if name == "lokr":
                w1 = w[0].shape if w[0] is not None else (w[3].shape[0], w[4].shape[1])
                w2 = w[1].shape if w[1] is not None else (w[5].shape[0], w[6].shape[1])
                return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])
            return None
        if isinstance(v, list):
            return tuple(v[0][0].shape)
        t = v[0] if len(v) == 1 else v[1][0]
        return tuple(t.shape)
    except Exception:   # noqa: BLE001 - only used for messages
        return None


def _kind(v) -> str:
    name = getattr(v, "name", None)
    if name is not None:
        return name
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
        return v[0]
    return "diff"


@contextmanager
def capture_root_log(match: Callable[[str], bool]):
    """Collect (and keep off the console) the warnings ComfyUI logs on the root logger
    whose message satisfies `match`; yields the list they are collected in."""
    caught: list[str] = []

    class _Filter(logging.Filter):
        def filter(self, record):
            if record.levelno >= logging.WARNING:
                msg = record.getMessage()
                if match(msg):
                    caught.append(msg)
                    return False
            return True

    root = logging.getLogger()
    f = _Filter()
    level = root.level
    root.addFilter(f)
    if level > logging.WARNING:
        root.setLevel(logging.WARNING)
    try:
        yield caught
    finally:
        root.removeFilter(f)
        root.setLevel(level)


def check_patches(key: str, patches, shape: tuple[int, ...]) -> None:
    """Raise ValueError if ComfyUI's weight math cannot apply `patches` to a weight of
    `shape` (it would only log and skip them): a dry run on a meta tensor."""
    trial = [(1.0,) + tuple(p[1:]) for p in patches]
    error = None
    with capture_root_log(lambda m: key in m or "Calculate Weight Failed" in m) as caught:
        try:
            out = comfy.lora.calculate_weight(trial, torch.empty(shape, dtype=torch.float32, device="meta"), key)
            if tuple(out.shape) != tuple(shape):
                error = f"the patched weight would have shape {tuple(out.shape)}"
        except NotImplementedError:
            return                      # an op without meta support: cannot check here
        except (RuntimeError, ValueError, IndexError) as e:
            error = str(e)
    if error is None and caught:
        error = caught[0]
    if error is None:
        return
    for p in patches:
        got = patch_shape(p[1])
        if got is not None and (torch.Size(got).numel() != torch.Size(shape).numel() or got[:1] != tuple(shape)[:1]):
            raise ValueError(
                f"RingSwap LoRA: shape mismatch at '{key}': the LoRA's {_kind(p[1])} patch is for a weight of "
                f"shape {tuple(got)}, but the model's weight has shape {tuple(shape)}; the LoRA was made for a "
                f"different model or model size (ComfyUI: {error})")
    raise ValueError(f"RingSwap LoRA: cannot apply the patch at '{key}' to the model's weight of shape "
                     f"{tuple(shape)}: {error}")


# ----- the block side ---------------------------------------------------------------------
def _meta(entries, idx):
    return [torch.empty(entries[i].shape, dtype=entries[i].dtype, device="meta") for i in idx]


def _attr_shape(layout, attr) -> tuple[int, ...]:
    """Logical shape of a block attribute (a packed tensor's unpacked shape)."""
    if attr.codec is None:
        return tuple(layout.entries[attr.entries[0]].shape)
    return tuple(attr.codec.join(attr.spec, _meta(layout.entries, attr.entries)).shape)


def _swap_state(patcher):
    try:
        return patcher.swap_state if hasattr(type(patcher), "swap_state") else None
    except Exception:   # noqa: BLE001
        return None


def _block_of(state, key: str) -> tuple[int, str] | None:
    m = _BLOCK_KEY.match(key)
    if m is None:
        return None
    b = state.block_index.get(m.group(1))
    return None if b is None else (b, m.group(2))


def _attr_index(layout) -> dict[str, int]:
    return {(a.path + "." if a.path else "") + a.name: i for i, a in enumerate(layout.attrs)}


def weight_shape(patcher, key: str) -> tuple[int, ...] | None:
    """The (logical) shape of the model weight `key`; for blocks of a RingSwap model from
    the block layout (their modules may hold placeholders)."""
    state = _swap_state(patcher)
    if state is not None:
        hit = _block_of(state, key)
        if hit is not None:
            layout = state.engine.states[hit[0]].layout
            i = _attr_index(layout).get(hit[1])
            return None if i is None else _attr_shape(layout, layout.attrs[i])
    try:
        return tuple(comfy.utils.get_attr(patcher.model, key).shape)
    except AttributeError:
        return None


def check_patcher(patcher, keys=None) -> None:
    """check_patches for every patched key of `patcher` (or only `keys`)."""
    for key in (patcher.patches if keys is None else keys):
        if isinstance(key, tuple):
            key = key[0]
        patches = patcher.patches.get(key)
        if not patches:
            continue
        if any(p[3] is not None for p in patches):
            continue                    # offset patches address part of a weight
        shape = weight_shape(patcher, key)
        if shape is not None:
            check_patches(key, patches, shape)


FUSED_DEVICES = {"cuda"}   # device types where plain LoRA pairs fold with a fused addmm_


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


class _Op:
    """Fold the patches of one weight into a landed block's tensors."""

    def __init__(self, key: str, patches):
        self.key = key
        self.patches = list(patches)   # what comfy.lora.calculate_weight takes (it does not modify it)
        self.pairs = _lora_pairs(self.patches)
        self._on_device: dict = {}

    def fused(self, w: torch.Tensor) -> bool:
        """Does `w` fold with the fused addmm_ (plain LoRA pairs, CUDA, float dtype)?"""
        return (self.pairs is not None and w.device.type in FUSED_DEVICES and w.dim() == 2
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


class _PlainOp(_Op):
    """ComfyUI's patch_weight_to_device, on the slot's tensor."""

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


class _ScaledFp8Op(_Op):
    """fp8 data + a per-tensor float scale: dequantize, patch, fresh scale."""

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


class _KitchenOp(_Op):
    """comfy_kitchen QuantizedTensor other than per-tensor fp8 (that one is a _ScaledFp8Op):
    dequantize in float32, patch, from_float (nvfp4 with
    plain LoRA pairs on CUDA: one lora/kernels.py fold in place)."""

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
        q = _kitchen_from_float(out, self.layout_cls, **kwargs)
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


def _kitchen_from_float(w: torch.Tensor, layout_cls: str, **kwargs):
    """comfy_kitchen's quantize of `w`, with its eager backend as the fallback."""
    return _kitchen_eager_fallback("quantize", layout_cls, w.device,
                                   lambda: KitchenTensor.from_float(w, layout_cls, **kwargs))


def _make_op(key, patches, layout, attr, attrs_by_name, patch_dtype: torch.dtype = torch.float32) -> _Op:
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
                    return _ScaledFp8Op(key, patches, attr.entries[0], s.entries[0])
        return _PlainOp(key, patches, attr.entries[0], patch_dtype)
    joined = attr.codec.join(attr.spec, _meta(entries, attr.entries))
    if KitchenTensor is not None and isinstance(joined, KitchenTensor):
        layout_cls, params, fields = attr.spec
        if getattr(params, "transposed", False):
            raise ValueError(f"RingSwap LoRA: cannot patch '{key}': a transposed {layout_cls} weight")
        if tuple(fields) == ("scale",) and entries[attr.entries[0]].dtype in FP8_DTYPES \
                and torch.Size(entries[attr.entries[1]].shape).numel() == 1:
            # per-tensor fp8 (TensorCoreFP8Layout, 0.33's TensorCoreFP8E4M3Layout / E5M2): data + scale
            return _ScaledFp8Op(key, patches, attr.entries[0], attr.entries[1])
        return _KitchenOp(key, patches, attr.entries, layout_cls, params, fields)
    if ComfyQuantizedTensor is not None and isinstance(joined, ComfyQuantizedTensor):
        layout_type, _static, tensor_keys = attr.spec
        qdtype = entries[attr.entries[0]].dtype
        if layout_type == "TensorCoreFP8Layout" and tuple(tensor_keys) == ("scale",) and qdtype in FP8_DTYPES:
            return _ScaledFp8Op(key, patches, attr.entries[0], attr.entries[1])
        raise ValueError(f"RingSwap LoRA: cannot patch '{key}': quantized layout {layout_type} is not supported")
    raise ValueError(f"RingSwap LoRA: cannot patch '{key}': unknown packed tensor {type(joined).__name__}")


class BlockFolder:
    """The fold work of every block: `folder(block, tensors)` runs it on a landed block."""

    def __init__(self, ops: dict[int, list[_Op]]):
        self.ops = ops

    def __call__(self, block: int, tensors: list[torch.Tensor]) -> None:
        ops = self.ops.get(block)
        if not ops:
            return
        with torch.no_grad():
            for op in ops:
                op(tensors)

    def release(self) -> None:
        """Drop the LoRA pairs kept on the device (when the model leaves it)."""
        for ops in self.ops.values():
            for op in ops:
                op._on_device.clear()

    def __repr__(self):
        return f"BlockFolder({sum(len(v) for v in self.ops.values())} weights in {len(self.ops)} blocks)"


def _comfyui_patches(block, attr) -> bool:
    """Would ComfyUI's own loader patch this block attribute? It patches only parameters
    of leaf modules (`ModelPatcher._load_list` skips modules with parameters of their own
    and in children, e.g. Wan's `blocks.N.modulation`, and never patches buffers); the
    fold does the same so results equal ComfyUI's."""
    if not attr.is_param:
        return False
    module = block.get_submodule(attr.path) if attr.path else block
    own = set(module._parameters)
    return all(name in own for name, _ in module.named_parameters())


def block_folder(patcher, patch_dtype: torch.dtype = torch.float32) -> FoldFn | None:
    """The per-landing fold of `patcher`'s block patches, or None if no block weight is
    patched. `patch_dtype`: what ComfyUI patches plain weights in on the fold's device
    (float32, or 0.33's `lora_compute_dtype`). Raises ValueError for a patch that cannot
    apply (e.g. a shape mismatch)."""
    state = patcher.swap_state
    engine = state.engine
    ops: dict[int, list[_Op]] = {}
    index_cache: dict[int, dict[str, int]] = {}
    left_out: list[str] = []
    for key, plist in patcher.patches.items():
        hit = _block_of(state, key)
        if hit is None:
            continue
        patches = _effective(plist)
        if not patches:
            continue
        b, sub = hit
        st = engine.states[b]
        layout = st.layout
        names = index_cache.get(id(layout))
        if names is None:
            names = index_cache[id(layout)] = _attr_index(layout)
        i = names.get(sub)
        if i is None:
            raise ValueError(f"RingSwap LoRA: '{key}' is patched but block {b} has no tensor '{sub}'")
        attr = layout.attrs[i]
        if not _comfyui_patches(st.block, attr):
            left_out.append(key)
            continue
        if all(p[3] is None for p in patches):
            check_patches(key, patches, _attr_shape(layout, attr))
        ops.setdefault(b, []).append(_make_op(key, patches, layout, attr, names, patch_dtype))
    if left_out:
        log.info("RingSwap LoRA: %d patched block tensors are left out, as ComfyUI's own loader leaves them "
                 "out (parameters of non-leaf modules, buffers), e.g. %s", len(left_out), left_out[0])
    if not ops:
        return None
    folder = BlockFolder(ops)
    log.debug("RingSwap LoRA: %r", folder)
    return folder
