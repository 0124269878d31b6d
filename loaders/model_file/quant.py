"""Quantized block weights: what ComfyUI would build, without reading the weights.

- Codecs that split a quantized tensor into its plain parts (data, scales) so it travels
  compact and is rebuilt around the landed bytes: ComfyUI 0.3.75's own fp8
  `comfy.quant_ops.QuantizedTensor`, and comfy_kitchen's `QuantizedTensor` (nvfp4, and
  fp8 in newer ComfyUI).
- Per-layer `.comfy_quant` files on a ComfyUI that does not read them (0.3.75 loads them
  silently wrong): fp8 layers are declared to ComfyUI through the `_quantization_metadata`
  header it does understand; nvfp4 layers get comfy_kitchen tensors (dequantize on CPU,
  comfy_kitchen's kernels on CUDA), since 0.3.75's ops have no nvfp4.
- Block layers whose ComfyUI op creates its weight only while loading a state dict
  (mixed-precision ops) get that done with meta tensors, so the structure is ComfyUI's
  own and no byte is read.
"""
from __future__ import annotations

import dataclasses
import json

import torch
from torch import nn

from ...swap.layout import register_codec

try:
    import comfy.quant_ops as comfy_quant_ops
except ImportError:   # very old ComfyUI
    comfy_quant_ops = None
try:
    from comfy_kitchen.tensor import QuantizedTensor as KitchenTensor
except ImportError:
    KitchenTensor = None

# file attribute suffix of each inner tensor, by its name in the quantized tensor
PART_SUFFIX = {"_qdata": "", "scale": "_scale", "block_scale": "_scale"}
KITCHEN_PART_SUFFIX = {"_qdata": "", "block_scale": "_scale", "scale": "_scale_2"}


class _ComfyQuantCodec:
    """comfy.quant_ops.QuantizedTensor of ComfyUI 0.3.75: `_qdata` + `_layout_params`."""

    fresh_join = True   # it replaces its scale with a converted copy when used

    def split(self, t, name):
        params = t._layout_params
        tensor_keys = tuple(k for k, v in params.items() if isinstance(v, torch.Tensor))
        static = tuple((k, v) for k, v in params.items() if k not in tensor_keys)
        parts = [(name, t._qdata)] + [(name + PART_SUFFIX.get(k, "_" + k), params[k]) for k in tensor_keys]
        return (t._layout_type, static, tensor_keys), parts

    def join(self, spec, parts):
        layout_type, static, tensor_keys = spec
        params = dict(static)
        params.update(zip(tensor_keys, parts[1:]))
        return comfy_quant_ops.QuantizedTensor(parts[0], layout_type, params)


class _KitchenCodec:
    """comfy_kitchen's QuantizedTensor: `_qdata` + a `Params` dataclass."""

    fresh_join = True   # its fp8 and nvfp4 Params hold a float32 copy of a scale stored otherwise

    def split(self, t, name):
        p = t._params
        tensor_fields = tuple(f.name for f in dataclasses.fields(p) if isinstance(getattr(p, f.name), torch.Tensor))
        parts = [(name, t._qdata)]
        parts += [(name + (KITCHEN_PART_SUFFIX if t._layout_cls == "TensorCoreNVFP4Layout" else PART_SUFFIX)
                   .get(f, "_" + f), getattr(p, f)) for f in tensor_fields]
        return (t._layout_cls, p, tensor_fields), parts

    def join(self, spec, parts):
        layout_cls, p, tensor_fields = spec
        return KitchenTensor(parts[0], layout_cls, dataclasses.replace(p, **dict(zip(tensor_fields, parts[1:]))))


if comfy_quant_ops is not None and hasattr(comfy_quant_ops, "QuantizedTensor"):
    if KitchenTensor is None or not issubclass(comfy_quant_ops.QuantizedTensor, KitchenTensor):
        register_codec(comfy_quant_ops.QuantizedTensor, _ComfyQuantCodec())
if KitchenTensor is not None:
    register_codec(KitchenTensor, _KitchenCodec())


def comfy_quant_layers(sd: dict[str, torch.Tensor]) -> dict[str, dict]:
    """{layer: config} from `<layer>.comfy_quant` tensors (uint8 bytes of JSON)."""
    out = {}
    for key, t in sd.items():
        if key.endswith(".comfy_quant") and t.device.type != "meta":
            out[key[:-len(".comfy_quant")]] = json.loads(bytes(t.to(torch.uint8).tolist()).decode("utf-8"))
    return out


def declare_fp8_layers(metadata: dict, layers: dict[str, dict]) -> dict:
    """Metadata with `_quantization_metadata` listing the fp8 layers (0.3.75's format)."""
    fp8 = {k: {"format": v["format"]} for k, v in layers.items() if v.get("format") == "float8_e4m3fn"}
    if not fp8 or "_quantization_metadata" in metadata:
        return metadata
    return {**metadata, "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": fp8})}


def build_quantized_blocks(modules: list[tuple[str, nn.Module]], sd: dict[str, torch.Tensor],
                           layers: dict[str, dict], compute_dtype: torch.dtype, path: str,
                           keep_comfy_quant: bool) -> None:
    """Give block layers (`(name, module)` pairs) the quantized weights ComfyUI would
    create, with meta storage: nothing of the blocks is read. `keep_comfy_quant`: the
    ComfyUI op reads the layer's `.comfy_quant` config itself."""
    for name, module in modules:
        prefix = name + "."
        if prefix + "weight" not in sd:
            continue
        if layers.get(name, {}).get("format") == "nvfp4":
            if KitchenTensor is None:
                raise RuntimeError(f"RingSwap: {path}: nvfp4 layer '{name}' needs the comfy-kitchen package")
            from comfy_kitchen.tensor import TensorCoreNVFP4Layout
            q, bs, s2 = sd[prefix + "weight"], sd[prefix + "weight_scale"], sd[prefix + "weight_scale_2"]
            params = TensorCoreNVFP4Layout.Params(scale=s2, orig_dtype=compute_dtype,
                                                  orig_shape=(q.shape[0], q.shape[1] * 2), block_scale=bs)
            module.weight = nn.Parameter(KitchenTensor(q, "TensorCoreNVFP4Layout", params), requires_grad=False)
        elif "weight" not in module._parameters and \
                type(module)._load_from_state_dict is not nn.Module._load_from_state_dict:
            # the op builds its weight while loading a state dict: let it, on meta tensors
            part = {k: v for k, v in sd.items() if k.startswith(prefix) and "." not in k[len(prefix):]
                    and k[len(prefix):] not in module._parameters
                    and (keep_comfy_quant or not k.endswith(".comfy_quant"))}
            errors: list[str] = []
            module._load_from_state_dict(part, prefix, {}, False, [], [], errors)
            if errors:
                raise ValueError(f"RingSwap: {path}: layer '{name}': {errors}")
