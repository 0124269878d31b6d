"""A load's first model call computes as its blocks arrive from the file (`LoadPlan.stream_first`).

Instead of reading every block before the first call, the attach only starts reading: in the
order a model calls its blocks (list order), at most LOOKAHEAD blocks in flight so that a block
the call needs soon is never queued behind the whole model. A resident block is copied into its
device buffer just before it first computes (a hook on it until then): from its file pages,
page-locked ahead on the pinning threads (swap/file_pages.py), else read into a pinned staging
buffer (the attachment's ReadAhead). A streamed block's home is its file pages where it can be
(given by the engine before this starts), else read into its own buffer (`HostPool.filling`, a
FillingHome in swap/homes.py), page-locked once read, and its slot copies from it. So every byte
is read at most once, into where it stays, and each block waits only for its own bytes; the
load's progress follows the bytes in. After the first call the attachment settles as an up-front
load would (swap/block_loop.py, `_settle_first_use`).
"""
from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Callable, ContextManager

from . import driver_turns
from .hooks import BlockHooks
from .host_pool import Fill, HostBuffer, HostPool
from .ram_homes import EarlyPins
from .read_ahead import ReadFn
from .state import Attachment, BlockState
from .stats import FirstCall

LOOKAHEAD = 6   # blocks read at once: enough chunks for 16 readers, few enough to keep call order


