"""How long one model call takes under a residency plan, by the engine's own rules.

Pure arithmetic for the planner: blocks run in order, each taking an equal share of the
call's compute; a streamed block waits for its copy and its on-land work (a LoRA fold, one
at a time on the land stream once the copy is in); copies run one at a time on the copy
stream, each issued as soon as a ring slot is free (the streamed block that held it has
run), and the ring wraps into the next call. Simulated over a few calls, so the result is
the steady state. Totals alone (copy time against compute time) miss the stalls where
streamed blocks sit next to each other and prefetch cannot bank the resident blocks' slack.
"""
from __future__ import annotations

from .residency import ResidencyPlan

CALLS = 4   # simulated calls; the last one is steady


def call_seconds(block_sizes: tuple[int, ...], plan: ResidencyPlan, compute_s: float,
                 link_bytes_per_s: float, land_s: float = 0.0) -> float:
    """Seconds of one steady model call: `compute_s` of compute (no copy or fold waits) spread
    evenly over the blocks, streamed blocks copied at `link_bytes_per_s`, each then folded for
    `land_s` seconds."""
    if not plan.streamed or link_bytes_per_s <= 0:
        return compute_s
    per_block = compute_s / plan.num_blocks
    streamed, slots = set(plan.streamed), plan.ring_slots
    ran: list[float] = []   # when each streamed block (in run order, over all calls) finished
    copy_free = land_free = now = start = 0.0
    for _ in range(CALLS):
        start = now
        for b in range(plan.num_blocks):
            if b in streamed:
                j = len(ran)
                issued = max(copy_free, ran[j - slots] if j >= slots else 0.0)
                copy_free = issued + block_sizes[b] / link_bytes_per_s
                land_free = max(land_free, copy_free) + land_s
                now = max(now, land_free)
                now += per_block
                ran.append(now)
            else:
                now += per_block
    return now - start
