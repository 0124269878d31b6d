"""How fast block homes can be filled from a file in the page cache, by strategy (issue 53).

Writes a --gb GB file of --block-mb MB "blocks" (once), warms it, then fills one host buffer
per block with RangeReader at several worker counts: into fresh mappings (as a load does today,
with and without the reader's page-cache advice), into fresh mappings made huge-page, into
buffers touched first (torch's threads), into buffers already page-locked (a reused pool); and
the page-locking rate of touched buffers (one thread and four), and the pinned to device rate.

    python3 bench/probes/fill_rates.py --gb 12 --json $OUT/fill_rates.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402,F401  (the repo as `ringswap` on sys.path)


def write_file(path: str, gb: float) -> int:
    size = int(gb * 1e9)
    if os.path.exists(path) and os.path.getsize(path) == size:
        return size
    chunk = torch.randint(0, 255, (1 << 26,), dtype=torch.uint8).numpy().tobytes()
    with open(path, "wb") as f:
        left = size
        while left > 0:
            f.write(chunk[:min(left, len(chunk))])
            left -= len(chunk)
    return size


def warm(path: str) -> float:
    """Read the whole file (16 threads) so it is in the page cache; returns GB/s."""
    from ringswap.loaders.model_file.range_reader import RangeReader
    size = os.path.getsize(path)
    buf = torch.empty(1 << 28, dtype=torch.uint8)
    t0 = time.perf_counter()
    with RangeReader(path, workers=16, drop_cache=False) as r:
        for off in range(0, size, buf.numel()):
            n = min(buf.numel(), size - off)
            r.read_into(buf, [(off, n, 0)]).result()
    return size / (time.perf_counter() - t0) / 1e9


def huge_bytes(nbytes: int) -> torch.Tensor:
    m = mmap.mmap(-1, nbytes)
    if hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8)


def fill(path: str, bufs: list[torch.Tensor], block: int, workers: int, drop_cache: bool) -> float:
    """Every block read into its buffer, all submitted at once (as ram_homes.fill does); seconds."""
    from ringswap.loaders.model_file.range_reader import RangeReader
    with RangeReader(path, workers=workers, drop_cache=drop_cache) as r:
        t0 = time.perf_counter()
        futs = [r.read_into(b, [(i * block, block, 0)]) for i, b in enumerate(bufs)]
        for f in futs:
            f.result()
        return time.perf_counter() - t0


def fresh(n: int, block: int, kind: str) -> list[torch.Tensor]:
    from ringswap.swap.host_pool import HostBuffer
    if kind == "huge":
        return [huge_bytes(block) for _ in range(n)]
    bufs = [HostBuffer(block) for _ in range(n)]
    return [b.flat for b in bufs] if kind == "fresh" else bufs


def pin_rate(bufs, threads: int) -> float:
    """Page-lock the touched HostBuffers with `threads` threads; GB/s."""
    todo, lock = list(bufs), threading.Lock()

    def work():
        while True:
            with lock:
                if not todo:
                    return
                b = todo.pop()
            b.pin()
    t0 = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    n = sum(b.nbytes for b in bufs)
    for b in bufs:
        b.unpin()
    return n / dt / 1e9


def windowed(path: str, n: int, block: int, workers: int, pin_threads: int, lookahead: int = 6) -> dict:
    """As a load's first call reads (swap/first_use.py): blocks in order into fresh HostBuffers, at
    most `lookahead` in flight, each page-locked on `pin_threads` threads once read; seconds and the
    time spent in page-locking."""
    from concurrent.futures import ThreadPoolExecutor
    from ringswap.loaders.model_file.range_reader import RangeReader
    from ringswap.swap.host_pool import HostBuffer
    pinner = ThreadPoolExecutor(max(1, pin_threads))
    pin_s = [0.0]

    def pin(b):
        t = time.perf_counter()
        b.pin()
        pin_s[0] += time.perf_counter() - t
    bufs, flight = [], []
    with RangeReader(path, workers=workers) as r:
        t0 = time.perf_counter()
        for i in range(n):
            while len(flight) >= lookahead:
                flight.pop(0).result()
            b = HostBuffer(block)
            bufs.append(b)
            fut = r.read_into(b.flat, [(i * block, block, 0)])
            if pin_threads:
                fut = pinner.submit(lambda f=fut, b=b: (f.result(), pin(b)))
            flight.append(fut)
        for f in flight:
            f.result()
        dt = time.perf_counter() - t0
    pinner.shutdown()
    for b in bufs:
        b.unpin()
    return {"seconds": dt, "pin_s": pin_s[0]}


def memory_facts() -> dict:
    out = {}
    for f in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.high"):
        try:
            out[os.path.basename(f)] = open(f).read().strip()
        except OSError:
            pass
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        out.update({k: info[k].strip() for k in ("MemTotal", "MemFree", "Cached", "Mlocked") if k in info})
    except OSError:
        pass
    return out


class Rows:
    """The probe's record: named rows of seconds over the file's bytes, printed as they come."""

    def __init__(self, out: dict, total: int) -> None:
        self.out, self.total = out, total

    def __call__(self, name: str, secs: float, **kw) -> None:
        r = {"name": name, "seconds": secs, "gbps": self.total / secs / 1e9, **kw}
        self.out["rows"].append(r)
        print(json.dumps(r), flush=True)


def windowed_rows(row: Rows, path: str, n: int, block: int) -> None:
    """The first call's windowed read + pin, with and without the link loaded (CUDA)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from link_load import LinkLoad
    for load in (False, True):
        with LinkLoad(load):
            for pins in (0, 2):
                w = windowed(path, n, block, 16, pins)
                row(f"windowed 6, pin threads {pins}, link load {load}", w["seconds"], workers=16, pin_s=w["pin_s"])
    row.out["after_windowed_gbps"] = warm(path)
    row.out["memory_after"] = memory_facts()


