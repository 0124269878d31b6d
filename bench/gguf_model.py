"""Wan-2.1-14B-shaped GGUF files as ComfyUI-GGUF reads them, with random valid quantized blocks.

Block linears in Q8_0 or Q4_K (about 8.5 and 4.5 bits a weight): random codes under small
random scales, so the weights stay near the bench's N(0, 0.02) scale; everything else F16
(2-D and more; Wan's 5-D patch embedding flattened with its shape in
`comfy.gguf.orig_shape.<name>`, as the pack's converter stores it) or F32 (1-D). Written tensor
by tensor with the `gguf` package. compare.py's formats gguf_q8_0 and gguf_q4_k.
"""
from __future__ import annotations

import math
import os

import numpy as np

from common import gb, say

QTYPES = {"gguf_q8_0": "Q8_0", "gguf_q4_k": "Q4_K"}


def is_gguf_format(fmt: str) -> bool:
    return fmt in QTYPES


def random_quantized(qtype, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid `qtype` bytes (rows x bytes a row) for a rows x cols weight."""
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    out = rng.integers(0, 256, (n, size), dtype=np.uint8)
    scales = 2 if qtype == gguf.GGMLQuantizationType.Q4_K else 1   # Q4_K: d and dmin; Q8_0: d
    for k in range(scales):
        out[:, 2 * k:2 * k + 2] = rng.uniform(1e-4, 4e-4, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return out.reshape(rows, cols // block * size)


def _kind(name: str, shape: tuple[int, ...], qtype) -> str:
    import gguf
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if name.startswith("blocks.") and name.endswith(".weight") and len(shape) == 2 and shape[1] % block == 0:
        return "quant"
    return "f16" if len(shape) > 1 else "f32"


def wan14b_gguf(directory: str, fmt: str, small: bool, layers_small: int = 2,
                shape: tuple[int, int, int] | None = None) -> str:
    """A Wan-2.1-14B-shaped .gguf in `fmt` (tiny with `small`; `shape`: (blocks, dim, ffn) instead)
    under `directory`, written once."""
    import gguf
    from model_file import wan_template
    from wan_files import _is_norm_weight
    layers, dim, ffn = shape or ((layers_small, 128, 256) if small else (40, 5120, 13824))
    path = os.path.join(directory, f"wan_{fmt}_l{layers}_d{dim}.gguf")
    if os.path.exists(path):
        return path
    os.makedirs(directory, exist_ok=True)
    qtype = gguf.GGMLQuantizationType[QTYPES[fmt]]
    template = wan_template(layers, dim, ffn)
    tmp = path + ".tmp"
    w = gguf.GGUFWriter(tmp, "wan")
    for name, shape in template:
        kind = _kind(name, shape, qtype)
        if kind == "quant":
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (shape[0], shape[1] // block * size)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
            continue
        if len(shape) > 4:
            w.add_array(f"comfy.gguf.orig_shape.{name}", list(shape))
            shape = (shape[0], math.prod(shape[1:]))
        dt = np.dtype(np.float16 if kind == "f16" else np.float32)
        w.add_tensor_info(name, shape, dt, math.prod(shape) * dt.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    say(f"  {fmt}: writing {len(template)} tensors ({layers} blocks) to {path}")
    for name, shape in template:
        kind = _kind(name, shape, qtype)
        if kind == "quant":
            w.write_tensor_data(random_quantized(qtype, shape[0], shape[1], rng))
            continue
        flat = (shape[0], math.prod(shape[1:])) if len(shape) > 4 else shape
        a = rng.standard_normal(flat, dtype=np.float32) * 0.02
        if _is_norm_weight(name):
            a += 1.0
        w.write_tensor_data(a.astype(np.float16 if kind == "f16" else np.float32))
    w.close()
    os.replace(tmp, path)
    say(f"  {fmt}: wrote {gb(os.path.getsize(path)):.2f} GB")
    return path


def load_pack():
    """ComfyUI-GGUF's package from ComfyUI's custom_nodes (linked there by device_setup.sh
    when `.comfyui-gguf` is carried, and by make test here), its nodes registered as ComfyUI
    registers a pack's; SystemExit naming what to carry where it is missing."""
    import folder_paths
    from gguf_files import comfyui_gguf_pack   # tests/comfyui/support, on sys.path (common)
    comfy_dir = os.path.dirname(folder_paths.__file__)
    pack = comfyui_gguf_pack(comfy_dir)
    if pack is None:
        raise SystemExit(f"gguf formats need ComfyUI-GGUF in {comfy_dir}/custom_nodes (carry .comfyui-gguf; "
                         "bench/DEVICE.md)")
    return pack


def load_stock_gguf(path: str):
    """Unet Loader (GGUF)'s MODEL of `path` (the pack's own node, its default options)."""
    import folder_paths
    load_pack()
    d = os.path.dirname(os.path.abspath(path))
    if d not in folder_paths.get_folder_paths("diffusion_models"):
        folder_paths.add_model_folder_path("diffusion_models", d)
    import nodes
    (model,) = nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(os.path.basename(path))
    return model
