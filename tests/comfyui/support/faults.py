"""Out-of-memory on demand, for the recovery tests: a forward pre-hook on one block that
raises as a failed allocation would, at a chosen model call of the engine's run."""
import torch


def inject_oom(engine, call: int, block: int, times: int = 1):
    """Make `block` of model call `call` (counted from 1 in a run) run out of memory `times`
    times; returns the hook's handle."""
    left = [times]

    def hook(module, args):
        if left[0] and engine.attached and engine.stats.calls == call:
            left[0] -= 1
            raise torch.OutOfMemoryError(f"injected allocation failure at block {block} of model call {call}")
    return engine.states[block].block.register_forward_pre_hook(hook)
