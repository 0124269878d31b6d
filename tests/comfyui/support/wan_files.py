"""Tiny random Wan 2.1 (t2v) diffusion-model files for tests and the demo.

The file is built from ComfyUI's own ``comfy.ldm.wan.model.WanModel`` so its keys and
shapes are exactly what ComfyUI's stock loader (``comfy.sd.load_diffusion_model``, the
UNETLoader node) expects; it is detected as Wan by ``head.modulation`` with
``num_heads = dim // 128``, ``text_dim = 4096``, ``freq_dim = 256``, patch (1, 2, 2).

The caller must have put ComfyUI's folder on ``sys.path`` before calling anything here.

Run as a script to write a file and check that ComfyUI loads it::

    python tests/support/wan_files.py /tmp/tiny_wan.safetensors --comfyui .comfyui
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

WEIGHT_STD = 0.02


def _ensure_comfy_cpu_if_needed():
    """ComfyUI asserts on CUDA when comfy.model_management is first imported on a
    machine without a GPU unless ``args.cpu`` is set before that import."""
    if "comfy.model_management" in sys.modules or torch.cuda.is_available():
        return
    from comfy.cli_args import args
    args.cpu = True


def _static_construction():
    try:
        from ringswap.loaders.comfyui_adapter.comfy_models import static_construction
    except ImportError:   # run as a script, without the pack on sys.path
        return contextlib.nullcontext()
    return static_construction()


def _is_norm_weight(name: str) -> bool:
    # norm_q / norm_k (RMSNorm), norm3 (cross-attn LayerNorm, affine) and any other
    # affine norm: weights around 1, like a trained model.
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) >= 2 and parts[-2].startswith("norm")


def build_tiny_wan_state_dict(dim=256, num_layers=8, ffn_dim=512, dtype=torch.float32,
                              seed=0, in_dim=16, out_dim=16):
    """Return (state_dict, config) of a randomly initialised ComfyUI WanModel (t2v)."""
    if dim < 128 or dim % 128 != 0:
        raise ValueError(f"dim must be a multiple of 128 and >= 128 (ComfyUI derives "
                         f"num_heads = dim // 128), got {dim}")
    if num_layers < 1 or ffn_dim < 1:
        raise ValueError(f"num_layers and ffn_dim must be >= 1, got {num_layers}, {ffn_dim}")
    _ensure_comfy_cpu_if_needed()
    import comfy.ops
    from comfy.ldm.wan.model import WanModel

    config = dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=in_dim, dim=dim,
                  ffn_dim=ffn_dim, freq_dim=256, text_dim=4096, out_dim=out_dim,
                  num_heads=dim // 128, num_layers=num_layers, window_size=(-1, -1),
                  qk_norm=True, cross_attn_norm=True, eps=1e-6)
    # disable_weight_init: no (slow, unseeded) default init; every tensor is set below.
    # Built statically even under dynamic VRAM (whose lazy ops leave weights unset).
    with _static_construction():
        model = WanModel(**config, device="cpu", dtype=torch.float32,
                         operations=comfy.ops.disable_weight_init)
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            if not p.is_floating_point():
                sd[name] = p.clone().contiguous()
                continue
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * WEIGHT_STD
            if _is_norm_weight(name):
                noise += 1.0
            sd[name] = noise.to(dtype).contiguous()
    del model
    return sd, config


def write_tiny_wan(path, dim=256, num_layers=8, ffn_dim=512, dtype=torch.float32,
                   seed=0, in_dim=16, out_dim=16) -> dict:
    """Write a random (seeded, std 0.02, norm weights ~1) Wan t2v model to ``path``.

    Returns {"path", "dim", "blocks", "bytes", "ffn_dim", "num_heads", "dtype", "seed",
    "block_bytes"}.
    """
    from safetensors.torch import save_file

    sd, config = build_tiny_wan_state_dict(dim=dim, num_layers=num_layers, ffn_dim=ffn_dim,
                                           dtype=dtype, seed=seed, in_dim=in_dim,
                                           out_dim=out_dim)
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(sd, tmp, metadata={"ringswap_test": "tiny_wan", "seed": str(seed)})
    os.replace(tmp, path)
    block_bytes = sum(t.numel() * t.element_size() for k, t in sd.items()
                      if k.startswith("blocks.0."))
    return {"path": path, "dim": dim, "blocks": num_layers, "bytes": os.path.getsize(path),
            "ffn_dim": ffn_dim, "num_heads": config["num_heads"], "dtype": str(dtype),
            "seed": seed, "block_bytes": block_bytes}


def load_with_comfy(path, model_options=None):
    """Load ``path`` with ComfyUI's stock loader; returns the ModelPatcher."""
    _ensure_comfy_cpu_if_needed()
    import comfy.sd
    return comfy.sd.load_diffusion_model(os.fspath(path), model_options=model_options or {})


def check_tiny_wan(path, dim=256, num_layers=8, ffn_dim=512, in_dim=16, out_dim=16) -> dict:
    """Load with ComfyUI and assert the detected unet config matches; returns it."""
    patcher = load_with_comfy(path)
    cfg = dict(patcher.model.model_config.unet_config)
    expected = {"image_model": "wan2.1", "model_type": "t2v", "dim": dim,
                "num_layers": num_layers, "ffn_dim": ffn_dim, "num_heads": dim // 128,
                "in_dim": in_dim, "out_dim": out_dim, "freq_dim": 256}
    bad = {k: (cfg.get(k), v) for k, v in expected.items() if cfg.get(k) != v}
    if bad:
        raise AssertionError(f"ComfyUI detected a different config for {path}: "
                             f"{{key: (detected, expected)}} = {bad}; full config {cfg}")
    if len(patcher.model.diffusion_model.blocks) != num_layers:
        raise AssertionError("wrong number of blocks built by ComfyUI")
    return cfg


if __name__ == "__main__":
    import argparse
    import time

    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--comfyui", default=os.environ.get("RINGSWAP_COMFYUI_DIR", ".comfyui"))
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    sys.path.insert(0, os.path.abspath(a.comfyui))
    t0 = time.perf_counter()
    info = write_tiny_wan(a.path, dim=a.dim, num_layers=a.layers, ffn_dim=a.ffn,
                          dtype=getattr(torch, a.dtype))
    t1 = time.perf_counter()
    print("wrote", info, f"in {t1 - t0:.2f}s")
    cfg = check_tiny_wan(a.path, dim=a.dim, num_layers=a.layers, ffn_dim=a.ffn)
    print("ComfyUI detected unet config:", cfg, f"(load {time.perf_counter() - t1:.2f}s)")
