"""Quantized tiny-Wan test files (support/quant_files.py) and what ComfyUI's stock loader
(``comfy.sd.load_diffusion_model``, the UNETLoader path) does with each, on CPU.

Facts pinned here for ComfyUI 0.3.75 (the tests branch on the running version where
newer ComfyUI behaves differently):
- bf16/fp16/fp32/plain fp8: ``disable_weight_init.Linear``; on CPU every weight is upcast
  to a float32 Parameter at load; output equals the float32 reference exactly.
- scaled_fp8: ``scaled_fp8_ops(...).scaled_fp8_op.Linear`` for EVERY Linear: weight AND
  bias are fp8 e4m3fn Parameters, ``scale_weight`` (f32 ()) and ``scale_input`` (f32 (),
  ones, because the (0,)-shaped marker turns fp8 optimizations on) are Parameters too.
  Linears without ``scale_weight`` in the file (text/time embedding, head) and all biases
  are rounded to fp8 with scale 1, so the output is ~0.5% off the dequantized reference,
  and exactly equal to a reference that rounds those tensors through fp8 too.
- quant_metadata: ``mixed_precision_ops(...).MixedPrecisionOps.Linear``; listed layers'
  ``_parameters['weight']`` is a Parameter-flagged ``comfy.quant_ops.QuantizedTensor``
  (outer dtype fp8, ``_qdata`` fp8, ``_layout_type`` 'TensorCoreFP8Layout',
  ``_layout_params`` dict {scale, orig_dtype, block_size}); exact output.
- comfy_quant: not recognised; fp8 weights are upcast WITHOUT their scale (weights
  1/scale ~ 5000x too large), ``.weight_scale``/``.comfy_quant`` are only logged as
  "unet unexpected": wrong output, no error.
- nvfp4: load raises RuntimeError (size mismatch, packed uint8 (N, K/2) vs (N, K)).
"""
import os

import pytest
import torch

import comfy.model_management
import comfy.sd

from wan_model import load_stock
from support.quant_files import (FORMATS, dequantize_nvfp4, dequantized_state_dict,
                                 detect_format, original_state_dict, quantized_layer_names,
                                 read_file, write_quant_wan)

DIM, LAYERS, FFN = 128, 2, 256


def comfy_version():
    try:
        import comfyui_version
        return tuple(int(p) for p in comfyui_version.__version__.split(".")[:3])
    except Exception:
        return (0, 0, 0)


OLD_COMFY = comfy_version() < (0, 4, 0)     # 0.3.x: own fp8-only QuantizedTensor


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="documents ComfyUI 0.3.75's stock loading on the CPU (dtypes differ on CUDA)")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant_wan")
    return {fmt: write_quant_wan(os.path.join(d, f"{fmt}.safetensors"), fmt, dim=DIM,
                                 num_layers=LAYERS, ffn_dim=FFN, seed=0)["path"]
            for fmt in FORMATS}


@pytest.fixture(scope="module")
def original():
    return original_state_dict(dim=DIM, num_layers=LAYERS, ffn_dim=FFN, seed=0)


def _inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 2, 8, 8, generator=g)
    ctx = torch.randn(1, 8, 4096, generator=g)
    return x, torch.tensor([0.7]), ctx


def _forward(patcher):
    x, sigma, ctx = _inputs()
    comfy.model_management.load_models_gpu([patcher])
    with torch.no_grad():
        return patcher.model.apply_model(x, sigma, c_crossattn=ctx).clone()


def _reference_output(sd):
    """Output of a float32 model built by ComfyUI from a float state dict."""
    return _forward(comfy.sd.load_diffusion_model_state_dict(dict(sd)))


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------- the files themselves

