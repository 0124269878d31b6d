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

import torch
from torch import nn

from .hooks import BlockHooks
from .host_pool import HostPool
from .layout import BlockBinding, BlockLayout
from .plan import ResidencyPlan
from .slot_ring import Slot, SlotRing
from .stats import RunStats
from .transfer import CopyStream

log = logging.getLogger("ringswap.engine")

PIN_MODES = ("auto", "on", "off")


class BlockState:
    """One block: its layout, the attributes to rebind, and where its weights are."""

    def __init__(self, index: int, block: nn.Module, layout: BlockLayout):
        self.index = index
        self.block = block
        self.layout = layout
        self.binding = BlockBinding(block, layout)
        self.placeholders: list[torch.Tensor] | None = None
        self.device_buffer: torch.Tensor | None = None   # resident blocks only
        self.slot: Slot | None = None                     # streamed block while it runs


class _Attachment:
    """Everything that exists only while the engine is attached to a device."""

    def __init__(self, device: torch.device, plan: ResidencyPlan, memory: str, pin_memory: str,
                 owner: object):
        self.owner = owner          # opaque token of whoever attached (e.g. a weakref)
        self.device = device
        self.plan = plan
        self.memory = memory
        self.pin_memory = pin_memory
        self.copier = CopyStream(device)
        self.ring: SlotRing | None = None
        self.hooks: BlockHooks | None = None
        self.order = {b: j for j, b in enumerate(plan.streamed)}
        self.stats = self.new_stats()

    def new_stats(self) -> RunStats:
        p = self.plan
        return RunStats(p.num_blocks, len(p.resident), len(p.streamed), p.ring_slots,
                        p.window, p.prefetch, self.memory)

    def upcoming(self, block: int) -> list[int]:
        """Streamed blocks in run order starting after `block` (wrapping)."""
        s, j = self.plan.streamed, self.order[block]
        return [s[(j + k) % len(s)] for k in range(1, len(s) + 1)]


