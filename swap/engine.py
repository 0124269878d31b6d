"""BlockSwapEngine: run a list of transformer blocks with only a few on the device.

Glue between the residency plan, the host pool, the slot ring, the copy stream and the
block hooks. `attach` puts resident blocks on the device and hooks the streamed ones;
each streamed block waits (GPU-side) for its copy before it runs, and as soon as it has
run its slot is refilled with the next streamed block not yet in the ring, so the copy
runs under the compute of the blocks in between (and wraps to the next step).
Imports torch only: nothing here knows about ComfyUI.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch
from torch import nn

from . import home
from .hooks import BlockHooks
from .host_pool import HostPool, empty_bytes
from .layout import BlockLayout
from .plan import ResidencyPlan
from .read_ahead import ReadAhead, ReadFn
from .slot_ring import Slot, SlotRing
from .state import Attachment, BlockState
from .stats import RunStats

log = logging.getLogger("ringswap.engine")

PIN_MODES = ("auto", "on", "off")


HOMES = ("ram", "disk")


class BlockSwapEngine:
    """`home="ram"`: every block has a host copy (taken from the module's tensors, or read
    once through `read_block`). `home="disk"`: blocks are read through `read_block` into a
    few staging buffers ahead of need and never held in host RAM as a whole."""

    def __init__(self, blocks: list[nn.Module], read_block: ReadFn | None = None,
                 home: str = "ram", disk_workers: int = 4):
        if not blocks:
            raise ValueError("BlockSwapEngine needs at least one block")
        if home not in HOMES:
            raise ValueError(f"home must be one of {HOMES}, got {home!r}")
        if home == "disk" and read_block is None:
            raise ValueError("home='disk' needs a read_block function")
        self.read_block = read_block
        self.home = home
        self.disk_workers = max(1, disk_workers)
        layouts: dict[BlockLayout, BlockLayout] = {}
        self.states = []
        for i, block in enumerate(blocks):
            layout = BlockLayout.of(block)
            layout = layouts.setdefault(layout, layout)
            self.states.append(BlockState(i, block, layout))
        self.pool = HostPool()
        self.att: Attachment | None = None
        self.link_bytes_per_s = 0.0   # host-to-device rate of the last run's copies from a pinned home
        self.faults = None            # test hook: .check(call, block) may raise (see recovery.FaultInjector)
        self.orders: dict[tuple[int, ...], tuple[int, ...]] = {}   # streamed blocks -> their learned call order
        self.observer: Callable[[], None] | None = None   # called before each streamed block and model call (keep it cheap)
        if read_block is not None:   # weights come from the reader: drop what the modules hold
            for st in self.states:
                st.unbind(torch.device("cpu"))

    # ----- sizes ---------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.states)

    def block_bytes(self) -> int:
        return max(s.layout.nbytes for s in self.states)

    def total_block_bytes(self) -> int:
        return sum(s.layout.nbytes for s in self.states)

    def device_bytes(self, plan: ResidencyPlan | None = None) -> int:
        """Bytes of block weights on the device under `plan` (default: the attached one)."""
        plan = plan or (self.att.plan if self.att else None)
        if plan is None:
            return 0
        ring = max((self.states[i].layout.nbytes for i in plan.streamed), default=0)
        return sum(self.states[i].layout.nbytes for i in plan.resident) + ring * plan.ring_slots

    # ----- home ----------------------------------------------------------------------
    def fill_home(self, progress: Callable[[int, int], None] | None = None) -> int:
        """home=ram with a reader: read every block once into its host buffer (parallel
        reads); calls progress(done_bytes, total_bytes). Returns the bytes read."""
        if self.home != "ram" or self.read_block is None:
            return 0
        try:
            return home.fill(self.states, self.pool, self.read_block, progress)
        except BaseException:
            self.release_home()
            raise

    def _ensure_home(self) -> None:
        """Every block's exact-size host home holds its current weights (home=ram)."""
        if self.home == "disk":
            return
        if self.read_block is not None:
            self.fill_home()
        else:
            home.capture(self.states, self.pool)

    def _home_views(self, s: BlockState) -> list[torch.Tensor]:
        return s.layout.views(self.pool.blocks[s.index].flat)

    # ----- attach / detach -----------------------------------------------------------
    def attach(self, device: torch.device | str, window: int, prefetch: int,
               pin_memory: str = "auto", owner: object = None,
               on_land: Callable[[int, list[torch.Tensor]], None] | None = None) -> ResidencyPlan:
        """Place resident blocks on `device`, hook the streamed ones and prime the ring.
        `on_land(block, tensors)` runs on the compute stream right after a block's weights
        land on the device and before it computes (e.g. to fold LoRA deltas in place);
        the host copy is never touched. Attaching again with the same settings keeps
        everything and only takes `owner`."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if pin_memory not in PIN_MODES:
            raise ValueError(f"pin_memory must be one of {PIN_MODES}, got {pin_memory!r}")
        plan = ResidencyPlan.make(self.num_blocks, window, prefetch)
        if self.att is not None:
            if (self.att.device, self.att.plan, self.att.pin_memory, self.att.on_land) == \
                    (device, plan, pin_memory, on_land):
                self.att.owner = owner
                return plan
            self.detach()
        self._ensure_home()
        memory = self._choose_memory(device, plan, pin_memory)
        att = Attachment(device, plan, memory, pin_memory, owner, on_land, self.orders.get(plan.streamed))
        try:
            if self.home == "disk":
                att.readahead = ReadAhead(self.read_block, self.disk_workers, self.block_bytes(),
                                          pin=device.type == "cuda" and pin_memory != "off")
            for i in plan.resident:
                s = self.states[i]
                s.device_buffer = empty_bytes(s.layout.nbytes, device)
                if att.readahead is None:
                    att.copier.copy(s.device_buffer, self.pool.blocks[i].flat, None)
                else:
                    staged = att.readahead.take(i, s.layout.nbytes)
                    att.readahead.release(staged, att.copier.copy(
                        s.device_buffer, staged.buffer.flat[:s.layout.nbytes], None))
                s.binding.bind(s.layout.views(s.device_buffer))
            if plan.streamed:
                nbytes = max(self.states[i].layout.nbytes for i in plan.streamed)
                att.ring = SlotRing(plan.ring_slots, nbytes, device, staging=memory == "staged",
                                    pin_staging=device.type == "cuda")
                for i in plan.streamed:
                    s = self.states[i]
                    s.unbind(device)
                att.hooks = BlockHooks([s.block for s in self.states], list(plan.streamed),
                                       self._before_block, self._after_block)
            self.att = att
            for i in att.upcoming()[:plan.ring_slots]:
                self._issue(i, att.ring.victim([]))
            att.copier.take_times()   # resident placement is loading, not a run's copies
            if on_land is not None:
                for i in plan.resident:
                    on_land(i, self.states[i].binding.current())
            att.stats = att.new_stats()
        except BaseException:
            self.att = att
            self.detach()
            raise
        log.debug("attached on %s: %s, %s memory", device, plan.describe(), memory)
        return plan

    def _choose_memory(self, device: torch.device, plan: ResidencyPlan, pin_memory: str) -> str:
        if self.home == "disk":
            return "disk"
        return home.copy_memory(self.states, self.pool, device, plan, pin_memory)

    def detach(self) -> None:
        """Drain copies, unhook, free device buffers; parameters point at home again."""
        att = self.att
        if att is None:
            return
        try:
            att.copier.synchronize()
        finally:
            if att.readahead is not None:
                att.readahead.release_all()
            if att.hooks is not None:
                att.hooks.remove()
            for s in self.states:
                s.device_buffer = None
                s.slot = None
                if s.index in self.pool.blocks:
                    s.binding.bind(self._home_views(s))
                else:   # home=disk: the weights live only in the file
                    s.unbind(torch.device("cpu"))
            if att.ring is not None:
                att.ring.release()
            self.att = None

    def release_home(self) -> None:
        """Free the pinned/host home copies (only when detached and the weights are
        no longer needed, e.g. the model is being deleted)."""
        self.detach()
        self.pool.release()

    # ----- the block loop --------------------------------------------------------------
    def _issue(self, block: int, slot: Slot) -> None:
        """Give `slot` to `block` and start its copy once the previous owner is done
        (home=disk: once its read has landed; see _pump)."""
        att = self.att
        s = self.states[block]
        slot.owner = block
        slot.landed = False
        att.stats.copies += 1
        att.stats.bytes_copied += s.layout.nbytes
        if att.readahead is not None:
            slot.ready = None
            slot.loading = att.readahead.request(block, s.layout.nbytes) or True
            self._pump(read_on=True)
            return
        src = self.pool.blocks[block].flat
        if slot.staging is not None:
            if slot.ready is not None:
                slot.ready.synchronize()   # staging buffer still feeding the last copy
            staged = slot.staging.flat[:s.layout.nbytes]
            staged.copy_(src)
            src = staged
        slot.ready = att.copier.copy(slot.flat[:s.layout.nbytes], src, slot.free)

    def _land(self, slot: Slot, wait: bool) -> None:
        """home=disk: copy a slot's block from its staging buffer once the read is done."""
        att, block = self.att, slot.owner
        nbytes = self.states[block].layout.nbytes
        staged = slot.loading if slot.loading is not True else None
        if staged is None or not staged.future.done():
            if not wait:
                if staged is None:
                    slot.loading = att.readahead.request(block, nbytes) or True
                return
            t0 = time.perf_counter()
            if staged is None:   # no buffer yet: first land the slots holding theirs
                for other in att.ring.slots:
                    if other is not slot and other.loading not in (None, True):
                        self._land(other, wait=True)
            staged = att.readahead.take(block, nbytes)
            att.stats.read_wait_s += time.perf_counter() - t0
        staged.future.result()
        slot.ready = att.copier.copy(slot.flat[:nbytes], staged.buffer.flat[:nbytes], slot.free)
        att.readahead.release(staged, slot.ready)
        slot.loading = None
        att.stats.bytes_read += nbytes

    def _pump(self, read_on: bool = False) -> None:
        """home=disk: land finished reads; with `read_on`, keep reads going for the streamed
        blocks the call order says come next (as many as there are free staging buffers)."""
        att = self.att
        for slot in att.ring.slots:
            if slot.loading is not None:
                self._land(slot, wait=False)
        if not read_on:
            return
        owners = set(att.ring.owners())
        for b in att.upcoming()[:len(att.readahead.staging)]:
            if b in owners or att.readahead.pending(b) is not None:
                continue
            if att.readahead.request(b, self.states[b].layout.nbytes) is None:
                break

    def _before_block(self, block: int) -> None:
        att = self.att
        if self.faults is not None:
            self.faults.check(att.stats.calls, block)
        att.order.observe(block)
        slot = att.ring.slot_of(block)
        if slot is None:   # not predicted (a call order not learned yet): fetched now, counted
            att.stats.unplanned += 1
            slot = att.ring.victim(att.upcoming()[:-1])
            self._issue(block, slot)
        if slot.loading is not None:
            self._land(slot, wait=True)
        att.copier.compute_wait(slot.ready)
        s = self.states[block]
        s.slot = slot
        views = slot.views(s.layout)
        if att.on_land is not None and not slot.landed:
            att.copier.timed_compute(att.on_land, block, views)
        slot.landed = True
        s.binding.bind(views)   # joined afresh: ComfyUI's quantized tensors keep state from their last use
        att.stats.forwards += 1
        if self.observer is not None:
            self.observer()

    def _after_block(self, block: int) -> None:
        att = self.att
        s = self.states[block]
        slot = s.slot
        s.unbind()
        s.slot = None
        if slot is None or slot.owner != block:
            return
        slot.free = att.copier.record_compute()
        upcoming = att.upcoming()
        if block in upcoming[:len(att.ring.slots)]:   # called again soon (e.g. the next VACE context): keep it
            if att.readahead is not None:
                self._pump()
            return
        owned = set(att.ring.owners())
        nxt = next((b for b in upcoming if b not in owned), None)
        if nxt is not None:
            self._issue(nxt, slot)
        elif att.readahead is not None:
            self._pump()

    # ----- runs ------------------------------------------------------------------------
    def begin_call(self) -> None:
        """A model call (one forward of all blocks) starts: counted, timed on the device, and
        the first call of a plan records the order the model calls its blocks in."""
        att = self.att
        if att is not None:
            att.stats.calls += 1
            att.copier.mark_call(start=True)
            att.order.start(learn=att.plan.streamed not in self.orders)
            if self.observer is not None:
                self.observer()

    def end_call(self) -> None:
        att = self.att
        if att is not None:
            att.copier.mark_call(start=False)
            learned = att.order.finish()
            if learned is not None:
                self.orders[att.plan.streamed] = learned

    def _close_stats(self) -> RunStats:
        """Unbind any block left bound by an exception and fold the device timings into the
        run's stats (synchronises once)."""
        att = self.att
        for s in self.states:
            if s.slot is not None:
                s.unbind()
                s.slot = None
        stats = att.stats
        stats.add_times(*att.copier.take_times())
        if stats.gbps > 0 and self.home == "ram" and att.memory == "pinned":
            self.link_bytes_per_s = stats.gbps * 1e9
        return stats

    def end_run(self) -> RunStats | None:
        """Close a sampling run (also after an interrupt): log one line and reset the counters."""
        att = self.att
        if att is None:
            return None
        stats = self._close_stats()
        att.stats = att.new_stats()
        if stats.streamed:
            log.info(stats.line())
        return stats

    def reattach(self, window: int, prefetch: int) -> ResidencyPlan:
        """Mid-run re-plan (e.g. a smaller window after running out of memory): free the ring
        and resident blocks, attach again with the same device, pinning, owner and on-land
        work, and carry the run's counters over."""
        att = self.att
        if att is None:
            raise RuntimeError("reattach needs an attached engine")
        stats = self._close_stats()
        device, pin_memory, owner, on_land = att.device, att.pin_memory, att.owner, att.on_land
        self.detach()
        plan = self.attach(device, window, prefetch, pin_memory, owner, on_land)
        self.att.stats = stats.continued(self.att.stats)
        return plan

    # ----- introspection ---------------------------------------------------------------
    def blocks_on_device(self) -> list[int]:
        """Blocks whose weights occupy device memory: resident ones and ring owners."""
        if self.att is None:
            return []
        owners = self.att.ring.owners() if self.att.ring else []
        return sorted(set(self.att.plan.resident) | set(owners))

    @property
    def plan(self) -> ResidencyPlan | None:
        return self.att.plan if self.att else None

    @property
    def memory(self) -> str | None:
        return self.att.memory if self.att else None
