"""ComfyUI's models as RingSwap builds and reads them: quantized checkpoint conversion, the
dtypes ComfyUI chooses, building statically beside dynamic VRAM, and what a dynamic VRAM
MODEL was made from. Where ComfyUI versions differ, comfy_features says which way to go.
"""
from __future__ import annotations

import contextlib
import threading
import types
from typing import Iterator

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.sd
import comfy.utils

from . import comfy_features as features


# ----- quantized checkpoints and dtypes ------------------------------------------------------
def convert_old_quants(sd: dict, metadata: dict) -> tuple[dict, dict]:
    """ComfyUI's own conversion of scaled fp8 / `_quantization_metadata` checkpoints to
    per-layer `.comfy_quant` + `weight_scale`, where it has one; else unchanged."""
    if not features.CONVERTS_OLD_QUANTS:
        return sd, metadata
    sd, metadata = comfy.utils.convert_old_quants(sd, "", metadata=dict(metadata))
    return sd, metadata or {}


def layer_quant_config(model_config) -> dict | None:
    """The model config's per-layer quantization, where this ComfyUI has one."""
    attr = features.QUANT_CONFIG_ATTR
    return getattr(model_config, attr) if attr else None


def drops_weight_dtype(model_config) -> bool:
    """Does ComfyUI's loader leave the file's weight dtype out of its dtype choice? It
    does for quantized checkpoints: 0.33 when a quant config exists, 0.3.75 for scaled fp8."""
    if features.CONVERTS_OLD_QUANTS:
        return layer_quant_config(model_config) is not None
    return getattr(model_config, "scaled_fp8", None) is not None


def set_inference_dtype(model_config, dtype, manual_cast_dtype, device: torch.device) -> None:
    """model_config.set_inference_dtype, with the device where this ComfyUI takes one."""
    if features.SET_DTYPE_TAKES_DEVICE:
        model_config.set_inference_dtype(dtype, manual_cast_dtype, device=device)
    else:
        model_config.set_inference_dtype(dtype, manual_cast_dtype)


def lora_patch_dtype(device: torch.device) -> torch.dtype:
    """The dtype ComfyUI patches (LoRA) weights in on `device`: 0.33's `lora_compute_dtype`
    (float16 where the device runs it), float32 before it had one."""
    if features.HAS_LORA_COMPUTE_DTYPE:
        return comfy.model_management.lora_compute_dtype(device)
    return torch.float32


def inference_dtype(base_model) -> torch.dtype:
    """The dtype a model's layers get their inputs in (0.33's `get_dtype_inference`; before
    it, the manual-cast dtype where set, else the model's own), as `_apply_model` casts."""
    fn = getattr(base_model, "get_dtype_inference", None)
    if callable(fn):
        return fn()
    return getattr(base_model, "manual_cast_dtype", None) or base_model.get_dtype()


# ----- building statically beside dynamic VRAM ----------------------------------------------
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
    mm = features.memory_management
    if not features.HAS_AIMDO_FLAG or not mm.aimdo_enabled:
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


# ----- MODELs built for dynamic VRAM ----------------------------------------------------------
def built_for_dynamic_vram(patcher) -> bool:
    """Is this MODEL dynamic, or were its layers built by dynamic VRAM's lazy ops (which
    keep the file's tensors uncast; ComfyUI gives CPU-only models a static patcher)?"""
    if features.is_dynamic(patcher):
        return True
    dm = getattr(getattr(patcher, "model", None), "diffusion_model", None)
    return dm is not None and any(getattr(m, "comfy_need_lazy_init_bias", None) is not None for m in dm.modules())


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


def clone_onto(patcher, onto) -> comfy.model_patcher.ModelPatcher:
    """A static ModelPatcher clone of `patcher` (patches, options, wrappers, callbacks...)
    whose model is `onto`'s instead of its own, sharing `onto`'s weight backups as ComfyUI's
    clones of one model do (with backups of its own, a clone would patch again the weights
    another clone left patched)."""
    if not features.CLONE_TAKES_MODEL:
        raise RuntimeError("RingSwap: this ComfyUI's ModelPatcher.clone cannot take another model")
    if features.CLONE_SHARES_BACKUPS:
        override = comfy.model_patcher.ModelPatcher.get_clone_model_override(onto)
    else:
        override = (onto.model, ({}, {}, {}, set()))
    kwargs = {"disable_dynamic": True} if features.CLONE_DISABLES_DYNAMIC else {}
    return comfy.model_patcher.ModelPatcher.clone(patcher, model_override=override, **kwargs)
