"""GGUF models (city96's ComfyUI-GGUF, the real pack from ../shared) block-swapped by RingSwap
Patch and read by RingSwap Model Loader: the Unet Loader (GGUF) MODEL streams its quantized
blocks in their GGUF bytes and the output equals ComfyUI-GGUF's own run bit for bit (LoRAs on
GGUF: test_gguf_lora.py)."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import comfy.model_management
import folder_paths
import nodes

from ringswap.lora import kernels
from ringswap.nodes.patch import RingSwapPatch
from support.gguf_case import BLOCKS, FILES, PACK, gguf_dir, load_gguf, lora_on, pack_mark, same_lora  # noqa: F401
from support.gguf_files import write_wan_gguf
from wan_model import forward, inputs, tiny_wan

pytestmark = pack_mark()


@pytest.mark.parametrize("qtype,other", FILES)
def test_gguf_model_patched_equals_comfyui_gguf(gguf_dir, qtype, other):
    """Unet Loader (GGUF) alone vs -> RingSwap Patch at windows 1, 2 and all, prefetch 0-2,
    two runs each: bit-identical; the streamed blocks travel in their GGUF bytes."""
    name = f"wan_{qtype}_{other}.gguf"
    stock = load_gguf(name)
    assert type(stock).__name__ == "GGUFModelPatcher"
    types = {getattr(getattr(t, "tensor_type", None), "name", None) for t in stock.model.diffusion_model.parameters()}
    assert qtype in types and other in types, types
    want = forward(stock, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    for window, prefetch in ((1, 0), (1, 1), (2, 2), (BLOCKS, 1)):
        (model,) = RingSwapPatch().patch(load_gguf(name), window, prefetch, "auto")
        engine = model.swap_engine
        for _ in range(2):
            assert torch.equal(forward(model, *inputs(seed=0)), want), (qtype, window, prefetch)
        qkv = next(a for a in engine.states[0].layout.attrs if (a.path, a.name) == ("self_attn.q", "weight"))
        entry = engine.states[0].layout.entries[qkv.entries[0]]
        assert entry.dtype == torch.uint8 and qkv.codec is not None, "the block weight travels as GGUF bytes"
        # the pack's dequantize of every type here but Q8_0 waits for the stream: made dense on landing instead
        dense = model.ringswap_run.plan.window.inputs.dense_bytes
        assert any(dense) == (qtype != "Q8_0"), (qtype, dense)
        plan = model.ringswap_run.plan.window   # what the blocks hold beyond their bytes: the planned dense weights
        assert engine.dense_held_bytes(engine.device) == pytest.approx(
            plan.block_bytes_on_device - engine.device_bytes(), rel=0.02, abs=4096), (qtype, window, prefetch)
        comfy.model_management.unload_all_models()


@pytest.mark.parametrize("family,arch", [("wan_vace", "wan"), ("flux", "flux")])
def test_gguf_vace_and_flux_patched_equal_comfyui_gguf(tmp_path, family, arch):
    """Wan VACE (vace blocks interleaved, learned order) and Flux (double and single blocks)
    GGUF files (Q5_0: made dense on landing) through Unet Loader (GGUF): RingSwap Patch at windows
    1, 2 and all equals the pack's own run bit for bit, two calls on different inputs each."""
    from support import family_files as ffs
    from support import family_models as fm
    ff = ffs.BY_NAME[family]
    if ff.family.missing():
        pytest.skip(ff.family.missing())
    src = ffs.write(ff, str(tmp_path / f"tiny_{family}.safetensors"))
    if ffs.unsupported(ff, src):
        pytest.skip(f"{family}: {ffs.unsupported(ff, src)}")
    name = f"gguf_{family}.gguf"
    write_wan_gguf(src, str(tmp_path / name), "Q5_0", "F32", arch=arch)   # made dense on landing
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path))
    try:
        stock = load_gguf(name)
        assert type(stock.model.diffusion_model).__name__ == ff.family.dm_class
        xs = [ff.family.inputs(seed=s) for s in (1, 2)]
        want = [fm.forward(stock, *x) for x in xs]
        comfy.model_management.unload_all_models()
        n = stock.model.diffusion_model
        blocks = sum(len(getattr(n, lst)) for lst in ff.family.lists)
        for window, prefetch in ((1, 0), (2, 1), (blocks, 1)):
            (model,) = RingSwapPatch().patch(load_gguf(name), window, prefetch, "auto")
            assert model.swap_engine.num_blocks == blocks
            for x, w in zip(xs, want):
                assert torch.equal(fm.forward(model, *x), w), (family, window, prefetch)
            assert any(model.ringswap_run.plan.window.inputs.dense_bytes), "Q5_0 is made dense on landing"
            comfy.model_management.unload_all_models()
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(tmp_path))


