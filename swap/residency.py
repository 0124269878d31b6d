"""Residency plan: which blocks stay on the compute device and which stream.

Pure logic, no torch. The device holds `window + prefetch` blocks. If the whole model
fits in that, every block is resident. Otherwise `window - 1` blocks stay resident for
the whole run and the rest stream through a ring of `prefetch + 1` slots (the block
computing plus `prefetch` copies in flight), so each step copies only the streamed
blocks (docs/design.md). Streamed blocks are spread evenly through the model
so that every copy has resident compute around it to hide under. A plan changed mid-run
(`reshaped`) keeps as many of the blocks already resident as it can, so only the
difference moves.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ResidencyPlan:
    num_blocks: int
    window: int
    prefetch: int
    resident: tuple[int, ...]
    streamed: tuple[int, ...]

    @property
    def ring_slots(self) -> int:
        """GPU slots of the ring (0 when every block is resident)."""
        return self.prefetch + 1 if self.streamed else 0

    @classmethod
    def make(cls, num_blocks: int, window: int, prefetch: int) -> "ResidencyPlan":
        if num_blocks < 1:
            raise ValueError(f"the model has no transformer blocks (num_blocks={num_blocks})")
        if window < 1:
            raise ValueError(f"window must be at least 1 block, got {window}")
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 or more, got {prefetch}")
        if window + prefetch >= num_blocks:
            return cls(num_blocks, window, prefetch, tuple(range(num_blocks)), ())
        n_streamed = num_blocks - (window - 1)
        streamed = tuple(sorted({(i * num_blocks) // n_streamed for i in range(n_streamed)}))
        resident = tuple(i for i in range(num_blocks) if i not in set(streamed))
        return cls(num_blocks, window, prefetch, resident, streamed)

    def reshaped(self, window: int, prefetch: int) -> "ResidencyPlan":
        """The plan for `window`/`prefetch` nearest this one: the same number of resident
        blocks as `make` gives, but taken from this plan's resident blocks when shrinking
        (dropping the one that joins the shortest runs of streamed blocks) and adding to
        them when growing (in the middle of the longest run), so a re-plan moves only
        the difference. Runs wrap around: the ring prefetches into the next call."""
        even = ResidencyPlan.make(self.num_blocks, window, prefetch)
        if not even.streamed or not self.streamed:
            return even
        n, resident = self.num_blocks, sorted(self.resident)
        while len(resident) > len(even.resident):   # drop the block whose neighbouring gaps are shortest
            gap = _gaps(n, resident)
            resident.pop(min(range(len(resident)), key=lambda k: gap[k - 1] + gap[k]))
        while len(resident) < len(even.resident):   # fill the middle of the longest gap
            if not resident:
                resident = [n // 2]
                continue
            gap = _gaps(n, resident)
            k = max(range(len(gap)), key=gap.__getitem__)
            resident = sorted(resident + [(resident[k] + 1 + gap[k] // 2) % n])
        return ResidencyPlan(n, window, prefetch, tuple(resident),
                             tuple(i for i in range(n) if i not in resident))

    def describe(self) -> str:
        if not self.streamed:
            return f"all {self.num_blocks} blocks resident"
        return (f"{len(self.resident)} resident + {len(self.streamed)} streamed through "
                f"{self.ring_slots} slots")



def _gaps(n: int, resident: list[int]) -> list[int]:
    """Streamed blocks after each (sorted) resident block up to the next, wrapping."""
    return [(nxt - r - 1) % n for r, nxt in zip(resident, resident[1:] + [resident[0] + n])]
