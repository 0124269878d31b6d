"""Block homes in the file's own pages: a read-only mapping of the model file, page-locked in place.

A RAM home made by reading the file costs new anonymous memory, and the OS zeroes every page of
it before the read fills it (2-5 GB/s on the device machine, whatever the reader count). A file
already in the page cache holds those bytes: mapped, a block's tensors are views of it, and
cudaHostRegister (read-only) page-locks them at 26 GB/s, after which they copy to the GPU at the
link's rate (bench/probes/map_rates.py). So a block whose tensors are the file's bytes as they are
(a tensor the model holds in another dtype crosses the link as the file has it and is cast on the GPU
by the stream that uses the block, never on the copy stream, where a kernel would wait for the
compute's; a scalar the file lacks is written beside) gets a MappedBlock as its home: nothing is read, nothing is copied in
RAM, and the pages are the ones ComfyUI's own mapping of the file uses too. A home registers only
the pages wholly inside its bytes (two registrations may not share a page, and a copy may not span
registered and unregistered memory): the few bytes in the pages it shares with its neighbours are
copied once into a small page-locked buffer of its own (a copy from pageable memory would make CUDA
synchronise the copy stream, holding the block loop to the GPU's pace). Written here: no library page-locks a file
mapping. Linux and Windows (mmap.ACCESS_READ); where CUDA refuses to register a file's pages
(`pinnable`) the loader keeps RAM homes read from the file instead.
"""
from __future__ import annotations

import mmap
import warnings
from typing import Callable

import torch

from .host_pool import REGISTER_READ_ONLY, HostBuffer, register, unregister

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
        self._pinnable: bool | None = None

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

    def close(self) -> None:
        self.data = None
        try:
            self.map.close()
        except BufferError:   # a view still exported (a block bound to it): freed with it
            pass


