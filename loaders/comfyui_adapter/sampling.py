"""RingSwap's wrappers around ComfyUI's sampling, and the plan changes made during a run.

OUTER_SAMPLE sees the guider (how many conds a step computes) and PREPARE_SAMPLING the latent
shape and conds before the model loads, so the load plans for this run's activations;
CALC_COND_BATCH makes ComfyUI's batching follow the plan (`free_for_batching`), and APPLY_MODEL
runs every model call through swap.recovery (out-of-memory retry at the plan swap.load_plan
shrinks to). A first prompt plans without measured rates; after its second model call
`replan_by_rates` moves to the plan those rates choose where swap.load_plan says it pays back.
"""
from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import time

import torch

import comfy.patcher_extension

from ...swap.load_plan import OOM, RATES, LoadPlan, plan_load
from ...swap.recovery import run_call
from . import comfy_features as features
from . import comfy_memory, comfy_sampling
from . import live_feed, prompt_clock, run_facts
from .run_facts import RunRequest, measured_for, request_of
from .swap_state import swap_state_on

log = logging.getLogger("ringswap.sampling")

# the run's second model call gives the rates: the first one's compute includes start-up (kernels,
# allocations), which hides a stall the timing model then misses
RATES_AFTER_CALLS = 2
WRAPPER_KEY = "ringswap"
LINE_SLACK = 1.25   # see free_for_batching

_conds_per_step: contextvars.ContextVar[int | None] = contextvars.ContextVar("ringswap_conds_per_step",
                                                                            default=None)
_steps: contextvars.ContextVar[int | None] = contextvars.ContextVar("ringswap_steps", default=None)
_started: contextvars.ContextVar[float | None] = contextvars.ContextVar("ringswap_started", default=None)


def install(patcher) -> None:
    """Register RingSwap's sampling wrappers on `patcher` (a SwapModelPatcher), once."""
    if not features.can_wrap(patcher):
        return
    kinds = comfy.patcher_extension.WrappersMP
    wrappers = [(kinds.PREPARE_SAMPLING, _prepare_sampling), (kinds.APPLY_MODEL, _apply_model)]
    wrappers += [(getattr(kinds, k), fn) for k, fn in (("OUTER_SAMPLE", _outer_sample),
                                                       ("CALC_COND_BATCH", _calc_cond_batch)) if hasattr(kinds, k)]
    for kind, fn in wrappers:
        if not patcher.wrappers.get(kind, {}).get(WRAPPER_KEY):
            patcher.add_wrapper_with_key(kind, WRAPPER_KEY, fn)


def conds_per_step(guider) -> int | None:
    """Conds `guider` computes each step: its non-empty cond groups (positive, negative, ...),
    less the negative that ComfyUI's sampling_function skips at cfg 1 (its cfg1 optimization);
    None for a guider that keeps no conds."""
    conds = getattr(guider, "conds", None) or getattr(guider, "original_conds", None)
    if not isinstance(conds, dict):
        return None
    groups = {k for k, v in conds.items() if v}
    cfg = getattr(guider, "cfg", None)
    options = getattr(guider, "model_options", None) or {}
    if isinstance(cfg, (int, float)) and math.isclose(cfg, 1.0) and "negative" in groups \
            and not options.get("disable_cfg1_optimization", False):
        groups.discard("negative")
    return max(1, len(groups))


def _outer_sample(executor, *args, **kwargs):
    token = _conds_per_step.set(conds_per_step(executor.class_obj))
    steps = _steps.set(comfy_sampling.sampling_steps(executor, args, kwargs))
    started = _started.set(prompt_clock.run_started())
    try:
        return executor(*args, **kwargs)
    finally:
        _started.reset(started)
        _steps.reset(steps)
        _conds_per_step.reset(token)


def _prepare_sampling(executor, model, noise_shape, conds, *args, **kwargs):
    if getattr(model, "ringswap", None) is not None:
        shape = tuple(int(d) for d in noise_shape)
        single, batched = comfy_memory.activation_estimates(model, shape, conds)
        per_step = _conds_per_step.get()
        model.ringswap_run.request = RunRequest(
            shape, single, batched, per_step if per_step is not None else comfy_memory.ESTIMATE_CONDS,
            steps=_steps.get() or 0)
    return executor(model, noise_shape, conds, *args, **kwargs)


def _calc_cond_batch(executor, model, conds, x_in, timestep, model_options, *args, **kwargs):
    patcher = getattr(model, "current_patcher", None)
    if getattr(patcher, "ringswap", None) is None:
        return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)
    with comfy_memory.batching_asks(patcher):
        return executor(model, conds, x_in, timestep, model_options, *args, **kwargs)


