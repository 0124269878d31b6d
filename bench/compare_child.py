"""One configuration of bench/compare.py, measured in its own process (behind the parent's
ballast): start ComfyUI as the configuration says, load the model, then time every workload.

Kinds of configuration:
  floor      ComfyUI's WanModel alone, fully resident, called directly (no sampling path)
  comfy      Load Diffusion Model + ComfyUI's sampling path: fully resident when nothing
             caps the GPU, ComfyUI's own partial load / dynamic VRAM under a cap
  diffusers  diffusers' apply_group_offloading(block_level, 1 block per group, a copy
             stream) on the same WanModel module, called directly
  patch      Load Diffusion Model -> RingSwap Patch (window --window, 0 = auto; prefetch 1)
  loader     RingSwap Model Loader, home ram (the same window, prefetch 1)
  auto       RingSwap Model Loader, home auto (RAM for the streamed blocks as the free RAM allows)
  disk       RingSwap Model Loader, home disk, page cache dropped before the load and
             before every workload
--experts 2 (loader, auto, disk): Wan 2.2 style, two models loaded apart from the file (a first
prompt loads both; the next prompt's two first steps are the expert switches timed), the
first sampling the first half of the steps and the second the rest; the switch and each
expert's pinned bytes are reported. --workflow: compare_workflow.py's cell instead (two files,
a LoRA each, first and next prompt, as users run Wan 2.2). Per workload: one prompt of
--prompt-steps steps (home=disk: 1 + --disk-steps), one sampling call; its first step apart,
s/step the mean of the rest (common.steady_s); TTFS and the prompt's wall (prompt_figures: the
first workload's include the node's load, later workloads' start at their sampling call);
RingSwap's log lines;
with --rerun, one more sampling run of 1 + --rerun-steps steps (the next prompt: its first step,
what ComfyUI's load costs again, its s/step planned with what the first run measured, and its
log lines);
host RSS sampled (peak, and steady = after the workload's last step); device memory in use
above what it was when the child started (sampled, sees allocations outside torch too), torch's
own peak; pinned bytes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

import comfy_start
import common


@dataclass(frozen=True)
class Config:
    kind: str          # floor, comfy, diffusers, patch, loader, disk
    comfy: str         # ComfyUI version the process runs: 0.3.75 or 0.33
    dynamic: bool      # 0.33's dynamic VRAM started as its main.py does
    label: str


CONFIGS = {
    "floor": Config("floor", "0.3.75", False, "WanModel alone, resident (floor)"),
    "comfy-0.3.75": Config("comfy", "0.3.75", False, "ComfyUI 0.3.75 (no cap: resident; cap: native partial load)"),
    "comfy-0.33": Config("comfy", "0.33", False, "ComfyUI 0.33, dynamic VRAM disabled"),
    "comfy-0.33-dyn": Config("comfy", "0.33", True, "ComfyUI 0.33 dynamic VRAM (its default)"),
    "diffusers": Config("diffusers", "0.3.75", False, "diffusers group offloading (block, stream)"),
    "rs-patch-0.3.75": Config("patch", "0.3.75", False, "RingSwap Patch, auto window, ComfyUI 0.3.75"),
    "rs-loader-0.3.75": Config("loader", "0.3.75", False, "RingSwap Loader, home ram, ComfyUI 0.3.75"),
    "rs-patch-0.33-dyn": Config("patch", "0.33", True, "RingSwap Patch, auto window, ComfyUI 0.33 dynamic"),
    "rs-patch-0.33": Config("patch", "0.33", False, "RingSwap Patch, auto window, ComfyUI 0.33, dynamic VRAM disabled"),
    "rs-loader-0.33-dyn": Config("loader", "0.33", True, "RingSwap Loader, home ram, ComfyUI 0.33 dynamic"),
    "rs-disk-0.3.75": Config("disk", "0.3.75", False, "RingSwap Loader, home disk (cold cache), 0.3.75"),
    "rs-auto-0.3.75": Config("auto", "0.3.75", False, "RingSwap Loader, home auto, ComfyUI 0.3.75"),
    "rs-auto-0.33-dyn": Config("auto", "0.33", True, "RingSwap Loader, home auto, ComfyUI 0.33 dynamic"),
}


def start_comfy(cfg: Config, device: str):
    """ComfyUI's modules, started as the configuration says (RingSwap's nodes imported, as ComfyUI
    imports custom nodes at its start, before any load is timed); returns comfy.model_management."""
    mm = comfy_start.start_comfy(device, cfg.dynamic, disable_dynamic=cfg.comfy == "0.33" and not cfg.dynamic)
    if cfg.kind in ("patch", "loader", "disk", "auto"):
        import ringswap.nodes  # noqa: F401
    return mm


def warm_cuda_libraries(dev: torch.device) -> None:
    """Load cuBLAS and the attention kernels' libraries before the RSS baseline is taken, so the
    RSS a configuration holds over it is its model's, not the libraries' (~0.6 GB on the H200)."""
    if dev.type != "cuda":
        return
    x = torch.randn(1, 2, 256, 64, device=dev, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(x, x, x)
    torch.nn.functional.linear(x, torch.randn(64, 64, device=dev, dtype=torch.bfloat16))
    torch.cuda.synchronize(dev)


def rss_parts() -> dict:
    """RSS by kind in bytes (Linux /proc/self/status: anonymous, file-backed such as mapped files
    and shared libraries, shared memory), to tell a model's copy from libraries; {} elsewhere."""
    try:
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("RssAnon", "RssFile", "RssShmem")}
    except OSError:
        return {}


