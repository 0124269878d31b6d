"""Which streamed blocks live in RAM and which are read from the file (home=auto).

Pure arithmetic like the planner: streamed blocks are read every step, so they get RAM
first; resident blocks need none once placed. When RAM is short, the blocks left in the
file are spread evenly over the call order, so each file read has the compute of the RAM
blocks between it and the next to hide under.
"""
from __future__ import annotations

from dataclasses import dataclass

from .residency import ResidencyPlan

GB = 1e9
MARGIN_SHARE = 0.10   # of the RAM to share, for the OS, ComfyUI's other work and the page cache's core
MARGIN_MIN = 2 * GB


def home_ram(budget_gb: float, available: int, held: int, kept_by_comfy: int) -> tuple[int, str]:
    """(bytes the model's block homes may use, why): the budget when set; else the RAM available
    now plus the homes the model already holds, less a margin (MARGIN_SHARE of those two, at least
    MARGIN_MIN) and less what ComfyUI keeps for itself. The margin follows the RAM there is to
    share, not the machine's size, so a RAM ballast emulates a smaller machine."""
    if budget_gb > 0:
        return int(budget_gb * GB), f"ram_budget_gb {budget_gb:g}"
    margin = max(MARGIN_MIN, MARGIN_SHARE * (available + held))
    why = (f"{available / GB:.1f} GB available + {held / GB:.1f} GB of its homes - {margin / GB:.1f} GB margin"
           + (f" - {kept_by_comfy / GB:.1f} GB ComfyUI keeps" if kept_by_comfy else ""))
    return max(0, int(available + held - margin - kept_by_comfy)), why


@dataclass(frozen=True)
class RamSplit:
    plan: ResidencyPlan
    block_sizes: tuple[int, ...]
    ram_blocks: frozenset[int]       # streamed blocks held in RAM
    ram_bytes: int                  # RAM counted on for block homes
    ram_why: str                    # where ram_bytes comes from
    staging_bytes: int = 0           # read-ahead buffers the file's blocks need
    device_sizes: tuple[int, ...] = ()   # each block's bytes on the device, where they differ from its home's (coded)

    @property
    def file_blocks(self) -> tuple[int, ...]:
        return tuple(i for i in self.plan.streamed if i not in self.ram_blocks)

    def bytes_of(self, blocks) -> int:
        return sum(self.block_sizes[i] for i in blocks)

    def line(self) -> str:
        p = self.plan
        on_device = sum((self.device_sizes or self.block_sizes)[i] for i in p.resident)
        parts = [f"{len(p.resident)} blocks ({on_device / GB:.1f} GB) on the GPU",
                 f"{len(self.ram_blocks)} ({self.bytes_of(self.ram_blocks) / GB:.1f} GB) in RAM"]
        if self.file_blocks:
            parts.append(f"{len(self.file_blocks)} ({self.bytes_of(self.file_blocks) / GB:.1f} GB) read from "
                         f"the file each step")
        return f"home auto: {', '.join(parts)}; RAM counted on {self.ram_bytes / GB:.1f} GB ({self.ram_why})"


def split_ram(plan: ResidencyPlan, block_sizes: tuple[int, ...], ram_bytes: int, ram_why: str,
              staging_blocks: int, device_sizes: tuple[int, ...] = ()) -> RamSplit:
    """Give as many streamed blocks RAM homes as `ram_bytes` holds; the file's blocks also
    need `staging_blocks` read-ahead buffers of the largest block, counted against that RAM.
    `block_sizes`: bytes in RAM; `device_sizes`: on the device, where they differ (for the line)."""
    streamed = list(plan.streamed)
    need = sum(block_sizes[i] for i in streamed)
    if need <= ram_bytes:
        return RamSplit(plan, block_sizes, frozenset(streamed), ram_bytes, ram_why, device_sizes=device_sizes)
    staging = staging_blocks * max((block_sizes[i] for i in streamed), default=0)
    left, fit = ram_bytes - staging, 0
    for size in sorted(block_sizes[i] for i in streamed):
        if size > left:
            break
        left -= size
        fit += 1
    ram = _spread(streamed, fit)
    while ram and sum(block_sizes[i] for i in ram) > ram_bytes - staging:   # unequal blocks
        ram.remove(max(ram, key=lambda i: block_sizes[i]))
    return RamSplit(plan, block_sizes, frozenset(ram), ram_bytes, ram_why, staging, device_sizes)


def _spread(streamed: list[int], count: int) -> list[int]:
    """`count` of `streamed` (in call order), the others spaced evenly between them."""
    n = len(streamed)
    if count <= 0:
        return []
    if count >= n:
        return list(streamed)
    file_count = n - count
    in_file = {int((k + 0.5) * n / file_count) for k in range(file_count)}
    return [b for j, b in enumerate(streamed) if j not in in_file]
