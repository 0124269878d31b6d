"""The automatic window against a sweep of manual windows, under VRAM caps (issue 12).

A Wan-2.1-14B-shaped file (stream.py's writer, random weights; bf16 or scaled fp8) goes
through Load Diffusion Model -> RingSwap Patch -> ComfyUI's own sampling path
(comfy.sample.sample, euler, cfg 1: one model call per step). Per cap, one process (with
dynamic VRAM started as ComfyUI 0.33's main.py does when RINGSWAP_DYNAMIC_VRAM=1) behind
a ballast process holding all but --caps GiB of the GPU. Per workload: window 0 (auto),
then manual windows around the one it chose; per run the median s/step after the first
step, the plan line, any out-of-memory shrink, torch's VRAM peak.

    source scripts/device_setup.sh && python3 bench/auto_window.py --format bf16 --json $OUT/auto.json
Tiny CPU run of every code path (meaningless numbers): .venv/bin/python bench/auto_window.py --small
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import stream  # noqa: E402  (ComfyUI and tests/support on sys.path, the model writer)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def child(a) -> dict:
    """One cap in this process: load once, then sample at the auto window and the sweep."""
    from comfy.cli_args import args
    if a.device == "cpu":
        args.cpu = True
    dyn = os.environ.get("RINGSWAP_DYNAMIC_VRAM") == "1"
    if dyn:
        import dynamic_vram   # tests/support: what ComfyUI 0.33's main.py does
        dynamic_vram.init_library()
    import comfy.model_management as mm
    import comfy.sample
    import comfy.sd
    if dyn:
        dynamic_vram.enable()
    from ringswap.nodes.patch import RingSwapPatch

    lines = Lines()
    logging.getLogger("ringswap").addHandler(lines)
    logging.getLogger("ringswap").setLevel(logging.INFO)
    t0 = time.perf_counter()
    stock = comfy.sd.load_diffusion_model(a.path)
    out = {"dynamic_vram": dyn, "stock_load_s": time.perf_counter() - t0, "rows": []}
    keep = []   # the patched MODELs keep RingSwap's own load of a dynamic MODEL alive (read once)

    def run(tokens: int, window: int, steps: int) -> dict:
        f, h, w = stream.latent_shape(tokens)
        g = torch.Generator().manual_seed(0)
        noise = torch.randn(1, 16, f, h, w, generator=g)
        cond = [[torch.randn(1, a.ctx_len, 4096, generator=g), {}]]
        t0 = time.perf_counter()
        (model,) = RingSwapPatch().patch(stock, window, 1, "auto")
        keep.append(model)
        row = {"tokens": tokens, "set_window": window, "patch_s": time.perf_counter() - t0}
        start = len(lines.lines)
        stamps = []
        t0 = time.perf_counter()
        try:
            comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", cond, cond, torch.zeros_like(noise),
                                callback=lambda *_: stamps.append(time.perf_counter()), disable_pbar=True, seed=0)
        except torch.OutOfMemoryError as e:
            row["error"] = str(e).splitlines()[0][:300]
        times = [b - a_ for a_, b in zip([t0] + stamps[:-1], stamps)]
        new = lines.lines[start:]
        plan = next((ln for ln in new if ln.startswith("RingSwap plan:")), "")
        summary = next((ln for ln in new if ln.startswith("RingSwap run:")), "")
        row.update(first_step_s=times[0] if times else None,
                   s_per_step=statistics.median(times[1:]) if len(times) > 1 else None,
                   window=int(m.group(1)) if (m := re.search(r"window (\d+) of", plan)) else None,
                   shrinks=re.findall(r"out of memory: window (\d+) -> (\d+)", summary), plan=plan, run=summary)
        if torch.cuda.is_available():
            row["vram_torch_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        mm.unload_all_models()
        mm.soft_empty_cache()
        stream.say(f"[auto] {tokens} tokens, window {window or 'auto'} -> {row.get('window')}: "
                   f"{stream.fmt_num(row['s_per_step'], '.3f')} s/step {row['shrinks'] or ''} {row.get('error', '')}")
        return row

    for tokens in a.tokens:
        steps = a.steps_long if tokens > 10000 else a.steps_short
        auto = run(tokens, 0, steps)
        out["rows"].append(auto)
        chosen = auto["window"] or 1
        n = int(re.search(r"of (\d+)", auto["plan"]).group(1)) if auto["plan"] else chosen
        for w in sorted({chosen + d for d in a.sweep} - {chosen}):
            if 1 <= w <= n:
                out["rows"].append(run(tokens, w, steps))
    return out


def run_cap(a, cap: float) -> dict:
    ballast = None
    if a.device == "cuda" and cap > 0:
        torch.cuda.empty_cache()
        ballast = subprocess.Popen([sys.executable, "-c", stream.BALLAST, str(cap)], stdout=subprocess.PIPE, text=True)
        stream.say(f"[auto] cap {cap} GiB, ballast: {ballast.stdout.readline().strip()}")
    try:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--path", a.path, "--device", a.device,
               "--steps-short", str(a.steps_short), "--steps-long", str(a.steps_long), "--ctx-len", str(a.ctx_len),
               "--sweep", *map(str, a.sweep), "--tokens", *map(str, a.tokens)]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.cap_timeout_s)
        found = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode != 0 or not found:
            return {"cap_gib": cap, "error": (p.stderr or p.stdout)[-3000:], "rc": p.returncode}
        r = json.loads(found[-1][len("RESULT "):])
        r.update(cap_gib=cap, wall_s=time.perf_counter() - t0)
        return r
    except subprocess.TimeoutExpired as e:
        return {"cap_gib": cap, "error": f"timed out after {a.cap_timeout_s} s: {(e.stderr or b'')[-2000:]}", "rc": 124}
    finally:
        if ballast is not None:
            ballast.kill()
            ballast.wait()


def verdicts(res: dict) -> list[dict]:
    """Per workload: the auto window's s/step against the best manual window that ran clean."""
    out = []
    for tokens in sorted({r["tokens"] for r in res.get("rows", [])}):
        rows = [r for r in res["rows"] if r["tokens"] == tokens]
        auto = next(r for r in rows if r["set_window"] == 0)
        clean = [r for r in rows if r["set_window"] and r["s_per_step"] and not r["shrinks"] and "error" not in r]
        best = min(clean, key=lambda r: r["s_per_step"], default=None)
        ratio = auto["s_per_step"] / best["s_per_step"] if best and auto["s_per_step"] else None
        out.append({"tokens": tokens, "auto_window": auto["window"], "auto_s": auto["s_per_step"],
                    "auto_oom": bool(auto["shrinks"] or "error" in auto), "best_window": best and best["window"],
                    "best_s": best and best["s_per_step"], "ratio": ratio,
                    "sweep": {r["set_window"]: ("OOM" if "error" in r else
                                                f"{r['s_per_step']:.3f}" + (" (shrunk)" if r["shrinks"] else ""))
                              for r in rows if r["set_window"]}})
    return out