EXPECTED_LAYER_KEYS = {
    "bf16": {"weight": (torch.bfloat16, (128, 128))},
    "fp16": {"weight": (torch.float16, (128, 128))},
    "fp32": {"weight": (torch.float32, (128, 128))},
    "fp8_e4m3fn": {"weight": (torch.float8_e4m3fn, (128, 128))},
    "fp8_e5m2": {"weight": (torch.float8_e5m2, (128, 128))},
    "scaled_fp8": {"weight": (torch.float8_e4m3fn, (128, 128)),
                   "scale_weight": (torch.float32, ())},
    "quant_metadata": {"weight": (torch.float8_e4m3fn, (128, 128)),
                       "weight_scale": (torch.float32, ())},
    "comfy_quant": {"weight": (torch.float8_e4m3fn, (128, 128)),
                    "weight_scale": (torch.float32, ()),
                    "comfy_quant": (torch.uint8, (len(b'{"format": "float8_e4m3fn"}'),))},
    "nvfp4": {"weight": (torch.uint8, (128, 64)),
              "weight_scale": (torch.float8_e4m3fn, (128, 8)),
              "weight_scale_2": (torch.float32, ()),
              "comfy_quant": (torch.uint8, (len(b'{"format": "nvfp4"}'),))},
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_on_disk_layout(files, fmt):
    tensors, meta = read_file(files[fmt])
    assert detect_format(tensors, meta) == fmt
    layer = "blocks.0.self_attn.q"
    got = {k[len(layer) + 1:]: (v.dtype, tuple(v.shape)) for k, v in tensors.items()
           if k.startswith(layer + ".") and k != f"{layer}.bias"}
    assert got == EXPECTED_LAYER_KEYS[fmt]
    # every block Linear is encoded the same way; nothing outside the blocks is quantized
    for name in quantized_layer_names(LAYERS):
        assert tensors[f"{name}.weight"].dtype == EXPECTED_LAYER_KEYS[fmt]["weight"][0]
    other = torch.bfloat16 if fmt not in ("fp16", "fp32") else EXPECTED_LAYER_KEYS[fmt]["weight"][0]
    for k in ("blocks.0.self_attn.q.bias", "blocks.0.norm3.weight", "blocks.0.modulation",
              "text_embedding.0.weight", "head.head.weight", "patch_embedding.weight"):
        assert tensors[k].dtype == other, k
    assert ("scaled_fp8" in tensors) == (fmt == "scaled_fp8")
    if fmt == "scaled_fp8":
        assert tensors["scaled_fp8"].dtype == torch.float8_e4m3fn
        assert tuple(tensors["scaled_fp8"].shape) == (0,)
    assert ("_quantization_metadata" in meta) == (fmt == "quant_metadata")
    if fmt == "quant_metadata":
        import json
        qm = json.loads(meta["_quantization_metadata"])
        assert qm["format_version"] == "1.0"
        assert qm["layers"] == {n: {"format": "float8_e4m3fn"} for n in quantized_layer_names(LAYERS)}
    if fmt in ("comfy_quant", "nvfp4"):
        import json
        conf = json.loads(bytes(tensors[f"{layer}.comfy_quant"].tolist()))
        assert conf == {"format": "float8_e4m3fn" if fmt == "comfy_quant" else "nvfp4"}


# relative L2 error of a dequantized block Linear weight against the original random one
ROUNDTRIP = {"fp32": (0.0, 0.0), "bf16": (1e-4, 5e-3), "fp16": (1e-5, 1e-3),
             "fp8_e4m3fn": (0.01, 0.05), "fp8_e5m2": (0.02, 0.08),
             "scaled_fp8": (0.01, 0.035), "quant_metadata": (0.01, 0.035),
             "comfy_quant": (0.01, 0.035), "nvfp4": (0.05, 0.12)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_writer_roundtrip(files, original, fmt):
    deq = dequantized_state_dict(files[fmt])
    assert set(deq) == set(original)
    assert all(v.dtype == torch.float32 for v in deq.values())
    lo, hi = ROUNDTRIP[fmt]
    for name in quantized_layer_names(LAYERS):
        k = f"{name}.weight"
        assert deq[k].shape == original[k].shape
        err = _rel(deq[k], original[k])
        assert lo <= err <= hi, (k, err)
    for k in original:
        if k.endswith(".weight") and k[:-len(".weight")] in quantized_layer_names(LAYERS):
            continue
        assert _rel(deq[k], original[k]) < (5e-3 if fmt not in ("fp16", "fp32") else 1e-3), k


def test_nvfp4_encoding_is_comfy_kitchens(files):
    """On-disk nvfp4 triple == comfy_kitchen's TensorCoreNVFP4Layout state dict; our pure-torch
    decoder, ck.dequantize_nvfp4 and QuantizedTensor.dequantize agree; a weight-only
    F.linear on a ck QuantizedTensor runs on CPU (eager backend: dequantize + matmul)."""
    import comfy_kitchen as ck
    from comfy_kitchen.tensor import QuantizedTensor, TensorCoreNVFP4Layout

    tensors, _ = read_file(files["nvfp4"])
    for name in ("blocks.0.ffn.0", "blocks.1.ffn.2", "blocks.0.cross_attn.k"):
        q, bs, s2 = (tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"],
                     tensors[f"{name}.weight_scale_2"])
        n, k = q.shape[0], q.shape[1] * 2
        ours = dequantize_nvfp4(q, bs, s2)
        theirs = ck.dequantize_nvfp4(q, s2, bs, torch.float32)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-7)
        qt = QuantizedTensor(q, "TensorCoreNVFP4Layout", TensorCoreNVFP4Layout.Params(
            scale=s2, orig_dtype=torch.float32, orig_shape=(n, k), block_scale=bs))
        torch.testing.assert_close(qt.dequantize(), ours, rtol=0, atol=1e-7)
        sd = qt.state_dict(f"{name}.weight")
        assert set(sd) == {f"{name}.weight", f"{name}.weight_scale", f"{name}.weight_scale_2"}
        assert torch.equal(sd[f"{name}.weight"], q) and torch.equal(sd[f"{name}.weight_scale_2"], s2)
        assert torch.equal(sd[f"{name}.weight_scale"].view(torch.uint8), bs.view(torch.uint8))
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(2))
        y = torch.nn.functional.linear(x, qt)
        torch.testing.assert_close(y, x @ ours.T, rtol=1e-5, atol=1e-6)
        # re-quantizing the original with ck gives the very same bytes (deterministic writer)
        w = original_state_dict(dim=DIM, num_layers=LAYERS, ffn_dim=FFN, seed=0)[f"{name}.weight"]
        again = QuantizedTensor.from_float(w, "TensorCoreNVFP4Layout")
        assert torch.equal(again._qdata, q)
        assert torch.equal(again._params.block_scale.view(torch.uint8), bs.view(torch.uint8))


