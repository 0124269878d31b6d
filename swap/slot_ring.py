"""The ring of device slots that streamed blocks pass through.

A fixed table of slots; each is owned by at most one block at a time, and the table
says which, so no block ever runs with another block's weights. A slot is refilled only
after the compute stream has passed the
`free` event recorded when its previous owner finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .dense_arena import DenseArena
from .host_pool import HostBuffer, empty_bytes
from .layout import BlockLayout


@dataclass
class Slot:
    index: int
    flat: torch.Tensor                    # device bytes
    staging: HostBuffer | None = None     # host bytes the copy goes through (staged mode)
    owner: int | None = None              # block whose weights are (being) copied here
    ready: object = None                  # event: the owner's copy has landed
    free: object = None                   # event: the previous owner's compute is done
    reading: bool = False                 # the owner comes from the file and is not copied yet
    landed: bool = False                  # on_land has run for the current owner
    pending: object = None                # casts left to do on landing (a home in the file's pages)
    replaced: dict | None = None          # what on_land had the current owner bind instead (attr -> tensor)
    dense: DenseArena | None = None       # where on_land cuts those from (its dense weights)
    _views: dict = field(default_factory=dict)
    _joined: dict = field(default_factory=dict)

    def views(self, layout: BlockLayout) -> list[torch.Tensor]:
        v = self._views.get(layout)
        if v is None:
            v = self._views[layout] = layout.views(self.flat)
        return v

    def joined(self, layout: BlockLayout) -> list:
        """What a block of `layout` landed here binds (BlockLayout.joined over this slot's views),
        its packed tensors kept from the last block where their codec allows."""
        v = self._joined.get(layout)
        if v is None or layout.rejoins:
            v = self._joined[layout] = layout.joined(self.views(layout), v)
        return v


class SlotRing:
    def __init__(self, count: int, nbytes: int, device: torch.device, staging: bool = False,
                 pin_staging: bool = False, dense_bytes: int = 0):
        self.slots = [Slot(i, empty_bytes(nbytes, device)) for i in range(count)]
        for s in self.slots if dense_bytes > 0 else ():
            s.dense = DenseArena(dense_bytes, device)
        if staging:
            self.add_staging(pin_staging)

    def add_staging(self, pin: bool) -> None:
        """Give every slot a staging buffer (copies from pageable homes go through it)."""
        for s in self.slots:
            if s.staging is None:
                s.staging = HostBuffer(s.flat.numel())
                if pin:
                    s.staging.pin()

    def slot_of(self, block: int) -> Slot | None:
        return next((s for s in self.slots if s.owner == block), None)

    def owners(self) -> list[int]:
        return [s.owner for s in self.slots if s.owner is not None]

    def victim(self, keep: list[int]) -> Slot:
        """A slot to refill: empty first, else the one whose owner is needed last
        (owners in `keep` are ordered by when they are needed next)."""
        for s in self.slots:
            if s.owner is None:
                return s
        rank = {b: i for i, b in enumerate(keep)}
        return max(self.slots, key=lambda s: rank.get(s.owner, len(rank)))

    def release(self) -> None:
        for s in self.slots:
            if s.staging is not None:
                s.staging.unpin()
        self.slots = []
