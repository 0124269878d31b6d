"""A block home in memory that is not RingSwap's: bytes where they already are, page-locked in place.

Shared by the homes in the model file's own pages (swap/file_pages.py) and in a module's own tensors
(swap/held_tensors.py). A home is `parts`, each (its bytes as a uint8 tensor, offset in the block's
layout, (source dtype, model dtype) where the model holds it in another dtype), and says which page
ranges it registers (cudaHostRegister; two registrations may not share a page, and one copy may not
span registered and unregistered memory). The bytes outside those ranges are copied once into a
small page-locked buffer of its own: CUDA synchronises a stream before any copy from pageable
memory, which would hold the block loop to the GPU's pace. The pieces each landing copies are
worked out once per pin state, not per landing. A tensor to cast crosses as its source holds it and
is cast by the stream that uses the block, never on the copy stream, where a kernel would wait for
the compute's. Written here: no library page-locks memory it does not own.
"""
from __future__ import annotations

import threading
from typing import Callable

import torch

from .host_pool import HostBuffer, register, unregister


class InPlace:
    """Offers what a home buffer does (pin, unpin, pinned, nbytes, locked_bytes), and `land`,
    `copy_into`, `pageable_bytes`. Subclasses give `_wanted` (the (pointer, size) ranges to
    register), `FLAGS` (cudaHostRegister flags to try in turn), and may `check` before each copy."""
    FLAGS: tuple[int, ...] = (0,)

    def __init__(self, parts: list[tuple], nbytes: int):
        self.parts, self.nbytes = parts, nbytes
        self.pinned = False
        self._pinning = threading.Lock()   # a pin on a pinning thread and an unpin (a dropped model's) take turns
        self._spans: list[tuple[int, int, object]] = []   # (pointer, size, budget) registered
        self._rest: HostBuffer | None = None
        self._copies: list[tuple[int, int, int, torch.Tensor]] | None = None   # (part, start, end, source)

    def _wanted(self) -> list[tuple[int, int]]:
        raise NotImplementedError

    def check(self) -> None:
        """Before each copy: raise where the bytes can no longer be read (nothing to ask here)."""

    @property
    def locked_bytes(self) -> int:
        if not self.pinned:
            return 0
        return sum(n for _, n, _ in self._spans) + (self._rest.locked_bytes if self._rest is not None else 0)

    def pin(self) -> bool:
        """Page-lock in place; False (and nothing left locked) where CUDA refuses."""
        with self._pinning:
            return self._pin()

    def _pin(self) -> bool:
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        for ptr, size in register_pieces(self._wanted()):
            budget = False
            for flags in self.FLAGS:
                budget = register(ptr, size, flags)
                if budget is not False:
                    break
            if budget is False:
                self.pinned = True
                self._unpin()
                return False
            self._spans.append((ptr, size, budget))
        self.pinned = True
        if not self._keep_rest():
            self._unpin()
            return False
        return True

    def _adopt(self, spans: list[tuple[int, int, object]]) -> bool:
        """Under the pin lock, not pinned yet: take over registrations made ahead for exactly this
        home's pieces ((pointer, size, budget), swap/file_pages.py `FilePages.lock_ahead`); False, with
        them let go, where they are not its pieces or its rest cannot be page-locked."""
        if [(p, n) for p, n, _ in spans] != register_pieces(self._wanted()):
            for ptr, _, budget in spans:
                unregister(ptr, budget)
            return False
        self._spans, self.pinned = list(spans), True
        if not self._keep_rest():
            self._unpin()
            return False
        return True

    def unpin(self) -> None:
        with self._pinning:
            self._unpin()

    def _unpin(self) -> None:
        if self.pinned:
            for ptr, _, budget in self._spans:
                unregister(ptr, budget)
            if self._rest is not None:
                self._rest.unpin()
            self.pinned, self._spans, self._rest, self._copies = False, [], None, None

    def pieces(self) -> list[tuple[int, int, int, bool]]:
        """(part, start, end, registered) of every part split where the registered ranges begin and end."""
        out = []
        for k, (src, _, _) in enumerate(self.parts):
            p, n = src.data_ptr(), src.numel()
            cuts = sorted({0, n} | {c - p for ptr, size, _ in self._spans for c in (ptr, ptr + size) if p < c < p + n})
            out += [(k, x, y, any(ptr <= p + x and p + y <= ptr + size for ptr, size, _ in self._spans))
                    for x, y in zip(cuts, cuts[1:])]
        return out

    def _keep_rest(self) -> bool:
        """Copy the bytes outside the registered ranges into a small page-locked buffer; False
        where it cannot be page-locked (over the pin budget: the block is not pinned at all)."""
        pieces = self.pieces()
        outside = sum(y - x for _, x, y, inside in pieces if not inside)
        rest = HostBuffer(outside) if outside else None
        if rest is not None and not rest.pin():
            return False
        pos, self._copies = 0, []
        for k, x, y, inside in pieces:
            src = self.parts[k][0][x:y]
            if not inside:
                rest.flat[pos:pos + y - x].copy_(src)
                src, pos = rest.flat[pos:pos + y - x], pos + y - x
            self._copies.append((k, x, y, src))
        self._rest = rest
        return True

    def _copy_list(self) -> list[tuple[int, int, int, torch.Tensor]]:
        if self._copies is None:
            self._copies = [(k, x, y, self.parts[k][0][x:y]) for k, x, y, _ in self.pieces()]
        return self._copies

    @property
    def pageable_bytes(self) -> int:
        """Bytes a copy of the block takes from pageable memory (none once pinned)."""
        return 0 if self.pinned else sum(src.numel() for src, _, _ in self.parts)

    def land(self, out: torch.Tensor) -> Callable[[], None] | None:
        """Copy the block's bytes into `out` (its layout; on the current stream, async where pinned).
        A tensor to cast crosses as its source holds it: into its own place where the sizes agree
        (bf16 and fp16), else into a device buffer of its own. Returns the casts left to do, in
        place, on the stream that will use the block once this stream's copies are done (None:
        nothing left); on the CPU too, so that one path serves both."""
        self.check()
        on_device, raws, casts = out.device.type != "cpu", [], []
        for src, d, cast in self.parts:
            n = src.numel()
            f, t = (cast[0].itemsize, cast[1].itemsize) if cast is not None else (1, 1)
            raw = out[d:d + n] if f == t else torch.empty(n, dtype=torch.uint8, device=out.device) \
                if on_device else src
            raws.append(raw)
            if cast is not None:
                casts.append((out[d:d + n // f * t].view(cast[1]), raw, cast[0]))
        for k, x, y, source in self._copy_list():
            if raws[k] is not self.parts[k][0]:
                raws[k][x:y].copy_(source, non_blocking=True)
        return (lambda: _cast(casts)) if casts else None

    def copy_into(self, out: torch.Tensor) -> None:
        """Copy and cast the block's bytes into `out`, all on the current stream (placing up front,
        reading into RAM)."""
        left = self.land(out)
        if left is not None:
            left()

    def __del__(self):
        try:
            self.unpin()
        except Exception:   # noqa: BLE001
            pass


REGISTER_PIECE = 256 << 20   # bytes a registration holds the driver for at most (~25 ms: swap/driver_turns.py)


def register_pieces(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Each (pointer, size) in REGISTER_PIECE pieces (page multiples), so a copy waits for one short one."""
    return [(p + k, min(REGISTER_PIECE, n - k)) for p, n in ranges for k in range(0, n, REGISTER_PIECE)]


def _cast(casts: list[tuple]) -> None:
    """Cast each (destination, its bytes as the source holds them, the source's dtype) on the current
    stream; a device buffer the bytes crossed in is kept until this stream is done with it."""
    for dst, raw, dtype in casts:
        if raw.is_cuda and raw.data_ptr() != dst.data_ptr():
            raw.record_stream(torch.cuda.current_stream(raw.device))
        dst.copy_(raw.view(dtype))
