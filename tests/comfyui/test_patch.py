"""RingSwap Patch on a native Wan MODEL, in-process in a real ComfyUI (CPU in CI)."""
import logging

import pytest
import torch

import comfy.model_management
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher
from ringswap.loaders.comfyui_adapter import comfy_models
from ringswap.nodes.patch import RingSwapPatch
from wan_model import BLOCKS, conditioning, forward, inputs, latent, load_stock, tiny_wan
from support.engine_plans import blocks_on_device


@pytest.fixture(scope="module")
def wan_path(tmp_path_factory):
    return tiny_wan(str(tmp_path_factory.mktemp("wan")))


@pytest.fixture(scope="module")
def reference(wan_path):
    """Outputs of the stock model: 3 forwards on different inputs and 2 sampling runs."""
    stock = load_stock(wan_path)
    outs = [forward(stock, *inputs(seed=s)) for s in range(3)]
    runs = [ksample(stock, seed) for seed in (11, 12)]
    comfy.model_management.unload_all_models()
    return stock, outs, runs


def ksample(model, seed, steps=3):
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 1.0, "euler", "simple",
                                          conditioning(1), conditioning(2), latent())
    return out["samples"].clone()


def patched(model, window, prefetch, pin="auto"):
    (m,) = RingSwapPatch().patch(model, window, prefetch, pin)
    return m


class OnDeviceProbe:
    """Inside every block (after the engine bound its weights) counts the blocks whose
    weights are materialised: from the engine's state and from parameter storage."""

    def __init__(self, engine):
        self.engine = engine
        self.max_engine = 0
        self.max_bound = 0
        self.calls = 0
        self.handles = [s.block.norm1.register_forward_pre_hook(self.check) for s in engine.states]

    def device_ranges(self):
        att = self.engine.att
        bufs = [s.device_buffer for s in self.engine.states if s.device_buffer is not None]
        bufs += [slot.flat for slot in (att.ring.slots if att.ring else [])]
        return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]

    def check(self, module, args):
        self.calls += 1
        ranges = self.device_ranges()
        bound = 0
        for s in self.engine.states:
            tensors = s.binding.current()
            if all(t.numel() == 0 for t in tensors):
                continue
            assert all(any(lo <= t.data_ptr() < hi for lo, hi in ranges) for t in tensors), \
                f"block {s.index} has weights outside the engine's device buffers"
            bound += 1
        self.max_bound = max(self.max_bound, bound)
        self.max_engine = max(self.max_engine, len(blocks_on_device(self.engine)))

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("window", range(1, BLOCKS + 1))
def test_bit_exact_every_window_and_prefetch(reference, window):
    stock, ref_outs, ref_runs = reference
    for prefetch in range(0, 3):
        model = patched(stock, window, prefetch)
        engine = model.swap_engine
        probe = OnDeviceProbe(engine)
        try:
            outs = [forward(model, *inputs(seed=s)) for s in range(3)]
            runs = [ksample(model, seed) for seed in (11, 12)]
        finally:
            probe.remove()
        for k, (a, b) in enumerate(zip(outs, ref_outs)):
            assert torch.equal(a, b), f"forward {k} differs at window={window} prefetch={prefetch}"
        for k, (a, b) in enumerate(zip(runs, ref_runs)):
            assert torch.equal(a, b), f"sampling run {k} differs at window={window} prefetch={prefetch}"
        assert probe.calls >= 5 * BLOCKS
        assert probe.max_engine <= window + prefetch
        assert probe.max_bound <= window + prefetch
        plan = engine.plan
        if window + prefetch < BLOCKS:
            assert len(plan.streamed) == BLOCKS - window + 1
            assert probe.max_bound <= len(plan.resident) + 1
        comfy.model_management.unload_all_models()
        assert not engine.attached, "unloading must detach the engine"


