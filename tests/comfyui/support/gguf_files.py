"""Tiny Wan GGUF files as ComfyUI-GGUF reads them, written with the `gguf` package from a tiny
Wan safetensors file: block linear weights quantized with gguf.quants (Q8_0, Q5_0, Q4_0), or
K-quants (Q4_K, Q5_K, Q6_K) made of random valid blocks where a row holds whole 256-weight
super-blocks (gguf.quants does not quantize K-quants; the other linears then Q8_0), everything else F32 (or F16), and tensors of more than four dimensions (Wan's patch
embedding) flattened with their shape in `comfy.gguf.orig_shape.<name>`, as ComfyUI-GGUF's
converter stores them."""
from __future__ import annotations

import importlib.util
import os
import sys

import gguf
import numpy as np
from safetensors.torch import load_file

QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q5_0": gguf.GGMLQuantizationType.Q5_0,
          "Q4_0": gguf.GGMLQuantizationType.Q4_0, "Q4_K": gguf.GGMLQuantizationType.Q4_K,
          "Q5_K": gguf.GGMLQuantizationType.Q5_K, "Q6_K": gguf.GGMLQuantizationType.Q6_K}
# where a GGML block's fp16 fields (d, and dmin or m) are, for the types the tests write at random
HALF_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
K_QUANTS = {getattr(gguf.GGMLQuantizationType, k): HALF_FIELDS[k] for k in ("Q4_K", "Q5_K", "Q6_K")}


def random_k_quant(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid K-quant bytes for a rows x cols weight: per 256 weights random bytes, with the fp16
    fields (d, and dmin where the type has one) small finite values."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, (n, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in K_QUANTS[qtype]:
        blocks[:, at:at + 2] = rng.uniform(1e-4, 5e-4, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, -1)


BLOCK_LISTS = ("blocks.", "vace_blocks.", "double_blocks.", "single_blocks.")


def write_wan_gguf(safetensors_path: str, path: str, qtype: str = "Q8_0", other: str = "F32",
                   arch: str = "wan", bf16_1d: bool = False, nonblock_linears: bool = False) -> str:
    """`path` (.gguf) holding the model of `safetensors_path` (Wan unless `arch` says another
    of ComfyUI-GGUF's architectures, e.g. "flux"), block linears in `qtype`; `bf16_1d`: the
    blocks' 1-D tensors in BF16 (which ComfyUI-GGUF converts to F32 when it loads them);
    `nonblock_linears`: the linears outside the blocks quantized too (text and time embeddings,
    head), as ComfyUI-GGUF's converter writes a real Wan file."""
    q = QTYPES[qtype]
    w = gguf.GGUFWriter(path, arch)
    for n, (key, t) in enumerate(load_file(safetensors_path).items()):
        a = t.float().numpy()
        if bf16_1d and t.ndim == 1 and key.startswith(BLOCK_LISTS):
            data = gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16)
            w.add_tensor(key, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
            continue
        linear = (nonblock_linears or key.startswith(BLOCK_LISTS)) and key.endswith(".weight") and t.ndim == 2
        if linear and q in K_QUANTS and t.shape[1] % 256 == 0:
            data = random_k_quant(q, *t.shape, seed=n)
            w.add_tensor(key, data, raw_shape=data.shape, raw_dtype=q)
            continue
        kind = gguf.GGMLQuantizationType.Q8_0 if q in K_QUANTS else q
        if linear and t.shape[1] % gguf.GGML_QUANT_SIZES[kind][0] == 0:
            data = gguf.quants.quantize(a, kind)
            w.add_tensor(key, data, raw_shape=data.shape, raw_dtype=kind)
            continue
        if t.ndim > 4:
            w.add_array(f"comfy.gguf.orig_shape.{key}", list(t.shape))
            a = a.reshape(t.shape[0], -1)
        w.add_tensor(key, a.astype("float16") if other == "F16" and t.ndim > 1 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def comfyui_gguf_pack(comfy_dir: str):
    """ComfyUI-GGUF's package as linked into `comfy_dir`/custom_nodes by `make test`, imported
    once under the name ComfyUI would give it and its nodes registered as ComfyUI registers a
    pack's; None where it is not installed."""
    root = os.path.join(comfy_dir, "custom_nodes", "ComfyUI-GGUF")
    if not os.path.isfile(os.path.join(root, "nodes.py")):
        return None
    name = "ComfyUI-GGUF"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(root, "__init__.py"),
                                                      submodule_search_locations=[root])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[name] = pack
        spec.loader.exec_module(pack)
        import nodes   # what ComfyUI's custom node loading does with a pack's nodes
        nodes.NODE_CLASS_MAPPINGS.update(pack.NODE_CLASS_MAPPINGS)
    return sys.modules[name]