@pytest.mark.parametrize("home", ["ram", "disk", "auto"])
def test_model_loader_reads_gguf_files(gguf_dir, home):
    """RingSwap Model Loader on a .gguf (built by ComfyUI-GGUF's loader code, blocks read from the
    file with positioned reads): equal to Unet Loader (GGUF) bit for bit at windows 1, 2 and
    all, two runs each, homes ram, disk and auto; with a LoRA equal to the pack's LoRA run."""
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    name = "wan_Q4_K_F32.gguf"
    path = os.path.join(gguf_dir, name)
    want = forward(load_gguf(name), *inputs(seed=0))
    want_lora = forward(lora_on(load_gguf(name), "kohya"), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    for window, prefetch in ((1, 0), (2, 1), (BLOCKS, 1)):
        model = load_swapped_model(path, SwapSettings(window, prefetch), home=home, disk_workers=2)
        assert model.swap_engine.read_block is not None and model.swap_engine.homes.mode == home
        qkv = next(a for a in model.swap_engine.states[0].layout.attrs if (a.path, a.name) == ("self_attn.q", "weight"))
        assert qkv.codec is not None, "the block weights stay GGUF bytes"
        for _ in range(2):
            assert torch.equal(forward(model, *inputs(seed=0)), want), (home, window, prefetch)
        comfy.model_management.unload_all_models()
        assert same_lora(forward(lora_on(model, "kohya"), *inputs(seed=0)), want_lora), (home, window)
        comfy.model_management.unload_all_models()


def test_model_loader_gguf_errors_name_the_file(gguf_dir, tmp_path):
    """A .gguf lacking a block tensor with home disk or auto, a file the pack cannot read, and a
    .gguf without ComfyUI-GGUF installed: clear errors naming the file."""
    from ringswap.loaders.comfyui_adapter import gguf_file
    path = os.path.join(gguf_dir, "wan_Q8_0_F32.gguf")
    saved = nodes.NODE_CLASS_MAPPINGS.pop(gguf_file.PACK_NODE)
    try:
        with pytest.raises(ValueError, match="ComfyUI-GGUF") as ei:
            gguf_file.pack_nodes(path)
        assert path in str(ei.value) and "not installed" in str(ei.value)
    finally:
        nodes.NODE_CLASS_MAPPINGS[gguf_file.PACK_NODE] = saved
    assert "wan_Q8_0_F32.gguf" in gguf_file.gguf_names()
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    src = tiny_wan(str(tmp_path), blocks=2, dtype=torch.float32)
    converted = write_wan_gguf(src, str(tmp_path / "bf16_norms.gguf"), "Q8_0", bf16_1d=True)
    garbage, truncated = str(tmp_path / "garbage.gguf"), str(tmp_path / "truncated.gguf")
    with open(garbage, "wb") as f:
        f.write(b"not a gguf file" * 100)
    with open(path, "rb") as f, open(truncated, "wb") as out:
        out.write(f.read(os.path.getsize(path) // 2))
    for bad in (garbage, truncated):
        with pytest.raises(ValueError, match="ComfyUI-GGUF cannot read this file") as ei:
            load_swapped_model(bad, SwapSettings(1), home="ram")
        assert bad in str(ei.value)
    sd = load_file(src)
    del sd["blocks.1.norm3.bias"]   # ComfyUI leaves the model's own tensor there: not in the file
    save_file(sd, str(tmp_path / "lacking.safetensors"))
    lacking = write_wan_gguf(str(tmp_path / "lacking.safetensors"), str(tmp_path / "lacking.gguf"), "Q8_0")
    for home in ("disk", "auto"):
        with pytest.raises(ValueError, match="cannot be read from it") as ei:
            load_swapped_model(lacking, SwapSettings(1), home=home)
        assert lacking in str(ei.value) and "'blocks.1.norm3.bias' (no tensor" in str(ei.value) \
            and "home=ram" in str(ei.value)
    assert load_swapped_model(lacking, SwapSettings(1), home="ram").swap_engine.read_block is None, \
        "home=ram copies the homes from the pack's model"
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path))
    try:   # BF16 1-D tensors the pack loads as F32: read from the file and cast
        want = forward(load_gguf("bf16_norms.gguf"), *inputs(seed=0))
        comfy.model_management.unload_all_models()
        model = load_swapped_model(converted, SwapSettings(1), home="ram")
        assert model.swap_engine.read_block is not None
        assert torch.equal(forward(model, *inputs(seed=0)), want)
        comfy.model_management.unload_all_models()
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(tmp_path))


