"""Build a ComfyUI diffusion model from a safetensors header without reading its blocks.

ComfyUI's own detection (`comfy.model_detection`) runs on a state dict in which the big
block tensors are meta tensors (shape and dtype from the header) and everything small is
real; ComfyUI's model class is then instantiated (its uninitialised `torch.empty`
weights cost no RAM until touched; the swap engine replaces the block ones with
placeholders before anything touches them), the non-block weights are loaded normally
and the block weights are left to the engine. The dtype choice mirrors
`comfy.sd.load_diffusion_model_state_dict`, so the model equals the stock loader's.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch

import comfy.model_detection
import comfy.model_management
import comfy.utils

from ..model_file.quant import build_quantized_blocks, comfy_quant_layers, declare_fp8_layers
from ..model_file.safetensors_index import ALIGN, SafetensorsIndex, owned
from . import comfy_features as features
from . import comfy_models
from .file_names import FileNames, comfy_prefix

log = logging.getLogger("ringswap.skeleton")

SMALL_BYTES = 64 * 1024   # block tensors at most this big are read for detection (scales, comfy_quant)
CASTABLE = (torch.float16, torch.bfloat16, torch.float32)   # non-block weights the load may cast from the file's pages


@dataclass
class Skeleton:
    model: object             # comfy.model_base.BaseModel, block weights not loaded
    model_config: object
    load_device: torch.device
    offload_device: torch.device
    names: FileNames          # the file's key of each of ComfyUI's keys (its prefix, ComfyUI's renames)


def _is_block_key(key: str, prefix: str, list_names: tuple[str, ...]) -> bool:
    rest = key[len(prefix):] if key.startswith(prefix) else key
    head, _, tail = rest.partition(".")
    return head in list_names and tail.split(".", 1)[0].isdigit()


def build_skeleton(index: SafetensorsIndex, list_names: tuple[str, ...],
                   model_options: dict | None = None, weights: bool = True) -> Skeleton:
    """The model with its non-block weights loaded; `weights=False`: built on the meta
    device from the header and the few tensors of at most SMALL_BYTES (sizes and ComfyUI's
    memory estimate only, nothing loaded)."""
    model_options = model_options or {}
    path = index.path
    big = [n for n, t in index.tensors.items() if weights and t.nbytes > SMALL_BYTES
           and not _is_block_key(n, "", list_names) and not _is_block_key(n, "model.diffusion_model.", list_names)]
    views = index.mapped_tensors([n for n in big if index[n].dtype in CASTABLE])
    real = {**index.read_tensors([n for n, t in index.tensors.items() if t.nbytes <= SMALL_BYTES]
                                 + [n for n in big if n not in views]), **views}
    sd = {n: real[n] if n in real else torch.empty(t.shape, dtype=t.dtype, device="meta")
          for n, t in index.tensors.items()}

    metadata = dict(index.metadata)
    sd, metadata = comfy_models.convert_old_quants(sd, metadata)
    prefix = comfy_prefix(sd)
    if prefix:
        sd = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True)
        sd, metadata = comfy_models.convert_old_quants(sd, metadata)
    reads_comfy_quant = features.reads_comfy_quant()
    layers = {} if reads_comfy_quant else comfy_quant_layers(sd)
    metadata = declare_fp8_layers(metadata, layers)
    parameters = comfy.utils.calculate_parameters(sd)
    weight_dtype = comfy.utils.weight_dtype(sd)
    load_device = comfy.model_management.get_torch_device()
    _check_blocks_complete(sd, list_names, path)
    kwargs = {"metadata": metadata} if features.has_arg(comfy.model_detection.model_config_from_unet, "metadata") else {}
    model_config = comfy.model_detection.model_config_from_unet(sd, "", **kwargs)
    if model_config is None:
        raise ValueError(f"RingSwap: {path}: ComfyUI does not recognise this diffusion model "
                         f"(no known architecture matches its {len(sd)} tensors)")

    offload_device = comfy.model_management.unet_offload_device()
    unet_dtype, manual_cast_dtype = _set_dtypes(model_config, model_options, parameters, weight_dtype, load_device)
    names = FileNames(model_config, index.tensors, prefix)

    if not weights:
        with comfy_models.static_construction(), torch.device("meta"):
            model = model_config.get_model(sd, "")
        return Skeleton(model, model_config, load_device, offload_device, names)
    with comfy_models.static_construction():
        model = model_config.get_model(sd, "").to(offload_device)   # a no-op move: nothing is loaded yet
        dm = model.diffusion_model
        block_modules = [(n, m) for n, m in dm.named_modules() if _is_block_key(n, "", list_names)]
        block_sd = {**sd, **{k: sd[f] for k, f in names.renamed.items() if f in sd}}   # also under ComfyUI's names
        build_quantized_blocks(block_modules, block_sd, layers, manual_cast_dtype or unet_dtype, path,
                               reads_comfy_quant)
        nonblock = {n: t for n, t in sd.items() if not _is_block_key(n, "", list_names)}
        missing = _load_nonblock(dm, model_config.process_unet_state_dict(nonblock), list_names, _views_of(views))
    if missing:
        log.warning("RingSwap: %s: missing non-block weights: %s", path, missing)
    return Skeleton(model, model_config, load_device, offload_device, names)


def _set_dtypes(model_config, model_options: dict, parameters: int, weight_dtype, load_device) -> tuple:
    """The model's dtype and manual-cast dtype, chosen and set as ComfyUI's
    load_diffusion_model_state_dict does (model_options: dtype, custom_operations, fp8)."""
    supported = list(model_config.supported_inference_dtypes)
    if comfy_models.drops_weight_dtype(model_config):
        weight_dtype = None
    unet_dtype = model_options.get("dtype", None)
    if unet_dtype is None:
        unet_dtype = comfy.model_management.unet_dtype(model_params=parameters, supported_dtypes=supported,
                                                       weight_dtype=weight_dtype)
    quantized = comfy_models.layer_quant_config(model_config) is not None
    manual_cast_dtype = comfy.model_management.unet_manual_cast(None if quantized else unet_dtype, load_device,
                                                                supported)
    comfy_models.set_inference_dtype(model_config, unet_dtype, manual_cast_dtype, load_device)
    model_config.custom_operations = model_options.get("custom_operations", model_config.custom_operations)
    if model_options.get("fp8_optimizations", False):
        model_config.optimizations["fp8"] = True
    return unet_dtype, manual_cast_dtype


def _check_blocks_complete(sd: dict, list_names: tuple[str, ...], path: str) -> None:
    """Block 0 of every list must have each tensor that all the list's other blocks have:
    ComfyUI's detection reads block 0 and would fail with a bare KeyError. (Blocks may
    differ otherwise: VACE's first vace block alone has `before_proj`, SD3's last joint
    block has fewer; a tensor missing from any other block is named by BlockReads, which
    checks every block against its module.)"""
    blocks: dict[tuple[str, int], set[str]] = {}
    for key in sd:
        head, _, rest = key.partition(".")
        index, _, suffix = rest.partition(".")
        if head in list_names and index.isdigit():
            blocks.setdefault((head, int(index)), set()).add(suffix)
    for name in list_names:
        others = [suffixes for (n, i), suffixes in blocks.items() if n == name and i > 0]
        if not others:
            continue
        missing = sorted(set.intersection(*others) - blocks.get((name, 0), set()))
        if missing:
            raise ValueError(f"RingSwap: {path}: missing tensor '{name}.0.{missing[0]}'"
                             + (f" (and {len(missing) - 1} more in that block)" if len(missing) > 1 else "")
                             + "; the other blocks have it")


def _views_of(views: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor lies in the storage of one of `views` (the file's mapping)."""
    bases = {t.untyped_storage().data_ptr() for t in views.values()}
    return lambda t: type(t) is torch.Tensor and t.untyped_storage().data_ptr() in bases


