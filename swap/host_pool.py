"""Host memory for blocks: exact-size buffers, pinned in place when allowed.

PyTorch's pinned caching allocator rounds allocations up (to powers of two), which can
cost up to ~1.7x the model's size in locked RAM; so each block gets a plain buffer of
its exact size (rounded to whole pages) that is page-locked in place with
cudaHostRegister (what ComfyUI itself uses). Written here because no library offers
exact-size pinned buffers. When pinning is off, fails, is over the host's pin budget
(`set_pin_budget`), or there is no CUDA, the pool stays pageable and the ring copies
through a few staging buffers instead.
"""
from __future__ import annotations

import logging
import mmap
from typing import Protocol

import torch

log = logging.getLogger("ringswap.host_pool")

PAGE = 4096


class PinBudget(Protocol):
    """Who else counts page-locked memory (e.g. the host application's own limit)."""

    def reserve(self, ptr: int, nbytes: int) -> bool: ...   # False: over the budget, do not pin

    def release(self, ptr: int) -> None: ...


_budget: PinBudget | None = None


def set_pin_budget(budget: PinBudget | None) -> None:
    """Count every pin of this process in `budget` (None: pin whatever CUDA allows)."""
    global _budget
    _budget = budget


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
        self._budget: PinBudget | None = None   # the budget this pin was counted in

    @property
    def locked_bytes(self) -> int:
        return self._region.numel() if self.pinned else 0

    def pin(self) -> bool:
        """Page-lock in place; False (and stays pageable) if CUDA refuses."""
        if self.pinned:
            return True
        if not torch.cuda.is_available():
            return False
        ptr, size = self._region.data_ptr(), self._region.numel()
        if _budget is not None and not _budget.reserve(ptr, size):
            return False
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
        if int(err) != 0:
            _clear_cuda_error()
            if _budget is not None:
                _budget.release(ptr)
            return False
        self.pinned = True
        self._budget = _budget
        return True

    def unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self._region.data_ptr())
            self.pinned = False
            if self._budget is not None:
                self._budget.release(self._region.data_ptr())

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
