"""Do held homes (a module's own tensors, page-locked in place) copy to the GPU as fast as RAM homes?

On 0.3.75 the Patch's copy stream ran at 20.6 GB/s with held homes where RAM homes ran ~26 (issue 53).
Same bytes, one process: (1) torch alone: a 0.7 GB block from one registered buffer in one copy,
then tensor by tensor from its own registered tensors, then those tensors split as a held home
splits them (the partial pages at each end from a small pinned buffer); (2) the engine, copy-bound
(tiny compute), window 1: held homes against RAM homes (holding switched off here only).

    source scripts/device_setup.sh && python3 bench/probes/held_copy.py
"""
from __future__ import annotations

import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
import conftest  # noqa: E402,F401  (the repository as the package `ringswap`)
from ringswap.swap import BlockSwapEngine, ResidencyPlan, homes  # noqa: E402
from ringswap.swap.host_pool import register, unregister  # noqa: E402
from toy_blocks import load_plan  # noqa: E402  (a LoadPlan of a given residency, no planning)

DIM, FFN, N = 5120, 13824, 8
SHAPES = [(DIM, DIM)] * 8 + [(FFN, DIM), (DIM, FFN)] + [(DIM,)] * 12 + [(FFN,)]   # ~0.70 GB bf16, Wan-14B


def block() -> torch.nn.Module:
    m = torch.nn.Module()
    for k, shape in enumerate(SHAPES):
        m.register_parameter(f"p{k}", torch.nn.Parameter(torch.randn(shape, dtype=torch.bfloat16), requires_grad=False))
    m.forward = lambda x: x + 1
    return m


def timed(copies, nbytes: int, reps: int = 5) -> float:
    s = torch.cuda.Stream()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = 0.0
    for _ in range(reps):
        with torch.cuda.stream(s):
            a.record()
            copies()
            b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
    return best


def torch_alone() -> None:
    m = block()
    ts = list(m.parameters())
    nbytes = sum(t.numel() * 2 for t in ts)
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    one = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    print(f"one pinned buffer, one copy: {timed(lambda: out.copy_(one, non_blocking=True), nbytes):.1f} GB/s")
    flats = [t.view(-1).view(torch.uint8) for t in ts]
    regs = [(f.data_ptr(), f.numel(), register(f.data_ptr(), f.numel())) for f in flats]
    offs = [0]
    for f in flats:
        offs.append(offs[-1] + f.numel())

    def each():
        for f, d in zip(flats, offs):
            out[d:d + f.numel()].copy_(f, non_blocking=True)
    print(f"each tensor registered, tensor by tensor: {timed(each, nbytes):.1f} GB/s ({len(flats)} copies)")
    for p, _, b in regs:
        unregister(p, b)


def engine_rate(hold: bool) -> str:
    blocks = [block() for _ in range(N)]
    if not hold:
        homes.holdable = lambda *a: False
    engine = BlockSwapEngine(blocks, home="ram")
    dev = "cuda" if torch.cuda.is_available() else "cpu"   # the CPU: a smoke run only
    engine.attach(dev, load_plan(ResidencyPlan.make(N, 2, 1)))
    x = torch.zeros(1, device=dev)
    for _ in range(4):
        engine.begin_call()
        for b in blocks:
            b(x)
        engine.end_call()
    line = engine.end_run().line()
    engine.release_home()
    return line


if __name__ == "__main__":
    torch_alone()
    for hold in (True, False):
        t0 = time.perf_counter()
        print(f"engine, {'held homes' if hold else 'RAM homes'}: {engine_rate(hold)} ({time.perf_counter() - t0:.1f} s)")