def test_plan_facts_of_a_gguf_leave_the_packs_options_alone(gguf_dir, tmp_path):
    """Unet Loader (GGUF/Advanced) keeps its dequant and patch dtypes on the pack's Linear class,
    which every GGUF model shares; the plan route (the browser asks it at any time) reads a
    .gguf's facts without setting them back to the defaults."""
    import shutil

    from ringswap.loaders.comfyui_adapter import file_plan
    model = PACK.NODE_CLASS_MAPPINGS["UnetLoaderGGUFAdvanced"]().load_unet("wan_Q8_0_F32.gguf", "float32",
                                                                             "bfloat16", False)[0]
    linear = type(model.model.diffusion_model.head.head)
    file_plan.file_facts(shutil.copy(os.path.join(gguf_dir, "wan_Q5_0_F32.gguf"), str(tmp_path / "facts.gguf")))
    assert (linear.dequant_dtype, linear.patch_dtype) == (torch.float32, torch.bfloat16)
    load_gguf("wan_Q8_0_F32.gguf")   # the pack's own Unet Loader (GGUF) sets its defaults back
    assert (linear.dequant_dtype, linear.patch_dtype) == (None, None)


def test_model_loader_gguf_file_replaced_while_loading_is_named(gguf_dir, tmp_path, monkeypatch):
    """The file replaced after ComfyUI-GGUF built the model from it and before its blocks are
    read (a download finishing): an error naming it, not one file's blocks in the other's model."""
    import shutil
    from ringswap.loaders.comfyui_adapter import gguf_file
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    from ringswap.loaders.model_file.range_reader import FileChangedError
    path = str(tmp_path / "downloading.gguf")
    shutil.copy(os.path.join(gguf_dir, "wan_Q8_0_F32.gguf"), path)
    built = gguf_file.load_gguf_model

    def built_then_replaced(p, *args, **kwargs):
        out = built(p, *args, **kwargs)
        os.replace(shutil.copy(os.path.join(gguf_dir, "wan_Q5_0_F32.gguf"), path + ".new"), path)
        return out
    monkeypatch.setattr(gguf_file, "load_gguf_model", built_then_replaced)
    for home in ("ram", "disk"):
        with pytest.raises(FileChangedError, match="downloading.gguf changed on disk while the model was loaded"):
            load_swapped_model(path, SwapSettings(1), home=home)


