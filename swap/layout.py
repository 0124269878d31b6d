"""Where each tensor of a block lives inside one flat byte buffer.

A block's parameters and buffers are packed into one contiguous uint8 buffer (each
tensor 512-byte aligned, the CUDA allocator's alignment, so kernels see the same
alignment as for normally allocated weights). One flat buffer per block means one copy
per block on the wire. Blocks with the same structure share one `BlockLayout`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

ALIGN = 512


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class TensorEntry:
    path: str          # submodule path inside the block ("" for the block itself)
    name: str          # attribute name in that module
    is_param: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BlockLayout:
    entries: tuple[TensorEntry, ...]
    nbytes: int

    @classmethod
    def of(cls, block: nn.Module) -> "BlockLayout":
        entries, offset = [], 0
        for path, module in block.named_modules():
            tensors = [(n, t, True) for n, t in module._parameters.items() if t is not None]
            tensors += [(n, t, False) for n, t in module._buffers.items() if t is not None]
            for name, t, is_param in tensors:
                nbytes = t.numel() * t.element_size()
                entries.append(TensorEntry(path, name, is_param, tuple(t.shape), t.dtype, offset, nbytes))
                offset += _align(nbytes)
        return cls(tuple(entries), offset)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed tensor views of `flat` (uint8), one per entry."""
        return [flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def pack(self, tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy `tensors` (any device) into `flat` at this layout's offsets."""
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)

    def placeholders(self, device: torch.device) -> list[torch.Tensor]:
        """Empty tensors of the right rank and dtype, standing in for unloaded weights."""
        return [torch.empty((0,) * max(1, len(e.shape)), dtype=e.dtype, device=device) for e in self.entries]


class BlockBinding:
    """The module attributes of one block that a layout's entries refer to."""

    def __init__(self, block: nn.Module, layout: BlockLayout):
        modules = dict(block.named_modules())
        self.targets = [(modules[e.path], e.name, e.is_param) for e in layout.entries]

    def current(self) -> list[torch.Tensor]:
        return [(m._parameters if p else m._buffers)[n].data for m, n, p in self.targets]

    def bind(self, tensors: list[torch.Tensor]) -> None:
        """Point the block's parameters and buffers at `tensors` (no copy)."""
        for (module, name, is_param), t in zip(self.targets, tensors):
            if is_param:
                module._parameters[name].data = t
            else:
                module._buffers[name] = t
