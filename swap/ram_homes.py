"""The RAM homes as a set: read from the file up front, captured, page-locked and settled.

Homes are read from a reader in parallel (`read_homes`) or captured from the modules' own
tensors or, at a detach, from the device (each block's home does its part: swap/homes.py), and
their blocks' parameters point into them; `settle` page-locks the streamed blocks' homes where
it can (else copies go through a pinned staging ring) and drops the homes an attachment does
not keep.
"""
from __future__ import annotations

import logging
import time
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

from . import driver_turns
from .coding import Coding
from .home_policy import HomePolicy
from .homes import CodedHome, RamHome, home_of
from .host_pool import HostPool
from .page_out import FileMaps
from .staged_copy import PinnedChunks
from .state import Attachment, BlockState

log = logging.getLogger("ringswap.ram_homes")


def read_progress(states: list, pool: HostPool, blocks: set[int],
                  progress: Callable[[int, int], None] | None) -> Callable[[int, int], None] | None:
    """progress(done, total) over the bytes of those `blocks` without a home (what an attach
    reads from the file), to be fed the bytes done so far; None when nothing is to be read."""
    total = sum(states[i].layout.nbytes for i in blocks if not pool.has(i))
    return (lambda done, _: progress(done, total)) if progress is not None and total else None


def fill(states: list, pool: HostPool, read_block: Callable, progress: Callable[[int, int], None] | None) -> int:
    """Read every block of `states` that has no home yet into a new one; calls progress(done, total) and
    returns the bytes read. On failure the reads in flight are cancelled or drained and
    the exception re-raised (the caller frees the homes)."""
    todo = [s for s in states if not pool.has(s.index)]
    total = sum(s.layout.nbytes for s in todo)
    futures = []
    try:
        for s in todo:
            buf = pool.add(s.index, s.layout.nbytes)
            futures.append((s, buf, read_block(s.index, buf.flat)))
        done = 0
        for s, buf, fut in futures:
            fut.result()
            s.binding.bind(s.layout.views(buf.flat))
            done += s.layout.nbytes
            if progress is not None:
                progress(done, total)
    except BaseException:
        for _, _, fut in futures:
            fut.cancel()
        for _, _, fut in futures:
            if not fut.cancelled():
                try:
                    fut.result()
                except BaseException:
                    pass
        raise
    return total


def read_homes(states: list, pool: HostPool, read_block: Callable,
               progress: Callable[[int, int], None] | None = None) -> int:
    """Read those of `states` that have no home yet into new ones (parallel reads); returns the
    bytes read. On failure the homes it made are freed and the error re-raised."""
    todo = [s for s in states if not pool.has(s.index)]
    if not todo:
        return 0
    try:
        return fill(todo, pool, read_block, progress)
    except BaseException:
        for s in todo:
            pool.drop(s.index)
        raise


def ensure(states: list[BlockState], pool: HostPool, read_block: Callable | None, keep: frozenset[int],
           progress: Callable[[int, int], None] | None = None, hold: bool = True) -> int:
    """The blocks in `keep` have an exact-size RAM home holding their weights: read from the file
    (home=ram: all, auto: read back), or without a reader the modules' own tensors, held as they are
    where `hold` allows, else captured (every block not on the device: a resident block kept by
    reattach stays put). Returns the bytes read from the file."""
    if read_block is None:
        capture(states, pool, [s.index for s in states if s.device_buffer is None], hold)
        return 0
    return read_homes([states[i] for i in sorted(keep)], pool, read_block, progress)


PIN_THREADS = 4   # page-locking threads of an attach: registrations go one at a time (swap/driver_turns.py); the threads
                  # fill page tables and pin rest buffers meanwhile: 31-34 GB/s on an H100 host (bench/RESULTS.md)


class EarlyPins:
    """The streamed blocks' homes page-locked on a few threads of their own, in call order, while
    the resident blocks are placed or a load's first call runs; a copy from a home not yet locked
    waits for its own pin (`wait`) rather than copy from pageable memory, which CUDA does
    synchronously, stalling the stream. `settle` pins what is left."""

    def __init__(self, pool: HostPool, blocks: list[int]):
        self.pins: dict[int, futures.Future] = {}
        self.done_at = 0.0   # perf_counter when the last pin so far ended
        self.by_attach = (0, 0)   # bytes of the homes it had page-locked by the attach (hand_over), of those it pins
        self.add(pool, blocks)

    def add(self, pool: HostPool, blocks: list[int]) -> None:
        """Page-lock `blocks` too, after those already asked for."""
        if not blocks:
            return
        threads = ThreadPoolExecutor(min(PIN_THREADS, len(blocks)), thread_name_prefix="ringswap-pin")
        added = {i: threads.submit(pool.lock, [i]) for i in blocks}
        self.pins.update(added)
        for pin in added.values():
            pin.add_done_callback(self._ended)
        threads.shutdown(wait=False)   # the threads end once the pins are done

    def _ended(self, _: futures.Future) -> None:
        self.done_at = max(self.done_at, time.perf_counter())

    def wait(self, block: int) -> None:
        pin = self.pins.get(block)
        if pin is not None:
            with driver_turns.aside():
                futures.wait([pin])

    def join(self) -> None:
        with driver_turns.aside():
            futures.wait(list(self.pins.values()))

    def hand_over(self, pool: HostPool, wanted: frozenset[int], pinning: bool) -> "EarlyPins | None":
        """To an attach: the homes pinned here that it does not want are dropped (a pin in flight ends
        first: InPlace's lock), so no page stays locked for a block it reads from the file; self to
        go on pinning the rest, or None once they are done where the attach does not pin."""
        for i in [i for i in self.pins if i not in wanted]:
            self.pins.pop(i).cancel()
            pool.drop(i)
        sizes = {i: pool.buffer(i).nbytes for i in self.pins}
        self.by_attach = (sum(n for i, n in sizes.items() if self.pins[i].done()), sum(sizes.values()))
        if pinning:
            return self
        self.join()
        return None


