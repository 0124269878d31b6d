"""The RAM home=auto gives block homes, and the split of a plan's streamed blocks (swap.ram_split).

The room is `ram_budget_gb` when set; else the RAM available now, plus the homes this model
already holds, less a margin (MARGIN_SHARE of those two, at least MARGIN_MIN) and less what
ComfyUI says it keeps for itself (comfy_memory.ram_kept_by_comfy). The margin follows the
RAM there is to share, not the machine's size, so a RAM ballast emulates a smaller machine.
A model taken off the GPU may keep its resident blocks in what the room leaves (`capture_room`).
"""
from __future__ import annotations

import logging

from ...swap.residency import ResidencyPlan
from ...swap.ram_split import RamSplit, split_ram
from . import comfy_memory

log = logging.getLogger("ringswap.ram_room")

GB = 1e9
MARGIN_SHARE = 0.10   # of the RAM to share, for the OS, ComfyUI's other work and the page cache's core
MARGIN_MIN = 2 * GB


def room(engine, ram_budget_gb: float) -> tuple[int, str]:
    """(bytes the model's block homes may use, why)."""
    if ram_budget_gb > 0:
        return int(ram_budget_gb * GB), f"ram_budget_gb {ram_budget_gb:g}"
    available, held = comfy_memory.ram_available(), engine.pool.nbytes
    margin = max(MARGIN_MIN, MARGIN_SHARE * (available + held))
    kept = comfy_memory.ram_kept_by_comfy()
    why = (f"{available / GB:.1f} GB available + {held / GB:.1f} GB of its homes - {margin / GB:.1f} GB margin"
           + (f" - {kept / GB:.1f} GB ComfyUI keeps" if kept else ""))
    return max(0, int(available + held - margin - kept)), why


def capture_room(engine, ram_budget_gb: float) -> int:
    """Bytes of resident blocks a home=auto model taken off the GPU may keep in RAM (so the next
    attach places them without reading the file): what `room` leaves beside the homes it holds.
    The model that loads next counts that RAM as taken. 0 for other homes."""
    if engine.home != "auto":
        return 0
    nbytes, _ = room(engine, ram_budget_gb)
    return max(0, nbytes - engine.pool.nbytes)


def short_of_whole(engine, ram_budget_gb: float) -> bool:
    """home=auto: whether the room is less than all the model's blocks raw (its homes and, once taken
    off the GPU, its kept resident blocks): RAM is short, so compress=auto codes its homes."""
    return engine.home == "auto" and room(engine, ram_budget_gb)[0] < engine.total_block_bytes()


def split_for(engine, plan: ResidencyPlan, ram_budget_gb: float) -> RamSplit | None:
    """The RAM split of `plan` for an engine with home=auto (None for other homes)."""
    if engine.home != "auto":
        return None
    nbytes, why = room(engine, ram_budget_gb)
    return split_ram(plan, home_sizes(engine), nbytes, why, engine.read_buffers,
                     tuple(s.layout.nbytes for s in engine.states))


def home_sizes(engine) -> tuple[int, ...]:
    """Each block's bytes in RAM: its coded bytes where it is kept coded; where blocks of this
    model were coded before, the others at the ratio they got (they will be coded too)."""
    coding, coded = engine.coding, engine.pool.coded
    ratio = coding.ratio if coding is not None and coding.pays else 1.0
    return tuple(coded[i].coded_bytes if i in coded else int(s.layout.nbytes * ratio)
                 for i, s in enumerate(engine.states))
