"""Test/demo-only ComfyUI nodes (NOT part of the user-facing RingSwap pack).

A real Wan text encoder (umt5-xxl) is several GB and no stock node makes conditioning
from nothing, so tests and ``make demo`` use this node for positive/negative prompts.
The test harness links this folder into a temporary ``custom_nodes`` directory.
"""
import torch


class RingSwapDemoConditioning:
    CATEGORY = "RingSwap/testing"
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    DESCRIPTION = ("Seeded random text conditioning [1, length, dim] (std 1) for tests "
                   "and demos without a text encoder.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF}),
            "length": ("INT", {"default": 16, "min": 1, "max": 4096}),
            "dim": ("INT", {"default": 4096, "min": 1, "max": 16384}),
        }}

    def make(self, seed, length, dim):
        gen = torch.Generator().manual_seed(int(seed) % (2 ** 63))
        cond = torch.randn((1, length, dim), generator=gen, dtype=torch.float32)
        return ([[cond, {}]],)


NODE_CLASS_MAPPINGS = {"RingSwapDemoConditioning": RingSwapDemoConditioning}
NODE_DISPLAY_NAME_MAPPINGS = {"RingSwapDemoConditioning": "RingSwap Demo Conditioning (testing)"}
