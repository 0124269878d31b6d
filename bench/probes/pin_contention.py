"""What page-locking a file's pages costs the copies beside it (issue 53, the Patch's first call on 0.33).

The traced first step spent 1.1 s in one slot copy while four threads page-locked the file's pages,
then waited 0.9 s for the copy stream. This measures, on one file in the page cache: (1) a copy loop
alone (pinned buffer -> GPU, 0.7 GB copies on a side stream: GB/s and the longest host-side call);
(2) cudaHostRegister (read-only) of the file's pages in 0.7 GB pieces on 1, 2, 4 threads, alone and
beside the copy loop; (3) positioned reads (RangeReader, 8 and 16 workers) into page-locked buffers,
alone and beside the copy loop; (4) a copy from the file's pages not page-locked (pageable).

    source scripts/device_setup.sh && python3 bench/probes/pin_contention.py [FILE] [--populate]

--populate instead: page-locking (1 thread) after filling the mapping's page tables (madvise
MADV_POPULATE_READ, or touching a byte a page on 8 threads), against page-locking alone; then as
the attach does (swap/file_pages.py, swap/in_place.py): 4 threads each touching a block's pages,
then registering it in 256 MB pieces one at a time (swap/driver_turns.py), alone and beside copies.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "engine"))
import conftest  # noqa: E402,F401  (the repository as the package `ringswap`)
from ringswap.loaders.model_file.range_reader import RangeReader  # noqa: E402
from ringswap.swap.file_pages import FilePages  # noqa: E402
from ringswap.swap.host_pool import PAGE, REGISTER_READ_ONLY, register, unregister, whole_pages  # noqa: E402

PIECE = 702788608   # one Wan-14B bf16 block
GB = 1e9


class CopyLoop:
    """Copies a pinned PIECE to the GPU back to back on a side stream until stopped."""

    def __init__(self):
        self.src = torch.empty(PIECE, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty(PIECE, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()
        self.stop = threading.Event()

    def run(self) -> tuple[float, float]:
        """Until stopped: (GB/s, longest host-side copy call in ms)."""
        n, worst, t0 = 0, 0.0, time.perf_counter()
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                c = time.perf_counter()
                self.dst.copy_(self.src, non_blocking=True)
                worst = max(worst, time.perf_counter() - c)
                self.stream.synchronize()
                n += 1
        return n * PIECE / (time.perf_counter() - t0) / GB, worst * 1e3

    def beside(self, work):
        """Run `work()` with the copy loop beside it: (work's result, copy GB/s, worst call ms)."""
        self.stop.clear()
        with ThreadPoolExecutor(1) as pool:
            loop = pool.submit(self.run)
            time.sleep(0.2)
            out = work()
            self.stop.set()
            rate, worst = loop.result()
        return out, rate, worst


def pieces(data: torch.Tensor, count: int) -> list[tuple[int, int]]:
    return [(data[k * PIECE:].data_ptr(), PIECE) for k in range(count)]


def register_all(path: str, threads: int, count: int) -> str:
    data = FilePages(path).data   # the file mapped read-only, as the homes map it
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        budgets = list(pool.map(lambda c: register(c[0], c[1], REGISTER_READ_ONLY), pieces(data, count)))
    dt = time.perf_counter() - t0
    for (p, _), b in zip(pieces(data, count), budgets):
        if b is not False:
            unregister(p, b)
    del data
    return f"register {count * PIECE / GB:.1f} GB on {threads} threads: {count * PIECE / dt / GB:.1f} GB/s" \
           + ("" if all(b is not False for b in budgets) else " (some refused)")


MADV_POPULATE_READ = 22   # Linux 5.14+: fill the mapping's page tables from the page cache


def populated(path: str, how: str, count: int) -> str:
    """Page-lock the file's pages (1 thread) after filling the mapping's page tables first: does a
    populated mapping register faster than cudaHostRegister's own 10 GB/s?"""
    pages = FilePages(path)
    m, data = pages.map, pages.data
    n = count * PIECE
    t0 = time.perf_counter()
    if how == "madvise":
        m.madvise(MADV_POPULATE_READ, 0, n)
    elif how == "touch":   # one byte a page, 8 threads
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda k: int(data[k * PIECE:(k + 1) * PIECE:PAGE].sum()), range(count)))
    t1 = time.perf_counter()
    budgets = [register(p, size, REGISTER_READ_ONLY) for p, size in pieces(data, count)]
    t2 = time.perf_counter()
    for (p, _), b in zip(pieces(data, count), budgets):
        if b is not False:
            unregister(p, b)
    del data
    return f"{how}: populate {n / GB:.1f} GB in {t1 - t0:.2f} s, then register at {n / (t2 - t1) / GB:.1f} GB/s, " \
           f"both {n / (t2 - t0) / GB:.1f} GB/s"