def table(fmt: str, results: list[dict]) -> str:
    lines = ["| format | cap GiB | tokens | auto window | auto s/step | OOM | best manual (window: s/step) | "
             "auto / best | sweep |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        if "error" in res:
            lines.append(f"| {fmt} | {res['cap_gib']} | — | failed (rc {res['rc']}) | | | | | |")
            continue
        for v in verdicts(res):
            sweep = ", ".join(f"{w}: {s}" for w, s in sorted(v["sweep"].items()))
            lines.append(f"| {fmt} | {res['cap_gib']:g} | {v['tokens']:,} | {v['auto_window']} | "
                         f"{stream.fmt_num(v['auto_s'], '.3f')} | {'yes' if v['auto_oom'] else 'no'} | "
                         f"{v['best_window']}: {stream.fmt_num(v['best_s'], '.3f')} | "
                         f"{stream.fmt_num(v['ratio'], '.3f')} | {sweep} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny model (CPU check of the code paths)")
    ap.add_argument("--format", default="bf16", choices=["bf16", "scaled_fp8"])
    ap.add_argument("--caps", type=float, nargs="+", default=[24, 16, 12], help="GiB left free by the ballast")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 7800 32760 (--small: 64)")
    ap.add_argument("--sweep", type=int, nargs="+", default=[-3, 1, 2], help="manual windows: auto + these")
    ap.add_argument("--steps-short", type=int, default=6)
    ap.add_argument("--steps-long", type=int, default=3)
    ap.add_argument("--ctx-len", type=int, default=512)
    ap.add_argument("--dir", default="/tmp/ringswap_bench")
    ap.add_argument("--cap-timeout-s", type=float, default=200.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.tokens = a.tokens or ([64] if a.small else [7800, 32760])
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    if a.device == "cpu":
        from comfy.cli_args import args
        args.cpu = True
    a.path = stream.wan14b_file(a.dir, a.format, a.small, a.device, layers_small=4)
    results = []
    for cap in (a.caps if a.device == "cuda" else [0]):
        results.append(run_cap(a, cap))
        stream.say(json.dumps({k: v for k, v in results[-1].items() if k != "rows"})[:1500])
        out = table(a.format, results)
        print(out, flush=True)
        if a.json:   # after every cap: a part cut short by its time limit keeps what it measured
            with open(a.json, "w") as f:
                json.dump({"env": stream.env_info(torch.device(a.device)), "format": a.format, "results": results,
                           "verdicts": [verdicts(r) for r in results if "rows" in r], "table": out}, f, indent=1)


if __name__ == "__main__":
    main()
