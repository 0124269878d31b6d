"""Where ComfyUI-resident's step goes beyond the floor (issue 13): torch.profiler over one
step of ComfyUI's sampling path (comfy.sample.sample, euler, cfg 1: one model call) and one
direct forward of the same, fully resident WanModel (the floor), same inputs' shapes.

One process, one load: Load Diffusion Model (a model_file.py Wan-14B-shaped file), every
weight on the GPU (load_models_gpu), warm-up, then per token count: the mean wall time
of --steps steps each way, host enqueue time of the direct forward, and one profiled step
each way (ComfyUI's: the second step of a two-step sampling run, a step mid-run). Printed:
totals (wall, device kernel time, CPU self time, kernel and cast counts) and the top
differences by name (device time, then CPU time), so a cast, an extra kernel or host-side
work shows up by name.
With --windows, then RingSwap Patch at each window (prefetch 1) against the resident step,
in the same process (what streaming costs, by kernel). RINGSWAP_DYNAMIC_VRAM=1 starts 0.33's
dynamic VRAM; --diff compares the profiles of two such runs (e.g. dynamic against static).

    source scripts/device_setup.sh && python3 bench/probes/gap_profile.py --json $OUT/gap.json
    python3 bench/probes/gap_profile.py --diff gap_033.json gap_033_dyn.json     # here, no GPU
Tiny CPU run (meaningless numbers): RINGSWAP_COMFYUI_DIR=$PWD/.comfyui .venv/bin/python bench/probes/gap_profile.py --small --windows 2
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

CAST_OPS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::type_as")


def _activities(cuda: bool) -> list:
    return [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])


def _ops(prof) -> dict:
    return {e.key: {"count": e.count, "device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
                    "cpu_ms": e.self_cpu_time_total / 1e3} for e in prof.key_averages()}


def profile(fn, cuda: bool) -> dict:
    """name -> {count, device_ms, cpu_ms} of one call of fn (self times), plus the wall."""
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=_activities(cuda)) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "ops": _ops(prof)}


def steady_profile(model, tokens: int, ctx_len: int, cuda: bool) -> dict:
    """As profile(), over the second step of a two-step sampling run of ComfyUI's path: a
    step in the middle of a run (no load, placement or run start in it). sample_steps has
    synchronised the device before both stamps, so the second step's time is its wall."""
    prof = torch.profiler.profile(activities=_activities(cuda))
    times = common.sample_steps(model, tokens, 2, ctx_len, lambda i: prof.start() if i == 0 else prof.stop())
    return {"wall_s": times[1], "ops": _ops(prof)}


def totals(p: dict) -> dict:
    ops = p["ops"].values()
    casts = [v for k, v in p["ops"].items() if k in CAST_OPS]
    return {"device_ms": sum(v["device_ms"] for v in ops), "cpu_ms": sum(v["cpu_ms"] for v in ops),
            "ops": sum(v["count"] for v in ops), "cast_calls": sum(v["count"] for v in casts),
            "cast_cpu_ms": sum(v["cpu_ms"] for v in casts)}


def diff_table(a: dict, b: dict, key: str, top: int, names: tuple[str, str] = ("ComfyUI", "floor")) -> str:
    """The `top` names whose `key` time differs most between profiles `a` and `b`."""
    zero = {"count": 0, "device_ms": 0.0, "cpu_ms": 0.0}
    rows = []
    for n in set(a["ops"]) | set(b["ops"]):
        x, y = a["ops"].get(n, zero), b["ops"].get(n, zero)
        rows.append((x[key] - y[key], n, x, y))
    rows.sort(key=lambda r: -abs(r[0]))
    return common.md_table(
        ["name", f"{names[0]} {key}", f"{names[1]} {key}", "difference", f"calls {names[0]} / {names[1]}"],
        [[n[:90].replace("|", "/"), f"{x[key]:.2f}", f"{y[key]:.2f}", f"{d:+.2f}", f"{x['count']} / {y['count']}"]
         for d, n, x, y in rows[:top]])