def fresh_rows(row: Rows, path: str, n: int, block: int, workers: list[int]) -> None:
    """Reads into fresh pageable memory (page cache dropped or not) and into huge pages."""
    for w in workers:
        for kind, drop in (("fresh", True), ("fresh", False), ("huge", False)):
            bufs = fresh(n, block, kind)
            row(f"{kind} drop={drop}", fill(path, bufs, block, w, drop), workers=w)
            del bufs
            if drop:
                warm(path)


def pool_rows(row: Rows, path: str, n: int, block: int, workers: list[int]) -> None:
    """Reads into a touched pool, pageable then page-locked, and the pool's copy to the GPU."""
    from ringswap.swap.host_pool import HostBuffer
    hb = [HostBuffer(block) for _ in range(n)]
    t1 = time.perf_counter()
    for b in hb:
        b.flat.zero_()
    row("touch (torch zero_)", time.perf_counter() - t1)
    for w in workers:
        row("touched, pageable", fill(path, [b.flat for b in hb], block, w, False), workers=w)
    if not torch.cuda.is_available():
        return
    for threads in (1, 4):
        row.out[f"pin_gbps_{threads}"] = pin_rate(hb, threads)
    for b in hb:
        b.pin()
    for w in workers:
        row("pinned pool", fill(path, [b.flat for b in hb], block, w, False), workers=w)
    dev = torch.empty(block, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    for b in hb:
        dev.copy_(b.flat, non_blocking=True)
    torch.cuda.synchronize()
    row("pinned -> device", time.perf_counter() - t1)
    for b in hb:
        b.unpin()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=12.0)
    ap.add_argument("--block-mb", type=int, default=700)
    ap.add_argument("--dir", default="/tmp/ringswap-bench")
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--json", default=None)
    ap.add_argument("--windowed", action="store_true", help="also the first call's windowed read + pin")
    ap.add_argument("--only-windowed", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    path = os.path.join(a.dir, "fill_rates.bin")
    t0 = time.perf_counter()
    size = write_file(path, a.gb)
    block = a.block_mb * 1_000_000 // 4096 * 4096
    n = size // block
    total = n * block
    out = {"gb": total / 1e9, "blocks": n, "write_s": time.perf_counter() - t0, "torch_threads": torch.get_num_threads(),
           "cpus": os.cpu_count(), "rows": []}
    row = Rows(out, total)
    out["warm_gbps"] = warm(path)
    out["rewarm_gbps"] = warm(path)   # a second read: the page cache kept it?
    out["memory"] = memory_facts()
    print(json.dumps({k: out[k] for k in ("warm_gbps", "rewarm_gbps", "memory")}), flush=True)
    if torch.cuda.is_available() and a.windowed:
        windowed_rows(row, path, n, block)
    if not a.only_windowed:
        fresh_rows(row, path, n, block, a.workers)
        pool_rows(row, path, n, block, a.workers)
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
