"""Host-to-device copies on one dedicated stream, ordered by events.

On CUDA every copy runs on a side stream: it first waits (GPU-side) for the event that
says its destination slot is free, then records an event that the compute stream waits
on before the block runs. The host never synchronises in the block loop. On a CPU
"device" the same calls copy inline, so the engine's logic runs unchanged in CI.
Copy and wait times are measured with timing events, read once per run; events whose work
is done are folded into running totals as they pile up, so a long run holds a few, not one
pair per copy.
"""
from __future__ import annotations

import time

import torch


FOLD_AT = 64   # pairs held before the finished ones are folded into a total


class Timings:
    """Device (or host) durations: (start, end) timing events, or (seconds,) on the CPU.
    `total` keeps only a running sum (finished pairs are folded in once FOLD_AT are held);
    otherwise each duration is kept (a run's few model calls and folds)."""

    def __init__(self, total: bool):
        self.pairs: list[tuple] = []
        self.summed = total
        self.done: list[float] = []
        self.sum = 0.0

    def add(self, pair: tuple) -> None:
        self.pairs.append(pair)
        if self.summed and len(self.pairs) >= FOLD_AT:
            self._fold(finished_only=True)

    def _fold(self, finished_only: bool) -> None:
        k = 0
        for p in self.pairs:
            if finished_only and len(p) == 2 and not p[1].query():
                break
            d = p[0] if len(p) == 1 else p[0].elapsed_time(p[1]) / 1000.0
            if self.summed:
                self.sum += d
            else:
                self.done.append(d)
            k += 1
        del self.pairs[:k]

    def take(self):
        """The total (or the durations) since the last take; the events must be finished."""
        self._fold(finished_only=False)
        out = self.sum if self.summed else self.done
        self.sum, self.done = 0.0, []
        return out


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._copies = Timings(total=True)    # (start, end) events, or seconds on CPU
        self._waits = Timings(total=True)
        self._lands = Timings(total=False)    # each on-land's (LoRA fold's) time
        self._calls = Timings(total=False)    # (start, end) of each model call on the compute stream
        self._call_start = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: "torch.cuda.Event | None"):
        """Copy src into dst once `after` has happened; returns the event of completion."""
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            self._copies.add((time.perf_counter() - t0,))
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        self._copies.add((start, done))
        return done

    def compute_wait(self, ready: "torch.cuda.Event | None") -> None:
        """Make the current (compute) stream wait for a copy, measuring the stall."""
        if ready is None:
            return
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(ready)
        after.record(stream)
        self._waits.add((before, after))

    def timed_compute(self, fn, *args) -> None:
        """Run `fn(*args)` (work on the compute stream) and measure its device time."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn(*args)
            self._lands.add((time.perf_counter() - t0,))
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn(*args)
        end.record(stream)
        self._lands.add((start, end))

    def record_compute(self) -> "torch.cuda.Event | None":
        """An event marking the end of the compute enqueued so far."""
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
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(torch.cuda.current_stream(self.device))
        if start:
            self._call_start = mark
        elif self._call_start is not None:
            self._calls.add((mark - self._call_start,) if not self.cuda else (self._call_start, mark))
            self._call_start = None

    def synchronize(self) -> None:
        if self.cuda:
            self.stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    def take_times(self) -> tuple[float, float, list[float], list[float]]:
        """Seconds spent copying, seconds compute waited for copies, the seconds of each
        on-land work (LoRA folds) and of each model call since the last call. Synchronises
        the device (once per run, outside the block loop)."""
        self.synchronize()
        copy_s = self._copies.take()
        wait_s = self._waits.take() if self.cuda else copy_s
        lands, calls = self._lands.take(), self._calls.take()
        self._call_start = None
        return copy_s, wait_s, lands, calls
