"""Where a prompt's first step goes on the GPU (issue 53): each stream's kernels and copies over time.

Runs a script (bench/compare_child.py, as compare.py starts it with RINGSWAP_BENCH_GPU=DIR) under
torch.profiler with CUDA activity only (CUPTI; no CPU events, so the run keeps its pace), then writes
a summary, not the trace: per stream its kernels, copies, busy time and bytes, and a timeline in BIN_S
bins from the first big host-to-device copy (a load's first block): the compute streams' busy ms and
the GB each copy stream moved, and the compute streams' idle gaps of GAP_S or more. Read beside
bench/probes/trace_calls.py's timeline of the same cell (RINGSWAP_BENCH_TRACE).

    python3 bench/probes/gpu_timeline.py OUT.txt bench/compare_child.py ARGS...
"""
from __future__ import annotations

import json
import os
import runpy
import sys
from collections import defaultdict

BIN_S = 0.05
SPAN_S = 6.0          # the timeline's length from its start
GAP_S = 0.005
BIG_COPY = 64 << 20   # bytes of a copy that marks the timeline's start


def _events(trace: str) -> list[dict]:
    with open(trace) as f:
        doc = json.load(f)
    return [e for e in doc.get("traceEvents", []) if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def _streams(events: list[dict]) -> dict:
    per = defaultdict(lambda: {"kernels": 0, "copies": 0, "busy": 0.0, "bytes": 0})
    for e in events:
        s = per[e["args"].get("stream", -1)]
        s["kernels" if e["cat"] == "kernel" else "copies"] += 1
        s["busy"] += e["dur"] / 1e6
        s["bytes"] += int(e["args"].get("bytes", 0) or 0)
    return per


def summarise(events: list[dict]) -> list[str]:
    """The lines written: streams, then the timeline and the compute gaps."""
    per = _streams(events)
    lines = ["stream  kernels  copies  busy s  GB"]
    lines += [f"{k:6}  {v['kernels']:7}  {v['copies']:6}  {v['busy']:6.3f}  {v['bytes'] / 1e9:6.2f}"
              for k, v in sorted(per.items(), key=lambda kv: str(kv[0]))]
    big = [e["ts"] for e in events if e["cat"] == "gpu_memcpy" and int(e["args"].get("bytes", 0) or 0) >= BIG_COPY]
    if not big:
        return lines + ["no copy of 64 MB or more: no timeline"]
    t0 = min(big)
    copy_streams = sorted({e["args"].get("stream", -1) for e in events if e["cat"] == "gpu_memcpy"
                           and int(e["args"].get("bytes", 0) or 0) >= BIG_COPY}, key=str)
    nbins = int(SPAN_S / BIN_S)
    busy = [0.0] * nbins
    moved = {s: [0.0] * nbins for s in copy_streams}
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "kernel" and e["ts"] >= t0)
    for e in events:
        b = int((e["ts"] - t0) / 1e6 / BIN_S)
        if not 0 <= b < nbins:
            continue
        if e["cat"] == "kernel":
            busy[b] += e["dur"] / 1e3
        elif e["args"].get("stream", -1) in moved:
            moved[e["args"]["stream"]][b] += int(e["args"].get("bytes", 0) or 0) / 1e9
    lines += ["", f"from the first copy of 64 MB or more (t=0), {BIN_S * 1e3:.0f} ms bins: "
              "compute busy ms (all kernels), GB copied by stream " + ", ".join(map(str, copy_streams))]
    last = max((b for b in range(nbins) if busy[b] or any(m[b] for m in moved.values())), default=-1)
    for b in range(last + 1):
        lines.append(f"{b * BIN_S:6.2f}  {busy[b]:6.1f}  " + "  ".join(f"{moved[s][b]:5.2f}" for s in copy_streams))
    lines += ["", f"kernel gaps of {GAP_S * 1e3:.0f} ms or more (start s, ms):"]
    end = None
    for start, stop in kernels:
        if end is not None and start - end >= GAP_S * 1e6 and (start - t0) / 1e6 < SPAN_S:
            lines.append(f"{(end - t0) / 1e6:6.3f}  {(start - end) / 1e3:7.1f}")
        end = stop if end is None else max(end, stop)
    return lines


def main() -> None:
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    from torch.profiler import ProfilerActivity, profile
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # as `python3 SCRIPT` would have it
    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        prof.stop()
        trace = out + ".trace.json"
        prof.export_chrome_trace(trace)
        with open(out, "w") as f:
            f.write("\n".join(summarise(_events(trace))) + "\n")
        os.remove(trace)


if __name__ == "__main__":
    main()