def block_lora(patcher, rank: int, seed: int = 0) -> dict:
    """A rank-`rank` LoRA (bf16, ComfyUI's generic key format) on every linear layer of every
    transformer block of `patcher`'s model."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, mod in patcher.model.diffusion_model.named_modules():
        if name.startswith("blocks.") and hasattr(mod, "in_features") and hasattr(mod, "out_features"):
            key = f"diffusion_model.{name}"
            sd[f"{key}.lora_up.weight"] = (torch.randn(mod.out_features, rank, generator=g) * 0.01).bfloat16()
            sd[f"{key}.lora_down.weight"] = (torch.randn(rank, mod.in_features, generator=g) * 0.01).bfloat16()
    return sd


def with_lora(model, a):
    """`model` with --lora-rank's LoRA applied as the stock LoraLoaderModelOnly does (strength 1)."""
    if not a.lora_rank:
        return model
    import comfy.sd
    return comfy.sd.load_lora_for_models(model, None, block_lora(model, a.lora_rank), 1.0, 0)[0]


def with_compile(model, a):
    """`model` compiled as ComfyUI's TorchCompileModel node does (the whole diffusion model,
    backend --compile), or `model` itself without --compile."""
    if not a.compile:
        return model
    from comfy_api.torch_helpers import set_torch_compile_wrapper
    compiled = model.clone()
    set_torch_compile_wrapper(model=compiled, backend=a.compile)
    return compiled


def as_sampled(model, a):
    """`model` as a sampled configuration runs it: with --lora-rank's LoRA, then --compile."""
    return with_compile(with_lora(model, a), a)


def build(cfg: Config, a, dev: torch.device):
    """(the object to step, how to step it: "direct" or "sample", the ComfyUI patcher); with
    --lora-rank, the sampled MODELs carry the LoRA, with --compile they are compiled (the
    direct ones run without either)."""
    import comfy.sd
    gguf = a.path.endswith(".gguf")   # ComfyUI-GGUF's Unet Loader (GGUF) stands in for Load Diffusion Model
    if gguf:
        from gguf_model import load_pack, load_stock_gguf
        load_pack()
        if cfg.kind in ("floor", "diffusers"):
            raise SystemExit(f"{cfg.kind} does not read .gguf files")
    if cfg.kind in ("loader", "disk", "auto"):
        from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
        from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
        home = {"disk": "disk", "auto": "auto"}.get(cfg.kind, "ram")
        models = [as_sampled(load_swapped_model(a.path, SwapSettings(a.window, 1, "auto", compress=a.compress), home=home,
                                                disk_workers=a.workers), a) for _ in range(a.experts)]
        return (models, "experts", models[0]) if a.experts > 1 else (models[0], "sample", models[0])
    stock = load_stock_gguf(a.path) if gguf else comfy.sd.load_diffusion_model(a.path)
    if cfg.kind == "comfy":
        stock = as_sampled(stock, a)
        return stock, "sample", stock
    if cfg.kind == "patch":
        from ringswap.nodes.patch import RingSwapPatch
        (model,) = RingSwapPatch().patch(stock, a.window, 1, "auto", compress=a.compress)
        model = as_sampled(model, a)
        return model, "sample", model
    dm = stock.model.diffusion_model
    if cfg.kind == "floor":
        dm.to(dev)
    else:
        from diffusers.hooks import apply_group_offloading
        # a copy stream needs CUDA; on the CPU (smoke runs) the same hooks without one
        apply_group_offloading(dm, onload_device=dev, offload_device=torch.device("cpu"),
                               offload_type="block_level", num_blocks_per_group=1,
                               use_stream=dev.type == "cuda")
    common.sync(dev)
    return dm, "direct", stock


