"""Block homes that are the module's own tensors: the weights ComfyUI loaded, page-locked in place.

Without a file to read (RingSwap Patch on a MODEL ComfyUI loaded itself: 0.3.75, or 0.33 without
dynamic VRAM) every block needs a home holding its weights. Copying them into new buffers costs a
second write of the whole model into memory the OS must zero first (2-5 GB/s on the device machine)
before the first step. A HeldBlock keeps the block's tensors where they are instead: they are its
home, copied tensor by tensor into a slot or device buffer, and the module points at them again
once off the device. Page-locking registers the pages wholly inside each large tensor
(cudaHostRegister); the rest (small tensors, the partial pages at each end) is copied once into a
small page-locked buffer, since CUDA synchronises a stream before any copy from pageable memory.
Written here: no library page-locks a module's tensors in place.
"""
from __future__ import annotations

import mmap

import torch
from torch import nn

from .host_pool import REGISTER_READ_ONLY, HostBuffer, register, unregister
from .layout import BlockLayout

PAGE = mmap.PAGESIZE
REGISTER_MIN = 1 << 20   # tensors smaller than this go to the page-locked rest instead


def holdable(tensors: list[torch.Tensor], layout: BlockLayout) -> bool:
    """Can these (a block's current tensors, one per layout entry) be its home as they are: plain
    contiguous CPU tensors with the layout's dtypes and sizes, none overlapping another?"""
    if any(a.codec is not None for a in layout.attrs):   # packed weights (GGUF) are copied as before
        return False
    spans = []
    for t, e in zip(tensors, layout.entries):
        if type(t) not in (torch.Tensor, nn.Parameter) or t.device.type != "cpu" or not t.is_contiguous() \
                or t.dtype != e.dtype or t.numel() * t.element_size() != e.nbytes or e.nbytes == 0:
            return False
        spans.append((t.data_ptr(), t.data_ptr() + e.nbytes))
    spans.sort()
    return len(tensors) == len(layout.entries) and all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


class HeldBlock:
    """One block's home in its module's tensors (`tensors`, at `offsets` in the block's layout of
    `nbytes`). Offers what a home buffer does (pin, unpin, pinned, nbytes, locked_bytes) and what a
    home in the file's pages does (land, copy_into, pageable_bytes, off_device)."""

    def __init__(self, tensors: list[torch.Tensor], offsets: list[int], nbytes: int):
        self.tensors, self.nbytes = tensors, nbytes
        self.parts = [(t.detach().reshape(-1).view(torch.uint8), d) for t, d in zip(tensors, offsets)]
        self.pinned = False
        self._registered: list[tuple[int, int, int, object]] = []   # (part, start, end, budget): pages inside
        self._rest: HostBuffer | None = None
        self._at: dict[tuple[int, int], int] = {}   # (part, start) -> offset in _rest

    def holds(self, tensors: list[torch.Tensor], hold: bool = True) -> bool:
        """Does this stay the home of a block whose module holds `tensors` now: they are the ones
        held, and `hold` (false: the homes are to be RAM buffers, e.g. to code them)?"""
        return hold and len(tensors) == len(self.tensors) and all(
            a.data_ptr() == b.data_ptr() for a, b in zip(tensors, self.tensors))

    @property
    def locked_bytes(self) -> int:
        if not self.pinned:
            return 0
        return sum(b - a for _, a, b, _ in self._registered) + (self._rest.locked_bytes if self._rest else 0)

    def pin(self) -> bool:
        """Page-lock in place; False (and nothing left locked) where CUDA refuses."""
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        for k, (src, _) in enumerate(self.parts):
            p = src.data_ptr()
            a, b = (-p) % PAGE, (src.numel() - (-p) % PAGE) // PAGE * PAGE + (-p) % PAGE
            if b - a < REGISTER_MIN:
                continue
            budget = register(p + a, b - a)
            if budget is False:
                budget = register(p + a, b - a, REGISTER_READ_ONLY)   # a read-only file mapping
            if budget is False:
                self.pinned = True
                self.unpin()
                return False
            self._registered.append((k, a, b, budget))
        self.pinned = True
        self._keep_rest()
        return True

    def _keep_rest(self) -> None:
        """Copy what is not registered into a small page-locked buffer (left pageable where that
        buffer cannot be page-locked)."""
        pieces = self._outside()
        if not pieces:
            return
        rest = HostBuffer(sum(y - x for _, x, y in pieces))
        if not rest.pin():
            return
        pos = 0
        for k, x, y in pieces:
            rest.flat[pos:pos + y - x].copy_(self.parts[k][0][x:y])
            self._at[(k, x)], pos = pos, pos + y - x
        self._rest = rest

    def _outside(self) -> list[tuple[int, int, int]]:
        """(part, start, end) of the bytes outside the registered pages."""
        inside = {k: (a, b) for k, a, b, _ in self._registered} if self.pinned else {}
        out = []
        for k, (src, _) in enumerate(self.parts):
            a, b = inside.get(k, (src.numel(), src.numel()))
            out += [(k, x, y) for x, y in ((0, a), (b, src.numel())) if y > x]
        return out

    @property
    def pageable_bytes(self) -> int:
        """Bytes a copy of the block takes from pageable memory (none once pinned)."""
        return sum(y - x for k, x, y in self._outside() if (k, x) not in self._at)

    def unpin(self) -> None:
        if self.pinned:
            for k, a, _, budget in self._registered:
                unregister(self.parts[k][0].data_ptr() + a, budget)
            if self._rest is not None:
                self._rest.unpin()
            self.pinned, self._registered, self._rest, self._at = False, [], None, {}

    def land(self, out: torch.Tensor) -> None:
        """Copy the block's bytes into `out` (its layout; on the current stream, async where
        pinned); nothing is left to do where it lands (None, as for a file's pages without casts)."""
        inside = {k: (a, b) for k, a, b, _ in self._registered} if self.pinned else {}
        for k, (src, d) in enumerate(self.parts):
            a, b = inside.get(k, (0, 0))
            for x, y in ((0, a), (a, b), (b, src.numel())) if b > a else ((0, src.numel()),):
                if y > x:
                    pos = self._at.get((k, x))
                    piece = src[x:y] if pos is None else self._rest.flat[pos:pos + y - x]
                    out[d + x:d + y].copy_(piece, non_blocking=True)

    def copy_into(self, out: torch.Tensor) -> None:
        self.land(out)

    def off_device(self, s) -> None:
        """Off the device the module points at its own tensors again."""
        s.binding.bind(self.tensors)

    def __del__(self):
        try:
            self.unpin()
        except Exception:   # noqa: BLE001
            pass
