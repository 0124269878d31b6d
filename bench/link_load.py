"""A separate process that keeps part of the host-to-GPU link busy: it copies a pinned
1 GiB buffer to the GPU in a loop, so the process under test gets about what a PCIe
4.0-class card gets (about 28 of the H200's 52 GB/s, measured 2026-12-02)."""
from __future__ import annotations

import subprocess
import sys

LOAD = ("import signal, sys, time, torch\n"
        "src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()\n"
        "dst = torch.empty_like(src, device='cuda')\n"
        "dst.copy_(src); torch.cuda.synchronize()\n"
        "stop = []\n"
        "signal.signal(signal.SIGTERM, lambda *a: stop.append(1))\n"
        "print('ready', flush=True)\n"
        "n, t0 = 0, time.perf_counter()\n"
        "while not stop:\n"
        "    dst.copy_(src, non_blocking=True); torch.cuda.synchronize(); n += 1\n"
        "dt = time.perf_counter() - t0\n"
        "print(f'link load took {n * src.numel() / dt / 1e9:.1f} GB/s over {dt:.0f} s', flush=True)\n")


class LinkLoad:
    """`with LinkLoad(on):` the copying process runs while the block runs (nothing when not
    `on`); after the block, `line` says what rate it took."""

    def __init__(self, on: bool):
        self.on, self.proc, self.line = on, None, ""

    def __enter__(self) -> "LinkLoad":
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", LOAD], stdout=subprocess.PIPE, text=True)
            if self.proc.stdout.readline().strip() != "ready":
                self.proc.kill()
                raise RuntimeError(f"the link load did not start (rc {self.proc.wait()})")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                out, _ = self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, _ = self.proc.communicate()
            self.line = (out or "").strip().splitlines()[-1] if (out or "").strip() else ""
            self.proc = None
