"""bench/compare.py's workflow cell (issue 53: the workflow cell as users run it), measured in
the cell's own process: the distilled Wan 2.2 recipe. Two experts (high noise and low noise: two
model files of one shape, --path and --low-path), each through its own graph as users wire it
(Load Diffusion Model -> LoRA for ComfyUI alone, Load Diffusion Model -> LoRA -> RingSwap Patch,
RingSwap Model Loader -> LoRA), a LoRA on every block linear of each (--lora-rank, a seed per
expert), sampled as ComfyUI's KSamplerAdvanced does for Wan 2.2: the high-noise expert for the
first half of --prompt-steps (noise added, leftover noise returned), the low-noise one for the
rest (no noise added, denoised to the end).

Per workload (--tokens): the first prompt (the first workload's: both experts loaded from
nothing, the LoRAs applied, every step) and the next prompt (the same graph with a new seed:
ComfyUI runs only the two samplers again); every step timed between device syncs, so the expert
switches show as steps; the resident bytes RingSwap placed in each sampling run; the final
latents (sha256, and saved under --latent-dir for the parent's torch.equal); host RSS, pinned bytes.
"""
from __future__ import annotations

import hashlib
import os
import time

import torch

import comfy_start
import common

LORA_SEEDS = (0, 1)      # the high- and low-noise experts' LoRAs
PROMPT_SEEDS = (0, 1)    # the first prompt's noise seed, the next prompt's
KINDS = ("comfy", "patch", "loader", "auto")
LAST_STEP = 10000        # KSamplerAdvanced's end_at_step default: to the end


def _lora(model, a, seed: int):
    """`model` with a rank --lora-rank LoRA on every block linear, as LoraLoaderModelOnly applies it."""
    if not a.lora_rank:
        return model
    import comfy.sd
    from compare_child import block_lora
    return comfy.sd.load_lora_for_models(model, None, block_lora(model, a.lora_rank, seed), 1.0, 0)[0]


def expert(cfg, a, path: str, lora_seed: int):
    """One expert's MODEL as its graph makes it (the nodes' defaults: prefetch 1, pin auto, the
    Loader's disk_workers auto; window --window, compress --compress)."""
    if cfg.kind not in KINDS:
        raise SystemExit(f"--workflow runs the {', '.join(KINDS)} kinds, not {cfg.kind}")
    if cfg.kind in ("loader", "auto"):
        from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
        from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
        model = load_swapped_model(path, SwapSettings(a.window, 1, "auto", compress=a.compress),
                                   home="auto" if cfg.kind == "auto" else "ram", disk_workers=0)
        return _lora(model, a, lora_seed)
    import comfy.sd
    model = _lora(comfy.sd.load_diffusion_model(path), a, lora_seed)
    if cfg.kind == "patch":
        from ringswap.nodes.patch import RingSwapPatch
        (model,) = RingSwapPatch().patch(model, a.window, 1, "auto", compress=a.compress)
    return model


class StepClock:
    """The sampling callback: a time stamp after every step, the device synchronised first, so
    each step's time is its own (an expert switch shows as the step after it)."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        common.sync(dev)
        self.stamps = [time.perf_counter()]

    def __call__(self, *_) -> None:
        common.sync(self.dev)
        self.stamps.append(time.perf_counter())

    def steps(self) -> list[float]:
        return [b - a_ for a_, b in zip(self.stamps, self.stamps[1:])]


def _resident_placed(model, before) -> int | None:
    """Resident bytes a sampling run of `model` placed on the device: its RingSwap plan's resident
    blocks where the run attached anew (`before`: the attachment before the run), 0 where it kept
    the last run's blocks; None for a model RingSwap does not swap."""
    engine = getattr(model, "swap_engine", None)
    if engine is None:
        return None
    att, plan = engine.att, engine.plan
    if att is None or plan is None or att is before:
        return 0
    return sum(engine.states[i].layout.nbytes for i in plan.resident)


def ksampler_advanced(model, latent, conds, a, seed: int, start: int, end: int, clock: StepClock):
    """What KSamplerAdvanced (euler, simple) does from step `start` to `end` of --prompt-steps:
    noise from `seed` added at the start only, leftover noise returned before the end."""
    import comfy.sample
    add_noise = start == 0
    noise = comfy.sample.prepare_noise(latent, seed) if add_noise else torch.zeros_like(latent)
    return comfy.sample.sample(model, noise, a.prompt_steps, a.cfg, "euler", "simple", conds[0], conds[1], latent,
                               disable_noise=not add_noise, start_step=start, last_step=end,
                               force_full_denoise=end >= a.prompt_steps, callback=clock, disable_pbar=True, seed=seed)


