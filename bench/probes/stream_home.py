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


class HomeRun:
    """One format and home of stream.py: load the file with RingSwap's Model Loader, time steps
    at each token count, unload; each row goes to `rows` (and --json through `save`) as measured."""

    def __init__(self, fmt: str, home: str, info: dict, a, dev: torch.device, mm, budget: Budget,
                 rows: list, skipped: list, save):
        self.fmt, self.home, self.info, self.a, self.dev, self.mm = fmt, home, info, a, dev, mm
        self.budget, self.rows, self.skipped, self.save = budget, rows, skipped, save
        self.is_disk = home == "disk"
        self.tag = f"{fmt} home={home}"
        self.patcher = None
        self.sampler = RssSampler()
        self.load_bytes = 0

    def tokens_s(self, tok: int, streamed_bytes: int) -> float:
        b = self.budget
        return b.disk_tokens(tok, streamed_bytes) if self.is_disk else b.ram_tokens(tok, streamed_bytes)

    def skip(self, msg: str, **where) -> None:
        say(msg)
        self.skipped.append({"format": self.fmt, "home": self.home, **where, "reason": msg})

    def fits(self) -> bool:
        """Whether the load and the first token count fit the time left."""
        a, info, budget = self.a, self.info, self.budget
        resident, streamed = plan_counts(info["blocks"], a.window, a.prefetch)
        streamed_bytes = streamed * info["block_bytes"]
        load_est = (budget.disk_load(resident, info["block_bytes"]) if self.is_disk
                    else budget.ram_load(info["bytes"], streamed_bytes))
        first_tok_est = min(self.tokens_s(t, streamed_bytes) for t in a.tokens)
        if load_est + first_tok_est > budget.deadline_left():
            self.skip(f"SKIP {self.tag}: load ~{load_est:.0f} s + a step set ~{first_tok_est:.0f} s "
                      f"> {budget.deadline_left():.0f} s left of --budget-s {a.budget_s:.0f}")
            return False
        return True

    def load(self) -> None:
        """Drop the page cache, load the file and attach it; `base`: what every row of it shares."""
        from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
        from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
        a, dev, path = self.a, self.dev, self.info["path"]
        method = drop_page_cache(path, a.drop)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        rss0 = rss_bytes()
        self.sampler.start()
        t0 = time.perf_counter()
        self.patcher = load_swapped_model(path, SwapSettings(a.window, a.prefetch, a.pin), home=self.home,
                                          disk_workers=a.workers)
        load_s = self.load_s = time.perf_counter() - t0
        engine = self.engine = self.patcher.swap_engine
        self.reader = engine.read_block.__self__.reader
        load_bytes = self.load_bytes = self.reader.bytes_read
        rss_loaded = rss_bytes()
        t0 = time.perf_counter()
        self.mm.load_models_gpu([self.patcher])
        attach_s = time.perf_counter() - t0
        plan = self.plan = engine.plan
        self.streamed_bytes = sum(engine.states[i].layout.nbytes for i in plan.streamed)
        self.dm = self.patcher.model.diffusion_model
        dtype = self.dtype = compute_dtype(self.patcher, dev)
        self.base = {"format": self.fmt, "home": self.home, "window": a.window, "prefetch": a.prefetch,
                     "pin": a.pin, "workers": a.workers, "memory": engine.memory, "plan": plan.describe(),
                     "block_bytes": engine.block_bytes(), "streamed_bytes_per_step": self.streamed_bytes,
                     "file_bytes": self.info["bytes"], "compute_dtype": str(dtype), "load_s": load_s,
                     "load_bytes_read": load_bytes, "load_gbps": gb(load_bytes) / load_s if load_bytes else None,
                     "attach_s": attach_s, "load_cache_drop": method, "rss_before_load": rss0,
                     "rss_after_load": rss_loaded,
                     "gpu_allocated_after_attach": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None}
        if self.is_disk:
            self.disk_now()
        say(f"  {self.tag}: loaded in {load_s:.1f} s"
            + (f" ({gb(load_bytes):.2f} GB read, {gb(load_bytes) / load_s:.2f} GB/s, after {method})"
               if load_bytes else f" (no block read, after {method})")
            + f"; load_models_gpu {attach_s:.1f} s: {plan.describe()}, {engine.memory} memory; "
            f"RSS {gb(rss0):.1f} -> {gb(rss_loaded):.1f} GB; compute dtype {dtype}")

    def disk_now(self) -> None:
        """home=disk: the RAM bound, and the disk's own rate now, next to the rows (a rate taken
        right after writing the file can come from a host-side cache of a virtual disk): 1 and
        `workers` threads."""
        a, path = self.a, self.info["path"]
        self.base["rss_bound_bytes"] = (a.window + a.prefetch + a.workers) * self.engine.block_bytes()
        self.base["odirect_now"] = [odirect_rate(path, int(a.odirect_gb * 1e9), not a.no_odirect, a.drop, t)
                                    for t in sorted({1, a.workers})]
        for od in self.base["odirect_now"]:
            say(f"  {self.fmt} home=disk: disk read now, {od['mode']}: {gb(od['bytes']):.2f} GB in "
                f"{od['seconds']:.1f} s = {od['gbps']:.2f} GB/s")

    def warm_up(self, tok: int, inputs) -> tuple[list, int]:
        """The warm-up steps, and how many steps to time after them: fewer where the warm-up
        was slower than estimated, never none."""
        a = self.a
        steps, warm = (a.disk_steps, a.disk_warmup) if self.is_disk else (a.steps, a.warmup)
        self.engine.end_run()
        warm_times = step_times(self.dm, inputs, warm, self.dev)
        self.engine.end_run()
        n_steps = steps
        if warm_times and n_steps > 1:
            fit = int(self.budget.deadline_left() // max(warm_times))
            if fit < n_steps:
                n_steps = max(1, fit)
                say(f"  {self.tag} tokens={tok}: warm-up took {max(warm_times):.1f} s; "
                    f"timing {n_steps} step(s) instead of {steps} to stay within --budget-s")
        return warm_times, n_steps

    def measure(self, tok: int) -> None:
        """Time the steps at `tok` tokens; the row goes to `rows`."""
        a, dev, engine, reader, is_disk = self.a, self.dev, self.engine, self.reader, self.is_disk
        inputs = make_inputs(tok, dev, self.dtype, a.ctx_len, a.seed)
        drop = drop_page_cache(self.info["path"], a.drop) if is_disk else None
        warm_times, n_steps = self.warm_up(tok, inputs)
        r0, rs0 = reader.bytes_read, reader.read_seconds
        times = step_times(self.dm, inputs, n_steps, dev)
        st = engine.end_run()
        r1, rs1 = reader.bytes_read, reader.read_seconds
        wall = sum(times)
        row = dict(self.base, tokens=tok, steps=n_steps, warmup=a.disk_warmup if is_disk else a.warmup,
                   median_s=statistics.median(times),
                   times=times, warmup_times=warm_times, cache_drop=drop,
                   copies=st.copies, bytes_copied=st.bytes_copied, copy_s=st.copy_s, wait_s=st.wait_s,
                   copy_gbps=st.gbps, h2d_gbps=gb(st.bytes_copied) / wall,
                   stats_bytes_read=st.bytes_read, read_wait_s=st.read_wait_s,
                   reader_bytes=r1 - r0, reader_thread_s=rs1 - rs0,
                   read_gbps=gb(r1 - r0) / wall if is_disk else None,
                   rss_peak=self.sampler.peak, vmhwm=vmhwm_bytes(),
                   gpu_peak_allocated=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                   stats_line=st.line())
        if is_disk and row["read_gbps"]:
            # steady state: a step reads its streamed blocks' file bytes at the achieved rate
            row["disk_bound_s_per_step"] = gb(len(self.plan.streamed) * self.info["block_bytes"]) / row["read_gbps"]
        self.rows.append(row)
        self.save()
        extra = (f"read {gb(r1 - r0):.2f} GB at {row['read_gbps']:.2f} GB/s (waited {st.read_wait_s:.1f} s)"
                 if is_disk else f"host->GPU {row['h2d_gbps']:.1f} GB/s per step wall")
        say(f"  {self.tag} tokens={tok}: {row['median_s']:.3f} s/step "
            f"{['%.3f' % x for x in times]} (warm-up {['%.3f' % x for x in warm_times]}); "
            f"copy {st.gbps:.1f} GB/s; {extra}; RSS peak {gb(self.sampler.peak):.1f} GB")
        if is_disk and row["read_gbps"]:
            self.budget.rates["disk_gbps"] = min(self.budget.rates["disk_gbps"], row["read_gbps"] / 0.9)

    def tokens(self, tok: int) -> None:
        """One token count, where it fits the time left; a failure (e.g. out of memory) is a row."""
        est = self.tokens_s(tok, self.streamed_bytes)
        if est > self.budget.deadline_left():
            self.skip(f"SKIP {self.tag} tokens={tok}: ~{est:.0f} s > {self.budget.deadline_left():.0f} s "
                      f"left of --budget-s {self.a.budget_s:.0f}", tokens=tok)
            return
        try:
            self.measure(tok)
            return
        except Exception as e:   # noqa: BLE001
            import traceback
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            say(f"  {self.tag} tokens={tok}: FAILED: {msg}")
            self.rows.append({"format": self.fmt, "home": self.home, "tokens": tok, "error": msg})
        self.engine.end_run()   # out of the except: its traceback (and the inputs) let go first
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def finish(self) -> None:
        """Unload; every row of this format and home gets the RSS peak and what is left after."""
        self.sampler.stop()
        try:
            unload(self.mm, self.patcher, self.dev)
        except Exception as e:   # noqa: BLE001
            say(f"  {self.tag}: unload failed: {type(e).__name__}: {e}")
        self.patcher = None
        gc.collect()
        rss_after = rss_bytes()
        for r in self.rows:
            if r.get("format") == self.fmt and r.get("home") == self.home and "tokens" in r:
                r["rss_peak_config"] = self.sampler.peak
                r["rss_after_unload"] = rss_after
        say(f"  {self.tag}: unloaded; RSS {gb(rss_after):.1f} GB, VmHWM {gb(vmhwm_bytes() or 0):.1f} GB")


def run_home(fmt: str, home: str, info: dict, a, dev: torch.device, mm, budget: Budget,
             rows: list, skipped: list, save=lambda: None) -> None:
    """Measure one format at one home (HomeRun), within the time left."""
    run = HomeRun(fmt, home, info, a, dev, mm, budget, rows, skipped, save)
    if not run.fits():
        return
    try:
        run.load()
        for tok in a.tokens:
            run.tokens(tok)
        if not run.is_disk and run.load_bytes:
            budget.rates["cold_gbps"] = gb(run.load_bytes) / run.load_s
        if not run.is_disk and a.ram_target_tokens in a.tokens:
            compute_only(run.patcher, fmt, a, dev, mm, rows, budget)
    except Exception as e:   # noqa: BLE001
        import traceback
        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        say(f"  {fmt} home={home}: FAILED: {msg}")
        rows.append({"format": fmt, "home": home, "error": msg})
    finally:
        run.finish()
