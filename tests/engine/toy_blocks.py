"""Toy blocks for the engine's tests: a small residual block, a list of them, and a file-like
source that reads packed blocks on worker threads as the loader's RangeReader does."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ringswap.swap.layout import BlockBinding, BlockLayout

N = 7


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.lin = nn.Linear(32, 32)
        self.register_buffer("gain", torch.randn(32))

    def forward(self, x):
        return x + self.lin(self.norm(x)) * self.gain


def make_blocks():
    torch.manual_seed(0)
    return nn.ModuleList([Block() for _ in range(N)])


class FileLike:
    """Blocks packed as bytes, read on worker threads like the loader's RangeReader."""

    def __init__(self, blocks, delay=0.0):
        self.flats = {}
        for i, b in enumerate(blocks):
            layout = BlockLayout.of(b)
            flat = torch.empty(layout.nbytes, dtype=torch.uint8)
            layout.pack(BlockBinding(b, layout).current(), flat)
            self.flats[i] = flat
        self.pool = ThreadPoolExecutor(2)
        self.delay = delay
        self.reads = 0
        self.broken = False
        self.in_flight = self.most_in_flight = 0
        self.lock = threading.Lock()

    def read(self, i, dest):
        def job():
            with self.lock:
                self.in_flight += 1
                self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                time.sleep(self.delay)
            finally:
                with self.lock:
                    self.in_flight -= 1
            if self.broken:
                raise OSError(f"block {i}: file ended early")
            dest.copy_(self.flats[i][:dest.numel()])
            self.reads += 1
            return dest.numel()
        return self.pool.submit(job)


def run(blocks, x):
    with torch.no_grad():
        for b in blocks:
            x = b(x)
    return x


def load_plan(residency, *, ram_blocks=None, compress=False, may_code=False, pin_memory="auto", stream_first=False):
    """A swap.load_plan.LoadPlan that attaches `residency` as given (what a test of the engine
    needs of a plan: no window planning), with these RAM homes, coding and pinning; `stream_first`:
    the first call computes as its blocks arrive from the file (swap/first_use.py)."""
    from ringswap.swap.coding_choice import CodingChoice
    from ringswap.swap.load_plan import LoadPlan, SwapSettings
    from ringswap.swap.ram_split import RamSplit
    from ringswap.swap.window_plan import PlanInputs, WindowPlan
    n = residency.num_blocks
    window = WindowPlan(PlanInputs(block_sizes=(0,) * n, nonblock_bytes=0, free_bytes=0), residency, False)
    ram = None if ram_blocks is None else RamSplit(residency, (0,) * n, frozenset(ram_blocks), 0, "test")
    return LoadPlan(window, ram, CodingChoice(compress, "", may_code), SwapSettings(0, pin_memory=pin_memory),
                    first_read=int(stream_first))


def blocks_on_device(engine) -> list[int]:
    """Blocks whose weights occupy device memory now: resident ones and ring owners."""
    from ringswap.swap.facts import live_view
    view = live_view(engine)
    return [] if view is None else [i for i, c in enumerate(view.places) if c in "GRC"]
