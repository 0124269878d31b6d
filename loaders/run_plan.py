"""Each sampling run's window plan from ComfyUI's memory picture, and the model-call wrapper.

ComfyUI's PREPARE_SAMPLING wrapper hands over the latent shape and conds before the model
loads, so `plan_for_load` plans for this run's activations (measured on the first call of
an earlier run at the same shape, else ComfyUI's estimate); the APPLY_MODEL wrapper runs
every model call through swap.recovery (out-of-memory retry at a smaller window).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

import comfy.patcher_extension

from ..swap.plan import ResidencyPlan
from ..swap.planner import PlanInputs, WindowPlan, plan_window, shrink_after_oom
from ..swap.recovery import run_call
from . import comfy_features as features

GB = 1e9
WRAPPER_KEY = "ringswap"


@dataclass(frozen=True)
class RunRequest:
    """What a sampling run will ask of the model: its latent shape and ComfyUI's activation estimate."""
    noise_shape: tuple[int, ...]
    estimate: int


SLACK = 64 * 2**20   # small tensors kept between runs (latents, conds) and the allocator's rounding


@dataclass
class Measured:
    """What an earlier run at one latent shape measured."""
    activation_peak: int = 0
    compute_s: float = 0.0
    ran: ResidencyPlan | None = None   # the plan that ran it (a model call or more, no shrink)
    free_after: int = 0                # device memory the model could have at that run's end (free_for)


def install(patcher) -> None:
    """Register RingSwap's sampling wrappers on `patcher` (a SwapModelPatcher), once."""
    if not features.can_wrap(patcher):
        return
    kinds = comfy.patcher_extension.WrappersMP
    for kind, fn in ((kinds.PREPARE_SAMPLING, _prepare_sampling), (kinds.APPLY_MODEL, _apply_model)):
        if not patcher.wrappers.get(kind, {}).get(WRAPPER_KEY):
            patcher.add_wrapper_with_key(kind, WRAPPER_KEY, fn)


def _prepare_sampling(executor, model, noise_shape, conds, *args, **kwargs):
    if getattr(model, "ringswap", None) is not None:
        shape = tuple(int(d) for d in noise_shape)
        model.__dict__["_ringswap_request"] = RunRequest(shape, features.activation_estimate(model, shape, conds))
    return executor(model, noise_shape, conds, *args, **kwargs)


def request_of(patcher) -> RunRequest | None:
    return patcher.__dict__.get("_ringswap_request")


def tokens(diffusion_model, noise_shape: tuple[int, ...]) -> int:
    """Tokens of one model call (batch included), from the model's patch size; 0 if unknown."""
    patch = getattr(diffusion_model, "patch_size", None)
    spatial = noise_shape[2:]
    if isinstance(patch, int):
        patch = (patch,) * len(spatial)
    if not isinstance(patch, (tuple, list)) or len(patch) != len(spatial):
        return 0
    return noise_shape[0] * math.prod(-(-d // max(1, int(p))) for d, p in zip(spatial, patch))


def plan_inputs(patcher, device: torch.device, free_bytes: int, request: RunRequest | None,
                window: int | None = None) -> PlanInputs:
    """The planner's inputs for `patcher` on `device` (free_bytes: what this model can have)."""
    state, settings = patcher.swap_state, patcher.ringswap
    engine = state.engine
    measured = state.measured.get(request.noise_shape) if request is not None else None
    if measured is not None and measured.activation_peak > 0:
        activation, source = measured.activation_peak, "measured on an earlier run"
    elif request is not None:
        activation, source = request.estimate, "ComfyUI's estimate"
    else:
        activation, source = 0, "no latent known"
    return PlanInputs(
        block_sizes=tuple(s.layout.nbytes for s in engine.states), nonblock_bytes=state.nonblock_bytes,
        free_bytes=int(free_bytes), reserve_bytes=features.reserved_vram(), activation_bytes=int(activation),
        activation_source=source, budget_bytes=int(settings.vram_budget_gb * GB),
        window=settings.window if window is None else window, prefetch=settings.prefetch, device=str(device),
        tokens=tokens(patcher.model.diffusion_model, request.noise_shape) if request is not None else 0,
        link_bytes_per_s=engine.link_bytes_per_s, compute_s=measured.compute_s if measured else 0.0)


def plan_for_load(patcher, device: torch.device, full_load: bool) -> WindowPlan:
    """The plan for this load of `patcher`: all blocks on a CPU device or a full load
    (unless a window or budget is set), else the planner's window for this run."""
    n = patcher.swap_engine.num_blocks
    settings = patcher.ringswap
    everything = (device.type == "cpu" or full_load) and not settings.vram_budget_gb
    plan = plan_window(plan_inputs(patcher, device, free_for(patcher, device), request_of(patcher),
                                   window=n if everything and not settings.window else None))
    return dataclasses.replace(plan, automatic=not settings.window)


def free_for(patcher, device: torch.device) -> int:
    """Device memory `patcher`'s model can have now: free plus what it holds."""
    return int(features.free_vram(device) + patcher.model.model_loaded_weight_memory)


def ran_here(patcher, device: torch.device, plan: ResidencyPlan) -> bool:
    """Whether `plan` ran this run's latent shape last time with no more
    device memory than the model can have now."""
    request = request_of(patcher)
    m = patcher.swap_state.measured.get(request.noise_shape) if request is not None else None
    return m is not None and m.ran == plan and free_for(patcher, device) + SLACK >= m.free_after


def record_run(patcher, stats) -> None:
    """Keep what this run measured for the next run at the same latent shape (call before
    the engine detaches)."""
    request = request_of(patcher)
    if request is None or stats is None:
        return
    m = patcher.swap_state.measured.setdefault(request.noise_shape, Measured())
    m.activation_peak = max(m.activation_peak, stats.activation_peak)
    if stats.compute_s:
        m.compute_s = stats.compute_s
    att = patcher.swap_engine.att
    proven = att is not None and bool(stats.call_times) and not stats.shrinks
    m.ran, m.free_after = (att.plan, free_for(patcher, att.device)) if proven else (None, 0)


def _apply_model(executor, *args, **kwargs):
    dm = executor.class_obj.diffusion_model
    state = dm.__dict__.get("_ringswap_state")
    engine = state.engine if state is not None else None
    if engine is None or engine.att is None:
        return executor(*args, **kwargs)
    patcher = engine.att.owner() if callable(engine.att.owner) else None
    plan = patcher.__dict__.get("_ringswap_plan") if patcher is not None else None

    def smaller():
        if plan is None:
            return None
        nxt = shrink_after_oom(plan)
        if nxt is None:
            return None
        patcher.__dict__["_ringswap_plan"] = nxt
        return nxt.window, nxt.prefetch

    def on_change(old: int, new: int) -> None:
        if patcher is not None and patcher.model.model_loaded_weight_memory:
            patcher.model.model_loaded_weight_memory = max(0, patcher.model.model_loaded_weight_memory - old + new)

    return run_call(engine, lambda: executor(*args, **kwargs), smaller, on_change)
