"""The fused LoRA fold (CUDA's path) checked on the CPU against ComfyUI's own patching: each
plain LoRA weight of a tiny Wan, folded by a PlainOp that fuses on the CPU too."""
import torch

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.lora.apply import apply_lora
from ringswap.lora.fold_ops import PlainOp
from support.fold_probe import close_in_ulps
from support.lora_files import build_lora, from_diffusers_names
from wan_model import load_stock, patched_weights, tiny_wan


class CpuFusedOp(PlainOp):
    fused_devices = frozenset({"cpu", "cuda"})


def test_fused_fold_within_one_ulp_of_comfyui(tmp_path):
    path = tiny_wan(str(tmp_path), blocks=4)
    sd = build_lora("kohya", blocks=4)
    stock = load_stock(path)
    base = {k: v.clone() for k, v in stock.model.state_dict().items()}
    weights = patched_weights(stock, from_diffusers_names(sd), 0.8, lambda k: k.startswith("diffusion_model.blocks."))
    model = apply_lora(load_swapped_model(path, SwapSettings(1, 1), home="ram"), sd, 0.8)
    ops = [op for ops in model.block_folder_on(torch.device("cpu")).ops.values() for op in ops]
    assert ops and all(isinstance(op, PlainOp) and op.pairs is not None for op in ops), "not all plain pairs"
    for op in ops:
        fused = CpuFusedOp(op.key, op.patches, 0, op.patch_dtype)
        w = base[op.key].clone()
        fused([w])
        assert fused.fused(w)
        assert close_in_ulps(w, weights[op.key], 1), op.key
        assert not torch.equal(w, base[op.key]), op.key
    assert {op.key for op in ops} == set(weights)