def free_for_batching(patcher, free_bytes: int) -> int:
    """The free memory ComfyUI's calc_cond_batch sees for `patcher`: it batches the step's
    conds when its estimate x BATCH_MARGIN is below this. So the answer follows the plan:
    above that line when the plan batches (it planned room for the batched call; with
    LINE_SLACK for an estimate at call time a little above the one at the run's start, less
    than one more cond adds), at most at it when the plan runs one call per cond; the true
    free memory without a plan."""
    plan, request = patcher.ringswap_run.plan, request_of(patcher)
    if plan is None or request is None or not patcher.swap_engine.attached or request.conds_per_step <= 1:
        return free_bytes
    window = plan.window
    line = int(comfy_memory.BATCH_MARGIN * request.estimate_for(window.inputs.conds_per_step))
    return max(free_bytes, int(line * LINE_SLACK) + 1) if window.batched else min(free_bytes, line)


def _note_first_call(request: RunRequest | None, x) -> None:
    """Record the conds the run's first model call batched (its batch over the latent's)."""
    if request is not None and not request.conds_per_call and isinstance(x, torch.Tensor) and x.ndim:
        request.conds_per_call = max(1, int(x.shape[0]) // max(1, request.noise_shape[0]))


def _peak_known(patcher) -> bool:
    """Whether an earlier run measured the activation peak of this run's call shape."""
    request = request_of(patcher) if patcher is not None else None
    if request is None or not request.conds_per_call:
        return False
    m = measured_for(patcher, request, request.conds_per_call)
    return m is not None and m.activation_peak > 0


def _apply_model(executor, *args, **kwargs):
    dm = executor.class_obj.diffusion_model
    state = swap_state_on(dm)
    engine = state.engine if state is not None else None
    if engine is None or not engine.attached:
        return executor(*args, **kwargs)
    live_feed.on_model_call(engine, args, kwargs)
    patcher = engine.owner
    if patcher is not None:
        _note_first_call(request_of(patcher), args[0] if args else kwargs.get("x"))

    def smaller() -> LoadPlan | None:
        run = patcher.ringswap_run if patcher is not None else None
        if run is None or run.plan is None:
            return None
        nxt = plan_load(engine.facts(), run_facts.gather(patcher, engine.device, change=OOM),
                        patcher.ringswap, run.plan)
        if nxt is not None:
            run.plan = nxt
        return nxt

    def on_change(old: int, new: int) -> None:
        if patcher is not None and patcher.model.model_loaded_weight_memory:
            patcher.model.model_loaded_weight_memory = max(0, patcher.model.model_loaded_weight_memory - old + new)

    out = run_call(engine, lambda: executor(*args, **kwargs), smaller, on_change,
                   measure_peak=not _peak_known(patcher))
    _time_first_step(engine, patcher)
    if patcher is not None and engine.attached and engine.stats.calls == RATES_AFTER_CALLS \
            and not engine.stats.shrinks:
        replan_by_rates(patcher, on_change)
    return out


def _time_first_step(engine, patcher) -> None:
    """After the run's first step (its planned model calls): the seconds since its prompt started
    go into the run's stats (one device sync a run)."""
    started, run = _started.get(), getattr(patcher, "ringswap_run", None)
    if started is None or run is None or run.plan is None or not engine.attached or engine.stats.first_step_s:
        return
    if engine.stats.calls == run.plan.window.inputs.calls_per_step:
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        engine.stats.first_step_s = time.perf_counter() - started


def replan_by_rates(patcher, on_change, rates: tuple[float, float] | None = None) -> LoadPlan | None:
    """Early in a run (after RATES_AFTER_CALLS model calls): where the plan was made without
    measured rates, take the plan the measured compute time a call and link rate choose where
    swap.load_plan says it pays back in this run's remaining calls; re-attach and log a plan
    line. Returns the new plan or None. `rates`: (compute seconds a call, link bytes/s), default
    the engine's measurement."""
    plan, request, engine = patcher.ringswap_run.plan, request_of(patcher), patcher.swap_engine
    if plan is None or request is None or not request.steps or plan.window.timed or not plan.residency.streamed:
        return None
    stats = engine.run_stats()
    compute_s, link = rates if rates is not None else (stats.compute_s, engine.facts().link_bytes_per_s)
    calls_left = request.steps * plan.window.inputs.calls_per_step - stats.calls
    facts = run_facts.gather(patcher, engine.device, change=RATES, calls_left=calls_left,
                             rates=(compute_s, link, stats.fold_s_per_block))
    new = plan_load(engine.facts(), facts, patcher.ringswap, plan)
    if new is None:
        return None
    t0, held = time.perf_counter(), engine.device_bytes()
    engine.reattach(new, after_oom=False)
    on_change(held, engine.device_bytes())
    patcher.ringswap_run.plan = new
    before = dataclasses.replace(plan.window, inputs=new.window.inputs)
    log.info("%s; re-planned by the rates of the run's first calls (est. %.2f s a call instead of %.2f s); "
             "placed in %.2f s", new.window.line(), new.window.call_s, before.call_s, time.perf_counter() - t0)
    return new
