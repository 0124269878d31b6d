"""GGUF models (city96's ComfyUI-GGUF, the real pack from ../shared) block-swapped by RingSwap
Patch: the Unet Loader (GGUF) MODEL streams its quantized blocks in their GGUF bytes and the
output equals ComfyUI-GGUF's own run bit for bit."""
import logging
import math
import os
import sys

import pytest
import torch

import comfy.model_management
import folder_paths
import nodes

from conftest import COMFY, CUDA
from ringswap.loaders.comfyui_adapter import run_plan
from ringswap.loaders.comfyui_adapter.comfy_features import inference_dtype
from ringswap.lora import kernels
from ringswap.nodes.patch import RingSwapPatch
from support.gguf_files import QTYPES, comfyui_gguf_pack, write_wan_gguf
from support.lora_files import LINEARS, linear_shape
from wan_model import forward, inputs, tiny_wan

PACK = comfyui_gguf_pack(COMFY)
if PACK is None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"ComfyUI-GGUF is not linked into {COMFY}/custom_nodes (make test does it from ../shared)",
                    pytrace=False)
    pytestmark = pytest.mark.skip(reason=f"ComfyUI-GGUF not in {COMFY}/custom_nodes (no ../shared/comfyui-gguf)")

BLOCKS = 4
FILES = [(q, "F32") for q in QTYPES] + [("Q8_0", "F16")]   # (block linears, the other 2-D+ tensors)


def same_lora(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A LoRA run on GGUF against ComfyUI-GGUF's own: bit for bit on the CPU; on CUDA plain LoRA
    pairs fold with a fused addmm_ (one rounding per weight), so within 5e-3 (relative L2)."""
    if not CUDA:
        return torch.equal(got, want)
    return ((got.float() - want.float()).norm() / want.float().norm()).item() <= 5e-3


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gguf_models"))
    src = tiny_wan(d, blocks=BLOCKS, dtype=torch.float32)
    for q, other in FILES:
        write_wan_gguf(src, os.path.join(d, f"wan_{q}_{other}.gguf"), q, other)
    folder_paths.add_model_folder_path("diffusion_models", d)   # "unet" is its legacy name
    yield d
    folder_paths.folder_names_and_paths["diffusion_models"][0].remove(d)


def load_gguf(name):
    (model,) = PACK.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(name)
    return model


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
        dense = model.ringswap_run.plan.inputs.dense_bytes
        assert any(dense) == (qtype != "Q8_0"), (qtype, dense)
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
            assert any(model.ringswap_run.plan.inputs.dense_bytes), "Q5_0 is made dense on landing"
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
        assert model.swap_engine.read_block is not None and model.swap_engine.home == home
        qkv = next(a for a in model.swap_engine.states[0].layout.attrs if (a.path, a.name) == ("self_attn.q", "weight"))
        assert qkv.codec is not None, "the block weights stay GGUF bytes"
        for _ in range(2):
            assert torch.equal(forward(model, *inputs(seed=0)), want), (home, window, prefetch)
        comfy.model_management.unload_all_models()
        assert same_lora(forward(lora_on(model, "kohya"), *inputs(seed=0)), want_lora), (home, window)
        comfy.model_management.unload_all_models()


def test_model_loader_gguf_errors_name_the_file(gguf_dir, tmp_path):
    """A .gguf whose block tensor ComfyUI-GGUF converts at load (so the file's bytes are not the
    block's) with home=disk, and a .gguf without ComfyUI-GGUF installed: clear errors."""
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
    for home in ("disk", "auto"):
        with pytest.raises(ValueError, match="converted at load") as ei:
            load_swapped_model(converted, SwapSettings(1), home=home)
        assert converted in str(ei.value) and "blocks.0." in str(ei.value) and "home=ram" in str(ei.value)
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path))
    try:   # home=ram copies those blocks from the pack's model once: equal to its own run
        want = forward(load_gguf("bf16_norms.gguf"), *inputs(seed=0))
        comfy.model_management.unload_all_models()
        model = load_swapped_model(converted, SwapSettings(1), home="ram")
        assert model.swap_engine.read_block is None
        assert torch.equal(forward(model, *inputs(seed=0)), want)
        comfy.model_management.unload_all_models()
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(tmp_path))


