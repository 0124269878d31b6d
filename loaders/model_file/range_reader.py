"""Parallel positioned reads of byte ranges of one file straight into host (e.g. pinned) buffers:
the bottom of the block read path (block_reads.BlockReads.read_block gives the ranges).

Written ourselves because no library does parallel pread/preadv into caller-owned pinned
memory: one file handle per worker thread, no mmap, no whole-file read, no intermediate copies.

Linux and Windows (docs/design.md): `os.preadv`/`os.pread` where the OS has them; elsewhere
(Windows) each worker's own handle, opened in binary mode, does seek + readinto. Which one
is used is decided in one place, `read_method`; `portable=True` (or the environment
variable RINGSWAP_PORTABLE_READS=1) forces seek + readinto so it is tested on Linux too.
Page-cache advice (posix_fadvise DONTNEED) is given only where the OS has it.
"""
from __future__ import annotations

import ctypes
import io
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

log = logging.getLogger("ringswap.range_reader")

CHUNK_BYTES = 64 * 1024 * 1024
_MAX_SYSCALL = 1 << 30  # Linux and Windows read at most ~2 GiB per call; keep well under
PORTABLE_ENV = "RINGSWAP_PORTABLE_READS"
PREADV, PREAD, SEEK_READINTO = "preadv", "pread", "seek+readinto"
AUTO_WORKERS_MAX = 16   # enough to read from the page cache at the memory's rate (bench/RESULTS.md, fill rates)


def reader_workers(requested: int = 0) -> int:
    """Reader threads for `requested` (0: auto, one per CPU core up to AUTO_WORKERS_MAX, at
    least 4). From the page cache one thread reads 2-5 GB/s and 16 read 10-47 GB/s (fresh or
    reused memory); the node's widget may set a count for a disk that reads slower with many
    parallel streams."""
    if requested > 0:
        return requested
    return max(4, min(AUTO_WORKERS_MAX, os.cpu_count() or 4))


def read_method(portable: bool | None = None) -> str:
    """How a RangeReader reads: "preadv", "pread" or "seek+readinto".

    `portable=None` takes RINGSWAP_PORTABLE_READS from the environment ("1" forces
    seek + readinto); without preadv and pread (Windows) it is seek + readinto anyway.
    """
    if portable is None:
        portable = os.environ.get(PORTABLE_ENV, "0") not in ("", "0")
    if not portable and hasattr(os, "preadv"):
        return PREADV
    if not portable and hasattr(os, "pread"):
        return PREAD
    return SEEK_READINTO


class BlockReadError(OSError):
    """A read of the file failed or came up short; the message names file, offset and length."""


class FileChangedError(BlockReadError):
    """The file was changed, replaced or removed after it was opened: the blocks read from
    it now would not be the model that was loaded."""


def file_identity(path: str) -> tuple[int, int, int]:
    """(inode / file index, size, mtime in ns) of `path`: what a reader checks before each read."""
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


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


