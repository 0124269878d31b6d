"""The disk's and the link's own rates: page-cache drops, O_DIRECT reads of a file, pinned
host-to-device copies. What a streaming row is held against."""
from __future__ import annotations

import mmap
import os
import statistics
import threading
import time

import torch

from common import gb, sync

def drop_page_cache(path: str, mode: str) -> str:
    """Evict `path` from the page cache; returns the method used."""
    if mode in ("auto", "root"):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError as e:
            if mode == "root":
                raise RuntimeError(f"cannot write /proc/sys/vm/drop_caches: {e}") from e
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd) if hasattr(os, "fdatasync") else None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fadvise"


def odirect_rate(path: str, limit: int, allow_direct: bool, drop_mode: str, threads: int = 1) -> dict:
    """4 MiB reads of the first `limit` bytes (0 = all) with O_DIRECT into aligned (mmap)
    buffers, by `threads` threads taking chunks in turn (one fd and buffer each); buffered
    reads after a cache drop if O_DIRECT is refused."""
    size = os.path.getsize(path)
    want = min(size, limit) if limit > 0 else size
    bs = 4 << 20
    flags, mode = os.O_RDONLY, "O_DIRECT"
    if allow_direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                probe = mmap.mmap(-1, bs)
                os.preadv(fd, [probe], 0)   # some file systems accept the open, refuse the read
                probe.close()
                flags = os.O_RDONLY | os.O_DIRECT
            finally:
                os.close(fd)
        except OSError as e:
            mode = f"buffered (O_DIRECT refused: {e.strerror or e})"
    else:
        mode = "buffered (O_DIRECT not tried)"
    if flags == os.O_RDONLY:
        mode += f", after {drop_page_cache(path, drop_mode)}"
    chunks = list(range(0, want, bs))
    lock = threading.Lock()
    got = [0]

    def worker() -> None:
        fd, buf = os.open(path, flags), mmap.mmap(-1, bs)
        try:
            while True:
                with lock:
                    if not chunks:
                        return
                    off = chunks.pop(0)
                k = os.preadv(fd, [buf], off)
                with lock:
                    got[0] += max(0, min(k, want - off))
        finally:
            os.close(fd)
            buf.close()

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    dt = time.perf_counter() - t0
    return {"mode": mode + (f", {threads} threads" if threads > 1 else ""), "bytes": got[0], "seconds": dt,
            "gbps": gb(got[0]) / dt if dt > 0 else 0.0, "threads": threads}


def h2d_rate(dev: torch.device, nbytes: int, reps: int = 5) -> dict:
    """Median of `reps` copies of one pinned host tensor to the device (CPU: a plain copy)."""
    cuda = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for i in range(reps + 1):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    del src, dst
    if cuda:
        try:
            torch._C._host_emptyCache()   # give the pinned 1 GiB back (RSS baselines)
        except Exception:   # noqa: BLE001
            pass
    med = statistics.median(times)
    return {"bytes": nbytes, "pinned": cuda, "times": times, "gbps": gb(nbytes) / med}
