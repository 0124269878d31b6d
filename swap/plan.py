"""Residency plan: which blocks stay on the compute device and which stream.

Pure logic, no torch. The device holds `window + prefetch` blocks. If the whole model
fits in that, every block is resident. Otherwise `window - 1` blocks stay resident for
the whole run and the rest stream through a ring of `prefetch + 1` slots (the block
computing plus `prefetch` copies in flight), so each step copies only the streamed
blocks (DESIGN.md, "Residency"). Streamed blocks are spread evenly through the model
so that every copy has resident compute around it to hide under.
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

    @property
    def max_on_device(self) -> int:
        """Blocks whose weights can be on the compute device at one time."""
        return len(self.resident) + self.ring_slots

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

    def describe(self) -> str:
        if not self.streamed:
            return f"all {self.num_blocks} blocks resident"
        return (f"{len(self.resident)} resident + {len(self.streamed)} streamed through "
                f"{self.ring_slots} slots")
