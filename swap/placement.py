"""Placing an attachment's resident blocks on the device: each block's home copies it in (a RAM
home pinned or through pinned chunks, swap/staged_copy.py; a coded one decoded; the file read
back), the next blocks' file reads running ahead in the free staging buffers."""
from __future__ import annotations

from typing import Callable

import torch

from .coding import Coding
from .homes import home_of
from .host_pool import HostPool, empty_bytes
from .staged_copy import PinnedChunks
from .state import Attachment, BlockState


def place_all(states: list[BlockState], pool: HostPool, att: Attachment, placing: list[int], read_back: int,
              report: Callable[[int, int], None] | None, coding: Coding | None = None) -> int:
    """Place the `placing` blocks (before page-locking changes: a block streamed until now
    copies from its pinned home; a coded one is decoded by `coding`); returns `read_back` plus
    the bytes read from the file."""
    homes = [home_of(states, pool, i, coding) for i in placing]
    if coding is not None:
        coding.make_scratch(pool, placing)
    with PinnedChunks(pin=att.pin_memory != "off") as chunks:
        for k, placed in enumerate(homes):
            for later in homes[k:]:   # the file reads on: this and the next blocks into free staging buffers
                if not later.read_ahead(att):
                    break
            read_back += placed.place(att, chunks)
            if report is not None:
                report(read_back, 0)
    att.copier.synchronize()
    return read_back


def reserve(states: list[BlockState], blocks: list[int], device: torch.device) -> None:
    """Device buffers for resident `blocks` placed later (swap/first_use.py), allocated now so the
    load's device memory is what the plan says from the start; each is bound once its bytes land
    (a packed tensor may read its parts when joined)."""
    for i in blocks:
        s = states[i]
        s.device_buffer = empty_bytes(s.layout.nbytes, device)
