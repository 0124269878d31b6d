"""Each sampling run's window plan from ComfyUI's memory picture, and the model-call wrappers.

The OUTER_SAMPLE wrapper sees the guider (how many conds a step computes) and PREPARE_SAMPLING
the latent shape and conds before the model loads, so `plan_for_load` plans for this run's
activations (measured on the first call of an earlier run of the same call shape, else
ComfyUI's estimate), batched or one call per cond (swap.window_plan.plan_step); CALC_COND_BATCH
makes ComfyUI's batching follow that plan (`free_for_batching`), and APPLY_MODEL runs every
model call through swap.recovery (out-of-memory retry at a smaller window). A first prompt
plans without measured rates; after its second model call `replan_by_rates` moves to the plan
those rates choose where that pays back within the run (swap.window_plan.replan_with_rates).
"""
from __future__ import annotations

import contextvars
import dataclasses
import logging
import math
import time
from dataclasses import dataclass

import torch

import comfy.patcher_extension

from ...swap.residency import ResidencyPlan
from ...swap.window_plan import NotEnoughVRAM, PlanInputs, WindowPlan, plan_step, replan_with_rates, shrink_after_oom
from ...swap.recovery import run_call
from . import comfy_features as features
from . import comfy_memory, comfy_sampling
from . import compress_choice, live_feed, ram_room
from .run_state import swap_state_on

log = logging.getLogger("ringswap.run_plan")

GB = 1e9
DISK_GUESS = 1e9   # bytes/s for reading blocks back from the file before any read was timed
# the run's second model call gives the rates: the first one's compute includes start-up (kernels,
# allocations), which hides a stall the timing model then misses
RATES_AFTER_CALLS = 2
WRAPPER_KEY = "ringswap"


@dataclass
class RunRequest:
    """What a sampling run will ask of the model: its latent shape, ComfyUI's activation
    estimates for one cond a call and for the step's conds batched, and the conds a step
    computes; `conds_per_call` records what the run's first model call really batched."""
    noise_shape: tuple[int, ...]
    estimate: int
    batched_estimate: int = 0
    conds_per_step: int = 1
    conds_per_call: int = 0      # conds in the first model call (0 until it ran)
    steps: int = 0               # steps of the run (0: unknown)

    def estimate_for(self, conds: int) -> int:
        """ComfyUI's activation estimate for `conds` conds in one call (linear past two)."""
        if conds <= 1 or not self.batched_estimate:
            return self.estimate * max(1, conds)
        return self.estimate + (conds - 1) * max(0, self.batched_estimate - self.estimate)


MEASURED = "measured on an earlier run"
LINE_SLACK = 1.25   # see free_for_batching
SLACK = 64 * 2**20   # small tensors kept between runs (latents, conds) and the allocator's rounding


@dataclass
class Measured:
    """What an earlier run of one call shape (latent shape, conds a call) measured."""
    activation_peak: int = 0
    compute_s: float = 0.0
    land_s: float = 0.0                # a streamed block's on-land work (LoRA fold), its median span
    ran: ResidencyPlan | None = None   # the plan that ran it (a model call or more, no shrink)
    free_after: int = 0                # device memory the model could have at that run's end (free_for)


_conds_per_step: contextvars.ContextVar[int | None] = contextvars.ContextVar("ringswap_conds_per_step",
                                                                            default=None)
_steps: contextvars.ContextVar[int | None] = contextvars.ContextVar("ringswap_steps", default=None)


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
    try:
        return executor(*args, **kwargs)
    finally:
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
    if plan is None or request is None or patcher.swap_engine.att is None or request.conds_per_step <= 1:
        return free_bytes
    line = int(comfy_memory.BATCH_MARGIN * request.estimate_for(plan.inputs.conds_per_step))
    return max(free_bytes, int(line * LINE_SLACK) + 1) if plan.batched else min(free_bytes, line)


def request_of(patcher) -> RunRequest | None:
    return patcher.ringswap_run.request