class BlockSwapEngine:
    def __init__(self, blocks: list[nn.Module]):
        if not blocks:
            raise ValueError("BlockSwapEngine needs at least one block")
        layouts: dict[BlockLayout, BlockLayout] = {}
        self.states = []
        for i, block in enumerate(blocks):
            layout = BlockLayout.of(block)
            layout = layouts.setdefault(layout, layout)
            self.states.append(BlockState(i, block, layout))
        self.pool = HostPool()
        self.att: _Attachment | None = None

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
    def _ensure_home(self) -> None:
        """Give every block an exact-size host home holding its current weights, and
        point its parameters there. Re-captures a block whose tensors were replaced
        from outside (e.g. another loader moved the shared model)."""
        for s in self.states:
            buf = self.pool.blocks.get(s.index)
            current = s.binding.current()
            if buf is not None and current[0].data_ptr() == buf.flat.data_ptr():
                continue
            if buf is None:
                buf = self.pool.add(s.index, s.layout.nbytes)
            s.layout.pack(current, buf.flat)
            s.binding.bind(s.layout.views(buf.flat))

    def _home_views(self, s: BlockState) -> list[torch.Tensor]:
        return s.layout.views(self.pool.blocks[s.index].flat)

    # ----- attach / detach -----------------------------------------------------------
    def attach(self, device: torch.device | str, window: int, prefetch: int,
               pin_memory: str = "auto", owner: object = None) -> ResidencyPlan:
        """Place resident blocks on `device`, hook the streamed ones and prime the ring.
        Attaching again with the same settings keeps everything and only takes `owner`."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if pin_memory not in PIN_MODES:
            raise ValueError(f"pin_memory must be one of {PIN_MODES}, got {pin_memory!r}")
        plan = ResidencyPlan.make(self.num_blocks, window, prefetch)
        if self.att is not None:
            if (self.att.device, self.att.plan, self.att.pin_memory) == (device, plan, pin_memory):
                self.att.owner = owner
                return plan
            self.detach()
        self._ensure_home()
        memory = self._choose_memory(device, plan, pin_memory)
        att = _Attachment(device, plan, memory, pin_memory, owner)
        try:
            for i in plan.resident:
                s = self.states[i]
                s.device_buffer = torch.empty(s.layout.nbytes, dtype=torch.uint8, device=device)
                att.copier.copy(s.device_buffer, self.pool.blocks[i].flat, None)
                s.binding.bind(s.layout.views(s.device_buffer))
            if plan.streamed:
                nbytes = max(self.states[i].layout.nbytes for i in plan.streamed)
                att.ring = SlotRing(plan.ring_slots, nbytes, device, staging=memory == "staged",
                                    pin_staging=device.type == "cuda")
                for i in plan.streamed:
                    s = self.states[i]
                    if s.placeholders is None or s.placeholders[0].device != device:
                        s.placeholders = s.layout.placeholders(device)
                    s.binding.bind(s.placeholders)
                att.hooks = BlockHooks([s.block for s in self.states], list(plan.streamed),
                                       self._before_block, self._after_block)
            self.att = att
            for i in plan.streamed[:plan.ring_slots]:
                self._issue(i, att.ring.victim([]))
            att.copier.take_times()   # resident placement is loading, not a run's copies
            att.stats = att.new_stats()
        except BaseException:
            self.att = att
            self.detach()
            raise
        log.debug("attached on %s: %s, %s memory", device, plan.describe(), memory)
        return plan

    def _choose_memory(self, device: torch.device, plan: ResidencyPlan, pin_memory: str) -> str:
        if not plan.streamed:
            return "pinned" if self.pool.pinned_bytes else "pageable"
        if device.type != "cuda":
            return "staged"
        if pin_memory == "off":
            self.pool.unpin_all()
            return "pageable"
        if self.pool.pin(list(plan.streamed)):
            return "pinned"
        if pin_memory == "on":
            raise RuntimeError(
                f"pin_memory='on' but page-locking {len(plan.streamed)} blocks "
                f"({sum(self.states[i].layout.nbytes for i in plan.streamed) / 2**30:.1f} GiB) failed; "
                "free RAM, lower the streamed share (a larger window) or use pin_memory='auto'")
        log.warning("RingSwap: could not pin %.1f GiB of host memory; using pageable memory with "
                    "a pinned staging ring (slower copies)",
                    sum(self.states[i].layout.nbytes for i in plan.streamed) / 2**30)
        return "staged"

    def detach(self) -> None:
        """Drain copies, unhook, free device buffers; parameters point at home again."""
        att = self.att
        if att is None:
            return
        try:
            att.copier.synchronize()
        finally:
            if att.hooks is not None:
                att.hooks.remove()
            for s in self.states:
                s.device_buffer = None
                s.slot = None
                if s.index in self.pool.blocks:
                    s.binding.bind(self._home_views(s))
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
        """Start copying `block` into `slot` once the slot's previous owner is done."""
        att = self.att
        s = self.states[block]
        src = self.pool.blocks[block].flat
        dst = slot.flat[:s.layout.nbytes]
        if slot.staging is not None:
            if slot.ready is not None:
                slot.ready.synchronize()   # staging buffer still feeding the last copy
            staged = slot.staging.flat[:s.layout.nbytes]
            staged.copy_(src)
            src = staged
        slot.owner = block
        slot.ready = att.copier.copy(dst, src, slot.free)
        att.stats.copies += 1
        att.stats.bytes_copied += s.layout.nbytes

    def _before_block(self, block: int) -> None:
        att = self.att
        slot = att.ring.slot_of(block)
        if slot is None:   # not predicted (first call after a plan change, odd call order)
            slot = att.ring.victim(att.upcoming(block)[:-1])
            self._issue(block, slot)
        att.copier.compute_wait(slot.ready)
        s = self.states[block]
        s.slot = slot
        s.binding.bind(slot.views(s.layout))
        att.stats.forwards += 1

    def _after_block(self, block: int) -> None:
        att = self.att
        s = self.states[block]
        slot = s.slot
        s.binding.bind(s.placeholders)
        s.slot = None
        if slot is None or slot.owner != block:
            return
        slot.free = att.copier.record_compute()
        owned = set(att.ring.owners())
        nxt = next((b for b in att.upcoming(block) if b not in owned), None)
        if nxt is not None:
            self._issue(nxt, slot)

    # ----- runs ------------------------------------------------------------------------
    def end_run(self) -> RunStats | None:
        """Close a sampling run (also after an interrupt): unbind any block left bound by
        an exception, read the copy/wait times, log one line and reset the counters."""
        att = self.att
        if att is None:
            return None
        for s in self.states:
            if s.slot is not None:
                s.binding.bind(s.placeholders)
                s.slot = None
        stats = att.stats
        stats.copy_s, stats.wait_s = att.copier.take_times()
        att.stats = att.new_stats()
        if stats.streamed:
            log.info(stats.line())
        return stats

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
