"""Placing an attachment's resident blocks on the device: each from its RAM home (pinned: on
the copy stream; pageable: through pinned chunks, swap/staged_copy.py) or else read back from
the file, the next blocks' reads running ahead in the free staging buffers."""
from __future__ import annotations

from typing import Callable

from .coding import Coding
from .host_pool import HostPool, empty_bytes
from .staged_copy import PinnedChunks
from .state import Attachment, BlockState


def place_all(states: list[BlockState], pool: HostPool, att: Attachment, placing: list[int], read_back: int,
              report: Callable[[int, int], None] | None, coding: Coding | None = None) -> int:
    """Place the `placing` blocks (before page-locking changes: a block streamed until now
    copies from its pinned home; a coded one is decoded by `coding`); returns `read_back` plus
    the bytes read from the file."""
    from_file = [i for i in placing if not pool.has(i)]   # read back, in placing order
    if coding is not None:
        coding.make_scratch(pool, placing)
    with PinnedChunks(pin=att.pin_memory != "off") as chunks:
        for i in placing:
            for j in from_file:   # the disk reads on: next blocks into the free staging buffers
                if att.readahead.request(j, states[j].layout.nbytes) is None:
                    break
            read_back += place(pool, att, states[i], chunks, coding)
            if from_file and from_file[0] == i:
                from_file.pop(0)
            if report is not None:
                report(read_back, 0)
    att.copier.synchronize()
    return read_back


def place(pool: HostPool, att: Attachment, s: BlockState, chunks: PinnedChunks, coding: Coding | None = None) -> int:
    """Copy a resident block to its device buffer, from its home (a pageable one through
    `chunks`, a coded one decoded) or else the file; returns the bytes read from the file."""
    s.device_buffer = empty_bytes(s.layout.nbytes, att.device)
    read = 0
    home_buf, coded = pool.blocks.get(s.index), pool.coded.get(s.index)
    if coded is not None:
        coding.land(att.copier, coded, s.device_buffer, None)
    elif home_buf is not None and home_buf.pinned:
        att.copier.copy(s.device_buffer, home_buf.flat, None)
    elif home_buf is not None:
        chunks.upload(home_buf.flat, s.device_buffer)
    else:
        staged = att.readahead.take(s.index, s.layout.nbytes)
        att.readahead.release(staged, att.copier.copy(s.device_buffer, staged.buffer.flat[:s.layout.nbytes], None))
        read = s.layout.nbytes
    s.binding.bind(s.layout.views(s.device_buffer))
    return read
