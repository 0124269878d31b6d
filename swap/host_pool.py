"""Host memory for blocks: exact-size buffers, pinned in place when allowed.

PyTorch's pinned caching allocator rounds allocations up (to powers of two), which can
lock a good deal more RAM than the model's size; so each block gets a plain buffer of
its exact size (rounded to whole pages) that is page-locked in place with
cudaHostRegister (what ComfyUI itself uses). Written here because no library offers
exact-size pinned buffers. When pinning is off, fails, is over the host's pin budget
(`set_pin_budget`), or there is no CUDA, the pool stays pageable and the ring copies
through a few staging buffers instead.

Host memory that comes and goes every load or run lives in memory mappings of its own
(`mapped_bytes`, `mapped_allocations`), never in malloc's heaps: see `mapped_bytes`.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Protocol

import torch
from torch.overrides import TorchFunctionMode

from . import driver_turns

log = logging.getLogger("ringswap.host_pool")

PAGE = mmap.PAGESIZE


def whole_pages(start: int, end: int) -> tuple[int, int]:
    """The pages wholly inside the addresses [start, end), as (first byte, end); empty where none."""
    lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    return (lo, hi) if lo < hi else (lo, lo)


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


def mapped_bytes(nbytes: int) -> torch.Tensor:
    """`nbytes` uninitialised host bytes (uint8, page-aligned) in an anonymous memory mapping
    of their own, unmapped when the last tensor using it is freed; untouched pages cost no
    RAM. Freed, they go back to the OS at once. From malloc they would not: glibc raises its
    mmap threshold to the largest block freed (up to 32 MiB), so such buffers then come from
    its heaps (one per thread that allocates), which keep what is freed among what lives on:
    a server's RSS climbed a few MiB every load. Linux and Windows (mmap.mmap(-1, n))."""
    region = mmap.mmap(-1, _page_round(max(nbytes, 1)))
    whole = torch.frombuffer(region, dtype=torch.uint8)
    _REGIONS[whole.data_ptr()] = region
    return whole[:nbytes]


_REGIONS: "weakref.WeakValueDictionary[int, mmap.mmap]" = weakref.WeakValueDictionary()   # mapped_bytes', by address


@contextmanager
def locked_while(tensors: Iterable[torch.Tensor]) -> Iterator[int]:
    """Page-lock the mappings (mapped_bytes) that hold those of `tensors` on the CPU while a copy
    from them runs, then let them go; yields the bytes locked (0 where CUDA refuses). ComfyUI's load
    copies the non-block weights from pageable memory, ~2.8 GB/s (0.18 s of Wan 14B's first load on
    an H100); the mapping is held until unlocked, whoever frees its tensors meanwhile."""
    ptrs = {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()}
    regions = {p: r for p in ptrs if (r := _REGIONS.get(p)) is not None} if torch.cuda.is_available() else {}
    locked = []
    try:
        for ptr, region in regions.items():
            budget = register(ptr, len(region))
            if budget is not False:
                locked.append((ptr, budget, region))
        yield sum(len(region) for _, _, region in locked)
    finally:
        for ptr, budget, _ in locked:
            unregister(ptr, budget)


MAPPED_MIN_BYTES = 128 * 1024   # glibc's initial mmap threshold: what it maps itself until that moves


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype, device="meta").element_size()


