"""Shared helpers for tests on a tiny Wan model loaded by ComfyUI's stock loader."""
import os

import torch

import comfy.model_management
import comfy.sd
import comfy.utils

from support.wan_files import write_tiny_wan

BLOCKS = 5


def tiny_wan(tmp_dir, blocks=BLOCKS, dim=128, ffn_dim=256, seed=0, dtype=torch.float32) -> str:
    path = os.path.join(tmp_dir, f"wan_d{dim}_b{blocks}_s{seed}.safetensors")
    if not os.path.exists(path):
        write_tiny_wan(path, dim=dim, num_layers=blocks, ffn_dim=ffn_dim, dtype=dtype, seed=seed)
    return path


def load_stock(path):
    """The stock Load Diffusion Model path (UNETLoader), as a user of this ComfyUI gets it.
    With dynamic VRAM started on a CPU-only machine (RINGSWAP_DYNAMIC_VRAM=1 in CI), which
    ComfyUI's main.py never does, its lazy ops would keep the file's dtype uncast under a
    static patcher; the CPU user's model is built without them (what main.py gives a CPU)."""
    if os.environ.get("RINGSWAP_DYNAMIC_VRAM") == "1" and not torch.cuda.is_available():
        return load_static(path)
    return comfy.sd.load_diffusion_model(path)


def load_static(path, model_options=None):
    """ComfyUI's static load of `path`: what --disable-dynamic-vram (or a CPU) gives."""
    from ringswap.loaders.comfyui_adapter import comfy_features as features
    from ringswap.loaders.comfyui_adapter import comfy_models
    kwargs = {"disable_dynamic": True} if features.has_arg(comfy.sd.load_diffusion_model, "disable_dynamic") else {}
    with comfy_models.static_construction():
        return comfy.sd.load_diffusion_model(path, model_options=model_options or {}, **kwargs)


def static_twin(patcher):
    """ComfyUI's static load (as with --disable-dynamic-vram) of the file a dynamic-VRAM
    MODEL came from; any other MODEL itself. Under dynamic VRAM ComfyUI patches LoRAs at
    use in the compute dtype and never stores patched weights: weight-level references
    come from the static twin, outputs from the dynamic MODEL."""
    from ringswap.loaders.comfyui_adapter import comfy_features as features
    from ringswap.loaders.comfyui_adapter import comfy_models
    if not features.is_dynamic(patcher):
        return patcher
    return load_static(*comfy_models.source_file(patcher))


def patched_weights(stock, lora_sd, strength, keys=lambda k: True):
    """ComfyUI's own patched block/non-block weights for `lora_sd` (after one forward)."""
    ref, _ = comfy.sd.load_lora_for_models(static_twin(stock), None, lora_sd, strength, 0)
    with torch.no_grad():
        forward(ref, *inputs(seed=0))
    weights = {k: comfy.utils.get_attr(ref.model, k).detach().clone() for k in ref.patches if keys(k)}
    comfy.model_management.unload_all_models()
    return weights


def inputs(seed=1, frames=2, size=8, ctx_len=8, device=None):
    device = device or comfy.model_management.get_torch_device()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, frames, size, size, generator=g).to(device)
    ctx = torch.randn(1, ctx_len, 4096, generator=g).to(device)
    sigma = torch.tensor([0.7]).to(device)
    return x, sigma, ctx


def forward(patcher, x, sigma, ctx):
    comfy.model_management.load_models_gpu([patcher])
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=ctx).clone()


def conditioning(seed, length=8):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(1, length, 4096, generator=g), {}]]


def latent(frames=2, size=8):
    return {"samples": torch.zeros(1, 16, frames, size, size)}
