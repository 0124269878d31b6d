"""LoRAs on GGUF models (city96's ComfyUI-GGUF, the real pack from ../shared) under RingSwap
Patch: each landed block's GGUF weights are dequantized and patched once, within the tolerance
of the pack's own per-forward LoRA math; the dense folds' planning, strength changes, OOM
recovery and the kernels' check against the pack's dequantize."""
import logging
import math
import sys

import pytest
import torch

import comfy.model_management
import nodes

from ringswap.loaders.comfyui_adapter.comfy_models import inference_dtype
from ringswap.lora import kernels
from ringswap.nodes.patch import RingSwapPatch
from support.gguf_case import BLOCKS, PACK, gguf_dir, load_gguf, lora_on, pack_mark, same_lora  # noqa: F401
from support.lora_files import LINEARS, linear_shape
from wan_model import forward, inputs

pytestmark = pack_mark()


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
        assert not any(map(folder.warm, range(BLOCKS))), "a block's first fold moves its pairs: not timed"
        for _ in range(2):
            got = forward(model, *inputs(seed=0))
            assert same_lora(got, want), (fmt, qtype, window)
        assert all(map(folder.warm, range(BLOCKS))), "folded once: timed from now on"
        comfy.model_management.unload_all_models()
    (model,) = RingSwapPatch().patch(base, 2, 1, "auto")
    assert torch.equal(forward(model, *inputs(seed=0)), plain), "nothing of the LoRA stays behind"
    comfy.model_management.unload_all_models()


def test_lora_strength_change_on_gguf_needs_no_reload(gguf_dir, caplog):
    """Strength 1 then 0.5 on the same loaded GGUF model: each equals ComfyUI-GGUF's own run
    at that strength, with no read of the file in between."""
    name = "wan_Q8_0_F32.gguf"
    base = load_gguf(name)
    caplog.set_level("INFO", logger="ringswap.swap_patcher")
    for strength in (1.0, 0.5):
        want = forward(lora_on(load_gguf(name), "kohya", strength), *inputs(seed=0))
        comfy.model_management.unload_all_models()
        (model,) = RingSwapPatch().patch(lora_on(base, "kohya", strength), 2, 1, "auto")
        assert same_lora(forward(model, *inputs(seed=0)), want), strength
        planned = model._plan(torch.device("cpu"), False).window.inputs
        itemsize = torch.empty(0, dtype=inference_dtype(model.model)).element_size()   # what the model computes in
        dense = sum(o * i for o, i in (linear_shape(n, 128, 256) for n in LINEARS)) * itemsize
        assert planned.block_sizes == tuple(s.layout.nbytes for s in model.swap_engine.states), "copied bytes"
        assert planned.dense_bytes == (dense,) * BLOCKS, "the dense weights a block holds while it computes"
        assert planned.nonblock_bytes > model.swap_state.nonblock_bytes, "the fold's workspace is planned"
        comfy.model_management.unload_all_models()
    assert any("GGUF dense weights: 0.00 GB a block" in r.getMessage() for r in caplog.records
               if r.name == "ringswap.swap_patcher"), "the plan line says what the dense folds take"


def test_dense_folds_plan_the_packs_dequantize_temporaries(gguf_dir):
    """Which weights are made dense on landing, and the device bytes planned for one fold's
    temporaries on CUDA (where its kernel may fall back: the pack's dequantize,
    bench/probes/dequant_peak.py): without a LoRA only the types whose dequantize waits for the stream
    (Q4_K 3.6 bytes a value, Q5_0 8.7), none for Q8_0; with plain LoRA pairs (kohya) Q8_0 2.2,
    Q4_K 3.6, Q5_0 8.7; with patches no kernel takes (LoHa), four float32. The largest weight
    is 128 x 256."""
    from ringswap.lora import dense_fold, gguf_kernels
    assert set(dense_fold.FALLBACK_BYTES) == set(gguf_kernels.ROW_BYTES), "a planned fallback for each kernel"
    from support.lora_files import build_lora
    cuda, largest = torch.device("cuda"), 128 * 256
    lora_bytes = sum(t.numel() * t.element_size() for k, t in build_lora("kohya", blocks=BLOCKS).items() if ".lora_" in k)
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
        # the LoRA pairs kept on CUDA, planned as weights: rank 4 in float32, each pair laid out for
        # the kernels in 16 ranks; none kept on the CPU, none before a fold
        pairs = 4 * lora_bytes if lora == "kohya" else 0
        assert (folder.pair_bytes(cuda), folder.pair_bytes(torch.device("cpu")), folder.kept_bytes(cuda)) \
            == (pairs, 0, 0), (qtype, lora)
    comfy.model_management.unload_all_models()


