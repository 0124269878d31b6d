"""Give back the RAM of file-mapped tensors once their bytes are copied into a home, or once
the model's other weights have been moved to the device.

A model whose weights are views of a memory-mapped file (ComfyUI-GGUF maps the .gguf) keeps
every page it has read in the process's RSS while the map lives, so copying its blocks into
homes would hold the file twice. On Linux the copied ranges that lie in file mappings are paged
out (madvise MADV_PAGEOUT, Linux 5.4+: data-safe; clean file pages are dropped and read again
on a later touch); anonymous memory is left alone. Written here because neither torch nor the
standard library pages out memory it did not map itself. Elsewhere (Windows, macOS, older
Linux) nothing is done: mapped file pages then go only when the OS trims them.
"""
from __future__ import annotations

import bisect
import ctypes
import logging
import sys
from dataclasses import dataclass

import torch

from .host_pool import PAGE, whole_pages  # noqa: F401  (PAGE: the page size, as the tests read it here)

log = logging.getLogger("ringswap.page_out")

MADV_PAGEOUT = 21


def _file_ranges() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of regular files, sorted; [] off Linux."""
    if not sys.platform.startswith("linux"):
        return []
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith("/") and not parts[5].startswith(("/dev/", "/proc/")):
                    start, end = (int(x, 16) for x in parts[0].split("-"))
                    out.append((start, end))
    except OSError:
        return []
    return sorted(out)


class FileMaps:
    """The process's file mappings as they are now; `page_out` gives back copied tensors' pages."""

    def __init__(self, ranges: list[tuple[int, int]] | None = None):
        self.ranges = _file_ranges() if ranges is None else ranges
        self._starts = [r[0] for r in self.ranges]
        self._madvise = None
        if self.ranges:
            libc = ctypes.CDLL(None, use_errno=True)
            self._madvise = libc.madvise
            self._madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def _mapped(self, start: int, end: int) -> bool:
        k = bisect.bisect_right(self._starts, start) - 1
        return k >= 0 and self.ranges[k][0] <= start and end <= self.ranges[k][1]

    def page_out(self, tensors: list[torch.Tensor]) -> int:
        """Page out the whole pages of these CPU tensors that lie in a file mapping; the bytes
        given back (0 where nothing applies or the kernel refuses)."""
        return self.page_out_ranges([_extent(t) for t in tensors if t.device.type == "cpu" and t.numel()
                                     and t.is_contiguous()])

    def page_out_ranges(self, ranges: list[tuple[int, int]]) -> int:
        """page_out for address ranges (start, end): only those inside a file mapping now."""
        done = 0
        for start, end in ranges:
            if self._madvise is None:
                break
            lo, hi = whole_pages(start, end)
            if hi <= lo or not self._mapped(start, end):
                continue
            if self._madvise(lo, hi - lo, MADV_PAGEOUT) != 0:
                log.debug("RingSwap: madvise(MADV_PAGEOUT) refused (errno %d)", ctypes.get_errno())
                self._madvise = None   # an older kernel: do not ask again
                continue
            done += hi - lo
        return done


def _extent(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


@dataclass(frozen=True)
class Mapped:
    """A module's CPU parameter or buffer that was a view of a file mapping, and where it lay."""
    module: torch.nn.Module
    name: str
    start: int
    end: int

    def moved(self) -> bool:
        """Does the module hold something else there now (moved to a device, or replaced)?"""
        t = self.module._parameters.get(self.name, self.module._buffers.get(self.name))
        return t is None or t.device.type != "cpu" or t.data_ptr() != self.start


def mapped_tensors(model: torch.nn.Module) -> list[Mapped]:
    """`model`'s CPU parameters and buffers that are views of a file mapping ([] off Linux)."""
    maps = FileMaps()
    if not maps.ranges:
        return []
    out = []
    for mod in model.modules():
        for name, t in (*mod._parameters.items(), *mod._buffers.items()):
            if t is not None and t.device.type == "cpu" and t.numel() and t.is_contiguous():
                start, end = _extent(t)
                if maps._mapped(start, end):
                    out.append(Mapped(mod, name, start, end))
    return out


def page_out_moved(mapped: list[Mapped]) -> int:
    """Page out the file pages of those `mapped` tensors whose modules no longer hold them (e.g.
    ComfyUI moved the non-block weights to the GPU): the map's pages would stay in the RSS,
    unused, while the map lives. Runs of moved neighbours go as one range, so the pages their
    small tensors share go too. The bytes given back."""
    runs: list[tuple[int, int]] = []
    last_moved = False
    for m in sorted(mapped, key=lambda m: m.start):
        moved = m.moved()
        if moved and last_moved:
            runs[-1] = (runs[-1][0], max(runs[-1][1], m.end))
        elif moved:
            runs.append((m.start, m.end))
        last_moved = moved
    return FileMaps().page_out_ranges(runs) if runs else 0
