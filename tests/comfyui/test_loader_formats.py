"""RingSwap Model Loader on every weight format, ram and disk homes, against ComfyUI."""

import pytest
import torch
from safetensors.torch import save_file

import comfy.model_management

from ringswap.loaders.comfyui_adapter import comfy_features as features
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from support.quant_files import dequantized_state_dict, write_quant_wan
from wan_model import forward, inputs, load_stock, static_twin

# 0.3.75's stock loader reads comfy_quant files silently wrong and refuses nvfp4; ComfyUI
# versions that read `.comfy_quant` themselves (0.33) load both, and are the reference.
NEWER = ("comfy_quant", "nvfp4")
STOCK_HANDLES = ("bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2", "scaled_fp8", "quant_metadata") \
    + (NEWER if features.reads_comfy_quant() else ())
REFERENCE_ONLY = NEWER


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("formats")
    out = {}
    for fmt in dict.fromkeys(STOCK_HANDLES + REFERENCE_ONLY):
        p = str(d / f"{fmt}.safetensors")
        write_quant_wan(p, fmt, dim=256, num_layers=4, ffn_dim=1024)   # big enough for meta tensors
        out[fmt] = p
    return out


def swapped_outputs(path, window=2, prefetch=1):
    outs = {}
    for home in ("ram", "disk", "auto"):   # auto: homes in the file's pages (a scalar the file lacks written beside)
        model = load_swapped_model(path, SwapSettings(window, prefetch, "auto"), home=home, disk_workers=2)
        outs[home] = [forward(model, *inputs(seed=s)) for s in range(2)]
        if home == "auto":   # every streamed block's home is the file's pages, whatever the format
            assert set(model.swap_engine.pool.mapped) == set(model.swap_engine.plan.streamed) > set()
        comfy.model_management.unload_all_models()
    return outs


@pytest.mark.parametrize("fmt", STOCK_HANDLES)
def test_equals_stock_loader_bit_for_bit(files, fmt):
    stock = load_stock(files[fmt])
    ref = [forward(stock, *inputs(seed=s)) for s in range(2)]
    comfy.model_management.unload_all_models()
    if features.is_dynamic(stock) and fmt in ("fp8_e4m3fn", "fp8_e5m2"):
        # Plain fp8 blocks with bf16 non-block weights: ComfyUI's dynamic VRAM and its static
        # load (--disable-dynamic-vram) differ here; RingSwap's static model equals the latter.
        twin = static_twin(stock)
        static_ref = [forward(twin, *inputs(seed=s)) for s in range(2)]
        comfy.model_management.unload_all_models()
        for k in range(2):
            err = ((ref[k].float() - static_ref[k].float()).norm() / ref[k].float().norm()).item()
            assert err < 2e-3, f"{fmt}: ComfyUI dynamic vs static load differ by {err:.2e}"
        ref = static_ref
    outs = swapped_outputs(files[fmt])
    for home, got in outs.items():
        for k in range(2):
            assert torch.equal(got[k], ref[k]), f"{fmt} home={home} input {k}"


@pytest.mark.parametrize("fmt", REFERENCE_ONLY)
def test_equals_dequantize_then_linear_reference(files, fmt, tmp_path):
    deq = {k: v.float().contiguous() for k, v in dequantized_state_dict(files[fmt]).items()}
    ref_path = str(tmp_path / "reference_fp32.safetensors")
    save_file(deq, ref_path)
    ref_model = load_stock(ref_path)
    ref = [forward(ref_model, *inputs(seed=s)) for s in range(2)]
    comfy.model_management.unload_all_models()
    outs = swapped_outputs(files[fmt])
    for k in range(2):
        assert torch.equal(outs["ram"][k], outs["disk"][k])
        err = ((outs["ram"][k] - ref[k]).norm() / ref[k].norm()).item()
        # fp32 compute on the CPU: the same function up to summation order. On CUDA ComfyUI
        # computes in half precision and the two models round at different places.
        tol = 1e-5 if ref[k].device.type == "cpu" else 5e-3
        assert err <= tol, f"{fmt}: relative error {err:.2e} against dequantize-then-linear"


def test_quantized_blocks_stay_compact(files):
    """fp8 and nvfp4 blocks travel and sit on the device in their file form (with scales):
    a block's layout is the file's block bytes plus alignment, not a dequantized copy."""
    from ringswap.loaders.model_file.safetensors_index import SafetensorsIndex
    for fmt in ("quant_metadata", "nvfp4"):
        model = load_swapped_model(files[fmt], SwapSettings(2, 1, "auto"), home="disk", disk_workers=1)
        block = [t for k, t in SafetensorsIndex.open(files[fmt]).tensors.items() if k.startswith("blocks.0.")]
        file_bytes = sum(t.nbytes for t in block)
        assert model.swap_engine.block_bytes() <= file_bytes + 512 * len(block), fmt
        comfy.model_management.unload_all_models()
