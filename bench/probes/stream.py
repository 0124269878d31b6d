"""Streaming Wan-14B-shaped models from safetensors files: step time, disk read rate, host RAM (H200).

Issue 3's benchmark. For each format in --formats (default bf16, scaled_fp8, nvfp4):
  1. write a Wan 2.1 14B t2v-shaped diffusion-model file (40 blocks, dim 5120, ffn 13824,
     40 heads; the keys of ComfyUI's WanModel state dict; random weights, std 0.02, norm
     weights around 1) in the on-disk conventions of tests/comfyui/support/quant_files.py. The
     weights are generated on the GPU block by block and written at their offsets of a
     header computed up front (tensor order as safetensors' save_file would use: dtype,
     then name), so the whole model is never in RAM; safetensors.safe_open checks it;
  2. measure the disk's own rate: O_DIRECT sequential 4 MiB reads of the file;
  3. drop the page cache (drop_caches as root, else posix_fadvise DONTNEED on the file)
     before every load and before every home=disk measurement;
  4. load it with RingSwap's loader (`load_swapped_model`), home=ram and home=disk,
     window --window, prefetch 1, pin auto, --workers read threads, and time steps at
     each token count (one step = one forward of the diffusion model). Reported: median
     s/step, the run's copy GB/s, for disk the achieved read GB/s against the O_DIRECT
     rate, for ram the achieved host->GPU rate (bytes copied per step / step time)
     against a measured pinned host->GPU rate, the host RAM high-water mark (VmHWM, and
     the peak RSS sampled during each configuration), load time and GB/s;
  5. delete the file (unless --keep) before the next format.
Issue-3 targets (PASS/FAIL): disk reads >= 85% of the O_DIRECT rate; home=ram at 4,096
tokens >= 85% of the pinned host->GPU rate. Everything goes to --json as well.

Usage (repo root; on the GPU machine after `source scripts/device_setup.sh`):
    python3 bench/probes/stream.py --json $OUT/stream.json
Runs here on a CPU with tiny shapes (all code paths, meaningless numbers):
    .venv/bin/python bench/probes/stream.py --device cpu --small
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # bench/probes/ (stream_*.py) and bench/ (common and its support)
from common import COMFY, REPO, T0, env_info, gb, latent_shape, say, write_json  # noqa: E402
from io_rates import h2d_rate, odirect_rate  # noqa: E402
from model_file import (estimate_file, existing_file_ok, file_signature, install_nvfp4_fallback,  # noqa: E402
                        wan_template, write_model)
from stream_budget import Budget  # noqa: E402
from stream_home import plan_counts, run_home  # noqa: E402
from stream_report import judge, report  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """stream.py's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes for a CPU check of every code path (4 blocks, dim 256, ffn 512, tokens 64, "
                         "window 2, 2 workers)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "scaled_fp8", "nvfp4"])
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 32760 4096 (--small: 64)")
    ap.add_argument("--homes", nargs="+", default=["ram", "disk"], choices=["ram", "disk"])
    ap.add_argument("--window", type=int, default=None, help="default 4 (--small: 2)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--pin", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--workers", type=int, default=None, help="disk_workers; default 8 (--small: 2)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps, home=ram")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps, home=ram")
    ap.add_argument("--disk-steps", type=int, default=1, help="timed steps, home=disk")
    ap.add_argument("--disk-warmup", type=int, default=0, help="warm-up steps, home=disk")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--ctx-len", type=int, default=None, help="text tokens; default 512 (--small: 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/ringswap_bench")
    ap.add_argument("--keep", action="store_true", help="keep the model files (reused by a later run)")
    ap.add_argument("--no-reuse", action="store_true", help="rewrite files even if a matching one is in --dir")
    ap.add_argument("--max-files-gb", type=float, default=45.0, help="cap on model files on disk at once")
    ap.add_argument("--free-margin-gb", type=float, default=3.0, help="disk space to leave free")
    ap.add_argument("--odirect-gb", type=float, default=None,
                    help="GB of the file read for the O_DIRECT rate; 0 = all; default 4 (--small: 0)")
    ap.add_argument("--no-odirect", action="store_true", help="measure the disk with buffered reads")
    ap.add_argument("--drop", default="auto", choices=["auto", "root", "fadvise"],
                    help="page-cache drop: drop_caches if writable (auto) / required (root), or fadvise only")
    ap.add_argument("--h2d-mib", type=int, default=None, help="pinned copy size for the link rate; default 1024")
    ap.add_argument("--ram-target-tokens", type=int, default=None,
                    help="token count of the home=ram link-rate target; default 4096 (--small: smallest)")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, then stop")
    return ap


def defaults(a) -> None:
    """The sizes and counts left open: the full Wan-14B shape, or tiny ones with --small."""
    small = a.small
    a.layers = a.layers or (4 if small else 40)
    a.dim = a.dim or (256 if small else 5120)
    a.ffn = a.ffn or (512 if small else 13824)
    a.tokens = a.tokens or ([64] if small else [32760, 4096])
    a.window = a.window or (2 if small else 4)
    a.workers = a.workers or (2 if small else 8)
    a.ctx_len = a.ctx_len or (16 if small else 512)
    a.odirect_gb = a.odirect_gb if a.odirect_gb is not None else (0.0 if small else 4.0)
    a.h2d_mib = a.h2d_mib or (64 if small else 1024)
    a.ram_target_tokens = a.ram_target_tokens or (min(a.tokens) if small else 4096)
    for t in a.tokens:
        latent_shape(t)
    if a.dim % 128:
        raise SystemExit("--dim must be a multiple of 128 (ComfyUI derives num_heads = dim // 128)")


def setup(a):
    """ComfyUI on the device asked for, this repo linked as its custom node; (mm, quant_files, device)."""
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (use --device cpu --small here)")
    if a.device == "cpu":
        from comfy.cli_args import args as comfy_args
        comfy_args.cpu = True
    link = os.path.join(COMFY, "custom_nodes", "ringswap")
    if not os.path.exists(link):
        os.symlink(REPO, link)
    import comfy.model_management as mm
    import quant_files as qf

    for f in a.formats:
        if f not in qf.FORMATS:
            raise SystemExit(f"unknown format {f!r}; expected some of {qf.FORMATS}")
    install_nvfp4_fallback(qf)
    dev = mm.get_torch_device()
    if dev.type != a.device:
        raise SystemExit(f"ComfyUI chose {dev}, asked for {a.device}")
    return mm, qf, dev


def estimate(a, template, budget: Budget, qf, dev: torch.device) -> None:
    """Say up front how long each format's parts should take (reference rates)."""
    resident, streamed = plan_counts(a.layers, a.window, a.prefetch)
    say(f"plan: {resident} resident + {streamed} streamed blocks per step")
    est_total = 0.0
    say("estimated time (H200 reference rates: write 1.0, O_DIRECT 1.0, cold read 1.4, pinning 1.4, "
        "link 51.7 GB/s; bf16 compute" + ("; meaningless on CPU)" if dev.type == "cpu" else ")"))
    for fmt in a.formats:
        total, blk = estimate_file(fmt, template, qf)
        parts = {"write": budget.write(total), "odirect": budget.odirect(total)}
        if "ram" in a.homes:
            parts["ram"] = budget.ram_load(total, streamed * blk) + sum(
                budget.ram_tokens(t, streamed * blk) for t in a.tokens)
        if "disk" in a.homes:
            parts["disk"] = budget.disk_load(resident, blk) + sum(
                budget.disk_tokens(t, streamed * blk) for t in a.tokens)
        s = sum(parts.values())
        est_total += s
        say(f"  {fmt:>10}: file ~{gb(total):.1f} GB (block {gb(blk):.3f} GB): "
            + ", ".join(f"{k} {v:.0f} s" for k, v in parts.items()) + f" = {s:.0f} s")
    say(f"  total ~{est_total:.0f} s against --budget-s {a.budget_s:.0f}"
        + (" (configurations that would overrun are skipped)" if est_total > a.budget_s else ""))


class StreamRun:
    """The formats of one stream.py run: each one's file written (or reused), the disk's rate,
    then each home measured; everything measured so far in --json after every measurement."""

    def __init__(self, a, env: dict, h2d: dict, mm, qf, dev: torch.device, template, budget: Budget):
        self.a, self.env, self.h2d, self.mm, self.qf, self.dev = a, env, h2d, mm, qf, dev
        self.template, self.budget = template, budget
        self.files, self.rows, self.skipped, self.kept, self.targets = {}, [], [], [], []

    def save(self) -> None:
        """Write --json now (again after every measurement: a run killed at its time limit
        keeps what it measured)."""
        write_json(self.a.json, {"env": self.env, "args": vars(self.a), "h2d": self.h2d, "files": self.files,
                                 "rows": self.rows, "skipped": self.skipped, "targets": self.targets,
                                 "elapsed_s": time.perf_counter() - T0})

    def _skip(self, msg: str, fmt: str) -> None:
        say(msg)
        self.skipped.append({"format": fmt, "reason": msg})

    def room_for(self, fmt: str, path: str, reuse: bool) -> bool:
        """Whether `fmt`'s file may be written: within --max-files-gb and the time left."""
        a, budget = self.a, self.budget
        if reuse:
            return True
        if os.path.exists(path):
            os.remove(path)
        total_est, _ = estimate_file(fmt, self.template, self.qf)
        on_disk = sum(os.path.getsize(p) for p in self.kept if os.path.exists(p))
        if on_disk + total_est > a.max_files_gb * 1e9:
            self._skip(f"SKIP {fmt}: {gb(total_est):.1f} GB more would put {gb(on_disk + total_est):.1f} GB "
                       f"of model files on disk (--max-files-gb {a.max_files_gb:.0f}; drop --keep)", fmt)
            return False
        need = budget.write(total_est) + budget.odirect(total_est)
        if need > budget.deadline_left():
            self._skip(f"SKIP {fmt}: writing + O_DIRECT ~{need:.0f} s > {budget.deadline_left():.0f} s left "
                       f"of --budget-s {a.budget_s:.0f}", fmt)
            return False
        return True

    def file_info(self, fmt: str, path: str, reuse: bool) -> dict:
        """The file of `fmt`: reused from an earlier run, or written now."""
        a = self.a
        if not reuse:
            info = write_model(path, fmt, a, self.dev, self.qf, self.template,
                               free_margin=int(a.free_margin_gb * 1e9))
            self.budget.rates["write_gbps"] = info["write_gbps"]
            return info
        from safetensors import safe_open
        with safe_open(path, framework="pt", device="cpu") as f:
            n = len(f.keys())
        total, blk = estimate_file(fmt, self.template, self.qf)
        info = {"path": path, "format": fmt, "bytes": os.path.getsize(path), "tensors": n,
                "blocks": a.layers, "block_bytes": blk, "reused": True}
        say(f"  {fmt}: reusing {path} ({gb(info['bytes']):.2f} GB, written by an earlier run)")
        return info

    def run_format(self, fmt: str) -> None:
        """One format: its file, the disk's O_DIRECT rate over it, then each home."""
        a = self.a
        path = os.path.join(a.dir, f"wan14b_shape_{fmt}.safetensors" if not a.small
                            else f"wan_small_{fmt}.safetensors")
        reuse = not a.no_reuse and existing_file_ok(path, file_signature(fmt, a))
        if not self.room_for(fmt, path, reuse):
            return
        say(f"== {fmt}")
        try:
            info = self.file_info(fmt, path, reuse)
            self.kept.append(path)
            self.files[fmt] = info
            od = odirect_rate(path, int(a.odirect_gb * 1e9), not a.no_odirect, a.drop)
            info["odirect"] = od
            if od["gbps"] > 0:
                self.budget.rates["disk_gbps"] = od["gbps"]
            say(f"  {fmt}: disk read {od['mode']}: {gb(od['bytes']):.2f} GB in {od['seconds']:.1f} s = "
                f"{od['gbps']:.2f} GB/s")
            self.save()
            for home in a.homes:
                run_home(fmt, home, info, a, self.dev, self.mm, self.budget, self.rows, self.skipped, self.save)
        except Exception as e:   # noqa: BLE001
            import traceback
            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            say(f"  {fmt}: FAILED: {msg}")
            self.files.setdefault(fmt, {})["error"] = msg
        finally:
            if not a.keep and os.path.exists(path):
                os.remove(path)
                say(f"  {fmt}: deleted {path}")

    def run(self) -> None:
        """Every format, then the files removed (unless --keep)."""
        a = self.a
        os.makedirs(a.dir, exist_ok=True)
        for name in os.listdir(a.dir):
            if name.endswith(".safetensors.tmp"):
                os.remove(os.path.join(a.dir, name))
        try:
            for fmt in a.formats:
                self.run_format(fmt)
        finally:
            if not a.keep:
                for p in self.kept:
                    if os.path.exists(p):
                        os.remove(p)
                try:
                    os.rmdir(a.dir)
                except OSError:
                    pass


def main() -> None:
    a = parser().parse_args()
    defaults(a)
    mm, qf, dev = setup(a)
    env = env_info(dev)
    say(f"stream.py on {env.get('gpu', 'CPU')}: torch {env['torch']}, ComfyUI {env.get('comfyui')}, "
        f"comfy-kitchen {env.get('comfy_kitchen')}, commit {env.get('commit')}; RAM {env.get('mem_total_gb', 0):.0f} GB")
    say(f"model: {a.layers} blocks, dim {a.dim}, ffn {a.ffn}, heads {a.dim // 128}; formats {a.formats}; "
        f"tokens {a.tokens}; homes {a.homes}; window {a.window}, prefetch {a.prefetch}, pin {a.pin}, "
        f"workers {a.workers}; ram {a.warmup}+{a.steps} steps, disk {a.disk_warmup}+{a.disk_steps} steps")
    template = wan_template(a.layers, a.dim, a.ffn)
    budget = Budget(a, a.layers)
    estimate(a, template, budget, qf, dev)
    if a.dry_run:
        return
    h2d = h2d_rate(dev, a.h2d_mib << 20)   # the link
    if dev.type == "cuda":
        budget.rates["link_gbps"] = h2d["gbps"]
    say(f"{'pinned host->GPU' if h2d['pinned'] else 'host copy (CPU)'}: {a.h2d_mib} MiB, median of 5: "
        f"{h2d['gbps']:.1f} GB/s")
    run = StreamRun(a, env, h2d, mm, qf, dev, template, budget)
    run.run()
    run.targets.extend(judge(run.rows, run.files, h2d, a))
    report(a, run.files, run.rows, run.skipped, run.targets, h2d)
    if a.json:
        run.save()
        say(f"wrote {a.json}")


if __name__ == "__main__":
    main()
