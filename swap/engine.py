"""BlockSwapEngine: run a list of transformer blocks with only a few on the device.

`attach` puts a plan's resident blocks on the device and hooks the streamed ones; each
streamed block waits (GPU-side) for its copy before it runs, and once it has run its slot
is refilled with the next streamed block not in the ring, so copies run under the compute
of the blocks between (wrapping to the next call; the loop itself: swap/block_loop.py). A load
whose plan says so reads nothing up front: its first call lands each block as it reaches it
(swap/first_use.py). Imports torch only, never ComfyUI.
"""
from __future__ import annotations

import logging
import time
from functools import partial
from typing import Callable, Iterable

import torch
from torch import nn

from . import placement
from .facts import engine_facts
from .home_policy import home_policy
from .hooks import BlockHooks
from .host_pool import HostPool
from .layout import BlockLayout
from .load_plan import PIN_MODES, EngineFacts, LoadPlan
from .window_plan import device_bytes
from .residency import ResidencyPlan
from .file_pages import MappedBlock
from .read_ahead import ReadAhead, ReadFn
from .block_loop import BlockLoop
from .first_use import FirstUse
from .resident_folds import fold_resident
from .slot_ring import SlotRing
from .coding import Coding, coding_for, keep_coder
from .plane_coder import PlaneCoder
from .ram_homes import EarlyPins, capture_resident, ensure, expected_memory, lock_early, read_homes, read_progress, settle
from .state import Attachment, BlockState, OnLand, ResidentWork, dense_bytes, writes_blocks
from .stats import RunStats

log = logging.getLogger("ringswap.engine")

READ_BUFFERS_MAX = 4
MapFn = Callable[[int], MappedBlock | None]