def run_prompt(models: list, a, tokens: int, seed: int, dev: torch.device) -> dict:
    """One prompt of the two samplers: its wall, each step's seconds, the final latent and the
    resident bytes each sampling run placed."""
    f, h, w = common.latent_shape(tokens)
    g = torch.Generator().manual_seed(0)
    conds = [[[torch.randn(1, a.ctx_len, 4096, generator=g), {}]] for _ in range(2)]   # positive, negative
    latent = torch.zeros(1, 16, f, h, w)
    half = a.prompt_steps // 2
    clock, placed = StepClock(dev), []
    for model, start, end in ((models[0], 0, half), (models[1], half, LAST_STEP)):
        before = getattr(getattr(model, "swap_engine", None), "att", None)
        latent = ksampler_advanced(model, latent, conds, a, seed, start, end, clock)
        placed.append(_resident_placed(model, before))
    common.sync(dev)
    return {"wall": time.perf_counter() - clock.stamps[0], "steps": clock.steps(), "latent": latent, "placed": placed}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def figures(first: dict, nxt: dict, load_s: float | None, n: int) -> dict:
    """A workload's figures: the first prompt's wall (with the nodes' loads where it paid them)
    and steps, the next prompt's; its steady step (the mean of the steps that switch no expert),
    the sum of its steps at each expert's steady step, and what the two switch steps take beyond it."""
    steps, half = nxt["steps"], n // 2
    high, low = _mean(steps[1:half]), _mean(steps[half + 1:])
    high, low = high or low, low or high
    steady = _mean(steps[1:half] + steps[half + 1:])
    placed = nxt["placed"]
    return {"first_prompt_s": (load_s or 0.0) + first["wall"], "ttfs_load": load_s is not None,
            "ttfs_s": (load_s or 0.0) + first["steps"][0], "first_sampling_s": first["wall"],
            "first_prompt_steps": first["steps"], "next_prompt_s": nxt["wall"], "next_prompt_steps": steps,
            "prompt_steps": n, "steady_s": steady, "s_per_step": steady,
            "steady_sum_s": None if high is None else half * high + (n - half) * low,
            "first_step_extra_s": None if steady is None else steps[0] - steady,
            "switch_extra_s": None if steady is None or len(steps) <= half else steps[half] - steady,
            "first_placed_bytes": first["placed"], "placed_bytes": placed,
            "resident_placed_bytes": None if None in placed else sum(placed)}


def keep_latents(a, tokens: int, latents: dict) -> dict:
    """Each final latent's sha256 (of its bytes) and, with --latent-dir, the latent saved there."""
    out: dict = {}
    for which, x in latents.items():
        x = x.detach().cpu().contiguous()
        out[f"{which}_latent_sha256"] = hashlib.sha256(x.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        if a.latent_dir:
            os.makedirs(a.latent_dir, exist_ok=True)
            path = os.path.join(a.latent_dir, f"{tokens}_{which}.pt")
            torch.save(x, path)
            out.setdefault("latents", {})[which] = path
    return out


def workload(models: list, a, tokens: int, dev: torch.device, load_s: float | None) -> dict:
    """The first and the next prompt at `tokens` and their figures."""
    first = run_prompt(models, a, tokens, PROMPT_SEEDS[0], dev)
    nxt = run_prompt(models, a, tokens, PROMPT_SEEDS[1], dev)
    row = figures(first, nxt, load_s, a.prompt_steps)
    row.update(keep_latents(a, tokens, {"first": first["latent"], "next": nxt["latent"]}))
    engines = [getattr(m, "swap_engine", None) for m in models]
    if all(e is not None for e in engines):
        row["expert_pinned"] = [e.pool.pinned_bytes for e in engines]
    return row


def workflow_child(a) -> dict:
    """Measure configuration `a.child` running the workflow at every workload in `a.tokens`."""
    from compare_child import CONFIGS, keep_run_stats, memory_after, run_figures, start_comfy, warm_cuda_libraries
    cfg = CONFIGS[a.child]
    mm = start_comfy(cfg, a.device)
    log = comfy_start.RingSwapLines()
    dev = mm.get_torch_device()
    warm_cuda_libraries(dev)
    vram0, rss0 = common.device_used_bytes(), common.rss_bytes()
    sampler = common.RssSampler(0.05, vram=True).start()
    t0 = time.perf_counter()
    models = [expert(cfg, a, p, s) for p, s in zip((a.path, a.low_path), LORA_SEEDS)]
    out = {"config": a.child, "kind": cfg.kind, "comfy": cfg.comfy, "dynamic_vram": cfg.dynamic, "workflow": True,
           "patcher": type(models[0]).__name__, "load_s": time.perf_counter() - t0, "rss_base": rss0,
           "rss_after_load": common.rss_bytes(), "file_bytes": os.path.getsize(a.path),
           "low_file_bytes": os.path.getsize(a.low_path), "env": common.env_info(dev), "rows": []}
    runs = keep_run_stats(models)
    for tokens in a.tokens:
        row, seen = {"tokens": tokens}, len(log.lines)
        try:   # the first workload's first prompt pays the nodes' loads
            row.update(workload(models, a, tokens, dev, None if out["rows"] else out["load_s"]))
        except torch.OutOfMemoryError as e:
            row["error"] = "out of memory: " + str(e).splitlines()[0][:200]
        row.update(memory_after(sampler, vram0, dev))   # rss_peak: the cell's so far, loads included
        if runs:   # the next prompt's two runs
            row.update(run_figures(runs[-2:], a.prompt_steps))
            runs.clear()
        row["log"] = log.lines[seen:]
        out["rows"].append(row)
        said = [common.fmt_num(row.get(k), f) for k, f in (("first_prompt_s", ".1f"), ("next_prompt_s", ".1f"),
                                                             ("steady_s", ".3f"))]
        common.say(f"[compare] workflow {a.child} {tokens} tokens: first prompt {said[0]} s, next {said[1]} s, "
                   f"steady {said[2]} s/step {row.get('error', '')}")
    out["rss_peak"] = sampler.stop()
    return out
