"""Resident blocks folded before each call: a block whose on-land work makes dense weights to
bind (a GGUF LoRA fold) keeps its packed weights on the device and holds the dense ones, made
on the land stream just before it computes, only while it computes. A resident block then costs
its packed bytes, not packed plus dense, so as many stay resident as without the fold. The
dense weights are cut from two arenas in turn (the block computing and the next, folded ahead)."""
from __future__ import annotations

from functools import partial

import torch

from .dense_arena import DenseArena
from .hooks import BlockHooks
from .state import BlockState, OnLand, ResidentWork, dense_bytes
from .transfer import CopyStream


class ResidentFolds:
    """The per-call folds of the resident blocks in `blocks` (hooks around their forward)."""

    def __init__(self, states: list[BlockState], blocks: list[int], each_call: OnLand, copier: CopyStream,
                 device: torch.device, nbytes: int = 0):
        self.states, self.each_call, self.copier = states, each_call, copier
        self.arenas = [DenseArena(nbytes, device) for _ in range(2)] if nbytes else []
        self.freed: list = [None, None]   # per arena: the event after the compute that last read it (CUDA)
        self.turn = 0
        self.packed: dict[int, dict[int, torch.Tensor]] = {}   # block -> what its dense weights replace
        self.cut_from: dict[int, int] = {}                      # block -> the arena its dense weights use
        self.hooks = BlockHooks([s.block for s in states], blocks, self.before, self.after)

    def before(self, block: int) -> None:
        binding = self.states[block].binding
        fold, ready = self.each_call, None
        if self.arenas:   # the arena's last reader has computed before the fold writes it
            k = self.cut_from[block] = self.turn % 2
            self.turn += 1
            fold, ready = partial(self.each_call, out=self.arenas[k].restart()), self.freed[k]
        dense = self.copier.landed(fold, block, binding.current(), ready=ready, sample=False)
        if dense:
            self.packed[block] = binding.bind_some(binding.bindable(dense))

    def after(self, block: int) -> None:
        k = self.cut_from.pop(block, None)
        if k is not None:
            self.freed[k] = self.copier.mark_compute()
        packed = self.packed.pop(block, None)
        if packed:
            self.states[block].binding.bind_some(packed)

    def remove(self) -> None:
        self.hooks.remove()
        for block in set(self.packed) | set(self.cut_from):
            self.after(block)
        self.arenas = []


def fold_once(s: BlockState, on_land: OnLand, work: ResidentWork | None) -> None:
    """Fold resident block `s` once, as placed (`work.placed` for `work`'s blocks, else `on_land`),
    its replacements bound for good."""
    fold = work.placed if work is not None and s.index in work.blocks else on_land
    s.binding.bind_some(s.binding.bindable(fold(s.index, s.binding.current()) or {}))


def fold_resident(states: list[BlockState], placing: list[int], resident: tuple[int, ...], on_land: OnLand,
                  work: ResidentWork | None, copier: CopyStream, device: torch.device) -> ResidentFolds | None:
    """Fold the blocks just placed, once (`work.placed` for `work`'s blocks, else `on_land`, its
    replacements bound for good), and hook the resident blocks of `work` for their per-call folds,
    given `out=` arenas where `on_land` has a `dense_bytes` method (swap/state.py)."""
    for i in placing:
        fold_once(states[i], on_land, work)
    per_call = [i for i in resident if work is not None and i in work.blocks]
    if not per_call:
        return None
    return ResidentFolds(states, per_call, work.each_call, copier, device, dense_bytes(on_land, per_call))
