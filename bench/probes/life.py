"""Wan 2.2-style two-expert runs through ComfyUI's samplers: switch time and flatness.

Two Wan-14B-shaped experts (random bf16 weights) made block-swapping with the RingSwap
Patch node; each run samples the high-noise expert for the first half of the steps and
the low-noise one for the rest with the stock KSamplerAdvanced. Over `--runs` runs it
records the expert switch time (from the `RingSwap plan:` lines), process RSS, pinned
bytes and VRAM after every run. Usage (repo root, on the GPU machine):
    python bench/probes/life.py --runs 20
    python bench/probes/life.py --small --runs 4        # CPU smoke test
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time

import psutil
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/probes/ -> the repo
COMFY = os.environ.get("RINGSWAP_COMFYUI_DIR") or os.path.join(REPO, ".comfyui")
sys.path.insert(0, COMFY)
sys.path.insert(0, os.path.join(COMFY, "custom_nodes"))
from comfy.cli_args import args  # noqa: E402

if not torch.cuda.is_available():
    args.cpu = True
import comfy.model_detection  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.model_patcher  # noqa: E402
import nodes as comfy_nodes  # noqa: E402

from ringswap.nodes.patch import RingSwapPatch  # noqa: E402


class LoadLines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def make_expert(layers: int, dim: int, ffn: int, seed: int):
    """A ComfyUI Wan model built by its own detection + model class, random weights
    generated on the compute device block by block and kept on the CPU."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tests_support_shapes import wan_meta_state_dict
    sd = wan_meta_state_dict(layers, dim, ffn)
    cfg = comfy.model_detection.model_config_from_unet(sd, "")
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    cfg.set_inference_dtype(dtype, None)
    model = cfg.get_model(sd, "")
    dev = comfy.model_management.get_torch_device()
    g = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.diffusion_model.named_parameters():
            w = torch.randn(p.shape, generator=g, device=dev, dtype=torch.float32).mul_(0.02)
            if name.split(".")[-2].startswith("norm"):
                w.add_(1.0)
            p.data = w.to(p.dtype).cpu()   # ComfyUI chose each dtype (patch_embedding stays fp32)
    patcher = comfy.model_patcher.ModelPatcher(model, load_device=dev,
                                               offload_device=comfy.model_management.unet_offload_device())
    return patcher


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    layers, dim, ffn, hw = (4, 256, 512, 16) if a.small else (40, 5120, 13824, 128)
    handler = LoadLines()
    logging.getLogger("ringswap").addHandler(handler)
    logging.getLogger("ringswap").setLevel(logging.INFO)
    t0 = time.perf_counter()
    high = RingSwapPatch().patch(make_expert(layers, dim, ffn, 1), a.window, 1, "auto")[0]
    low = RingSwapPatch().patch(make_expert(layers, dim, ffn, 2), a.window, 1, "auto")[0]
    print(f"built two experts ({layers} blocks, dim {dim}) in {time.perf_counter() - t0:.1f}s", flush=True)
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, 512, 4096, generator=g), {}]]
    neg = [[torch.randn(1, 512, 4096, generator=g), {}]]
    lat = {"samples": torch.zeros(1, 16, 1, hw, hw)}
    proc = psutil.Process()
    adv = comfy_nodes.KSamplerAdvanced()
    rows = []
    for run in range(a.runs):
        t1 = time.perf_counter()
        (mid,) = adv.sample(high, "enable", run, a.steps, 1.0, "euler", "simple", pos, neg, lat, 0,
                            a.steps // 2, "enable")
        (out,) = adv.sample(low, "disable", run, a.steps, 1.0, "euler", "simple", pos, neg, mid,
                            a.steps // 2, 10000, "disable")
        wall = time.perf_counter() - t1
        pinned = high.swap_engine.pool.pinned_bytes + low.swap_engine.pool.pinned_bytes
        vram = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        reserved = torch.cuda.memory_reserved() if torch.cuda.is_available() else 0
        rows.append({"run": run, "wall_s": wall, "rss": proc.memory_info().rss, "pinned": pinned,
                     "vram": vram, "vram_reserved": reserved,
                     "attached": [m.swap_engine.att is not None for m in (high, low)]})
        print(f"run {run:2d}: {wall:.2f}s rss {rows[-1]['rss'] / 1e9:.2f} GB pinned {pinned / 1e9:.2f} GB "
              f"vram {vram / 1e9:.2f} GB (reserved {reserved / 1e9:.2f})", flush=True)
    switch = [float(m.group(1)) for line in handler.lines
              if "switched from another" in line and (m := re.search(r"placed in ([0-9.]+) s \(switched", line))]
    base = rows[1]
    growth = {k: (max(r[k] for r in rows[2:]) - base[k]) / max(base[k], 1) for k in ("rss", "pinned", "vram")}
    print(f"\nexpert switches: {len(switch)}, median {sorted(switch)[len(switch) // 2]:.3f} s, "
          f"max {max(switch):.3f} s" if switch else "no switch lines")
    print("growth after run 2 (max of runs 3.. vs run 2): " +
          ", ".join(f"{k} {100 * v:+.2f}%" for k, v in growth.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "switch_s": switch, "growth": growth}, f, indent=1)


if __name__ == "__main__":
    main()
