"""LoRA on block-swapped models against ComfyUI's own LoRA patching, in a real ComfyUI.

Reference: the stock loader (comfy.sd.load_diffusion_model) + ComfyUI's LoRA patching
(comfy.sd.load_lora_for_models, as LoraLoaderModelOnly), fully resident on the CPU; its
patched weights are read from the model after ComfyUI loaded it. RingSwap folds the same
patches into each block as it lands; on the same device the math is the same, so weights
and outputs must be equal bit for bit (torch.equal) on the CPU; on CUDA plain LoRA pairs fold
with a fused addmm_ (lora/fold_ops.py): within one ulp per weight, outputs within 1e-3.
"""
import logging
import os
import re

import pytest
import torch

import comfy.lora
import comfy.model_management
import comfy.sd
import comfy.utils
import folder_paths
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.lora.fold import BlockFolder
from ringswap.nodes.lora import RingSwapLoRA, RingSwapLoRAStack
from ringswap.nodes.patch import RingSwapPatch
from support.fold_probe import FoldProbe
from support.lora_files import (FORMATS, build_lora, from_diffusers_names, other_arch_lora,
                                write_lora)
from wan_model import conditioning, forward, inputs, latent, load_stock, patched_weights, tiny_wan

BLOCKS = 4


def ksample(model, seed, steps=2):
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 1.0, "euler", "simple",
                                          conditioning(1), conditioning(2), latent())
    return out["samples"].clone()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("wan"))
    return {"fp32": tiny_wan(d, blocks=BLOCKS, dtype=torch.float32),
            "bf16": tiny_wan(d, blocks=BLOCKS, dtype=torch.bfloat16, seed=1)}


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    d = tmp_path_factory.mktemp("loras")
    out = {}
    for fmt in FORMATS:
        sd = build_lora(fmt, blocks=BLOCKS, seed=FORMATS.index(fmt))
        out[fmt] = (os.path.basename(write_lora(d / f"{fmt}.safetensors", sd)), sd)
    sd = from_diffusers_names(out["mixed"][1])   # the stock loader knows no diffusers names
    out["mixed_comfy"] = (os.path.basename(write_lora(d / "mixed_comfy.safetensors", sd)), sd)
    sd = other_arch_lora()
    out["flux"] = (os.path.basename(write_lora(d / "flux.safetensors", sd)), sd)
    sd = build_lora("kohya", dim=256, ffn_dim=512, blocks=BLOCKS)
    out["wide"] = (os.path.basename(write_lora(d / "wide.safetensors", sd)), sd)
    good = (d / "kohya.safetensors").read_bytes()
    (d / "truncated.safetensors").write_bytes(good[:len(good) // 2])
    (d / "garbage.safetensors").write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00{not a header" + bytes(64))
    folder_paths.add_model_folder_path("loras", str(d))
    return out


@pytest.fixture(scope="module")
def stock(models):
    """The stock-loaded models (shared: ComfyUI's LoRA patching clones them)."""
    return {k: load_stock(p) for k, p in models.items()}


@pytest.fixture(scope="module")
def swapped(models):
    """RingSwap models (home ram, window 2, prefetch 1) of the same files."""
    return {k: load_swapped_model(p, SwapSettings(2, 1), home="ram") for k, p in models.items()}


def comfy_reference(stock_model, lora_sd, strength=1.0, runs=True, n_inputs=2):
    """ComfyUI's own LoRA patching of the stock model: patched weights and outputs."""
    ref, _ = comfy.sd.load_lora_for_models(stock_model, None, from_diffusers_names(lora_sd), strength, 0)
    outs = [forward(ref, *inputs(seed=s)) for s in range(n_inputs)]
    samples = [ksample(ref, seed) for seed in (11, 12)] if runs else []
    comfy.model_management.unload_all_models()
    weights = patched_weights(stock_model, from_diffusers_names(lora_sd), strength)
    return {"weights": weights, "outs": outs, "runs": samples, "stock": stock_model}


def same_as_comfyui(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Our LoRA output against ComfyUI's own patching: bit for bit on the CPU; on CUDA the
    fused fold differs by at most one ulp per weight (FoldProbe checks each weight), so the
    outputs (forwards and sampled latents) agree to 1e-3 (relative L2)."""
    if comfy.model_management.get_torch_device().type == "cpu":   # sampled latents come back on the CPU
        return torch.equal(got, want)
    return ((got.float() - want.float()).norm() / want.float().norm()).item() <= 1e-3


def apply_node(model, name, strength=1.0):
    (m,) = RingSwapLoRA().apply(model, name, strength)
    return m


# ----- every block gets its LoRA, at every window / prefetch / home ------------------------
def test_lora_finds_blocks_through_the_declared_interface(stock, swapped):
    """lora.blocks.SwappedBlocks is what the LoRA side reads of a block-swapped model: a
    weight key's block and tensor, the block's module and layout; a stock patcher has none."""
    from ringswap.lora.blocks import SwappedBlocks, swapped_blocks
    from ringswap.lora.checks import weight_shape
    model = swapped["fp32"]
    blocks = swapped_blocks(model)
    assert isinstance(blocks, SwappedBlocks) and swapped_blocks(stock["fp32"]) is None
    assert blocks.block_of("diffusion_model.blocks.1.ffn.0.weight") == (1, "ffn.0.weight")
    assert blocks.block_of("diffusion_model.head.head.weight") is None
    module, layout = blocks.block(1)
    assert module is model.model.diffusion_model.blocks[1]
    want = tuple(comfy.utils.get_attr(stock["fp32"].model, "diffusion_model.blocks.1.ffn.0.weight").shape)
    assert weight_shape(model, "diffusion_model.blocks.1.ffn.0.weight") == want


@pytest.fixture(scope="module")
def mixed_reference(stock, loras):
    return comfy_reference(stock["fp32"], loras["mixed"][1], n_inputs=1)


@pytest.mark.parametrize("home", ["ram", "disk", "patch"])
def test_every_block_gets_its_lora_every_window_prefetch_home(models, loras, mixed_reference, home):
    ref = mixed_reference
    name = loras["mixed"][0]
    if home == "patch":
        base = ref["stock"]
    else:
        base = load_swapped_model(models["fp32"], SwapSettings(1, 0), home=home, disk_workers=2)
    for window in range(1, BLOCKS + 1):
        for prefetch in range(3):
            (swapped,) = RingSwapPatch().patch(base, window, prefetch, "auto")
            if home == "patch":   # the stock LoRA loader on a RingSwap MODEL
                (model,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(
                    swapped, loras["mixed_comfy"][0], 1.0)
            else:
                model = apply_node(swapped, name)
            probe = FoldProbe(model, {k: w for k, w in ref["weights"].items()})
            try:
                out = forward(model, *inputs(seed=0))
                runs = [ksample(model, seed) for seed in (11, 12)]
            finally:
                probe.remove()
            where = f"home={home} window={window} prefetch={prefetch}"
            assert not probe.bad, f"{where}: folded weights differ from ComfyUI's: {probe.bad[:4]}"
            assert all(c >= 1 + 2 * 2 for c in probe.checks), (where, probe.checks)
            assert same_as_comfyui(out, ref["outs"][0]), f"{where}: forward"
            for k in range(2):
                assert same_as_comfyui(runs[k], ref["runs"][k]), f"{where}: sampling run {k}"
            comfy.model_management.unload_all_models()


# ----- each format, bf16 and fp32 bases, against ComfyUI ---------------------------------
FORMAT_CASES = [(f, d) for f in FORMATS if f != "mixed" for d in ("fp32", "bf16")] + [("mixed", "bf16")]


@pytest.mark.parametrize("fmt,dtype", FORMAT_CASES)   # mixed on fp32: the window/prefetch/home test
def test_format_equals_comfyui_patching(stock, swapped, loras, fmt, dtype):
    name, sd = loras[fmt]
    ref = comfy_reference(stock[dtype], sd, runs=False, n_inputs=1)
    assert ref["weights"], "ComfyUI patched nothing"
    base = swapped[dtype]
    model = apply_node(base, name)
    assert set(model.patches) == set(ref["weights"]), "same keys patched as ComfyUI"
    probe = FoldProbe(model, {k: w for k, w in ref["weights"].items()
                              if k.startswith("diffusion_model.blocks.")})
    try:
        out = forward(model, *inputs(seed=0))
    finally:
        probe.remove()
    assert not probe.bad, probe.bad[:4]
    assert min(probe.checks) >= 1
    assert same_as_comfyui(out, ref["outs"][0]), f"{fmt} {dtype}: output"
    assert not torch.equal(forward(base, *inputs(seed=0)), out), "the LoRA changed nothing"


def test_diffusers_names_attn1_is_self_attention(models, loras, swapped):
    """diffusers `attn1` = Wan's self_attn, `attn2` = cross_attn (the seed swapped them)."""
    name, sd = loras["diffusers"]
    model = apply_node(swapped["fp32"], name)
    assert "diffusion_model.blocks.0.self_attn.q.weight" in model.patches
    assert "diffusion_model.blocks.0.cross_attn.o.weight" in model.patches
    assert "diffusion_model.blocks.3.ffn.0.weight" in model.patches
    up = sd["diffusion_model.blocks.1.attn1.to_k.lora_B.weight"]
    (patch,) = model.patches["diffusion_model.blocks.1.self_attn.k.weight"]
    assert torch.equal(patch[1].weights[0], up)


def test_non_block_weights_are_patched_by_comfyui(models, loras, mixed_reference, swapped):
    ref = mixed_reference
    model = apply_node(swapped["fp32"], loras["mixed"][0])
    forward(model, *inputs(seed=0))
    for key in ("diffusion_model.head.head.weight", "diffusion_model.text_embedding.0.weight"):
        assert torch.equal(comfy.utils.get_attr(model.model, key), ref["weights"][key]), key


def test_stock_lora_loaders_and_stack_equal_the_node(models, loras, swapped, stock):
    name = loras["kohya"][0]
    base = swapped["fp32"]
    want = forward(apply_node(base, name, 0.8), *inputs(seed=0))
    # the node on a MODEL that is not block-swapped: plain ComfyUI patching, same result
    assert same_as_comfyui(forward(apply_node(stock["fp32"], name, 0.8), *inputs(seed=0)), want)
    (a,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, name, 0.8)
    b, _ = comfy_nodes.LoraLoader().load_lora(base, None, name, 0.8, 0.0)
    rows = {"lora_1_on": True, "lora_1_name": name, "lora_1_strength": 0.8,
            "lora_2_on": False, "lora_2_name": loras["peft"][0], "lora_2_strength": 1.0,
            "lora_3_on": True, "lora_3_name": "None", "lora_3_strength": 1.0,
            "lora_4_on": True, "lora_4_name": loras["diff_b"][0], "lora_4_strength": 0.0}
    (c,) = RingSwapLoRAStack().apply(base, **rows)
    for m in (a, b, c):
        assert m.ringswap == base.ringswap, "LoRA clones keep the swap settings"
        assert same_as_comfyui(forward(m, *inputs(seed=0)), want)


def test_stack_chains_like_nodes(models, loras):
    base = load_swapped_model(models["fp32"], SwapSettings(1, 1), home="disk", disk_workers=2)
    chained = apply_node(apply_node(base, loras["peft"][0], 0.7), loras["diff_b"][0], -0.5)
    rows = {"lora_1_on": True, "lora_1_name": loras["peft"][0], "lora_1_strength": 0.7,
            "lora_2_on": True, "lora_2_name": loras["diff_b"][0], "lora_2_strength": -0.5,
            "lora_3_on": True, "lora_3_name": "None", "lora_3_strength": 1.0,
            "lora_4_on": False, "lora_4_name": "None", "lora_4_strength": 1.0}
    (stacked,) = RingSwapLoRAStack().apply(base, **rows)
    assert torch.equal(forward(chained, *inputs(seed=1)), forward(stacked, *inputs(seed=1)))


# ----- strength changes between runs: no reload, exact ------------------------------------
def home_bytes(engine):
    return {i: b.flat.clone() for i, b in engine.pool.blocks.items()}


def test_strength_changes_equal_fresh_loads(models, loras):
    name = loras["mixed"][0]
    base = load_swapped_model(models["bf16"], SwapSettings(2, 1), home="ram")
    engine = base.swap_engine
    home = home_bytes(engine)
    plain = ksample(base, 5)
    node = RingSwapLoRA()
    got = {s: ksample(node.apply(base, name, s)[0], 5) for s in (1.0, 0.5, 0.0, 1.0)}
    for s in (1.0, 0.5):
        fresh = load_swapped_model(models["bf16"], SwapSettings(2, 1), home="ram")
        assert torch.equal(got[s], ksample(RingSwapLoRA().apply(fresh, name, s)[0], 5)), s
        comfy.model_management.unload_all_models()
    assert torch.equal(got[0.0], plain), "strength 0 must give the base model exactly"
    assert not torch.equal(got[0.5], plain) and not torch.equal(got[0.5], got[1.0])
    assert node.apply(base, name, 0.0)[0] is base
    # the home was never written and never reloaded
    assert base.swap_engine is engine
    for i, b in home.items():
        assert torch.equal(engine.pool.blocks[i].flat, b), f"home of block {i} changed"
    # a LoRA'd model and the plain one alternate without reloading, each exact
    lora = node.apply(base, name, 0.5)[0]
    for m, want in ((lora, got[0.5]), (base, plain), (lora, got[0.5])):
        assert torch.equal(ksample(m, 5), want)


def test_patches_at_strength_zero_fold_nothing(models, loras, swapped):
    base = swapped["fp32"]
    m = base.clone()
    m.add_patches(comfy.lora.load_lora(build_lora("kohya", blocks=BLOCKS), comfy.lora.model_lora_keys_unet(m.model, {})), 0.0)
    assert m.patches and m.block_folder_on(m.load_device) is None
    assert torch.equal(forward(m, *inputs(seed=0)), forward(base, *inputs(seed=0)))


def test_fold_time_in_run_stats(models, loras, caplog, swapped):
    base = swapped["fp32"]
    model = apply_node(base, loras["kohya"][0])
    with caplog.at_level(logging.INFO, logger="ringswap"):
        ksample(model, 3)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap run:")]
    assert "fold on landing" in line and "ms per block" in line
    assert isinstance(model.block_folder_on(model.load_device), BlockFolder)


# ----- bad input --------------------------------------------------------------------------
def test_lora_for_another_model_warns_and_changes_nothing(models, loras, caplog, swapped):
    name, sd = loras["flux"]
    base = swapped["fp32"]
    with caplog.at_level(logging.WARNING):
        out = apply_node(base, name)
    assert out is base
    msgs = [r.getMessage() for r in caplog.records]
    assert any(f"0 of {len(sd)} keys matched" in m and name in m for m in msgs), msgs
    assert not any(m.startswith("lora key not loaded") for m in msgs), "one summary line, not one per key"


def test_lora_with_wrong_shapes_is_refused_naming_key_and_shapes(models, loras, swapped):
    name = loras["wide"][0]
    base = swapped["fp32"]
    want = forward(base, *inputs(seed=0))
    with pytest.raises(ValueError) as err:
        apply_node(base, name)
    assert re.search(r"shape mismatch at 'diffusion_model\.blocks\.\d+\.[\w.]+\.weight': the LoRA's lora patch is "
                     r"for a weight of shape \((256|512), (256|512)\), but the model's weight has shape "
                     r"\((128|256), (128|256)\)", str(err.value)), str(err.value)
    # the stock loader cannot check; the fold plan refuses it before anything lands
    (model,) = comfy_nodes.LoraLoaderModelOnly().load_lora_model_only(base, name, 1.0)
    with pytest.raises(ValueError, match=r"shape mismatch at 'diffusion_model\.blocks\.\d"):
        forward(model, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    assert torch.equal(forward(base, *inputs(seed=0)), want), "nothing half-loaded"


@pytest.mark.parametrize("broken", ["truncated", "garbage"])
def test_corrupt_lora_file_is_a_clear_error(models, loras, broken, swapped):
    base = swapped["fp32"]
    with pytest.raises(ValueError, match=rf"cannot read the LoRA file '.*{broken}\.safetensors'"):
        apply_node(base, f"{broken}.safetensors")
    rows = {f"lora_{i}_{k}": v for i in range(1, 5) for k, v in (("on", True), ("name", "None"), ("strength", 1.0))}
    rows["lora_2_name"] = f"{broken}.safetensors"
    with pytest.raises(ValueError, match=rf"{broken}\.safetensors"):
        RingSwapLoRAStack().apply(base, **rows)


def test_nodes_have_tooltips_and_are_registered(loras):
    from ringswap.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    for key, cls in (("RingSwapLoRA", RingSwapLoRA), ("RingSwapLoRAStack", RingSwapLoRAStack)):
        assert NODE_CLASS_MAPPINGS[key] is cls and NODE_DISPLAY_NAME_MAPPINGS[key]
        assert cls.CATEGORY == "RingSwap" and cls.RETURN_TYPES == ("MODEL",)
        req = cls.INPUT_TYPES()["required"]
        for widget, spec in req.items():
            assert spec[1].get("tooltip"), f"{key}.{widget} has no tooltip"
    req = RingSwapLoRA.INPUT_TYPES()["required"]
    assert loras["kohya"][0] in req["lora_name"][0]
    stack = RingSwapLoRAStack.INPUT_TYPES()["required"]
    assert stack["lora_1_name"][0][0] == "None" and stack["lora_4_on"][0] == "BOOLEAN"


def test_partial_match_warns_once_text_encoder_keys_are_expected(swapped, caplog):
    from ringswap.lora.apply import apply_lora
    base = swapped["fp32"]
    six = build_lora("kohya", blocks=BLOCKS + 2)            # blocks 4 and 5 do not exist here
    te = {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(8, 4),
          "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 8)}
    with caplog.at_level(logging.WARNING):
        apply_lora(base, {**build_lora("kohya", blocks=BLOCKS), **te}, 1.0, "with_te")
        apply_lora(base, six, 1.0, "six")
    msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("with_te" in m for m in msgs), msgs
    n = len(six)
    (line,) = [m for m in msgs if "six" in m]
    assert f"{n * BLOCKS // (BLOCKS + 2)} of {n} keys matched" in line and "lora_unet_blocks_4_" in line
