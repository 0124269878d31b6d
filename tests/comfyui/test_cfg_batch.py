"""cfg > 1 on a swapped model: cond and uncond in one model call per step when the plan
batches, one call each when it does not, bit-identical to ComfyUI's own run that batches
the same way (real ComfyUI, in-process; CPU in CI, CUDA on the GPU machine)."""
import logging

import pytest
import torch

import comfy.model_management
import comfy.patcher_extension
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter import run_facts
from ringswap.nodes.patch import RingSwapPatch
from wan_model import BLOCKS, conditioning, latent, load_stock, tiny_wan

CFG, STEPS = 5.0, 3


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return load_stock(tiny_wan(str(tmp_path_factory.mktemp("wan"))))


class CallCounter:
    """Counts forwards of a MODEL's diffusion model and the batch each one ran."""

    def __init__(self, model):
        self.batches = []
        self.handle = model.model.diffusion_model.register_forward_pre_hook(
            lambda m, args: self.batches.append(int(args[0].shape[0])))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def one_cond_per_call(model):
    """A clone of `model` whose calc_cond_batch computes each cond in its own model call
    (ComfyUI's own path for conds it does not batch), through ComfyUI's wrapper mechanism."""
    clone = model.clone()

    def each_alone(executor, model_, conds, x_in, timestep, model_options):
        outs = []
        for i in range(len(conds)):
            alone = [c if j == i else None for j, c in enumerate(conds)]
            outs.append(executor(model_, alone, x_in, timestep, model_options)[i])
        return outs
    clone.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.CALC_COND_BATCH, "test_alone", each_alone)
    return clone


def ksample(model, seed=11, cfg=CFG):
    (out,) = comfy_nodes.KSampler().sample(model, seed, STEPS, cfg, "euler", "simple",
                                          conditioning(1), conditioning(2), latent())
    return out["samples"].clone()


def ksample_advanced(model, seed=11):
    (out,) = comfy_nodes.KSamplerAdvanced().sample(
        model, "enable", seed, STEPS, CFG, "euler", "simple", conditioning(1), conditioning(2), latent(),
        0, 10000, "disable")
    return out["samples"].clone()


def custom_advanced(model, seed=11):
    from comfy_extras.nodes_custom_sampler import (BasicScheduler, CFGGuider, KSamplerSelect,
                                                   RandomNoise, SamplerCustomAdvanced)

    def unwrap(result):
        return getattr(result, "result", result)
    (noise,) = unwrap(RandomNoise.execute(seed))
    (guider,) = unwrap(CFGGuider.execute(model, conditioning(1), conditioning(2), CFG))
    (sampler,) = unwrap(KSamplerSelect.execute("euler"))
    (sigmas,) = unwrap(BasicScheduler.execute(model, "simple", STEPS, 1.0))
    out, _ = unwrap(SamplerCustomAdvanced.execute(noise, guider, sampler, sigmas, latent()))
    return out["samples"].clone()


SAMPLERS = {"KSampler": ksample, "KSamplerAdvanced": ksample_advanced, "SamplerCustomAdvanced": custom_advanced}


def patched(model, window=1, prefetch=1, budget=0.0):
    (m,) = RingSwapPatch().patch(model, window, prefetch, "auto", vram_budget_gb=budget)
    return m


def log_lines(caplog, prefix):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_cfg_batched_one_call_per_step_and_exact(stock, sampler, caplog):
    run = SAMPLERS[sampler]
    with CallCounter(stock) as ref_calls:
        ref = run(stock)
    assert ref_calls.batches == [2] * STEPS, "ComfyUI batches cond + uncond on this machine"
    comfy.model_management.unload_all_models()
    for prefetch in (0, 1, 2):
        model = patched(stock, window=1, prefetch=prefetch)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ringswap"), CallCounter(model) as calls:
            out = run(model)
        assert torch.equal(out, ref), f"{sampler} at window 1, prefetch {prefetch} differs from the stock run"
        assert calls.batches == [2] * STEPS, calls.batches
        plan = log_lines(caplog, "RingSwap plan:")
        assert len(plan) == 1 and "2 conds a step batched in 1 model call" in plan[0], plan
        steps = log_lines(caplog, "RingSwap steps:")
        assert len(steps) == 1 and "1.00 model calls a step (planned 1)" in steps[0], steps
        assert f"; {STEPS} model calls" in log_lines(caplog, "RingSwap run:")[0]
        comfy.model_management.unload_all_models()


def test_cfg_1_runs_one_cond_and_plans_for_it(stock, caplog):
    with CallCounter(stock) as ref_calls:
        ref = ksample(stock, cfg=1.0)
    comfy.model_management.unload_all_models()
    model = patched(stock, window=2)
    with caplog.at_level(logging.INFO, logger="ringswap"), CallCounter(model) as calls:
        out = ksample(model, cfg=1.0)
    assert torch.equal(out, ref)
    assert calls.batches == ref_calls.batches == [1] * STEPS
    assert "; 1 model call a step" in log_lines(caplog, "RingSwap plan:")[0]
    assert run_facts.request_of(model).conds_per_step == 1


