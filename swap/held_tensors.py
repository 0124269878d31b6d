"""Block homes that are the module's own tensors: the weights ComfyUI loaded, page-locked in place.

Without a file to read (RingSwap Patch on a MODEL ComfyUI loaded itself: 0.3.75, or 0.33 without
dynamic VRAM) every block needs a home holding its weights. Copying them into new buffers costs a
second write of the whole model into memory the OS must zero first (2-5 GB/s on the device machine)
before the first step. A HeldBlock keeps the block's tensors where they are instead: they are its
home, copied tensor by tensor into a slot or device buffer, and the module points at them again
once off the device. Page-locking registers the pages wholly inside each large tensor, read-only
where CUDA can (the GPU only reads them; like the rest, held homes assume nothing writes a block's
weights in place while RingSwap holds them); the rest (small tensors, the partial pages at each end)
goes to a small page-locked buffer (swap/in_place.py).
"""
from __future__ import annotations

import torch
from torch import nn

from .host_pool import REGISTER_READ_ONLY, whole_pages
from .in_place import InPlace
from .layout import BlockLayout

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


class HeldBlock(InPlace):
    """One block's home in its module's tensors (`tensors`, at `offsets` in the block's layout of
    `nbytes`): it registers the whole pages inside each tensor of REGISTER_MIN or more
    (swap/in_place.py does the rest); off the device the module points at them again."""
    # read-only first: ComfyUI 0.3.75's tensors are views of a private mapping of the file, and a
    # writable registration copies each of its pages into a new one (copy-on-write) before locking it
    FLAGS = (REGISTER_READ_ONLY, 0)

    def __init__(self, tensors: list[torch.Tensor], offsets: list[int], nbytes: int):
        self.tensors = tensors
        super().__init__([(t.detach().reshape(-1).view(torch.uint8), d, None) for t, d in zip(tensors, offsets)],
                         nbytes)

    def _wanted(self) -> list[tuple[int, int]]:
        pages = [whole_pages(src.data_ptr(), src.data_ptr() + src.numel()) for src, _, _ in self.parts]
        return [(a, b - a) for a, b in pages if b - a >= REGISTER_MIN]

    def holds(self, tensors: list[torch.Tensor], hold: bool = True) -> bool:
        """Does this stay the home of a block whose module holds `tensors` now: they are the ones
        held, and `hold` (false: the homes are to be RAM buffers, e.g. to code them)?"""
        return hold and len(tensors) == len(self.tensors) and all(
            a.data_ptr() == b.data_ptr() for a, b in zip(tensors, self.tensors))

    def off_device(self, s) -> None:
        """Off the device the module points at its own tensors again."""
        s.binding.bind(self.tensors)
