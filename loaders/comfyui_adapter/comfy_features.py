"""What this ComfyUI can do, probed once: the one place where version differences live.

Every probe asks whether a function, argument or attribute exists (never a version
number), so a newer ComfyUI that keeps an interface keeps working. Covered: the quantized
checkpoint conversion and per-layer quant config (0.33: `convert_old_quants`,
`quant_config`; 0.3.75: `layer_quant_config`), dynamic VRAM (`is_dynamic`,
`cached_patcher_init`, `clone(model_override=)`, `aimdo_enabled` lazy ops) and ComfyUI's
pin budget (`MAX_PINNED_MEMORY`, `PINNED_MEMORY`, `ensure_pin_registerable`), who
calc_cond_batch asks for free memory (`ModelPatcher.get_free_memory` from 0.33 on, else
`comfy.samplers.model_management`), and the server's websocket clients
(`PromptServer.instance.sockets`, `send_sync`).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import types
from typing import Iterator

import torch

import comfy.cli_args
import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.supported_models_base
import comfy.utils

try:
    import comfy.memory_management as _memory_management
except ImportError:   # ComfyUI without dynamic VRAM
    _memory_management = None


def has_arg(fn, name: str) -> bool:
    """Does callable `fn` take an argument called `name`?"""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ----- quantized checkpoints ----------------------------------------------------------
CONVERTS_OLD_QUANTS = hasattr(comfy.utils, "convert_old_quants")
# the model config attribute that holds per-layer quantization ("quant_config" from 0.33 on)
QUANT_CONFIG_ATTR = next((a for a in ("quant_config", "layer_quant_config")
                          if a in vars(comfy.supported_models_base.BASE)), None)
SET_DTYPE_TAKES_DEVICE = has_arg(comfy.supported_models_base.BASE.set_inference_dtype, "device")


def convert_old_quants(sd: dict, metadata: dict) -> tuple[dict, dict]:
    """ComfyUI's own conversion of scaled fp8 / `_quantization_metadata` checkpoints to
    per-layer `.comfy_quant` + `weight_scale`, where it has one; else unchanged."""
    if not CONVERTS_OLD_QUANTS:
        return sd, metadata
    sd, metadata = comfy.utils.convert_old_quants(sd, "", metadata=dict(metadata))
    return sd, metadata or {}


@functools.cache
def reads_comfy_quant() -> bool:
    """Does this ComfyUI build layers from per-layer `.comfy_quant` tensors itself?"""
    if CONVERTS_OLD_QUANTS:
        return True
    src = os.path.join(os.path.dirname(comfy.sd.__file__), "model_detection.py")
    with open(src, encoding="utf-8") as f:
        return "comfy_quant" in f.read()


def layer_quant_config(model_config) -> dict | None:
    return getattr(model_config, QUANT_CONFIG_ATTR) if QUANT_CONFIG_ATTR else None


def drops_weight_dtype(model_config) -> bool:
    """Does ComfyUI's loader leave the file's weight dtype out of its dtype choice? It
    does for quantized checkpoints: 0.33 when a quant config exists, 0.3.75 for scaled fp8."""
    if CONVERTS_OLD_QUANTS:
        return layer_quant_config(model_config) is not None
    return getattr(model_config, "scaled_fp8", None) is not None


def set_inference_dtype(model_config, dtype, manual_cast_dtype, device: torch.device) -> None:
    if SET_DTYPE_TAKES_DEVICE:
        model_config.set_inference_dtype(dtype, manual_cast_dtype, device=device)
    else:
        model_config.set_inference_dtype(dtype, manual_cast_dtype)


def lora_patch_dtype(device: torch.device) -> torch.dtype:
    """The dtype ComfyUI patches (LoRA) weights in on `device`: 0.33's `lora_compute_dtype`
    (float16 where the device runs it), float32 before it had one."""
    fn = getattr(comfy.model_management, "lora_compute_dtype", None)
    return fn(device) if fn is not None else torch.float32


def inference_dtype(base_model) -> torch.dtype:
    """The dtype a model's layers get their inputs in (0.33's `get_dtype_inference`; before
    it, the manual-cast dtype where set, else the model's own), as `_apply_model` casts."""
    fn = getattr(base_model, "get_dtype_inference", None)
    if callable(fn):
        return fn()
    return getattr(base_model, "manual_cast_dtype", None) or base_model.get_dtype()


