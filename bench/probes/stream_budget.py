"""stream.py's up-front time estimate: how long each part of a run will take, from H200
reference rates (shared/FACTS.md) that measured rates replace as they come in, so parts
that would not fit the --budget-s are left out before they start."""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
from common import T0, gb  # noqa: E402

# H200 reference rates, GB/s
REF = {"write_gbps": 1.0, "disk_gbps": 1.0, "cold_gbps": 1.4, "pin_gbps": 1.4, "link_gbps": 51.7,
       "gen_gbps": 3.0}
# Wan-14B block forward (bf16, H200): 4.1 ms @ 4,096 tokens, 68.6 @ 32,760, 279 @ 75,600.
_REF_BLOCK_MS = ((4096, 4.1), (32760, 68.6), (75600, 279.0))


class Budget:
    """Seconds each part of a stream.py run is expected to take, and what is left."""

    def __init__(self, a, layers: int):
        self.a = a
        self.rates = dict(REF)
        self.layers = layers
        # per-block compute (s) = c1 * t + c2 * t^2, least squares on the H200 points
        sxx = sum(t ** 2 for t, _ in _REF_BLOCK_MS)
        sx3 = sum(t ** 3 for t, _ in _REF_BLOCK_MS)
        sx4 = sum(t ** 4 for t, _ in _REF_BLOCK_MS)
        sxy = sum(t * ms / 1e3 for t, ms in _REF_BLOCK_MS)
        sx2y = sum(t * t * ms / 1e3 for t, ms in _REF_BLOCK_MS)
        det = sxx * sx4 - sx3 * sx3
        self.c1 = (sxy * sx4 - sx3 * sx2y) / det
        self.c2 = (sxx * sx2y - sx3 * sxy) / det
        self.scale = (a.dim / 5120) ** 2   # rough, for other shapes

    def deadline_left(self) -> float:
        return self.a.budget_s - (time.perf_counter() - T0)

    def step_compute(self, tokens: int) -> float:
        return self.layers * self.scale * (self.c1 * tokens + self.c2 * tokens * tokens)

    def write(self, total: int) -> float:
        return gb(total) / self.rates["write_gbps"] + gb(total) / self.rates["gen_gbps"] * 0.2

    def odirect(self, total: int) -> float:
        n = min(total, int(self.a.odirect_gb * 1e9)) if self.a.odirect_gb > 0 else total
        return gb(n) / self.rates["disk_gbps"]

    def ram_load(self, total: int, streamed: int) -> float:
        return gb(total) / self.rates["cold_gbps"] + gb(streamed) / self.rates["pin_gbps"] + 2.0

    def ram_tokens(self, tokens: int, streamed: int) -> float:
        per = max(self.step_compute(tokens), gb(streamed) / self.rates["link_gbps"])
        return (self.a.warmup + self.a.steps) * per + 0.5

    def disk_load(self, resident: int, block: int) -> float:
        return (gb(resident * block) / self.rates["disk_gbps"]
                + gb(self.a.workers * block) / self.rates["pin_gbps"] + 2.0)

    def disk_tokens(self, tokens: int, streamed: int) -> float:
        per = max(self.step_compute(tokens), gb(streamed) / (0.9 * self.rates["disk_gbps"]))
        return (self.a.disk_warmup + self.a.disk_steps) * per + 1.0