def as_attach(path: str, count: int, threads: int = 4, piece: int = 256 << 20) -> str:
    """Each block's pages touched (a byte a page), then registered in `piece`s, one registration
    at a time through host_pool.register (its driver turns), on `threads` threads: GB/s."""
    data = FilePages(path).data

    def pin(k: int) -> list:
        block = data[k * PIECE:(k + 1) * PIECE]
        lo, hi = whole_pages(block.data_ptr(), block.data_ptr() + PIECE)
        int(data[lo - data.data_ptr():hi - data.data_ptr():PAGE].sum())   # its own pages, as MappedBlock.pin
        return [(a, register(a, min(piece, hi - a), REGISTER_READ_ONLY)) for a in range(lo, hi, piece)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = [r for rs in pool.map(pin, range(count)) for r in rs]
    dt = time.perf_counter() - t0
    for a, b in done:
        if b is not False:
            unregister(a, b)
    del data
    return f"as the attach ({threads} threads, {piece >> 20} MB pieces): {count * PIECE / dt / GB:.1f} GB/s"


def read_all(reader: RangeReader, bufs: list[torch.Tensor], count: int) -> str:
    t0 = time.perf_counter()
    futs = [reader.read_into(bufs[k % len(bufs)], [(k * PIECE, PIECE, 0)]) for k in range(count)]
    for f in futs:
        f.result()
    dt = time.perf_counter() - t0
    return f"read {count * PIECE / GB:.1f} GB into page-locked buffers, {reader.workers} workers: " \
           f"{count * PIECE / dt / GB:.1f} GB/s"


def pageable(path: str) -> str:
    data = FilePages(path).data
    dst = torch.empty(PIECE, dtype=torch.uint8, device="cuda")
    out = []
    for k in range(2):   # first touch of the mapping, then again
        t0 = time.perf_counter()
        dst.copy_(data[:PIECE], non_blocking=True)
        torch.cuda.synchronize()
        out.append(f"{PIECE / (time.perf_counter() - t0) / GB:.1f}")
    del data
    return f"copy one piece from the file's pages, not page-locked: {' then '.join(out)} GB/s"


def main(path: str) -> None:
    count = min(os.path.getsize(path) // PIECE, 24)
    with open(path, "rb") as f:   # in the page cache
        while f.read(1 << 26):
            pass
    loop = CopyLoop()
    loop.stop.clear()
    threading.Timer(1.5, loop.stop.set).start()
    rate, worst = loop.run()
    print(f"copy loop alone: {rate:.1f} GB/s, longest call {worst:.1f} ms", flush=True)
    if "--populate" in sys.argv:
        for how in ("none", "madvise", "touch"):
            try:
                print(populated(path, how, count), flush=True)
            except OSError as e:
                print(f"{how}: {e}", flush=True)
        print(as_attach(path, count), flush=True)
        line, rate, worst = loop.beside(lambda: as_attach(path, count))
        print(f"  beside the copy loop: {line}; copies {rate:.1f} GB/s, longest call {worst:.1f} ms", flush=True)
        print(as_attach(path, count, threads=1, piece=PIECE), flush=True)
        return
    for threads in (1, 2, 4):
        print(register_all(path, threads, count), flush=True)
        line, rate, worst = loop.beside(lambda: register_all(path, threads, count))
        print(f"  beside the copy loop: {line}; copies {rate:.1f} GB/s, longest call {worst:.1f} ms", flush=True)
    bufs = [torch.empty(PIECE, dtype=torch.uint8).pin_memory() for _ in range(6)]
    for workers in (8, 16):
        reader = RangeReader(path, workers=workers, drop_cache=False)
        print(read_all(reader, bufs, count), flush=True)
        line, rate, worst = loop.beside(lambda: read_all(reader, bufs, count))
        print(f"  beside the copy loop: {line}; copies {rate:.1f} GB/s, longest call {worst:.1f} ms", flush=True)
        reader.close()
    print(pageable(path), flush=True)


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    main(args[0] if args else "/tmp/ringswap_bench/wan_bf16_l40_d5120.safetensors")
