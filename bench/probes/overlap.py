"""Step time of RingSwap vs. fully resident on a Wan-14B-shaped model (H200).

ComfyUI's own WanModel with Wan 2.1 14B t2v sizes (40 blocks, dim 5120, ffn 13824,
40 heads, random bf16 weights), one denoising step = one forward of the diffusion
model. Rows: fully resident; RingSwap at the given windows (prefetch 1, pinned home).
Usage (repo root, ComfyUI on sys.path via RINGSWAP_COMFYUI_DIR):
    python bench/probes/overlap.py --tokens 32760 7800 --windows 4 20 --steps 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/probes/ -> the repo
COMFY = os.environ.get("RINGSWAP_COMFYUI_DIR") or os.path.join(REPO, ".comfyui")
sys.path.insert(0, COMFY)
sys.path.insert(0, os.path.join(COMFY, "custom_nodes"))

import comfy.ops  # noqa: E402
from comfy.ldm.wan.model import WanModel  # noqa: E402

from ringswap.swap import BlockSwapEngine  # noqa: E402
from ringswap.swap.load_plan import RunFacts, SwapSettings, plan_load  # noqa: E402

# latent (frames, height, width) for a token count: tokens = f * (h/2) * (w/2)
SHAPES = {32760: (21, 60, 104), 7800: (5, 60, 104), 75600: (21, 90, 160), 4096: (1, 128, 128)}


def build(layers: int, dim: int, ffn: int, device: str = "cuda") -> WanModel:
    torch.manual_seed(0)
    m = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=dim, ffn_dim=ffn, freq_dim=256,
                 text_dim=4096, out_dim=16, num_heads=dim // 128, num_layers=layers,
                 device=device, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.02)
            if name.split(".")[-2].startswith("norm"):
                p.add_(1.0)
    return m.eval()


def step_times(model, x, t, ctx, steps: int) -> list[float]:
    times = []
    with torch.no_grad():
        for i in range(steps + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model(x, t, ctx)
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[32760])
    ap.add_argument("--windows", type=int, nargs="+", default=[4])
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--ffn", type=int, default=13824)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    t0 = time.perf_counter()
    model = build(a.layers, a.dim, a.ffn)
    dev = torch.device("cuda")
    print(f"built WanModel {a.layers}x{a.dim} on GPU in {time.perf_counter() - t0:.1f}s; "
          f"{torch.cuda.memory_allocated() / 1e9:.1f} GB", flush=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    inputs = {}
    for tok in a.tokens:
        f, h, w = SHAPES[tok]
        inputs[tok] = (torch.randn(1, 16, f, h, w, device=dev, dtype=torch.bfloat16, generator=g),
                       torch.tensor([500.0], device=dev),
                       torch.randn(1, 512, 4096, device=dev, dtype=torch.bfloat16, generator=g))
    rows = []
    for tok in a.tokens:
        ts = step_times(model, *inputs[tok], a.steps)
        rows.append({"tokens": tok, "config": "resident", "median_s": statistics.median(ts), "times": ts})
        print(f"resident  tokens={tok}: {statistics.median(ts):.3f} s/step {['%.3f' % x for x in ts]}", flush=True)

    engine = BlockSwapEngine(list(model.blocks))
    for window in a.windows:
        t0 = time.perf_counter()
        plan = engine.attach(dev, plan_load(engine.facts(), RunFacts(str(dev), 1 << 50, 0), SwapSettings(window, a.prefetch)))
        attach_s = time.perf_counter() - t0
        torch.cuda.empty_cache()
        print(f"attached window={window}: {plan.describe()}, {engine.memory} memory, "
              f"{engine.device_bytes() / 1e9:.1f} GB of blocks on GPU, attach {attach_s:.1f}s, "
              f"GPU allocated {torch.cuda.memory_allocated() / 1e9:.1f} GB", flush=True)
        for tok in a.tokens:
            engine.end_run()
            ts = step_times(model, *inputs[tok], a.steps)
            st = engine.end_run()
            res = next(r for r in rows if r["tokens"] == tok and r["config"] == "resident")
            ratio = statistics.median(ts) / res["median_s"]
            rows.append({"tokens": tok, "config": f"window {window} prefetch {a.prefetch}",
                         "median_s": statistics.median(ts), "ratio": ratio, "times": ts,
                         "gbps": st.gbps, "copy_s": st.copy_s, "wait_s": st.wait_s,
                         "bytes": st.bytes_copied, "memory": st.memory})
            print(f"ringswap  tokens={tok} window={window}: {statistics.median(ts):.3f} s/step "
                  f"= {ratio:.3f}x resident; {st.line()}", flush=True)
        engine.detach()
    print("\n| tokens | configuration | s/step (median) | vs resident |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tokens']} | {r['config']} | {r['median_s']:.3f} | {r.get('ratio', 1.0):.3f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
