"""stream.py's measurement of one format and home: load a file with RingSwap's Model Loader
(home ram or disk), time steps at each token count, and for home=ram the all-resident
compute bound of the link-rate target's row."""
from __future__ import annotations

import gc
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # bench/probes/ (stream_*.py) and bench/ (common and its support)
from common import (RssSampler, compute_dtype, gb, make_inputs, rss_bytes, say, step_times, unload,  # noqa: E402
                    vmhwm_bytes)
from io_rates import drop_page_cache, odirect_rate  # noqa: E402
from stream_budget import Budget  # noqa: E402


def plan_counts(layers: int, window: int, prefetch: int) -> tuple[int, int]:
    """(resident, streamed) blocks, as swap.residency.ResidencyPlan decides."""
    from ringswap.swap.residency import ResidencyPlan
    p = ResidencyPlan.make(layers, window, prefetch)
    return len(p.resident), len(p.streamed)



def compute_only(patcher, fmt: str, a, dev: torch.device, mm, rows: list, budget: Budget) -> None:
    """The step time at the home=ram target's token count with every block resident (no
    streaming, where the device holds the model): the compute bound of that row. When it
    is longer than the copies of a step, the link cannot reach the pinned rate per step
    wall time however well the copies overlap."""
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
    row = next((r for r in rows if r.get("format") == fmt and r.get("home") == "ram"
                and r.get("tokens") == a.ram_target_tokens and "error" not in r), None)
    engine = patcher.swap_engine
    need = sum(engine.states[i].layout.nbytes for i in range(engine.num_blocks))
    if row is None or (dev.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(dev)[0]) \
            or 3 * row["median_s"] > budget.deadline_left():
        return
    mm.unload_all_models()
    full = SwapModelPatcher.wrap(patcher, SwapSettings(engine.num_blocks, 0, a.pin))
    mm.load_models_gpu([full])
    inputs = make_inputs(a.ram_target_tokens, dev, compute_dtype(full, dev), a.ctx_len, a.seed)
    step_times(full.model.diffusion_model, inputs, 1, dev)
    times = step_times(full.model.diffusion_model, inputs, max(1, a.steps), dev)
    engine.end_run()
    mm.unload_all_models()
    del full
    row["compute_only_s"] = statistics.median(times)
    say(f"  {fmt} home=ram tokens={a.ram_target_tokens}: every block resident (no streaming): "
        f"{row['compute_only_s']:.3f} s/step vs {row['median_s']:.3f} s streamed")


def compute_note(r: dict, h2d: dict) -> str:
    """What the compute bound of a home=ram row allows the link per step wall time."""
    c = r.get("compute_only_s")
    if not c:
        return ""
    ceiling = gb(r["bytes_copied"]) / r["steps"] / c / h2d["gbps"]   # a step's bytes in compute-only time
    return (f"; every block resident (no copies) {c:.3f} s/step, streamed {r['median_s']:.3f} s "
            f"(+{100 * (r['median_s'] / c - 1):.0f}%): with this compute the link can reach at most "
            f"{100 * min(1.0, ceiling):.0f}% of pinned per step wall")