class BlockSwapEngine(BlockLoop):
    """Blocks read through `read_block` (or, without one, held by the modules) with homes as the
    `home` setting says (swap/home_policy.py): which blocks keep a RAM home, which read the file."""

    def __init__(self, blocks: list[nn.Module], read_block: ReadFn | None = None,
                 home: str = "ram", disk_workers: int = 4, map_block: MapFn | None = None):
        if not blocks:
            raise ValueError("BlockSwapEngine needs at least one block")
        self.homes = home_policy(home)
        if self.homes.from_file and read_block is None:
            raise ValueError(f"home={home!r} needs a read_block function")
        self.read_block = read_block
        self.map_block = map_block   # a block's home in the file's own pages, or None (swap/file_pages.py)
        # staging buffers for file reads: one is read (by all the reader's threads, a chunk each)
        # while the others land; more would only hold RAM (home=disk: RAM for blocks)
        self.read_buffers = max(2, min(disk_workers, READ_BUFFERS_MAX))
        layouts: dict[BlockLayout, BlockLayout] = {}
        self.states = []
        for i, block in enumerate(blocks):
            layout = BlockLayout.of(block)
            layout = layouts.setdefault(layout, layout)
            self.states.append(BlockState(i, block, layout))
        self.pool = HostPool()
        self.att: Attachment | None = None
        self.link_bytes_per_s = 0.0   # host-to-device rate of the last run's copies from a pinned home
        self.read_back = (0, 0.0)     # bytes read from the file by the last attach, and its seconds
        self.orders: dict[tuple[int, ...], tuple[int, ...]] = {}   # streamed blocks -> their learned call order
        self.observer: Callable[[], None] | None = None   # called before each streamed block and model call (keep it cheap)
        self.coder_factory: Callable[[torch.device], PlaneCoder] | None = None   # set where a load may code
        self.coding: Coding | None = None
        self.in_order = True   # the model runs nothing between a block and the next (timing; VACE: False)
        self.ahead: EarlyPins | None = None   # the file's pages page-locked before the first attach (pin_ahead)
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

    def device_bytes(self) -> int:
        """Bytes of block weights on the device under the attached plan (swap.window_plan.device_bytes)."""
        return device_bytes(tuple(s.layout.nbytes for s in self.states), self.att.plan) if self.att else 0

    # ----- home ----------------------------------------------------------------------
    def fill_home(self, progress: Callable[[int, int], None] | None = None) -> int:
        """home=ram with a reader: read every block once into its host buffer (parallel
        reads); calls progress(done_bytes, total_bytes). Returns the bytes read."""
        every = self.homes.every_block and self.read_block is not None
        return read_homes(self.states, self.pool, self.read_block, progress) if every else 0

    def pin_ahead(self, device: torch.device | str) -> None:
        """Before the first attach (as swap.load_plan.pins_ahead says): page-lock every block's file
        pages from now on, in call order; the attach takes the pins over, its first call still streams."""
        if self.att is None and self.ahead is None and self.map_block is not None:
            self._map_homes(frozenset(range(self.num_blocks)), compress=False)
            self.ahead = EarlyPins(self.pool, sorted(self.pool.mapped)) if self.pool.mapped else None

    # ----- attach / detach -----------------------------------------------------------
    def attach(self, device: torch.device | str, load_plan: LoadPlan, owner: object = None,
               on_land: OnLand | None = None, progress: Callable[[int, int], None] | None = None,
               resident_work: ResidentWork | None = None) -> ResidencyPlan:
        """Attach `load_plan` (swap.load_plan: its residency, RAM homes, coding and pinning) on
        `device`: place the resident blocks, hook the streamed ones and prime the ring.
        `on_land(block, tensors)` (a LoRA fold) runs on the land stream once a block's bytes are
        in, before it computes; it may return {attr index: tensor} to bind instead, held until
        the slot is refilled (cut from `out=`, the slot's DenseArena, where it has `dense_bytes`).
        `progress(done, total)` follows file reads. The same settings again only take `owner`.
        `resident_work`: on-land work split for its blocks where they stay resident (dense weights
        made before each call instead of held: swap/resident_folds.py). Returns the residency."""
        return self._attach(device, load_plan.residency, load_plan.pin_memory, owner, on_land, load_plan.ram_blocks,
                            progress, load_plan.coding.code, load_plan.coding.may_code, resident_work,
                            load_plan.stream_first)

    def _attach(self, device: torch.device | str, plan: ResidencyPlan, pin_memory: str, owner: object,
                on_land: OnLand | None, ram_blocks: Iterable[int] | None, progress: Callable[[int, int], None] | None,
                compress: bool, may_code: bool, resident_work: ResidentWork | None,
                stream_first: bool = False) -> ResidencyPlan:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if pin_memory not in PIN_MODES:
            raise ValueError(f"pin_memory must be one of {PIN_MODES}, got {pin_memory!r}")
        if plan.num_blocks != self.num_blocks:
            raise ValueError(f"the plan is for {plan.num_blocks} blocks, the engine has {self.num_blocks}")
        keep = self.homes.ram_homes(self.num_blocks, plan, ram_blocks)
        ahead, self.ahead = self.ahead, None   # pin_ahead's, only before a first attach
        if self.att is not None:
            a = self.att
            if (a.device, a.plan, a.pin_memory, a.on_land, a.ram_homes, a.compress, a.resident_work) == \
                    (device, plan, pin_memory, on_land, keep, compress, resident_work):
                self.att.owner, self.att.may_code = owner, may_code
                return plan
            self.detach()
        t0 = time.perf_counter()
        placing = [i for i in plan.resident if self.states[i].device_buffer is None]
        if ahead is not None:   # coded homes replace mapped ones; settle unpins what is not to pin
            ahead = ahead.hand_over(self.pool, keep | frozenset(placing), not compress and pin_memory != "off"
                                    and device.type == "cuda")
        report = progress if stream_first else read_progress(self.states, self.pool, keep | set(placing), progress) \
            if self.read_block is not None else None
        self._map_homes(keep | (frozenset(placing) if stream_first else frozenset()), compress)
        fills = [i for i in sorted(keep) if not self.pool.has(i)] if stream_first else []
        read_back = 0 if stream_first else ensure(self.states, self.pool, self.read_block, keep, report,
                                                         hold=not compress)
        file_streamed = [i for i in plan.streamed if i not in keep]
        att = Attachment(device, plan, "", pin_memory, owner, on_land, self.orders.get(plan.streamed), keep)
        att.compress, att.may_code, att.resident_work = compress, may_code, resident_work
        if compress or self.pool.coded:   # coded homes decode with a coder for this device
            self.coding = coding_for(self.coding, self.coder_factory, device)
        homed = [i for i in plan.streamed if i in keep]
        if compress:
            self.coding.code_homes(self.states, self.pool, homed, self.link_bytes_per_s)
        pinning = lock_early(self.pool, device, pin_memory, homed, ahead)
        read_back = self._place_and_prime(att, placing, file_streamed, read_back, report, pinning, fills, stream_first)
        if att.first_use is None:
            self.read_back = (read_back, time.perf_counter() - t0) if read_back else (0, 0.0)
        log.debug("attached on %s: %s, %s memory", device, plan.describe(), att.memory)
        return plan

    def _map_homes(self, keep: frozenset[int], compress: bool) -> None:
        """home=auto, raw homes: the blocks to keep in RAM (and, for a first call that streams, the
        resident blocks to place) that have no home get one in the file's own pages where the file
        holds their bytes as they are (nothing read, nothing copied; a resident block's goes at settle).
        Homes kept coded are RAM buffers: an attach that codes reads its mapped homes into them."""
        if self.map_block is None or not self.homes.splits_ram:
            return
        for i in sorted(keep):
            if compress:
                if i in self.pool.mapped:
                    self.pool.drop(i)
                continue
            mapped = None if self.pool.has(i) else self.map_block(i)
            if mapped is not None:
                self.pool.mapped[i] = mapped

    def _place_and_prime(self, att: Attachment, placing: list[int], file_streamed: list[int],
                         read_back: int, report, pinning, fills: list[int], stream_first: bool) -> int:
        """Place the resident blocks, settle the homes, hook the streamed blocks and issue the
        ring's first copies; on any failure the attachment is taken down again. `stream_first`:
        the resident blocks from the file and the homes in `fills` arrive during the first call
        (swap/first_use.py), which settles at its end."""
        plan, device, on_land = att.plan, att.device, att.on_land
        later = [i for i in placing if not self.pool.has(i) or i in self.pool.mapped] if stream_first else []
        now = [i for i in placing if i not in later]
        try:
            if file_streamed or any(not self.pool.has(i) for i in placing):
                att.readahead = ReadAhead(self.read_block, self.read_buffers, self.block_bytes(),
                                          pin=device.type == "cuda" and att.pin_memory != "off")
            read_back = placement.place_all(self.states, self.pool, att, now, read_back,
                                            None if stream_first else report, self.coding)
            if pinning is not None and not (later or fills):
                pinning.join()
            if later or fills:
                placement.reserve(self.states, later, device)
                att.memory = expected_memory(self.homes, self.pool, att)
                att.first_use = FirstUse(self.states, self.pool, self.read_block, att, later, fills, pinning,
                                         pin=device.type == "cuda" and att.pin_memory != "off",
                                         placed=partial(self._placed_first, att), guard=self._loading,
                                         landed=self._settle_first_use, progress=report)
            else:
                settle(self.homes, self.states, self.pool, att)
            if plan.streamed:
                self._hook_streamed(att)
            self.att = att
            for i in att.upcoming()[:plan.ring_slots]:
                self._issue(i, att.ring.victim([]))
            att.copier.take_times()   # resident placement is loading, not a run's copies
            if on_land is not None:
                att.resident_folds = fold_resident(self.states, now, plan.resident, on_land,
                                                   att.resident_work, att.copier, device)
            att.stats = att.new_stats()
        except BaseException:
            if pinning is not None:
                pinning.join()
            self.att = att
            self.detach()
            raise
        return read_back

    def _hook_streamed(self, att: Attachment) -> None:
        """The ring, the coded homes' decode scratch, the streamed blocks' hooks and stand-ins."""
        plan, device = att.plan, att.device
        nbytes = max(self.states[i].layout.nbytes for i in plan.streamed)
        att.ring = SlotRing(plan.ring_slots, nbytes, device, staging=att.memory == "staged",
                            pin_staging=device.type == "cuda", dense_bytes=dense_bytes(att.on_land, plan.streamed))
        if self.coding is not None:
            self.coding.make_scratch(self.pool, plan.streamed)
        for i in plan.streamed:
            self.states[i].unbind(device)
        att.hooks = BlockHooks([s.block for s in self.states], list(plan.streamed),
                               self._before_block, self._after_block)

    def detach(self, capture_bytes: int = 0) -> None:
        """Drain copies, unhook, free device buffers; parameters point at home again. home=auto:
        up to `capture_bytes` of resident blocks get a host home copied from the device, so the
        next attach places them without reading the file (not where on-land work changed them)."""
        self._detach(frozenset(), unpin=True, capture_bytes=capture_bytes)

    def _detach(self, kept: frozenset[int], unpin: bool, capture_bytes: int = 0) -> None:
        """detach, keeping the device buffers of the resident blocks in `kept` (and, without
        `unpin`, home=auto's pinned homes) for the attach that follows."""
        att = self.att
        if att is None:
            return
        if att.first_use is not None:   # given up before the first call ended: unplaced blocks hold nothing
            fu, att.first_use = att.first_use, None
            kept = kept - fu.stop()
        try:
            att.copier.synchronize()
            if self.homes.splits_ram and capture_bytes > 0 and not writes_blocks(att.on_land):
                coding = keep_coder(self.coding, self.coder_factory, att)
                self.coding = self.coding if coding is None else coding
                capture_resident(self.states, self.pool, self._unmappable(att.plan.resident, coding),
                                 capture_bytes, coding)
        finally:
            att.release()
            for s in self.states:
                if s.index in kept:
                    continue
                s.device_buffer = None
                s.slot = None
                self._home(s.index).detach()
            if self.coding is not None:
                self.coding.release()
            if self.homes.splits_ram and unpin:   # a model not on the device holds no pinned memory
                self.pool.unpin_all()
            self.att = None

    def _unmappable(self, blocks: tuple[int, ...], coding) -> tuple[int, ...]:
        """Those of `blocks` a home in the file's pages cannot hold raw (all of them where homes
        are kept coded): the rest are mapped again, not captured, on the next attach."""
        if self.map_block is None or coding is not None:
            return blocks
        return tuple(i for i in blocks if self.map_block(i) is None)

    def release_home(self) -> None:
        """Free the host homes and pins (the weights no longer needed: the model is being deleted)."""
        self.ahead = self.ahead and self.ahead.join()
        self.detach()
        self.pool.release()

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
            if att.first_use is not None:
                with self._loading():
                    self._settle_first_use()
            att.copier.mark_call(start=False)
            learned = att.order.finish()
            if learned is not None:
                self.orders[att.plan.streamed] = learned

    def _close_stats(self) -> RunStats:
        """Unbind any block an exception left bound; fold the device timings into the run's stats (one sync)."""
        for s in self.states:
            if s.slot is not None:
                s.unbind()
                s.slot = None
        return self.run_stats()

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

    def reattach(self, load_plan: LoadPlan, after_oom: bool = True) -> ResidencyPlan:
        """Mid-run re-plan (a smaller window after running out of memory, the plan the first
        calls' rates choose, more RAM homes once homes were coded): attach `load_plan`'s residency
        and RAM homes with the same device, pinning, owner, on-land work and coding, keeping on
        the device the resident blocks both plans share and carrying the run's counters over."""
        att = self.att
        if att is None:
            raise RuntimeError("reattach needs an attached engine")
        plan = load_plan.residency
        stats = self._close_stats()
        self._detach(frozenset(att.plan.resident) & frozenset(plan.resident), unpin=False)
        ram_blocks = att.ram_homes if load_plan.ram_blocks is None else load_plan.ram_blocks
        self._attach(att.device, plan, att.pin_memory, att.owner, att.on_land, ram_blocks, None,
                     att.compress, False, att.resident_work)
        self.att.stats = stats.continued(self.att.stats, after_oom)
        return plan

    def run_stats(self) -> RunStats:
        """This run's stats so far, with the device timings of the calls done (synchronises)."""
        att = self.att
        att.stats.add_times(att.copier.take_times())
        if att.stats.gbps > 0 and att.memory == "pinned":
            self.link_bytes_per_s = att.stats.gbps * 1e9
        return att.stats

    # ----- introspection ---------------------------------------------------------------
    @property
    def plan(self) -> ResidencyPlan | None:
        return self.att.plan if self.att else None

    @property
    def attached(self) -> bool:
        return self.att is not None

    @property
    def loading(self) -> bool:
        """The first call of the attached load is still reading blocks from the file."""
        return self.att is not None and self.att.first_use is not None

    @property
    def device(self) -> torch.device | None:
        return self.att.device if self.att else None

    @property
    def owner(self) -> object:
        """Whoever attached (the `owner` given to attach, called where it is a weak reference)."""
        owner = self.att.owner if self.att else None
        return owner() if callable(owner) else owner

    @property
    def stats(self) -> RunStats | None:
        """This run's counters so far, without the device timings (run_stats has those)."""
        return self.att.stats if self.att else None

    def dense_held_bytes(self, device: torch.device) -> int:
        """Device bytes of dense weights the on-land work holds while attached on `device`."""
        return self.att.dense_held_bytes() if self.att is not None and self.att.device == device else 0

    def facts(self) -> EngineFacts:
        """What this engine knows that a load plan needs (swap.load_plan)."""
        return engine_facts(self)

    @property
    def memory(self) -> str | None:
        return self.att.memory if self.att else None