class FirstUse:
    """The first call's reads of one attachment: `placing` resident blocks to place from the file
    and `homes` streamed blocks whose RAM homes are read; `placed(block)` runs once a resident
    block has landed (its placement fold), `landed()` once every block is in (the streamed blocks'
    hooks ask `landed` too)."""

    def __init__(self, states: list[BlockState], pool: HostPool, read_block: ReadFn, att: Attachment,
                 placing: list[int], homes: list[int], pinning: EarlyPins | None, pin: bool, placed: Callable[[int], None],
                 guard: Callable[[], ContextManager] = nullcontext, landed: Callable[[], None] = lambda: None,
                 progress: Callable[[int, int], None] | None = None):
        self.states, self.pool, self.read_block, self.att, self.placed = states, pool, read_block, att, placed
        self.pinning = pinning   # page-locking the homes held already (ram_homes.lock_early), joined at the end
        self.guard = guard   # around each landing: the engine's (a failure takes the attachment down)
        self.on_landed = landed   # called once every block is in (the engine settles the attachment)
        self.progress, self.shown = progress, -1   # progress(bytes in, bytes of the blocks the call lands)
        self.todo = deque(sorted(set(placing) | set(homes)))
        self.placing = set(placing)
        self.flight: set[int] = set()   # resident blocks whose staging read is submitted, not yet placed
        self.fills: dict[int, Fill] = {}   # the homes this load reads, by block
        self.pinner = ThreadPoolExecutor(2, thread_name_prefix="ringswap-pin") if pin else None
        self.hold = driver_turns.Hold() if pin else None   # page-locking runs while this call waits for it
        self.nbytes = sum(states[i].layout.nbytes for i in self.todo if i not in pool.mapped)   # read
        self.pins: dict[int, Future] = {}   # resident blocks placed from the file's pages: page-locking them
        self.t0 = time.perf_counter()
        self.reads_done = self.t0   # when the last read finished
        self.pin_s = 0.0            # page-locking time, summed over the pinning threads
        self.pin_wait_s = 0.0       # this call's thread waited for page-locking
        self.pins_end = 0.0         # when the last of its own pins ended
        self.total = sum(states[i].layout.nbytes for i in self.todo)   # what the progress counts to
        self.placed_bytes = 0
        self.streamed_homes = [i for i in homes if i not in self.placing]   # in once read
        for i in homes:   # untouched mappings: no RAM until read into
            buf = HostBuffer(states[i].layout.nbytes)
            fill = Fill(buf, lambda i=i, buf=buf: self._read_home(i, buf))
            pool.filling[i] = self.fills[i] = fill
        blocks = [s.block for s in states]
        self.hooks = BlockHooks(blocks, sorted(placing), self._guarded, lambda i: None) if placing else None
        self.pump()

    def before_copy(self, block: int) -> None:
        """Before a slot copies streamed `block` from its home: the home page-locked first where
        its pin is in flight (a copy from pageable memory would stall the copy stream)."""
        if self.pinning is not None:
            t0 = time.perf_counter()
            self.pinning.wait(block)
            self.pin_wait_s += time.perf_counter() - t0

    # ----- reads ahead -----------------------------------------------------------------
    def _in_flight(self) -> int:
        return len(self.flight) + sum(1 for f in self.fills.values() if f.started and not f.future.done())

    def pump(self) -> None:
        """Submit reads in call order while fewer than LOOKAHEAD blocks are in flight (a resident
        block waits for a free staging buffer); report the bytes in so far."""
        self._report()
        while self.todo and self._in_flight() < LOOKAHEAD:
            b = self.todo[0]
            if b in self.fills:   # read into its home (a resident block with one is placed from there)
                if self.pool.filling.get(b) is self.fills[b]:
                    self.fills[b].start()
            elif b in self.placing and b in self.pool.mapped:   # placed from the file's pages
                ahead = self.pinning.pins.get(b) if self.pinning is not None else None
                if ahead is not None:
                    self.pins[b] = ahead
                elif self.pinner is not None:
                    self.pins[b] = self.pinner.submit(self._pin, b)
                self.flight.add(b)
            elif b in self.placing:
                if self.att.readahead.request(b, self.states[b].layout.nbytes) is None:
                    return
                self.flight.add(b)
            self.todo.popleft()

    def _report(self) -> None:
        if self.progress is None:
            return
        done = self.placed_bytes + sum(self.states[i].layout.nbytes for i in self.streamed_homes
                                       if self.fills[i].future.done())
        if done != self.shown:
            self.shown = done
            self.progress(done, self.total)

    def _read_home(self, block: int, buf: HostBuffer) -> None:
        """Read `block` into its home `buf`, then page-lock it (on the pinning threads); the
        Fill's future resolves after both."""
        fill = self.pool.filling[block]
        out = fill.future

        def pinned(_: Future) -> None:
            if out.set_running_or_notify_cancel():
                out.set_result(None)

        def read_done(f: Future) -> None:
            self.reads_done = max(self.reads_done, time.perf_counter())
            if f.exception() is not None:
                if out.set_running_or_notify_cancel():
                    out.set_exception(f.exception())
            elif self.pinner is not None:
                self.pinner.submit(self._pin, block).add_done_callback(pinned)
            else:
                pinned(f)
        try:
            read = self.read_block(block, buf.flat)
        except BaseException as e:   # noqa: BLE001  (raised where the block waits for it)
            if out.set_running_or_notify_cancel():
                out.set_exception(e)
            return
        read.add_done_callback(read_done)

    def _pin(self, block: int) -> None:
        t0 = time.perf_counter()
        self.pool.lock([block])
        self.pins_end = time.perf_counter()
        self.pin_s += self.pins_end - t0

    # ----- resident blocks ---------------------------------------------------------------
    def _guarded(self, block: int) -> None:
        with self.guard():
            self.place(block)
            if self.landed():
                self.on_landed()

    def landed(self) -> bool:
        """Every block of the first call is in: resident ones placed, homes read and adopted."""
        return not self.placing and not any(f is self.pool.filling.get(i) for i, f in self.fills.items())

    def place(self, block: int) -> None:
        """Before resident `block` first computes: copy it from its staging buffer (read now
        where it was not submitted yet) into its device buffer; the compute waits for the copy."""
        if block not in self.placing:
            return
        self.pump()
        att, s = self.att, self.states[block]
        nbytes = s.layout.nbytes
        t0 = time.perf_counter()
        mapped = self.pool.mapped.get(block)
        if mapped is not None:   # the file's pages, page-locked ahead where they can be
            pin = self.pins.pop(block, None)
            if pin is not None:
                with driver_turns.aside():
                    pin.result()
                self.pin_wait_s += time.perf_counter() - t0
            out, left = s.device_buffer, []
            ready = att.copier.enqueue(lambda: left.append(mapped.land(out)), None, timed=False)
            if left[0] is not None:   # its casts on the land stream, the compute waits for them
                att.copier.landed(left[0], ready=ready, sample=False)
        elif block in self.fills:   # its RAM home is read first (home=ram), then copied from there
            src = self.pool.adopt(block).flat if self.pool.filling.get(block) is self.fills[block] \
                else self.pool.buffer(block).flat
            att.stats.read_wait_s += time.perf_counter() - t0
            ready = att.copier.copy(s.device_buffer, src, None, timed=False)
        else:
            staged = att.readahead.take(block, nbytes)
            att.stats.read_wait_s += time.perf_counter() - t0
            ready = att.copier.copy(s.device_buffer, staged.buffer.flat[:nbytes], None, timed=False)
            att.readahead.release(staged, ready)
        s.binding.bind(s.layout.views(s.device_buffer))
        att.copier.compute_wait(ready)
        self.placing.discard(block)
        self.placed_bytes += nbytes
        self.flight.discard(block)
        if block in self.todo:
            self.todo.remove(block)
        self.placed(block)
        self.pump()

    # ----- the end -----------------------------------------------------------------------
    def complete(self) -> FirstCall:
        """After the first call: place the resident blocks it never called and wait for every home
        (the caller lands the slots still reading); returns what the call read and waited for."""
        self._let_go()
        for block in sorted(self.placing):
            self.place(block)
        for fill in self.fills.values():
            fill.start()
            fill.future.result()
        self._report()
        seconds = time.perf_counter() - self.t0
        pins_end = max(self.pins_end, self.pinning.done_at if self.pinning is not None else 0.0)
        ahead = self.pinning.by_attach if self.pinning is not None else (0, 0)   # read before stop() lets go of it
        self.stop()
        return FirstCall(self.nbytes, seconds, self.att.stats.read_wait_s, self.reads_done - self.t0, self.pin_s,
                         self.pin_wait_s, max(0.0, pins_end - self.t0), ahead)   # 0: every pin ended by the attach

    def _let_go(self) -> None:
        if self.hold is not None:
            self.hold.release()

    def stop(self) -> set[int]:
        """Take the first use down (done, or given up by a detach): no more reads start, reads in
        flight are waited for; a home read in full is kept, one not read is dropped. Returns the
        resident blocks never placed (their device buffers hold nothing)."""
        self._let_go()
        if self.hooks is not None:
            self.hooks.remove()
            self.hooks = None
        self.todo.clear()
        for pin in self.pins.values():
            pin.result()
        self.pins = {}
        for block, fill in self.fills.items():
            if self.pool.filling.get(block) is not fill:   # adopted (or dropped) already
                continue
            fill.cancel()
            ok = fill.future.done() and not fill.future.cancelled() and fill.future.exception() is None
            if ok:
                self.pool.adopt(block)
            else:
                self.pool.drop(block)
        if self.pinner is not None:
            self.pinner.shutdown(wait=True)
        if self.pinning is not None:
            self.pinning.join()
            self.pinning = None
        unplaced, self.placing = self.placing, set()
        self.flight.clear()
        return unplaced