def test_weights_made_dense_on_landing_stay_packed_where_only_that_fits(gguf_dir, caplog):
    """Under a VRAM budget that holds the ring of packed blocks but not their dense weights, a
    K-quant model without a LoRA keeps its weights packed in the pack's layers (one log line
    says so) and equals the pack's run bit for bit; with room for them they are made dense on
    landing again. A type never made dense (Q8_0) has nothing to give way: NotEnoughVRAM."""
    from ringswap.swap.window_plan import NotEnoughVRAM
    cpu, name = torch.device("cpu"), "wan_Q4_K_F32.gguf"
    want = forward(load_gguf(name), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    base = load_gguf(name)

    def planned(budget_kb, model=base):
        (m,) = RingSwapPatch().patch(model, 0, 1, "auto", vram_budget_gb=budget_kb / 1e6)
        try:
            return m, m._plan(cpu, False)
        except NotEnoughVRAM:
            return m, None
    budgets = range(500, 20000, 50)
    first = next(kb for kb in budgets if planned(kb)[1] is not None)
    model, plan = planned(first)
    assert model.ringswap_run.packed_only and plan.packed_only and not any(plan.window.inputs.dense_bytes), \
        "only packed weights fit"
    dense_kb = next(kb for kb in budgets if kb > first and not planned(kb)[0].ringswap_run.packed_only)
    model, plan = planned(dense_kb)
    assert not plan.packed_only and any(plan.window.inputs.dense_bytes) and model.block_folder_on(cpu).dense_unpatched
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


def test_lora_on_quantized_non_block_weights_applies_where_comfyui_loads_them_lowvram(gguf_dir, tmp_path):
    """Where ComfyUI's budget leaves non-block layers lowvram (a small card, --novram), a LoRA on
    quantized non-block weights (a real Wan file's text and time embeddings and head) still
    applies: the pack's layers never read ComfyUI's lowvram weight functions, so the patcher
    hangs the patches on the weights, as the pack's own patcher forces. Equal to the pack's run."""
    import os

    from support.gguf_files import write_wan_gguf
    from wan_model import tiny_wan
    name = "wan_Q8_0_nonblock_q8.gguf"
    write_wan_gguf(tiny_wan(str(tmp_path), blocks=BLOCKS, dtype=torch.float32), os.path.join(gguf_dir, name),
                   "Q8_0", nonblock_linears=True)
    head = load_gguf(name).model.diffusion_model.head.head.weight
    assert type(head).__name__ == "GGMLTensor" and head.tensor_type.name == "Q8_0"
    x = inputs(seed=0)
    device = comfy.model_management.get_torch_device()

    def lowvram_forward(model):   # every layer ComfyUI loads gets a budget of one byte
        model.patch_model(device_to=device, lowvram_model_memory=1)
        try:
            with torch.no_grad():
                return model.model.apply_model(x[0], x[1], c_crossattn=x[2]).clone()
        finally:
            model.unpatch_model(model.offload_device)
    plain = forward(load_gguf(name), *x)
    comfy.model_management.unload_all_models()
    want = lowvram_forward(lora_on(load_gguf(name), "mixed"))
    assert same_lora(forward(lora_on(load_gguf(name), "mixed"), *x), want), "the pack's lowvram run has the LoRA"
    comfy.model_management.unload_all_models()
    (model,) = RingSwapPatch().patch(lora_on(load_gguf(name), "mixed"), 2, 1, "auto")
    got = lowvram_forward(model)
    assert same_lora(got, want) and not torch.equal(got, plain)
