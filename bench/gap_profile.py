"""Where ComfyUI-resident's step goes beyond the floor (issue 13): torch.profiler over one
step of ComfyUI's sampling path (comfy.sample.sample, euler, cfg 1: one model call) and one
direct forward of the same, fully resident WanModel (the floor), same inputs' shapes.

One process, one load: Load Diffusion Model (a model_file.py Wan-14B-shaped file), every
weight on the GPU (load_models_gpu), warm-up, then per token count: the median wall time
of --steps steps each way, host enqueue time of the direct forward, and one profiled step
each way (ComfyUI's: a one-step sampling run, its setup included). Printed: totals (wall, device kernel time, CPU self time, kernel and cast
counts) and the top differences by name (device time, then CPU time), so a cast, an extra
kernel or host-side work on ComfyUI's path shows up by name.

    source scripts/device_setup.sh && python3 bench/gap_profile.py --json $OUT/gap.json
Tiny CPU run (meaningless numbers): RINGSWAP_COMFYUI_DIR=$PWD/.comfyui .venv/bin/python bench/gap_profile.py --small
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (ComfyUI and tests/support on sys.path)
from model_file import wan14b_file  # noqa: E402

CAST_OPS = ("aten::to", "aten::_to_copy", "aten::copy_", "aten::type_as")


def profile(fn, cuda: bool) -> dict:
    """name -> {count, device_ms, cpu_ms} of one call of fn (self times), plus the wall."""
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ops = {}
    for e in prof.key_averages():
        ops[e.key] = {"count": e.count, "device_ms": getattr(e, "self_device_time_total", 0) / 1e3,
                      "cpu_ms": e.self_cpu_time_total / 1e3}
    return {"wall_s": wall, "ops": ops}


def totals(p: dict) -> dict:
    ops = p["ops"].values()
    casts = [v for k, v in p["ops"].items() if k in CAST_OPS]
    return {"device_ms": sum(v["device_ms"] for v in ops), "cpu_ms": sum(v["cpu_ms"] for v in ops),
            "ops": sum(v["count"] for v in ops), "cast_calls": sum(v["count"] for v in casts),
            "cast_cpu_ms": sum(v["cpu_ms"] for v in casts)}


def diff_table(comfy: dict, floor: dict, key: str, top: int) -> str:
    """The `top` names whose `key` time differs most between the two profiles."""
    names = set(comfy["ops"]) | set(floor["ops"])
    zero = {"count": 0, "device_ms": 0.0, "cpu_ms": 0.0}
    rows = []
    for n in names:
        c, f = comfy["ops"].get(n, zero), floor["ops"].get(n, zero)
        rows.append((c[key] - f[key], n, c, f))
    rows.sort(key=lambda r: -abs(r[0]))
    return common.md_table(
        ["name", f"ComfyUI {key}", f"floor {key}", "difference", "calls ComfyUI / floor"],
        [[n[:90].replace("|", "/"), f"{c[key]:.2f}", f"{f[key]:.2f}", f"{d:+.2f}", f"{c['count']} / {f['count']}"]
         for d, n, c, f in rows[:top]])


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--format", default="bf16", choices=["bf16", "scaled_fp8"])
    ap.add_argument("--steps", type=int, default=3, help="timed steps each way (median)")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    a.tokens = a.tokens or ([64] if a.small else [7800, 32760])
    common.start(a, lambda _: {})
    if a.small:
        a.ctx_len = 16
    path = wan14b_file(a.dir, a.format, a.small, a.device, layers_small=4)
    import comfy.model_management as mm
    import comfy.sd
    patcher = comfy.sd.load_diffusion_model(path)
    mm.load_models_gpu([patcher], force_full_load=True)
    dev = mm.get_torch_device()
    cuda = dev.type == "cuda"
    dm = patcher.model.diffusion_model
    out = {"env": common.env_info(dev), "format": a.format, "rows": []}
    for tokens in a.tokens:
        inputs = common.make_inputs(tokens, dev, common.compute_dtype(patcher, dev), a.ctx_len, 0)

        def comfy_step() -> None:
            common.sample_steps(patcher, tokens, 1, a.ctx_len)

        def floor_step() -> None:
            with torch.no_grad():
                dm(*inputs)

        comfy_step()
        floor_step()
        comfy_s = statistics.median(common.sample_steps(patcher, tokens, a.steps + 1, a.ctx_len)[1:])
        floor_s = statistics.median(common.step_times(dm, inputs, a.steps, dev))
        common.sync(dev)
        t0 = time.perf_counter()
        floor_step()
        enqueue_s = time.perf_counter() - t0
        common.sync(dev)
        pc, pf = profile(comfy_step, cuda), profile(floor_step, cuda)
        tc, tf = totals(pc), totals(pf)
        row = {"tokens": tokens, "comfy_s": comfy_s, "floor_s": floor_s, "ratio": comfy_s / floor_s,
               "floor_enqueue_s": enqueue_s, "comfy_totals": tc, "floor_totals": tf,
               "comfy_ops": pc["ops"], "floor_ops": pf["ops"]}
        out["rows"].append(row)
        print(f"\n## {tokens:,} tokens: ComfyUI {comfy_s:.3f} s/step, floor {floor_s:.3f} s/step "
              f"(x{comfy_s / floor_s:.3f}); floor's forward enqueues in {enqueue_s:.3f} s\n")
        print(common.md_table(["", "ComfyUI path", "floor"], [
            ["profiled step wall s", f"{pc['wall_s']:.3f}", f"{pf['wall_s']:.3f}"],
            ["device kernel ms", f"{tc['device_ms']:.1f}", f"{tf['device_ms']:.1f}"],
            ["CPU self ms", f"{tc['cpu_ms']:.1f}", f"{tf['cpu_ms']:.1f}"],
            ["ops (calls)", tc["ops"], tf["ops"]],
            ["casts: calls / CPU ms", f"{tc['cast_calls']} / {tc['cast_cpu_ms']:.1f}",
             f"{tf['cast_calls']} / {tf['cast_cpu_ms']:.1f}"]]))
        if cuda:
            print("\nby device time (ms):\n" + diff_table(pc, pf, "device_ms", a.top))
        print("\nby CPU self time (ms):\n" + diff_table(pc, pf, "cpu_ms", a.top), flush=True)
        common.write_json(a.json, out)


if __name__ == "__main__":
    main()
