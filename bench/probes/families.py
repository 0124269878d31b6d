"""Qwen-Image and Wan-VACE-14B shapes under a VRAM cap, against ComfyUI-resident (issue 11).

Each family in its own process: ComfyUI's own model class at the real widths, built in
process (bf16, random weights; no file, these would be 34-41 GB on disk), sampled through
comfy.sample.sample (euler, cfg 1: one model call per step). First fully resident (no
cap), then behind a ballast process leaving --cap GiB, RingSwap Patch at the auto window,
prefetch 1 and 2. Qwen-Image (60 blocks, dim 3072) at 4,096 tokens is transfer-bound under
12 GiB: the verdict is bytes copied per step over the step time against the pinned link
rate measured in the same process. VACE-14B (40 main + 8 vace blocks, dim 5120) at 480p
81 frames under 16 GiB: the verdict is s/step against the resident run.

    source scripts/device_setup.sh && python3 bench/probes/families.py --json $OUT/families.json
Tiny CPU run of every code path (meaningless numbers): .venv/bin/python bench/probes/families.py --small
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (ComfyUI and tests/comfyui/support on sys.path, ballast)
from comfy_start import RingSwapLines, start_comfy  # noqa: E402
from io_rates import h2d_rate  # noqa: E402

# name -> (family in tests/comfyui/support/family_models.py at family_shapes.REAL widths, its block counts,
#          block counts with --small (tiny widths), tokens, cap GiB, target)
SHAPES = {
    "qwen_image": ("qwen_image", dict(num_layers=60), dict(num_layers=6), 4096, 12.0, "link"),
    "wan_vace_14b": ("wan_vace", dict(num_layers=40, vace_layers=8), dict(num_layers=4, vace_layers=2), 32760, 16.0,
                     "resident"),
}


def build(name: str, small: bool, dev: torch.device):
    """A ModelPatcher around ComfyUI's own model of this family and shape (bf16 on CUDA, random
    weights drawn on `dev`), and its bytes."""
    sys.path.insert(0, os.path.join(common.REPO, "tests", "comfyui"))
    from support import family_models as fm
    from support import family_shapes
    fam_name, blocks, tiny_blocks, *_ = SHAPES[name]
    fam = fm.BY_NAME[fam_name]
    widths = {} if small else family_shapes.REAL[fam_name]
    fam = dataclasses.replace(fam, unet_config={**fam.unet_config, **widths, **(tiny_blocks if small else blocks)})
    patcher = fm.build(fam, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, init_device=dev)
    return patcher, fm.block_bytes(patcher.model.diffusion_model)


def conditioning(name: str, tokens: int, small: bool, ctx_len: int):
    """(noise, positive) for `tokens` image/video tokens of this family."""
    g = torch.Generator().manual_seed(0)
    if name == "qwen_image":
        side = 2 * int(tokens ** 0.5)                                 # patch 2: (2s)x(2s) latents
        noise = torch.randn(1, 16, 1, side, side, generator=g)
        return noise, [[torch.randn(1, ctx_len, 48 if small else 3584, generator=g), {}]]
    f, h, w = common.latent_shape(tokens)
    noise = torch.randn(1, 16, f, h, w, generator=g)
    vace = {"vace_frames": [torch.randn(1, 32, f, h, w, generator=g)],
            "vace_mask": [torch.ones(1, 64, f, h, w)], "vace_strength": [1.0]}
    return noise, [[torch.randn(1, ctx_len, 64 if small else 4096, generator=g), vace]]


def sample(model, noise, cond, steps: int, lines: RingSwapLines) -> dict:
    """One sampling run: median s/step after the first, the first step, the RingSwap lines, VRAM peak."""
    import comfy.model_management as mm
    import comfy.sample
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start, stamps = len(lines.lines), []
    t0 = time.perf_counter()
    row: dict = {}
    try:
        comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", cond, cond, torch.zeros_like(noise),
                            callback=lambda *_: stamps.append(time.perf_counter()), disable_pbar=True, seed=0)
    except torch.OutOfMemoryError as e:
        row["error"] = str(e).splitlines()[0][:300]
    times = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    new = lines.lines[start:]
    row.update(first_step_s=times[0] if times else None,
               s_per_step=common.steady_s(times),
               plan=next((ln for ln in new if ln.startswith("RingSwap plan:")), ""),
               run=next((ln for ln in new if ln.startswith("RingSwap run:")), ""))
    if torch.cuda.is_available():
        row["vram_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        row["vram_reserved_peak_gb"] = torch.cuda.max_memory_reserved() / 1e9
    m = re.search(r"copied ([\d.]+) GB .*?; (\d+) model calls", row["run"])
    if m and row["s_per_step"]:
        row["gb_per_step"] = float(m.group(1)) / int(m.group(2))
        row["gbps_per_step"] = row["gb_per_step"] / row["s_per_step"]
    if m := re.search(r"window (\d+) of (\d+)", row["plan"]):
        row["window"], row["blocks"] = int(m.group(1)), int(m.group(2))
    mm.unload_all_models()
    mm.soft_empty_cache()
    return row


def child(a) -> dict:
    """One family in this process: resident, then RingSwap behind the ballast."""
    dyn = os.environ.get("RINGSWAP_DYNAMIC_VRAM") == "1"
    start_comfy(a.device, dyn)
    from ringswap.nodes.patch import RingSwapPatch
    lines = RingSwapLines()
    dev = torch.device(a.device)
    _, _, _, tokens, cap, target = SHAPES[a.family]
    tokens = 64 if a.small else tokens
    t0 = time.perf_counter()
    stock, nbytes = build(a.family, a.small, dev)
    out = {"family": a.family, "tokens": tokens, "cap_gib": cap, "target": target, "dynamic_vram": dyn,
           "model_gb": nbytes / 1e9, "build_s": time.perf_counter() - t0}
    common.say(f"[families] built {a.family}: {nbytes / 1e9:.1f} GB in {out['build_s']:.0f} s")
    noise, cond = conditioning(a.family, tokens, a.small, a.ctx_len)
    out["resident"] = sample(stock, noise, cond, a.steps, lines)
    common.say(f"[families] resident: {out['resident']}")
    with common.Ballast(cap if dev.type == "cuda" else 0, a.device) as ballast:
        common.say(f"[families] cap {cap} GiB, ballast: {ballast.line or 'none (CPU)'}")
        out["link"] = h2d_rate(dev, (1 << 30) if dev.type == "cuda" else 1 << 20)
        out["ringswap"] = []
        for prefetch in a.prefetch:
            t0 = time.perf_counter()
            (model,) = RingSwapPatch().patch(stock, a.window, prefetch, "auto")
            row = {"prefetch": prefetch, "patch_s": time.perf_counter() - t0, **sample(model, noise, cond, a.steps,
                                                                                      lines)}
            del model
            out["ringswap"].append(row)
            common.say(f"[families] ringswap prefetch {prefetch}: {row}")
    return out


def verdict(r: dict) -> dict:
    """The best RingSwap row against the family's target."""
    ok = [x for x in r.get("ringswap", []) if x.get("s_per_step") and "error" not in x]
    best = min(ok, key=lambda x: x["s_per_step"], default=None)
    res = r.get("resident", {}).get("s_per_step")
    v = {"best": best, "vs_resident": best["s_per_step"] / res if best and res else None,
         "link_share": (best or {}).get("gbps_per_step", 0) / r["link"]["gbps"] if best and "link" in r else None}
    v["pass"] = (v["link_share"] is not None and v["link_share"] >= 0.90) if r["target"] == "link" else \
        (v["vs_resident"] is not None and v["vs_resident"] <= 1.02)
    return v


