"""Living inside ComfyUI: Wan 2.2's two experts, node caching, many runs, torch.compile."""
import gc
import os

import psutil
import pytest
import torch

import comfy.model_management
import folder_paths
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ringswap.nodes.model_loader import RingSwapModelLoader
from ringswap.nodes.patch import RingSwapPatch
from wan_model import conditioning, forward, inputs, latent, load_stock, tiny_wan
from support.engine_plans import blocks_on_device


@pytest.fixture(scope="module")
def experts(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("experts"))
    return tiny_wan(d, blocks=4, seed=1), tiny_wan(d, blocks=4, seed=2)


def two_expert_sample(high, low, steps=4, switch=2):
    """Wan 2.2 style: the high-noise expert for the first steps, the low-noise one after."""
    adv = comfy_nodes.KSamplerAdvanced()
    (mid,) = adv.sample(high, "enable", 5, steps, 1.0, "euler", "simple", conditioning(1), conditioning(2),
                        latent(), 0, switch, "enable")
    (out,) = adv.sample(low, "disable", 5, steps, 1.0, "euler", "simple", conditioning(1), conditioning(2),
                        mid, switch, 10000, "disable")
    return out["samples"]


def test_wan22_two_experts_one_ring_at_a_time(experts, caplog):
    ref = two_expert_sample(load_stock(experts[0]), load_stock(experts[1]))
    comfy.model_management.unload_all_models()
    for home in ("ram", "disk", "auto"):
        high = load_swapped_model(experts[0], SwapSettings(2, 1), home=home, disk_workers=2)
        low = load_swapped_model(experts[1], SwapSettings(2, 1), home=home, disk_workers=2)
        seen = []
        for model in (high, low):
            for s in model.swap_engine.states:
                s.block.register_forward_pre_hook(
                    lambda m, a: seen.append(high.swap_engine.attached + low.swap_engine.attached))
        with caplog.at_level("INFO", logger="ringswap"):
            for _ in range(2):
                assert torch.equal(two_expert_sample(high, low), ref), home
        assert max(seen) == 1, "both experts' rings were on the device at once"
        if home != "ram":   # the expert that is not sampling holds no pinned memory (ram keeps its home)
            assert not high.swap_engine.attached and high.swap_engine.pool.pinned_bytes == 0
            assert not blocks_on_device(high.swap_engine)
        if home == "auto":   # plenty of RAM: the inactive expert keeps a home for every block, its
            engine = high.swap_engine   # streamed ones in the file's own pages where the file holds their
            mapped = set(engine.pool.mapped)   # bytes as they are (nothing read), the others captured
            assert all(i in engine.pool.blocks or i in mapped or engine.map_block(i) is not None
                       for i in range(engine.num_blocks)), "a block that cannot be mapped was not kept in RAM"
            assert torch.equal(two_expert_sample(high, low), ref)
            if not mapped:   # so switching back to it reads nothing from the file
                assert high.swap_engine.read_back[0] == 0 and low.swap_engine.read_back[0] == 0
        switches = [r for r in caplog.records if "switched from another block-swapped model" in r.getMessage()]
        assert len(switches) >= 3
        comfy.model_management.unload_all_models()
        caplog.clear()


def test_disk_home_two_experts_hold_one_staging_set(experts):
    high = load_swapped_model(experts[0], SwapSettings(1, 1), home="disk", disk_workers=2)
    low = load_swapped_model(experts[1], SwapSettings(1, 1), home="disk", disk_workers=2)
    two_expert_sample(high, low)
    attached = [m for m in (high, low) if m.swap_engine.attached]
    assert len(attached) == 1 and attached[0] is low
    assert high.swap_engine.pool.nbytes == low.swap_engine.pool.nbytes == 0   # no RAM home


def test_loader_node_reuses_the_file_when_only_settings_change(experts, tmp_path):
    d = tmp_path / "diffusion_models"
    d.mkdir()
    os.link(experts[0], d / "expert.safetensors")
    folder_paths.add_model_folder_path("diffusion_models", str(d))
    node = RingSwapModelLoader()
    (a,) = node.load("expert.safetensors", 2, 1, "ram", "auto", 2)
    reader = a.swap_engine.read_block.__self__.reader
    read_once = reader.bytes_read
    assert read_once > 0
    (b,) = node.load("expert.safetensors", 3, 0, "ram", "off", 2)
    assert b.model is a.model and reader.bytes_read == read_once, "the file was read again"
    assert b.ringswap == SwapSettings(3, 0, "off")
    assert torch.equal(forward(b, *inputs(seed=0)), forward(a, *inputs(seed=0)))
    assert reader.bytes_read == read_once


