"""Tiny in-process instances of ComfyUI's own DiT families, for RingSwap tests.

Each family is built the way ComfyUI's loader builds a model (its model config class from
`comfy.supported_models`, `set_inference_dtype`, `get_model` -> its `comfy.model_base`
BaseModel subclass around the real `comfy.ldm` diffusion model) from a small unet_config
of the diffusion model's constructor arguments: ComfyUI's detection hard-codes real sizes
(e.g. Flux's 24 heads), so tiny files would not load through the stock loader. Every
state-dict tensor is then set from a seeded generator (std 0.02, norm weights ~1), as
tests/support/wan_files.py does; the model is built statically under dynamic VRAM.

The caller must have put ComfyUI's folder on sys.path (tests/conftest.py does).
"""
from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable

import torch

import comfy.model_management
import comfy.model_patcher
import comfy.supported_models

from ringswap.loaders.comfyui_adapter import comfy_models

WEIGHT_STD = 0.02
Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]


@dataclass(frozen=True)
class Family:
    name: str                       # test id
    config: str                     # model config class in comfy.supported_models
    module: str                     # comfy.ldm module of the diffusion model
    dm_class: str                   # its diffusion model class
    lists: tuple[str, ...]          # the block lists, in call order
    unet_config: dict
    make_inputs: Callable[[torch.Generator], Inputs] = field(repr=False)
    params: str | None = None       # the constructor's params dataclass, where it has one...
    newer: dict = field(default_factory=dict)   # ...and arguments passed only where it has the field
    block_calls: int = 0            # block forwards per model call; 0: each block once

    def constructor_config(self) -> dict:
        """unet_config plus the `newer` arguments this ComfyUI's params dataclass has."""
        config = dict(self.unet_config)
        params = getattr(importlib.import_module(self.module), self.params or "", None)
        if self.newer and dataclasses.is_dataclass(params):
            names = {f.name for f in dataclasses.fields(params)}
            config.update({k: v for k, v in self.newer.items() if k in names})
        return config

    def missing(self) -> str | None:
        """Why this ComfyUI cannot build the family (what is missing), else None."""
        if not hasattr(comfy.supported_models, self.config):
            return f"comfy.supported_models has no {self.config}"
        try:
            mod = importlib.import_module(self.module)
        except ImportError as e:
            return f"no module {self.module} ({e})"
        if not hasattr(mod, self.dm_class):
            return f"{self.module} has no {self.dm_class}"
        return None

    def inputs(self, seed: int, device=None) -> Inputs:
        """(x, sigma, context, extra apply_model kwargs), the same for the same seed."""
        device = device or comfy.model_management.get_torch_device()
        x, sigma, ctx, extra = self.make_inputs(torch.Generator().manual_seed(seed))
        move = (lambda v: v.to(device) if torch.is_tensor(v) else v)
        return move(x), move(sigma), move(ctx), {k: move(v) for k, v in extra.items()}


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _image(g):
    return _randn(g, 1, 16, 8, 8)   # a Flux-format latent: 16 channels, 64x64 pixels


def _flux_inputs(g):
    return _image(g), torch.tensor([0.7]), _randn(g, 1, 8, 64), {
        "y": _randn(g, 1, 32), "guidance": torch.tensor([3.5])}


def _chroma_inputs(g):
    return _image(g), torch.tensor([0.7]), _randn(g, 1, 8, 64), {"guidance": torch.tensor([0.0])}


def _hidream_inputs(g):
    return _image(g), torch.tensor([0.7]), _randn(g, 1, 8, 64), {
        "y": _randn(g, 1, 32), "encoder_hidden_states_llama3": _randn(g, 1, 4, 8, 48)}


def _qwen_inputs(g):
    return _randn(g, 1, 16, 1, 8, 8), torch.tensor([0.7]), _randn(g, 1, 8, 48), {}


def _lumina_inputs(g):
    return _image(g), torch.tensor([0.7]), _randn(g, 1, 8, 48), {"num_tokens": 8}


def _hunyuan_inputs(g):
    return _randn(g, 1, 16, 2, 8, 8), torch.tensor([0.7]), _randn(g, 1, 8, 48), {
        "y": _randn(g, 1, 32), "guidance": torch.tensor([6.0])}


def _ltxv_inputs(g):
    return _randn(g, 1, 128, 2, 4, 4), torch.tensor([0.7]), _randn(g, 1, 8, 64), {
        "attention_mask": None, "frame_rate": 25}


VACE_MAIN, VACE_BLOCKS, VACE_IN = 4, 2, 96     # vace block k runs after main block 2k
VACE_STRENGTH = [1.0, 0.5]                    # two vace contexts: each vace block runs twice


def _vace_inputs(g):
    ctx = _randn(g, 1, len(VACE_STRENGTH), VACE_IN, 2, 8, 8)   # (batch, contexts, channels, t, h, w)
    return _randn(g, 1, 16, 2, 8, 8), torch.tensor([0.7]), _randn(g, 1, 8, 64), {
        "vace_context": ctx, "vace_strength": list(VACE_STRENGTH)}


ROPE_32 = [8, 12, 12]   # axes of a 32-wide attention head

