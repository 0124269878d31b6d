"""Each run's plan and out-of-memory recovery, in-process in a real ComfyUI (CPU in CI).

The plan line comes once per sampling run, before the first step; vram_budget_gb sizes
an automatic window; a budget that holds no block is refused with its numbers; an
allocation failure injected at a chosen block of a chosen model call (swap.recovery's
test hook) is retried at a smaller window, bit-exact with a clean run at that window,
and a second failure fails the run with nothing left attached.
"""
import logging

import pytest
import torch

import comfy.model_management
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter import run_facts, sampling
from ringswap.nodes.patch import RingSwapPatch
from ringswap.swap import ResidencyPlan
from ringswap.swap.load_plan import place_seconds
from ringswap.swap.window_plan import NotEnoughVRAM
from support.faults import inject_oom
from wan_model import conditioning, latent, load_stock, tiny_wan
from support.engine_plans import blocks_on_device

BLOCKS = 8
GB = 1e9


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return load_stock(tiny_wan(str(tmp_path_factory.mktemp("wan")), blocks=BLOCKS))


@pytest.fixture(scope="module")
def reference(stock):
    out = ksample(stock)
    comfy.model_management.unload_all_models()
    return out


def ksample(model, seed=5, steps=3):
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 1.0, "euler", "simple",
                                          conditioning(1), conditioning(2), latent())
    return out["samples"].clone()


def patched(model, window, prefetch=1, budget=0.0):
    (m,) = RingSwapPatch().patch(model, window, prefetch, "auto", budget)
    return m


def messages(caplog, start):
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(start)]


def test_one_plan_line_per_run_before_its_steps(stock, reference, caplog):
    model = patched(stock, 2)
    with caplog.at_level(logging.INFO, logger="ringswap"):
        for _ in range(2):
            assert torch.equal(ksample(model), reference)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("RingSwap plan:", "RingSwap run:"))]
    assert [ln.split(":")[0] for ln in lines] == ["RingSwap plan", "RingSwap run"] * 2, lines
    plan = lines[0]
    assert f"window 2 of {BLOCKS} (set; 1 resident + ring 2)" in plan
    assert "activations ~" in plan and "at 32 tokens (ComfyUI's estimate)" in plan   # 2x8x8 latent, patch 1x2x2
    assert "streams" in plan and "per model call" in plan
    assert "3 model calls" in lines[1]
    # the sampler's steps reach the run's summary through the one APPLY_MODEL wrapper
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap steps:")]
    assert len(steps) == 2 and all(s.startswith("RingSwap steps: 3 in ") for s in steps), steps


def test_a_clone_starts_a_fresh_run_state(stock):
    """A clone (ComfyUI's or RingSwap Patch's) keeps nothing of its source's run: no plan,
    request or reloading mark; the source keeps its own."""
    model = patched(stock, 2)
    ksample(model)
    run = model.ringswap_run
    assert run.plan is not None and run.request is not None
    for fresh in (model.clone(), patched(model, 2)):
        assert fresh.ringswap_run is not run
        assert (fresh.ringswap_run.plan, fresh.ringswap_run.request, fresh.ringswap_run.reloading) == \
            (None, None, False)
    assert model.ringswap_run is run and run.plan is not None
    comfy.model_management.unload_all_models()


