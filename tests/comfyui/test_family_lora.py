"""A LoRA on a two-list family (Flux, HunyuanVideo) touching blocks of both lists and a
non-block weight: through RingSwap Patch it equals ComfyUI's own LoRA patching bit for bit
on the CPU, at every window. The LoRA uses ComfyUI's own key names for the model
(`comfy.lora.model_lora_keys_unet`), so the keys are those ComfyUI maps for this family.
"""
import pytest
import torch

import comfy.lora
import comfy.model_management
import comfy.sd

from ringswap.nodes.patch import RingSwapPatch
from support.family_models import BY_NAME, build, forward

CPU = comfy.model_management.get_torch_device().type == "cpu"


def lora_for(patcher, lists, rank=4, seed=0) -> dict:
    """lora_up/lora_down pairs for every 2-D weight in the first block of each list and in
    one non-block Linear, under the names ComfyUI maps for this model."""
    key_map = comfy.lora.model_lora_keys_unet(patcher.model, {})
    sd = patcher.model.state_dict()
    wanted = [f"diffusion_model.{name}.{j}." for name in lists for j in (0, 1)]
    g = torch.Generator().manual_seed(seed)
    lora, blocks_hit, nonblock_hit = {}, set(), False
    for lora_key, weight_key in sorted(key_map.items()):
        if not isinstance(weight_key, str) or not lora_key.startswith("diffusion_model.") or weight_key not in sd:
            continue
        w = sd[weight_key]
        if w.ndim != 2:
            continue
        block = next((p for p in wanted if weight_key.startswith(p)), None)
        if block is None and (nonblock_hit or any(weight_key.startswith(f"diffusion_model.{n}.") for n in lists)):
            continue
        out, inn = w.shape
        lora[f"{lora_key}.lora_up.weight"] = torch.randn(out, rank, generator=g) * 0.1
        lora[f"{lora_key}.lora_down.weight"] = torch.randn(rank, inn, generator=g) * 0.1
        if block is None:
            nonblock_hit = True
        else:
            blocks_hit.add(block)
    assert blocks_hit == set(wanted) and nonblock_hit, (blocks_hit, nonblock_hit)
    return lora


@pytest.mark.parametrize("name", ["flux", "hunyuan_video"])
def test_two_list_lora_equals_comfyui_patching(name):
    family = BY_NAME[name]
    if family.missing():
        pytest.skip(family.missing())
    stock = build(family)
    lora = lora_for(stock, family.lists)
    inputs = family.inputs(seed=3)
    plain = forward(stock, *inputs)
    ref_model, _ = comfy.sd.load_lora_for_models(stock, None, lora, 0.8, 0)
    ref = forward(ref_model, *inputs)
    comfy.model_management.unload_all_models()
    assert not torch.equal(ref, plain), "the LoRA changes the output"
    blocks = sum(len(getattr(stock.model.diffusion_model, n)) for n in family.lists)
    for window in (1, 2, blocks):
        (swapped,) = RingSwapPatch().patch(stock, window, 1, "auto")
        lora_model, _ = comfy.sd.load_lora_for_models(swapped, None, lora, 0.8, 0)
        for _ in range(2):
            out = forward(lora_model, *inputs)
            if CPU:
                assert torch.equal(out, ref), (name, window)
            else:
                assert ((out - ref).norm() / ref.norm()).item() <= 1e-3, (name, window)
        comfy.model_management.unload_all_models()