FAMILIES = [
    Family("qwen_image", "QwenImage", "comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel",
           ("transformer_blocks",),
           dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=4,
                attention_head_dim=32, num_attention_heads=2, joint_attention_dim=48,
                axes_dims_rope=tuple(ROPE_32)), _qwen_inputs),
    Family("chroma", "Chroma", "comfy.ldm.chroma.model", "Chroma", ("double_blocks", "single_blocks"),
           dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=64, hidden_size=64,
                mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=ROPE_32, theta=10000,
                patch_size=2, qkv_bias=True, in_dim=64, out_dim=64, hidden_dim=64, n_layers=2),
           _chroma_inputs, "ChromaParams", dict(txt_ids_dims=[], vec_in_dim=None)),
    Family("hidream", "HiDream", "comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel",
           ("double_stream_blocks", "single_stream_blocks"),
           dict(image_model="hidream", patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                num_single_layers=2, attention_head_dim=32, num_attention_heads=2, caption_channels=[64, 48],
                text_emb_dim=32, num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[16, 8, 8],
                max_resolution=[16, 16], llama_layers=[0, 1, 2, 3]), _hidream_inputs),
    Family("lumina2", "Lumina2", "comfy.ldm.lumina.model", "NextDiT", ("layers",),
           dict(image_model="lumina2", patch_size=2, in_channels=16, dim=64, n_layers=4, n_refiner_layers=1,
                n_heads=2, n_kv_heads=1, multiple_of=16, ffn_dim_multiplier=2.0, qk_norm=True, cap_feat_dim=48,
                axes_dims=ROPE_32, axes_lens=[64, 64, 64], rope_theta=10000.0), _lumina_inputs),
    Family("z_image", "ZImage", "comfy.ldm.lumina.model", "NextDiT", ("layers",),
           # Z-Image's modulation takes min(dim, 256) features of a 256-wide time embedding: dim >= 256
           dict(image_model="lumina2", patch_size=2, in_channels=16, dim=256, n_layers=4, n_refiner_layers=1,
                n_heads=8, n_kv_heads=8, multiple_of=16, ffn_dim_multiplier=1.0, qk_norm=True,
                cap_feat_dim=48, axes_dims=ROPE_32, axes_lens=[64, 64, 64], rope_theta=256.0,
                z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32), _lumina_inputs),
    Family("flux", "Flux", "comfy.ldm.flux.model", "Flux", ("double_blocks", "single_blocks"),
           dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=ROPE_32,
                theta=10000, patch_size=2, qkv_bias=True, guidance_embed=True), _flux_inputs,
           "FluxParams", dict(txt_ids_dims=[])),
    Family("hunyuan_video", "HunyuanVideo", "comfy.ldm.hunyuan_video.model", "HunyuanVideo",
           ("double_blocks", "single_blocks"),
           dict(image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=48,
                hidden_size=64, mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=ROPE_32,
                theta=256, patch_size=[1, 2, 2], qkv_bias=True, guidance_embed=True, byt5=False,
                meanflow=False, use_cond_type_embedding=False, vision_in_dim=None), _hunyuan_inputs,
           "HunyuanVideoParams", dict(meanflow_sum=False)),
    Family("ltxv", "LTXV", "comfy.ldm.lightricks.model", "LTXVModel", ("transformer_blocks",),
           dict(image_model="ltxv", in_channels=128, cross_attention_dim=64, attention_head_dim=32,
                num_attention_heads=2, caption_channels=64, num_layers=4), _ltxv_inputs),
    Family("wan_vace", "WAN21_Vace", "comfy.ldm.wan.model", "VaceWanModel", ("blocks", "vace_blocks"),
           dict(image_model="wan2.1", model_type="vace", patch_size=(1, 2, 2), in_dim=16, dim=64, ffn_dim=128,
                freq_dim=256, text_dim=64, out_dim=16, num_heads=2, num_layers=VACE_MAIN,
                window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6,
                vace_layers=VACE_BLOCKS, vace_in_dim=VACE_IN), _vace_inputs,
           block_calls=VACE_MAIN + VACE_BLOCKS * len(VACE_STRENGTH)),
]
BY_NAME = {f.name: f for f in FAMILIES}


def _norm_weights(module: torch.nn.Module) -> set[int]:
    """ids of the affine weights/scales of every norm layer (LayerNorm, RMSNorm, ...)."""
    out = set()
    for m in module.modules():
        if "norm" in type(m).__name__.lower():
            for name, p in m.named_parameters(recurse=False):
                if name in ("weight", "scale"):
                    out.add(id(p))
    return out


def build(family: Family, seed: int = 0, dtype: torch.dtype = torch.float32,
          init_device="cpu") -> comfy.model_patcher.ModelPatcher:
    """A plain ModelPatcher around a seeded random `family` model in `dtype`, on the CPU
    (its offload device). The random values are drawn on `init_device` (a GPU draws the
    billions of a real-width model in milliseconds; its values differ from the CPU's)."""
    reason = family.missing()
    if reason:
        raise RuntimeError(f"cannot build {family.name}: {reason}")
    load_device = comfy.model_management.get_torch_device()
    config = getattr(comfy.supported_models, family.config)(family.constructor_config())
    comfy_models.set_inference_dtype(config, dtype, None, load_device)
    with comfy_models.static_construction():
        model = config.get_model({})
    dm = model.diffusion_model
    norms = _norm_weights(dm)
    gen = torch.Generator(device=init_device).manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(dm.state_dict(keep_vars=True).items()):
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32, device=init_device) * WEIGHT_STD
            if id(t) in norms:
                noise += 1.0
            t.copy_(noise.to(t.dtype))
    return comfy.model_patcher.ModelPatcher(model, load_device=load_device,
                                            offload_device=comfy.model_management.unet_offload_device())


def forward(patcher, x, sigma, ctx, extra: dict) -> torch.Tensor:
    """One model call through ComfyUI: load the patcher, then apply_model."""
    comfy.model_management.load_models_gpu([patcher])
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=ctx, **extra).clone()


def block_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
