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

from ...swap.window_plan import PlanInputs, WindowPlan, plan_step
from ..model_file.safetensors_index import SafetensorsIndex
from . import comfy_memory, comfy_sampling
from . import compress_choice, gguf_file
from .block_lists import ALL_NAMES, find_block_lists, nonblock_bytes
from .run_plan import tokens
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
                  compress: str = "auto") -> WindowPlan:
    """The plan of a RingSwap Model Loader run of `path` at this size with `conds` conds a step
    (cond + uncond: 2), batched or not as a run would (raises NotEnoughVRAM with the numbers);
    `home` and `compress` as on the node (the decode scratch where it may code)."""
    facts = file_facts(path)
    shape = latent_shape(facts.model, width, height, frames, batch)
    device = comfy.model_management.get_torch_device()
    everything = device.type == "cpu" and not vram_budget_gb and not window
    free, reserve = free_for_run(device), comfy_memory.reserved_vram()

    def inputs(per_call: int) -> PlanInputs:
        call = [shape[0] * per_call] + list(shape[1:])
        return PlanInputs(
            block_sizes=facts.block_sizes, free_bytes=free,
            nonblock_bytes=facts.nonblock_bytes + compress_choice.scratch_bytes(compress, device, home, own_load=True),
            reserve_bytes=reserve, activation_bytes=int(facts.model.memory_required(call)),
            activation_source="ComfyUI's estimate", budget_bytes=int(vram_budget_gb * GB),
            window=len(facts.block_sizes) if everything else window, prefetch=prefetch, device=str(device),
            tokens=tokens(facts.model.diffusion_model, tuple(call)), conds_per_step=conds, conds_per_call=per_call)
    return plan_step(inputs(conds), inputs(1))
