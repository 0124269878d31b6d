"""Tiny DiT families shaped so that ComfyUI's stock detection accepts them as files.

Each is a family of support/family_models.py with the sizes the detection derives or
hard-codes (Wan: 128-wide heads, 4096-wide text; HunyuanVideo: a 768-wide vector; LTX-Video:
32 heads, a 4096-wide caption; Flux: 128-wide heads), written as a safetensors file with the
diffusion model's own state-dict keys (what ComfyUI's UNETLoader reads), plus what the
detection must build from that file: the model config class (Family.config) and the
`comfy.model_base` class. Files are 6-14 MB (float32, width 128, 4 blocks).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import torch
from safetensors.torch import save_file

import comfy.model_detection

from support import family_models as fm


@dataclass(frozen=True)
class FileFamily:
    family: fm.Family
    model_class: str                            # the comfy.model_base class detection builds
    attrs: dict = field(default_factory=dict)   # dotted path on the BaseModel -> the value it must have
    undetectable: Callable[[dict], str | None] = field(default=lambda sd: None, repr=False)

    @property
    def name(self) -> str:
        return self.family.name


def attr(obj, path: str):
    """`path` ("diffusion_model.blocks.0.cross_attn") looked up on obj; digits index lists."""
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def write(ff: FileFamily, path: str) -> str:
    """Build the tiny model in-process and write its diffusion model's state dict to `path`."""
    model = fm.build(ff.family)
    save_file({k: v.contiguous() for k, v in model.model.diffusion_model.state_dict().items()}, path)
    return path


def unsupported(ff: FileFamily, path: str) -> str | None:
    """Why this ComfyUI cannot load `path` as `ff` (a family it lacks, or a detection that
    fixes sizes a tiny file cannot have), else None."""
    reason = ff.family.missing()
    if reason:
        return reason
    from safetensors.torch import load_file
    return ff.undetectable(load_file(path))


def _text(g, width=4096):
    return torch.randn(1, 8, width, generator=g)


def _wan_video(g, channels):
    return torch.randn(1, channels, 2, 8, 8, generator=g)


def _vace_inputs(g):
    x, sigma, _, extra = fm._vace_inputs(g)
    return x, sigma, _text(g), extra   # Wan's detection: 4096-wide text


def _wan_i2v_inputs(g):
    # 36 input channels: the 16-channel latent plus ComfyUI's c_concat (4 mask + 16 image
    # channels); clip_fea feeds img_emb and the blocks' k_img / v_img attention
    return _wan_video(g, 16), torch.tensor([0.7]), _text(g), {
        "c_concat": _wan_video(g, 20), "clip_fea": torch.randn(1, 4, 1280, generator=g)}


def _wan22_ti2v_inputs(g):
    # 48-channel latent (Wan 2.2 VAE); a denoise mask gives per-token timesteps (WAN22.process_timestep)
    return _wan_video(g, 48), torch.tensor([0.7]), _text(g), {
        "denoise_mask": torch.rand(1, 1, 2, 8, 8, generator=g)}


def _hunyuan_inputs(g):
    x, sigma, ctx, extra = fm._hunyuan_inputs(g)
    return x, sigma, ctx, dict(extra, y=torch.randn(1, 768, generator=g))   # its detection: 768-wide vector


def _ltxv_inputs(g):
    x, sigma, _, extra = fm._ltxv_inputs(g)
    return x, sigma, _text(g), extra   # caption_channels: the constructor's default, 4096


def _flux_heads_fixed(sd) -> str | None:
    cfg = comfy.model_detection.detect_unet_config(sd, "")
    if cfg["num_heads"] * 128 != cfg["hidden_size"]:
        return (f"this ComfyUI's Flux detection fixes {cfg['num_heads']} heads of 128 (width 3072), not "
                f"width {cfg['hidden_size']} (tiny Flux: tests/test_families.py; real width: test_family_gpu.py)")
    return None


def _replace(name, make_inputs, **unet):
    base = fm.BY_NAME[name]
    return dataclasses.replace(base, unet_config=dict(base.unet_config, **unet), make_inputs=make_inputs)


WAN = dict(image_model="wan2.1", patch_size=(1, 2, 2), dim=128, ffn_dim=256, freq_dim=256, text_dim=4096,
           num_heads=1, num_layers=4, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6)


def _wan(name, config, unet, make_inputs):
    return fm.Family(name, config, "comfy.ldm.wan.model", "WanModel", ("blocks",), dict(WAN, **unet), make_inputs)


FILES = [
    FileFamily(_replace("wan_vace", _vace_inputs, dim=128, ffn_dim=256, num_heads=1, text_dim=4096),
               "WAN21_Vace"),
    FileFamily(_replace("hunyuan_video", _hunyuan_inputs, hidden_size=128, num_heads=1, axes_dim=[16, 56, 56],
                        vec_in_dim=768, mlp_ratio=4.0), "HunyuanVideo"),
    FileFamily(_replace("ltxv", _ltxv_inputs, num_attention_heads=32, attention_head_dim=4,
                        cross_attention_dim=128, caption_channels=4096), "LTXV"),
    FileFamily(_replace("flux", fm._flux_inputs, hidden_size=128, num_heads=1, axes_dim=[16, 56, 56],
                        mlp_ratio=4.0), "Flux", undetectable=_flux_heads_fixed),
    FileFamily(_wan("wan_i2v", "WAN21_I2V", dict(model_type="i2v", in_dim=36, out_dim=16), _wan_i2v_inputs),
               "WAN21", {"image_to_video": True, "diffusion_model.img_emb.proj.0.normalized_shape": (1280,),
                         "diffusion_model.blocks.0.cross_attn.__class__.__name__": "WanI2VCrossAttention"}),
    FileFamily(_wan("wan22_ti2v", "WAN22_T2V", dict(model_type="t2v", in_dim=48, out_dim=48), _wan22_ti2v_inputs),
               "WAN22", {"image_to_video": True, "latent_format.latent_channels": 48,
                         "diffusion_model.out_dim": 48, "diffusion_model.img_emb": None}),
]
BY_NAME = {ff.name: ff for ff in FILES}
