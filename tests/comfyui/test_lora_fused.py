"""The fused LoRA fold (CUDA's path) checked on the CPU against ComfyUI's own patching."""
import comfy.model_management
import comfy.sd

import ringswap.lora.fold_ops as fold_ops
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.lora.apply import apply_lora
from support.lora_files import build_lora, from_diffusers_names
from test_lora import FoldProbe
from wan_model import forward, inputs, load_stock, patched_weights, tiny_wan


def test_fused_fold_within_one_ulp_of_comfyui(tmp_path, monkeypatch):
    monkeypatch.setattr(fold_ops, "FUSED_DEVICES", {"cpu"})
    path = tiny_wan(str(tmp_path), blocks=4)
    sd = build_lora("kohya", blocks=4)
    stock = load_stock(path)
    weights = patched_weights(stock, from_diffusers_names(sd), 0.8, lambda k: k.startswith("diffusion_model.blocks."))
    model = apply_lora(load_swapped_model(path, SwapSettings(1, 1), home="ram"), sd, 0.8)
    folder = model._block_folder(model.load_device)
    assert all(op.pairs is not None for ops in folder.ops.values() for op in ops), "not all plain pairs"
    probe = FoldProbe(model, weights, ulps=1)
    try:
        forward(model, *inputs(seed=0))
    finally:
        probe.remove()
    assert not probe.bad, probe.bad[:4]
    assert all(probe.checks)
