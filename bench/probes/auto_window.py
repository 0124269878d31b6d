"""The automatic window against a sweep of manual windows, under VRAM caps (issue 12).

A Wan-2.1-14B-shaped file (model_file.py's writer, random weights; bf16 or scaled fp8) goes
through Load Diffusion Model -> RingSwap Patch -> ComfyUI's own sampling path
(comfy.sample.sample, euler, cfg 1: one model call per step). Per cap, one process (with
dynamic VRAM started as ComfyUI 0.33's main.py does when RINGSWAP_DYNAMIC_VRAM=1) behind
a ballast process holding all but --caps GiB of the GPU. Per workload: window 0 (auto),
then manual windows around the one it chose; per run the median s/step after the first
step, the plan line, any out-of-memory shrink, torch's VRAM peak.

    source scripts/device_setup.sh && python3 bench/probes/auto_window.py --format bf16 --json $OUT/auto.json
Tiny CPU run of every code path (meaningless numbers): .venv/bin/python bench/probes/auto_window.py --small
"""
from __future__ import annotations

import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (ComfyUI and tests/comfyui/support on sys.path)
from comfy_start import RingSwapLines, start_comfy  # noqa: E402
from model_file import wan14b_file  # noqa: E402


def child(a) -> dict:
    """One cap in this process: load once, then sample at the auto window and the sweep."""
    dyn = os.environ.get("RINGSWAP_DYNAMIC_VRAM") == "1"
    mm = start_comfy(a.device, dyn)
    import comfy.sd
    from ringswap.nodes.patch import RingSwapPatch

    lines = RingSwapLines()
    t0 = time.perf_counter()
    stock = comfy.sd.load_diffusion_model(a.path)
    out = {"dynamic_vram": dyn, "stock_load_s": time.perf_counter() - t0, "rows": []}
    keep = []   # the patched MODELs keep RingSwap's own load of a dynamic MODEL alive (read once)

    def run(tokens: int, window: int, steps: int) -> dict:
        t0 = time.perf_counter()
        (model,) = RingSwapPatch().patch(stock, window, 1, "auto")
        keep.append(model)
        row = {"tokens": tokens, "set_window": window, "patch_s": time.perf_counter() - t0}
        start = len(lines.lines)
        times = []
        try:
            times = common.sample_steps(model, tokens, steps, a.ctx_len)
        except torch.OutOfMemoryError as e:
            row["error"] = str(e).splitlines()[0][:300]
        new = lines.lines[start:]
        plan = next((ln for ln in new if ln.startswith("RingSwap plan:")), "")
        summary = next((ln for ln in new if ln.startswith("RingSwap run:")), "")
        row.update(first_step_s=times[0] if times else None,
                   s_per_step=common.steady_s(times),
                   window=int(m.group(1)) if (m := re.search(r"window (\d+) of", plan)) else None,
                   shrinks=re.findall(r"out of memory: window (\d+) -> (\d+)", summary), plan=plan, run=summary)
        if torch.cuda.is_available():
            row["vram_torch_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        mm.unload_all_models()
        mm.soft_empty_cache()
        common.say(f"[auto] {tokens} tokens, window {window or 'auto'} -> {row.get('window')}: "
                   f"{common.fmt_num(row['s_per_step'], '.3f')} s/step {row['shrinks'] or ''} {row.get('error', '')}")
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
    """One cap: a child process behind a ballast holding all but `cap` GiB."""
    with common.Ballast(cap if a.device == "cuda" else 0, a.device) as ballast:
        if ballast.line:
            common.say(f"[auto] cap {cap} GiB, ballast: {ballast.line}")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--path", a.path,
               *common.child_args(a, ["device", "steps_short", "steps_long", "ctx_len", "sweep", "tokens"])]
        r = common.child_result(cmd, a.cap_timeout_s)
    r["cap_gib"] = cap
    return r


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
                         f"{common.fmt_num(v['auto_s'], '.3f')} | {'yes' if v['auto_oom'] else 'no'} | "
                         f"{v['best_window']}: {common.fmt_num(v['best_s'], '.3f')} | "
                         f"{common.fmt_num(v['ratio'], '.3f')} | {sweep} |")
    return "\n".join(lines)


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--format", default="bf16", choices=["bf16", "scaled_fp8"])
    ap.add_argument("--caps", type=float, nargs="+", default=[24, 16, 12], help="GiB left free by the ballast")
    ap.add_argument("--sweep", type=int, nargs="+", default=[-3, 1, 2], help="manual windows: auto + these")
    ap.add_argument("--steps-short", type=int, default=6)
    ap.add_argument("--steps-long", type=int, default=3)
    ap.add_argument("--cap-timeout-s", type=float, default=200.0)
    a = ap.parse_args()
    if common.start(a, child):
        return
    a.path = wan14b_file(a.dir, a.format, a.small, a.device, layers_small=4)
    results = []
    for cap in (a.caps if a.device == "cuda" else [0]):
        results.append(run_cap(a, cap))
        common.say(json.dumps({k: v for k, v in results[-1].items() if k != "rows"})[:1500])
        out = table(a.format, results)
        print(out, flush=True)
        # after every cap: a part cut short by its time limit keeps what it measured
        common.write_json(a.json, {"env": common.env_info(torch.device(a.device)), "format": a.format,
                                   "results": results, "verdicts": [verdicts(r) for r in results if "rows" in r],
                                   "table": out})


if __name__ == "__main__":
    main()