def test_stock_model_unchanged_after_swapping(reference):
    """After a RingSwap run and unload, the shared stock model still gives its outputs."""
    stock, ref_outs, _ = reference
    forward(patched(stock, 2, 1), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    assert torch.equal(forward(stock, *inputs(seed=0)), ref_outs[0])


def test_switching_between_stock_and_swapped_without_unloading(reference):
    """ComfyUI evicts one patcher of a model when another loads; each must stay exact."""
    stock, ref_outs, _ = reference
    a, b = patched(stock, 2, 1), patched(stock, 3, 0)
    for model in (stock, a, stock, b, a, b, stock):
        assert torch.equal(forward(model, *inputs(seed=1)), ref_outs[1])
    if a.model is stock.model:   # a dynamic-VRAM stock MODEL is not shared (RingSwap Patch re-bases it)
        assert not a.swap_engine.attached, "loading the stock patcher must give the blocks back"


def test_other_samplers(reference):
    stock, _, ref_runs = reference
    model = patched(stock, 2, 1)
    (adv,) = comfy_nodes.KSamplerAdvanced().sample(
        model, "enable", 11, 3, 1.0, "euler", "simple", conditioning(1), conditioning(2), latent(),
        0, 10000, "disable")
    assert torch.equal(adv["samples"], ref_runs[0])

    from comfy_extras.nodes_custom_sampler import (BasicScheduler, CFGGuider, KSamplerSelect,
                                                   RandomNoise, SamplerCustomAdvanced)

    def unwrap(result):
        return getattr(result, "result", result)

    (noise,) = unwrap(RandomNoise.execute(11))
    (guider,) = unwrap(CFGGuider.execute(model, conditioning(1), conditioning(2), 1.0))
    (sampler,) = unwrap(KSamplerSelect.execute("euler"))
    (sigmas,) = unwrap(BasicScheduler.execute(model, "simple", 3, 1.0))
    out, _ = unwrap(SamplerCustomAdvanced.execute(noise, guider, sampler, sigmas, latent()))
    assert torch.equal(out["samples"], ref_runs[0])


def test_run_summary_line(reference, caplog):
    stock, _, _ = reference
    model = patched(stock, 2, 1)
    with caplog.at_level(logging.INFO, logger="ringswap"):
        ksample(model, 11)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap run:")]
    assert len(lines) == 1, lines
    line = lines[0]
    streamed = BLOCKS - 1
    assert f"{BLOCKS} blocks (1 resident, {streamed} streamed, ring 2)" in line
    assert "window 2, prefetch 1" in line
    assert "GB/s" in line and "hidden under compute" in line and "compute waited" in line
    loads = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap plan:")]
    assert len(loads) == 1


def test_window_above_block_count_is_clamped_with_warning(reference, caplog):
    stock, ref_outs, _ = reference
    with caplog.at_level(logging.WARNING, logger="ringswap"):
        model = patched(stock, BLOCKS + 7, 1)
    assert any(f"window={BLOCKS + 7} is more than the model's {BLOCKS} blocks" in r.getMessage()
               for r in caplog.records)
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    assert model.swap_engine.plan.streamed == ()


def test_window_zero_is_automatic(reference):
    """window=0 takes the window from ComfyUI's memory budget; on CPU all blocks fit."""
    stock, ref_outs, _ = reference
    model = patched(stock, 0, 1)
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    assert len(model.swap_engine.plan.resident) == BLOCKS


def test_model_without_block_list_is_refused():
    import comfy.model_patcher

    class NotADiT(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Sequential(torch.nn.Linear(4, 4))

    plain = comfy.model_patcher.ModelPatcher(NotADiT(), torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ValueError, match="Sequential has no transformer block list"):
        patched(plain, 2, 1)


def test_bad_widget_values_are_refused(reference):
    stock, _, _ = reference
    with pytest.raises(ValueError, match="pin_memory must be one of"):
        patched(stock, 2, 1, "sometimes")
    with pytest.raises(ValueError, match="prefetch must be 0 or more"):
        patched(stock, 2, -1)


def test_patcher_class_and_clone(reference):
    stock, _, _ = reference
    model = patched(stock, 2, 1)
    assert isinstance(model, SwapModelPatcher)
    assert type(stock) is not SwapModelPatcher
    c = model.clone()
    assert isinstance(c, SwapModelPatcher) and c.ringswap == model.ringswap
    assert c.swap_engine is model.swap_engine


class OtherQuant(torch.Tensor):
    """Another pack's quantized weight class, unknown to RingSwap."""


def test_a_tensor_class_ringswap_cannot_move_is_refused_by_name(tmp_path):
    """A MODEL whose block weight is of a tensor class RingSwap has no codec for: RingSwap Patch
    refuses it naming the weight and the class, installs nothing, and the model still samples."""
    stock = load_stock(tiny_wan(str(tmp_path), blocks=BLOCKS))
    want = forward(stock, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    if comfy_models.built_for_dynamic_vram(stock):
        pytest.skip("this MODEL was built for dynamic VRAM: the Patch loads the file itself and never moves "
                    "the MODEL's own block tensors")
    lin = stock.model.diffusion_model.blocks[1].ffn[0]
    lin.weight = torch.nn.Parameter(lin.weight.data.as_subclass(OtherQuant), requires_grad=False)
    with pytest.raises(ValueError, match=r"cannot block-swap 'blocks\.1\.ffn\.0\.weight'.*OtherQuant"):
        RingSwapPatch().patch(stock, 2, 1, "auto")
    assert getattr(stock.model.diffusion_model, "ringswap_state", None) is None
    lin.weight = torch.nn.Parameter(lin.weight.data.as_subclass(torch.Tensor), requires_grad=False)
    assert torch.equal(forward(stock, *inputs(seed=0)), want)


def test_compress_on_without_cuda_or_nvcomp_is_a_clear_error_and_auto_is_off(reference, caplog):
    """compress=on where it cannot code (no CUDA, no nvCOMP, or a stock MODEL whose blocks its loader
    shares) names why at load and leaves the model unloaded; auto there is off (exact, no coded
    homes) with one log line; a bad value is refused. (The choice's rules: tests/engine/test_coding_choice.py.)"""
    from ringswap.loaders.comfyui_adapter import swap_patcher
    from ringswap.nodes.model_loader import RingSwapModelLoader
    from ringswap.swap.plane_coder import coder_missing
    for node in (RingSwapPatch, RingSwapModelLoader):   # optional: workflows saved before it still validate
        kind, opts = node.INPUT_TYPES()["optional"]["compress"]
        assert kind == ["auto", "on", "off"] and opts["default"] == "auto" and "nvidia-nvcomp" in opts["tooltip"]
    stock, ref_outs, _ = reference
    with pytest.raises(ValueError, match="compress must be one of"):
        RingSwapPatch().patch(stock, 2, 1, "auto", compress="sometimes")
    (model,) = RingSwapPatch().patch(stock, 2, 1, "auto", compress="on")
    if torch.cuda.is_available() and coder_missing() is None and model.swap_engine.facts().own_load:
        pytest.skip("this MODEL was built for dynamic VRAM on CUDA: the Patch re-bases it onto RingSwap's own "
                    "load of the file, which can code (test_compress_gpu.py tests that)")
    want = ("no CUDA device" if not torch.cuda.is_available() else "nvidia-nvcomp-cu13"
            if coder_missing() else "shared with the node that loaded it")
    with pytest.raises(RuntimeError, match=want):   # a stock MODEL's blocks are never coded
        forward(model, *inputs(seed=0))
    assert not model.swap_engine.attached and not model.swap_engine.pool.coded
    swap_patcher._said.clear()
    (model,) = RingSwapPatch().patch(stock, 2, 1, "auto", compress="auto")
    with caplog.at_level(logging.INFO, logger="ringswap"):
        assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
        assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    assert caplog.text.count("RingSwap compress auto: off") == 1
    assert not model.swap_engine.pool.coded
    # nor are resident blocks kept coded at an unload there (nor anywhere with compress=off)
    coding = model.ringswap_run.plan.coding
    assert not coding.code and not coding.may_code and coding.note.startswith("RingSwap compress auto: off")
    (off,) = RingSwapPatch().patch(stock, 2, 1, "auto", compress="off")
    assert torch.equal(forward(off, *inputs(seed=0)), ref_outs[0])
    assert not off.ringswap_run.plan.coding.may_code and not off.ringswap_run.plan.coding.note
