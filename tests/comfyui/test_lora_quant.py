"""LoRA folded into fp8 and nvfp4 blocks as they land: dequantize, patch in fp32, requantize.

Folded weights are compared with requantize(dequantize(base) + delta) computed here
independently (the base decoded by support.quant_files' own decoders, the delta by
ComfyUI's `comfy.lora.calculate_weight`, fp8 requantized by hand: scale amax/448, round to
nearest; nvfp4 by comfy_kitchen, whose format it is). Outputs are compared with the fp32
model the quantized file was made from, patched by ComfyUI: the error must stay what the
format costs without a LoRA.
"""
import pytest
import torch
from safetensors.torch import save_file

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.lora.apply import apply_lora
from support.fp8_close import assert_fp8_close
from support.lora_files import build_lora
from support.quant_files import (QUANT_LINEARS, dequantized_state_dict, original_state_dict,
                                 write_quant_wan)
from wan_model import forward, inputs, load_stock, static_twin

BLOCKS, DIM, FFN = 4, 128, 256
QUANT = ("scaled_fp8", "quant_metadata", "nvfp4")
# Relative L2 output error of the quantized model against its fp32 original: with a LoRA
# folded in it may exceed the error without one by this factor. Folding rounds a second
# time (Q(Q(W) + delta) against W + delta), so about sqrt(2)..2x; measured 1.2x (scaled
# fp8), 1.9x (fp8 QuantizedTensor), 1.6x (nvfp4) on these files.
ERROR_GROWTH = 2.5


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    out = {}
    for fmt in QUANT + ("fp8_e4m3fn",):
        p = str(d / f"{fmt}.safetensors")
        write_quant_wan(p, fmt, dim=DIM, num_layers=BLOCKS, ffn_dim=FFN)
        out[fmt] = p
    out["orig"] = str(d / "orig_fp32.safetensors")
    save_file(original_state_dict(dim=DIM, num_layers=BLOCKS, ffn_dim=FFN), out["orig"])
    return out


@pytest.fixture(scope="module")
def lora():
    sd = build_lora("kohya", dim=DIM, ffn_dim=FFN, blocks=BLOCKS, seed=3)
    sd.update(build_lora("diff_b", dim=DIM, ffn_dim=FFN, blocks=BLOCKS, seed=4))
    return sd