def test_two_calls_when_only_one_cond_fits(stock, caplog):
    """A budget that holds the window beside one cond's activations but not beside the
    batched call's: the plan runs cond and uncond one call each, counted and exact."""
    probe = patched(stock, window=1)
    ksample(probe)
    request = run_facts.request_of(probe)
    assert request.batched_estimate > request.estimate > 0
    comfy.model_management.unload_all_models()
    state = probe.swap_state
    ring = 2 * max(s.layout.nbytes for s in state.engine.states)   # window 1, prefetch 1: 2 slots
    gap = request.estimate_for(2) - request.estimate
    budget = (state.nonblock_bytes + request.estimate + ring + gap // 2) / 1e9

    with CallCounter(one_cond_per_call(stock)) as ref_calls:
        ref = ksample(one_cond_per_call(stock))
    assert ref_calls.batches == [1] * (2 * STEPS)
    comfy.model_management.unload_all_models()

    model = patched(stock, window=1, budget=budget)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ringswap"), CallCounter(model) as calls:
        out = ksample(model)
    plan = log_lines(caplog, "RingSwap plan:")
    assert len(plan) == 1 and "2 conds a step in 2 model calls (batched is" in plan[0], plan
    assert calls.batches == [1] * (2 * STEPS), calls.batches
    assert "2.00 model calls a step (planned 2)" in log_lines(caplog, "RingSwap steps:")[0]
    assert torch.equal(out, ref), "the two-call run differs from ComfyUI's own one-call-per-cond run"


def test_batching_follows_the_plan_not_the_free_memory(stock):
    """ComfyUI's batching question (get_free_memory) is answered by the plan: above its
    batching line when the plan batches, at most at it when it does not."""
    model = patched(stock, window=1)
    ksample(model)
    request = run_facts.request_of(model)
    line = int(1.5 * request.estimate_for(2))
    comfy.model_management.load_models_gpu([model])
    device = model.load_device
    plan = model._plan(device, False)
    assert plan.window.batched
    model.ringswap_run.plan = plan
    assert model.get_free_memory(device) > line
    import dataclasses
    window = plan.window
    split = dataclasses.replace(plan, window=dataclasses.replace(
        window, inputs=dataclasses.replace(window.inputs, conds_per_call=1)))
    model.ringswap_run.plan = split
    assert model.get_free_memory(device) <= line
    assert BLOCKS == model.swap_engine.num_blocks


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [1, 2])
def test_cfg_batched_is_exact_on_cuda(stock, prefetch, caplog):
    """On CUDA (where ComfyUI's batching looks at free VRAM): window 1, cfg 5, one batched
    call a step, bit-identical to the stock run."""
    assert stock.load_device.type == "cuda"
    with CallCounter(stock) as ref_calls:
        ref = ksample(stock)
    assert ref_calls.batches == [2] * STEPS
    comfy.model_management.unload_all_models()
    model = patched(stock, window=1, prefetch=prefetch)
    with caplog.at_level(logging.INFO, logger="ringswap"), CallCounter(model) as calls:
        out = ksample(model)
    assert calls.batches == [2] * STEPS
    assert torch.equal(out, ref)
    assert "1.00 model calls a step (planned 1)" in log_lines(caplog, "RingSwap steps:")[0]


def test_measured_activations_drop_the_inference_minimums_margin(stock):
    """ComfyUI's estimate: its whole inference minimum stays free beside it; a measured peak
    (per call shape: latent and conds a call) keeps only ComfyUI's reserve for others."""
    model = patched(stock, window=1)
    ksample(model)
    request = run_facts.request_of(model)
    device = model.load_device
    mm = comfy.model_management
    model.swap_state.measured.clear()   # on CUDA the run above measured its peak already
    first = run_facts.call_facts(model, request, 2, folded=False)
    assert (first.activation_source, first.reserve_bytes) == ("ComfyUI's estimate", int(mm.minimum_inference_memory()))
    model.swap_state.measured[(request.noise_shape, 2)] = run_facts.Measured(activation_peak=12345)
    later = run_facts.call_facts(model, request, 2, folded=False)
    assert (later.activation_bytes, later.reserve_bytes) == (12345, int(mm.extra_reserved_memory()))
    assert run_facts.call_facts(model, request, 1, folded=False).activation_source == "ComfyUI's estimate"
    # the facts a load plans with: the batched call's and the single call's
    facts = run_facts.gather(model, device)
    assert (facts.batched.activation_bytes, facts.single.activation_source) == (12345, "ComfyUI's estimate")


def test_wan22_two_experts_at_cfg_5(tmp_path):
    """Wan 2.2's graph: two MODELs, two KSamplerAdvanced; each expert runs cond and uncond
    in one call a step, and the latents equal the stock two-expert run."""
    paths = [tiny_wan(str(tmp_path), blocks=4, seed=s) for s in (1, 2)]

    def two_experts(high, low):
        adv = comfy_nodes.KSamplerAdvanced()
        (mid,) = adv.sample(high, "enable", 5, 4, CFG, "euler", "simple", conditioning(1), conditioning(2),
                            latent(), 0, 2, "enable")
        (out,) = adv.sample(low, "disable", 5, 4, CFG, "euler", "simple", conditioning(1), conditioning(2),
                            mid, 2, 10000, "disable")
        return out["samples"].clone()

    stock = [load_stock(p) for p in paths]
    ref = two_experts(*stock)
    comfy.model_management.unload_all_models()
    high, low = (patched(m, window=1) for m in stock)
    with CallCounter(high) as a, CallCounter(low) as b:
        out = two_experts(high, low)
    assert torch.equal(out, ref)
    assert a.batches == [2, 2] and b.batches == [2, 2], (a.batches, b.batches)