def show(title: str, named: dict, cuda: bool, top: int) -> None:
    """Totals of two or more profiles side by side, then the first two's differences by name."""
    (na, pa), (nb, pb) = list(named.items())[:2]
    ts = {n: totals(p) for n, p in named.items()}
    print(f"\n## {title}\n")
    walls = [["profiled step wall s"] + [f"{p['wall_s']:.3f}" for p in named.values()]] \
        if all(p["wall_s"] for p in named.values()) else []
    print(common.md_table([""] + list(named), walls + [
        ["device kernel ms"] + [f"{t['device_ms']:.1f}" for t in ts.values()],
        ["CPU self ms"] + [f"{t['cpu_ms']:.1f}" for t in ts.values()],
        ["ops (calls)"] + [t["ops"] for t in ts.values()],
        ["casts: calls / CPU ms"] + [f"{t['cast_calls']} / {t['cast_cpu_ms']:.1f}" for t in ts.values()]]))
    if cuda:
        print("\nby device time (ms):\n" + diff_table(pa, pb, "device_ms", top, (na, nb)))
    print("\nby CPU self time (ms):\n" + diff_table(pa, pb, "cpu_ms", top, (na, nb)), flush=True)


def diff_runs(a) -> None:
    """--diff A B: the --what profiles of two earlier runs, per token count both measured."""
    runs = []
    for p in a.diff:
        with open(p) as f:
            data = json.load(f)
        env = data["env"]
        runs.append((f"{env.get('comfyui')}{' dyn' if data.get('dynamic_vram') else ''} ({os.path.basename(p)})",
                     {r["tokens"]: r for r in data["rows"]}))
    (na, ra), (nb, rb) = runs
    for tokens in sorted(set(ra) & set(rb)):
        x, y = ra[tokens], rb[tokens]
        key = f"{a.what}_ops"
        if key not in x or key not in y:
            continue
        print(f"\n{tokens:,} tokens, {a.what} path: {x.get(a.what + '_s', 0):.3f} vs {y.get(a.what + '_s', 0):.3f} s/step")
        show(f"{tokens:,} tokens: {na} against {nb}",
             {na: {"wall_s": 0.0, "ops": x[key]}, nb: {"wall_s": 0.0, "ops": y[key]}}, True, a.top)


def ringswap_rows(a, patcher, rows: dict, cuda: bool, out: dict) -> None:
    """RingSwap Patch at each of --windows (prefetch 1) on the loaded model, per token count:
    s/step, one profiled step against the resident ComfyUI step of the same tokens."""
    from compare_child import keep_run_stats
    from ringswap.nodes.patch import RingSwapPatch
    for window in a.windows:
        (rs,) = RingSwapPatch().patch(patcher, window, 1, "auto")
        stats = keep_run_stats([rs])   # it takes a list of patchers since abded46
        for tokens, row in rows.items():
            common.sample_steps(rs, tokens, 1, a.ctx_len)
            rs_s = common.steady_s(common.sample_steps(rs, tokens, a.steps + 1, a.ctx_len))
            line = stats[-1].line() if stats else ""
            pr = steady_profile(rs, tokens, a.ctx_len, cuda)
            row.setdefault("ringswap", []).append({"window": window, "s": rs_s, "stats": line,
                                                    "totals": totals(pr), "ops": pr["ops"]})
            print(f"\n{tokens:,} tokens: RingSwap window {window} {rs_s:.3f} s/step against resident "
                  f"{row['comfy_s']:.3f} (x{rs_s / row['comfy_s']:.3f}); {line}")
            show(f"{tokens:,} tokens: RingSwap window {window} against ComfyUI resident",
                 {f"RingSwap w{window}": pr, "ComfyUI": {"wall_s": row["comfy_wall_s"], "ops": row["comfy_ops"]}},
                 cuda, a.top)
        common.write_json(a.json, out)