def time_steps(obj, how: str, patcher, tokens: int, n: int, a, dev: torch.device) -> list[float]:
    """`n` steps at `tokens` and cfg `a.cfg`: ComfyUI's sampling path, or direct forwards of
    the module (at cfg > 1 one forward of cond and uncond batched, the floor of a step)."""
    if how == "sample":
        return common.sample_steps(obj, tokens, n, a.ctx_len, cfg=a.cfg)
    if how == "experts":
        return expert_steps(obj, tokens, n, a.ctx_len, a.cfg)
    inputs = common.make_inputs(tokens, dev, common.compute_dtype(patcher, dev), a.ctx_len, 0,
                                batch=1 if a.cfg == 1 else 2)
    return common.step_times(obj, inputs, n, dev)


def prompt_figures(times: list[float], load_s: float | None) -> dict:
    """One prompt's figures from its per-step times (times[0]: from the sampling call to the end
    of step 1, the device synchronised): s/step, the mean of steps 2..N; TTFS, the node's load
    `load_s` (the Load Diffusion Model / RingSwap node calls timed by child(), where this prompt
    paid it, else None) plus times[0]; the prompt's wall, TTFS plus steps 2..N."""
    ttfs = (load_s or 0.0) + times[0]
    return {"first_step_s": times[0], "steps": times, "s_per_step": common.steady_s(times) or times[0],
            "ttfs_s": ttfs, "ttfs_load": load_s is not None, "first_prompt_s": ttfs + sum(times[1:]),
            "prompt_steps": len(times)}


def timed_prompts(obj, how: str, patcher, tokens: int, n: int, a, dev: torch.device, load_s: float | None) -> dict:
    """A workload's prompt of `n` steps and its figures (prompt_figures); two experts: the first
    prompt (loading both) gives TTFS and its wall, the next one (switching) the steps."""
    times = time_steps(obj, how, patcher, tokens, n, a, dev)
    row = prompt_figures(times, load_s)
    if how == "experts":
        again = time_steps(obj, how, patcher, tokens, n, a, dev)
        row.update(first_prompt_steps=times, first_prompt_switch_s=times[n // 2], first_step_s=again[0],
                   steps=again, s_per_step=common.steady_s(again) or again[0])
    return row


def expert_steps(models: list, tokens: int, steps: int, ctx_len: int, cfg: float) -> list[float]:
    """Seconds per step, Wan 2.2 style: models[0] samples the first half of the steps and
    models[1] the rest from its latent (comfy.sample.sample's last_step / start_step, as
    KSamplerAdvanced does); the device is synchronised at every step."""
    import comfy.sample
    f, h, w = common.latent_shape(tokens)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 16, f, h, w, generator=g)
    cond = [[torch.randn(1, ctx_len, 4096, generator=g), {}]]
    uncond = [[torch.randn(1, ctx_len, 4096, generator=g), {}]]
    dev = models[0].load_device
    stamps = [time.perf_counter()]

    def step_done(*_) -> None:
        common.sync(dev)
        stamps.append(time.perf_counter())
    half = steps // 2
    mid = comfy.sample.sample(models[0], noise, steps, cfg, "euler", "simple", cond, uncond, torch.zeros_like(noise),
                              last_step=half, force_full_denoise=False, callback=step_done, disable_pbar=True, seed=0)
    comfy.sample.sample(models[1], noise, steps, cfg, "euler", "simple", cond, uncond, mid, start_step=half,
                        disable_noise=True, callback=step_done, disable_pbar=True, seed=0)
    return [b - a_ for a_, b in zip(stamps, stamps[1:])]


def keep_run_stats(patchers: list) -> list:
    """RingSwap's per-run stats (bytes copied and read, copy rate) as each of `patchers`
    closes a sampling run, in one list; empty for other patchers."""
    runs: list = []
    for engine in {id(e): e for e in (getattr(p, "swap_engine", None) for p in patchers) if e is not None}.values():
        end_run = engine.end_run

        def keep(end_run=end_run):
            st = end_run()
            if st is not None:
                runs.append(st)
            return st

        engine.end_run = keep
    return runs


def memory_after(sampler, vram0: int | None, dev: torch.device) -> dict:
    """A workload's host and device memory: steady and peak RSS, pinned bytes, VRAM peaks, and
    on CUDA the caching allocator's retries (it freeing its cache to retry: a device sync each)."""
    out = {"rss_steady": common.rss_bytes(), "rss_steady_parts": rss_parts(), "rss_peak": sampler.peak,
           "pinned": common.pinned_bytes(), "vram_peak": None if vram0 is None else sampler.vram_peak - vram0,
           "vram_torch_peak": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}
    if dev.type == "cuda":
        mem = torch.cuda.memory_stats(dev)
        out.update(alloc_retries=mem.get("num_alloc_retries", 0), device_allocs=mem.get("num_device_alloc", 0))
    return out


