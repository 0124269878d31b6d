"""FoldProbe: checks every patched block weight against ComfyUI's patched weight inside each
block, after the engine bound its landed (and folded) weights."""
import torch


def close_in_ulps(got: torch.Tensor, want: torch.Tensor, ulps: int) -> bool:
    if ulps == 0 or not want.dtype.is_floating_point:
        return torch.equal(got, want)
    # in units of the tensor's largest magnitude: where base and delta nearly cancel, the
    # result is tiny but both foldings round at the operands' scale
    w = want.float()
    tol = ulps * torch.finfo(want.dtype).eps * w.abs().max()
    return bool(((got.float() - w).abs() <= tol).all())


class FoldProbe:
    """Inside every block (after the engine bound its landed weights), compares each
    patched block weight with ComfyUI's patched weight; counts checks per block."""

    def __init__(self, model, expected: dict, ulps: int | None = None):
        # 0: bit-exact (the CPU follows ComfyUI's steps); on CUDA plain LoRA pairs fold with
        # a fused addmm_, within one unit in the last place (lora/fold_ops.py)
        self.ulps = (1 if torch.cuda.is_available() else 0) if ulps is None else ulps
        self.engine = model.swap_engine
        self.checks = [0] * self.engine.num_blocks
        self.bad: list[str] = []
        keys = model.swap_state.block_keys
        self.per_block = {i: [(k[len(p):], w) for k, w in expected.items() if k.startswith(p)]
                          for i, p in enumerate(keys)}
        assert all(self.per_block.values()), "every block must have patched weights in this test"
        self.handles = [s.block.norm1.register_forward_pre_hook(self._hook(s.index, s.block))
                        for s in self.engine.states]

    def _hook(self, i, block):
        def check(module, args):
            for sub, want in self.per_block[i]:
                path, _, name = sub.rpartition(".")
                got = getattr(block.get_submodule(path) if path else block, name)
                if not close_in_ulps(got.detach(), want, self.ulps):
                    self.bad.append(f"block {i} {sub}")
            self.checks[i] += 1
        return check

    def remove(self):
        for h in self.handles:
            h.remove()
