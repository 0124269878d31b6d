"""Host-to-device copies on one dedicated stream, ordered by events.

On CUDA every copy runs on a side stream: it first waits (GPU-side) for the event that
says its destination slot is free, then records an event that the compute stream waits
on before the block runs. The host never synchronises in the block loop. On a CPU
"device" the same calls copy inline, so the engine's logic runs unchanged in CI.

Measuring adds at most one event per streamed block to the ones that order the streams:
a copy lasts from the later of the previous copy's end and its slot's free event to its
end (for a copy the host issues after its own work, a staging copy or a read, that counts
the time the host held it back: the rate blocks arrive at); a stall lasts from the compute
stream's arrival to the copy's end. The arrival is the slot-free event of the block that
ran just before where there is one (`follows`), else a mark of its own; a block that
follows so may have its on-land work (LoRA fold) timed (one in LAND_SAMPLE), with the compute
stream's stall for it past its copy (an event more on those). On-land work
runs on a land stream of its own: a host wait inside it (ComfyUI-GGUF's dequantize makes a
blocking small copy, which synchronises its stream) then waits for the fold's own work, not
for the compute queued ahead of it. Finished events are folded into running totals as they
pile up, so a run holds a few, not one per copy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import driver_turns


FOLD_AT = 64       # measurements held before the finished ones are folded into a total
LAND_SAMPLE = 8    # one landing in this many (of those that follow a streamed block) has its on-land work timed


def _seconds(m: tuple) -> float:
    """A measurement's seconds: (seconds,) on the CPU, else (end, *starts) events: from the
    latest start to the end, never below zero."""
    if len(m) == 1:
        return m[0]
    end, starts = m[0], [e for e in m[1:] if e is not None]
    return max(0.0, min(e.elapsed_time(end) for e in starts) / 1000.0)


def _finished(m: tuple) -> bool:
    return len(m) == 1 or all(e is None or e.query() for e in m)


class Timings:
    """Durations: (seconds,) on the CPU or (end, *starts) timing events (see `_seconds`).
    `total` keeps only a running sum (finished ones are folded in once FOLD_AT are held);
    otherwise each duration is kept (a run's few model calls and sampled folds)."""

    def __init__(self, total: bool):
        self.held: list[tuple] = []
        self.summed = total
        self.done: list[float] = []
        self.sum = 0.0

    def add(self, m: tuple) -> None:
        self.held.append(m)
        if self.summed and len(self.held) >= FOLD_AT:
            self._fold(finished_only=True)

    def _fold(self, finished_only: bool) -> None:
        k = 0
        for m in self.held:
            if finished_only and not _finished(m):
                break
            d = _seconds(m)
            if self.summed:
                self.sum += d
            else:
                self.done.append(d)
            k += 1
        del self.held[:k]

    def take(self):
        """The total (or the durations) since the last take; the events must be finished."""
        self._fold(finished_only=False)
        out = self.sum if self.summed else self.done
        self.sum, self.done = 0.0, []
        return out


def _timing_event() -> "torch.cuda.Event":
    return torch.cuda.Event(enable_timing=True)


@dataclass
class Times:
    """A run's measurements (CopyStream.take_times): seconds spent copying, seconds compute
    waited for copies, each sampled on-land work (LoRA fold) and model call, and on the sampled
    landings the compute's wait for the fold past its copy, of `landings` that could be sampled."""
    copy_s: float
    wait_s: float
    land_times: list[float]
    call_times: list[float]
    land_stalls: list[float]
    landings: int


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.land_stream = torch.cuda.Stream(device) if self.cuda else None   # on-land work (LoRA folds)
        self._call_begun = None               # compute's event at the call start: the call's first landing waits for it
        self._copies = Timings(total=True)
        self._waits = Timings(total=True)
        self._lands = Timings(total=False)    # sampled on-land (LoRA fold) times
        self._land_stalls = Timings(total=False)   # on those, the compute stream's wait for the fold's end
        self._calls = Timings(total=False)    # each model call on the compute stream
        self._call_start = None
        self._last_copy: dict = {}            # each stream's latest end event (copy stream, coder's)
        self._streams = {self.stream, self.land_stream} if self.cuda else set()
        self._landings = 0                    # landings that followed a streamed block since the last take (the ones sampled)
        self._freed: tuple | None = None      # (block, event): the last slot-free event on the compute stream
        self._follows = False                 # the last compute_wait started from it

    def _started(self, stream: "torch.cuda.Stream"):
        """The event a copy on `stream` is timed from when nothing precedes it there: one per
        stream and run, recorded before its first copy."""
        last = self._last_copy.get(stream)
        if last is None:
            last = self._last_copy[stream] = _timing_event()
            last.record(stream)
        return last

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: "torch.cuda.Event | None", timed: bool = True):
        """Copy src into dst once `after` has happened; returns the event of completion."""
        return self.enqueue(lambda: dst.copy_(src, non_blocking=True), after, timed=timed)

    def enqueue(self, work, after: "torch.cuda.Event | None", stream: "torch.cuda.Stream | None" = None,
                timed: bool = True):
        """Run `work()` (copies, and for a coded block its decode) on the copy stream, or on
        `stream` (a coder's own), once `after` has happened; returns its completion event, timed
        like a copy (from the stream's previous work there) unless not `timed` (a load's placement)."""
        if not self.cuda:
            t0 = time.perf_counter()
            work()
            if timed:
                self._copies.add((time.perf_counter() - t0,))
            return None
        stream = stream or self.stream
        self._streams.add(stream)
        last = self._started(stream)
        with driver_turns.copies(), torch.cuda.stream(stream):
            if after is not None:
                stream.wait_event(after)
            work()
            done = _timing_event()
            done.record(stream)
        if timed:
            self._copies.add((done, last, after))
        self._last_copy[stream] = done
        return done

    def compute_wait(self, ready: "torch.cuda.Event | None", block: int | None = None) -> None:
        """Make the current (compute) stream wait for a copy, measuring the stall from the compute
        stream's arrival. `block`: the block about to run, where the model runs nothing between a
        block and the next (None: it may); if the last slot-free event recorded was block - 1's,
        that event is the arrival, no new one."""
        freed, self._freed = self._freed, None
        self._follows = block is not None and freed is not None and freed[0] == block - 1
        if ready is None:
            return
        stream = torch.cuda.current_stream(self.device)
        if self._follows:
            before = freed[1]
        else:   # a mark of its own (on the CPU, where nothing is recorded, `ready` is None)
            before = _timing_event()
            before.record(stream)
        stream.wait_event(ready)
        self._waits.add((ready, before))

    def landed(self, fn, *args, ready: "torch.cuda.Event | None" = None, sample: bool = True):
        """Run the on-land work `fn(*args)` once the block's bytes are in (`ready`) and return what
        it returns. On CUDA it runs on the land stream, after the compute enqueued before this
        model call (what it reads from earlier ones, e.g. LoRA pairs moved there), and the
        compute stream waits for its end; tensors it returns are marked used there. One landing in
        LAND_SAMPLE of those that followed a streamed block is timed, from its start to its end
        (`sample=False`: never, e.g. a resident block's fold before each call)."""
        follows = sample and self._follows
        timed = follows and self._landings % LAND_SAMPLE == 0
        self._landings += follows
        if not self.cuda:
            t0 = time.perf_counter()
            out = fn(*args)
            if timed:
                self._lands.add((time.perf_counter() - t0,))
            return out
        compute, land = torch.cuda.current_stream(self.device), self.land_stream
        with torch.cuda.stream(land):
            if self._call_begun is not None:
                land.wait_event(self._call_begun)
                self._call_begun = None
            if ready is not None:
                land.wait_event(ready)
            start = _timing_event() if timed else None
            if start is not None:
                start.record(land)
            out = fn(*args)
            end = _timing_event() if timed else torch.cuda.Event()   # orders the compute after it
            end.record(land)
        if start is not None:
            stall_from = _timing_event()
            stall_from.record(compute)
            self._lands.add((end, start))
            self._land_stalls.add((end, stall_from))
        compute.wait_event(end)
        for t in (out or {}).values():
            t.record_stream(compute)
        return out

    def record_compute(self, block: int) -> "torch.cuda.Event | None":
        """An event marking the end of the compute enqueued so far, after `block` ran (timing: a
        copy into the slot it frees starts no earlier; the next block's arrival)."""
        event = None
        if self.cuda:
            event = _timing_event()
            event.record(torch.cuda.current_stream(self.device))
        self._freed = (block, event)
        return event

    def mark_compute(self) -> "torch.cuda.Event | None":
        """An untimed event marking the end of the compute enqueued so far (None on the CPU)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark_call(self, start: bool) -> None:
        """Mark the start or end of a model call on the compute stream (its device time)."""
        if not self.cuda:
            mark = time.perf_counter()
        else:
            mark = _timing_event()
            mark.record(torch.cuda.current_stream(self.device))
        self._freed = None
        if start:
            self._call_start = mark
            self._call_begun = mark if self.cuda else None
        elif self._call_start is not None:
            self._calls.add((mark - self._call_start,) if not self.cuda else (mark, self._call_start))
            self._call_start = None

    def synchronize(self) -> None:
        if self.cuda:
            for stream in self._streams:
                stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def take_times(self) -> "Times":
        """What was measured since the last call. Synchronises the device (once per run,
        outside the block loop)."""
        self.synchronize()
        copy_s = self._copies.take()
        wait_s = self._waits.take() if self.cuda else copy_s
        stalls = self._land_stalls.take()
        times = Times(copy_s, wait_s, self._lands.take(), self._calls.take(), stalls, self._landings)
        self._landings = 0
        self._call_start = None
        self._last_copy = {}
        return times