def test_no_growth_over_many_runs(experts):
    proc = psutil.Process()
    model = load_swapped_model(experts[0], SwapSettings(2, 1), home="ram", disk_workers=2)
    other = RingSwapPatch().patch(load_stock(experts[1]), 2, 1, "auto")[0]
    rss, pinned = [], []
    for run in range(20):
        comfy_nodes.KSampler().sample(model if run % 2 == 0 else other, run, 2, 1.0, "euler", "simple",
                                      conditioning(1), conditioning(2), latent())
        gc.collect()
        rss.append(proc.memory_info().rss)
        pinned.append(model.swap_engine.pool.pinned_bytes + other.swap_engine.pool.pinned_bytes)
    assert max(rss[2:]) <= 1.02 * rss[1], [r // 2**20 for r in rss]
    assert max(pinned[2:]) <= pinned[1]


@pytest.mark.parametrize("keys", [["diffusion_model"], ["diffusion_model.blocks.0", "diffusion_model.blocks.2"]])
def test_torch_compile_keeps_swapping(experts, keys, caplog):
    """ComfyUI's own compile wrapper (as its TorchCompileModel node uses), on the whole
    diffusion model or on single blocks: the hooks are opaque to dynamo, swapping goes on."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    model = load_swapped_model(experts[0], SwapSettings(2, 1), home="ram", disk_workers=2)
    compiled = model.clone()
    set_torch_compile_wrapper(model=compiled, backend="eager", keys=keys)
    torch._dynamo.reset()
    with caplog.at_level("INFO", logger="ringswap"):
        (res,) = comfy_nodes.KSampler().sample(compiled, 3, 2, 1.0, "euler", "simple", conditioning(1),
                                              conditioning(2), latent())
    runs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap run:")]
    assert len(runs) == 1 and " 0 copies" not in runs[0] and "3 streamed" in runs[0], runs
    (plain,) = comfy_nodes.KSampler().sample(model, 3, 2, 1.0, "euler", "simple", conditioning(1),
                                            conditioning(2), latent())
    assert torch.allclose(res["samples"], plain["samples"], rtol=1e-5, atol=1e-5)
    assert isinstance(compiled, SwapModelPatcher)


def test_comfyui_sees_true_memory_and_can_unload_us(experts):
    model = load_swapped_model(experts[0], SwapSettings(2, 1), home="ram", disk_workers=2)
    ref = forward(model, *inputs(seed=0))
    engine, state = model.swap_engine, model.swap_state
    used = state.nonblock_bytes + engine.device_bytes()
    assert model.loaded_size() == model.model_size() == used
    assert used < state.nonblock_bytes + engine.total_block_bytes()
    (lm,) = [lm for lm in comfy.model_management.current_loaded_models if lm.model is model]
    assert lm.model_offloaded_memory() == 0

    # something else needs just the ring's memory: the ring goes, the model stays listed
    assert lm.model_unload(memory_to_free=engine.device_bytes()) is False
    assert not engine.attached and model.loaded_size() == state.nonblock_bytes
    assert torch.equal(forward(model, *inputs(seed=0)), ref)      # restored on the next run
    assert engine.attached

    # everything is needed: ComfyUI unloads us completely
    comfy.model_management.free_memory(1e30, comfy.model_management.get_torch_device())
    assert not engine.attached and model.loaded_size() == 0
    assert torch.equal(forward(model, *inputs(seed=0)), ref)


def test_home_is_freed_with_the_model(experts):
    import weakref

    model = load_swapped_model(experts[0], SwapSettings(2, 1), home="ram", disk_workers=2)
    forward(model, *inputs(seed=0))
    home = weakref.ref(model.swap_engine.pool.blocks[0])
    reader = model.swap_engine.read_block.__self__.reader
    comfy.model_management.unload_all_models()
    del model
    gc.collect()
    assert home() is None, "the host home outlived its model"
    assert reader._closed, "the file handles outlived the model"


def _sample(model, seed=3):
    (out,) = comfy_nodes.KSampler().sample(model, seed, 2, 1.0, "euler", "simple", conditioning(1),
                                          conditioning(2), latent())
    return out["samples"]


def _plan_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap plan:")]


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_blocks_stay_on_the_device_between_runs(experts, home, caplog):
    """ComfyUI re-attaches a loaded model to itself at every sampling run: the resident
    blocks and the ring stay (nothing copied again), one plan line per run, same result."""
    ref = _sample(load_stock(experts[0]))
    comfy.model_management.unload_all_models()
    model = load_swapped_model(experts[0], SwapSettings(2, 1), home=home, disk_workers=2)
    engine = model.swap_engine
    with caplog.at_level("INFO", logger="ringswap"):
        assert torch.equal(_sample(model), ref)
        att = engine.att
        resident = [engine.states[i].device_buffer for i in att.plan.resident]
        assert resident and all(b is not None for b in resident)
        for _ in range(2):
            assert torch.equal(_sample(model), ref)
            assert engine.att is att, "the blocks were taken back between runs"
            assert [engine.states[i].device_buffer for i in att.plan.resident] == resident
    plans = _plan_lines(caplog)
    assert len(plans) == 3 and all("kept on the device from the last run" in p for p in plans[1:]), plans
    assert model.loaded_size() == model.model_size() == model.swap_state.nonblock_bytes + engine.device_bytes()


def test_blocks_go_back_when_something_else_needs_them(experts, caplog):
    """The same plan is kept whatever ComfyUI offers; a changed plan, ComfyUI freeing memory,
    another patcher of the same model and the plain stock MODEL each take the blocks back,
    and the next run attaches afresh."""
    stock = load_stock(experts[0])
    ref = _sample(stock)
    comfy.model_management.unload_all_models()
    model = RingSwapPatch().patch(stock, 2, 1, "auto")[0]
    engine = model.swap_engine
    assert torch.equal(_sample(model), ref)

    att = engine.att
    model.partially_load(model.load_device, 2**40)            # room to spare: same plan, kept
    assert engine.att is att
    model.partially_load(model.load_device, -1)               # ComfyUI counts the kept blocks as used
    assert engine.att is att
    # a changed plan while ComfyUI, counting the kept blocks, offers less than nothing: the
    # blocks go back and the new plan is attached with what they freed (never left unattached)
    model.ringswap = SwapSettings(3, 1)
    model.partially_load(model.load_device, -(engine.device_bytes() // 2))
    assert engine.att is not att and engine.attached and engine.plan.window == 3
    model.partially_unload(model.offload_device, 1)           # ComfyUI frees memory: taken back
    assert not engine.attached
    assert torch.equal(_sample(model), ref) and engine.attached

    sibling = model.clone()
    assert torch.equal(_sample(sibling), ref)
    assert engine.owner is sibling, "a sibling patcher ran on the other's attachment"
    assert torch.equal(_sample(model), ref) and engine.owner is model

    if model.model is stock.model:   # ComfyUI 0.3.75 / static: the Patch shares the stock model
        assert torch.equal(_sample(stock), ref)
        assert not engine.attached, "the stock patcher ran with RingSwap's hooks on"
        assert torch.equal(_sample(model), ref) and engine.attached

    comfy.model_management.free_memory(1e30, comfy.model_management.get_torch_device())
    assert not engine.attached
    with caplog.at_level("INFO", logger="ringswap"):
        assert torch.equal(_sample(model), ref)
    assert engine.attached and len(_plan_lines(caplog)) == 1


def test_compiled_model_is_exact_and_a_lora_strength_change_does_not_recompile(experts):
    """ComfyUI's compile wrapper (TorchCompileModel) with a backend that runs the captured
    graphs as they are: the compiled RingSwap run equals the uncompiled one at cfg 5, and
    changing the strength of a stock LoRA (load_lora_for_models) compiles nothing new: the
    fold happens on the weights as they land, outside the compiled graphs."""
    import comfy.sd
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    from support.lora_files import build_lora

    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    def sample(m):
        (out,) = comfy_nodes.KSampler().sample(m, 3, 2, 5.0, "euler", "simple", conditioning(1), conditioning(2),
                                              latent())
        return out["samples"].clone()

    lora = build_lora("kohya", blocks=4)
    base = load_swapped_model(experts[0], SwapSettings(2, 1), home="ram", disk_workers=2)
    plain = {s: sample(comfy.sd.load_lora_for_models(base, None, lora, s, 0)[0]) for s in (0.5, 1.0)}
    assert not torch.equal(plain[0.5], plain[1.0])
    compiled = base.clone()
    set_torch_compile_wrapper(model=compiled, backend=counting_backend, keys=["diffusion_model"])
    torch._dynamo.reset()
    seen = None
    for s in (0.5, 1.0, 0.5):
        m, _ = comfy.sd.load_lora_for_models(compiled, None, lora, s, 0)
        assert isinstance(m, SwapModelPatcher)
        assert torch.equal(sample(m), plain[s]), f"compiled run at strength {s} differs"
        seen = len(compiles) if seen is None else seen
        assert len(compiles) == seen, f"strength {s} compiled again: {len(compiles)} compiles, {seen} before"
    assert seen > 0


@torch.no_grad()
def test_a_load_offering_less_than_the_model_holds_still_attaches_the_blocks(tmp_path):
    """Free VRAM below ComfyUI's minimum on a later run: load_models_gpu offers a negative budget,
    ComfyUI's partially_load only unloads and returns without `load`. The blocks still attach
    (ComfyUI counts the model loaded): the run equals ComfyUI's own, its LoRA included."""
    import comfy.sd
    from support.lora_files import build_lora

    def with_lora(model):
        return comfy.sd.load_lora_for_models(model, None, build_lora("mixed", blocks=4), 1.0, 0)[0]

    def tight_second_run(model):
        loaded = comfy.model_management.LoadedModel(model)
        loaded.model_load(0)
        first = model.model.apply_model(*(x := inputs(seed=0))[:2], c_crossattn=x[2]).clone()
        assert loaded.model_unload(memory_to_free=1) is False   # free_memory: a partial unload
        loaded.model_load(-10**9)                                # the budget less what it holds
        return first, model.model.apply_model(x[0], x[1], c_crossattn=x[2]).clone()
    path = tiny_wan(str(tmp_path), blocks=4)
    want = tight_second_run(with_lora(load_stock(path)))
    comfy.model_management.unload_all_models()
    (model,) = RingSwapPatch().patch(with_lora(load_stock(path)), 2, 1, "auto")
    got = tight_second_run(model)
    assert model.swap_engine.attached and model.swap_engine.owner is model
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    comfy.model_management.unload_all_models()
