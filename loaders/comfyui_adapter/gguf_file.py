"""RingSwap Model Loader on a `.gguf` file: the model is built by ComfyUI-GGUF's own loader code
(its `gguf_sd_loader`, its GGMLOps, its patcher), then its blocks are read from the file with
positioned reads, never through the pack's memory map: each block tensor's bytes lie in one
range of the file (the GGUF header gives offset and size), found under the file's name for it
(loaders/comfyui_adapter/file_names.py); a float tensor the model holds in another dtype is cast
on read. Without ComfyUI-GGUF installed, a clear error names the pack."""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

import comfy.model_patcher
import comfy.sd
import folder_paths

from ...swap.home_policy import home_policy
from ...swap.layout import BlockLayout
from ..model_file.block_reads import BlockReads
from ..model_file.range_reader import RangeReader
from ..model_file.safetensors_index import TensorInfo
from .comfy_server import node_class
from .file_names import FileNames, comfy_prefix

PACK_NODE = "UnetLoaderGGUF"
PACK = "ComfyUI-GGUF (city96/ComfyUI-GGUF)"
SUFFIX = ".gguf"
PREFIX = "model.diffusion_model."


def is_gguf(path: str) -> bool:
    return path.lower().endswith(SUFFIX)


def pack_nodes(path: str):
    """The module of ComfyUI-GGUF's nodes (its loader, ops and patcher), as ComfyUI imported the
    pack; ValueError naming `path` and the pack where it is not installed."""
    cls = node_class(PACK_NODE)
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


FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


@dataclass
class GgufIndex:
    """Where each block tensor's bytes lie in the GGUF file, by ComfyUI's key, as the
    safetensors BlockReads reads them: quantized tensors as the raw bytes the pack's model
    holds, float tensors with their file dtype (cast on read where the model holds another,
    as ComfyUI's load copies them). `unreadable`: block tensors the file does not give as
    either (under no name the file has, or converted otherwise by the pack)."""
    path: str
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)


def gguf_index(path: str, blocks: list[nn.Module], block_keys: list[str], model_config) -> GgufIndex:
    """The GgufIndex of `blocks` (`block_keys`: ComfyUI's key prefix of each)."""
    import gguf
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    pack_prefix = PREFIX if any(k.startswith(PREFIX) for k in tensors) else ""   # the pack strips it first
    keys = [k[len(pack_prefix):] for k in tensors if k.startswith(pack_prefix)]
    names = FileNames(model_config, keys, comfy_prefix(keys))
    index = GgufIndex(path)
    for block, key_prefix in zip(blocks, block_keys):
        for e in BlockLayout.of(block).entries:
            key = key_prefix + (f"{e.path}.{e.key}" if e.path else e.key)
            t = tensors.get(pack_prefix + names.file_key(key))
            if t is None:
                index.unreadable.append(f"'{key}' (no tensor of that name in the file)")
                continue
            start, nbytes = int(t.data_offset), int(t.n_bytes)
            dtype = FLOAT_TYPES.get(t.tensor_type.name)
            numel = math.prod(e.shape)
            if (nbytes == e.nbytes and e.dtype == torch.uint8 and dtype is None) or \
                    (dtype is not None and e.dtype.is_floating_point and nbytes == numel * dtype.itemsize):
                index.tensors[key] = TensorInfo(key, dtype or torch.uint8, e.shape, start, start + nbytes)
            else:
                index.unreadable.append(f"'{key}' ({t.tensor_type.name}, {nbytes} bytes in the file; "
                                        f"{e.dtype}, {e.nbytes} bytes in the model)")
    return index


def block_reads(path: str, reader: RangeReader, blocks: list[nn.Module], block_keys: list[str],
                home: str, model_config) -> BlockReads | None:
    """The BlockReads of the blocks from the file (`block_keys`: ComfyUI's key prefix of each);
    None for home=ram where block tensors cannot be read from the file (GgufIndex.unreadable):
    the homes are then copied from the pack's model once. ValueError naming the file and a
    tensor for home disk or auto there."""
    index = gguf_index(path, blocks, block_keys, model_config)
    if not index.unreadable:
        return BlockReads(index, reader, blocks, block_keys)
    if not home_policy(home).from_file:   # home=ram: homes copied from the pack's model
        return None
    what = index.unreadable[0] + (" and more" if len(index.unreadable) > 1 else "")
    raise ValueError(f"RingSwap: {path}: block tensors of this file cannot be read from it as ComfyUI-GGUF loads "
                     f"them (not as the file holds them: {what}), so they cannot be read each step; use home=ram")
