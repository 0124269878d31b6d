"""Resident blocks folded before each call: a block whose on-land work makes dense weights to
bind (a GGUF LoRA fold) keeps its packed weights on the device and holds the dense ones, made
on the land stream just before it computes, only while it computes. A resident block then costs
its packed bytes, not packed plus dense, so as many stay resident as without the fold."""
from __future__ import annotations

import torch

from .hooks import BlockHooks
from .state import BlockState, OnLand, ResidentWork
from .transfer import CopyStream


class ResidentFolds:
    """The per-call folds of the resident blocks in `blocks` (hooks around their forward)."""

    def __init__(self, states: list[BlockState], blocks: list[int], each_call: OnLand, copier: CopyStream):
        self.states, self.each_call, self.copier = states, each_call, copier
        self.packed: dict[int, dict[int, torch.Tensor]] = {}   # block -> what its dense weights replace
        self.hooks = BlockHooks([s.block for s in states], blocks, self.before, self.after)

    def before(self, block: int) -> None:
        binding = self.states[block].binding
        dense = self.copier.landed(self.each_call, block, binding.current(), sample=False)
        if dense:
            self.packed[block] = binding.bind_some(binding.bindable(dense))

    def after(self, block: int) -> None:
        packed = self.packed.pop(block, None)
        if packed:
            self.states[block].binding.bind_some(packed)

    def remove(self) -> None:
        self.hooks.remove()
        for block in list(self.packed):
            self.after(block)


def fold_resident(states: list[BlockState], placing: list[int], resident: tuple[int, ...], on_land: OnLand,
                  work: ResidentWork | None, copier: CopyStream) -> ResidentFolds | None:
    """Fold the blocks just placed, once (`work.placed` for `work`'s blocks, else `on_land`, its
    replacements bound for good), and hook the resident blocks of `work` for their per-call folds."""
    for i in placing:
        binding = states[i].binding
        fold = work.placed if work is not None and i in work.blocks else on_land
        binding.bind_some(binding.bindable(fold(i, binding.current()) or {}))
    per_call = [i for i in resident if work is not None and i in work.blocks]
    return ResidentFolds(states, per_call, work.each_call, copier) if per_call else None