# ----- dynamic VRAM -------------------------------------------------------------------
def is_dynamic(patcher) -> bool:
    """Was this MODEL built for ComfyUI's dynamic VRAM (weights cast at use, from an mmap)?"""
    fn = getattr(patcher, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


def built_for_dynamic_vram(patcher) -> bool:
    """Is this MODEL dynamic, or were its layers built by dynamic VRAM's lazy ops (which
    keep the file's tensors uncast; ComfyUI gives CPU-only models a static patcher)?"""
    if is_dynamic(patcher):
        return True
    dm = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    return dm is not None and any(getattr(m, "comfy_need_lazy_init_bias", None) is not None for m in dm.modules())


class _PerThreadDynamicVram(types.ModuleType):
    """comfy.memory_management with `aimdo_enabled` seen per thread while a thread builds
    statically: the plan route builds on a worker thread while the prompt thread may load a
    model with dynamic VRAM, so the process-wide flag must not change under it."""
    _static = threading.local()

    @property
    def aimdo_enabled(self) -> bool:
        return False if getattr(self._static, "depth", 0) else self.__dict__["aimdo_enabled"]

    @aimdo_enabled.setter
    def aimdo_enabled(self, value: bool) -> None:
        self.__dict__["aimdo_enabled"] = value


@contextlib.contextmanager
def static_construction() -> Iterator[None]:
    """Build ComfyUI modules as without dynamic VRAM: with `aimdo_enabled`, ComfyUI's
    Linear/Embedding leave their weight unset and keep the file's tensors uncast until a
    dynamic patcher loads them; RingSwap owns its models as static patchers, so it builds
    them the static way (weights in ComfyUI's chosen dtype, cast while loading). Only this
    thread sees dynamic VRAM off."""
    mm = _memory_management
    if mm is None or not getattr(mm, "aimdo_enabled", False):
        yield
        return
    if type(mm) is types.ModuleType:
        mm.__class__ = _PerThreadDynamicVram
    if not isinstance(mm, _PerThreadDynamicVram):   # another pack made it a class of its own: process-wide
        mm.aimdo_enabled = False
        try:
            yield
        finally:
            mm.aimdo_enabled = True
        return
    static = _PerThreadDynamicVram._static
    static.depth = getattr(static, "depth", 0) + 1
    try:
        yield
    finally:
        static.depth -= 1


def source_file(patcher) -> tuple[str, dict] | None:
    """(path, model_options) of a MODEL made by ComfyUI's Load Diffusion Model, from the
    factory ComfyUI records to rebuild it (`cached_patcher_init`); None for any other."""
    init = getattr(patcher, "cached_patcher_init", None)
    if not init or init[0] is not getattr(comfy.sd, "load_diffusion_model", None) or len(init) > 2:
        return None
    args = tuple(init[1])
    if not args or not isinstance(args[0], str):
        return None
    return args[0], (dict(args[1]) if len(args) > 1 and args[1] else {})


CLONE_TAKES_MODEL = has_arg(comfy.model_patcher.ModelPatcher.clone, "model_override")
CLONE_DISABLES_DYNAMIC = has_arg(comfy.model_patcher.ModelPatcher.clone, "disable_dynamic")


def clone_onto(patcher, onto) -> comfy.model_patcher.ModelPatcher:
    """A static ModelPatcher clone of `patcher` (patches, options, wrappers, callbacks...)
    whose model is `onto`'s instead of its own, sharing `onto`'s weight backups as ComfyUI's
    clones of one model do (with backups of its own, a clone would patch again the weights
    another clone left patched)."""
    if not CLONE_TAKES_MODEL:
        raise RuntimeError("RingSwap: this ComfyUI's ModelPatcher.clone cannot take another model")
    shared = getattr(comfy.model_patcher.ModelPatcher, "get_clone_model_override", None)
    override = shared(onto) if shared is not None else (onto.model, ({}, {}, {}, set()))
    kwargs = {"disable_dynamic": True} if CLONE_DISABLES_DYNAMIC else {}
    return comfy.model_patcher.ModelPatcher.clone(patcher, model_override=override, **kwargs)


# ----- pinned memory ------------------------------------------------------------------
class ComfyPinBudget:
    """RingSwap's page-locked bytes counted in ComfyUI's own pin accounting
    (`PINNED_MEMORY`, `TOTAL_PINNED_MEMORY`) and held to its limit (`MAX_PINNED_MEMORY`,
    e.g. 40-45% of RAM on Windows), asking ComfyUI to free other pins first where it can."""

    def __init__(self, mm=comfy.model_management):
        self.mm = mm

    @staticmethod
    def available(mm=comfy.model_management) -> bool:
        return all(hasattr(mm, a) for a in ("MAX_PINNED_MEMORY", "TOTAL_PINNED_MEMORY", "PINNED_MEMORY"))

    def reserve(self, ptr: int, nbytes: int) -> bool:
        mm = self.mm
        if mm.MAX_PINNED_MEMORY <= 0:   # ComfyUI pins nothing here (--disable-pinned-memory, no NVIDIA/AMD)
            return False
        if mm.TOTAL_PINNED_MEMORY + nbytes > mm.MAX_PINNED_MEMORY and hasattr(mm, "ensure_pin_registerable"):
            mm.ensure_pin_registerable(nbytes)
        if mm.TOTAL_PINNED_MEMORY + nbytes > mm.MAX_PINNED_MEMORY:
            return False
        mm.PINNED_MEMORY[ptr] = nbytes
        mm.TOTAL_PINNED_MEMORY += nbytes
        return True

    def release(self, ptr: int) -> None:
        nbytes = self.mm.PINNED_MEMORY.pop(ptr, None)
        if nbytes is not None:
            self.mm.TOTAL_PINNED_MEMORY -= nbytes


# ----- host RAM (home=auto) -------------------------------------------------------------
CPU = torch.device("cpu")


def ram_available() -> int:
    """Host RAM available now, as ComfyUI counts it: its cgroup-aware `comfy.system_memory`
    where it has one (newer ComfyUI), else its CPU free memory (psutil's available)."""
    try:
        import comfy.system_memory as system_memory
        return int(system_memory.virtual_memory_available())
    except (ImportError, AttributeError):
        return int(comfy.model_management.get_free_memory(CPU))


def ram_total() -> int:
    return int(comfy.model_management.get_total_memory(CPU))


def ram_kept_by_comfy() -> int:
    """RAM ComfyUI keeps available for itself: the RAM cache's headroom while a prompt runs
    (`comfy.memory_management.RAM_CACHE_HEADROOM`, 0.33 and later), else what --cache-ram
    asks for (0.33+: default min(10, max(2, 10% of RAM)) GB unless another cache is chosen;
    0.3.75: only when given)."""
    try:
        import comfy.memory_management as memory_management
        headroom = int(getattr(memory_management, "RAM_CACHE_HEADROOM", 0) or 0)
        if headroom > 0:
            return headroom
    except ImportError:
        pass
    args = comfy.cli_args.args
    cache_ram = getattr(args, "cache_ram", None)
    if isinstance(cache_ram, list):
        if getattr(args, "cache_classic", False) or getattr(args, "cache_none", False) \
                or (getattr(args, "cache_lru", 0) or 0) > 0:
            return 0
        gb = cache_ram[0] if cache_ram else min(10.0, max(2.0, ram_total() / 2**30 * 0.10))
        return int(gb * 2**30)
    return int(cache_ram * 2**30) if isinstance(cache_ram, (int, float)) and cache_ram > 0 else 0


# ----- sampling runs: the memory picture and wrappers ---------------------------------
def free_vram(device: torch.device) -> int:
    """Device memory free now, as ComfyUI counts it (its own and torch's caches included)."""
    return int(comfy.model_management.get_free_memory(device))


def reserved_vram(activations_measured: bool = False) -> int:
    """What ComfyUI keeps free beside a model's weights: its inference minimum, which holds
    --reserve-vram (`minimum_inference_memory`, else `extra_reserved_memory`). Once the
    activation peak is measured (what the allocator reserved, fragmentation included) the
    inference minimum's margin for activations is counted already: then only the reserve
    for others (`extra_reserved_memory`: the OS share and --reserve-vram)."""
    mm = comfy.model_management
    names = ("minimum_inference_memory", "extra_reserved_memory")
    for name in (names[::-1] if activations_measured else names):
        fn = getattr(mm, name, None)
        if fn is not None:
            return int(fn())
    return 0


ESTIMATE_CONDS = 2   # conds a step that sampler_helpers.estimate_memory's first figure is for (cond + uncond)
BATCH_MARGIN = 1.5   # calc_cond_batch batches while memory_required(batched) * 1.5 < the free memory


def activation_estimates(patcher, noise_shape, conds) -> tuple[int, int]:
    """ComfyUI's estimates of one model call's activations: (one cond at batch
    `noise_shape[0]`, ESTIMATE_CONDS conds batched), from `sampler_helpers.estimate_memory`
    (the first is what its partial load reserves)."""
    import comfy.sampler_helpers
    estimate = getattr(comfy.sampler_helpers, "estimate_memory", None)
    if estimate is not None:
        batched, single = estimate(patcher, noise_shape, conds)
        return int(single), int(batched)
    shape = list(noise_shape)
    return (int(patcher.model.memory_required(shape)),
            int(patcher.model.memory_required([shape[0] * ESTIMATE_CONDS] + shape[1:])))


# calc_cond_batch asks the sampled patcher (model.current_patcher.get_free_memory) from 0.33 on
PATCHER_ANSWERS_BATCHING = hasattr(comfy.model_patcher.ModelPatcher, "get_free_memory")


class _FreeMemoryFromPatcher:
    """comfy.model_management as comfy.samplers sees it inside one calc_cond_batch on a
    ComfyUI whose batching asks `model_management.get_free_memory` (0.3.75): that one
    question goes to the sampled patcher's `get_free_memory`, all else to the module."""

    def __init__(self, module, patcher):
        self._module, self._patcher = module, patcher

    def __getattr__(self, name):
        return getattr(self._module, name)

    def get_free_memory(self, dev=None, torch_free_too=False):
        if torch_free_too or dev is None:
            return self._module.get_free_memory(dev, torch_free_too)
        return self._patcher.get_free_memory(dev)


@contextlib.contextmanager
def batching_asks(patcher) -> Iterator[None]:
    """Within one calc_cond_batch, have ComfyUI's batching ask `patcher.get_free_memory`:
    it does by itself where PATCHER_ANSWERS_BATCHING; before that, comfy.samplers' own
    reference to model_management is swapped for the call (the only use of it there)."""
    import comfy.samplers
    module = getattr(comfy.samplers, "model_management", None)
    if PATCHER_ANSWERS_BATCHING or module is None or not hasattr(module, "get_free_memory"):
        yield
        return
    comfy.samplers.model_management = _FreeMemoryFromPatcher(module, patcher)
    try:
        yield
    finally:
        comfy.samplers.model_management = module


def patcher_free_memory(patcher, device: torch.device) -> int:
    """What ComfyUI's own patcher class would answer to get_free_memory (0.33: free memory
    plus what dynamic VRAM could evict), else the device's free memory."""
    fn = getattr(comfy.model_patcher.ModelPatcher, "get_free_memory", None)
    return int(fn(patcher, device)) if fn is not None else free_vram(device)


def sampling_steps(executor, args: tuple, kwargs: dict) -> int | None:
    """Steps of a sampling run, from the `sigmas` argument of the function an OUTER_SAMPLE
    wrapper's executor runs (CFGGuider.outer_sample), found by name in its signature; None
    where it has none."""
    try:
        bound = inspect.signature(executor.original).bind_partial(*args, **kwargs)
    except (AttributeError, TypeError, ValueError):
        return None
    sigmas = bound.arguments.get("sigmas")
    return max(0, len(sigmas) - 1) if isinstance(sigmas, torch.Tensor) and sigmas.ndim == 1 else None


def can_wrap(patcher) -> bool:
    """Does this ComfyUI run ModelPatcher wrappers around prepare_sampling and apply_model?"""
    import comfy.patcher_extension
    kinds = getattr(comfy.patcher_extension, "WrappersMP", None)
    return (hasattr(patcher, "add_wrapper_with_key") and kinds is not None
            and all(hasattr(kinds, k) for k in ("PREPARE_SAMPLING", "APPLY_MODEL")))


def spatial_downscale(latent_format) -> int:
    """Pixels per latent cell along a side (`spacial_downscale_ratio` where the format has
    it, from 0.33 on; before that 8, ComfyUI's VAE default)."""
    return int(getattr(latent_format, "spacial_downscale_ratio", 8))


def temporal_downscale(latent_format) -> int:
    """Frames per latent frame of a video format (`temporal_downscale_ratio`; else 4, the
    causal video VAEs' 1 + 4k frames)."""
    ratio = getattr(latent_format, "temporal_downscale_ratio", None)
    return int(ratio) if ratio and ratio > 1 else 4


# ----- the server and its websocket clients -------------------------------------------
def prompt_server():
    """ComfyUI's running PromptServer, or None (imported in-process, no server)."""
    server = sys.modules.get("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def client_connected(sid: str) -> bool:
    """Is the websocket client `sid` connected now (`PromptServer.instance.sockets`)?"""
    sockets = getattr(prompt_server(), "sockets", None)
    return isinstance(sockets, dict) and sid in sockets


def send_to_client(event: str, data: dict, sid: str | None = None) -> None:
    """Send a websocket message to client `sid` (None: every client), from any thread."""
    instance = prompt_server()
    if instance is not None:
        instance.send_sync(event, data, sid)