def test_model_loader_gguf_file_replaced_is_named(gguf_dir, tmp_path):
    """A .gguf replaced on disk while the Model Loader serves blocks from it (home=disk): the
    next run fails naming the file, nothing stays attached, and a fresh load of the new file
    equals ComfyUI-GGUF's own run of it."""
    import shutil
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
    from ringswap.loaders.model_file.block_reader import FileChangedError
    path = str(tmp_path / "replaced.gguf")
    shutil.copy(os.path.join(gguf_dir, "wan_Q8_0_F32.gguf"), path)
    model = load_swapped_model(path, SwapSettings(1), home="disk", disk_workers=2)
    forward(model, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    os.replace(shutil.copy(os.path.join(gguf_dir, "wan_Q5_0_F32.gguf"), path + ".new"), path)
    with pytest.raises(FileChangedError, match="replaced.gguf"):
        forward(model, *inputs(seed=0))
    assert model.swap_engine.att is None
    comfy.model_management.unload_all_models()
    want = forward(load_gguf("wan_Q5_0_F32.gguf"), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    assert torch.equal(forward(load_swapped_model(path, SwapSettings(1), home="disk"), *inputs(seed=0)), want)
    comfy.model_management.unload_all_models()


def test_out_of_memory_recovery_on_gguf_with_lora_is_exact(gguf_dir):
    """An out-of-memory in a streamed block of a GGUF MODEL with a LoRA (dense folds held per
    slot) retries the step at a smaller window, as for safetensors: the sampled latent equals
    ComfyUI-GGUF's own LoRA run, and no slot or dense weight is left behind."""
    from support.faults import inject_oom
    from wan_model import conditioning, latent
    name = "wan_Q4_K_F32.gguf"

    def ksample(model):
        (out,) = nodes.KSampler().sample(model, 5, 3, 1.0, "euler", "simple", conditioning(1), conditioning(2),
                                         latent())
        return out["samples"].clone()
    want = ksample(lora_on(load_gguf(name), "kohya"))
    comfy.model_management.unload_all_models()
    (model,) = RingSwapPatch().patch(lora_on(load_gguf(name), "kohya"), 3, 1, "auto")
    engine = model.swap_engine
    inject_oom(engine, call=2, block=BLOCKS - 1)
    assert same_lora(ksample(model), want)
    assert engine.plan.window == 2 and all(s.slot is None for s in engine.states)
    assert all(slot.replaced is None or slot.owner is not None for slot in engine.att.ring.slots)
    comfy.model_management.unload_all_models()


def lora_on(model, fmt, strength=1.0):
    """What the stock LoraLoaderModelOnly does: comfy.sd.load_lora_for_models(model, None, ...).
    `diffusers` (Wan's diffusers names, which ComfyUI's key map does not know): RingSwap's
    LoRA loader (lora.apply), which adds them to ComfyUI's map."""
    import comfy.sd
    from ringswap.lora.apply import apply_lora
    from support.lora_files import build_lora
    if fmt == "diffusers":
        patched = apply_lora(model, build_lora(fmt, blocks=BLOCKS), strength)
    else:
        patched, _ = comfy.sd.load_lora_for_models(model, None, build_lora(fmt, blocks=BLOCKS), strength, 0)
    assert patched.patches, fmt
    return patched


@pytest.mark.parametrize("fmt,qtype", [("kohya", "Q8_0"), ("peft", "Q4_K"), ("diffusers", "Q5_0"), ("mixed", "Q4_0")])
def test_lora_on_gguf_folds_once_per_landing_and_equals_comfyui_gguf(gguf_dir, fmt, qtype):
    """A LoRA (stock loader) on a GGUF MODEL under RingSwap Patch: each landed block's GGUF
    weights are dequantized and patched once (a dense weight bound in their place); outputs
    equal ComfyUI-GGUF's own LoRA run (its math per forward) at windows 1, 2 and all, two
    runs each. `mixed` also patches weights outside the blocks (hung on them as the pack does)
    and F32 norms in place. The same model without the LoRA afterwards is the plain output."""
    name = f"wan_{qtype}_F32.gguf"
    plain = forward(load_gguf(name), *inputs(seed=0))
    want = forward(lora_on(load_gguf(name), fmt), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    assert not torch.equal(want, plain), "the LoRA changes the output"
    base = load_gguf(name)
    for window, prefetch in ((1, 0), (2, 1), (BLOCKS, 1)):
        (model,) = RingSwapPatch().patch(lora_on(base, fmt), window, prefetch, "auto")
        folder = model.block_folder_on(model.load_device)
        assert folder is not None and any(folder.dense_bytes(b) for b in range(BLOCKS)), "dense folds planned"
        for _ in range(2):
            got = forward(model, *inputs(seed=0))
            assert same_lora(got, want), (fmt, qtype, window)
        comfy.model_management.unload_all_models()
    (model,) = RingSwapPatch().patch(base, 2, 1, "auto")
    assert torch.equal(forward(model, *inputs(seed=0)), plain), "nothing of the LoRA stays behind"
    comfy.model_management.unload_all_models()


def test_lora_strength_change_on_gguf_needs_no_reload(gguf_dir, caplog):
    """Strength 1 then 0.5 on the same loaded GGUF model: each equals ComfyUI-GGUF's own run
    at that strength, with no read of the file in between."""
    name = "wan_Q8_0_F32.gguf"
    base = load_gguf(name)
    caplog.set_level("INFO", logger="ringswap.patcher")
    for strength in (1.0, 0.5):
        want = forward(lora_on(load_gguf(name), "kohya", strength), *inputs(seed=0))
        comfy.model_management.unload_all_models()
        (model,) = RingSwapPatch().patch(lora_on(base, "kohya", strength), 2, 1, "auto")
        assert same_lora(forward(model, *inputs(seed=0)), want), strength
        planned = run_plan.plan_inputs(model, torch.device("cpu"), 10**12, None)
        itemsize = torch.empty(0, dtype=inference_dtype(model.model)).element_size()   # what the model computes in
        dense = sum(o * i for o, i in (linear_shape(n, 128, 256) for n in LINEARS)) * itemsize
        assert planned.block_sizes == tuple(s.layout.nbytes for s in model.swap_engine.states), "copied bytes"
        assert planned.dense_bytes == (dense,) * BLOCKS, "the dense weights a block holds while it computes"
        assert planned.nonblock_bytes > model.swap_state.nonblock_bytes, "the fold's workspace is planned"
        comfy.model_management.unload_all_models()
    assert any("GGUF dense weights: 0.00 GB a block" in r.getMessage() for r in caplog.records
               if r.name == "ringswap.patcher"), "the plan line says what the dense folds take"


def test_dense_folds_plan_the_packs_dequantize_temporaries(gguf_dir):
    """Which weights are made dense on landing, and the device bytes planned for one fold's
    temporaries on CUDA (where its kernel may fall back: the pack's dequantize,
    bench/dequant_peak.py): without a LoRA only the types whose dequantize waits for the stream
    (Q4_K 3.6 bytes a value, Q5_0 8.7), none for Q8_0; with plain LoRA pairs (kohya) Q8_0 2.2,
    Q4_K 3.6, Q5_0 8.7; with patches no kernel takes (LoHa), four float32. The largest weight
    is 128 x 256."""
    from ringswap.lora import dense_fold, gguf_kernels
    assert set(dense_fold.FALLBACK_BYTES) == set(gguf_kernels.ROW_BYTES), "a planned fallback for each kernel"
    cuda, largest = torch.device("cuda"), 128 * 256
    cases = {("Q8_0", None): None, ("Q4_K", None): 3.6, ("Q5_0", None): 8.7, ("Q8_0", "kohya"): 2.2,
             ("Q4_K", "kohya"): 3.6, ("Q5_0", "kohya"): 8.7, ("Q5_0", "loha"): 16}
    for (qtype, lora), per_value in cases.items():
        base = load_gguf(f"wan_{qtype}_F32.gguf")
        (model,) = RingSwapPatch().patch(lora_on(base, lora) if lora else base, 1, 1, "auto")
        folder = model.block_folder_on(cuda)
        if per_value is None:
            assert folder is None, qtype
            continue
        types = {op.type_name for ops in folder.ops.values() for op in ops}
        assert types == ({"Q8_0", "Q4_K"} if qtype == "Q4_K" and lora else {qtype}), (qtype, lora, types)
        assert folder.workspace_bytes(cuda) == math.ceil(largest * per_value), (qtype, lora)
        assert folder.writes_blocks is False, "dense folds leave the packed bytes as placed"
    comfy.model_management.unload_all_models()


def test_weights_made_dense_on_landing_stay_packed_where_only_that_fits(gguf_dir, caplog):
    """Under a VRAM budget that holds the ring of packed blocks but not their dense weights, a
    K-quant model without a LoRA keeps its weights packed in the pack's layers (one log line
    says so) and equals the pack's run bit for bit; with room for them they are made dense on
    landing again. A type never made dense (Q8_0) has nothing to give way: NotEnoughVRAM."""
    from ringswap.swap.planner import NotEnoughVRAM
    cpu, name = torch.device("cpu"), "wan_Q4_K_F32.gguf"
    want = forward(load_gguf(name), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    base = load_gguf(name)

    def planned(budget_kb, model=base):
        (m,) = RingSwapPatch().patch(model, 0, 1, "auto", vram_budget_gb=budget_kb / 1e6)
        try:
            return m, run_plan.plan_for_load(m, cpu, False)
        except NotEnoughVRAM:
            return m, None
    budgets = range(500, 20000, 50)
    first = next(kb for kb in budgets if planned(kb)[1] is not None)
    model, plan = planned(first)
    assert model.ringswap_run.packed_only and not any(plan.inputs.dense_bytes), "only packed weights fit"
    dense_kb = next(kb for kb in budgets if kb > first and not planned(kb)[0].ringswap_run.packed_only)
    model, plan = planned(dense_kb)
    assert any(plan.inputs.dense_bytes) and model.block_folder_on(cpu).dense_unpatched
    (model,) = RingSwapPatch().patch(base, 0, 1, "auto", vram_budget_gb=first / 1e6)
    with caplog.at_level(logging.INFO, logger="ringswap"):
        assert torch.equal(forward(model, *inputs(seed=0)), want)
    assert any("stay packed in their layers" in r.getMessage() for r in caplog.records)
    assert model.ringswap_run.packed_only and model.block_folder_on(cpu) is None
    comfy.model_management.unload_all_models()
    q8 = load_gguf("wan_Q8_0_F32.gguf")
    assert planned(first - 600, q8)[1] is None, "no optional dense weights: the budget is too small"


def test_a_kernel_is_used_only_where_it_equals_the_packs_dequantize(gguf_dir, monkeypatch, caplog):
    """The first weight of a type asks whether its kernel equals ComfyUI-GGUF's dequantize on this
    device (dequant and model dtypes too): a stand-in that does (the pack's own math) is then used
    at every landing; one that does not (zeros: a GPU or Triton build that rounds otherwise) is
    warned about once and never used, and the run still equals the pack's bit for bit."""
    import gguf
    from ringswap.lora import dense_fold, gguf_kernels
    name = "wan_Q4_K_F32.gguf"
    want = forward(load_gguf(name), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    dequant = sys.modules[PACK.__name__ + ".dequant"]
    calls: list[str] = []

    def packs_math(type_name, blocks, shape, dtype, mid, pairs, out=None):
        calls.append(type_name)
        qt = getattr(gguf.GGMLQuantizationType, type_name)
        w = dequant.dequantize(blocks, qt, shape, dtype=None if mid == torch.float16 else mid).to(dtype)
        return w if out is None else out.copy_(w)

    def zeros(type_name, blocks, shape, dtype, mid, pairs, out=None):
        calls.append(type_name)
        return torch.zeros(shape, dtype=dtype) if out is None else out.zero_()
    monkeypatch.setattr(kernels, "enabled", lambda device: True)
    for stand_in, used in ((packs_math, True), (zeros, False)):
        monkeypatch.setattr(gguf_kernels, "dense", stand_in)
        monkeypatch.setattr(dense_fold, "_KERNEL_OK", {})
        calls.clear()
        caplog.clear()
        (model,) = RingSwapPatch().patch(load_gguf(name), 1, 1, "auto")
        with caplog.at_level(logging.WARNING, logger="ringswap"):
            for _ in range(2):
                assert torch.equal(forward(model, *inputs(seed=0)), want), stand_in.__name__
        warned = [r for r in caplog.records if "differs from ComfyUI-GGUF's dequantize" in r.getMessage()]
        assert (len(calls) > 2 * BLOCKS, len(warned)) == ((True, 0) if used else (False, 1)), (stand_in.__name__, calls)
        (key, ok), = dense_fold._KERNEL_OK.items()   # one check: one type, dequant and model dtype, device
        assert (key[0], key[1], key[3], ok) == ("Q4_K", torch.float16, torch.device("cpu"), used), key
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
        plan = model.ringswap_run.plan   # windows 2 (prefetch 2) and 4 hold every block; 1 streams
        assert plan.inputs.dense_per_call == (not plan.residency.streamed), "held where blocks stream, per call where all are resident"
        comfy.model_management.unload_all_models()
    # the Q4_K file's linears whose rows are not whole super-blocks are Q8_0
    for kind in {"q8_0", qtype.lower()}:
        assert any(name == kind for name, _ in kernels._BUILT), f"{kind} dequantized and patched in one kernel"
    from ringswap.lora import dense_fold
    assert dense_fold._KERNEL_OK and all(dense_fold._KERNEL_OK.values()), dense_fold._KERNEL_OK
