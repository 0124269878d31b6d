"""Where a streamed block's bytes come from each time it lands: its home in RAM (raw or coded), or the file.

The block loop asks a block's source to start filling a ring slot (`start`) and, before
the block runs, to have its bytes landed (`finish`). Which source a block has follows from
where it lives (a host home in the pool: RAM; none: the file), so the loop has no branch
on the engine's home.
"""
from __future__ import annotations

import time
from itertools import islice

from .slot_ring import Slot, SlotRing


class RamSource:
    """Blocks with an exact-size host home: copied straight from it when it is pinned, else
    through the slot's pinned staging buffer."""

    def __init__(self, engine, att):
        self.engine, self.att = engine, att

    def start(self, block: int, slot: Slot) -> None:
        nbytes = self.engine.states[block].layout.nbytes
        src = self.engine.pool.blocks[block].flat
        if slot.staging is not None:
            if slot.ready is not None:
                slot.ready.synchronize()   # staging buffer still feeding the last copy
            staged = slot.staging.flat[:nbytes]
            staged.copy_(src)
            src = staged
        slot.reading = False
        slot.ready = self.att.copier.copy(slot.flat[:nbytes], src, slot.free)


class CodedSource:
    """Blocks with a coded home (swap/coding.py): the coded bytes cross the link into the
    coder's scratch and are decoded into the slot, on the coder's stream."""

    def __init__(self, engine, att):
        self.engine, self.att = engine, att

    def start(self, block: int, slot: Slot) -> None:
        coded = self.engine.pool.coded[block]
        slot.reading = False
        slot.ready = self.engine.coding.land(self.att.copier, coded, slot.flat[:coded.nbytes], slot.free)


class FileSource:
    """Blocks without a host home: read by the read-ahead's workers into a few staging
    buffers ahead of need, then copied to their slot once the read is done."""

    def __init__(self, engine, att, ring: SlotRing):
        self.engine, self.att, self.ring = engine, att, ring
        self.readahead = att.readahead

    def start(self, block: int, slot: Slot) -> None:
        slot.reading = True
        slot.ready = None
        self.readahead.request(block, self.engine.states[block].layout.nbytes)
        self.pump(read_on=True)

    def finish(self, slot: Slot, wait: bool) -> None:
        """Copy the slot's block out of its staging buffer once read; with `wait`, wait for
        the read (starting it if no buffer was free before), else only if it is done."""
        if not slot.reading:
            return
        att, block = self.att, slot.owner
        nbytes = self.engine.states[block].layout.nbytes
        staged = self.readahead.pending(block)
        if staged is None or not staged.future.done():
            if not wait:
                if staged is None:
                    self.readahead.request(block, nbytes)
                return
            t0 = time.perf_counter()
            if staged is None:   # no buffer yet: first land the slots holding theirs
                for other in self.ring.slots:
                    if other is not slot and other.reading and self.readahead.pending(other.owner) is not None:
                        self.finish(other, wait=True)
            staged = self.readahead.take(block, nbytes)
            att.stats.read_wait_s += time.perf_counter() - t0
        staged.future.result()
        slot.ready = att.copier.copy(slot.flat[:nbytes], staged.buffer.flat[:nbytes], slot.free)
        self.readahead.release(staged, slot.ready)
        slot.reading = False
        att.stats.bytes_read += nbytes

    def pump(self, read_on: bool = False) -> None:
        """Land finished reads; with `read_on`, keep reads going for the file's blocks the
        call order says come next (as many as there are free staging buffers)."""
        for slot in self.ring.slots:
            if slot.reading:
                self.finish(slot, wait=False)
        if not read_on:
            return
        owners, pool = set(self.ring.owners()), self.engine.pool
        for b in islice((b for b in self.att.upcoming() if not pool.has(b)), len(self.readahead.staging)):
            if b in owners or self.readahead.pending(b) is not None:
                continue
            if self.readahead.request(b, self.engine.states[b].layout.nbytes) is None:
                break
