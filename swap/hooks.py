"""Per-block forward hooks: the mechanism, separate from the swapping policy.

Generic torch module hooks on each block of a block list; the model's own forward is
untouched, so any DiT with a ModuleList of blocks works. The hook functions are opaque
to torch.compile (they move weights, not tensors of the graph).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


class BlockHooks:
    def __init__(self, blocks: list[nn.Module], indices: list[int],
                 before: Callable[[int], None], after: Callable[[int], None]):
        self._handles = []
        for i in indices:
            pre = torch.compiler.disable(lambda module, args, kwargs, i=i: before(i))
            post = torch.compiler.disable(lambda module, args, kwargs, output, i=i: after(i))
            self._handles.append(blocks[i].register_forward_pre_hook(pre, with_kwargs=True))
            self._handles.append(blocks[i].register_forward_hook(post, with_kwargs=True, always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
