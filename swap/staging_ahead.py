"""Pinned staging buffers for a load's first call, made ahead on a thread of their own.

A load's first call reads the blocks whose homes are not page-locked yet into a few pinned staging
buffers (swap/first_use.py). Each buffer's pages are made first (the OS zeroes them) and then
page-locked: ~2.8 GB for Wan 14B's four, on the attach's path unless made before it. The engine's
`stage_ahead` starts them from the RingSwap node on, so the attach takes them ready; a load that
does not use them lets them go.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from . import driver_turns
from .host_pool import HostBuffer

COUNT = 4   # the buffers made ahead: a ring of 2 slots + 2 (first_use takes ring slots + 2, at most 6)


def pinned_buffer(nbytes: int, pin: bool = True) -> HostBuffer:
    """A staging buffer of `nbytes`, its pages made on torch's threads before page-locking (the
    driver would fault them in one by one, holding its lock)."""
    buf = HostBuffer(nbytes)
    if pin:
        buf.flat.zero_()
        buf.pin()
    return buf


class StagingAhead:
    """`count` pinned buffers of `nbytes`, being made from now on; `take()` waits for them."""

    def __init__(self, nbytes: int, count: int = COUNT):
        self.nbytes = nbytes
        pool = ThreadPoolExecutor(1, thread_name_prefix="ringswap-stage")
        self._made = pool.submit(lambda: [pinned_buffer(nbytes) for _ in range(count)])
        pool.shutdown(wait=False)

    def take(self) -> list[HostBuffer]:
        with driver_turns.aside():
            return self._made.result()

    def release(self) -> None:
        for buf in self.take():
            buf.unpin()
