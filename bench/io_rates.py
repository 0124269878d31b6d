"""The disk's and the link's own rates: page-cache drops, O_DIRECT reads of a file, reads of a
warm file into pinned memory, pinned host-to-device copies. What a streaming row and the time
to the first step are held against."""
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
    want = _want(path, limit)
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
    got, dt = _read_chunks(path, flags, want, bs, [mmap.mmap(-1, bs) for _ in range(max(1, threads))])
    return {"mode": mode + (f", {threads} threads" if threads > 1 else ""), "bytes": got, "seconds": dt,
            "gbps": gb(got) / dt if dt > 0 else 0.0, "threads": threads}


def _read_chunks(path: str, flags: int, want: int, bs: int, bufs: list) -> tuple[int, float]:
    """Positioned reads (os.preadv) of the first `want` bytes of `path` in `bs` chunks, one
    thread per buffer of `bufs` taking chunks in turn, each with its own fd (opened before the
    clock starts, as the buffers are made); (bytes read, seconds)."""
    chunks = iter(range(0, want, bs))
    lock = threading.Lock()
    got = [0]
    fds = [os.open(path, flags) for _ in bufs]

    def worker(fd: int, buf) -> None:
        while True:
            with lock:
                off = next(chunks, None)
            if off is None:
                return
            k = os.preadv(fd, [buf], off)
            with lock:
                got[0] += max(0, min(k, want - off))

    try:
        t0 = time.perf_counter()
        pool = [threading.Thread(target=worker, args=(fd, buf)) for fd, buf in zip(fds, bufs)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return got[0], time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def _want(path: str, limit: int) -> int:
    size = os.path.getsize(path)
    return min(size, limit) if limit > 0 else size


def warm_read(path: str, threads: int = 8, limit: int = 0, chunk: int = 64 << 20) -> dict:
    """Read the first `limit` bytes (0 = all) of `path` once through the page cache, `threads`
    threads of 64 MiB positioned reads into reused buffers: the file is then as warm as the
    page cache can hold it (compare.py's warm cells all start so)."""
    bufs = [bytearray(chunk) for _ in range(max(1, threads))]
    got, dt = _read_chunks(path, os.O_RDONLY, _want(path, limit), chunk, bufs)
    return {"bytes": got, "seconds": dt, "gbps": gb(got) / dt if dt > 0 else 0.0, "threads": threads}


def pinned_read_rate(path: str, limit: int, threads: int, chunk: int = 64 << 20) -> dict:
    """The rate of reading the first `limit` bytes (0 = all) of `path` from the page cache into
    page-locked memory: `threads` threads of 64 MiB os.preadv reads, each with its own fd and
    its own pinned buffer (plain memory without CUDA): what a load that fills pinned homes from
    a warm file can reach (issue 53's bound on the time to the first step)."""
    cuda = torch.cuda.is_available()
    tensors = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(max(1, threads))]
    got, dt = _read_chunks(path, os.O_RDONLY, _want(path, limit), chunk, [t.numpy() for t in tensors])
    del tensors
    if cuda:
        try:
            torch._C._host_emptyCache()   # give the pinned buffers back (the cells' RSS and pins)
        except Exception:   # noqa: BLE001
            pass
    return {"bytes": got, "seconds": dt, "gbps": gb(got) / dt if dt > 0 else 0.0, "threads": threads,
            "pinned": cuda}


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
