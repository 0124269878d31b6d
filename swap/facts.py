"""What an engine tells the outside, read off its state in one place so the ComfyUI adapter never
reaches into it: its facts for swap.load_plan (block sizes raw and in their homes, the homes held,
what coding measured, the link, read and pin rates) and the live view of where each block is."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from torch import nn

from .coding import Coding
from .home_policy import HomePolicy
from .layout import BlockLayout
from .host_pool import HostPool
from .load_plan import EngineFacts
from .residency import ResidencyPlan
from .state import Attachment, BlockState
from .stats import RunStats


class EngineState(Protocol):
    """What these functions read of a BlockSwapEngine (which calls them: no import back)."""
    states: list[BlockState]
    pool: HostPool
    coding: Coding | None
    att: Attachment | None
    homes: HomePolicy
    read_block: Callable | None
    read_buffers: int
    link_bytes_per_s: float
    read_back: tuple[int, float]
    num_blocks: int
    ahead: object | None   # ram_homes.EarlyPins: the file's pages page-locking before the first attach


def engine_facts(engine: EngineState) -> EngineFacts:
    pool, coding, att = engine.pool, engine.coding, engine.att
    ratio = coding.ratio if coding is not None and coding.pays else 1.0
    # homes mapped ahead (engine.pin_ahead) are still the file's to the plan: its first call streams them
    ahead = engine.ahead.pins if engine.ahead is not None else {}
    homes = frozenset(i for i in range(engine.num_blocks) if pool.has(i) and i not in ahead)
    read, read_s = engine.read_back
    return EngineFacts(
        block_sizes=tuple(s.layout.nbytes for s in engine.states),
        home_sizes=tuple(pool.coded[i].coded_bytes if i in pool.coded else int(s.layout.nbytes * ratio)
                         for i, s in enumerate(engine.states)),
        homes_held=pool.nbytes, policy=engine.homes,
        own_load=engine.read_block is not None, read_buffers=engine.read_buffers, coded_any=bool(pool.coded),
        coding_ratio=coding.ratio if coding is not None and coding.encoded[0] else 0.0,
        coding_pays=coding.pays if coding is not None else None,
        decode_rate=coding.decode_rate if coding is not None else 0.0,
        link_bytes_per_s=engine.link_bytes_per_s, read_bytes_per_s=read / read_s if read and read_s > 0 else 0.0,
        pin_s_per_byte=pool.pin_seconds(1), attached=att.plan if att else None, attached_coded=bool(att and att.compress),
        pinned_copies=bool(att and att.memory == "pinned"), homes=homes,
        pinned=frozenset(i for i in homes if pool.buffer(i).pinned),
        coded=frozenset(pool.coded), memory=att.memory if att else None, read_back=engine.read_back)


PLACES = {"G": "resident on the device", "R": "in a ring slot, landed", "C": "in a ring slot, copy or read in flight",
          "H": "at home in RAM", "D": "only in the file"}


@dataclass(frozen=True)
class LiveView:
    """Where each block's weights are right now (one PLACES letter a block), the block computing
    (-1 between blocks), the attached residency and the run's counters."""
    places: str
    current: int
    plan: ResidencyPlan
    stats: RunStats
    home: str


def live_view(engine: EngineState) -> LiveView | None:
    """The attached engine's LiveView (None when detached); reads only flags, never waits."""
    att = engine.att
    if att is None:
        return None
    places = ["H" if engine.pool.has(i) else "D" for i in range(engine.num_blocks)]
    for i in att.plan.resident:
        places[i] = "G"
    for slot in att.ring.slots if att.ring is not None else ():
        if slot.owner is not None:
            places[slot.owner] = "R" if _landed(slot) else "C"
    current = next((s.index for s in engine.states if s.slot is not None), -1)
    return LiveView("".join(places), current, att.plan, att.stats, engine.homes.mode)


def _landed(slot) -> bool:
    if slot.reading:
        return False
    return slot.ready is None or bool(slot.ready.query())


def block_of(engine: EngineState, index: int) -> tuple[nn.Module, BlockLayout]:
    """(the block module, its BlockLayout) of block `index`."""
    s = engine.states[index]
    return s.block, s.layout
