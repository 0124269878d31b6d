"""The block read path: the engine's `read_block(block, dest)` fills a block's buffer from its file.

`BlockReads` maps every tensor of an engine block layout to its file key and byte range,
checks the file against the model ComfyUI built (missing keys, shapes), and reads a block
with the RangeReader's positioned reads (range_reader.py) straight into the destination
buffer. A tensor whose file dtype differs from the dtype ComfyUI chose for the module is
read into a small temporary buffer and cast, exactly as ComfyUI's load_state_dict copy
would. A scalar the file lacks (e.g. scaled-fp8 `scale_input`) keeps the value ComfyUI's
op gave it, as with ComfyUI's non-strict loading; any other missing tensor is an error.
The buffers for casts are memory mappings of their own (swap.host_pool.mapped_bytes), not malloc's.
`mapped` gives a block whose tensors are all the file's bytes as they are a home in the file's own
pages instead (home=auto: nothing read, swap/file_pages.py).
"""
from __future__ import annotations

import logging
import queue
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from torch import nn

from ...swap.file_pages import FilePages, MappedBlock
from ...swap.host_pool import mapped_bytes, whole_pages
from ...swap.layout import BlockBinding, BlockLayout
from .range_reader import RangeReader
from .safetensors_index import SafetensorsIndex

log = logging.getLogger("ringswap.block_reads")


SMALL_CAST = 1 << 20   # cast tensors up to this size are read together with the block
CAST_SHARE = 4         # one buffer for large casts per this many readers
# a mapped home's tensors cast to another size cross into device buffers of their own, outside the
# plan's device bytes: on a GPU a block maps only where those are this small (biases, norms)
RESIZED_MAX = 16 << 20


