"""RingSwap on ComfyUI 0.33 with dynamic VRAM against ComfyUI's own dynamic VRAM (issue 10).

A Wan-2.1-14B-shaped bf16 file (stream.py's writer: ComfyUI's WanModel keys, random
weights) is sampled through ComfyUI's own sampling path (comfy.sample.sample, euler,
cfg 1: one forward per step) in three configurations, each in its own process started
the way ComfyUI 0.33's main.py starts on NVIDIA (dynamic VRAM on), with a ballast
process holding all but --cap-gib of the GPU's free memory:
  stock   Load Diffusion Model (comfy.sd.load_diffusion_model): ComfyUI's dynamic VRAM
  patch   the same MODEL through RingSwap Patch, window 0 (auto), prefetch 1
  loader  RingSwap Model Loader, home ram, window 0, prefetch 1
Per configuration and token count: median s/step of the steps after the first, the first
step, load time, host RSS peak (psutil, sampled) and its growth from before the load
against the model's bytes, torch's VRAM peak.

    source scripts/device_setup.sh && RINGSWAP_COMFY=0.33 ... python3 bench/dynamic_vram.py --json $OUT/dyn.json
Tiny CPU run of every code path (meaningless numbers): .venv/bin/python bench/dynamic_vram.py --small
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stream  # noqa: E402  (ComfyUI and tests/support on sys.path, the model writer)

CONFIGS = ("stock", "patch", "loader")


def child(a) -> dict:
    """One configuration in this process: start ComfyUI's dynamic VRAM, load, sample."""
    from comfy.cli_args import args
    if a.device == "cpu":
        args.cpu = True
    import dynamic_vram   # tests/support: what ComfyUI 0.33's main.py does
    dynamic_vram.init_library()
    import comfy.sample
    import comfy.sd
    dynamic_vram.enable()
    from ringswap.loaders.model_loader import load_swapped_model
    from ringswap.loaders.swap_patcher import SwapSettings
    from ringswap.nodes.patch import RingSwapPatch

    rss_base = stream.rss_bytes()
    rss = stream.RssSampler(0.05).start()
    t0 = time.perf_counter()
    if a.child == "loader":
        model = load_swapped_model(a.path, SwapSettings(0, 1, "auto"), home="ram")
    else:
        model = comfy.sd.load_diffusion_model(a.path)
        if a.child == "patch":
            (model,) = RingSwapPatch().patch(model, 0, 1, "auto")
    load_s = time.perf_counter() - t0
    out = {"config": a.child, "patcher": type(model).__name__, "load_s": load_s, "rows": []}
    for tokens in a.tokens:
        f, h, w = stream.latent_shape(tokens)
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(1, 16, f, h, w, generator=g)
        cond = [[torch.randn(1, a.ctx_len, 4096, generator=g), {}]]
        stamps = []
        t0 = time.perf_counter()
        comfy.sample.sample(model, noise, a.steps, 1.0, "euler", "simple", cond, cond, torch.zeros_like(noise),
                            callback=lambda *_: stamps.append(time.perf_counter()), disable_pbar=True, seed=0)
        steps = [b - a_ for a_, b in zip([t0] + stamps[:-1], stamps)]
        row = {"tokens": tokens, "first_step_s": steps[0], "s_per_step": statistics.median(steps[1:]),
               "steps": steps}
        if torch.cuda.is_available():
            free, total = torch.cuda.mem_get_info()
            row["vram_torch_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            torch.cuda.reset_peak_memory_stats()
        engine = getattr(model, "swap_engine", None)
        if engine is not None and engine.plan is not None:
            row["window"] = engine.plan.window
            row["plan"] = engine.plan.describe()
        out["rows"].append(row)
    out["rss_peak_gb"] = rss.stop() / 1e9
    out["model_gb"] = os.path.getsize(a.path) / 1e9
    out["rss_base_gb"] = rss_base / 1e9
    out["rss_over_model"] = (out["rss_peak_gb"] - out["rss_base_gb"]) / out["model_gb"]
    return out


def run_config(a, config: str) -> dict:
    ballast = None
    if a.device == "cuda" and a.cap_gib > 0:
        ballast = subprocess.Popen([sys.executable, "-c", stream.BALLAST, str(a.cap_gib)], stdout=subprocess.PIPE, text=True)
        stream.say(f"[dyn] ballast: {ballast.stdout.readline().strip()}")
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--path", a.path, "--device", a.device,
               "--steps", str(a.steps), "--ctx-len", str(a.ctx_len), "--tokens", *map(str, a.tokens)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.config_timeout_s)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not lines:
            return {"config": config, "error": (p.stderr or p.stdout)[-3000:], "rc": p.returncode}
        r = json.loads(lines[-1][len("RESULT "):])
        r["wall_s"] = time.perf_counter() - t0
        r["log_tail"] = [ln for ln in p.stderr.splitlines() if "RingSwap" in ln][-6:]
        return r
    finally:
        if ballast is not None:
            ballast.kill()
            ballast.wait()


def table(results: list[dict]) -> str:
    lines = ["| configuration | tokens | s/step | vs stock | first step s | load s | RSS peak GB (growth / model) | window |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    stock = {r["tokens"]: r["s_per_step"] for res in results if res.get("config") == "stock" and "rows" in res
             for r in res["rows"]}
    for res in results:
        if "error" in res:
            lines.append(f"| {res['config']} | — | failed (rc {res['rc']}) | | | | | |")
            continue
        for r in res["rows"]:
            ratio = r["s_per_step"] / stock[r["tokens"]] if r["tokens"] in stock else None
            lines.append(f"| {res['config']} ({res['patcher']}) | {r['tokens']:,} | {r['s_per_step']:.3f} | "
                         f"{stream.fmt_num(ratio, '.3f')} | {r['first_step_s']:.2f} | {res['load_s']:.1f} | "
                         f"{res['rss_peak_gb']:.1f} ({res['rss_over_model']:.2f}) | {r.get('window', '—')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny model (CPU check of the code paths)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 7800 32760 (--small: 64)")
    ap.add_argument("--steps", type=int, default=5, help="sampling steps (the first is reported apart)")
    ap.add_argument("--ctx-len", type=int, default=512)
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory left free by the ballast (0: none)")
    ap.add_argument("--dir", default="/tmp/ringswap_bench")
    ap.add_argument("--drop-cache", action="store_true", help="evict the file from the page cache before each")
    ap.add_argument("--config-timeout-s", type=float, default=400.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.tokens = a.tokens or ([64] if a.small else [7800, 32760])
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    if a.device == "cpu":
        from comfy.cli_args import args
        args.cpu = True
    a.path = stream.wan14b_file(a.dir, "bf16", a.small, a.device)
    if a.device == "cuda":
        torch.cuda.empty_cache()   # the ballast sizes itself from what is free now
    results = []
    for config in a.configs:
        if a.drop_cache:
            stream.drop_page_cache(a.path, "auto")
        results.append(run_config(a, config))
        stream.say(json.dumps(results[-1])[:1500])
    out = table(results)
    print(out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": stream.env_info(torch.device(a.device)), "cap_gib": a.cap_gib, "results": results,
                       "table": out}, f, indent=1)


if __name__ == "__main__":
    main()
