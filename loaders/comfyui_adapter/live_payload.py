"""The `ringswap.live` message: where each block's weights are right now, for the browser; and
the `ringswap.run` message, a sampling run's summary.

One character per block keeps a 200-block model's message at a few hundred bytes:

    G  resident on the GPU for the whole run
    R  in a ring slot, its copy landed (computing or waiting to)
    C  in a ring slot, its copy (or home=disk: its read) still in flight
    H  at home in host RAM, not on the GPU
    D  only in the file (home=disk, or home=auto where RAM is short), not on the GPU
"""
from __future__ import annotations

from ...swap import BlockSwapEngine
from ...swap.facts import live_view
from ...swap.load_plan import LoadPlan
from ...swap.stats import RunStats

SCHEMA_VERSION = 1
RUN_EVENT = "ringswap.run"


def live_payload(engine: BlockSwapEngine, node: str | None, step: int, steps: int, elapsed_s: float) -> dict:
    """The message for one moment of a run (JSON-ready). `step`/`steps`: the sampler's step
    (0-based) and its count when known (else -1 / 0); `elapsed_s`: since the run's first call.

    Keys: v, node (the RingSwap node's id or None), blocks, states (one letter a block,
    swap/facts.py PLACES), current (the block computing, -1 between blocks), window, prefetch,
    ring_slots, resident, streamed, home, step, steps, calls, forwards, copies, bytes_copied,
    unplanned, elapsed_s.
    """
    view = live_view(engine)
    plan, stats = view.plan, view.stats
    return {"v": SCHEMA_VERSION, "node": node, "blocks": engine.num_blocks, "states": view.places,
            "current": view.current, "window": plan.window, "prefetch": plan.prefetch, "ring_slots": plan.ring_slots,
            "resident": len(plan.resident), "streamed": len(plan.streamed), "home": view.home,
            "step": step, "steps": steps, "calls": stats.calls, "forwards": stats.forwards,
            "copies": stats.copies, "bytes_copied": stats.bytes_copied, "unplanned": stats.unplanned,
            "elapsed_s": round(elapsed_s, 3)}


def run_payload(stats: RunStats, plan: LoadPlan | None, node: str | None, wall_s: float, steps: int,
                live: int) -> dict:
    """The `ringswap.run` message (web/ringswap.js): the run's engine stats, the plan it ran, seconds
    since its first model call, its steps and the live messages sent."""
    return {
        "node": node, "line": stats.line(), "blocks": stats.blocks, "streamed": stats.streamed,
        "window": stats.window, "prefetch": stats.prefetch, "memory": stats.memory,
        "bytes_copied": stats.bytes_copied, "gbps": stats.gbps, "copy_ms": stats.copy_s * 1e3,
        "hidden_ms": stats.hidden_s * 1e3, "wait_ms": stats.wait_s * 1e3,
        "fold_ms_per_block": 1e3 * stats.fold_s_per_block, "calls": stats.calls, "compute_s": stats.compute_s,
        "shrinks": stats.shrinks, "steps": steps, "wall_s": wall_s,
        "s_per_step": wall_s / steps if steps else 0.0, "calls_per_step": stats.calls / steps if steps else 0.0,
        "live_messages": live, "plan": plan.as_dict() if plan is not None else None}
