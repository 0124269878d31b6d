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
        m.register_parameter(f"p{k}", torch.nn.Parameter(torch.full(shape, 0.5, dtype=torch.bfloat16), requires_grad=False))
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


def from_file(flags: int) -> None:
    """Tensors as ComfyUI 0.3.75 loads them (safetensors' safe_open: views of a private mapping of
    the file), registered with `flags`: 0 breaks copy-on-write (each page copied into a new anonymous
    one), read-only keeps the page cache's own pages."""
    import safetensors.torch
    path = "/tmp/held_copy_block.safetensors"
    if not os.path.exists(path):
        safetensors.torch.save_file({f"p{k}": t.contiguous() for k, t in enumerate(block().parameters())}, path)
    with safetensors.safe_open(path, framework="pt", device="cpu") as f:
        ts = [f.get_tensor(k) for k in f.keys()]
    flats = [t.view(-1).view(torch.uint8) for t in ts]
    nbytes = sum(f.numel() for f in flats)
    out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    t0 = time.perf_counter()
    regs = []
    for f in flats:   # the whole pages inside each tensor, as a held home registers them
        a = (-f.data_ptr()) % 4096
        n = (f.numel() - a) // 4096 * 4096
        if n > 0:
            regs.append((f.data_ptr() + a, register(f.data_ptr() + a, n, flags), f[a:a + n]))
    reg_s = time.perf_counter() - t0
    parts, d = [], 0
    for _, _, f in regs:
        parts.append((out[d:d + f.numel()], f))
        d += f.numel()

    def each():
        for o, f in parts:
            o.copy_(f, non_blocking=True)
    rate = timed(each, d)
    print(f"file tensors (safe_open), registered with flags {flags} in {reg_s:.2f} s "
          f"({d / reg_s / 1e9:.1f} GB/s): tensor by tensor {rate:.1f} GB/s")
    for p, b, _ in regs:
        if b is not False:
            unregister(p, b)


def register_threads(path: str, parts: int = 8) -> None:
    """Page-locking a file's pages in place (read-only, a fresh shared mapping each time, as
    swap/file_pages.py maps them) with 1 to 8 threads: does cudaHostRegister scale?"""
    import mmap
    from concurrent.futures import ThreadPoolExecutor
    from ringswap.swap.host_pool import REGISTER_READ_ONLY
    size = os.path.getsize(path) // 4096 * 4096
    for threads in (1, 2, 4, 8):
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = torch.frombuffer(m, dtype=torch.uint8)
        step = size // parts // 4096 * 4096
        chunks = [(data[k * step:].data_ptr(), step) for k in range(parts)]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            budgets = list(pool.map(lambda c: register(c[0], c[1], REGISTER_READ_ONLY), chunks))
        dt = time.perf_counter() - t0
        print(f"register {step * parts / 1e9:.1f} GB of file pages read-only, {threads} threads: "
              f"{step * parts / dt / 1e9:.1f} GB/s{'' if all(b is not False for b in budgets) else ' (some refused)'}")
        for (p, _), b in zip(chunks, budgets):
            if b is not False:
                unregister(p, b)
        del data
        m.close()


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
    from ringswap.swap.host_pool import REGISTER_READ_ONLY
    for flags in (0, REGISTER_READ_ONLY, 0):
        from_file(flags)
    if len(sys.argv) > 1:   # a model file (bench/model_file.py writes one)
        register_threads(sys.argv[1])
    for hold in (True, False):
        t0 = time.perf_counter()
        print(f"engine, {'held homes' if hold else 'RAM homes'}: {engine_rate(hold)} ({time.perf_counter() - t0:.1f} s)")
