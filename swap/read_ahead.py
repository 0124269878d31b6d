"""Read-ahead staging for blocks whose home is a file (home=disk).

A few host buffers (pinned when possible) that blocks are read into ahead of need by a
reader's worker threads, then copied to their GPU slot. A buffer is reused only after
its copy has landed (event), so host memory for streamed blocks stays at
`count` buffers however long the run. The reads go through the engine's `read_block`, any
callable `read_block(index, dest) -> Future` filling `dest` (uint8) with the block's bytes
(the loader's: loaders/model_file/block_reads.py, BlockReads.read_block).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from .host_pool import HostBuffer

ReadFn = Callable[[int, torch.Tensor], Future]


class _Staging:
    def __init__(self, nbytes: int, pin: bool):
        self.buffer = HostBuffer(nbytes)
        if pin:
            self.buffer.pin()
        self.block: int | None = None
        self.future: Future | None = None
        self.order = 0                # when its read was requested
        self.copied = None            # event: the copy out of this buffer has landed

    def reusable(self) -> bool:
        return self.block is None and (self.copied is None or self.copied.query())


class ReadAhead:
    def __init__(self, read: ReadFn, count: int, nbytes: int, pin: bool):
        self.read = read
        self.staging = [_Staging(nbytes, pin) for _ in range(max(1, count))]
        self.nbytes = nbytes * len(self.staging)
        self._requests = 0

    def pending(self, block: int) -> _Staging | None:
        return next((s for s in self.staging if s.block == block), None)

    def request(self, block: int, nbytes: int, wait: bool = False) -> _Staging | None:
        """Start reading `block` into a free buffer (None if none is free and not `wait`)."""
        s = self.pending(block)
        if s is not None:
            return s
        free = [s for s in self.staging if s.block is None]
        s = next((s for s in free if s.reusable()), None)
        if s is None:
            if not wait:
                return None
            if free:
                s = free[0]
                s.copied.synchronize()
            else:   # every buffer holds a read-ahead: give up the one asked for last
                s = max(self.staging, key=lambda x: x.order)
                s.future.result()
        self._requests += 1
        s.block, s.order = block, self._requests
        s.future = self.read(block, s.buffer.flat[:nbytes])
        return s

    def take(self, block: int, nbytes: int) -> _Staging:
        """The buffer holding `block`, waiting for its read (starting it if needed)."""
        s = self.request(block, nbytes, wait=True)
        if s is None:
            raise RuntimeError("RingSwap: no staging buffer free for a disk read (all are awaiting reads)")
        s.future.result()
        return s

    def release(self, s: _Staging, copied) -> None:
        """`s` may be refilled once `copied` (an event, or None on CPU) has happened."""
        s.block, s.future, s.copied = None, None, copied

    def drain(self) -> None:
        """Wait for reads in flight (before the buffers go away or after an interrupt)."""
        for s in self.staging:
            if s.future is not None:
                try:
                    s.future.result()
                except Exception:
                    pass
            s.block, s.future = None, None

    def release_all(self) -> None:
        self.drain()
        for s in self.staging:
            s.buffer.unpin()
        self.staging = []
