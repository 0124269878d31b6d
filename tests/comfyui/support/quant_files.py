"""Tiny random Wan 2.1 (t2v) diffusion-model files in the quantized formats found in the wild.

Built on ``wan_files.build_tiny_wan_state_dict`` (same keys, shapes and random values), then
re-encoded. Only the block Linear weights are quantized, as real checkpoints do::

    blocks.N.self_attn.{q,k,v,o}.weight   blocks.N.cross_attn.{q,k,v,o}.weight
    blocks.N.ffn.0.weight                 blocks.N.ffn.2.weight

Everything else (biases, norm weights, ``modulation``, patch/text/time embeddings, head)
is stored in ``other_dtype`` (default bf16; fp8 norms/modulation would be unusable). On-disk key names per format
(``<L>`` = a block Linear such as ``blocks.0.self_attn.q``):

- ``bf16`` / ``fp16`` / ``fp32``: every tensor in that dtype.
- ``fp8_e4m3fn`` / ``fp8_e5m2``: ``<L>.weight`` cast to fp8 with no scale (the
  "..._fp8_e4m3fn.safetensors" kind), value = float(weight); the rest in ``other_dtype``.
- ``scaled_fp8`` (ComfyUI < 0.4 "fp8_scaled"): ``<L>.weight`` fp8 e4m3fn,
  ``<L>.scale_weight`` f32 shape ``()``; value = float(weight) * scale_weight; plus the marker
  ``scaled_fp8`` = ``torch.tensor([], dtype=float8_e4m3fn)`` (shape ``(0,)``: what
  0.3.75's ``state_dict_for_saving`` writes; a 2-element marker would mean "no fp8 matmul").
- ``quant_metadata`` (ComfyUI 0.3.7x mixed precision): header metadata
  ``_quantization_metadata`` = ``{"format_version": "1.0", "layers": {"<L>": {"format":
  "float8_e4m3fn"}}}``, ``<L>.weight`` fp8 e4m3fn, ``<L>.weight_scale`` f32 shape ``()``;
  value = float(weight) * weight_scale. No ``input_scale`` (optional in 0.3.75).
- ``comfy_quant`` (ComfyUI >= ~0.4): ``<L>.comfy_quant`` = uint8 bytes of the JSON
  ``{"format": "float8_e4m3fn"}`` (1-D), ``<L>.weight`` fp8 e4m3fn, ``<L>.weight_scale`` f32
  ``()``; no header metadata.
- ``nvfp4`` (ComfyUI >= ~0.8 + comfy_kitchen): ``<L>.comfy_quant`` = ``{"format": "nvfp4"}``,
  ``<L>.weight`` uint8 ``(N, K/2)`` (two E2M1 codes per byte, element 2j in the HIGH
  nibble), ``<L>.weight_scale`` float8_e4m3fn ``(roundup(N,128), roundup(K/16,4))`` block
  scales (one per 16 consecutive inputs of a row) in cuBLAS's swizzled 128x4 tile layout,
  ``<L>.weight_scale_2`` f32 ``()`` global scale. value[n, k] = e2m1(code[n, k]) *
  block_scale[n, k // 16] * weight_scale_2. This is exactly comfy_kitchen's
  ``TensorCoreNVFP4Layout.state_dict_tensors``: ``""`` = ``_qdata``, ``"_scale"`` =
  ``_params.block_scale``, ``"_scale_2"`` = ``_params.scale``; not transposed.

``dequantized_state_dict(path)`` decodes any of these to float32 (independently of
ComfyUI; nvfp4 with a pure-torch decoder, cross-checked against comfy_kitchen in the tests).
"""
from __future__ import annotations

import json
import os

import torch

try:
    from .wan_files import build_tiny_wan_state_dict
except ImportError:  # imported as a top-level module
    from wan_files import build_tiny_wan_state_dict

FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2", "scaled_fp8",
           "quant_metadata", "comfy_quant", "nvfp4")

PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FP8_PLAIN_DTYPES = {"fp8_e4m3fn": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

QUANT_LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
                 "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o",
                 "ffn.0", "ffn.2")

FP8_MAX = 448.0          # torch.finfo(torch.float8_e4m3fn).max
E2M1_MAX = 6.0
NVFP4_GROUP = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def quantized_layer_names(num_layers):
    return [f"blocks.{i}.{s}" for i in range(num_layers) for s in QUANT_LINEARS]


def _comfy_quant_tensor(conf: dict) -> torch.Tensor:
    return torch.tensor(list(json.dumps(conf).encode("utf-8")), dtype=torch.uint8)


def _fp8_scaled(w: torch.Tensor):
    """Per-tensor scaled fp8 e4m3fn, as ComfyUI's TensorCoreFP8Layout.quantize does."""
    w = w.float()
    scale = (w.abs().amax() / FP8_MAX).clamp_min(1e-12).to(torch.float32)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.reshape(())


