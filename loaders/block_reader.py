"""Parallel positioned reads of byte ranges of one file straight into host (e.g. pinned) buffers.

Written ourselves because no library does parallel pread/preadv into caller-owned pinned
memory: one fd per worker thread, no mmap, no whole-file read, no intermediate copies.
"""
from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

CHUNK_BYTES = 64 * 1024 * 1024
_MAX_SYSCALL = 1 << 30  # Linux reads at most ~2 GiB per call; keep each call well under


class BlockReadError(OSError):
    """A read of the file failed or came up short; the message names file, offset and length."""


class _Job:
    """One read_into call: counts its chunks down and resolves its future once, at the end."""

    def __init__(self, n: int):
        self.future: Future = Future()
        self.left = n
        self.total = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def done(self, nbytes: int, error: BaseException | None) -> None:
        with self.lock:
            self.total += nbytes
            if error is not None and self.error is None:
                self.error = error
            self.left -= 1
            if self.left:
                return
        # Only after every chunk has stopped touching the buffer does the future resolve.
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.total)


class BlockReader:
    def __init__(self, path: str, workers: int = 4, drop_cache: bool = True,
                 chunk_bytes: int = CHUNK_BYTES):
        if workers < 1 or chunk_bytes < 1:
            raise ValueError(f"BlockReader: workers ({workers}) and chunk_bytes ({chunk_bytes}) must be >= 1")
        self.path = os.fspath(path)
        self.workers = workers
        self.drop_cache = drop_cache and hasattr(os, "posix_fadvise")
        self.chunk_bytes = chunk_bytes
        self._fds: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._all_fds: list[int] = []
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
        try:
            for _ in range(workers):
                fd = os.open(self.path, flags)
                self._all_fds.append(fd)
                self._fds.put(fd)
        except OSError as e:
            for fd in self._all_fds:
                os.close(fd)
            raise BlockReadError(f"{self.path}: cannot open for reading: {e.strerror or e}") from e
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ringswap-read")
        self._lock = threading.Lock()
        self._closed = False
        self._bytes_read = 0
        self._reads = 0
        self._read_seconds = 0.0

    # -- counters ---------------------------------------------------------------------------
    @property
    def bytes_read(self) -> int:
        with self._lock:
            return self._bytes_read

    @property
    def reads(self) -> int:
        with self._lock:
            return self._reads

    @property
    def read_seconds(self) -> float:
        with self._lock:
            return self._read_seconds

    # -- reading ----------------------------------------------------------------------------
    def read_into(self, dest: torch.Tensor, ranges: list[tuple[int, int, int]]) -> Future:
        """Read each (file_offset, length, dest_offset) into `dest` (contiguous CPU uint8).

        The future resolves to the bytes read once every chunk has finished (so nothing
        writes into `dest` afterwards), or raises the first BlockReadError.
        """
        if dest.device.type != "cpu" or dest.dtype != torch.uint8 or not dest.is_contiguous():
            raise ValueError(f"{self.path}: read_into needs a contiguous CPU uint8 tensor, got "
                             f"{dest.dtype} on {dest.device} (contiguous={dest.is_contiguous()})")
        size = dest.numel()
        chunks = []
        for off, length, doff in ranges:
            if off < 0 or length < 0 or doff < 0 or doff + length > size:
                raise ValueError(f"{self.path}: range (offset {off}, length {length}, dest offset "
                                 f"{doff}) does not fit a destination of {size} bytes")
            for c in range(0, length, self.chunk_bytes):
                chunks.append((off, length, c, min(self.chunk_bytes, length - c), doff))
        job = _Job(len(chunks))
        if not chunks:
            job.future.set_result(0)
            return job.future
        # Zero-copy writable view of the tensor's memory; `dest` stays referenced by the closure.
        mv = memoryview((ctypes.c_ubyte * size).from_address(dest.data_ptr())).cast("B")
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: BlockReader is closed; cannot read")
            for ch in chunks:
                self._pool.submit(self._run_chunk, job, dest, mv, *ch)
        return job.future

    def _run_chunk(self, job: _Job, dest: torch.Tensor, mv: memoryview, off: int, length: int,
                   c: int, n: int, doff: int) -> None:
        if job.error is not None:  # another chunk of this job failed: skip, don't read
            job.done(0, None)
            return
        fd = self._fds.get()
        got, calls, err = 0, 0, None
        t0 = time.perf_counter()
        try:
            while got < n:
                pos = off + c + got
                want = min(n - got, _MAX_SYSCALL)
                view = mv[doff + c + got: doff + c + got + want]
                calls += 1
                if hasattr(os, "preadv"):
                    k = os.preadv(fd, [view], pos)
                else:
                    data = os.pread(fd, want, pos)
                    k = len(data)
                    view[:k] = data
                if k == 0:  # end of file; parallel chunks fail in any order, so ask its size
                    have = max(0, min(length, os.fstat(fd).st_size - off))
                    err = BlockReadError(
                        f"{self.path}: reading {length} bytes at offset {off}: file ended after "
                        f"{have} of {length} bytes — was it truncated or replaced after loading?")
                    break
                got += k
            if self.drop_cache and got:
                try:
                    os.posix_fadvise(fd, off + c, got, os.POSIX_FADV_DONTNEED)
                except OSError:
                    pass
        except OSError as e:
            err = BlockReadError(f"{self.path}: reading {length} bytes at offset {off} failed at "
                                 f"offset {off + c + got}: {e.strerror or e}")
            err.errno = e.errno
            err.__cause__ = e
        except BaseException as e:  # never leave the job's future pending
            err = e
        finally:
            self._fds.put(fd)
            with self._lock:
                self._bytes_read += got
                self._reads += calls
                self._read_seconds += time.perf_counter() - t0
            job.done(got, err)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for reads in flight, then close the fds. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        for fd in self._all_fds:
            os.close(fd)
        self._all_fds = []

    def __enter__(self) -> "BlockReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Unreferenced means no chunk is queued (each holds a reference): just release the fds.
        if not getattr(self, "_closed", True):
            self._closed = True
            self._pool.shutdown(wait=False)
            for fd in self._all_fds:
                os.close(fd)
