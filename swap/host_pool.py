"""Host memory for blocks: exact-size buffers, pinned in place when allowed.

PyTorch's pinned caching allocator rounds allocations up (to powers of two), which can
cost up to ~1.7x the model's size in locked RAM; so each block gets a plain buffer of
its exact size (rounded to whole pages) that is page-locked in place with
cudaHostRegister (what ComfyUI itself uses). Written here because no library offers
exact-size pinned buffers. When pinning is off, fails, or there is no CUDA, the pool
stays pageable and the ring copies through a few staging buffers instead.
"""
from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger("ringswap.host_pool")

PAGE = 4096


def _page_round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _clear_cuda_error() -> None:
    """A failed cudaHostRegister leaves CUDA's last-error set, and torch would raise it
    at an unrelated kernel launch later; a launch check here consumes it."""
    try:
        torch.zeros(1, device="cuda").add_(1)
    except RuntimeError:
        pass


class HostBuffer:
    """One page-aligned host byte buffer, optionally page-locked. Anonymous mmap memory:
    freeing it returns it to the OS at once (malloc'd blocks of this size would stay in
    the allocator's heap and make RSS climb run after run)."""

    def __init__(self, nbytes: int):
        size = _page_round(max(nbytes, 1))
        self._region = torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)
        self.flat = self._region[:nbytes]
        self.nbytes = nbytes
        self.pinned = False

    @property
    def locked_bytes(self) -> int:
        return self._region.numel() if self.pinned else 0

    def pin(self) -> bool:
        """Page-lock in place; False (and stays pageable) if CUDA refuses."""
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        err = torch.cuda.cudart().cudaHostRegister(self._region.data_ptr(), self._region.numel(), 0)
        if int(err) != 0:
            _clear_cuda_error()
            return False
        self.pinned = True
        return True

    def unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._region.data_ptr())
            self.pinned = False

    def __del__(self):
        try:
            self.unpin()
        except Exception:
            pass


def empty_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised byte buffer on `device` (host memory via HostBuffer on the CPU)."""
    if device.type == "cpu":
        return HostBuffer(nbytes).flat
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class HostPool:
    """The home of every block: one exact-size host buffer per block."""

    def __init__(self) -> None:
        self.blocks: dict[int, HostBuffer] = {}

    def add(self, index: int, nbytes: int) -> HostBuffer:
        buf = HostBuffer(nbytes)
        self.blocks[index] = buf
        return buf

    def pin(self, indices: list[int]) -> bool:
        """Pin exactly these blocks (unpinning the others). False if any pin failed:
        then nothing stays pinned and the caller falls back to staging."""
        wanted = set(indices)
        for i, buf in self.blocks.items():
            if i not in wanted:
                buf.unpin()
        for i in indices:
            if not self.blocks[i].pin():
                self.unpin_all()
                return False
        return True

    def unpin_all(self) -> None:
        for buf in self.blocks.values():
            buf.unpin()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.blocks.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(b.locked_bytes for b in self.blocks.values())

    def release(self) -> None:
        self.unpin_all()
        self.blocks.clear()