def _nvfp4(w: torch.Tensor):
    """(qdata uint8 (N, K/2), block_scale fp8 swizzled, global scale f32 ()) via comfy_kitchen."""
    from comfy_kitchen.tensor import QuantizedTensor
    qt = QuantizedTensor.from_float(w.float(), "TensorCoreNVFP4Layout")
    p = qt._params
    assert not p.transposed
    return (qt._qdata.contiguous(), p.block_scale.contiguous(),
            p.scale.to(torch.float32).reshape(()).contiguous())


def encode_state_dict(sd: dict, fmt: str, num_layers: int, other_dtype=torch.bfloat16):
    """Re-encode a float state dict in ``fmt``; returns (tensors, header_metadata)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    if fmt in PLAIN_DTYPES:
        dt = PLAIN_DTYPES[fmt]
        return {k: v.to(dt).contiguous() for k, v in sd.items()}, {}
    layers = quantized_layer_names(num_layers)
    qset = {f"{name}.weight" for name in layers}
    out = {k: v.to(other_dtype).contiguous() for k, v in sd.items() if k not in qset}
    meta = {}
    for name in layers:
        w = sd[f"{name}.weight"]
        if fmt in FP8_PLAIN_DTYPES:
            out[f"{name}.weight"] = w.to(FP8_PLAIN_DTYPES[fmt]).contiguous()
            continue
        if fmt == "nvfp4":
            q, block_scale, scale2 = _nvfp4(w)
            out[f"{name}.weight"] = q
            out[f"{name}.weight_scale"] = block_scale
            out[f"{name}.weight_scale_2"] = scale2
            out[f"{name}.comfy_quant"] = _comfy_quant_tensor({"format": "nvfp4"})
            continue
        q, scale = _fp8_scaled(w)
        out[f"{name}.weight"] = q
        if fmt == "scaled_fp8":
            out[f"{name}.scale_weight"] = scale
        else:
            out[f"{name}.weight_scale"] = scale
            if fmt == "comfy_quant":
                out[f"{name}.comfy_quant"] = _comfy_quant_tensor({"format": "float8_e4m3fn"})
    if fmt == "scaled_fp8":
        out["scaled_fp8"] = torch.tensor([], dtype=torch.float8_e4m3fn)
    if fmt == "quant_metadata":
        meta["_quantization_metadata"] = json.dumps(
            {"format_version": "1.0",
             "layers": {name: {"format": "float8_e4m3fn"} for name in layers}})
    return out, meta


def write_quant_wan(path, fmt, dim=128, num_layers=2, ffn_dim=256, seed=0,
                    other_dtype=torch.bfloat16, pad: int = 0) -> dict:
    """Write a tiny random Wan t2v model in format ``fmt`` (one of FORMATS) to ``path``.

    ``pad``: that many more header bytes (moves every tensor's file offset; the header is
    padded to 8 bytes). The float values are those of ``build_tiny_wan_state_dict(dim, num_layers, ffn_dim,
    float32, seed)`` (so ``original_state_dict`` gives the pre-quantization weights).
    Returns {"path", "fmt", "dim", "blocks", "ffn_dim", "seed", "bytes", "block_bytes",
    "quantized_layers", "other_dtype", "metadata_keys"}.
    """
    from safetensors.torch import save_file

    sd = original_state_dict(dim=dim, num_layers=num_layers, ffn_dim=ffn_dim, seed=seed)
    tensors, meta = encode_state_dict(sd, fmt, num_layers, other_dtype=other_dtype)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"ringswap_test": f"tiny_wan_{fmt}", "seed": str(seed),
                                      **({"ringswap_pad": "." * pad} if pad else {}), **meta})
    os.replace(tmp, path)
    block_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items()
                      if k.startswith("blocks.0."))
    return {"path": path, "fmt": fmt, "dim": dim, "blocks": num_layers, "ffn_dim": ffn_dim,
            "seed": seed, "bytes": os.path.getsize(path), "block_bytes": block_bytes,
            "quantized_layers": [] if fmt in PLAIN_DTYPES else quantized_layer_names(num_layers),
            "other_dtype": None if fmt in PLAIN_DTYPES else str(other_dtype),
            "metadata_keys": sorted(meta)}


def file_offset(path, name: str) -> int:
    """Where tensor `name`'s bytes start in the safetensors file at `path` (from its header)."""
    import struct
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return 8 + n + header[name]["data_offsets"][0]


def write_misaligned_quant_wan(path, fmt, probe="time_embedding.0.weight", **kw) -> dict:
    """write_quant_wan with float32 non-block tensors and the header padded until `probe`'s
    file offset is 8 mod 16 (MKL's CPU matmul rounds differently there than at 0 mod 16)."""
    for pad in range(0, 64, 4):
        info = write_quant_wan(path, fmt, other_dtype=torch.float32, pad=pad, **kw)
        if file_offset(path, probe) % 16 == 8:
            return info
    raise AssertionError(f"{path}: no header padding puts {probe} at 8 mod 16")