def run_home(fmt: str, home: str, info: dict, a, dev: torch.device, mm, budget: Budget,
             rows: list, skipped: list, save=lambda: None) -> None:
    from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
    from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings

    path, total, block = info["path"], info["bytes"], info["block_bytes"]
    resident, streamed = plan_counts(info["blocks"], a.window, a.prefetch)
    streamed_bytes = streamed * block
    is_disk = home == "disk"
    load_est = budget.disk_load(resident, block) if is_disk else budget.ram_load(total, streamed_bytes)
    first_tok_est = min((budget.disk_tokens(t, streamed_bytes) if is_disk else budget.ram_tokens(t, streamed_bytes))
                        for t in a.tokens)
    if load_est + first_tok_est > budget.deadline_left():
        msg = (f"SKIP {fmt} home={home}: load ~{load_est:.0f} s + a step set ~{first_tok_est:.0f} s "
               f"> {budget.deadline_left():.0f} s left of --budget-s {a.budget_s:.0f}")
        say(msg)
        skipped.append({"format": fmt, "home": home, "reason": msg})
        return
    steps, warm = (a.disk_steps, a.disk_warmup) if is_disk else (a.steps, a.warmup)
    patcher = None
    sampler = RssSampler()
    try:
        method = drop_page_cache(path, a.drop)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        rss0 = rss_bytes()
        sampler.start()
        t0 = time.perf_counter()
        patcher = load_swapped_model(path, SwapSettings(a.window, a.prefetch, a.pin), home=home,
                                     disk_workers=a.workers)
        load_s = time.perf_counter() - t0
        engine = patcher.swap_engine
        reader = engine.read_block.__self__.reader
        load_bytes = reader.bytes_read
        rss_loaded = rss_bytes()
        t0 = time.perf_counter()
        mm.load_models_gpu([patcher])
        attach_s = time.perf_counter() - t0
        plan = engine.plan
        streamed_bytes = sum(engine.states[i].layout.nbytes for i in plan.streamed)
        dm = patcher.model.diffusion_model
        dtype = compute_dtype(patcher, dev)
        base = {"format": fmt, "home": home, "window": a.window, "prefetch": a.prefetch, "pin": a.pin,
                "workers": a.workers, "memory": engine.memory, "plan": plan.describe(),
                "block_bytes": engine.block_bytes(), "streamed_bytes_per_step": streamed_bytes,
                "file_bytes": total, "compute_dtype": str(dtype), "load_s": load_s,
                "load_bytes_read": load_bytes, "load_gbps": gb(load_bytes) / load_s if load_bytes else None,
                "attach_s": attach_s, "load_cache_drop": method, "rss_before_load": rss0,
                "rss_after_load": rss_loaded,
                "gpu_allocated_after_attach": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None}
        if is_disk:
            bound = (a.window + a.prefetch + a.workers) * engine.block_bytes()
            base["rss_bound_bytes"] = bound
            # the disk's own rate now, next to the rows (a rate taken right after writing the
            # file can come from a host-side cache of a virtual disk): 1 and `workers` threads
            base["odirect_now"] = [odirect_rate(path, int(a.odirect_gb * 1e9), not a.no_odirect, a.drop, t)
                                   for t in sorted({1, a.workers})]
            for od in base["odirect_now"]:
                say(f"  {fmt} home=disk: disk read now, {od['mode']}: {gb(od['bytes']):.2f} GB in "
                    f"{od['seconds']:.1f} s = {od['gbps']:.2f} GB/s")
        say(f"  {fmt} home={home}: loaded in {load_s:.1f} s"
            + (f" ({gb(load_bytes):.2f} GB read, {gb(load_bytes) / load_s:.2f} GB/s, after {method})"
               if load_bytes else f" (no block read, after {method})")
            + f"; load_models_gpu {attach_s:.1f} s: {plan.describe()}, {engine.memory} memory; "
            f"RSS {gb(rss0):.1f} -> {gb(rss_loaded):.1f} GB; compute dtype {dtype}")
        for tok in a.tokens:
            est = budget.disk_tokens(tok, streamed_bytes) if is_disk else budget.ram_tokens(tok, streamed_bytes)
            if est > budget.deadline_left():
                msg = (f"SKIP {fmt} home={home} tokens={tok}: ~{est:.0f} s > {budget.deadline_left():.0f} s "
                       f"left of --budget-s {a.budget_s:.0f}")
                say(msg)
                skipped.append({"format": fmt, "home": home, "tokens": tok, "reason": msg})
                continue
            try:
                inputs = make_inputs(tok, dev, dtype, a.ctx_len, a.seed)
                drop = drop_page_cache(path, a.drop) if is_disk else None
                engine.end_run()
                warm_times = step_times(dm, inputs, warm, dev)
                engine.end_run()
                n_steps = steps
                if warm_times and n_steps > 1:   # slower than estimated: fewer steps, never none
                    fit = int(budget.deadline_left() // max(warm_times))
                    if fit < n_steps:
                        n_steps = max(1, fit)
                        say(f"  {fmt} home={home} tokens={tok}: warm-up took {max(warm_times):.1f} s; "
                            f"timing {n_steps} step(s) instead of {steps} to stay within --budget-s")
                r0, rs0 = reader.bytes_read, reader.read_seconds
                times = step_times(dm, inputs, n_steps, dev)
                st = engine.end_run()
                r1, rs1 = reader.bytes_read, reader.read_seconds
                wall = sum(times)
                row = dict(base, tokens=tok, steps=n_steps, warmup=warm, median_s=statistics.median(times),
                           times=times, warmup_times=warm_times, cache_drop=drop,
                           copies=st.copies, bytes_copied=st.bytes_copied, copy_s=st.copy_s, wait_s=st.wait_s,
                           copy_gbps=st.gbps, h2d_gbps=gb(st.bytes_copied) / wall,
                           stats_bytes_read=st.bytes_read, read_wait_s=st.read_wait_s,
                           reader_bytes=r1 - r0, reader_thread_s=rs1 - rs0,
                           read_gbps=gb(r1 - r0) / wall if is_disk else None,
                           rss_peak=sampler.peak, vmhwm=vmhwm_bytes(),
                           gpu_peak_allocated=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                           stats_line=st.line())
                if is_disk and row["read_gbps"]:
                    # steady state: a step reads its streamed blocks' file bytes at the achieved rate
                    row["disk_bound_s_per_step"] = gb(len(plan.streamed) * block) / row["read_gbps"]
                rows.append(row)
                save()
                extra = (f"read {gb(r1 - r0):.2f} GB at {row['read_gbps']:.2f} GB/s (waited {st.read_wait_s:.1f} s)"
                         if is_disk else f"host->GPU {row['h2d_gbps']:.1f} GB/s per step wall")
                say(f"  {fmt} home={home} tokens={tok}: {row['median_s']:.3f} s/step "
                    f"{['%.3f' % x for x in times]} (warm-up {['%.3f' % x for x in warm_times]}); "
                    f"copy {st.gbps:.1f} GB/s; {extra}; RSS peak {gb(sampler.peak):.1f} GB")
                if is_disk and row["read_gbps"]:
                    budget.rates["disk_gbps"] = min(budget.rates["disk_gbps"], row["read_gbps"] / 0.9)
            except Exception as e:   # noqa: BLE001  (e.g. out of memory at one token count)
                import traceback
                traceback.print_exc()
                msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                say(f"  {fmt} home={home} tokens={tok}: FAILED: {msg}")
                rows.append({"format": fmt, "home": home, "tokens": tok, "error": msg})
                engine.end_run()
                inputs = None
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if not is_disk and load_bytes:
            budget.rates["cold_gbps"] = gb(load_bytes) / load_s
        if not is_disk and a.ram_target_tokens in a.tokens:
            compute_only(patcher, fmt, a, dev, mm, rows, budget)
    except Exception as e:   # noqa: BLE001
        import traceback
        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        say(f"  {fmt} home={home}: FAILED: {msg}")
        rows.append({"format": fmt, "home": home, "error": msg})
    finally:
        sampler.stop()
        try:
            unload(mm, patcher, dev)
        except Exception as e:   # noqa: BLE001
            say(f"  {fmt} home={home}: unload failed: {type(e).__name__}: {e}")
        patcher = None
        gc.collect()
        rss_after = rss_bytes()
        for r in rows:
            if r.get("format") == fmt and r.get("home") == home and "tokens" in r:
                r["rss_peak_config"] = sampler.peak
                r["rss_after_unload"] = rss_after
        say(f"  {fmt} home={home}: unloaded; RSS {gb(rss_after):.1f} GB, VmHWM {gb(vmhwm_bytes() or 0):.1f} GB")
