"""One model call with out-of-memory recovery: free the ring, shrink the window, retry once.

The retry runs the same inputs through the same weights, so its output equals a run at
the smaller window from the start. The first call of a run also measures the activation
peak on CUDA where the caller asks (`CallPeak`: it empties the allocator's cache and resets
CUDA's peak-memory statistics, so a call shape measured before is not measured again).
"""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch

from .engine import BlockSwapEngine
from .load_plan import LoadPlan
from .state import OnLand, kept_bytes

log = logging.getLogger("ringswap.recovery")

T = TypeVar("T")
GB = 1e9


class CallPeak:
    """Bytes one model call needs on a CUDA device beyond what it holds at the call's start:
    what the caching allocator had to reserve (fragmentation included), not only what tensors
    occupied: a plan sized on tensor bytes alone can run out of memory. What the on-land work
    keeps from the call on (LoRA pairs moved there, planned as weights) is not counted."""

    def __init__(self, device: torch.device, on_land: OnLand | None = None):
        torch.cuda.empty_cache()   # reserved == held at the start: its growth is this call's own
        torch.cuda.reset_peak_memory_stats(device)
        self.device, self.on_land = device, on_land
        self.allocated = torch.cuda.memory_allocated(device)
        self.reserved = torch.cuda.memory_reserved(device)
        self.kept = kept_bytes(on_land, device)

    def bytes(self) -> int:
        kept = kept_bytes(self.on_land, self.device) - self.kept
        return max(0, torch.cuda.max_memory_allocated(self.device) - self.allocated - kept,
                   torch.cuda.max_memory_reserved(self.device) - self.reserved - kept)


def _take_down(engine: BlockSwapEngine, on_change: Callable[[int, int], None]) -> None:
    """End the run and detach, reporting the device bytes given back."""
    held = engine.device_bytes()
    engine.end_run()
    engine.detach()
    on_change(held, 0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _load_failed(engine: BlockSwapEngine, on_change: Callable[[int, int], None], held: int) -> None:
    """A call failed while its load's blocks were arriving: detached (where the failed landing did
    not do it already), the `held` device bytes given back."""
    if engine.attached:
        _take_down(engine, lambda old, new: None)
    on_change(held, 0)


def _give_up(engine: BlockSwapEngine, on_change: Callable[[int, int], None], message: str) -> None:
    _take_down(engine, on_change)
    raise torch.OutOfMemoryError(message)


def run_call(engine: BlockSwapEngine, call: Callable[[], T],
             smaller: Callable[[], LoadPlan | None],
             on_change: Callable[[int, int], None], measure_peak: bool = True) -> T:
    """Run one model call on an attached engine; the first of a run measures its activation
    peak with `measure_peak`. On running out of memory: `smaller()` gives
    the plan to retry with (None: no smaller plan), the engine re-attaches with
    it, `on_change(old_bytes, new_bytes)` reports the change of block bytes on the device,
    and the call runs once more. A second failure (or none smaller) detaches the engine and
    raises torch.OutOfMemoryError with what was tried."""
    att = engine.att
    engine.begin_call()
    cuda = att.device.type == "cuda"
    first = att.stats.calls == 1
    loading = engine.device_bytes() if engine.loading else 0   # device bytes of a load still landing
    peak = CallPeak(att.device, att.on_land) if first and cuda and measure_peak else None
    try:
        out = call()
        if peak is not None:
            att.stats.activation_peak = peak.bytes()
        engine.end_call()
        return out
    except torch.OutOfMemoryError as e:
        reason = str(e).splitlines()[0] if str(e) else "out of memory"
    except BaseException:
        if loading:   # a read error or an interrupt while the blocks arrived: nothing stays half-placed
            _load_failed(engine, on_change, loading)
        raise
    # Outside the except block: the failed call's frames (and activations) are freed.
    window, prefetch = att.plan.window, att.plan.prefetch
    where = f"{att.device} at window {window}, prefetch {prefetch}"
    target = smaller()
    if target is None:
        _give_up(engine, on_change, f"RingSwap: out of memory on {where}, already the smallest plan: {reason}. "
                                    "Use a smaller latent (resolution, frames, batch), a quantized model, or free "
                                    "VRAM held by other programs.")
    return _retry(engine, call, target, on_change, where, reason)


def _retry(engine: BlockSwapEngine, call: Callable[[], T], target: LoadPlan,
           on_change: Callable[[int, int], None], where: str, reason: str) -> T:
    """Re-attach at `target` (the smaller plan after running out of memory on `where`) and run the
    call once more; out of memory again detaches and raises."""
    shrunk, cuda = target.residency, engine.att.device.type == "cuda"
    held = engine.device_bytes()
    try:
        engine.reattach(target)
    except torch.OutOfMemoryError as e:
        _give_up(engine, on_change, f"RingSwap: out of memory on {where}, and again re-attaching at window "
                                    f"{shrunk.window}: {str(e).splitlines()[0]}")
    if cuda:
        torch.cuda.empty_cache()
    on_change(held, engine.device_bytes())
    log.warning("RingSwap: out of memory on %s (%s); retrying this step at window %d, prefetch %d "
                "(%.2f GB of blocks on the device instead of %.2f GB)",
                where, reason, shrunk.window, shrunk.prefetch, engine.device_bytes() / GB, held / GB)
    engine.begin_call()
    att = engine.att
    att.stats.calls -= 1   # the same call, retried
    peak = CallPeak(att.device, att.on_land) if cuda else None
    try:
        out = call()
        if peak is not None:
            att.stats.activation_peak = peak.bytes()
        engine.end_call()
        return out
    except torch.OutOfMemoryError as e:
        reason = str(e).splitlines()[0] if str(e) else "out of memory"
    _give_up(engine, on_change, f"RingSwap: out of memory on {where}, and again after shrinking to window "
                                f"{shrunk.window}, prefetch {shrunk.prefetch}: {reason}. Use a smaller latent (resolution, "
                                "frames, batch), a quantized model, or free VRAM held by other programs.")
