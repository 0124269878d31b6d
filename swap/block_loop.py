"""The block loop: what happens around each streamed block's forward, and a load's first call.

A mixin of BlockSwapEngine (swap/engine.py), kept apart so each file has one job: before a
streamed block runs its slot is landed (fetched now where the call order was not learned yet),
its on-land work done and the block bound to the slot; after it runs its slot is refilled with the
next block not in the ring. While a load's first call lands its blocks (swap/first_use.py) the loop
also pumps that call's reads, settles the attachment once every block is in, and takes the
attachment down where a landing fails. It uses the engine's `att`, `states`, `pool`, `coding`,
`homes`, `in_order` and `observer`.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from functools import partial

from .homes import Home, home_of, pump
from .ram_homes import settle
from .resident_folds import fold_once
from .slot_ring import Slot
from .state import Attachment, warm

log = logging.getLogger("ringswap.block_loop")


class BlockLoop:
    def _home(self, block: int) -> Home:
        """`block`'s home, derived from the pool (swap/homes.py)."""
        return home_of(self.states, self.pool, block, self.coding)

    def _issue(self, block: int, slot: Slot) -> None:
        """Give `slot` to `block`; the block's home lands it there once the previous owner is done."""
        att = self.att
        slot.owner = block
        slot.landed, slot.replaced, slot.pending = False, None, None
        att.stats.copies += 1
        att.stats.bytes_copied += self.states[block].layout.nbytes
        if att.first_use is not None:
            att.first_use.before_copy(block)
        self._home(block).start(slot, att)

    def _before_block(self, block: int) -> None:
        if self.att.first_use is None:
            return self._land(block)
        with self._loading():
            self.att.first_use.pump()
            self._land(block)

    def _land(self, block: int) -> None:
        """Before streamed `block` runs: its slot (fetched now if not planned) landed, its on-land
        work done, the block bound to the slot."""
        att = self.att
        att.order.observe(block)
        slot = att.ring.slot_of(block)
        if slot is None:   # not predicted (a call order not learned yet): fetched now, counted
            att.stats.unplanned += 1
            slot = att.ring.victim(att.upcoming()[:-1])
            self._issue(block, slot)
        if slot.reading:   # only a file read is left to land
            self._home(block).finish(slot, att)
        att.copier.compute_wait(slot.ready, block if self.in_order else None)
        if slot.pending is not None:   # casts on the land stream: a kernel on the copy stream would wait
            left, slot.pending = slot.pending, None
            att.copier.landed(left, ready=slot.ready, sample=False)
        s = self.states[block]
        s.slot = slot
        if att.on_land is not None and not slot.landed:
            fold = att.on_land if slot.dense is None else partial(att.on_land, out=slot.dense.restart())
            replaced = att.copier.landed(fold, block, slot.views(s.layout), ready=slot.ready,
                                         sample=warm(att.on_land, block))
            slot.replaced = s.binding.bindable(replaced) if replaced else None
        slot.landed = True
        s.binding.bind_joined(slot.joined(s.layout))
        if slot.replaced:
            s.binding.bind_some(slot.replaced)
        att.stats.forwards += 1
        if self.observer is not None:
            self.observer()

    def _after_block(self, block: int) -> None:
        if self.att.first_use is None:
            return self._free(block)
        with self._loading():
            self._free(block)
            if self.att.first_use.landed():
                self._settle_first_use()

    @contextmanager
    def _loading(self):
        """While a load's first call lands its blocks: a failure (a read error, a file changed)
        takes the attachment down before it propagates, so nothing stays half-placed."""
        try:
            yield
        except BaseException:
            self.end_run()
            self.detach()
            raise

    def _free(self, block: int) -> None:
        """After streamed `block` ran: its slot refilled with the next block not in the ring,
        unless it is called again soon."""
        att = self.att
        s = self.states[block]
        slot, s.slot = s.slot, None
        s.unbind()
        if slot is None or slot.owner != block:
            return
        slot.free = att.copier.record_compute(block)
        upcoming = att.upcoming()
        owned = set(att.ring.owners())
        nxt = next((b for b in upcoming if b not in owned), None)
        if nxt is not None and block not in upcoming[:len(att.ring.slots)]:   # else called again soon: kept
            self._issue(nxt, slot)
        else:   # the file's reads go on (none without a read-ahead)
            pump(att, self.states, self.pool)

    def _placed_first(self, att: Attachment, block: int) -> None:
        """A resident block placed during the first call: its placement fold, as fold_resident
        does for the blocks placed up front."""
        if att.on_land is not None:
            fold_once(self.states[block], att.on_land, att.resident_work)

    def _settle_first_use(self) -> None:
        """After the first call of a load that streamed it: the rest of the blocks in, the slots
        still waiting for a home landed, then the homes settle as an up-front load's do; the run's
        stats note what the first call read (its placement copies were not timed as the run's)."""
        att = self.att
        for slot in att.ring.slots if att.ring is not None else ():
            if slot.reading and slot.owner in self.pool.filling:
                self._home(slot.owner).finish(slot, att)
        first = att.first_use.complete()
        att.first_use = None
        att.copier.synchronize()   # settle may unpin what the copies read
        staged = att.memory == "staged"
        settle(self.homes, self.states, self.pool, att)
        if att.memory == "staged" and not staged and att.ring is not None:   # page-locking failed
            att.ring.add_staging(pin=att.device.type == "cuda")
        self.read_back = (first.read, first.seconds)
        att.stats.first_call = first
        log.debug("first call streamed %.2f GB from the file in %.2f s", first.read / 1e9, first.seconds)
