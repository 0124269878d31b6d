"""Which ModuleLists of a diffusion model are its transformer blocks, per family, in call order.

The one table of block lists: ComfyUI's diffusion model class (or a base class) -> the
lists the swap engine streams, in the order the model calls them. Where lists interleave
(Wan VACE runs a vace block after every few main blocks, once per context), the engine
learns the real order on the first model call. Any other model: the generic names.
"""
from __future__ import annotations

from torch import nn

FAMILIES: dict[str, tuple[str, ...]] = {
    "WanModel": ("blocks",),                                   # Wan 2.1/2.2 t2v, i2v, TI2V-5B, S2V, HuMo
    "VaceWanModel": ("blocks", "vace_blocks"),                 # vace_blocks interleaved: learned order
    "Flux": ("double_blocks", "single_blocks"),                # Flux, Flux Kontext
    "Chroma": ("double_blocks", "single_blocks"),
    "HunyuanVideo": ("double_blocks", "single_blocks"),
    "HiDreamImageTransformer2DModel": ("double_stream_blocks", "single_stream_blocks"),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "NextDiT": ("layers",),                                    # Lumina 2, Z-Image (refiners stay resident)
    "LTXVModel": ("transformer_blocks",),
    "MMDiT": ("joint_blocks",),                                # SD3 / SD3.5
}
GENERIC = ("blocks", "double_blocks", "single_blocks", "double_stream_blocks", "single_stream_blocks",
           "transformer_blocks", "joint_blocks", "layers", "vace_blocks")
INTERLEAVED = ("vace_blocks",)   # lists whose blocks run between another list's blocks
# every name a block tensor's key may start with (the loader classifies keys before the model exists)
ALL_NAMES = tuple(dict.fromkeys(GENERIC + tuple(n for names in FAMILIES.values() for n in names)))


def list_names(diffusion_model: nn.Module) -> tuple[str, ...]:
    """The block lists of this model's family (its class or nearest listed base class), else GENERIC."""
    for cls in type(diffusion_model).__mro__:
        names = FAMILIES.get(cls.__name__)
        if names is not None:
            return names
    return GENERIC


def interleaved(names: list[str]) -> bool:
    """Whether blocks of these lists run between the blocks of another (e.g. Wan VACE's)."""
    return len(names) > 1 and any(n in INTERLEAVED for n in names)


def nonblock_bytes(diffusion_model: nn.Module, list_names: list[str]) -> int:
    """Bytes of the model's weights outside its block lists (they stay on the device); read
    from the tensors' shapes, so a meta skeleton or unbound blocks count the same."""
    prefixes = tuple(f"{n}." for n in list_names)
    return sum(t.numel() * t.element_size()
               for n, t in list(diffusion_model.named_parameters()) + list(diffusion_model.named_buffers())
               if not n.startswith(prefixes))


def find_block_lists(diffusion_model: nn.Module, source: str = "") -> list[tuple[str, nn.ModuleList]]:
    """The model's non-empty transformer block lists in call order, e.g. [("blocks", ...)] for Wan.
    Raises ValueError (naming `source`, e.g. the file, and the names looked for) when it has none."""
    found = []
    for name in list_names(diffusion_model):
        blocks = getattr(diffusion_model, name, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            found.append((name, blocks))
    if not found:
        raise ValueError(
            f"RingSwap: {source + ': ' if source else ''}{type(diffusion_model).__name__} has no transformer "
            f"block list (looked for a non-empty ModuleList named one of: {', '.join(list_names(diffusion_model))}); "
            "this model cannot be block-swapped")
    return found