# ------------------------------------------------------------ ComfyUI's stock loader

def _block_linear(patcher, name="self_attn.q", block=0):
    mod = patcher.model.diffusion_model.blocks[block]
    for part in name.split("."):
        mod = getattr(mod, part)
    return mod


@CPU_ONLY
@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp32", "fp8_e4m3fn", "fp8_e5m2"])
def test_stock_load_plain(files, fmt):
    deq = dequantized_state_dict(files[fmt])
    patcher = load_stock(files[fmt])
    m = _block_linear(patcher)
    assert type(m).__qualname__ == "disable_weight_init.Linear"
    assert type(m.weight) is torch.nn.Parameter
    assert m.weight.dtype == torch.float32          # CPU: upcast at load
    assert set(m._parameters) == {"weight", "bias"} and not m._buffers
    torch.testing.assert_close(m.weight.data, deq["blocks.0.self_attn.q.weight"], rtol=0, atol=0)
    assert _rel(_forward(patcher), _reference_output(deq)) < 1e-5


@CPU_ONLY
def test_stock_load_scaled_fp8(files):
    deq = dequantized_state_dict(files["scaled_fp8"])
    tensors, _ = read_file(files["scaled_fp8"])
    patcher = load_stock(files["scaled_fp8"])
    out = _forward(patcher)
    ref = _reference_output(deq)
    m = _block_linear(patcher)
    if not OLD_COMFY:   # newer ComfyUI converts scaled_fp8 to comfy_quant: exact
        assert _rel(out, ref) < 1e-5
        return
    assert "scaled_fp8_op.Linear" in type(m).__qualname__
    assert set(m._parameters) == {"weight", "bias", "scale_weight", "scale_input"}
    assert not m._buffers
    assert m.weight.dtype == torch.float8_e4m3fn and m.bias.dtype == torch.float8_e4m3fn
    assert torch.equal(m.weight.data.view(torch.uint8),
                       tensors["blocks.0.self_attn.q.weight"].view(torch.uint8))
    assert m.scale_weight.dtype == torch.float32 and m.scale_weight.shape == ()
    assert float(m.scale_weight) == float(tensors["blocks.0.self_attn.q.scale_weight"])
    assert float(m.scale_input) == 1.0
    # every Linear becomes fp8: those without scale_weight (embeddings, head) get scale 1
    te = patcher.model.diffusion_model.text_embedding[0]
    assert te.weight.dtype == torch.float8_e4m3fn and float(te.scale_weight) == 1.0
    err = _rel(out, ref)
    assert 1e-4 < err < 0.02, err
    # ... and that is the whole difference: round those through fp8 in the reference too
    lin = [n for n, mod in patcher.model.diffusion_model.named_modules()
           if isinstance(mod, torch.nn.Linear)]
    fp8_ref = dict(deq)
    for n in lin:
        for k in (f"{n}.bias",) + (() if f"{n}.scale_weight" in tensors else (f"{n}.weight",)):
            fp8_ref[k] = fp8_ref[k].to(torch.float8_e4m3fn).float()
    assert _rel(out, _reference_output(fp8_ref)) < 1e-5