def _load_nonblock(dm: torch.nn.Module, sd: dict, list_names: tuple[str, ...],
                   file_view: Callable[[torch.Tensor], bool]) -> list[str]:
    """torch's load_state_dict recursion (so ComfyUI's ops see their full key prefixes),
    skipping the block lists; returns the missing keys. A tensor read as the module keeps it
    (same dtype, shape and device) becomes its storage first, so the load's copy is a no-op
    (no second copy of the non-block weights, ~0.5 GB for Wan 14B). Where ComfyUI picks another
    dtype (fp16 for a bf16 Wan file on a GPU) the load casts from the file's pages (`file_view`).
    A module left holding the file's pages gets a copy of its own, and an adopted tensor is 64-byte
    aligned, as ComfyUI's load copies it into its own tensor; one its op's load kept stays at the
    file's alignment, as ComfyUI keeps the view. CPU matmuls round differently at other alignments
    (fp32 tensors at 8 mod 16 in the file gave other outputs on an AVX2 CPU)."""
    missing: list[str] = []
    unexpected: list[str] = []
    errors: list[str] = []

    def load(module, prefix):
        adopted = _adopt(module, sd, prefix)
        module._load_from_state_dict(sd, prefix, {}, False, missing, unexpected, errors)
        for name, child in module._modules.items():
            if child is not None and not (module is dm and name in list_names):
                load(child, prefix + name + ".")
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is None:
                    continue
                mine = adopted.get(name) is t   # adopted and kept: ComfyUI would have copied it, aligned
                if file_view(t.data) or mine and t.data.data_ptr() % ALIGN:
                    t.data = owned(t.data, aligned=mine)

    with torch.no_grad():
        load(dm, "")
    if errors:
        raise ValueError("RingSwap: loading non-block weights: " + "; ".join(errors))
    return missing


def _adopt(module: torch.nn.Module, sd: dict, prefix: str) -> dict[str, torch.nn.Parameter]:
    """Point `module`'s own parameters at the state dict's tensors where they match as they are;
    returns those parameters by name."""
    adopted = {}
    for name, param in module._parameters.items():
        t = sd.get(prefix + name)
        if (param is not None and type(t) is torch.Tensor
                and t.dtype == param.dtype and t.shape == param.shape and t.device == param.device):
            param.data = t
            adopted[name] = param
    return adopted
