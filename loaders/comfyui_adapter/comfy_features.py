"""What this ComfyUI can do, probed once: does a function, argument or attribute exist?

The one place where version differences are asked, never by version number, so a newer
ComfyUI that keeps an interface keeps working. The modules that use ComfyUI's internals
ask these probes first: comfy_models (building models, dtypes, dynamic VRAM models),
comfy_memory (VRAM, RAM, pins, activation estimates), comfy_sampling (a run's steps and
latent shape) and comfy_server (the prompt server, its clients, its node classes).
"""
from __future__ import annotations

import functools
import inspect
import os

import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.supported_models_base
import comfy.utils

try:
    import comfy.memory_management as memory_management
except ImportError:   # ComfyUI without dynamic VRAM
    memory_management = None


def has_arg(fn, name: str) -> bool:
    """Does callable `fn` take an argument called `name`?"""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ----- quantized checkpoints and dtypes (0.33: convert_old_quants, quant_config; 0.3.75: layer_quant_config)
CONVERTS_OLD_QUANTS = hasattr(comfy.utils, "convert_old_quants")
# the model config attribute that holds per-layer quantization ("quant_config" from 0.33 on)
QUANT_CONFIG_ATTR = next((a for a in ("quant_config", "layer_quant_config")
                          if a in vars(comfy.supported_models_base.BASE)), None)
SET_DTYPE_TAKES_DEVICE = has_arg(comfy.supported_models_base.BASE.set_inference_dtype, "device")
# the dtype ComfyUI patches (LoRA) weights in, per device (0.33 on); float32 before
HAS_LORA_COMPUTE_DTYPE = hasattr(comfy.model_management, "lora_compute_dtype")


@functools.cache
def reads_comfy_quant() -> bool:
    """Does this ComfyUI build layers from per-layer `.comfy_quant` tensors itself?"""
    if CONVERTS_OLD_QUANTS:
        return True
    src = os.path.join(os.path.dirname(comfy.sd.__file__), "model_detection.py")
    with open(src, encoding="utf-8") as f:
        return "comfy_quant" in f.read()


# ----- dynamic VRAM (is_dynamic, cached_patcher_init, clone(model_override=), aimdo_enabled lazy ops)
def is_dynamic(patcher) -> bool:
    """Was this MODEL built for ComfyUI's dynamic VRAM (weights cast at use, from an mmap)?"""
    fn = getattr(patcher, "is_dynamic", None)
    return bool(fn()) if callable(fn) else False


HAS_AIMDO_FLAG = memory_management is not None and hasattr(memory_management, "aimdo_enabled")
CLONE_TAKES_MODEL = has_arg(comfy.model_patcher.ModelPatcher.clone, "model_override")
CLONE_DISABLES_DYNAMIC = has_arg(comfy.model_patcher.ModelPatcher.clone, "disable_dynamic")
# clones of one model share its weight backups through this (else: an override of our own)
CLONE_SHARES_BACKUPS = hasattr(comfy.model_patcher.ModelPatcher, "get_clone_model_override")


# ----- memory: ComfyUI's pin budget, its RAM figures, its batching question ------------------
PIN_BUDGET = all(hasattr(comfy.model_management, a)
                 for a in ("MAX_PINNED_MEMORY", "TOTAL_PINNED_MEMORY", "PINNED_MEMORY"))
ENSURES_PIN_ROOM = hasattr(comfy.model_management, "ensure_pin_registerable")
# the RAM cache's headroom while a prompt runs (0.33 on)
HAS_RAM_CACHE_HEADROOM = memory_management is not None and hasattr(memory_management, "RAM_CACHE_HEADROOM")
try:
    import comfy.system_memory as system_memory   # newer ComfyUI: RAM figures that respect cgroups
except ImportError:
    system_memory = None
COUNTS_CGROUP_RAM = system_memory is not None and hasattr(system_memory, "virtual_memory_available")
# calc_cond_batch asks the sampled patcher (model.current_patcher.get_free_memory) from 0.33 on
PATCHER_ANSWERS_BATCHING = hasattr(comfy.model_patcher.ModelPatcher, "get_free_memory")


# ----- sampling ------------------------------------------------------------------------------
def can_wrap(patcher) -> bool:
    """Does this ComfyUI run ModelPatcher wrappers around prepare_sampling and apply_model?"""
    import comfy.patcher_extension
    kinds = getattr(comfy.patcher_extension, "WrappersMP", None)
    return (hasattr(patcher, "add_wrapper_with_key") and kinds is not None
            and all(hasattr(kinds, k) for k in ("PREPARE_SAMPLING", "APPLY_MODEL")))
