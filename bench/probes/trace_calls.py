"""Where a prompt's first step goes (issue 53): a timeline of RingSwap's and ComfyUI's calls, every thread.

Runs a script (bench/compare_child.py, as compare.py starts it with RINGSWAP_BENCH_TRACE=DIR) under
sys.monitoring (Python 3.12+): a call is timed only where its code is RingSwap's, one of ComfyUI's
sampling and loading entry points, or one of torch's waits and module moves (TORCH); every other
code object is switched off at its first event, so the run keeps its pace (cProfile times
everything, and its cumulative times mix threads). Written at exit: the calls of at least MIN_S,
and every call of the few decisions in ALWAYS with what it returned, by start time, with their
thread and nesting depth.

    python3 bench/probes/trace_calls.py OUT.txt bench/compare_child.py ARGS...
"""
from __future__ import annotations

import os
import runpy
import sys
import threading
import time

MIN_S = 0.003
COMFY = ("comfy/sample.py", "comfy/samplers.py", "comfy/model_management.py", "comfy/sd.py",
         "comfy/model_patcher.py", "comfy/sampler_helpers.py", "comfy/utils.py", "/nodes.py", "compare_child.py")
TORCH = {("torch/cuda/__init__.py", "synchronize"), ("torch/nn/modules/module.py", "Module.to"),
         ("torch/cuda/streams.py", "Stream.synchronize"), ("torch/cuda/streams.py", "Event.synchronize")}
# the page-locking ahead's decisions, however short: did the node's wrap page-lock ahead, and which attach took it
ALWAYS = {"pins_ahead", "BlockSwapEngine.pin_ahead", "EarlyPins.hand_over", "lock_early", "BlockSwapEngine.attach",
          "FilePages.lock_ahead", "SwapModelPatcher.wrap"}
DISABLE = getattr(getattr(sys, "monitoring", None), "DISABLE", None)
TOOL = 4   # a sys.monitoring tool id no profiler or debugger takes


def _wanted(code) -> bool:
    f = code.co_filename.replace("\\", "/")
    return "ringswap" in f or any(f.endswith(c) or c in f for c in COMFY) \
        or any(f.endswith(c) and code.co_qualname == q for c, q in TORCH)


class Tracer:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.stacks: dict[int, list] = {}
        self.calls: list[tuple] = []   # (start, seconds, thread, depth, name)
        self.names: dict[int, str] = {}

    def start(self, code, offset):
        if not _wanted(code):
            return DISABLE
        self.stacks.setdefault(threading.get_ident(), []).append((code, time.perf_counter()))

    def end(self, code, offset, value, unwind: bool = False):
        if not _wanted(code):
            return None if unwind else DISABLE
        stack = self.stacks.get(threading.get_ident())
        while stack:
            c, t = stack.pop()
            if c is code:
                dt = time.perf_counter() - t
                always = "ringswap" in code.co_filename and code.co_qualname in ALWAYS
                if dt >= MIN_S or always:
                    name = f"{os.path.basename(code.co_filename)}:{code.co_qualname}"
                    if always:
                        name += f" -> {type(value).__name__ if value is not None else None}"
                        name += f" {value}" if isinstance(value, (bool, int, tuple)) else ""
                    self.calls.append((t - self.t0, dt, threading.current_thread().name, len(stack), name))
                return

    def write(self, path: str) -> None:
        with open(path, "w") as f:
            for start, dt, thread, depth, name in sorted(self.calls):
                f.write(f"{start:9.3f} {dt:8.3f} {thread[:18]:18} {'  ' * min(depth, 20)}{name}\n")


def _profile_hook(tracer: Tracer):
    """Before Python 3.12 (no sys.monitoring): the same through setprofile, slower (CPU checks)."""
    def hook(frame, event, arg):
        if event == "call":
            tracer.start(frame.f_code, 0)
        elif event == "return":
            tracer.end(frame.f_code, 0, arg, True)
    return hook


def _watch(tracer: Tracer) -> None:
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        threading.setprofile(_profile_hook(tracer))
        sys.setprofile(_profile_hook(tracer))
        return
    mon.use_tool_id(TOOL, "ringswap-trace")
    ev = mon.events
    mon.register_callback(TOOL, ev.PY_START, tracer.start)
    mon.register_callback(TOOL, ev.PY_RETURN, tracer.end)
    mon.register_callback(TOOL, ev.PY_UNWIND, lambda code, offset, exc: tracer.end(code, offset, None, True))
    mon.set_events(TOOL, ev.PY_START | ev.PY_RETURN | ev.PY_UNWIND)


def main() -> None:
    out, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    tracer = Tracer()
    _watch(tracer)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))   # as `python3 SCRIPT` would have it
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        if getattr(sys, "monitoring", None) is not None:
            sys.monitoring.set_events(TOOL, 0)
        tracer.write(out)


if __name__ == "__main__":
    main()
