"""A smaller machine's RAM on a big one: a separate process locks all but `leave` GB of the
RAM available, so the process under test sees about `leave` GB (psutil's available, which
RingSwap's home=auto and ComfyUI read). The locked pages are mlock'ed where the OS lets it
(else only touched: no swap on the H200 machine). Also: the pages swapped out so far (to
show a cell did not swap).

    with RamBallast(32) as b: print(b.line)     # in bench/compare.py, per cell (--rams)
    python bench/ram_ballast.py 32               # the ballast process itself
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import time

import psutil

from common import Ballast   # bench/ is on sys.path: as the script's folder or by the importer

GB = 1e9


def swapped_out_pages() -> int | None:
    """Pages the kernel has swapped out since boot (/proc/vmstat pswpout); None where unknown."""
    try:
        with open("/proc/vmstat") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("pswpout "))
    except (OSError, StopIteration, ValueError):
        return None


class RamBallast(Ballast):
    """`with RamBallast(leave_gb):` a process holding all but `leave_gb` GB of the available
    RAM while the block runs (nothing for 0); `line` says what it locked and what is left."""

    def __init__(self, leave_gb: float):
        super().__init__(leave_gb, "cpu")

    def command(self) -> list[str]:
        return [sys.executable, os.path.abspath(__file__), str(self.cap_gib)]

    def __enter__(self) -> "RamBallast":
        super().__enter__()
        if self.line:
            self.line += f"; available to the cell now {psutil.virtual_memory().available / GB:.1f} GB"
        return self


def _hold(leave_gb: float) -> None:
    before = psutil.virtual_memory().available
    n = int(before - leave_gb * GB)
    if n <= 0:
        print(f"ready: nothing to lock ({before / GB:.1f} GB available <= {leave_gb:g} GB)", flush=True)
    else:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(-1, n, flags=flags)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
        libc = ctypes.CDLL(None, use_errno=True)
        locked = libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(n)) == 0
        if not locked:   # touch every page instead (MAP_POPULATE may be missing)
            for off in range(0, n, mmap.PAGESIZE):
                region[off] = 1
        print(f"ready: {'locked' if locked else 'touched (mlock refused)'} {n / GB:.1f} GB of "
              f"{before / GB:.1f} GB available, {psutil.virtual_memory().available / GB:.1f} GB left; "
              f"swap {psutil.swap_memory().total / GB:.1f} GB", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    _hold(float(sys.argv[1]))
