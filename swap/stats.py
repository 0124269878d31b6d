"""What one sampling run moved and how well the copies hid under compute."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .transfer import Times


@dataclass(frozen=True)
class FirstCall:
    """A load's first call that streamed (swap/first_use.py): its reads and what its thread waited for.
    Times from the attach that made it."""
    read: int             # bytes read from the file (not copied from its pages)
    seconds: float        # to the call's end
    read_wait_s: float    # the call's thread waited for reads
    reads_s: float        # when the last read was done
    pin_s: float          # page-locking of the homes this call read and the blocks it placed, summed over threads
    pin_wait_s: float = 0.0   # the call's thread waited for page-locking (a slot's copy, a resident block's)
    pins_end_s: float = 0.0   # when the last home or placed block was page-locked after the attach (0: none was)
    ahead: tuple[int, int] = (0, 0)   # bytes page-locked ahead (engine.pin_ahead) by the attach, of all pinned ahead


@dataclass
class RunStats:
    blocks: int
    resident: int
    streamed: int
    ring_slots: int
    window: int
    prefetch: int
    memory: str            # "pinned", "staged" or "pageable"
    copies: int = 0
    bytes_copied: int = 0
    copy_s: float = 0.0    # time the copy stream spent copying
    wait_s: float = 0.0    # time the compute stream stood waiting for copies
    forwards: int = 0      # streamed-block forwards
    bytes_read: int = 0    # home=disk: bytes read from the file
    read_wait_s: float = 0.0   # home=disk: time the block loop waited for reads
    land_times: list = field(default_factory=list)   # device seconds of each streamed block's on-land (LoRA fold)
    land_stalls: list = field(default_factory=list)  # on those sampled, the compute's wait for the fold past its copy
    landings: int = 0      # landings that could be sampled
    calls: int = 0         # model calls (forwards of all blocks)
    unplanned: int = 0     # streamed blocks called before their copy was issued (fetched then)
    call_times: list = field(default_factory=list)   # device seconds of each model call
    shrinks: list = field(default_factory=list)      # (from window, to window) after running out of memory
    replans: list = field(default_factory=list)      # ((window, prefetch) from, to) by the first calls' rates
    activation_peak: int = 0   # bytes the first model call allocated beyond the weights (CUDA)
    first_call: FirstCall | None = None   # a load's first call that streamed (first_use.py)
    first_step_s: float = 0.0  # seconds from the prompt's start to the end of its first step (the adapter's clock)

    def add_times(self, t: "Times") -> None:
        self.copy_s += t.copy_s
        self.wait_s += t.wait_s
        self.land_times += t.land_times
        self.call_times += t.call_times
        self.land_stalls += t.land_stalls
        self.landings += t.landings

    def continued(self, fresh: "RunStats", after_oom: bool = True) -> "RunStats":
        """`fresh` (stats of a new plan mid-run: after running out of memory, or a re-plan by
        measured rates) with this run's counters carried over."""
        for name in ("copies", "bytes_copied", "copy_s", "wait_s", "forwards", "bytes_read", "read_wait_s",
                     "calls", "unplanned", "activation_peak", "landings"):
            setattr(fresh, name, getattr(self, name))
        fresh.land_times, fresh.call_times, fresh.land_stalls = self.land_times, self.call_times, self.land_stalls
        fresh.first_call, fresh.first_step_s = self.first_call, self.first_step_s
        fresh.shrinks = self.shrinks + ([(self.window, fresh.window)] if after_oom else [])
        same = (self.window, self.prefetch) == (fresh.window, fresh.prefetch)   # e.g. only the RAM split changed
        fresh.replans = self.replans + ([] if after_oom or same else [((self.window, self.prefetch),
                                                                        (fresh.window, fresh.prefetch))])
        return fresh

    @property
    def land_wait_s(self) -> float:
        """Time the compute stream stood waiting for LoRA folds past their copies: the sampled
        landings' mean wait times the landings that could be sampled."""
        return statistics.fmean(self.land_stalls) * self.landings if self.land_stalls else 0.0

    @property
    def compute_s(self) -> float:
        """Mean device time of a model call, less the time it stood waiting for copies and
        folds. The run's first call (slower: allocator and kernel start-up) is left out where
        there are more, with its mean share of the waits."""
        n = len(self.call_times)
        if not n:
            return 0.0
        calls = self.call_times[1:] if n > 1 else self.call_times
        return max(0.0, (sum(calls) - (self.wait_s + self.land_wait_s) * len(calls) / n) / len(calls))

    @property
    def fold_s_per_block(self) -> float:
        """Median span of a streamed block's on-land work (LoRA fold) on the land stream, from its
        start to its end (it shares the device with the compute it runs beside): the median, as
        the first folds also wait for kernel compiles and the LoRA pairs' first copy."""
        return statistics.median(self.land_times) if self.land_times else 0.0

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.copy_s - self.wait_s)

    @property
    def gbps(self) -> float:
        return self.bytes_copied / self.copy_s / 1e9 if self.copy_s > 0 else 0.0

    def line(self) -> str:
        hidden = 100.0 * self.hidden_s / self.copy_s if self.copy_s > 0 else 100.0
        return (f"RingSwap run: {self.blocks} blocks ({self.resident} resident, {self.streamed} streamed, "
                f"ring {self.ring_slots}), window {self.window}, prefetch {self.prefetch}, {self.memory} memory; "
                f"copied {self.bytes_copied / 1e9:.2f} GB in {self.copies} copies at {self.gbps:.1f} GB/s; "
                f"copy time {self.copy_s * 1e3:.0f} ms, {self.hidden_s * 1e3:.0f} ms hidden under compute "
                f"({hidden:.0f}%), compute waited {self.wait_s * 1e3:.0f} ms"
                + (f"; fold on landing {1e3 * self.fold_s_per_block:.2f} ms per block (on its own stream, beside compute; "
                   f"compute waited ~{self.land_wait_s * 1e3:.0f} ms for folds past their copies)"
                   if self.fold_s_per_block else "")
                + (f"; {self.calls} model calls, {self.compute_s:.2f} s compute each" if self.call_times else "")
                + (f"; {self.unplanned} out-of-order fetches" if self.unplanned else "")
                + (f"; activations peaked at {self.activation_peak / 1e9:.2f} GB" if self.activation_peak else "")
                + "".join(f"; out of memory: window {a} -> {b}" for a, b in self.shrinks)
                + "".join(f"; re-planned by the first calls' rates: window {a[0]} prefetch {a[1]} -> window "
                          f"{b[0]} prefetch {b[1]}" for a, b in self.replans)
                + (f"; read {self.bytes_read / 1e9:.2f} GB from disk, waited {self.read_wait_s * 1e3:.0f} ms "
                   "for reads" if self.memory == "disk" or self.bytes_read else "")
                + self.first_words())

    def first_words(self) -> str:
        """The load's first call and first step, where this run had them."""
        out = ""
        f = self.first_call
        if f is not None:
            rate = f" ({f.read / f.reads_s / 1e9:.1f} GB/s)" if f.reads_s > 0.01 else ""
            ended = f", the last {f.pins_end_s:.2f} s after the attach" if f.pins_end_s else ""
            if f.ahead[1]:
                ended += f" ({f.ahead[0] / 1e9:.2f} of {f.ahead[1] / 1e9:.2f} GB pinned ahead were done by the attach)"
            out += (f"; the first call computed as its blocks arrived: {f.read / 1e9:.2f} GB read from the file in "
                    f"{f.reads_s:.2f} s{rate}, homes page-locked in {f.pin_s:.2f} s{ended}, all in {f.seconds:.2f} s, "
                    f"compute waited {f.read_wait_s:.2f} s for reads and {f.pin_wait_s:.2f} s for page-locking")
        if self.first_step_s:
            out += f"; first step done {self.first_step_s:.2f} s after the prompt started"
        return out