@CPU_ONLY
def test_stock_load_quant_metadata(files):
    deq = dequantized_state_dict(files["quant_metadata"])
    tensors, _ = read_file(files["quant_metadata"])
    patcher = load_stock(files["quant_metadata"])
    m = _block_linear(patcher)
    from comfy.quant_ops import QuantizedTensor
    w = m._parameters["weight"]
    assert isinstance(w, QuantizedTensor) and isinstance(w, torch.nn.Parameter)
    assert tuple(w.shape) == (128, 128)
    assert torch.equal(w._qdata.view(torch.uint8),
                       tensors["blocks.0.self_attn.q.weight"].view(torch.uint8))
    if OLD_COMFY:
        assert "MixedPrecisionOps.Linear" in type(m).__qualname__
        assert w.dtype == torch.float8_e4m3fn              # 0.3.75: outer dtype = qdata dtype
        assert w._layout_type == "TensorCoreFP8Layout"
        assert set(w._layout_params) == {"scale", "orig_dtype", "block_size"}
        assert float(w._layout_params["scale"]) == float(tensors["blocks.0.self_attn.q.weight_scale"])
        assert w._layout_params["orig_dtype"] == torch.float32
        assert set(m._parameters) == {"weight", "bias"} and not m._buffers
        assert m.layout_type == "TensorCoreFP8Layout"
    te = patcher.model.diffusion_model.text_embedding[0]     # not listed: plain compute dtype
    assert not isinstance(te.weight, QuantizedTensor) and te.weight.dtype == torch.float32
    assert _rel(_forward(patcher), _reference_output(deq)) < 1e-5


@CPU_ONLY
def test_stock_load_comfy_quant(files):
    """0.3.75 does not know `.comfy_quant`: it loads the fp8 weights WITHOUT their scale
    (only a 'unet unexpected' log line): silently wrong. Newer ComfyUI: exact."""
    deq = dequantized_state_dict(files["comfy_quant"])
    tensors, _ = read_file(files["comfy_quant"])
    patcher = load_stock(files["comfy_quant"])
    out = _forward(patcher)
    err = _rel(out, _reference_output(deq))
    if not OLD_COMFY:
        assert err < 1e-5
        return
    m = _block_linear(patcher)
    assert type(m).__qualname__ == "disable_weight_init.Linear"
    assert type(m.weight) is torch.nn.Parameter and m.weight.dtype == torch.float32
    raw = tensors["blocks.0.self_attn.q.weight"].float()
    assert torch.equal(m.weight.data, raw)                     # the scale was dropped
    ratio = float(m.weight.data.norm() / deq["blocks.0.self_attn.q.weight"].norm())
    inv_scale = 1.0 / float(tensors["blocks.0.self_attn.q.weight_scale"])
    assert ratio == pytest.approx(inv_scale, rel=1e-3) and ratio > 1000
    assert torch.isfinite(out).all()
    assert err > 0.1, err            # measured 0.22: the head's LayerNorm hides the magnitude


def test_stock_load_nvfp4(files):
    if not OLD_COMFY:
        deq = dequantized_state_dict(files["nvfp4"])
        patcher = load_stock(files["nvfp4"])
        tol = 1e-4 if comfy.model_management.get_torch_device().type == "cpu" else 5e-3   # CUDA: half precision
        assert _rel(_forward(patcher), _reference_output(deq)) < tol
        return
    with pytest.raises(RuntimeError, match="size mismatch for blocks.0.self_attn.q.weight"):
        load_stock(files["nvfp4"])
