"""LoRA key names: ComfyUI's own key map, plus Wan's diffusers names.

ComfyUI (`comfy.lora.model_lora_keys_unet`) maps, for Wan, the model's own module names
(`diffusion_model.blocks.0.self_attn.q`, with any of the lora_up/down, lora_A/B, ...
suffixes) and kohya names (`lora_unet_blocks_0_self_attn_q`), but not the names of
diffusers' `WanTransformer3DModel` (`blocks.0.attn1.to_q`, `ffn.net.0.proj`, ...), which
LoRAs trained with diffusers/PEFT carry. This module adds those, as extra entries of the
same key map (never replacing one of ComfyUI's), so ComfyUI's `load_lora` does the rest.
diffusers renamed Wan's norms: its `norm2` is Wan's `norm3` (the cross-attention norm)
and the other way round; `attn1` is self-attention, `attn2` cross-attention.
"""
from __future__ import annotations

import re

import comfy.lora
import comfy.model_base

# Wan module path inside a block -> diffusers name (diffusers' convert_wan_to_diffusers.py)
WAN_BLOCK_TO_DIFFUSERS = {
    "self_attn.q": "attn1.to_q",
    "self_attn.k": "attn1.to_k",
    "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "self_attn.norm_q": "attn1.norm_q",
    "self_attn.norm_k": "attn1.norm_k",
    "cross_attn.q": "attn2.to_q",
    "cross_attn.k": "attn2.to_k",
    "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.norm_q": "attn2.norm_q",
    "cross_attn.norm_k": "attn2.norm_k",
    "cross_attn.k_img": "attn2.add_k_proj",
    "cross_attn.v_img": "attn2.add_v_proj",
    "cross_attn.norm_k_img": "attn2.norm_added_k",
    "ffn.0": "ffn.net.0.proj",
    "ffn.2": "ffn.net.2",
    "norm3": "norm2",
    "modulation": "scale_shift_table",
}
WAN_TOP_TO_DIFFUSERS = {
    "patch_embedding": "patch_embedding",
    "text_embedding.0": "condition_embedder.text_embedder.linear_1",
    "text_embedding.2": "condition_embedder.text_embedder.linear_2",
    "time_embedding.0": "condition_embedder.time_embedder.linear_1",
    "time_embedding.2": "condition_embedder.time_embedder.linear_2",
    "time_projection.1": "condition_embedder.time_proj",
    "head.head": "proj_out",
    "head.modulation": "scale_shift_table",
    "img_emb.proj.0": "condition_embedder.image_embedder.norm1",
    "img_emb.proj.1": "condition_embedder.image_embedder.ff.net.0.proj",
    "img_emb.proj.3": "condition_embedder.image_embedder.ff.net.2",
    "img_emb.proj.4": "condition_embedder.image_embedder.norm2",
}
DIFFUSERS_PREFIXES = ("", "transformer.", "diffusion_model.", "base_model.model.")
KOHYA_PREFIXES = ("lora_transformer_", "lora_unet_")

_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")


def _diffusers_name(module: str) -> str | None:
    m = _BLOCK.match(module)
    if m:
        sub = WAN_BLOCK_TO_DIFFUSERS.get(m.group(2))
        return None if sub is None else f"blocks.{m.group(1)}.{sub}"
    return WAN_TOP_TO_DIFFUSERS.get(module)


def wan_diffusers_keys(model) -> dict[str, str]:
    """{diffusers LoRA name: ComfyUI weight key} for a Wan model (a ComfyUI BaseModel);
    {} for any other model."""
    if not isinstance(model, comfy.model_base.WAN21):
        return {}
    out = {}
    for key in model.state_dict().keys():
        if not key.startswith("diffusion_model."):
            continue
        rest = key[len("diffusion_model."):]
        if rest.endswith(".weight"):
            name = _diffusers_name(rest[:-len(".weight")])
        elif rest.endswith(".bias"):
            continue                      # biases come with their weight (.diff_b)
        else:
            name = _diffusers_name(rest)  # bare parameters, e.g. modulation
        if name is None:
            continue
        for p in DIFFUSERS_PREFIXES:
            out[p + name] = key
        for p in KOHYA_PREFIXES:
            out[p + name.replace(".", "_")] = key
    return out


def model_key_map(model) -> dict[str, str]:
    """ComfyUI's LoRA key map of a diffusion model (a ComfyUI BaseModel), with Wan's
    diffusers names added where ComfyUI has no entry of its own."""
    key_map = comfy.lora.model_lora_keys_unet(model, {})
    for k, v in wan_diffusers_keys(model).items():
        key_map.setdefault(k, v)
    return key_map
