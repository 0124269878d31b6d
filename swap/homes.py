"""Block homes: where one block's weights live off the device, and how they reach it.

A block's home is derived from the HostPool, the one record of what host RAM holds
(`home_of`): a raw exact-size buffer (RamHome), its coded bytes (CodedHome, swap/coding.py), the
file's own pages (MappedHome, swap/file_pages.py), a buffer still being read (FillingHome,
swap/first_use.py), or none, so it is read from the file through the attachment's ReadAhead (FileHome). Each home
lands its block in a ring slot (`start`, then `finish` before the block runs), places it as a
resident block (`place`), drops itself at settle where the attachment keeps no RAM home, and
captures (makes a RAM home from the weights held elsewhere). The block loop and placement ask
the home, never which kind it is.
"""
from __future__ import annotations

import logging
import time
from itertools import islice

import torch

from .coding import Coding
from .held_tensors import HeldBlock, holdable
from .host_pool import HostPool, empty_bytes
from .page_out import FileMaps
from .slot_ring import Slot
from .staged_copy import PinnedChunks
from .state import Attachment, BlockState

log = logging.getLogger("ringswap.homes")


class Home:
    """What every home does alike: its block `s` and the pool that records it."""

    def __init__(self, s: BlockState, pool: HostPool):
        self.s, self.pool = s, pool

    def start(self, slot: Slot, att: Attachment) -> None:
        """Start landing the block in `slot` once the slot's previous owner is done (`slot.free`)."""
        raise NotImplementedError

    def finish(self, slot: Slot, att: Attachment, wait: bool = True) -> None:
        """Before the block runs: have its copy into `slot` enqueued (a RAM home did at `start`)."""

    def read_ahead(self, att: Attachment) -> bool:
        """Before placing: start reading the block where it comes from the file; False where no
        staging buffer is free (the blocks after it wait too)."""
        return True

    def place(self, att: Attachment, chunks: PinnedChunks) -> int:
        """Copy the block into a device buffer of its own and bind it there (a resident block);
        returns the bytes read from the file."""
        s = self.s
        s.device_buffer = empty_bytes(s.layout.nbytes, att.device)
        read = self._place(s.device_buffer, att, chunks)
        s.binding.bind(s.layout.views(s.device_buffer))
        return read

    def _place(self, out: torch.Tensor, att: Attachment, chunks: PinnedChunks) -> int:
        raise NotImplementedError

    def settle(self, kept: bool) -> None:
        """After placing: a RAM home the attachment does not keep is dropped (nothing to drop
        for the file)."""
        if not kept:
            self.pool.drop(self.s.index)

    def capture(self, maps: FileMaps, hold: bool = True) -> None:
        """Have a RAM home hold the weights the block's module has now and point them there (their
        file pages given back through `maps`); with `hold`, the module's own tensors where they can
        be (not where the homes are coded: those are RAM buffers)."""
        raise NotImplementedError

    def detach(self) -> None:
        """Off the device: the block's parameters point at its home again (empty stand-ins where
        the weights are not held raw in RAM)."""
        self.s.unbind(torch.device("cpu"))


def _new_home(s: BlockState, pool: HostPool, maps: FileMaps, hold: bool) -> None:
    """A home for the weights the block's module has now: those tensors held as they are where
    they can be (swap/held_tensors.py: nothing copied), else a new raw RAM home they are packed into."""
    current = s.binding.current()
    if hold and holdable(current, s.layout):
        pool.mapped[s.index] = HeldBlock(current, [e.offset for e in s.layout.entries], s.layout.nbytes)
        return
    _pack(s, current, pool.add(s.index, s.layout.nbytes).flat, maps)


def _pack(s: BlockState, current: list, flat: torch.Tensor, maps: FileMaps) -> None:
    """Copy the module's `current` tensors into the home's bytes, bind the block there and give
    the tensors' file pages back."""
    s.layout.pack(current, flat)
    s.binding.bind(s.layout.views(flat))
    maps.page_out(current)


