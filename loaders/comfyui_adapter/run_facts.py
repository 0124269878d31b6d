"""ComfyUI's numbers for a load plan: what a sampling run asks, what earlier runs measured, and the
free VRAM and RAM, gathered into swap.load_plan.RunFacts. The plan itself is decided in swap/.

The activation bytes of a call are the peak measured on the first call of an earlier run of the
same call shape (latent shape, conds a call), else ComfyUI's estimate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...swap.load_plan import LOAD, CallFacts, RunFacts
from ...swap.plane_coder import coder_missing
from ...swap.residency import ResidencyPlan
from . import comfy_memory

MEASURED = "measured on an earlier run"
SLACK = 64 * 2**20   # small tensors kept between runs (latents, conds) and the allocator's rounding


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


@dataclass
class Measured:
    """What an earlier run of one call shape (latent shape, conds a call) measured."""
    activation_peak: int = 0
    compute_s: float = 0.0
    land_s: float = 0.0                # a streamed block's on-land work (LoRA fold), its median span
    ran: ResidencyPlan | None = None   # the plan that ran it (a model call or more, no shrink)
    free_after: int = 0                # device memory the model could have at that run's end (free_for)


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


def call_facts(patcher, request: RunRequest | None, conds: int, folded: bool) -> CallFacts:
    """ComfyUI's numbers for a model call of `conds` conds (`folded`: blocks have on-land work)."""
    measured = measured_for(patcher, request, conds)
    if measured is not None and measured.activation_peak > 0:
        activation, source = measured.activation_peak, MEASURED
    elif request is not None:
        activation, source = request.estimate_for(conds), "ComfyUI's estimate"
    else:
        activation, source = 0, "no latent known"
    return CallFacts(
        activation_bytes=int(activation), activation_source=source,
        reserve_bytes=comfy_memory.reserved_vram(source == MEASURED),
        tokens=conds * tokens(patcher.model.diffusion_model, request.noise_shape) if request is not None else 0,
        compute_s=_compute_s(patcher, request, conds),
        land_s=measured.land_s if measured is not None and folded else 0.0)


def gather(patcher, device: torch.device, all_asked: bool = False, change: str = LOAD, **extra) -> RunFacts:
    """swap.load_plan.RunFacts for `patcher` (a SwapModelPatcher) on `device` now; `extra` sets the
    path's own fields (ran_here, rates, calls_left)."""
    request = request_of(patcher)
    folder = patcher.block_folder_on(device)   # dense folds (GGUF) hold dense weights while a block computes
    engine = patcher.swap_engine
    per_step = request.conds_per_step if request is not None else 1
    nonblock = patcher.swap_state.nonblock_bytes + (
        folder.workspace_bytes(device) + folder.pair_bytes(device) if folder else 0)
    return RunFacts(
        device=str(device), free_bytes=free_for(patcher, device), nonblock_bytes=nonblock,
        batched=call_facts(patcher, request, per_step, folder is not None),
        single=call_facts(patcher, request, 1, folder is not None), conds_per_step=per_step,
        all_asked=device.type == "cpu" or all_asked,
        dense_bytes=tuple(folder.dense_bytes(i) for i in range(engine.num_blocks)) if folder else (),
        packed_only=patcher.ringswap_run.packed_only, coder_missing=coder_missing(),
        change=change, **_host_ram(), **extra)


def host_ram(device: torch.device) -> RunFacts:
    """RunFacts with only the host RAM numbers filled in (what an unload's kept_at_unload reads)."""
    return RunFacts(device=str(device), free_bytes=0, nonblock_bytes=0, **_host_ram())


def _host_ram() -> dict:
    return dict(ram_available=comfy_memory.ram_available(), ram_kept_by_comfy=comfy_memory.ram_kept_by_comfy())


def free_for(patcher, device: torch.device) -> int:
    """Device memory `patcher`'s model can have now: free plus what it holds (its LoRA pairs
    kept on the device and the dense weights its attached blocks hold included: neither is in
    ComfyUI's model_loaded_weight_memory)."""
    folder = patcher.ringswap_run.folder
    kept = folder.kept_bytes(device) if folder is not None else 0
    dense = patcher.swap_engine.dense_held_bytes(device)
    return int(comfy_memory.free_vram(device) + patcher.model.model_loaded_weight_memory + kept + dense)


def ran_here(patcher, device: torch.device, plan: ResidencyPlan) -> frozenset[int]:
    """The conds a call at which `plan` ran this run's latent last time with no more device
    memory than the model can have now."""
    request = request_of(patcher)
    if request is None:
        return frozenset()
    free = free_for(patcher, device) + SLACK
    return frozenset(k for (shape, k), m in patcher.swap_state.measured.items()
                     if shape == request.noise_shape and m.ran == plan and free >= m.free_after)


def record_run(patcher, stats, plan: ResidencyPlan | None, device: torch.device | None) -> None:
    """Keep what this run measured for the next run of the same call shape (call before the
    engine detaches; `plan`/`device`: what is attached)."""
    request = request_of(patcher)
    if request is None or stats is None or not request.conds_per_call:
        return
    m = patcher.swap_state.measured.setdefault((request.noise_shape, request.conds_per_call), Measured())
    m.activation_peak = max(m.activation_peak, stats.activation_peak)
    if stats.compute_s:
        m.compute_s = stats.compute_s
    if stats.land_times:
        m.land_s = stats.fold_s_per_block
    proven = plan is not None and bool(stats.call_times) and not stats.shrinks
    m.ran, m.free_after = (plan, free_for(patcher, device)) if proven else (None, 0)
