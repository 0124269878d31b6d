"""SwapState: what all patchers of one diffusion model share (the engine, the block names
and keys, the measured runs), kept on the model itself. It is the model's
lora.blocks.SwappedBlocks, so the LoRA fold finds blocks without reaching into the engine."""
from __future__ import annotations

import itertools
import logging
import re

import comfy.model_patcher
import torch
from torch import nn

from ...swap import BlockSwapEngine
from ...swap.facts import block_of
from ...swap.layout import BlockLayout, codec_for
from . import gguf_tensors
from .block_lists import find_block_lists, interleaved, nonblock_bytes

log = logging.getLogger("ringswap.swap_state")

_BLOCK_KEY = re.compile(r"^(.*?\.\d+\.)(.+)$")   # "diffusion_model.blocks.7." + "ffn.0.weight"


class SwapState:
    """What all patchers of one diffusion model share: the engine and block names."""

    def __init__(self, diffusion_model: nn.Module, engine: BlockSwapEngine | None = None):
        lists = find_block_lists(diffusion_model)
        self.list_names = [n for n, _ in lists]
        # ComfyUI's weight-key prefix of each engine block, e.g. "diffusion_model.blocks.7."
        self.block_keys = [f"diffusion_model.{n}.{j}." for n, blocks in lists for j in range(len(blocks))]
        self.block_index = {k: i for i, k in enumerate(self.block_keys)}
        self.prefixes = tuple(f"diffusion_model.{n}." for n in self.list_names)
        gguf_tensors.register_for(diffusion_model)
        _refuse_unknown_tensors(lists)
        self.engine = engine or BlockSwapEngine([b for _, blocks in lists for b in blocks])
        self.engine.in_order = not interleaved(self.list_names)
        self.measured: dict = {}   # (latent shape, conds a call) -> run_facts.Measured (activation peak, compute time)
        self.nonblock_bytes = nonblock_bytes(diffusion_model, self.list_names)

        _warn_unlisted(diffusion_model, self.list_names)

    def block_of(self, key: str) -> tuple[int, str] | None:
        """(block index, the tensor's name inside the block) of a ComfyUI weight key."""
        m = _BLOCK_KEY.match(key)
        b = self.block_index.get(m.group(1)) if m is not None else None
        return None if b is None else (b, m.group(2))

    def block(self, index: int) -> tuple[nn.Module, BlockLayout]:
        return block_of(self.engine, index)

    @property
    def block_count(self) -> int:
        return self.engine.num_blocks

    @classmethod
    def install(cls, diffusion_model: nn.Module, engine: BlockSwapEngine) -> "SwapState":
        """Use `engine` (e.g. one that reads blocks from a file) for this model."""
        state = cls(diffusion_model, engine)
        diffusion_model.ringswap_state = state
        return state

    @classmethod
    def of(cls, patcher: comfy.model_patcher.ModelPatcher) -> "SwapState":
        dm = patcher.model.diffusion_model
        state = swap_state_on(dm)
        if state is None:
            state = cls(dm)
            dm.ringswap_state = state
        return state


def _refuse_unknown_tensors(lists: list) -> None:
    """A block tensor of a tensor class RingSwap has no codec for (another pack's quantization)
    would move as plain bytes and lose what its class carries: refuse it by name, with nothing
    installed, instead of computing silently wrong."""
    plain = (torch.Tensor, nn.Parameter, nn.Buffer) if hasattr(nn, "Buffer") else (torch.Tensor, nn.Parameter)
    for list_name, blocks in lists:
        for j, block in enumerate(blocks):
            for name, t in itertools.chain(block.named_parameters(), block.named_buffers()):
                if type(t) not in plain and codec_for(t) is None:
                    raise ValueError(
                        f"RingSwap: cannot block-swap '{list_name}.{j}.{name}': its tensor is a "
                        f"{type(t).__module__}.{type(t).__name__}, a format RingSwap cannot move (it knows "
                        "ComfyUI's own quantized tensors, comfy_kitchen's and ComfyUI-GGUF's); sample this "
                        "MODEL without RingSwap Patch")


def _warn_unlisted(diffusion_model: nn.Module, listed: list[str]) -> None:
    """Say so when a ModuleList that is not swapped holds a tenth of the model or more."""
    def nbytes(m):
        return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
    total = nbytes(diffusion_model)
    for name, child in diffusion_model.named_children():
        if isinstance(child, nn.ModuleList) and name not in listed and total and nbytes(child) >= total / 10:
            log.warning("RingSwap: %s.%s (%d modules, %.2f GB) is not a block list RingSwap swaps; it stays "
                        "on the GPU", type(diffusion_model).__name__, name, len(child), nbytes(child) / 1e9)


def swap_state_on(diffusion_model: nn.Module) -> "SwapState | None":
    """The SwapState installed on `diffusion_model` itself, or None. Read from the module's
    own attributes, not getattr: a wrapper module that forwards attribute reads (torch.compile's
    OptimizedModule, swapped in by ComfyUI's compile wrapper during a model call) has none."""
    return vars(diffusion_model).get("ringswap_state")