def table(results: list[dict]) -> str:
    rows = ["| family | tokens | cap GiB | resident s/step | RingSwap (prefetch: window, s/step, GB/step) | "
            "vs resident | GB/s per step / pinned link | target | pass |", "| --- " * 9 + "|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['family']} | failed (rc {r.get('rc')}) | | | | | | | |")
            continue
        v = verdict(r)
        cells = "; ".join(f"{x['prefetch']}: {x.get('window')}, {common.fmt_num(x.get('s_per_step'), '.3f')}, "
                          f"{common.fmt_num(x.get('gb_per_step'), '.1f')}" + (" OOM" if "error" in x else "")
                          for x in r["ringswap"])
        share = (f"{common.fmt_num((v['best'] or {}).get('gbps_per_step'), '.1f')} / "
                 f"{r['link']['gbps']:.1f} = {common.fmt_num(v['link_share'], '.3f')}")
        target = ">= 0.90 of link" if r["target"] == "link" else "<= 1.02 x resident"
        rows.append(f"| {r['family']} | {r['tokens']:,} | {r['cap_gib']:g} | "
                    f"{common.fmt_num(r['resident'].get('s_per_step'), '.3f')} | {cells} | "
                    f"{common.fmt_num(v['vs_resident'], '.3f')} | {share} | {target} | "
                    f"{'yes' if v['pass'] else 'NO'} |")
    return "\n".join(rows)


def run_family(a, name: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--family", name, "--device", a.device,
           "--steps", str(a.steps), "--window", str(a.window), "--ctx-len", str(a.ctx_len), "--prefetch", *map(str, a.prefetch)]
    if a.small:
        cmd.append("--small")
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.family_timeout_s)
    except subprocess.TimeoutExpired as e:
        return {"family": name, "error": f"timed out after {a.family_timeout_s} s: {(e.stdout or b'')[-2000:]}",
                "rc": 124}
    sys.stderr.write(p.stdout[-4000:])
    found = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not found:
        return {"family": name, "error": (p.stderr or p.stdout)[-3000:], "rc": p.returncode}
    return json.loads(found[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--family", help=argparse.SUPPRESS)
    ap.add_argument("--families", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny models (CPU check of the code paths)")
    ap.add_argument("--steps", type=int, default=4, help="steps per run; the first is not timed")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--window", type=int, default=None, help="RingSwap window (default 0, auto; --small: 2)")
    ap.add_argument("--ctx-len", type=int, default=256)
    ap.add_argument("--family-timeout-s", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    a.window = (2 if a.small else 0) if a.window is None else a.window
    if a.child:
        print("RESULT " + json.dumps(child(a)), flush=True)
        return
    results = []
    for name in a.families:
        results.append(run_family(a, name))
        out = table(results)
        print(out, flush=True)
        if a.json:   # after every family: a part cut short by its time limit keeps what it measured
            with open(a.json, "w") as f:
                json.dump({"env": common.env_info(torch.device(a.device)), "results": results, "table": out}, f,
                          indent=1)


if __name__ == "__main__":
    main()
