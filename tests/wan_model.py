"""Shared helpers for tests on a tiny Wan model loaded by ComfyUI's stock loader."""
import os

import torch

import comfy.model_management
import comfy.sd

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
        from ringswap.loaders.comfy_features import static_construction
        with static_construction():
            return comfy.sd.load_diffusion_model(path)
    return comfy.sd.load_diffusion_model(path)


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