def test_budget_sizes_the_automatic_window(stock, reference):
    probe = patched(stock, 0)
    ksample(probe)
    inp = probe.ringswap_run.plan.window.inputs
    assert probe.swap_engine.plan.streamed == ()          # CPU without a budget: all resident
    block = max(inp.block_sizes)
    for on_device in (2, 3, 5):                            # window + prefetch blocks of room
        budget = (inp.nonblock_bytes + inp.activation_bytes + on_device * block + block // 2) / GB
        model = patched(stock, 0, 1, budget)
        assert torch.equal(ksample(model), reference)
        plan = model.ringswap_run.plan.window
        assert (plan.window, plan.automatic) == (on_device - 1, True), plan.line()
        assert model.swap_engine.plan.window == on_device - 1
        comfy.model_management.unload_all_models()


def test_automatic_window_that_ran_this_size_stays_placed(stock, reference, caplog):
    """An automatic window that ran this latent size stays placed for the next run at it:
    when a larger window would fit but the copies hide already (placing the blocks again
    costs seconds), and when by the numbers it is past the room but ran with no more memory
    than there is now. A copy-bound window, or less memory than when it ran, is placed again."""
    probe = patched(stock, 0)
    ksample(probe)
    inp = probe.ringswap_run.plan.window.inputs
    comfy.model_management.unload_all_models()
    block = max(inp.block_sizes)
    activation = inp.activation_bytes + 2 * block
    model = patched(stock, 0, 1, (inp.nonblock_bytes + activation + 3 * block + block // 2) / GB)
    shape = probe.ringswap_run.request.noise_shape
    model.swap_state.measured.clear()
    model.swap_state.measured[(shape, 1)] = run_facts.Measured(activation_peak=activation)
    assert torch.equal(ksample(model), reference)
    engine = model.swap_engine
    att = engine.att   # the attachment: the same object while the blocks stay placed
    assert engine.plan.window == 2
    measured = model.swap_state.measured[(shape, 1)]
    assert measured.ran == engine.plan and measured.free_after > 0           # window 2 ran this size
    measured.activation_peak, measured.compute_s = activation - block, 1.0   # room for window 3 now
    measured.free_after = run_facts.free_for(model, engine.device) - GB          # (free RAM moves on a CPU)
    engine.link_bytes_per_s = 1e12                                           # the copies hide
    with caplog.at_level(logging.INFO, logger="ringswap"):
        assert torch.equal(ksample(model), reference)
    assert engine.att is att and engine.plan.window == 2
    (plan,) = messages(caplog, "RingSwap plan:")
    assert plan.startswith("RingSwap plan: window 2 of 8 (auto;") and \
        plan.endswith("kept on the device from the last run (window 3 would fit; the copies hide already)"), plan
    engine.link_bytes_per_s, measured.compute_s = 1.0, 1.0                   # copy-bound: place window 3
    measured.free_after = run_facts.free_for(model, engine.device) - GB
    assert torch.equal(ksample(model), reference)
    assert engine.att is not att and engine.plan.window == 3
    assert measured.ran == engine.plan and measured.free_after > 0           # window 3 ran this size

    # by the numbers window 3 is now past the room (the first run's start-up allocations came
    # out of the free memory), but it ran this size with no more memory than there is now: kept
    att = engine.att
    measured.activation_peak = activation
    measured.free_after = run_facts.free_for(model, engine.device) - GB
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ringswap"):
        assert torch.equal(ksample(model), reference)
    assert engine.att is att and engine.plan.window == 3
    (plan,) = messages(caplog, "RingSwap plan:")
    assert plan.endswith("kept on the device from the last run (it ran this size last time with no more "
                         "memory than now; the planner's numbers give window 2)"), plan
    measured.free_after = run_facts.free_for(model, engine.device) + 10 * GB   # less memory now: place again
    assert torch.equal(ksample(model), reference)
    assert engine.att is not att and engine.plan.window == 2
    comfy.model_management.unload_all_models()


def test_budget_that_holds_no_block_is_refused(stock):
    model = patched(stock, 0, 1, 0.0001)
    with pytest.raises(NotEnoughVRAM, match=r"not even one block fits on cpu: .* budget 0\.00 GB"):
        ksample(model)
    assert not model.swap_engine.attached
    assert ksample(patched(stock, 3)) is not None           # the next run works


def test_out_of_memory_mid_run_retries_at_a_smaller_window(stock, reference, caplog):
    clean = patched(stock, 3)
    at_3 = ksample(clean)
    comfy.model_management.unload_all_models()
    model = patched(stock, 4)
    engine = model.swap_engine
    streamed = [b for b in range(BLOCKS) if b not in (0, 1, 2)][1]
    inject_oom(engine, call=2, block=streamed)
    with caplog.at_level(logging.INFO, logger="ringswap"):
        out = ksample(model)
    assert torch.equal(out, at_3) and torch.equal(out, reference)
    (warning,) = messages(caplog, "RingSwap: out of memory on cpu at window 4, prefetch 1")
    assert "retrying this step at window 3, prefetch 1" in warning
    (run,) = messages(caplog, "RingSwap run:")
    assert "window 3, prefetch 1" in run and "out of memory: window 4 -> 3" in run and "3 model calls" in run
    plan = engine.plan
    assert plan.window == 3 and len(engine.att.ring.slots) == plan.ring_slots == 2
    assert len(blocks_on_device(engine)) <= len(plan.resident) + plan.ring_slots
    assert all(s.slot is None for s in engine.states)
    # the next run plans the set window again
    assert torch.equal(ksample(model), reference) and engine.plan.window == 4


def test_second_out_of_memory_fails_the_run_and_holds_nothing(stock, reference):
    model = patched(stock, 4)
    engine = model.swap_engine
    inject_oom(engine, call=1, block=4, times=2)
    with pytest.raises(torch.OutOfMemoryError, match="again after shrinking to window 3, prefetch 1"):
        ksample(model)
    assert not engine.attached
    assert all(s.device_buffer is None and s.slot is None for s in engine.states)
    assert torch.equal(ksample(model), reference)            # and the prompt after runs


def test_out_of_memory_at_the_smallest_plan_fails_clearly(stock, reference):
    model = patched(stock, 1, 0)
    inject_oom(model.swap_engine, call=1, block=3)
    with pytest.raises(torch.OutOfMemoryError, match="at window 1, prefetch 0, already the smallest plan"):
        ksample(model)
    assert not model.swap_engine.attached
    assert torch.equal(ksample(model), reference)


@pytest.mark.gpu
def test_out_of_memory_recovery_on_cuda_is_bit_exact_and_frees_the_ring(stock):
    clean = ksample(patched(stock, 3))
    comfy.model_management.unload_all_models()
    model = patched(stock, 4)
    inject_oom(model.swap_engine, call=2, block=4)
    assert torch.equal(ksample(model), clean)
    assert model.swap_engine.plan.window == 3
    comfy.model_management.unload_all_models()
    base = torch.cuda.memory_allocated()
    model = patched(stock, 4)
    inject_oom(model.swap_engine, call=1, block=4, times=2)
    with pytest.raises(torch.OutOfMemoryError, match="again after shrinking"):
        ksample(model)
    assert not model.swap_engine.attached
    comfy.model_management.unload_all_models()
    assert torch.cuda.memory_allocated() <= base


@pytest.mark.gpu
def test_first_call_measures_the_activation_peak_for_the_next_plan(stock, caplog):
    model = patched(stock, 0)
    model.swap_state.measured.clear()   # the module's earlier tests ran this model at the same shape
    with caplog.at_level(logging.INFO, logger="ringswap"):
        ksample(model)
        ksample(model)
    plans = messages(caplog, "RingSwap plan:")
    assert "(ComfyUI's estimate)" in plans[0] and "(measured on an earlier run)" in plans[1], plans
    (measured,) = model.swap_state.measured.values()
    assert measured.activation_peak > 0 and measured.compute_s > 0


@pytest.fixture(scope="module")
def stock12(tmp_path_factory):
    return load_stock(tiny_wan(str(tmp_path_factory.mktemp("wan12")), blocks=12))


def test_first_prompt_replans_by_the_first_calls_rates(stock12, caplog):
    """A first prompt plans without rates. Early in the run, the plan the measured compute time
    and link rate choose is taken where it pays back within the run (here 12 equal
    blocks, room for 4: window 3 prefetch 1 stalls on adjacent streamed blocks, window 2
    prefetch 2 does not); the run stays bit-exact and its lines say so. The blocks both plans
    keep resident stay on the device, so a re-plan that only drops one places nothing and
    pays back with two calls left."""
    import comfy.sample
    steps = 20
    noise = torch.randn(1, 16, 2, 8, 8, generator=torch.Generator().manual_seed(3))

    def sample(model, callback=None, steps=steps):
        return comfy.sample.sample(model, noise, steps, 1.0, "euler", "simple", conditioning(1), conditioning(2),
                                   torch.zeros_like(noise), callback=callback, disable_pbar=True, seed=3)
    ref = sample(stock12)
    comfy.model_management.unload_all_models()
    probe = patched(stock12, 0)
    sample(probe)
    inp = probe.ringswap_run.plan.window.inputs
    comfy.model_management.unload_all_models()
    block = max(inp.block_sizes)
    model = patched(stock12, 0, 1, (inp.nonblock_bytes + inp.activation_bytes + 4 * block + block // 2) / GB)
    rates = (1.0, 10.5 * block)   # compute 1 s a call; a block copies in 1 / 10.5 s
    seen = []

    def after_step(i, *_):
        if i == 0:
            seen.append(sampling.replan_by_rates(model, lambda old, new: None, rates))
    with caplog.at_level(logging.INFO, logger="ringswap"):
        assert torch.equal(sample(model, after_step), ref)
    (new,) = seen
    assert run_facts.request_of(model).steps == steps   # from the sampler's sigmas (OUTER_SAMPLE)
    assert new is not None and (new.window.window, new.window.prefetch) == (2, 2), new
    assert model.ringswap_run.plan is new
    plans = messages(caplog, "RingSwap plan:")
    assert plans[0].startswith("RingSwap plan: window 3 of 12 (auto;"), plans
    assert plans[1].startswith("RingSwap plan: window 2 of 12 (auto; 1 resident + ring 3)"), plans
    assert "re-planned by the rates of the run's first calls (est. 1.05 s a call instead of 1.07 s)" in plans[1]
    (run,) = messages(caplog, "RingSwap run:")
    assert "re-planned by the first calls' rates: window 3 prefetch 1 -> window 2 prefetch 2" in run, run
    assert "out of memory" not in run
    comfy.model_management.unload_all_models()

    ref3 = sample(stock12, steps=3)
    comfy.model_management.unload_all_models()
    short = patched(stock12, 0, 1, (inp.nonblock_bytes + inp.activation_bytes + 4 * block + block // 2) / GB)

    def late(i, *_):   # 2 calls left save 0.05 s: enough, as dropping a resident block places nothing
        if i == 0:
            engine = short.swap_engine
            kept = engine.states[11].device_buffer
            assert engine.plan.resident == (5, 11)
            assert place_seconds(engine.facts(), ResidencyPlan.make(12, 2, 2), None, rates[1]) == 0
            grown = ResidencyPlan.make(12, 4, 1)   # (3, 7, 11): two blocks to copy from RAM
            assert place_seconds(engine.facts(), grown, None, rates[1]) == pytest.approx(2 * block / rates[1])
            seen.append(sampling.replan_by_rates(short, lambda old, new: None, rates))
            assert engine.states[11].device_buffer is kept   # still on the device, not placed again
    assert torch.equal(sample(short, late, steps=3), ref3)
    assert seen[-1] is not None and short.swap_engine.plan.window == 2
    comfy.model_management.unload_all_models()
