"""The plan a run of a diffusion_models file would get, without loading it (GET /ringswap/plan).

The model is built on the meta device from the file's header (a .gguf: by ComfyUI-GGUF on
the file's memory map, no weight read), cached per unchanged file, so block sizes, non-block
weights and ComfyUI's activation estimate are the ones a load would have; the free VRAM counts what ComfyUI would unload before the run.
"""
from __future__ import annotations

import collections
import os
import threading
from dataclasses import dataclass

import comfy.model_management

from ...swap.home_policy import home_policy
from ...swap.load_plan import CallFacts, EngineFacts, LoadPlan, RunFacts, SwapSettings, plan_load
from ...swap.plane_coder import coder_missing
from ..model_file.safetensors_index import SafetensorsIndex
from . import comfy_memory, comfy_sampling
from . import gguf_file
from .block_lists import ALL_NAMES, find_block_lists, nonblock_bytes
from .run_facts import tokens
from .skeleton import build_skeleton

GB = 1e9
_CACHE: "collections.OrderedDict[tuple, FileFacts]" = collections.OrderedDict()
_LOCK = threading.Lock()


@dataclass(frozen=True)
class FileFacts:
    model: object                   # comfy BaseModel on the meta device (memory_required, latent_format)
    block_sizes: tuple[int, ...]
    nonblock_bytes: int


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def file_facts(path: str) -> FileFacts:
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    with _LOCK:
        facts = _CACHE.get(key)
        if facts is not None:
            _CACHE.move_to_end(key)
            return facts
    if gguf_file.is_gguf(path):   # ComfyUI-GGUF's model on the file's map: nothing of the weights is read
        model = gguf_file.load_gguf_model(path, set_defaults=False).model
    else:
        model = build_skeleton(SafetensorsIndex.open(path), ALL_NAMES, weights=False).model
    dm = model.diffusion_model
    lists = find_block_lists(dm, path)
    blocks = [b for _, bl in lists for b in bl]
    sizes = tuple(_nbytes(list(b.parameters()) + list(b.buffers())) for b in blocks)
    facts = FileFacts(model, sizes, nonblock_bytes(dm, [n for n, _ in lists]))
    with _LOCK:
        _CACHE[key] = facts
        while len(_CACHE) > 4:
            _CACHE.popitem(last=False)
    return facts


def latent_shape(model, width: int, height: int, frames: int, batch: int) -> tuple[int, ...]:
    """The latent a run at this image/video size samples (the model's latent format)."""
    fmt = model.latent_format
    spatial = comfy_sampling.spatial_downscale(fmt)
    shape = [batch, fmt.latent_channels]
    if getattr(fmt, "latent_dimensions", 2) == 3:
        shape.append((max(1, frames) - 1) // comfy_sampling.temporal_downscale(fmt) + 1)
    return tuple(shape + [max(1, height // spatial), max(1, width // spatial)])


def free_for_run(device) -> int:
    """Free device memory plus what ComfyUI's loaded models hold (unloaded before a run as needed)."""
    held = sum(lm.model_loaded_memory() for lm in comfy.model_management.current_loaded_models
               if getattr(lm, "device", None) == device)
    return comfy_memory.free_vram(device) + int(held)


def plan_for_file(path: str, width: int, height: int, frames: int = 1, batch: int = 1, window: int = 0,
                  prefetch: int = 1, vram_budget_gb: float = 0.0, conds: int = 1, home: str = "auto",
                  compress: str = "auto") -> LoadPlan:
    """swap.load_plan's plan for a RingSwap Model Loader run of `path` at this size with `conds`
    conds a step (cond + uncond: 2), as a first load would get it (raises NotEnoughVRAM with the
    numbers); `home` and `compress` as on the node."""
    facts = file_facts(path)
    shape = latent_shape(facts.model, width, height, frames, batch)
    device = comfy.model_management.get_torch_device()
    reserve = comfy_memory.reserved_vram()

    def call(per_call: int) -> CallFacts:
        call_shape = tuple([shape[0] * per_call] + list(shape[1:]))
        return CallFacts(activation_bytes=int(facts.model.memory_required(list(call_shape))),
                         activation_source="ComfyUI's estimate", reserve_bytes=reserve,
                         tokens=tokens(facts.model.diffusion_model, call_shape))
    engine = EngineFacts(block_sizes=facts.block_sizes, policy=home_policy(home), own_load=True)
    run = RunFacts(device=str(device), free_bytes=free_for_run(device), nonblock_bytes=facts.nonblock_bytes,
                   batched=call(conds), single=call(1), conds_per_step=conds, all_asked=device.type == "cpu",
                   coder_missing=coder_missing(), ram_available=comfy_memory.ram_available(),
                   ram_kept_by_comfy=comfy_memory.ram_kept_by_comfy(), preview=True)
    return plan_load(engine, run, SwapSettings(window, prefetch, vram_budget_gb=vram_budget_gb, compress=compress))