def run_figures(done: list, n_steps: int) -> dict:
    """What the engine's run stats of one workload (two experts: one each) say per step."""
    calls = sum(st.calls for st in done)
    copied, copy_s = sum(st.bytes_copied for st in done), sum(st.copy_s for st in done)
    return {"stats_line": " | ".join(st.line() for st in done), "calls": calls, "calls_per_step": calls / n_steps,
            "h2d_bytes_per_step": copied / n_steps, "copy_gbps": copied / copy_s / 1e9 if copy_s else 0.0,
            "read_bytes_per_step": sum(st.bytes_read for st in done) / n_steps}


def expert_figures(times: list[float], experts: list, n_steps: int) -> dict:
    """The next prompt of two experts (n_steps, half each): each expert's first step switches;
    s/step is the mean of the others."""
    half = n_steps // 2
    rest = times[1:half] + times[half + 1:]
    return {"s_per_step": sum(rest) / len(rest) if rest else None, "switch_step_s": max(times[0], times[half]),
            "expert_pinned": [m.swap_engine.pool.pinned_bytes for m in experts],
            "expert_attached": [m.swap_engine.att is not None for m in experts]}


def cold_for_disk(cfg: Config, a) -> None:
    """home=disk reads from a cold file: the page cache dropped (before the load and before each
    workload); other kinds: nothing (compare.py set the cache up before the process)."""
    if cfg.kind == "disk":
        from io_rates import drop_page_cache
        drop_page_cache(a.path, "auto")


def child(a) -> dict:
    """Measure configuration `a.child` at every workload in `a.tokens` (--workflow: the Wan 2.2
    recipe as users run it, compare_workflow.py)."""
    if getattr(a, "workflow", False):
        from compare_workflow import workflow_child
        return workflow_child(a)
    cfg = CONFIGS[a.child]
    mm = start_comfy(cfg, a.device)
    log = comfy_start.RingSwapLines()
    dev = mm.get_torch_device()
    warm_cuda_libraries(dev)
    vram0 = common.device_used_bytes()
    rss0, parts0 = common.rss_bytes(), rss_parts()
    sampler = common.RssSampler(0.05, vram=True).start()
    cold_for_disk(cfg, a)   # before the clock: the drop is not the load's time
    t0 = time.perf_counter()
    obj, how, patcher = build(cfg, a, dev)
    out = {"config": a.child, "kind": cfg.kind, "comfy": cfg.comfy, "dynamic_vram": cfg.dynamic,
           "patcher": type(patcher).__name__, "load_s": time.perf_counter() - t0, "rss_base": rss0,
           "rss_base_parts": parts0, "rss_after_load": common.rss_bytes(), "rss_after_load_parts": rss_parts(),
           "file_bytes": os.path.getsize(a.path),
           "env": common.env_info(dev), "rows": []}
    n = 1 + a.disk_steps if cfg.kind == "disk" else a.prompt_steps
    runs = keep_run_stats(obj if how == "experts" else [patcher])
    for tokens in a.tokens:
        cold_for_disk(cfg, a)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        sampler.vram_peak = common.device_used_bytes()
        rss_peak_before, sampler.peak = sampler.peak, common.rss_bytes()
        row = {"tokens": tokens}
        seen = len(log.lines)
        try:   # the first workload pays the node's load
            row.update(timed_prompts(obj, how, patcher, tokens, n, a, dev, None if out["rows"] else out["load_s"]))
        except torch.OutOfMemoryError as e:
            row["error"] = "out of memory: " + str(e).splitlines()[0][:200]
        row.update(memory_after(sampler, vram0, dev))
        sampler.peak = max(sampler.peak, rss_peak_before)
        engine = getattr(patcher, "swap_engine", None)
        if engine is not None and engine.plan is not None:
            row["plan"] = engine.plan.describe()
        if runs:   # this workload's run (two experts: one each)
            row.update(run_figures(runs[-2:] if how == "experts" else runs[-1:], n))
            runs.clear()
        row["log"], seen = log.lines[seen:], len(log.lines)
        if how == "experts" and "error" not in row:
            row.update(expert_figures(row["steps"], obj, n))
        if a.rerun and "error" not in row:   # the next prompt at this size: its first step
            again = time_steps(obj, how, patcher, tokens, 1 + a.rerun_steps, a, dev)
            row.update(rerun_first_step_s=again[0], rerun_step_s=common.steady_s(again), rerun_log=log.lines[seen:])
            runs.clear()
        out["rows"].append(row)
        common.say(f"[compare] {a.child} {tokens} tokens: {common.fmt_num(row.get('s_per_step'), '.3f')} s/step, "
                   f"TTFS {common.fmt_num(row.get('ttfs_s'), '.2f')} s {row.get('error', '')}")
    out["rss_peak"] = sampler.stop()
    if cfg.kind == "diffusers":
        import diffusers
        out["diffusers"] = diffusers.__version__
    return out