class RamHome(Home):
    """A raw exact-size host buffer (HostPool.blocks): copied straight from it when it is pinned,
    else through the slot's pinned staging buffer (streamed) or pinned chunks (placed)."""

    def __init__(self, s: BlockState, pool: HostPool):
        super().__init__(s, pool)
        self.buf = pool.blocks[s.index]

    def start(self, slot: Slot, att: Attachment) -> None:
        nbytes = self.s.layout.nbytes
        src = self.buf.flat
        if slot.staging is not None:
            if slot.ready is not None:
                slot.ready.synchronize()   # staging buffer still feeding the last copy
            staged = slot.staging.flat[:nbytes]
            staged.copy_(src)
            src = staged
        slot.reading = False
        slot.ready = att.copier.copy(slot.flat[:nbytes], src, slot.free)

    def _place(self, out: torch.Tensor, att: Attachment, chunks: PinnedChunks) -> int:
        if self.buf.pinned:
            att.copier.copy(out, self.buf.flat, None)
        else:
            chunks.upload(self.buf.flat, out)
        return 0

    def detach(self) -> None:
        self.s.binding.bind(self.s.layout.views(self.buf.flat))

    def capture(self, maps: FileMaps, hold: bool = True) -> None:
        """Capture again where the module's tensors were replaced from outside (e.g. another loader
        moved the shared model); the same buffer is reused."""
        current = self.s.binding.current()
        if current[0].data_ptr() != self.buf.flat.data_ptr():
            _pack(self.s, current, self.buf.flat, maps)

    @staticmethod
    def download(s: BlockState, pool: HostPool, chunks: PinnedChunks, ram_left: int) -> int:
        """Capture a raw home for resident block `s` from its device buffer; its bytes (0: over
        `ram_left`)."""
        if s.layout.nbytes > ram_left:
            return 0
        chunks.download(s.device_buffer, pool.add(s.index, s.layout.nbytes).flat)
        return s.layout.nbytes


class CodedHome(Home):
    """The block's coded bytes (HostPool.coded): copied across the link into the coder's scratch
    and decoded into the slot or resident buffer, on the coder's stream."""

    def __init__(self, s: BlockState, pool: HostPool, coding: Coding | None):
        super().__init__(s, pool)
        self.coded, self.coding = pool.coded[s.index], coding

    def start(self, slot: Slot, att: Attachment) -> None:
        slot.reading = False
        slot.ready = self.coding.land(att.copier, self.coded, slot.flat[:self.coded.nbytes], slot.free)

    def _place(self, out: torch.Tensor, att: Attachment, chunks: PinnedChunks) -> int:
        self.coding.land(att.copier, self.coded, out, None)
        return 0

    def capture(self, maps: FileMaps, hold: bool = True) -> None:
        """Kept coded: its weights are not in the module, nothing to capture."""

    @staticmethod
    def encode(coding: Coding, s: BlockState, pool: HostPool, ram_left: int, chunks: PinnedChunks) -> int | None:
        """Capture a coded home for resident block `s` from its device buffer (`coding.keep`); its
        bytes (0: over `ram_left`), or None where it does not shrink enough to pay or the device has no
        memory to code it (the caller keeps it, and the rest, raw)."""
        try:
            return coding.keep(s, pool, ram_left, chunks)
        except torch.cuda.OutOfMemoryError as e:
            log.info("RingSwap: no device memory to code the kept resident blocks (%s); kept raw", e)
            return None


class FileHome(Home):
    """No RAM home: the block is read by the read-ahead's workers into one of a few staging
    buffers ahead of need, then copied to its slot or resident buffer once read. (Without a
    reader, its weights are the module's own until captured.)"""

    def __init__(self, s: BlockState, pool: HostPool, states: list[BlockState]):
        super().__init__(s, pool)
        self.states = states

    def start(self, slot: Slot, att: Attachment) -> None:
        slot.reading = True
        slot.ready = None
        att.readahead.request(self.s.index, self.s.layout.nbytes)
        pump(att, self.states, self.pool, read_on=True)

    def finish(self, slot: Slot, att: Attachment, wait: bool = True) -> None:
        _land_read(slot, att, self.states, wait)

    def read_ahead(self, att: Attachment) -> bool:
        return att.readahead.request(self.s.index, self.s.layout.nbytes) is not None

    def _place(self, out: torch.Tensor, att: Attachment, chunks: PinnedChunks) -> int:
        nbytes = self.s.layout.nbytes
        staged = att.readahead.take(self.s.index, nbytes)
        att.readahead.release(staged, att.copier.copy(out, staged.buffer.flat[:nbytes], None))
        return nbytes

    def capture(self, maps: FileMaps, hold: bool = True) -> None:
        _new_home(self.s, self.pool, maps, hold)


