"""Device bytes that a landing's dense weights are cut from (a ring slot's, or one of the two
sets of resident blocks folded before each call), allocated once with the ring. Folds that
allocated their outputs on the land stream would leave them to the caching allocator, which
cannot reuse a block freed on another stream until its event passes: with the host ahead of
the device the dense sets pile up to the VRAM cap, and each retry there synchronises the
device. Reuse is ordered by the slot's events instead."""
from __future__ import annotations

import math

import torch

from .host_pool import empty_bytes

ALIGN = 512   # bytes; every view starts on it (any dtype, and the kernels' vector loads)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class DenseArena:
    """A flat byte buffer handed out front to back, from the start again at each landing."""

    def __init__(self, nbytes: int, device: torch.device):
        self.flat = empty_bytes(aligned(nbytes), device)
        self.used = 0

    def restart(self) -> "DenseArena":
        """Hand out from the start again (the last landing's weights are no longer read)."""
        self.used = 0
        return self

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """An uninitialised contiguous tensor cut from the buffer, or None where it is full."""
        nbytes = math.prod(shape) * dtype.itemsize
        end = self.used + aligned(nbytes)
        if end > self.flat.numel():
            return None
        t = self.flat[self.used:self.used + nbytes].view(dtype).view(shape)
        self.used = end
        return t

    @property
    def nbytes(self) -> int:
        return self.flat.numel()
