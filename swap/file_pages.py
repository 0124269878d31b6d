"""Block homes in the file's own pages: a read-only mapping of the model file, page-locked in place.

A RAM home made by reading the file costs new anonymous memory, and the OS zeroes every page of
it before the read fills it (2-5 GB/s on the device machine, whatever the reader count). A file
already in the page cache holds those bytes: mapped, a block's tensors are views of it, and
cudaHostRegister (read-only) page-locks them at 26 GB/s, after which they copy to the GPU at the
link's rate (bench/probes/map_rates.py). So a block whose tensors are the file's bytes as they are
(a tensor the model holds in another dtype crosses the link as the file has it and is cast on the GPU
where the block lands; a scalar the file lacks is written beside) gets a MappedBlock as its home:
nothing is read, nothing is copied in RAM, and the pages are the ones ComfyUI's own mapping of the
file uses too. A home registers the pages wholly inside its bytes; swap/in_place.py does the copies,
the casts and the few bytes in the pages it shares with its neighbours. Written here: no library page-locks a file
mapping. Linux and Windows (mmap.ACCESS_READ); where CUDA refuses to register a file's pages
(`pinnable`) the loader keeps RAM homes read from the file instead.
"""
from __future__ import annotations

import mmap
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from . import driver_turns
from .host_pool import PAGE, REGISTER_READ_ONLY, register, unregister, whole_pages
from .in_place import InPlace, register_pieces

AHEAD_THREADS = 2   # lock_ahead's threads: the driver registers one piece at a time, a second touches pages meanwhile


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
        self._pinnable: bool | None = None
        self._ahead: dict[tuple[int, int], Future] = {}   # lock_ahead's registrations by page range
        self._ahead_lock = threading.Lock()

    def pinnable(self) -> bool:
        """Can CUDA page-lock this mapping's pages (asked once: register a few pages and let them go)?
        Where it cannot (some drivers, other OSes) homes here would copy as pageable memory, slowly."""
        if self._pinnable is None:
            n = min(len(self.map), 1 << 21) // PAGE * PAGE
            budget = register(self.data[:n].data_ptr(), n, REGISTER_READ_ONLY) if n else False
            if budget is not False:
                unregister(self.data[:n].data_ptr(), budget)
            self._pinnable = budget is not False
        return self._pinnable

    def lock_ahead(self, ranges: list[tuple[int, int]]) -> None:
        """Page-lock the whole pages of each byte range [start, end) of the file, in this order, from
        now on (a model's blocks, before the model is even built: swap/load_plan.pins_ahead); a
        MappedBlock over exactly such a range takes the registration over (`take`)."""
        if not ranges or not torch.cuda.is_available() or not self.pinnable():
            return
        threads = ThreadPoolExecutor(AHEAD_THREADS, thread_name_prefix="ringswap-pin-ahead")
        data = self.data   # held by the threads: the pages stay mapped while they register
        with self._ahead_lock:
            for k, (start, end) in enumerate(ranges):
                a, b = whole_pages(start, end)
                if b > a and (a, b) not in self._ahead:
                    self._ahead[(a, b)] = threads.submit(_lock_pages, data[a:b], k)
        threads.shutdown(wait=False)

    def take(self, start: int, end: int) -> list[tuple[int, int, object]] | None:
        """The registrations lock_ahead made for exactly the pages [start, end) (waiting for them), or
        None; one made for pages overlapping these is let go first (no page is registered twice)."""
        with self._ahead_lock:
            mine = self._ahead.pop((start, end), None)
            others = [self._ahead.pop(r) for r in list(self._ahead) if r[0] < end and start < r[1]]
        _let_go(others)
        if mine is None or mine.cancel():
            return None
        with driver_turns.aside():
            return mine.result()

    def keep(self, ranges: set[tuple[int, int]]) -> None:
        """Let go of lock_ahead's registrations of every page range but these (the blocks that will
        have homes here)."""
        with self._ahead_lock:
            left = [self._ahead.pop(r) for r in list(self._ahead) if r not in ranges]
        _let_go(left)

    def release(self, start: int, end: int) -> None:
        """Let go of lock_ahead's registration of [start, end) if no home took it over."""
        with self._ahead_lock:
            mine = self._ahead.pop((start, end), None)
        _let_go([mine] if mine is not None else [])

    def close(self) -> None:
        """Let go of what lock_ahead registered and no home took over, and of the mapping: unmapped once
        no view of it is left. Not mmap.close(): torch.frombuffer's views keep the mapping object alive
        but do not export its buffer, so close() would unmap pages a home still copies from (or a
        pinning thread still registers: a crash)."""
        with self._ahead_lock:
            left, self._ahead = list(self._ahead.values()), {}
        _let_go(left)
        self.data = self.map = None