def original_state_dict(dim=128, num_layers=2, ffn_dim=256, seed=0) -> dict:
    """The float32 weights ``write_quant_wan`` starts from (before any rounding)."""
    sd, _ = build_tiny_wan_state_dict(dim=dim, num_layers=num_layers, ffn_dim=ffn_dim,
                                      dtype=torch.float32, seed=seed)
    return sd


# ---------------------------------------------------------------------------- decoding

def unswizzle_block_scales(block_scale: torch.Tensor, rows: int, groups: int) -> torch.Tensor:
    """cuBLAS 128x4-tiled block-scale layout -> plain (rows, groups) (same as
    comfy_kitchen.float_utils.from_blocked)."""
    rb, cb = -(-rows // 128), -(-groups // 4)
    t = block_scale.reshape(rb, cb, 32, 4, 4)           # (row tile, col tile, r%32, r//32, c%4)
    t = t.permute(0, 3, 2, 1, 4)                         # (row tile, r//32, r%32, col tile, c%4)
    return t.reshape(rb * 128, cb * 4)[:rows, :groups]


def dequantize_nvfp4(qdata: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor,
                     shape=None) -> torch.Tensor:
    """Pure-torch NVFP4 decode of the on-disk triple to float32 (rows, cols)."""
    rows, packed = qdata.shape
    cols = packed * 2
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    q = qdata.to(torch.uint8)
    codes = torch.stack([q >> 4, q & 0x0F], dim=-1).reshape(rows, cols).long()
    vals = lut[codes]
    bs = unswizzle_block_scales(block_scale.view(torch.float8_e4m3fn), rows, cols // NVFP4_GROUP)
    w = (vals.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
         * bs.float().unsqueeze(-1) * scale_2.float()).reshape(rows, cols)
    if shape is not None:
        w = w[:shape[0], :shape[1]]
    return w.contiguous()


def read_file(path):
    """(tensors, header metadata dict) of a safetensors file."""
    from safetensors import safe_open
    with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})


def detect_format(tensors: dict, metadata: dict) -> str:
    """Name of the encoding used by a file (one of FORMATS, 'mixed' for other
    comfy_quant/metadata mixes)."""
    confs = {json.loads(bytes(v.tolist()).decode("utf-8")).get("format")
             for k, v in tensors.items() if k.endswith(".comfy_quant")}
    if confs:
        return "nvfp4" if confs == {"nvfp4"} else ("comfy_quant" if confs == {"float8_e4m3fn"}
                                                     else "mixed")
    if "_quantization_metadata" in metadata:
        return "quant_metadata"
    if "scaled_fp8" in tensors:
        return "scaled_fp8"
    w = tensors.get("blocks.0.self_attn.q.weight")
    for name, dt in {**PLAIN_DTYPES, **FP8_PLAIN_DTYPES}.items():
        if w is not None and w.dtype == dt:
            return name
    return "fp32"


def dequantized_state_dict(path) -> dict:
    """Every model weight of ``path`` decoded to float32 the way its format defines
    (scale keys, markers and comfy_quant entries are consumed, not returned)."""
    tensors, metadata = read_file(path)
    layers = {}
    for k, v in tensors.items():
        if k.endswith(".comfy_quant"):
            layers[k[:-len(".comfy_quant")]] = json.loads(bytes(v.tolist()).decode("utf-8"))
    if "_quantization_metadata" in metadata:
        qm = json.loads(metadata["_quantization_metadata"])
        for name, conf in qm.get("layers", {}).items():
            layers.setdefault(name, conf)
    out, used = {}, set()
    for name, conf in layers.items():
        fmt = conf.get("format")
        w = tensors[f"{name}.weight"]
        used.update({f"{name}.weight", f"{name}.comfy_quant", f"{name}.weight_scale",
                     f"{name}.weight_scale_2", f"{name}.input_scale"})
        if fmt in ("float8_e4m3fn", "float8_e5m2"):
            scale = tensors.get(f"{name}.weight_scale")
            deq = w.float() * (scale.float() if scale is not None else 1.0)
        elif fmt == "nvfp4":
            deq = dequantize_nvfp4(w, tensors[f"{name}.weight_scale"],
                                   tensors[f"{name}.weight_scale_2"])
        else:
            raise ValueError(f"{path}: layer {name} has unsupported format {fmt!r}")
        out[f"{name}.weight"] = deq
    if "scaled_fp8" in tensors and not layers:
        used.add("scaled_fp8")
        for k, v in tensors.items():
            if k.endswith(".scale_weight"):
                name = k[:-len(".scale_weight")]
                out[f"{name}.weight"] = tensors[f"{name}.weight"].float() * v.float()
                used.update({k, f"{name}.weight"})
            elif k.endswith(".scale_input"):
                used.add(k)
    for k, v in tensors.items():
        if k not in used and k not in out:
            out[k] = v.float() if v.is_floating_point() else v
    return out
