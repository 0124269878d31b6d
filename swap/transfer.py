"""Host-to-device copies on one dedicated stream, ordered by events.

On CUDA every copy runs on a side stream: it first waits (GPU-side) for the event that
says its destination slot is free, then records an event that the compute stream waits
on before the block runs. The host never synchronises in the block loop. On a CPU
"device" the same calls copy inline, so the engine's logic runs unchanged in CI.
Copy and wait times are measured with timing events and read once per run.
"""
from __future__ import annotations

import time

import torch


class CopyStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._copies: list[tuple] = []   # (start, end) events, or seconds on CPU
        self._waits: list[tuple] = []
        self._lands: list[tuple] = []
        self._calls: list[tuple] = []    # (start, end) of each model call on the compute stream
        self._call_start = None

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: "torch.cuda.Event | None"):
        """Copy src into dst once `after` has happened; returns the event of completion."""
        if not self.cuda:
            t0 = time.perf_counter()
            dst.copy_(src)
            self._copies.append((time.perf_counter() - t0,))
            return None
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            done.record(self.stream)
        self._copies.append((start, done))
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
        self._waits.append((before, after))

    def timed_compute(self, fn, *args) -> None:
        """Run `fn(*args)` (work on the compute stream) and measure its device time."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn(*args)
            self._lands.append((time.perf_counter() - t0,))
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn(*args)
        end.record(stream)
        self._lands.append((start, end))

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
            self._calls.append((mark - self._call_start,) if not self.cuda else (self._call_start, mark))
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

        def each(pairs):
            return [p[0] if len(p) == 1 else p[0].elapsed_time(p[1]) / 1000.0 for p in pairs]

        def total(pairs):
            return sum(each(pairs))

        copy_s = total(self._copies)
        wait_s = total(self._waits) if self.cuda else copy_s
        lands, calls = each(self._lands), each(self._calls)
        for pairs in (self._copies, self._waits, self._lands, self._calls):
            pairs.clear()
        self._call_start = None
        return copy_s, wait_s, lands, calls