@pytest.fixture(scope="module")
def original(files, lora):
    """The fp32 model the quantized files were made from, without and with the LoRA
    (patched by ComfyUI)."""
    stock = load_stock(files["orig"])
    base = forward(stock, *inputs(seed=0))
    ref, _ = comfy.sd.load_lora_for_models(stock, None, lora, 1.0, 0)
    with_lora = forward(ref, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    return base, with_lora


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def requantize_fp8(w):
    scale = (w.abs().amax() / 448.0).clamp_min(1e-12)
    return (w / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), scale


def bits(t):
    return t.reshape(-1).view(torch.uint8)


def quantized_parts(module):
    """The stored parts of a block Linear's weight, as the block sees them now."""
    w = module._parameters["weight"]
    if hasattr(w, "_layout_cls"):        # comfy_kitchen: nvfp4; fp8 on ComfyUI 0.33
        if hasattr(w._params, "block_scale"):
            return {"data": w._qdata, "block_scale": w._params.block_scale, "scale": w._params.scale}
        return {"data": w._qdata, "scale": w._params.scale}
    if hasattr(w, "_layout_params"):     # ComfyUI 0.3.75 fp8 QuantizedTensor
        return {"data": w._qdata, "scale": w._layout_params["scale"]}
    if "scale_weight" in module._parameters:
        return {"data": w.data, "scale": module._parameters["scale_weight"].data}
    return {"data": w.data}


class PartsProbe:
    """Records, inside every block, the parts of each patched Linear after the fold."""

    def __init__(self, model):
        self.seen: dict[tuple[int, str], dict] = {}
        self.handles = []
        for s in model.swap_engine.states:
            self.handles.append(s.block.norm1.register_forward_pre_hook(self._hook(s.index, s.block)))

    def _hook(self, i, block):
        def record(module, args):
            for name in QUANT_LINEARS:
                parts = {k: v.detach().clone() for k, v in quantized_parts(block.get_submodule(name)).items()}
                prev = self.seen.setdefault((i, name), parts)
                for k in parts:   # every landing folds the same result
                    assert torch.equal(bits(prev[k]), bits(parts[k])), (i, name, k)
        return record

    def remove(self):
        for h in self.handles:
            h.remove()


def run_with_probe(model):
    probe = PartsProbe(model)
    try:
        outs = [forward(model, *inputs(seed=0)) for _ in range(2)]
    finally:
        probe.remove()
    assert torch.equal(outs[0], outs[1])
    return outs[0], probe.seen


@pytest.mark.parametrize("home", ["ram", "disk"])
@pytest.mark.parametrize("fmt", QUANT)
def test_folded_weights_equal_requantized_dequantized_base_plus_delta(files, lora, original, fmt, home):
    base_model = load_swapped_model(files[fmt], SwapSettings(2, 1), home=home, disk_workers=2)
    plain_out = forward(base_model, *inputs(seed=0))
    model = apply_lora(base_model, lora, 1.0)
    out, seen = run_with_probe(model)
    assert len(seen) == BLOCKS * len(QUANT_LINEARS)

    decoded = dequantized_state_dict(files[fmt])
    for (i, name), parts in seen.items():
        key = f"diffusion_model.blocks.{i}.{name}.weight"
        w = decoded[f"blocks.{i}.{name}.weight"].to(parts["data"].device)   # the fold's device: same math
        want = comfy.lora.calculate_weight(model.patches[key], w, key)
        if fmt == "nvfp4":   # comfy_kitchen's quantizer (on the CPU), the format's definition
            from comfy_kitchen.tensor import QuantizedTensor
            from support.quant_files import dequantize_nvfp4
            want, parts = want.cpu(), {k: v.cpu() for k, v in parts.items()}
            q = QuantizedTensor.from_float(want, "TensorCoreNVFP4Layout",
                                           scale=(want.abs().amax() / 2688.0).clamp_min(1e-12))
            assert rel(parts["scale"].reshape(()), q._params.scale.reshape(())) < 1e-6, (i, name)
            same = (parts["data"] == q._qdata).float().mean().item()
            assert same > 0.999, f"{name}: {same:.4%} of nvfp4 codes as requantized here"
            got = dequantize_nvfp4(parts["data"], parts["block_scale"], parts["scale"])
            exp = dequantize_nvfp4(q._qdata, q._params.block_scale, q._params.scale)
            assert rel(got, exp) < 1e-3
            assert rel(got, want) < 0.12, f"nvfp4 error {rel(got, want):.3f}"
        else:
            q, scale = requantize_fp8(want)
            if parts["data"].device.type == "cpu":   # ComfyUI's steps, op by op: bit for bit
                assert torch.equal(bits(parts["data"]), bits(q)), (i, name)
                assert torch.equal(parts["scale"].reshape(()), scale.reshape(())), (i, name)
            else:   # CUDA: lora/kernels.py sums the same float32 products in another order
                assert rel(parts["scale"].reshape(()), scale.reshape(())) < 1e-6, (i, name)
                assert_fp8_close(parts["data"], q, (i, name))
            assert rel(parts["data"].float() * parts["scale"], want) < 0.04

    ref_base, ref_lora = original
    err_base, err_lora = rel(plain_out, ref_base), rel(out, ref_lora)
    assert err_lora <= ERROR_GROWTH * err_base + 1e-4, \
        f"{fmt}: output error {err_lora:.4f} with the LoRA vs {err_base:.4f} without"
    assert rel(out, plain_out) > 3 * err_lora, "the LoRA must change the output well above the format's error"


def test_plain_fp8_equals_comfyui_patching(files, lora):
    """fp8 without a scale: folded exactly as ComfyUI patches it (seeded stochastic rounding)."""
    stock = load_stock(files["fp8_e4m3fn"])
    ref, _ = comfy.sd.load_lora_for_models(stock, None, lora, 1.0, 0)
    with torch.no_grad():   # as ComfyUI's executor (its fp8 stochastic rounding needs it on CUDA)
        dynamic_want = forward(ref, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    # ComfyUI's stored fp8 patching; under dynamic VRAM (patched at use in the compute dtype,
    # never re-rounded to fp8) that of its static twin, and the dynamic output only close
    twin, _ = comfy.sd.load_lora_for_models(static_twin(stock), None, lora, 1.0, 0)
    with torch.no_grad():
        want = forward(twin, *inputs(seed=0))
    weights = {k: comfy.utils.get_attr(twin.model, k).detach().clone() for k in twin.patches}
    comfy.model_management.unload_all_models()
    assert rel(want, dynamic_want) < 0.05
    model = apply_lora(load_swapped_model(files["fp8_e4m3fn"], SwapSettings(1, 1), home="disk", disk_workers=2),
                       lora, 1.0)
    out, seen = run_with_probe(model)
    assert torch.equal(out, want)
    for (i, name), parts in seen.items():
        key = f"diffusion_model.blocks.{i}.{name}.weight"
        assert torch.equal(bits(parts["data"]).cpu(), bits(weights[key]).cpu()), key


@pytest.mark.parametrize("fmt", ("quant_metadata", "nvfp4"))
def test_strength_changes_on_quantized_home_are_exact(files, lora, fmt):
    """The home keeps the file's bytes, so 1.0 -> 0.5 -> 0 -> 1.0 repeats exactly and 0 is the base."""
    base = load_swapped_model(files[fmt], SwapSettings(2, 1), home="ram")
    home = {i: b.flat.clone() for i, b in base.swap_engine.pool.blocks.items()}
    plain = forward(base, *inputs(seed=2))
    outs = [forward(apply_lora(base, lora, s), *inputs(seed=2)) for s in (1.0, 0.5, 0.0, 1.0)]
    assert torch.equal(outs[0], outs[3])
    assert torch.equal(outs[2], plain)
    assert not torch.equal(outs[1], outs[0])
    for i, b in home.items():
        assert torch.equal(base.swap_engine.pool.blocks[i].flat, b)


@pytest.mark.parametrize("layout_cls", ["TensorCoreFP8Layout", "TensorCoreNVFP4Layout"])
def test_kitchen_tensor_fold_op(layout_cls):
    """comfy_kitchen tensors (nvfp4; fp8 as newer ComfyUI stores it): the fold of a block whose
    Linear holds one, on the block's packed bytes, through the layout the engine uses."""
    from comfy_kitchen.tensor import QuantizedTensor

    import ringswap.loaders.model_file.quant  # noqa: F401 - registers the codecs
    from ringswap.lora.checks import attr_index
    from ringswap.lora.fold_ops import KitchenOp, ScaledFp8Op, make_op
    from ringswap.swap.layout import BlockLayout

    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g) * 0.02
    block = torch.nn.Module()
    block.lin = torch.nn.Linear(128, 64, bias=False)
    block.lin.weight = torch.nn.Parameter(QuantizedTensor.from_float(w, layout_cls), requires_grad=False)
    layout = BlockLayout.of(block)
    flat = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack([t for a in layout.attrs for _, t in a.codec.split(getattr(block.lin, a.name), a.name)[1]], flat)
    before = flat.clone()
    up, down = torch.randn(64, 4, generator=g) * 0.1, torch.randn(4, 128, generator=g) * 0.1
    lora = comfy.lora.load_lora({"x.lora_up.weight": up, "x.lora_down.weight": down}, {"x": "k"})
    patches = [(1.0, lora["k"], 1.0, None, None)]
    names = attr_index(layout)
    op = make_op("k", patches, layout, layout.attrs[names["lin.weight"]], names)
    assert isinstance(op, ScaledFp8Op if layout_cls == "TensorCoreFP8Layout" else KitchenOp)
    views = layout.views(flat)
    op(views)
    folded = layout.attrs[0].codec.join(layout.attrs[0].spec, views)
    base = QuantizedTensor.from_float(w, layout_cls).dequantize().float()
    want = comfy.lora.calculate_weight(patches, base.clone(), "k")
    bound = 0.04 if layout_cls == "TensorCoreFP8Layout" else 0.12
    assert rel(folded.dequantize().float(), want) < bound
    assert rel(folded.dequantize().float(), base) > 3 * bound, "the delta is in"
    assert not torch.equal(flat, before)
    assert flat.numel() == before.numel()
