"""Tiny Wan GGUF files as ComfyUI-GGUF reads them, written with the `gguf` package from a tiny
Wan safetensors file: block linear weights quantized with gguf.quants (Q8_0, Q5_0, Q4_0, or a
K-quant: random valid blocks are not what gguf.quants makes, so K-quants are not written
here yet), everything else F32 (or F16), and tensors of more than four dimensions (Wan's patch
embedding) flattened with their shape in `comfy.gguf.orig_shape.<name>`, as ComfyUI-GGUF's
converter stores them."""
from __future__ import annotations

import importlib.util
import os
import sys

import gguf
from safetensors.torch import load_file

QTYPES = {"Q8_0": gguf.GGMLQuantizationType.Q8_0, "Q5_0": gguf.GGMLQuantizationType.Q5_0,
          "Q4_0": gguf.GGMLQuantizationType.Q4_0}


def write_wan_gguf(safetensors_path: str, path: str, qtype: str = "Q8_0", other: str = "F32") -> str:
    """`path` (.gguf) holding the Wan model of `safetensors_path`, block linears in `qtype`."""
    q = QTYPES[qtype]
    block_size = gguf.GGML_QUANT_SIZES[q][0]
    w = gguf.GGUFWriter(path, "wan")
    for key, t in load_file(safetensors_path).items():
        a = t.float().numpy()
        if key.startswith("blocks.") and key.endswith(".weight") and t.ndim == 2 and t.shape[1] % block_size == 0:
            data = gguf.quants.quantize(a, q)
            w.add_tensor(key, data, raw_shape=data.shape, raw_dtype=q)
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
    once under the name ComfyUI would give it; None where it is not installed."""
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
    return sys.modules[name]
