"""The order a model calls its streamed blocks in, learned on a model call, and a cursor.

Most DiTs call their blocks in list order, but some interleave lists (Wan VACE runs one
of its vace_blocks after every few main blocks) or call a block more than once per call
(VACE, once per context). The ring issues copies for the blocks this order says come next.
"""
from __future__ import annotations


class CallOrder:
    def __init__(self, streamed: tuple[int, ...], sequence: tuple[int, ...] | None = None):
        self.streamed = tuple(streamed)
        self.sequence = tuple(sequence) if sequence else self.streamed
        self.pos = len(self.sequence) - 1          # the last call seen (start: before the first)
        self._recording: list[int] | None = None
        self._upcoming: dict[int, list[int]] = {}  # cursor position -> upcoming(), for this sequence

    def start(self, learn: bool) -> None:
        """A model call begins: back to its first block; with `learn`, record what it calls."""
        self.pos = len(self.sequence) - 1
        self._recording = [] if learn else None

    def finish(self) -> tuple[int, ...] | None:
        """A model call ended: the recorded order (blocks it never called appended in list
        order) becomes the order, and is returned; None when nothing was recorded."""
        rec, self._recording = self._recording, None
        if not rec:
            return None
        seen = set(rec)
        self.sequence = tuple(rec) + tuple(b for b in self.streamed if b not in seen)
        self.pos = len(self.sequence) - 1
        self._upcoming = {}
        return self.sequence

    def observe(self, block: int) -> bool:
        """Move the cursor to this call of `block`; True when it is the call the order expected."""
        if self._recording is not None:
            self._recording.append(block)
        seq, n = self.sequence, len(self.sequence)
        for k in range(1, n + 1):
            j = (self.pos + k) % n
            if seq[j] == block:
                self.pos = j
                return k == 1
        return False

    def upcoming(self) -> list[int]:
        """Streamed blocks in the order they are called after the cursor, each once
        (wrapping to the next model call, so the current block comes last unless it is
        called again sooner). Made once per cursor position (the engine asks after every
        block): the list is shared, not to be modified."""
        out = self._upcoming.get(self.pos)
        if out is None:
            seq, cut = self.sequence, self.pos + 1
            out = self._upcoming[self.pos] = list(dict.fromkeys(seq[cut:] + seq[:cut]))
        return out
