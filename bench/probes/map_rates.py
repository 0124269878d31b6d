"""Fresh anonymous memory against the file's own pages (issue 53): what a load's RAM homes cost.

Touches --gb of fresh anonymous memory with 16 threads (the first time in this process, then
again after freeing it: memory the OS hands back a second time), and maps a --gb file already in
the page cache, page-locks the mapping with cudaHostRegister (read-only) and copies it to the
GPU: the rates of making homes from new memory against using the page cache in place.

    python3 bench/probes/map_rates.py --gb 12 --json $OUT/map_rates.json
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import threading
import time

import torch

READ_ONLY = 8   # cudaHostRegisterReadOnly


def touch(gb: float, threads: int = 16) -> float:
    """GB/s writing one byte a page of fresh anonymous memory on `threads` threads."""
    n = int(gb * 1e9) // 4096 * 4096
    m = mmap.mmap(-1, n)
    t = torch.frombuffer(m, dtype=torch.uint8)
    step = n // threads // 4096 * 4096

    def work(k: int) -> None:
        t[k * step:(k + 1) * step].view(-1, 4096)[:, 0].fill_(1)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for x in ts:
        x.start()
    for x in ts:
        x.join()
    dt = time.perf_counter() - t0
    del t
    m.close()
    return n / dt / 1e9


def mapped(path: str) -> dict:
    size = os.path.getsize(path) // 4096 * 4096
    f = open(path, "rb")
    m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
    t = torch.frombuffer(m, dtype=torch.uint8)
    out = {"bytes": size}
    t0 = time.perf_counter()
    t.view(-1, 4096)[:, 0].sum()   # fault every page in (page cache: no read)
    out["fault_gbps"] = size / (time.perf_counter() - t0) / 1e9
    rt = torch.cuda.cudart()
    chunk = 1 << 30
    t0 = time.perf_counter()
    errs = [int(rt.cudaHostRegister(t[o:o + chunk].data_ptr(), min(chunk, size - o), READ_ONLY)) for o in range(0, size, chunk)]
    out["register_gbps"] = size / (time.perf_counter() - t0) / 1e9
    out["register_errors"] = sorted(set(errs))
    dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for o in range(0, size - chunk + 1, chunk):
        dev.copy_(t[o:o + chunk], non_blocking=True)
    torch.cuda.synchronize()
    out["h2d_gbps"] = (size // chunk * chunk) / (time.perf_counter() - t0) / 1e9
    for o in range(0, size, chunk):
        rt.cudaHostUnregister(t[o:o + chunk].data_ptr())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=12.0)
    ap.add_argument("--file", default="/tmp/ringswap-bench/fill_rates.bin")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = {"touch_first_gbps": touch(a.gb), "touch_again_gbps": touch(a.gb)}
    print(json.dumps(out), flush=True)
    if os.path.exists(a.file) and torch.cuda.is_available():
        out["mapped"] = mapped(a.file)
        print(json.dumps(out["mapped"]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
