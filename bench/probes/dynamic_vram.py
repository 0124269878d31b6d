"""RingSwap on ComfyUI 0.33 with dynamic VRAM against ComfyUI's own dynamic VRAM (issue 10).

A Wan-2.1-14B-shaped bf16 file (model_file.py's writer: ComfyUI's WanModel keys, random
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

    source scripts/device_setup.sh && RINGSWAP_COMFY=0.33 ... python3 bench/probes/dynamic_vram.py --json $OUT/dyn.json
Tiny CPU run of every code path (fp32, meaningless numbers): .venv/bin/python bench/probes/dynamic_vram.py --small
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (ComfyUI and tests/comfyui/support on sys.path)
from model_file import wan14b_file  # noqa: E402

CONFIGS = ("stock", "patch", "loader")


def child(a) -> dict:
    """One configuration in this process: start ComfyUI's dynamic VRAM, load, sample."""
    from comfy.cli_args import args
    if a.device == "cpu":
        args.cpu = True
    import dynamic_vram   # tests/comfyui/support: what ComfyUI 0.33's main.py does
    dynamic_vram.init_library()
    import comfy.sd
    dynamic_vram.enable()
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    from ringswap.nodes.patch import RingSwapPatch

    rss_base = common.rss_bytes()
    rss = common.RssSampler(0.05).start()
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
        steps = common.sample_steps(model, tokens, a.steps, a.ctx_len)
        row = {"tokens": tokens, "first_step_s": steps[0], "s_per_step": common.steady_s(steps),
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
    """One configuration in a child process behind the ballast."""
    with common.Ballast(a.cap_gib if a.device == "cuda" else 0, a.device) as ballast:
        if ballast.line:
            common.say(f"[dyn] ballast: {ballast.line}")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", config, "--path", a.path,
               *common.child_args(a, ["device", "steps", "ctx_len", "tokens"])]
        r = common.child_result(cmd, a.config_timeout_s)
    r.setdefault("config", config)
    return r


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
                         f"{common.fmt_num(ratio, '.3f')} | {r['first_step_s']:.2f} | {res['load_s']:.1f} | "
                         f"{res['rss_peak_gb']:.1f} ({res['rss_over_model']:.2f}) | {r.get('window', '—')} |")
    return "\n".join(lines)


def main() -> None:
    ap = common.base_parser(__doc__, CONFIGS)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--steps", type=int, default=5, help="sampling steps (the first is reported apart)")
    ap.add_argument("--cap-gib", type=float, default=24.0, help="GPU memory left free by the ballast (0: none)")
    ap.add_argument("--drop-cache", action="store_true", help="evict the file from the page cache before each")
    ap.add_argument("--config-timeout-s", type=float, default=400.0)
    a = ap.parse_args()
    if common.start(a, child):
        return
    # --small: fp32, since 0.33's dynamic VRAM on a CPU runs bf16 weights uncast (as compare.py)
    a.path = wan14b_file(a.dir, "fp32" if a.small else "bf16", a.small, a.device)
    results = []
    for config in a.configs:
        if a.drop_cache:
            from io_rates import drop_page_cache
            drop_page_cache(a.path, "auto")
        results.append(run_config(a, config))
        common.say(json.dumps(results[-1])[:1500])
    out = table(results)
    print(out)
    common.write_json(a.json, {"env": common.env_info(torch.device(a.device)), "cap_gib": a.cap_gib,
                               "results": results, "table": out})


if __name__ == "__main__":
    main()
