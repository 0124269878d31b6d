"""Copies between the GPU and pageable host memory through two pinned staging chunks.

CUDA copies to or from pageable memory through a driver buffer on one thread, well below the
link's rate (fresh pages also fault in on that thread, so a device-to-host copy into new homes
is slower still; bench/RESULTS.md). Here the DMA of one 64 MiB chunk overlaps the host copy of the
other, which torch runs on its threads. Used when a model taken off the GPU keeps its
resident blocks (download) and when those are placed again (upload). Where the tensor is
not on CUDA, pinning is off or fails, it is a plain copy_.
"""
from __future__ import annotations

import torch

from .host_pool import HostBuffer

CHUNK = 64 << 20


class PinnedChunks:
    """Within `with`: `download(device, host)` and `upload(host, device)`; leaving it waits for
    the last copies and unpins the chunks."""

    def __init__(self, pin: bool = True):
        self.pin = pin
        self.chunks: list[HostBuffer] = []
        self.free: list = []          # per chunk: the event after which it may be refilled (upload)
        self.stream = None
        self._usable: bool | None = None

    def __enter__(self) -> "PinnedChunks":
        return self

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        for c in self.chunks:
            c.unpin()
        self.chunks, self.free = [], []

    def _staging(self, device: torch.device) -> bool:
        if self._usable is None:
            self.chunks = [HostBuffer(CHUNK) for _ in range(2)]
            self.free = [None] * len(self.chunks)
            self._usable = self.pin and all(c.pin() for c in self.chunks)
            if self._usable:
                self.stream = torch.cuda.Stream(device)
        return self._usable

    def download(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy a CUDA tensor into host memory; returns with `dest` filled."""
        if src.device.type != "cuda" or not self._staging(src.device):
            dest.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        inflight: list[tuple[HostBuffer, int, int, torch.cuda.Event]] = []

        def finish() -> None:
            chunk, off, m, landed = inflight.pop(0)
            landed.synchronize()
            dest[off:off + m].copy_(chunk.flat[:m])
        for k, off in enumerate(range(0, src.numel(), CHUNK)):
            if len(inflight) == len(self.chunks):
                finish()
            chunk, m = self.chunks[k % len(self.chunks)], min(CHUNK, src.numel() - off)
            with torch.cuda.stream(self.stream):
                chunk.flat[:m].copy_(src[off:off + m], non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(self.stream)
            inflight.append((chunk, off, m, landed))
        while inflight:
            finish()

    def upload(self, src: torch.Tensor, dest: torch.Tensor) -> None:
        """Copy host memory into a CUDA tensor; the last chunks may still be in flight until
        `synchronize` or leaving the `with`."""
        if dest.device.type != "cuda" or not self._staging(dest.device):
            dest.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(dest.device))   # dest was just allocated there
        for k, off in enumerate(range(0, src.numel(), CHUNK)):
            j = k % len(self.chunks)
            chunk, m = self.chunks[j], min(CHUNK, src.numel() - off)
            if self.free[j] is not None:
                self.free[j].synchronize()   # its last DMA has read it
            chunk.flat[:m].copy_(src[off:off + m])
            with torch.cuda.stream(self.stream):
                dest[off:off + m].copy_(chunk.flat[:m], non_blocking=True)
                self.free[j] = torch.cuda.Event()
                self.free[j].record(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