def floor_of(floor_step, dm, inputs, steps: int, dev: torch.device, cuda: bool) -> tuple[float, float, dict]:
    """The floor's steady s/step (WanModel called directly), how long one forward takes to
    enqueue, and its profile."""
    floor_step()
    floor_s = common.steady_s(common.step_times(dm, inputs, steps + 1, dev))
    common.sync(dev)
    t0 = time.perf_counter()
    floor_step()
    enqueue_s = time.perf_counter() - t0
    common.sync(dev)
    return floor_s, enqueue_s, profile(floor_step, cuda)


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--format", default=None, choices=["bf16", "scaled_fp8", "fp32"],
                    help="default bf16 (--small: fp32, as 0.33's dynamic VRAM on a CPU runs bf16 uncast)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps each way (mean)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--windows", type=int, nargs="*", default=[], help="RingSwap Patch windows to profile too")
    ap.add_argument("--diff", nargs=2, default=None, help="two earlier runs' JSON: compare, no GPU")
    ap.add_argument("--what", default="comfy", choices=["comfy", "floor"], help="--diff: which profiles")
    a = ap.parse_args()
    if a.diff:
        diff_runs(a)
        return
    common.start(a, lambda _: {})
    if a.small:
        a.ctx_len = 16
    a.format = a.format or ("fp32" if a.small else "bf16")
    import comfy_start
    dynamic = os.environ.get("RINGSWAP_DYNAMIC_VRAM") == "1"
    mm = comfy_start.start_comfy(a.device, dynamic)
    path = wan14b_file(a.dir, a.format, a.small, a.device, layers_small=4)
    import comfy.sd
    patcher = comfy.sd.load_diffusion_model(path)
    mm.load_models_gpu([patcher], force_full_load=True)
    dev = mm.get_torch_device()
    cuda = dev.type == "cuda"
    dm = patcher.model.diffusion_model
    out = {"env": common.env_info(dev), "format": a.format, "dynamic_vram": dynamic,
             "patcher": type(patcher).__name__, "rows": []}
    rows = {}
    for tokens in a.tokens:
        inputs = common.make_inputs(tokens, dev, common.compute_dtype(patcher, dev), a.ctx_len, 0)

        def floor_step() -> None:
            with torch.no_grad():
                dm(*inputs)

        common.sample_steps(patcher, tokens, 1, a.ctx_len)
        comfy_s = common.steady_s(common.sample_steps(patcher, tokens, a.steps + 1, a.ctx_len))
        pc = steady_profile(patcher, tokens, a.ctx_len, cuda)
        row = rows[tokens] = {"tokens": tokens, "comfy_s": comfy_s, "comfy_wall_s": pc["wall_s"],
                              "comfy_totals": totals(pc), "comfy_ops": pc["ops"]}
        out["rows"].append(row)
        try:   # under dynamic VRAM a direct call of the module is not a path ComfyUI promises
            floor_s, enqueue_s, pf = floor_of(floor_step, dm, inputs, a.steps, dev, cuda)
        except Exception as e:  # noqa: BLE001  (reported in the row; ComfyUI's path stands alone)
            row["floor_error"] = f"{type(e).__name__}: {e}"[:300]
            print(f"\n{tokens:,} tokens: ComfyUI {comfy_s:.3f} s/step; floor failed: {row['floor_error']}")
            common.write_json(a.json, out)
            continue
        row.update(floor_s=floor_s, ratio=comfy_s / floor_s, floor_enqueue_s=enqueue_s,
                   floor_totals=totals(pf), floor_ops=pf["ops"])
        print(f"\n{tokens:,} tokens: ComfyUI {comfy_s:.3f} s/step, floor {floor_s:.3f} s/step "
              f"(x{comfy_s / floor_s:.3f}); floor's forward enqueues in {enqueue_s:.3f} s")
        show(f"{tokens:,} tokens: ComfyUI path against the floor", {"ComfyUI path": pc, "floor": pf}, cuda, a.top)
        common.write_json(a.json, out)
    ringswap_rows(a, patcher, rows, cuda, out)


if __name__ == "__main__":
    main()