class MappedHome(Home):
    """The block's bytes where they already are, in the file's own pages (swap/file_pages.py) or
    the module's own tensors (swap/held_tensors.py): copied piece by piece (its tensors) into the
    slot or resident buffer; nothing is read."""

    def __init__(self, s: BlockState, pool: HostPool):
        super().__init__(s, pool)
        self.mapped = pool.mapped[s.index]

    def start(self, slot: Slot, att: Attachment) -> None:
        slot.reading = False
        flat, left = slot.flat, []
        slot.ready = att.copier.enqueue(lambda: left.append(self.mapped.land(flat)), slot.free)
        slot.pending = left[0]   # its casts, done where it lands (block_loop._land)

    def _place(self, out: torch.Tensor, att: Attachment, chunks: PinnedChunks) -> int:
        att.copier.enqueue(lambda: self.mapped.copy_into(out), None)
        return 0

    def capture(self, maps: FileMaps, hold: bool = True) -> None:
        """Nothing to capture, unless the module's tensors held as the home were replaced from
        outside (e.g. another loader moved the shared model: the new ones are held instead) or
        are to be copied into a RAM home (`hold` false)."""
        if not self.mapped.holds(self.s.binding.current(), hold):
            self.pool.drop(self.s.index)
            _new_home(self.s, self.pool, maps, hold)

    def detach(self) -> None:
        self.mapped.off_device(self.s)


class FillingHome(Home):
    """A raw home still being read from the file (a load whose first call streams: swap/first_use.py):
    its slot waits for the read, then the home becomes a RamHome and copies from there."""

    def start(self, slot: Slot, att: Attachment) -> None:
        slot.reading = True
        slot.ready = None

    def finish(self, slot: Slot, att: Attachment, wait: bool = True) -> None:
        if not slot.reading:
            return
        done = self.pool.filling[self.s.index].future.done()
        if not wait and not done:
            return
        t0 = time.perf_counter()
        self.pool.adopt(self.s.index)   # starts the read where it was not, waits for it, raises its error
        if not done:
            att.stats.read_wait_s += time.perf_counter() - t0
        RamHome(self.s, self.pool).start(slot, att)


def home_of(states: list[BlockState], pool: HostPool, block: int, coding: Coding | None = None) -> Home:
    """`block`'s home as the pool records it now (a coded one decodes with `coding`)."""
    s = states[block]
    if block in pool.filling:
        return FillingHome(s, pool)
    if block in pool.mapped:
        return MappedHome(s, pool)
    if block in pool.coded:
        return CodedHome(s, pool, coding)
    if block in pool.blocks:
        return RamHome(s, pool)
    return FileHome(s, pool, states)


def _land_read(slot: Slot, att: Attachment, states: list[BlockState], wait: bool) -> None:
    """Copy the slot's block out of its staging buffer once read; with `wait`, wait for the read
    (starting it if no buffer was free before), else only if it is done."""
    if not slot.reading:
        return
    block, readahead = slot.owner, att.readahead
    nbytes = states[block].layout.nbytes
    staged = readahead.pending(block)
    if staged is None or not staged.future.done():
        if not wait:
            if staged is None:
                readahead.request(block, nbytes)
            return
        t0 = time.perf_counter()
        if staged is None:   # no buffer yet: first land the slots holding theirs
            for other in att.ring.slots:
                if other is not slot and other.reading and readahead.pending(other.owner) is not None:
                    _land_read(other, att, states, wait=True)
        staged = readahead.take(block, nbytes)
        att.stats.read_wait_s += time.perf_counter() - t0
    staged.future.result()
    slot.ready = att.copier.copy(slot.flat[:nbytes], staged.buffer.flat[:nbytes], slot.free)
    readahead.release(staged, slot.ready)
    slot.reading = False
    att.stats.bytes_read += nbytes


def pump(att: Attachment, states: list[BlockState], pool: HostPool, read_on: bool = False) -> None:
    """Land the file reads that are done (none without a read-ahead); with `read_on`, keep reads
    going for the file's blocks the call order says come next (as many as there are free
    staging buffers)."""
    readahead = att.readahead
    for slot in att.ring.slots:
        if slot.reading:
            home_of(states, pool, slot.owner).finish(slot, att, wait=False)
    if readahead is None:
        return
    if not read_on:
        return
    owners = set(att.ring.owners())
    for b in islice((b for b in att.upcoming() if not pool.has(b)), len(readahead.staging)):
        if b in owners or readahead.pending(b) is not None:
            continue
        if readahead.request(b, states[b].layout.nbytes) is None:
            break