def _lock_pages(pages: torch.Tensor, key: int) -> list[tuple[int, int, object]] | None:
    """Register `pages` (a page-aligned view of the mapping) in REGISTER_PIECE pieces, page tables
    filled first (a byte read a page), taking turns in call order `key`; None where CUDA refuses."""
    fill_page_tables(pages)
    spans = []
    with driver_turns.in_call_order(key):
        for ptr, size in register_pieces([(pages.data_ptr(), pages.numel())]):
            budget = register(ptr, size, REGISTER_READ_ONLY)
            if budget is False:
                for p, _, b in spans:
                    unregister(p, b)
                return None
            spans.append((ptr, size, budget))
    return spans


def fill_page_tables(pages: torch.Tensor) -> None:
    """Fill the mapping's page tables for `pages` (a byte read a page), outside the driver's lock, so a
    registration after it runs at 28.6 GB/s instead of 18.1 (bench/probes/pin_contention.py --populate)."""
    int(pages[::PAGE].sum())


def _let_go(pins: list[Future]) -> None:
    """Unregister what these lock_ahead registrations hold (each waited for; one not begun is dropped)."""
    for pin in pins:
        if pin.cancel():
            continue
        for ptr, _, budget in pin.result() or ():
            unregister(ptr, budget)


class MappedBlock(InPlace):
    """One block's home in the file's pages: `parts` are (file offset, length in the file, offset in
    the block's layout[, (file dtype, model dtype) where the model holds it in another dtype: cast
    where it lands, on the GPU]); `values` (tensor, offset in the layout) the few values the model
    holds that the file lacks (scaled fp8's `scale_input`), written where the block lands. It
    registers the whole pages inside its bytes in the file (swap/in_place.py does the rest)."""
    FLAGS = (REGISTER_READ_ONLY,)

    def __init__(self, pages: FilePages, parts: list[tuple], nbytes: int,
                 values: list[tuple[torch.Tensor, int]] = ()):
        self.pages, self.data = pages, pages.data   # the mapping, held while this home lives (pages may close)
        self.start = min(p[0] for p in parts)
        self.end = max(p[0] + p[1] for p in parts)
        super().__init__([(self.data[p[0]:p[0] + p[1]], p[2], p[3] if len(p) > 3 else None) for p in parts]
                         + [(v.reshape(-1).view(torch.uint8), d, None) for v, d in values], nbytes)

    def _own_pages(self) -> torch.Tensor:
        """The mapping's pages wholly inside the block's bytes (maybe none)."""
        a, b = whole_pages(self.start, self.end)
        return self.data[a:b]

    def _wanted(self) -> list[tuple[int, int]]:
        own = self._own_pages()
        return [(own.data_ptr(), own.numel())] if own.numel() else []

    def _pin(self) -> bool:
        """Page-lock in place (under the pin lock): the registration FilePages.lock_ahead made of these
        pages where there is one, else with the mapping's page tables filled first (a byte read a page,
        outside the driver's lock): the registration then runs at 28.6 GB/s instead of 18.1
        (bench/probes/pin_contention.py --populate, bench/RESULTS.md)."""
        if not self.pinned and torch.cuda.is_available():
            spans = self.pages.take(*whole_pages(self.start, self.end))
            if spans and self._adopt(spans):
                return True
            fill_page_tables(self._own_pages())
        return super()._pin()

    def unpin(self) -> None:
        super().unpin()
        self.pages.release(*whole_pages(self.start, self.end))

    def check(self) -> None:
        self.pages.check()

    def holds(self, tensors: list[torch.Tensor], hold: bool = True) -> bool:
        """The file's pages hold the block whatever its module points at."""
        return True

    def off_device(self, s) -> None:
        """Off the device the module holds empty stand-ins (its weights are the file's)."""
        s.unbind(torch.device("cpu"))
