"""RingSwap Model Loader on a `.gguf` file: the model is built by ComfyUI-GGUF's own loader code
(its `gguf_sd_loader`, its GGMLOps, its patcher), then its blocks are read from the file with
positioned reads, never through the pack's memory map: each block tensor's bytes lie in one
range of the file (the GGUF header gives offset and size), exactly as the block travels.
Without ComfyUI-GGUF installed, a clear error names the pack."""
from __future__ import annotations

import sys
from concurrent.futures import Future

import torch
from torch import nn

import comfy.model_patcher
import comfy.sd
import folder_paths

from ...swap.layout import BlockLayout
from ..model_file.block_reader import BlockReader

PACK_NODE = "UnetLoaderGGUF"
PACK = "ComfyUI-GGUF (city96/ComfyUI-GGUF)"
SUFFIX = ".gguf"
PREFIX = "model.diffusion_model."


def is_gguf(path: str) -> bool:
    return path.lower().endswith(SUFFIX)


def pack_nodes(path: str):
    """The module of ComfyUI-GGUF's nodes (its loader, ops and patcher), as ComfyUI imported the
    pack; ValueError naming `path` and the pack where it is not installed."""
    import nodes
    cls = nodes.NODE_CLASS_MAPPINGS.get(PACK_NODE)
    module = sys.modules.get(getattr(cls, "__module__", "")) if cls is not None else None
    if module is None or not all(hasattr(module, n) for n in ("gguf_sd_loader", "GGMLOps", "GGUFModelPatcher")):
        raise ValueError(f"RingSwap Model Loader: {path} is a GGUF file; reading it needs the {PACK} custom node "
                         "pack, which is not installed (install it with ComfyUI-Manager or clone it into "
                         "custom_nodes, then restart ComfyUI)")
    return module


def gguf_names() -> list[str]:
    """The .gguf files of diffusion_models (and its legacy name unet), found with ComfyUI's own
    search also without the pack, so the loader can say that the pack is missing."""
    names: set[str] = set()
    for folder in ("diffusion_models", "unet"):
        try:
            roots = folder_paths.get_folder_paths(folder)
        except KeyError:
            continue
        for root in roots:
            names.update(folder_paths.filter_files_extensions(folder_paths.recursive_search(root)[0], {SUFFIX}))
    return sorted(names)


def model_names() -> list[str]:
    """What RingSwap Model Loader offers and the plan route accepts: diffusion_models' own list
    and its .gguf files."""
    return folder_paths.get_filename_list("diffusion_models") + gguf_names()


def load_gguf_model(path: str, set_defaults: bool = True) -> comfy.model_patcher.ModelPatcher:
    """What ComfyUI-GGUF's Unet Loader (GGUF) returns for `path`, with its default options. The
    pack keeps those on its Linear class, which every GGUF model shares: `set_defaults=False`
    (only the model's facts are read) leaves another loader's choice alone. A file the pack
    cannot read is a ValueError naming it."""
    pack = pack_nodes(path)
    ops = pack.GGMLOps()
    if set_defaults:   # Unet Loader (GGUF)'s defaults ("default" dequant and patch dtypes)
        ops.Linear.dequant_dtype = None
        ops.Linear.patch_dtype = None
    try:
        sd = pack.gguf_sd_loader(path)
    except Exception as e:   # noqa: BLE001 - the gguf package's and the pack's own errors
        raise ValueError(f"RingSwap: {path}: ComfyUI-GGUF cannot read this file as a GGUF model "
                         f"({type(e).__name__}: {e})") from e
    model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops})
    if model is None:
        raise ValueError(f"RingSwap Model Loader: {path}: ComfyUI could not detect the model type of this GGUF file")
    return pack.GGUFModelPatcher.clone(model)


class GgufBlockSource:
    """Each block's bytes from their ranges in the GGUF file (one range per layout entry)."""

    def __init__(self, path: str, reader: BlockReader, blocks: list[nn.Module], block_keys: list[str]):
        import gguf
        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        self.reader = reader
        self.ranges: list[list[tuple[int, int, int]]] = []
        self.converted: list[str] = []   # block tensors the pack converted at load: not the file's bytes
        for block, prefix in zip(blocks, block_keys):
            ranges = []
            for e in BlockLayout.of(block).entries:
                key = prefix + (f"{e.path}.{e.key}" if e.path else e.key)
                t = tensors.get(key) or tensors.get(PREFIX + key)   # the pack strips this prefix where a file has it
                if t is None:
                    raise ValueError(f"RingSwap: {path}: missing tensor '{key}'")
                if int(t.n_bytes) != e.nbytes:
                    self.converted.append(f"'{key}' ({int(t.n_bytes)} bytes in the file, {e.nbytes} in the model)")
                ranges.append((int(t.data_offset), e.nbytes, e.offset))
            self.ranges.append(ranges)

    def read(self, block: int, dest: torch.Tensor) -> Future:
        return self.reader.read_into(dest, self.ranges[block])

    def close(self) -> None:
        self.reader.close()


def block_source(path: str, reader: BlockReader, blocks: list[nn.Module], block_keys: list[str],
                 home: str) -> GgufBlockSource | None:
    """The file source of the blocks; None for home=ram where ComfyUI-GGUF converted block
    tensors at load (the homes are then copied from its model once). ValueError naming the
    file and a tensor for home disk or auto there (the file's bytes are not the block's)."""
    source = GgufBlockSource(path, reader, blocks, block_keys)
    if not source.converted:
        return source
    if home == "ram":
        return None
    raise ValueError(f"RingSwap: {path}: ComfyUI-GGUF converts block tensors of this file when it loads them "
                     f"(converted at load: {source.converted[0]}{' and more' if len(source.converted) > 1 else ''}), "
                     "so they cannot be read from the file each step; use home=ram")