def _mapped_empty(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """torch.empty(*args, **kwargs) in its own mapping, or None to leave the call to torch:
    another device, `out=`/`names=`, pinned, another layout or memory format, or small."""
    if set(kwargs) - {"size", "dtype", "device", "layout", "requires_grad", "memory_format", "pin_memory"}:
        return None
    if kwargs.get("layout") not in (None, torch.strided) or kwargs.get("pin_memory") \
            or kwargs.get("memory_format") not in (None, torch.contiguous_format):
        return None
    size = kwargs["size"] if "size" in kwargs else args[0] if len(args) == 1 and not isinstance(args[0], int) else args
    if not all(isinstance(d, int) and d >= 0 for d in size):
        return None
    device = kwargs.get("device")
    # the default device as torch would pick it (a `with torch.device(...)` outside this mode included)
    device = torch.device(device) if device is not None else torch.empty(0).device
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    numel = 1
    for d in size:
        numel *= d
    nbytes = numel * _itemsize(dtype)
    if device.type != "cpu" or nbytes < MAPPED_MIN_BYTES:
        return None
    t = mapped_bytes(nbytes).view(dtype).view(tuple(size))
    return t.requires_grad_() if kwargs.get("requires_grad") else t


class mapped_allocations(TorchFunctionMode):
    """Within `with mapped_allocations():`, every `torch.empty` of at least MAPPED_MIN_BYTES
    on the CPU gets a mapping of its own (`mapped_bytes`); any other call is torch's. For
    building a model whose block weights are dropped right away (an untouched mapping
    costs no RAM and, freed, leaves nothing behind) and whose other weights live as long
    as the model."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            t = _mapped_empty(args, kwargs)
            if t is not None:
                return t
        return func(*args, **kwargs)


REGISTER_READ_ONLY = 8   # cudaHostRegisterReadOnly: pages the process may not write (a file's, mapped)


def register(ptr: int, size: int, flags: int = 0):
    """Page-lock `size` bytes at `ptr` in place (cudaHostRegister), counted in the pin budget:
    the budget it was counted in (None: no budget), or False where over the budget or refused."""
    if _budget is not None and not _budget.reserve(ptr, size):
        return False
    with driver_turns.registration():
        err = torch.cuda.cudart().cudaHostRegister(ptr, size, flags)
    if int(err) != 0:
        _clear_cuda_error()
        if _budget is not None:
            _budget.release(ptr)
        return False
    return _budget


def unregister(ptr: int, budget) -> None:
    """Undo `register` (its returned budget)."""
    with driver_turns.registration():
        torch.cuda.cudart().cudaHostUnregister(ptr)
    if budget is not None:
        budget.release(ptr)


class HostBuffer:
    """One page-aligned host byte buffer, optionally page-locked, in a memory mapping of
    its own (`mapped_bytes`): freeing it returns it to the OS at once."""

    def __init__(self, nbytes: int):
        self._region = mapped_bytes(_page_round(max(nbytes, 1)))
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
        self._budget = register(self._region.data_ptr(), self._region.numel())
        self.pinned = self._budget is not False
        return self.pinned

    def unpin(self) -> None:
        if self.pinned:
            unregister(self._region.data_ptr(), self._budget)
            self.pinned = False

    def __del__(self):
        try:
            self.unpin()
        except Exception:
            pass


PIN_GUESS = 4e9   # bytes/s page-locking runs at before it is measured (cudaHostRegister)


def empty_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """An uninitialised byte buffer on `device` (host memory via HostBuffer on the CPU)."""
    if device.type == "cpu":
        return HostBuffer(nbytes).flat
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Fill:
    """A raw home being filled from the file: its buffer, the Future of its read (and pin), and
    `start`, which submits the read where it is not submitted yet (swap/first_use.py reads homes
    in call order, a few ahead; a block needed out of order starts its own)."""

    def __init__(self, buffer: HostBuffer, start: Callable[[], None]):
        self.buffer, self.future, self._start = buffer, Future(), start
        self.started = False

    def start(self) -> None:
        if not self.started:
            self.started = True
            self._start()

    def cancel(self) -> None:
        """Give the fill up: a read not started never starts; one in flight is waited for."""
        if not self.started:
            self.started = True
            self.future.cancel()
        self.wait()

    def wait(self) -> None:
        """Wait for the read, whatever its outcome (before the buffer is freed or given up)."""
        try:
            self.future.result()
        except BaseException:   # noqa: BLE001  (the block loop that needs it raises it)
            pass


class HostPool:
    """The home of every block: one exact-size host buffer per block (`blocks`), its coded
    bytes (`coded`, swap/plane_coder.CodedBlock) where the block is kept coded, or one being
    read from the file (`filling`, swap/first_use.py) until `adopt` makes it a raw home."""

    def __init__(self) -> None:
        self.blocks: dict[int, HostBuffer] = {}
        self.coded: dict = {}   # block -> CodedBlock
        self.filling: dict[int, Fill] = {}
        self.mapped: dict = {}   # block -> swap/file_pages.MappedBlock: its bytes are the file's own pages
        self._rate_lock = threading.Lock()   # lock() may run on several threads at once
        self.pin_rate = (0, 0.0)   # (bytes page-locked so far, the seconds that took): the rate

    def has(self, index: int) -> bool:
        """The block has a home in RAM (raw, coded, or being read into one)."""
        return index in self.blocks or index in self.coded or index in self.filling or index in self.mapped

    def buffer(self, index: int) -> HostBuffer:
        """The block's home memory (a mapped home offers the same pin, unpin, pinned and nbytes)."""
        coded, fill, mapped = self.coded.get(index), self.filling.get(index), self.mapped.get(index)
        return coded.home if coded is not None else fill.buffer if fill is not None else \
            mapped if mapped is not None else self.blocks[index]

    def _all(self) -> list[tuple[int, HostBuffer]]:
        return list(self.blocks.items()) + [(i, c.home) for i, c in self.coded.items()] \
            + [(i, f.buffer) for i, f in self.filling.items()] + list(self.mapped.items())

    def add(self, index: int, nbytes: int) -> HostBuffer:
        buf = HostBuffer(nbytes)
        self.blocks[index] = buf
        return buf

    def adopt(self, index: int) -> HostBuffer:
        """The filled home of `index` becomes a raw home once its read is done (started here where
        it was not); raises the read's error."""
        fill = self.filling[index]
        fill.start()
        with driver_turns.aside():   # a first call's home: its read, then its page-locking
            fill.future.result()
        del self.filling[index]
        self.blocks[index] = fill.buffer
        return fill.buffer

    def drop(self, index: int) -> None:
        """Free one block's home, raw, coded or filling (a read in flight is waited for; unpinned
        first; no copy from it may be in flight)."""
        fill = self.filling.pop(index, None)
        if fill is not None:
            fill.cancel()
        for buf in (self.blocks.pop(index, None), getattr(self.coded.pop(index, None), "home", None),
                    fill.buffer if fill is not None else None, self.mapped.pop(index, None)):
            if buf is not None:
                buf.unpin()

    def pin(self, indices: list[int]) -> bool:
        """Pin exactly these blocks (unpinning the others). False if any pin failed:
        then nothing stays pinned and the caller falls back to staging."""
        wanted = set(indices)
        for i, buf in self._all():
            if i not in wanted:
                buf.unpin()
        if not self.lock(indices):
            self.unpin_all()
            return False
        return True

    def lock(self, indices: list[int]) -> bool:
        """Page-lock these blocks' homes where not yet, leaving the others as they are; stops
        at the first that fails (False). May run on another thread than the block copies."""
        pending = [(i, self.buffer(i)) for i in indices if not self.buffer(i).pinned]
        t0 = time.perf_counter()
        done = 0
        try:
            for i, buf in pending:
                with driver_turns.in_call_order(i):
                    if not buf.pin():
                        return False
                done += buf.nbytes
        finally:
            if done:
                with self._rate_lock:
                    total, secs = self.pin_rate
                    self.pin_rate = (total + done, secs + time.perf_counter() - t0)
        return True

    def pin_seconds(self, nbytes: int) -> float:
        """Seconds page-locking `nbytes` more would take, at the rate measured so far."""
        done, secs = self.pin_rate
        return nbytes * secs / done if done and secs > 0 else nbytes / PIN_GUESS

    def unpin_all(self) -> None:
        for _, buf in self._all():
            buf.unpin()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for _, b in self._all())

    @property
    def pinned_bytes(self) -> int:
        return sum(b.locked_bytes for _, b in self._all())

    def release(self) -> None:
        for fill in self.filling.values():
            fill.cancel()
        self.unpin_all()
        self.blocks.clear()
        self.coded.clear()
        self.filling.clear()
        self.mapped.clear()
