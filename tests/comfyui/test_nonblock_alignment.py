"""Non-block tensors sit at the address alignment ComfyUI's own loader leaves them at (the
file offset mod 64, as in its mmap views), so CPU matmuls round alike: RingSwap Model Loader
is bit-identical to Load Diffusion Model on quantized files with float32 non-block weights
whose file offsets are 8 mod 16 (MKL rounds differently at 8 and at 0 mod 16)."""
import pytest
import torch

import comfy.model_management

from ringswap.loaders.comfyui_adapter import comfy_features as features
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.model_file.safetensors_index import SafetensorsIndex
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from support.quant_files import file_offset, write_misaligned_quant_wan
from wan_model import forward, inputs, load_stock

FORMATS = ("quant_metadata",) + (("comfy_quant", "nvfp4") if features.reads_comfy_quant() else ())
PROBE = "time_embedding.0.weight"   # the first non-block float32 Linear the forward uses


def nonblock_linear_alignment(patcher) -> dict:
    dm = patcher.model.diffusion_model
    return {n: m.weight.data_ptr() % 64 for n, m in dm.named_modules()
            if hasattr(m, "weight") and isinstance(m.weight, torch.Tensor) and m.weight.dtype == torch.float32
            and m.weight.ndim == 2 and not n.startswith("blocks.")}


@pytest.mark.parametrize("fmt", FORMATS)
def test_loader_equals_stock_on_misaligned_float32_nonblock_tensors(tmp_path, fmt):
    path = str(tmp_path / f"{fmt}.safetensors")
    write_misaligned_quant_wan(path, fmt, probe=PROBE, dim=256, num_layers=2, ffn_dim=1024)
    assert file_offset(path, PROBE) % 16 == 8 == SafetensorsIndex.open(path)[PROBE].start % 16
    stock = load_stock(path)
    ref = [forward(stock, *inputs(seed=s)) for s in range(2)]
    ref_align = nonblock_linear_alignment(stock)
    comfy.model_management.unload_all_models()
    for home in ("ram", "disk"):
        model = load_swapped_model(path, SwapSettings(1, 1, "auto"), home=home, disk_workers=2)
        align = nonblock_linear_alignment(model)
        assert {n: a % 16 for n, a in align.items()} == {n: a % 16 for n, a in ref_align.items()}, (home, align,
                                                                                                    ref_align)
        for k in range(2):
            assert torch.equal(forward(model, *inputs(seed=k)), ref[k]), f"{fmt} home={home} input {k}"
        comfy.model_management.unload_all_models()
