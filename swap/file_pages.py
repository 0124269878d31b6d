"""Block homes in the file's own pages: a read-only mapping of the model file, page-locked in place.

A RAM home made by reading the file costs new anonymous memory, and the OS zeroes every page of
it before the read fills it (2-5 GB/s on the device machine, whatever the reader count). A file
already in the page cache holds those bytes: mapped, a block's tensors are views of it, and
cudaHostRegister (read-only) page-locks them at 26 GB/s, after which they copy to the GPU at the
link's rate (bench/probes/map_rates.py). So a block whose tensors are the file's bytes as they are
(no cast, nothing missing) gets a MappedBlock as its home: nothing is read, nothing is copied in
RAM, and the pages are the ones ComfyUI's own mapping of the file uses too. A home registers only
the pages wholly inside its bytes (two registrations may not share a page, and a copy may not span
registered and unregistered memory): the few bytes in the pages it shares with its neighbours are
copied as pageable memory, in pieces of their own. Written here: no library page-locks a file
mapping. Linux and Windows (mmap.ACCESS_READ); where CUDA refuses the registration the home stays
pageable and its copies are synchronous.
"""
from __future__ import annotations

import mmap
import warnings
from typing import Callable

import torch

from .host_pool import REGISTER_READ_ONLY, register, unregister

PAGE = mmap.PAGESIZE


class FilePages:
    """One model file mapped read-only; `check()` raises where the file changed since it was opened
    (the loader's: a mapped page cut off by truncation would crash the process on a copy, so every
    block's copy asks first)."""

    def __init__(self, path: str, check: Callable[[], None] = lambda: None):
        self.path, self.check = path, check
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():   # read-only memory: nothing here writes it
            warnings.simplefilter("ignore", UserWarning)
            self.data = torch.frombuffer(self.map, dtype=torch.uint8)

    def close(self) -> None:
        self.data = None
        try:
            self.map.close()
        except BufferError:   # a view still exported (a block bound to it): freed with it
            pass


class MappedBlock:
    """One block's home in the file's pages: `parts` are (file offset, length, offset in the
    block's layout). Offers what a home buffer does (pin, unpin, pinned, nbytes, locked_bytes)."""

    def __init__(self, pages: FilePages, parts: list[tuple[int, int, int]], nbytes: int):
        self.pages, self.parts, self.nbytes = pages, parts, nbytes
        self.start = min(s for s, _, _ in parts)
        self.end = max(s + n for s, n, _ in parts)
        self.pinned = False
        self._range = (0, 0)
        self._budget = None

    @property
    def locked_bytes(self) -> int:
        a, b = self._range
        return b - a if self.pinned else 0

    def pin(self) -> bool:
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        a, b = (self.start + PAGE - 1) // PAGE * PAGE, self.end // PAGE * PAGE   # its own whole pages
        if a >= b:
            return False
        budget = register(self.pages.data[a:b].data_ptr(), b - a, REGISTER_READ_ONLY)
        if budget is False:
            return False
        self._range, self._budget, self.pinned = (a, b), budget, True
        return True

    def unpin(self) -> None:
        if self.pinned:
            a, _ = self._range
            unregister(self.pages.data[a:].data_ptr(), self._budget)
            self.pinned, self._range = False, (0, 0)

    def pieces(self) -> list[tuple[int, int, int]]:
        """`parts` split where the registered range begins and ends (a copy is either all
        page-locked or all pageable)."""
        a, b = self._range if self.pinned else (0, 0)
        out = []
        for s, n, d in self.parts:
            cuts = sorted({s, s + n} | {c for c in (a, b) if s < c < s + n})
            out += [(x, y - x, d + x - s) for x, y in zip(cuts, cuts[1:])]
        return out

    def copy_into(self, out: torch.Tensor) -> None:
        """Copy the block's bytes into `out` (its layout; on the current stream, async where pinned)."""
        self.pages.check()
        data = self.pages.data
        for s, n, d in self.pieces():
            out[d:d + n].copy_(data[s:s + n], non_blocking=True)

    def __del__(self):
        try:
            self.unpin()
        except Exception:   # noqa: BLE001
            pass
