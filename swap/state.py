"""The engine's state: one small object per block, and one per attachment to a device.

A BlockState says where its block's weights are (home, resident buffer or ring slot); an
Attachment holds everything that exists only while the engine is attached: the plan, the
copy stream, the ring, the file read-ahead, the hooks, the learned call order and the run's stats.
A block's home (swap/homes.py) is not held here: it is derived from the HostPool when asked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from .call_order import CallOrder
from .hooks import BlockHooks
from .layout import BlockBinding, BlockLayout
from .residency import ResidencyPlan
from .read_ahead import ReadAhead
from .slot_ring import Slot, SlotRing
from .stats import RunStats
from .transfer import CopyStream


OnLand = Callable[..., "dict[int, torch.Tensor] | None"]   # on_land(block, tensors[, out=]): BlockSwapEngine.attach


def writes_blocks(on_land: OnLand | None) -> bool:
    """May `on_land` write a block's own tensors? (One whose `writes_blocks` is False only hands
    back replacements to bind, so the device copy stays what was placed.)"""
    return on_land is not None and getattr(on_land, "writes_blocks", True)


def dense_bytes(on_land: OnLand | None, blocks) -> int:
    """Device bytes the largest landing of `blocks` hands back (0: none). On-land work with a
    `dense_bytes(block)` method is given `out=`, a DenseArena of that size, to cut them from."""
    size = getattr(on_land, "dense_bytes", None)
    return max((size(i) for i in blocks), default=0) if size is not None else 0


def kept_bytes(on_land: OnLand | None, device: torch.device) -> int:
    """Device bytes the on-land work keeps between calls (LoRA pairs moved there by their first
    fold): weights, not activations. 0 without a `kept_bytes(device)` method."""
    kept = getattr(on_land, "kept_bytes", None)
    return kept(device) if kept is not None else 0


def warm(on_land: OnLand | None, block: int) -> bool:
    """Is a landing of `block` timed like the ones after it? Not where `on_land` says it has
    one-time work left for the block (`warm(block)` False: the LoRA pairs moved and laid out
    on its first fold), which would make the fold look several times dearer to the planner."""
    is_warm = getattr(on_land, "warm", None)
    return is_warm(block) if is_warm is not None else True


@dataclass(frozen=True)
class ResidentWork:
    """On-land work of `blocks` split for where they stay resident: `placed` once, when placed
    (it writes the block's own tensors), `each_call` before each call (its replacements, e.g.
    dense weights, are bound only while the block computes: swap/resident_folds.py)."""
    blocks: frozenset[int]
    placed: OnLand
    each_call: OnLand


class HeldFolds(Protocol):
    """What the attachment asks of its resident blocks' per-call folds (swap/resident_folds.py
    ResidentFolds, which imports this module: a Protocol here keeps the imports one way)."""
    arenas: list

    def remove(self) -> None: ...


class BlockState:
    """One block: its layout, the attributes to rebind, and where its weights are."""

    def __init__(self, index: int, block: nn.Module, layout: BlockLayout):
        self.index = index
        self.block = block
        self.layout = layout
        self.binding = BlockBinding(block, layout)
        self.device_buffer: torch.Tensor | None = None   # resident blocks only
        self.slot: Slot | None = None                     # streamed block while it runs
        self._stand_ins: tuple | None = None              # (device, joined empty tensors)

    def unbind(self, device: torch.device | None = None) -> None:
        """Point the block at empty stand-ins on `device` (default: the last one used); they
        are made and joined once per device, as a block of the ring is unbound every step."""
        if device is not None and (self._stand_ins is None or self._stand_ins[0] != device):
            self._stand_ins = (device, self.layout.joined(self.layout.placeholders(device)))
        self.binding.bind_joined(self._stand_ins[1])


class Attachment:
    """Everything that exists only while the engine is attached to a device."""

    def __init__(self, device: torch.device, plan: ResidencyPlan, memory: str, pin_memory: str,
                 owner: object, on_land: Callable | None, learned: tuple[int, ...] | None,
                 ram_homes: frozenset[int] = frozenset()):
        self.owner = owner          # opaque token of whoever attached (e.g. a weakref)
        self.on_land = on_land
        self.device = device
        self.plan = plan
        self.memory = memory
        self.pin_memory = pin_memory
        self.ram_homes = ram_homes  # blocks holding a host copy while attached
        self.copier = CopyStream(device)
        self.ring: SlotRing | None = None
        self.readahead: ReadAhead | None = None
        self.compress = False       # streamed RAM homes are kept coded (swap/coding.py)
        self.may_code = False       # resident blocks kept in RAM at detach are coded (coding.keep_coder)
        self.hooks: BlockHooks | None = None
        self.resident_work: ResidentWork | None = None   # on-land work split for resident blocks
        self.resident_folds: HeldFolds | None = None      # their hooks
        self.first_use = None       # swap/first_use.FirstUse while the first call's blocks arrive
        self.order = CallOrder(plan.streamed, learned)
        self.stats = self.new_stats()

    def new_stats(self) -> RunStats:
        p = self.plan
        return RunStats(p.num_blocks, len(p.resident), len(p.streamed), p.ring_slots,
                        p.window, p.prefetch, self.memory)

    def dense_held_bytes(self) -> int:
        """Device bytes of the dense weights the on-land work makes, held while attached: the ring
        slots' arenas, the two arenas of the resident blocks folded per call, and the sets the
        other resident blocks hold from placing on (swap/dense_arena.py)."""
        slots = sum(s.dense.nbytes for s in self.ring.slots if s.dense is not None) if self.ring else 0
        sets = sum(a.nbytes for a in self.resident_folds.arenas) if self.resident_folds else 0
        size = getattr(self.on_land, "dense_bytes", None)
        per_call = self.resident_work.blocks if self.resident_work else frozenset()
        held = sum(size(i) for i in self.plan.resident if i not in per_call) if size is not None else 0
        return slots + sets + held

    def release(self) -> None:
        """Take down the file reads, the hooks (the resident folds' binding back what they replaced)
        and the ring; the copies are drained first (BlockSwapEngine.detach)."""
        if self.readahead is not None:
            self.readahead.release_all()
        if self.hooks is not None:
            self.hooks.remove()
        if self.resident_folds is not None:
            self.resident_folds.remove()
        if self.ring is not None:
            self.ring.release()

    def upcoming(self) -> list[int]:
        """Streamed blocks in call order after the last one called (wrapping)."""
        return self.order.upcoming()