def _cast(casts: list[tuple]) -> None:
    """Cast each (destination, its bytes as the file holds them, the file's dtype) on the current
    stream; a device buffer the bytes crossed in is kept until this stream is done with it."""
    for dst, raw, dtype in casts:
        if raw.is_cuda and raw.data_ptr() != dst.data_ptr():
            raw.record_stream(torch.cuda.current_stream(raw.device))
        dst.copy_(raw.view(dtype))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class MappedBlock:
    """One block's home in the file's pages: `parts` are (file offset, length in the file, offset in
    the block's layout[, (file dtype, model dtype) where the model holds it in another dtype: cast
    where it lands, on the GPU]); `values` (tensor, offset in the layout) the few values the model
    holds that the file lacks (scaled fp8's `scale_input`), written where the block lands. Offers
    what a home buffer does (pin, unpin, pinned, nbytes, locked_bytes)."""

    def __init__(self, pages: FilePages, parts: list[tuple], nbytes: int,
                 values: list[tuple[torch.Tensor, int]] = ()):
        self.pages, self.nbytes = pages, nbytes
        self.parts = [(p[0], p[1], p[2], p[3] if len(p) > 3 else None) for p in parts]
        self.values = [(v.reshape(-1).view(torch.uint8), d) for v, d in values]   # (bytes, offset): not in the file
        self.start = min(p[0] for p in parts)
        self.end = max(p[0] + p[1] for p in parts)
        self.pinned = False
        self._range = (0, 0)
        self._budget = None
        self._rest: HostBuffer | None = None   # page-locked: the bytes outside the registered pages, the values
        self._at: dict[int, int] = {}           # file offset (a value: -1 - its index) -> offset in _rest

    @property
    def locked_bytes(self) -> int:
        a, b = self._range
        return b - a + (self._rest.locked_bytes if self._rest is not None else 0) if self.pinned else 0

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
        self._keep_rest()
        return True

    def _keep_rest(self) -> None:
        """Copy the few bytes outside the registered pages (at most a page at each end) and the
        values into a small page-locked buffer: a copy from pageable memory makes CUDA synchronise
        the copy stream first, which would hold the block loop to the GPU's pace. Left pageable
        where that buffer cannot be page-locked."""
        pieces = self._outside()
        if not pieces:
            return
        rest = HostBuffer(sum(n for _, n in pieces))
        if not rest.pin():
            return
        pos = 0
        for key, n in pieces:
            src = self.pages.data[key:key + n] if key >= 0 else self.values[-1 - key][0]
            rest.flat[pos:pos + n].copy_(src)
            self._at[key], pos = pos, pos + n
        self._rest = rest

    @property
    def pageable_bytes(self) -> int:
        """Bytes a copy of the block takes from pageable memory (none once pinned, unless the
        buffer for the rest could not be page-locked)."""
        return sum(n for key, n in self._outside() if key not in self._at)

    def _outside(self) -> list[tuple[int, int]]:
        """(file offset, length) of the pieces outside the registered pages, then (-1 - k, length)
        of each value."""
        a, b = self._range if self.pinned else (0, 0)
        pieces = [(x, y - x) for s, n, _, _ in self.parts for x, y in self.cuts(s, n) if not a <= x < b]
        return pieces + [(-1 - k, v.numel()) for k, (v, _) in enumerate(self.values)]

    def _source(self, key: int, n: int) -> torch.Tensor:
        """The bytes at file offset `key` (a value: -1 - its index), from the page-locked rest where kept."""
        pos = self._at.get(key)
        if pos is not None:
            return self._rest.flat[pos:pos + n]
        return self.pages.data[key:key + n] if key >= 0 else self.values[-1 - key][0]

    def unpin(self) -> None:
        if self.pinned:
            a, _ = self._range
            unregister(self.pages.data[a:].data_ptr(), self._budget)
            self.pinned, self._range = False, (0, 0)
            if self._rest is not None:
                self._rest.unpin()
            self._rest, self._at = None, {}

    def cuts(self, s: int, n: int) -> list[tuple[int, int]]:
        """The file range [s, s + n) split where the registered range begins and ends (a copy is
        either all page-locked or all pageable; a page boundary falls between two elements)."""
        a, b = self._range if self.pinned else (0, 0)
        cuts = sorted({s, s + n} | {c for c in (a, b) if s < c < s + n})
        return list(zip(cuts, cuts[1:]))

    def land(self, out: torch.Tensor) -> Callable[[], None] | None:
        """Copy the block's bytes into `out` (its layout; on the current stream, async where pinned).
        A tensor to cast crosses as the file has it: into its own place where the sizes agree (bf16
        and fp16), else into a device buffer of its own. Returns the casts left to do, in place, on
        the stream that will use the block once this stream's copies are done (None: nothing left);
        on the CPU too, so that one path serves both."""
        self.pages.check()
        data, on_device, casts = self.pages.data, out.device.type != "cpu", []
        for s, n, d, cast in self.parts:
            f, t = (_itemsize(cast[0]), _itemsize(cast[1])) if cast is not None else (1, 1)
            raw = out[d:d + n] if f == t else torch.empty(n, dtype=torch.uint8, device=out.device) \
                if on_device else data[s:s + n]
            if raw.data_ptr() != data[s:s + n].data_ptr():
                for x, y in self.cuts(s, n):
                    raw[x - s:y - s].copy_(self._source(x, y - x), non_blocking=True)
            if cast is not None:
                casts.append((out[d:d + n // f * t].view(cast[1]), raw, cast[0]))
        for k, (value, d) in enumerate(self.values):
            out[d:d + value.numel()].copy_(self._source(-1 - k, value.numel()), non_blocking=True)
        return (lambda: _cast(casts)) if casts else None

    def copy_into(self, out: torch.Tensor) -> None:
        """Copy and cast the block's bytes into `out`, all on the current stream (placing up front,
        reading into RAM)."""
        left = self.land(out)
        if left is not None:
            left()

    def holds(self, tensors: list[torch.Tensor], hold: bool = True) -> bool:
        """The file's pages hold the block whatever its module points at."""
        return True

    def off_device(self, s) -> None:
        """Off the device the module holds empty stand-ins (its weights are the file's)."""
        s.unbind(torch.device("cpu"))

    def __del__(self):
        try:
            self.unpin()
        except Exception:   # noqa: BLE001
            pass