def test_model_loader_gguf_file_replaced_is_named(gguf_dir, tmp_path):
    """A .gguf replaced on disk while the Model Loader serves blocks from it (home=disk): the
    next run fails naming the file, nothing stays attached, and a fresh load of the new file
    equals ComfyUI-GGUF's own run of it."""
    import shutil
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    from ringswap.loaders.model_file.range_reader import FileChangedError
    path = str(tmp_path / "replaced.gguf")
    shutil.copy(os.path.join(gguf_dir, "wan_Q8_0_F32.gguf"), path)
    model = load_swapped_model(path, SwapSettings(1), home="disk", disk_workers=2)
    forward(model, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    os.replace(shutil.copy(os.path.join(gguf_dir, "wan_Q5_0_F32.gguf"), path + ".new"), path)
    with pytest.raises(FileChangedError, match="replaced.gguf"):
        forward(model, *inputs(seed=0))
    assert not model.swap_engine.attached
    comfy.model_management.unload_all_models()
    want = forward(load_gguf("wan_Q5_0_F32.gguf"), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    assert torch.equal(forward(load_swapped_model(path, SwapSettings(1), home="disk"), *inputs(seed=0)), want)
    comfy.model_management.unload_all_models()


@pytest.mark.server
def test_gguf_workflow_over_http_equals_comfyui_gguf(shared_models, shared_server):
    """As a user would: Unet Loader (GGUF) [-> LoraLoaderModelOnly] -> KSampler vs the same
    -> RingSwap Patch (windows 1 and 2) -> KSampler, and vs RingSwap Model Loader on the .gguf
    (homes ram and disk) [-> LoraLoaderModelOnly] -> KSampler, on a server that loaded the real
    ComfyUI-GGUF pack: the same latent bit for bit, without and with a LoRA."""
    from safetensors.torch import load_file
    from support.lora_files import build_lora, write_lora
    from support.workflows import build_workflow
    d = os.path.join(shared_models, "diffusion_models")
    os.makedirs(d, exist_ok=True)
    name, lora = "tiny_wan_http_Q8_0.gguf", "gguf_http_kohya.safetensors"
    write_wan_gguf(tiny_wan(str(shared_models), blocks=BLOCKS, dtype=torch.float32, seed=3), os.path.join(d, name))
    write_lora(os.path.join(shared_models, "loras", lora), build_lora("kohya", blocks=BLOCKS, seed=4))
    assert "UnetLoaderGGUF" in shared_server.object_info(), "the server did not load ComfyUI-GGUF"

    def latent(use_patch, window=2, prefix="gguf_stock", with_lora=False, home=None):
        wf = build_workflow(name, use_patch=use_patch, window=window, seed=5, steps=2, filename_prefix=prefix)
        wf["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}}
        if home is not None:   # RingSwap Model Loader on the .gguf instead
            wf["1"] = {"class_type": "RingSwapModelLoader",
                       "inputs": {"unet_name": name, "window": window, "prefetch": 1, "home": home,
                                  "pin_memory": "auto", "disk_workers": 2}}
        if with_lora:
            wf["9"] = {"class_type": "LoraLoaderModelOnly",
                       "inputs": {"model": ["1", 0], "lora_name": lora, "strength_model": 0.8}}
            (wf["2"] if use_patch else wf["6"])["inputs"]["model"] = ["9", 0]
        entry = shared_server.run(wf, timeout=300)
        (path,) = [p for p in shared_server.output_files(entry, "latents") if os.path.isfile(p)]
        return load_file(path)["latent_tensor"]
    for with_lora in (False, True):
        want = latent(False, prefix=f"gguf_stock_{with_lora}", with_lora=with_lora)
        for window in (1, 2):
            for run in range(2):
                got = latent(True, window, f"gguf_w{window}_{run}_{with_lora}", with_lora)
                assert same_lora(got, want) if with_lora else torch.equal(got, want), (with_lora, window, run)
        for home in ("ram", "disk"):
            got = latent(False, 1, f"gguf_loader_{home}_{with_lora}", with_lora, home=home)
            assert same_lora(got, want) if with_lora else torch.equal(got, want), ("Model Loader", home, with_lora)
    assert not torch.equal(latent(False, prefix="gguf_stock_again"), want), "the LoRA changes the latent"


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_gguf_on_cuda_bit_exact_and_lora_close(gguf_dir, qtype):
    """On CUDA: RingSwap Patch on a GGUF MODEL at windows 1-2, prefetch 1-2, and all resident
    equals ComfyUI-GGUF's own run bit for bit; with a LoRA (fused addmm_ on the land stream; all
    resident: the dense weights made before each call) it differs from the pack's per-forward
    math by far less than the LoRA's own effect."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name = f"wan_{qtype}_F32.gguf"
    x = inputs(seed=0)
    plain = forward(load_gguf(name), *x)
    want = forward(lora_on(load_gguf(name), "kohya"), *x)
    comfy.model_management.unload_all_models()
    base = load_gguf(name)
    for window, prefetch in ((1, 1), (2, 2), (BLOCKS, 1)):
        (model,) = RingSwapPatch().patch(base, window, prefetch, "auto")
        for _ in range(2):
            assert torch.equal(forward(model, *x), plain), (qtype, window, prefetch)
        comfy.model_management.unload_all_models()
        (model,) = RingSwapPatch().patch(lora_on(base, "kohya"), window, prefetch, "auto")
        for _ in range(2):
            got = forward(model, *x)
            assert (got - want).float().norm() <= 0.02 * (want - plain).float().norm(), (qtype, window, prefetch)
        folder, device = model.block_folder_on(model.load_device), model.load_device
        assert 0 < folder.kept_bytes(device) <= folder.pair_bytes(device), "the LoRA pairs kept as planned"
        plan = model.ringswap_run.plan.window   # windows 2 (prefetch 2) and 4 hold every block; 1 streams
        assert plan.inputs.dense_per_call == (not plan.residency.streamed), "held where blocks stream, per call where all are resident"
        comfy.model_management.unload_all_models()
    # the Q4_K file's linears whose rows are not whole super-blocks are Q8_0
    for kind in {"q8_0", qtype.lower()}:
        assert any(name == kind for name, _ in kernels._BUILT), f"{kind} dequantized and patched in one kernel"
    from ringswap.lora import dense_fold
    assert dense_fold._KERNEL_OK and all(dense_fold._KERNEL_OK.values()), dense_fold._KERNEL_OK


@pytest.mark.gpu
def test_gguf_patch_on_cuda_gives_the_non_block_pages_back(gguf_dir, caplog):
    """On CUDA: once a Patch on a GGUF MODEL has loaded, no weight of it is left a view of the
    pack's memory map (the blocks in their homes, the others on the GPU), and on a Linux kernel
    with MADV_PAGEOUT the load line says how much of the map's pages went back."""
    import logging

    from ringswap.swap import page_out
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    comfy.model_management.unload_all_models()
    (model,) = RingSwapPatch().patch(load_gguf("wan_Q8_0_F32.gguf"), 1, 1, "auto")
    with caplog.at_level(logging.INFO, logger="ringswap"):
        forward(model, *inputs(seed=0))
    assert page_out.mapped_tensors(model.model) == []
    import platform
    kernel = tuple(int(p) for p in platform.release().split(".")[:2] if p.isdigit())
    comfy.model_management.unload_all_models()
    if not (page_out.FileMaps().ranges and kernel >= (5, 4)):   # MADV_PAGEOUT: Linux 5.4+
        pytest.skip("page-out probe negative (no file mappings listed, or a kernel before 5.4): "
                    "the pages-given-back line cannot show")
    assert any("of the file's pages given back" in r.getMessage() for r in caplog.records)