class RangeReader:
    """`workers` threads (0: auto, `reader_workers`), each taking one of `workers` file handles for a chunk, so no
    handle is ever used by two threads at once (the seek + readinto path relies on that).
    `portable`: see read_method; `self.method` says what was chosen."""

    def __init__(self, path: str | os.PathLike, workers: int = 0, drop_cache: bool = True,
                 chunk_bytes: int = CHUNK_BYTES, portable: bool | None = None):
        if workers < 0 or chunk_bytes < 1:
            raise ValueError(f"RangeReader: workers ({workers}) must be >= 0 (0: auto) and chunk_bytes "
                             f"({chunk_bytes}) >= 1")
        self.path = os.fspath(path)
        self.workers = workers = reader_workers(workers)
        self.method = read_method(portable)
        self.drop_cache = drop_cache and hasattr(os, "posix_fadvise")
        self.chunk_bytes = chunk_bytes
        self._handles: queue.SimpleQueue[int | io.FileIO] = queue.SimpleQueue()
        self._all_handles: list[int | io.FileIO] = []
        try:
            for _ in range(workers):
                h = self._open()
                self._all_handles.append(h)
                self._handles.put(h)
            self.identity = file_identity(self.path)
        except OSError as e:
            self._close_handles()
            raise BlockReadError(f"{self.path}: cannot open for reading: {e.strerror or e}") from e
        log.debug("RangeReader %s: %d workers, %s reads, page-cache advice %s", self.path, workers,
                  self.method, "on" if self.drop_cache else "off")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="ringswap-read")
        self._lock = threading.Lock()
        self._closed = False
        self._bytes_read = 0
        self._reads = 0
        self._read_seconds = 0.0

    def _open(self) -> int | io.FileIO:
        if self.method == SEEK_READINTO:  # unbuffered binary (and non-inheritable) handle
            return io.FileIO(self.path, "rb")
        return os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))

    def _close_handles(self) -> None:
        handles, self._all_handles = self._all_handles, []
        for h in handles:
            if isinstance(h, int):
                os.close(h)
            else:
                h.close()

    def _read(self, h: int | io.FileIO, view: memoryview, pos: int) -> int:
        """One read call at file offset `pos` into `view`; 0 only at end of file."""
        if self.method == PREADV:
            return os.preadv(h, [view], pos)
        if self.method == PREAD:
            data = os.pread(h, len(view), pos)
            view[:len(data)] = data
            return len(data)
        h.seek(pos)
        return h.readinto(view) or 0

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
        try:
            self.check_unchanged()
        except FileChangedError as e:
            job.future.set_exception(e)
            return job.future
        # Zero-copy writable view of the tensor's memory; `dest` stays referenced by the closure.
        mv = memoryview((ctypes.c_ubyte * size).from_address(dest.data_ptr())).cast("B")
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.path}: RangeReader is closed; cannot read")
            for ch in chunks:
                self._pool.submit(self._run_chunk, job, dest, mv, *ch)
        return job.future

    def check_unchanged(self) -> None:
        """Raise FileChangedError (naming the file and what changed) when the file is not the
        one opened: removed, replaced, or written (size or modification time)."""
        try:
            now = file_identity(self.path)
        except FileNotFoundError:
            raise FileChangedError(f"RingSwap: {self.path} was removed after the model was loaded from it; "
                                   "its blocks are read from the file, so load the model again") from None
        except OSError as e:
            raise FileChangedError(f"RingSwap: {self.path}: cannot check the file: {e.strerror or e}") from e
        if now == self.identity:
            return
        (ino, size, _), (ino0, size0, _) = now, self.identity
        what = ("replaced by another file" if ino != ino0 else
                f"truncated from {size0} to {size} bytes" if size < size0 else
                f"{size0} -> {size} bytes" if size != size0 else "written to (its modification time moved)")
        raise FileChangedError(f"RingSwap: {self.path} changed on disk after the model was loaded from it "
                               f"({what}); its blocks are read from the file, so load the model again "
                               "(a RingSwap Model Loader does so on the next prompt)")

    def _run_chunk(self, job: _Job, dest: torch.Tensor, mv: memoryview, off: int, length: int,
                   c: int, n: int, doff: int) -> None:
        if job.error is not None:  # another chunk of this job failed: skip, don't read
            job.done(0, None)
            return
        h = self._handles.get()
        fd = h if isinstance(h, int) else h.fileno()
        got, calls, err = 0, 0, None
        t0 = time.perf_counter()
        try:
            while got < n:
                pos = off + c + got
                want = min(n - got, _MAX_SYSCALL)
                view = mv[doff + c + got: doff + c + got + want]
                calls += 1
                k = self._read(h, view, pos)
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
            self._handles.put(h)
            with self._lock:
                self._bytes_read += got
                self._reads += calls
                self._read_seconds += time.perf_counter() - t0
            job.done(got, err)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for reads in flight, then close the file handles. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._close_handles()

    def __enter__(self) -> "RangeReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        # Unreferenced means no chunk is queued (each holds a reference): just release the handles.
        if not getattr(self, "_closed", True):
            self._closed = True
            self._pool.shutdown(wait=False)
            self._close_handles()