def _cast_into(dest: torch.Tensor, e, raw: torch.Tensor, info) -> None:
    dest[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(raw.view(info.dtype).view(info.shape))


def _plan_casts(cast: list[tuple]) -> tuple[list[tuple], int, list[tuple]]:
    """A block's tensors to cast, split once: the small ones with their offsets in one
    staging buffer and its size, and the large ones."""
    small, total = [], 0
    for info, e in cast:
        if info.nbytes <= SMALL_CAST:
            small.append((info, e, total))
            total += info.nbytes
    return small, total, [(info, e) for info, e in cast if info.nbytes > SMALL_CAST]


class BlockReads:
    """A model file's blocks as the engine reads them: `read_block` is its ReadFn
    (swap/read_ahead.py); `reader` is the RangeReader beneath it."""

    def __init__(self, index: SafetensorsIndex, reader: RangeReader, blocks: list[nn.Module],
                 block_keys: list[str], file_key: Callable[[str], str] = str, pages: FilePages | None = None):
        """`block_keys[i]` is the key prefix of block i, e.g. "blocks.7."; `file_key` gives the
        file's key of a tensor's key (ComfyUI may rename tensors and strips the file's prefix).
        The blocks must still hold ComfyUI's freshly built (unloaded) tensors. `pages`: the file
        mapped already (its pages maybe page-locking ahead: FilePages.lock_ahead), used by `mapped`."""
        self.index = index
        self.reader = reader
        self.direct: list[list[tuple[int, int, int]]] = []
        self.cast: list[list[tuple]] = []
        self.constants: list[list[tuple]] = []
        self._nbytes: list[int] = []   # each block's bytes in its layout (a mapped home's size)
        for block, key_prefix in zip(blocks, block_keys):
            layout = BlockLayout.of(block)
            initial = BlockBinding(block, layout).current()
            direct, cast, constants = [], [], []
            for e, value in zip(layout.entries, initial):
                key = file_key(key_prefix + (f"{e.path}.{e.key}" if e.path else e.key))
                info = index.tensors.get(key)
                if info is None and value.numel() <= 1 and value.device.type != "meta":
                    constants.append((value.detach().clone(), e))
                    continue
                if info is None:
                    raise ValueError(f"RingSwap: {index.path}: missing tensor '{key}' "
                                     f"(the model expects shape {list(e.shape)}, {e.dtype})")
                if tuple(info.shape) != tuple(e.shape):
                    raise ValueError(f"RingSwap: {index.path}: tensor '{key}' has shape {list(info.shape)}, "
                                     f"the model expects {list(e.shape)}")
                if info.dtype == e.dtype:
                    direct.append((info.start, info.nbytes, e.offset))
                else:
                    cast.append((info, e))
            self.direct.append(direct)
            self.cast.append(cast)
            self.constants.append(constants)
            self._nbytes.append(layout.nbytes)
        self._cast_plan = [_plan_casts(cast) for cast in self.cast]
        # one thread per reader worker: blocks read ahead in parallel also when they hold
        # tensors to cast (a single thread would read such blocks one at a time)
        self._cast_pool = ThreadPoolExecutor(reader.workers, thread_name_prefix="ringswap-cast") \
            if any(self.cast) else None
        # buffers for the large casts, reused: CAST_SHARE of the readers read and cast at once,
        # so host memory for casts stays a few tensors (a lone buffer read at 2 GB/s: issue 53)
        self._cast_bufs: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(max(1, reader.workers // CAST_SHARE)):
            self._cast_bufs.put(mapped_bytes(0))
        self._pages: FilePages | None = pages
        self._mapped: dict[int, MappedBlock] = {}
        self._said = False   # why the blocks cannot be mapped, logged once

    def mapped(self, block: int) -> MappedBlock | None:
        """The block's home in the file's own pages (swap/file_pages.py; a tensor held in another
        dtype is cast as it lands, a scalar the file lacks written beside), or None where the file
        holds nothing of the block or CUDA will not page-lock its pages."""
        if not (self.direct[block] or self.cast[block]):
            return None
        if block in self._mapped:   # the checks below passed for it once; they hold for the file
            return self._mapped[block]
        if self._pages is None:
            self._pages = FilePages(self.index.path, self.reader.check_unchanged)
        resized = sum(info.nbytes for info, e in self.cast[block]
                      if info.dtype.itemsize != e.dtype.itemsize)
        if torch.cuda.is_available() and resized > RESIZED_MAX:   # e.g. an fp32 file: read and cast in RAM
            return None
        if torch.cuda.is_available() and not self._pages.pinnable():
            if not self._said:
                self._said = True
                log.info("RingSwap: %s: CUDA does not page-lock this file's pages here; blocks keep RAM homes "
                         "read from the file", self.index.path)
            return None
        casts = [(info.start, info.nbytes, e.offset, (info.dtype, e.dtype)) for info, e in self.cast[block]]
        values = [(value, e.offset) for value, e in self.constants[block]]
        home = self._mapped[block] = MappedBlock(self._pages, self.direct[block] + casts, self._nbytes[block], values)
        return home

    def keep_ahead(self) -> None:
        """Where the file's pages page-lock ahead (FilePages.lock_ahead): let go of the pages of the
        blocks that will not have a home in them."""
        if self._pages is not None:
            homes = [self.mapped(i) for i in range(len(self.direct))]
            self._pages.keep({whole_pages(h.start, h.end) for h in homes if h is not None})

    def read_block(self, block: int, dest: torch.Tensor) -> Future:
        """Fill `dest` (uint8, the block's layout) from the file; a Future of bytes read."""
        for value, e in self.constants[block]:
            dest[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(value)
        if not self.cast[block]:
            return self.reader.read_into(dest, self.direct[block])
        return self._cast_pool.submit(self._read_with_casts, block, dest)

    def _read_with_casts(self, block: int, dest: torch.Tensor) -> int:
        """The small tensors to cast (biases, norms: up to SMALL_CAST bytes each) are read
        together with the direct ranges, into one staging buffer; the large ones after, each
        through one of a few reused buffers (as many at once across all blocks)."""
        small, small_bytes, large = self._cast_plan[block]
        # mapped, not malloc'd: on a reader thread malloc would take it from that thread's
        # own heap, which keeps what is freed (RSS would grow every load; swap.host_pool.mapped_bytes)
        tmp = mapped_bytes(small_bytes)
        futures = [self.reader.read_into(tmp, [(info.start, info.nbytes, off) for info, _, off in small])]
        if self.direct[block]:
            futures.append(self.reader.read_into(dest, self.direct[block]))
        n, error = 0, None
        for f in futures:   # wait for every read before raising: nothing may write into dest after
            try:
                n += f.result()
            except BaseException as e:   # noqa: BLE001
                error = error or e
        if error is not None:
            raise error
        for info, e, off in small:
            _cast_into(dest, e, tmp[off:off + info.nbytes], info)
        for info, e in large:
            buf = self._cast_bufs.get()   # waits while every buffer is in use
            try:
                if buf.numel() < info.nbytes:
                    buf = mapped_bytes(info.nbytes)
                big = buf[:info.nbytes]
                n += self.reader.read_into(big, [(info.start, info.nbytes, 0)]).result()
                _cast_into(dest, e, big, info)
            finally:
                self._cast_bufs.put(buf)
        return n

    def close(self) -> None:
        if self._cast_pool is not None:
            self._cast_pool.shutdown(wait=True)
        self.reader.close()
        for home in self._mapped.values():
            home.unpin()
        self._mapped = {}
        if self._pages is not None:
            self._pages.close()