def tokens(diffusion_model, noise_shape: tuple[int, ...]) -> int:
    """Tokens of one model call (batch included), from the model's patch size; 0 if unknown."""
    patch = getattr(diffusion_model, "patch_size", None)
    spatial = noise_shape[2:]
    if isinstance(patch, int):
        patch = (patch,) * len(spatial)
    if not isinstance(patch, (tuple, list)) or len(patch) != len(spatial):
        return 0
    return noise_shape[0] * math.prod(-(-d // max(1, int(p))) for d, p in zip(spatial, patch))


def measured_for(patcher, request: RunRequest | None, conds: int) -> Measured | None:
    return patcher.swap_state.measured.get((request.noise_shape, conds)) if request is not None else None


def _compute_s(patcher, request: RunRequest | None, conds: int) -> float:
    """Device time of one model call of `conds` conds: measured at that shape, else scaled
    from a call of the same latent with another number of conds; 0 if none ran."""
    if request is None:
        return 0.0
    exact = measured_for(patcher, request, conds)
    if exact is not None and exact.compute_s > 0:
        return exact.compute_s
    for (shape, k), m in patcher.swap_state.measured.items():
        if shape == request.noise_shape and m.compute_s > 0:
            return m.compute_s * conds / k
    return 0.0


def plan_inputs(patcher, device: torch.device, free_bytes: int, request: RunRequest | None,
                window: int | None = None, conds: int = 1, copy_bound: bool = False) -> PlanInputs:
    """The planner's inputs for `patcher` on `device` (free_bytes: what this model can have)
    with `conds` of the step's conds in each model call (`copy_bound`: a plan without the decode
    scratch was copy-bound, so compress=auto may code and the scratch counts)."""
    state, settings = patcher.swap_state, patcher.ringswap
    engine = state.engine
    measured = measured_for(patcher, request, conds)
    if measured is not None and measured.activation_peak > 0:
        activation, source = measured.activation_peak, MEASURED
    elif request is not None:
        activation, source = request.estimate_for(conds), "ComfyUI's estimate"
    else:
        activation, source = 0, "no latent known"
    per_step = request.conds_per_step if request is not None else 1
    folder = patcher.block_folder_on(device)   # dense folds (GGUF) hold dense weights while a block computes
    return PlanInputs(
        block_sizes=tuple(s.layout.nbytes for s in engine.states),
        dense_bytes=tuple(folder.dense_bytes(s.index) for s in engine.states) if folder else (),
        nonblock_bytes=state.nonblock_bytes + (folder.workspace_bytes(device) + folder.pair_bytes(device) if folder else 0)
        + compress_choice.scratch_bytes(settings.compress, device, engine.home, engine.read_block is not None,
                                         bool(engine.pool.coded), copy_bound),
        free_bytes=int(free_bytes), reserve_bytes=comfy_memory.reserved_vram(source == MEASURED),
        activation_bytes=int(activation),
        activation_source=source, budget_bytes=int(settings.vram_budget_gb * GB),
        window=settings.window if window is None else window, prefetch=settings.prefetch, device=str(device),
        tokens=conds * tokens(patcher.model.diffusion_model, request.noise_shape) if request is not None else 0,
        link_bytes_per_s=engine.link_bytes_per_s, compute_s=_compute_s(patcher, request, conds),
        land_s=measured.land_s if measured is not None and folder is not None else 0.0,
        conds_per_step=per_step, conds_per_call=min(conds, per_step))


def plan_for_load(patcher, device: torch.device, full_load: bool) -> WindowPlan:
    """The plan for this load of `patcher`: all blocks on a CPU device or a full load
    (unless a window or budget is set), else the planner's window for this run; the step's
    conds batched or one call each, whichever swap.window_plan.plan_step finds faster."""
    n = patcher.swap_engine.num_blocks
    settings = patcher.ringswap
    everything = (device.type == "cpu" or full_load) and not settings.vram_budget_gb
    request = request_of(patcher)
    window = n if everything and not settings.window else None
    free = free_for(patcher, device)
    per_step = request.conds_per_step if request is not None else 1

    def plan(copy_bound: bool) -> WindowPlan:
        return plan_step(plan_inputs(patcher, device, free, request, window, per_step, copy_bound),
                         plan_inputs(patcher, device, free, request, window, 1, copy_bound))
    run = patcher.ringswap_run
    run.packed_only = False
    try:
        chosen = plan(False)
    except NotEnoughVRAM as e:
        folder = patcher.block_folder_on(device)
        if folder is None or not folder.dense_unpatched:
            raise
        run.packed_only = True   # the weights made dense on landing are optional: packed, in their layers
        chosen = plan(False)
        log.info("RingSwap: GGUF weights made dense on landing do not fit (%s); they stay packed in "
                 "their layers for this load", str(e).splitlines()[0])
    if chosen.bound == "copy-bound" and settings.compress == "auto":   # auto may code: its scratch counts
        chosen = plan(True)
    return dataclasses.replace(chosen, automatic=not settings.window)


def free_for(patcher, device: torch.device) -> int:
    """Device memory `patcher`'s model can have now: free plus what it holds (its LoRA pairs
    kept on the device and the dense weights its attached blocks hold included: neither is in
    ComfyUI's model_loaded_weight_memory)."""
    folder, att = patcher.ringswap_run.folder, patcher.swap_engine.att
    kept = folder.kept_bytes(device) if folder is not None else 0
    dense = att.dense_held_bytes() if att is not None and att.device == device else 0
    return int(comfy_memory.free_vram(device) + patcher.model.model_loaded_weight_memory + kept + dense)


def ran_here(patcher, device: torch.device, plan: ResidencyPlan, conds: int) -> bool:
    """Whether `plan` ran this run's call shape (latent shape, `conds` a call) last time with
    no more device memory than the model can have now."""
    m = measured_for(patcher, request_of(patcher), conds)
    return m is not None and m.ran == plan and free_for(patcher, device) + SLACK >= m.free_after


def record_run(patcher, stats) -> None:
    """Keep what this run measured for the next run of the same call shape (call before
    the engine detaches)."""
    request = request_of(patcher)
    if request is None or stats is None or not request.conds_per_call:
        return
    m = patcher.swap_state.measured.setdefault((request.noise_shape, request.conds_per_call), Measured())
    m.activation_peak = max(m.activation_peak, stats.activation_peak)
    if stats.compute_s:
        m.compute_s = stats.compute_s
    if stats.land_times:
        m.land_s = stats.fold_s_per_block
    att = patcher.swap_engine.att
    proven = att is not None and bool(stats.call_times) and not stats.shrinks
    m.ran, m.free_after = (att.plan, free_for(patcher, att.device)) if proven else (None, 0)


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
    if engine is None or engine.att is None:
        return executor(*args, **kwargs)
    live_feed.on_model_call(engine, args, kwargs)
    patcher = engine.att.owner() if callable(engine.att.owner) else None
    plan = patcher.ringswap_run.plan if patcher is not None else None
    if patcher is not None:
        _note_first_call(request_of(patcher), args[0] if args else kwargs.get("x"))

    def smaller():
        if plan is None:
            return None
        nxt = shrink_after_oom(plan)
        if nxt is None:
            return None
        patcher.ringswap_run.plan = nxt
        return nxt.residency

    def on_change(old: int, new: int) -> None:
        if patcher is not None and patcher.model.model_loaded_weight_memory:
            patcher.model.model_loaded_weight_memory = max(0, patcher.model.model_loaded_weight_memory - old + new)

    out = run_call(engine, lambda: executor(*args, **kwargs), smaller, on_change,
                   measure_peak=not _peak_known(patcher))
    if patcher is not None and engine.att is not None and engine.att.stats.calls == RATES_AFTER_CALLS \
            and not engine.att.stats.shrinks:
        replan_by_rates(patcher, on_change)
    return out


def place_seconds(engine, residency: ResidencyPlan, ram_blocks, link_bytes_per_s: float) -> float:
    """Seconds re-attaching `residency` takes: the resident blocks not on the device yet, copied
    from their RAM home at the link rate or read from the file at the last read-back's rate,
    RAM homes to fill from the file, and the streamed homes to page-lock at the pool's rate."""
    read, read_s = engine.read_back
    disk = read / read_s if read and read_s > 0 else DISK_GUESS
    on_device = set(engine.att.plan.resident) if engine.att is not None else set()
    placing = set(residency.resident) - on_device
    homes = engine.ram_homes(residency, ram_blocks)
    size, pool = [s.layout.nbytes for s in engine.states], engine.pool
    from_file = sum(size[i] for i in placing | homes if not pool.has(i))
    from_ram = sum(size[i] for i in placing if pool.has(i))
    to_pin = sum(size[i] for i in homes & set(residency.streamed) if not pool.has(i) or not pool.buffer(i).pinned) \
        if engine.memory == "pinned" else 0
    return from_file / disk + from_ram / link_bytes_per_s + engine.pool.pin_seconds(to_pin)


def replan_by_rates(patcher, on_change, rates: tuple[float, float] | None = None) -> WindowPlan | None:
    """Early in a run (after RATES_AFTER_CALLS model calls): where the plan was made without
    measured rates, take the plan the measured compute time a call and link rate choose, if
    swap.window_plan.replan_with_rates says it pays back in this run's remaining calls; re-attach
    and log a plan line. Returns the new plan or None. `rates`: (compute seconds a call, link
    bytes/s), default the engine's measurement (compute without the first call where there
    are more; pinned copies only)."""
    plan, request, engine = patcher.ringswap_run.plan, request_of(patcher), patcher.swap_engine
    if plan is None or request is None or not request.steps or plan.timed or not plan.residency.streamed:
        return None
    stats = engine.run_stats()
    if rates is None:
        rates = (stats.compute_s, engine.link_bytes_per_s)
    compute_s, link = rates
    calls_left = request.steps * plan.inputs.calls_per_step - stats.calls
    budget = patcher.ringswap.ram_budget_gb

    def homes(residency):
        split = ram_room.split_for(engine, residency, budget)
        return split.ram_blocks if split is not None else None
    new = replan_with_rates(plan, compute_s, link, calls_left,
                            lambda r: place_seconds(engine, r, homes(r), link), stats.fold_s_per_block)
    if new is None:
        return None
    t0, held = time.perf_counter(), engine.device_bytes()
    engine.reattach(new.residency, homes(new.residency), after_oom=False)
    on_change(held, engine.device_bytes())
    patcher.ringswap_run.plan = new
    log.info("%s; re-planned by the rates of the run's first calls (est. %.2f s a call instead of %.2f s); "
             "placed in %.2f s", new.line(), new.call_s, dataclasses.replace(plan, inputs=new.inputs).call_s,
             time.perf_counter() - t0)
    return new
