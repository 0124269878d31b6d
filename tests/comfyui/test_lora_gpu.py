"""LoRA folds on CUDA: equal to ComfyUI's own patching on the same GPU, and what a fold of a
Wan-14B block costs (printed; run with -s)."""
import time

import pytest
import torch

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.lora.apply import apply_lora
from ringswap.lora.fold_ops import KitchenOp, PlainOp, ScaledFp8Op, kitchen_from_float
from support.lora_files import LINEARS, build_lora, from_diffusers_names, kohya, linear_shape
from test_lora import FoldProbe
from wan_model import forward, inputs, load_stock, patched_weights, tiny_wan

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_fold_equals_comfyui_patching(tmp_path, dtype):
    path = tiny_wan(str(tmp_path), blocks=4, dtype=dtype)
    sd = build_lora("mixed", blocks=4)
    stock = load_stock(path)
    ref, _ = comfy.sd.load_lora_for_models(stock, None, from_diffusers_names(sd), 1.0, 0)
    want = forward(ref, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    weights = patched_weights(stock, from_diffusers_names(sd), 1.0)
    for window, prefetch in ((1, 1), (2, 1), (4, 0)):
        model = apply_lora(load_swapped_model(path, SwapSettings(window, prefetch), home="ram"), sd, 1.0)
        # plain LoRA pairs fold with a fused addmm_ on CUDA: within one unit in the last place
        probe = FoldProbe(model, {k: w for k, w in weights.items() if k.startswith("diffusion_model.blocks.")},
                          ulps=1)
        try:
            outs = [forward(model, *inputs(seed=0)) for _ in range(2)]
        finally:
            probe.remove()
        assert not probe.bad, probe.bad[:4]
        for out in outs:
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err <= 1e-3, (window, prefetch, err)   # one ulp per folded weight, see lora/fold_ops.py
        comfy.model_management.unload_all_models()


def _cuda_ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, (time.perf_counter() - t0) * 1e3 / reps


def test_fold_cost_per_wan14b_block():
    """Rank-64 LoRA on the 10 Linears of a Wan 2.1 14B block (dim 5120, ffn 13824)."""
    dev = torch.device("cuda")
    dim, ffn, rank = 5120, 13824, 64
    lora = {k: v.to(torch.bfloat16) for k, v in build_lora("kohya", dim=dim, ffn_dim=ffn, blocks=1, rank=rank).items()}
    key_map = {kohya(0, n): f"diffusion_model.blocks.0.{n}.weight" for n in LINEARS}
    patches = comfy.lora.load_lora(lora, key_map)
    on_gpu = {k: type(v)(v.loaded_keys, tuple(t.to(dev) if isinstance(t, torch.Tensor) else t for t in v.weights))
              for k, v in patches.items()}
    results = {}
    for base in ("bf16", "fp8", "nvfp4"):
        for where, pset in (("host", patches), ("gpu", on_gpu)):
            tensors, ops = [], []
            for n in LINEARS:
                key = f"diffusion_model.blocks.0.{n}.weight"
                w = torch.randn(linear_shape(n, dim, ffn), device=dev) * 0.02
                plist = ((1.0, pset[key], 1.0, None, None),)
                if base == "bf16":
                    ops.append(PlainOp(key, plist, len(tensors)))
                    tensors.append(w.to(torch.bfloat16))
                elif base == "fp8":
                    scale = w.abs().amax() / 448.0
                    ops.append(ScaledFp8Op(key, plist, len(tensors), len(tensors) + 1))
                    tensors += [(w / scale).to(torch.float8_e4m3fn), scale.reshape(())]
                else:
                    q = kitchen_from_float(w, "TensorCoreNVFP4Layout")
                    p = q._params
                    fields = ("scale", "block_scale")
                    ops.append(KitchenOp(key, plist, range(len(tensors), len(tensors) + 3),
                                          "TensorCoreNVFP4Layout", p, fields))
                    tensors += [q._qdata, p.scale, p.block_scale]
            del w

            def fold():
                with torch.no_grad():
                    for op in ops:
                        op(tensors)
            results[(base, where)] = _cuda_ms(fold)
            del tensors, ops
            torch.cuda.empty_cache()
    block_ms = 68.6   # FACTS.md: Wan-14B block forward, bf16, 480p 81 frames (32,760 tokens)
    print("\nLoRA fold per Wan-14B block, rank 64 (device ms / host ms; % of a 68.6 ms block):")
    for (base, where), (dev_ms, host_ms) in results.items():
        print(f"  {base:6s} LoRA tensors on {where:4s}: {dev_ms:7.2f} ms device, {host_ms:7.2f} ms host, "
              f"{100 * dev_ms / block_ms:5.1f}%")
