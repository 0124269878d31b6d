"""What the LoRA side needs from a block-swapped model, declared once: `lora` reads the
blocks through this interface, never the engine's or the adapter's own attributes."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from torch import nn

if TYPE_CHECKING:   # the layout's shape only: lora does not import the engine
    from ..swap.layout import BlockLayout


@runtime_checkable
class SwappedBlocks(Protocol):
    """The transformer blocks of a model whose weights the swap engine places."""

    def block_of(self, key: str) -> tuple[int, str] | None:
        """(block index, the tensor's name inside the block) of a ComfyUI weight key such as
        "diffusion_model.blocks.7.ffn.0.weight"; None for a weight outside the blocks."""

    def block(self, index: int) -> tuple[nn.Module, BlockLayout]:
        """The block's module and the layout of its weights (their logical shapes, codecs)."""

    @property
    def block_count(self) -> int:
        """How many blocks there are (indices 0 .. block_count - 1)."""


def swapped_blocks(patcher) -> SwappedBlocks | None:
    """The blocks of a block-swapped patcher (its `swapped_blocks` property), else None."""
    try:
        blocks = getattr(patcher, "swapped_blocks", None)
    except Exception:   # noqa: BLE001  (a patcher whose model is gone)
        return None
    return blocks if isinstance(blocks, SwappedBlocks) else None