def lock_early(pool: HostPool, device: torch.device, pin_memory: str, streamed: list[int],
               ahead: EarlyPins | None = None) -> EarlyPins | None:
    """Page-lock the streamed blocks' RAM homes early (EarlyPins; an expert switch reads and pins at once);
    `ahead`: the pins begun before the attach (engine.pin_ahead), which go on and take these on too."""
    todo = [i for i in streamed if pool.has(i) and not pool.buffer(i).pinned and (ahead is None or i not in ahead.pins)]
    if ahead is not None:
        ahead.add(pool, todo)
        return ahead
    if device.type != "cuda" or pin_memory == "off" or not todo:
        return None
    return EarlyPins(pool, todo)


def capture(states: list[BlockState], pool: HostPool, blocks: list[int], hold: bool = True) -> None:
    """Give each of `blocks` a home holding its module's current weights (with `hold` the tensors
    themselves where they can be, swap/held_tensors.py) and point its parameters there; re-captures
    a block whose tensors were replaced from outside (e.g. another loader moved the shared model)."""
    maps = FileMaps()   # a model mapped from its file: give back each block's pages once copied
    for i in blocks:
        home_of(states, pool, i).capture(maps, hold)


def capture_resident(states: list[BlockState], pool: HostPool, resident: tuple[int, ...], nbytes: int,
                     coding: Coding | None = None) -> None:
    """Give resident blocks without a home one copied from the device, in order, while they fit
    in `nbytes` (stops where memory runs out): with `coding` (swap/coding.py) coded ones, so an
    expert switch holds and places them at their coded size; raw ones without it, or from where
    coding stops paying or finds no device memory."""
    done, coded, t0 = 0, 0, time.perf_counter()
    with PinnedChunks() as chunks:
        for i in resident:
            s = states[i]
            if s.device_buffer is None or pool.has(i):
                continue
            try:
                kept = CodedHome.encode(coding, s, pool, nbytes - done, chunks) if coding is not None else None
                if kept is None:
                    coding, kept = None, RamHome.download(s, pool, chunks, nbytes - done)
                else:
                    coded += kept
                done += kept
            except (OSError, RuntimeError) as e:
                log.info("RingSwap: stopped keeping resident blocks in RAM (%s)", e)
                break
    if done:
        log.info("RingSwap: kept %.2f GB of resident blocks in RAM for the next load (%.2f GB of them coded; "
                 "%.2f s; home RAM left %.2f GB)", done / 1e9, coded / 1e9, time.perf_counter() - t0, nbytes / 1e9)


def settle(policy: HomePolicy, states: list[BlockState], pool: HostPool, att: Attachment) -> None:
    """After an attachment's placement: how its streamed copies leave host memory (page-locking
    the RAM homes that stream; "disk" where all come from the file), and where the home `policy`
    splits RAM, each home the attachment does not keep drops itself (no host copy of a resident
    block) and a read-ahead no streamed block needs goes."""
    keep, file_streamed = att.ram_homes, _from_ram(att)[1]
    att.memory = _memory(policy, states, pool, att, lock=True)
    if policy.splits_ram:
        for s in states:
            home_of(states, pool, s.index).settle(s.index in keep)
        if not file_streamed and att.readahead is not None:
            att.readahead.release_all()
            att.readahead = None


def expected_memory(policy: HomePolicy, pool: HostPool, att: Attachment) -> str:
    """The copy memory `settle` will find for an attachment whose homes are still being read
    (swap/first_use.py): page-locked where pinning is on (settle finds "staged" only where it fails)."""
    return _memory(policy, [], pool, att, lock=False)


def _from_ram(att: Attachment) -> tuple[list[int], bool]:
    """The attachment's streamed blocks with a RAM home, and whether others read the file."""
    from_ram = [i for i in att.plan.streamed if i in att.ram_homes]
    return from_ram, len(from_ram) < len(att.plan.streamed)


def _memory(policy: HomePolicy, states: list, pool: HostPool, att: Attachment, lock: bool) -> str:
    """"disk" where every streamed block comes from the file, else copy_memory's word."""
    from_ram, file_streamed = _from_ram(att)
    if policy.keeps_none or (file_streamed and not from_ram):
        return "disk"
    return copy_memory(states, pool, att.device, from_ram, att.pin_memory, lock)


def copy_memory(states: list, pool: HostPool, device: torch.device, streamed: list[int], pin_memory: str,
                lock: bool = True) -> str:
    """How the copies of the `streamed` blocks leave their RAM homes: "pinned", "staged" or
    "pageable" (the engine says "disk" where every streamed block comes from the file); without
    `lock`, the word where page-locking them will succeed, nothing pinned or unpinned."""
    if not streamed:
        return "pinned" if pool.pinned_bytes else "pageable"
    if device.type != "cuda":
        return "staged"
    if pin_memory == "off":
        if lock:
            pool.unpin_all()
        return "pageable"
    if not lock or pool.pin(list(streamed)):
        return "pinned"
    gib = sum(states[i].layout.nbytes for i in streamed) / 2**30
    if pin_memory == "on":
        raise RuntimeError(
            f"pin_memory='on' but page-locking {len(streamed)} blocks ({gib:.1f} GiB) failed (refused "
            "by the OS or over the host's pin budget); free RAM, lower the streamed share (a larger window) "
            "or use pin_memory='auto'")
    log.warning("RingSwap: could not pin %.1f GiB of host memory (refused by the OS or over the host's "
                "pin budget); using pageable memory with a pinned staging ring (slower copies)", gib)
    return "staged"
