"""LoRA folds on CUDA: equal to ComfyUI's own patching on the same GPU (what a fold costs:
bench/probes/fold.py)."""
import pytest
import torch

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.lora.apply import apply_lora
from support.fold_probe import FoldProbe
from support.lora_files import build_lora, from_diffusers_names
from wan_model import forward, inputs, load_stock, patched_weights, tiny_wan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype, compress", [(torch.bfloat16, "off"), (torch.float32, "off"), (torch.bfloat16, "on")])
def test_cuda_fold_equals_comfyui_patching(tmp_path, dtype, compress):
    """compress on: the blocks land coded, are decoded, then folded, with the same bound."""
    from ringswap.swap.plane_coder import coder_missing
    if compress == "on" and coder_missing():
        pytest.skip("needs nvCOMP (scripts/prepare_nvcomp_wheels.sh)")
    dim, ffn_dim = (512, 2048) if compress == "on" else (128, 256)   # blocks large enough to code
    path = tiny_wan(str(tmp_path), blocks=4, dim=dim, ffn_dim=ffn_dim, dtype=dtype)
    sd = build_lora("mixed", dim=dim, ffn_dim=ffn_dim, blocks=4)
    stock = load_stock(path)
    ref, _ = comfy.sd.load_lora_for_models(stock, None, from_diffusers_names(sd), 1.0, 0)
    want = forward(ref, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    weights = patched_weights(stock, from_diffusers_names(sd), 1.0)
    for window, prefetch in ((1, 1), (2, 1), (4, 0)):
        model = apply_lora(load_swapped_model(path, SwapSettings(window, prefetch, compress=compress), home="ram"),
                           sd, 1.0)
        # plain LoRA pairs fold with a fused addmm_ on CUDA: within one unit in the last place
        probe = FoldProbe(model, {k: w for k, w in weights.items() if k.startswith("diffusion_model.blocks.")},
                          ulps=1)
        try:
            outs = [forward(model, *inputs(seed=0)) for _ in range(2)]
        finally:
            probe.remove()
        assert not probe.bad, probe.bad[:4]
        assert bool(model.swap_engine.pool.coded) == (compress == "on" and window < 4)
        for out in outs:
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err <= 1e-3, (window, prefetch, err)   # one ulp per folded weight, see lora/fold_ops.py
        comfy.model_management.unload_all_models()
