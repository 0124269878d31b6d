"""The engine's `home` setting, parsed once into the policy it names.

ram: every block keeps a RAM home (read up front, or captured from the module's tensors).
disk: no block keeps one; streamed blocks are read from the file each time they land.
auto: the streamed blocks a load plan's RAM split names keep one, the others read the file;
resident blocks keep none once placed (or a captured one, taken off the device at an unload).
The engine and the load plan ask the policy; nothing else compares the setting.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .residency import ResidencyPlan

HOMES = ("ram", "disk", "auto")


@dataclass(frozen=True)
class HomePolicy:
    mode: str
    every_block: bool = False    # every block keeps a RAM home for as long as the engine lives
    splits_ram: bool = False     # streamed blocks get RAM homes as the plan's RAM split allows
    from_file: bool = False      # streamed blocks without a RAM home read the file as they land

    @property
    def keeps_none(self) -> bool:
        """No block keeps a RAM home."""
        return not (self.every_block or self.splits_ram)

    def ram_homes(self, num_blocks: int, plan: ResidencyPlan, ram_blocks: Iterable[int] | None) -> frozenset[int]:
        """The blocks that hold a RAM home while `plan` is attached (`ram_blocks`: the split's
        streamed blocks; None: all streamed)."""
        if self.every_block:
            return frozenset(range(num_blocks))
        if not self.splits_ram:
            return frozenset()
        streamed = frozenset(plan.streamed)
        return streamed if ram_blocks is None else streamed & frozenset(ram_blocks)


_POLICIES = {"ram": HomePolicy("ram", every_block=True), "disk": HomePolicy("disk", from_file=True),
             "auto": HomePolicy("auto", splits_ram=True, from_file=True)}


def home_policy(mode: str) -> HomePolicy:
    """The policy `mode` names; a clear error for anything else."""
    policy = _POLICIES.get(mode)
    if policy is None:
        raise ValueError(f"home must be one of {HOMES}, got {mode!r}")
    return policy
