"""RingSwap against ComfyUI's own offloading (0.3.75, 0.33 with and without dynamic VRAM)
and diffusers' group offloading, side by side against the physical floor (issue 13).

One Wan-2.1-14B-shaped file per format (ComfyUI's WanModel: 40 blocks, dim 5120, ffn
13824; model_file.py's writer, random weights; bf16 and scaled fp8), written once per
machine into --dir. Each cell (format x configuration x cap) runs in its own process
(bench/compare_child.py) on the ComfyUI version the configuration names, behind a ballast
process started before it that holds all but `cap` GiB of the GPU's free memory; the
process measures every workload (--tokens, default 7,800 and 32,760) after one load, each as
one prompt of --prompt-steps steps (one sampling call): s/step (steps 2..N), the time to the
first step (TTFS: the first workload's includes the node's load) and the prompt's wall.
The disk cell also gets the disk's own O_DIRECT rate, measured right before it. Every other
cell starts from a warm file (read whole before it) or, with --cold, a dropped page cache;
the file's read rates (into pinned memory; --cold: O_DIRECT) are measured once per format
(compare_cache.py), the bounds TTFS is held to.

Cells run in priority order (per format: the uncapped baselines, then each cap in --caps
order, the disk cells last, since they drop the page cache); a cell whose estimated time
(compare_plan.py) does not fit the rest of --budget-s is listed as "not run (budget)". Under the table, one line
per RingSwap cell says which of the issue's targets it meets (compare_targets.py). The table (markdown)
and everything measured (JSON) are written after every cell; --merge joins the JSON of
several runs (e.g. several device calls) into one table. The process exits with status 8
(MISSED_EXIT) when a target line of the final report reads MISSED, 0 when none does.

    source scripts/device_setup.sh && python3 bench/compare.py --caps 24 --json $OUT/compare.json
    python3 bench/compare.py --merge a/compare.json b/compare.json --json all.json   # here, no GPU
Tiny CPU run of every configuration's code path (caps ignored; meaningless numbers, so target
lines read MISSED and it exits 8; --prompt-steps 3 makes it quicker):
    RINGSWAP_COMFYUI_DIR=$PWD/.comfyui .venv/bin/python bench/compare.py --small
--workflow: the workflow cell instead (issue 53, compare_workflow.py): the distilled Wan 2.2
recipe as users run it, two experts (two files of --layers blocks, seeds EXPERT_SEEDS) each
with a LoRA, first and next prompt, for ComfyUI alone and RingSwap; its own table and target
lines (compare_workflow_report.py); by default 32,760 tokens, 4 + 4 steps, cfg 1, 12 GiB,
halved link, rank 64, the configurations of compare_plan.WORKFLOW:
    RINGSWAP_COMFYUI_DIR=$PWD/.comfyui .venv/bin/python bench/compare.py --small --workflow
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402  (ComfyUI and tests/comfyui/support on sys.path)
from compare_child import CONFIGS, child  # noqa: E402
from link_load import LinkLoad  # noqa: E402
from ram_ballast import RamBallast, swapped_out_pages  # noqa: E402
from compare_table import rounds_joined, scenario, table  # noqa: E402
from compare_targets import missed, targets  # noqa: E402
import compare_cache  # noqa: E402
from compare_plan import (EXPERT_SEEDS, GROUPS, add_prompt_options, add_workflow_options, config_at,  # noqa: E402,F401
                          dry_run, estimate, plan_cells, prompt_steps, rates_s, workflow_defaults)
from compare_workflow_report import outputs, workflow_table, workflow_targets  # noqa: E402

# the exit status when a target line reads MISSED: apart from a crash (1), argparse (2), pytest's
# 0-5 and timeout's 124+ in device_run.sh's summary
MISSED_EXIT = 8


def runtime(a) -> str:
    """device: children source scripts/device_setup.sh; local: RINGSWAP_COMFYUI_DIR per version."""
    if a.runtime != "auto":
        return a.runtime
    return "device" if os.path.exists("/tmp/site/.ringswap-stamp") and os.path.exists(
        os.path.join(common.REPO, os.environ.get("RINGSWAP_WHEELS_DIR", ".whl"))) else "local"


def child_command(a, cell: dict, path: str, low: str | None = None) -> tuple[list[str], dict]:
    """The command and environment of one cell's process, on its ComfyUI version; a workflow
    cell's second expert is the file `low`, its latents go under the cell's --latent-dir."""
    cfg = CONFIGS[cell["config"]]
    # on the CPU a ballast holds nothing: RingSwap's cap is emulated by a window of 2 blocks
    window = 2 if a.small and cell["cap_gib"] else a.window
    opts = ["--child", cell["config"], "--path", path, "--window", str(window), "--cfg", str(cell.get("cfg", 1.0)),
            *common.child_args(a, ["device", "prompt_steps", "disk_steps", "workers", "ctx_len", "tokens", "rerun",
                                    "rerun_steps", "lora_rank", "compile", "experts", "compress", "workflow"])]
    if cell.get("workflow"):
        opts += ["--low-path", low or path, "--latent-dir", latent_dir(a, cell)]
    env = dict(os.environ, RINGSWAP_DYNAMIC_VRAM="1" if cfg.dynamic else "0", PYTHONUNBUFFERED="1")
    script = os.path.abspath(__file__)
    if os.environ.get("RINGSWAP_BENCH_PROFILE"):   # a folder: each cell's process under cProfile there
        out = os.path.join(os.environ["RINGSWAP_BENCH_PROFILE"], cell["config"].replace("@", "_") + ".prof")
        script = f"-m cProfile -o {out} {script}"
    elif os.environ.get("RINGSWAP_BENCH_TRACE"):   # a folder: each cell's timeline there (bench/probes/trace_calls.py)
        out = os.path.join(os.environ["RINGSWAP_BENCH_TRACE"], cell["config"].replace("@", "_") + ".txt")
        script = f"{os.path.join(os.path.dirname(script), 'probes', 'trace_calls.py')} {out} {script}"
    elif os.environ.get("RINGSWAP_BENCH_GPU"):   # a folder: each cell's GPU streams over time (bench/probes/gpu_timeline.py)
        out = os.path.join(os.environ["RINGSWAP_BENCH_GPU"], cell["config"].replace("@", "_") + "_gpu.txt")
        script = f"{os.path.join(os.path.dirname(script), 'probes', 'gpu_timeline.py')} {out} {script}"
    if runtime(a) == "device":
        setup = 'export RINGSWAP_COMFY="$1"; shift; source scripts/device_setup.sh >&2 && exec "$@"'
        return ["bash", "-c", setup, "_", cfg.comfy, "python3", *script.split(), *opts], env
    env["RINGSWAP_COMFYUI_DIR"] = a.comfy_033 if cfg.comfy == "0.33" else a.comfy_0375
    return [sys.executable, *script.split(), *opts], env


def latent_dir(a, cell: dict) -> str:
    """Where a workflow cell's process saves its final latents (one folder per run and cell)."""
    run = "".join(ch if ch.isalnum() else "_" for ch in str(cell.get("run", "")))
    name = "_".join(str(cell.get(k, "")) for k in ("format", "cfg", "link", "config", "cap_gib", "round"))
    return os.path.join(a.dir, "latents", run, "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in name))


def model_paths(a, fmt: str, workflow: bool) -> list[str]:
    """The cells' model file (a workflow cell: its two experts, one file each), written where missing."""
    from gguf_model import is_gguf_format, wan14b_gguf
    from model_file import wan14b_file
    if is_gguf_format(fmt):
        return [wan14b_gguf(a.dir, fmt, a.small, layers_small=4)]
    return [wan14b_file(a.dir, fmt, a.small, a.device, layers_small=4, layers=a.layers, seed=s)
            for s in (EXPERT_SEEDS if workflow else EXPERT_SEEDS[:1])]


def disk_rates(path: str, a) -> list[dict]:
    """The disk's own O_DIRECT rate over --odirect-gb of the file, after a cache drop, with
    one reader and with --workers readers."""
    from io_rates import odirect_rate
    return [odirect_rate(path, int(a.odirect_gb * 1e9), True, "auto", t) for t in sorted({1, a.workers})]


def run_cell(a, cell: dict, paths: list[str], deadline: float) -> dict:
    """One cell: ballast (cap) first, then its process; the result merged into `cell`. `paths`:
    its model file, or a workflow cell's two."""
    path = paths[0]
    if CONFIGS[cell["config"]].kind == "disk" or cell.get("ram_gb"):   # held to the disk's own rate
        cell["odirect"] = disk_rates(path, a)
        common.say("[compare] O_DIRECT: " + ", ".join(f"{o['gbps']:.2f} GB/s ({o['mode']})" for o in cell["odirect"]))
    cmd, env = child_command(a, cell, path, paths[-1])
    t0 = time.perf_counter()
    caches = []
    for p in paths:   # warm: each file read whole; --cold: the page cache dropped
        compare_cache.prepare(a, cell, p)
        caches.append(cell.get("page_cache"))
    if len(paths) > 1 and caches[0]:
        cell["page_cache"] = "; ".join(caches)
    halved = cell.get("link", "full") == "halved" and a.device == "cuda"
    if cell.get("ram_gb"):   # a smaller machine: cold page cache, all but ram_gb of the RAM locked away
        from io_rates import drop_page_cache
        cell["page_cache"] = drop_page_cache(path, "auto")
    swapped = swapped_out_pages()
    with LinkLoad(halved) as load, common.Ballast(cell["cap_gib"] if a.device == "cuda" else 0, a.device) as ballast, \
            RamBallast(cell.get("ram_gb", 0)) as ram:
        cell["ballast"] = ballast.line
        if ram.line:
            cell["ram_ballast"] = ram.line
            common.say(f"[compare] RAM ballast: {ram.line}")
        if halved:   # what the load leaves to the cell, measured beside it
            from io_rates import h2d_rate
            cell["h2d_left_gbps"] = h2d_rate(torch.device(a.device), 1024 << 20)["gbps"]
        timeout = max(10.0, min(a.cell_timeout_s, deadline - time.perf_counter()))
        res = common.child_result(cmd, timeout, env, cwd=common.REPO)
    if halved:
        cell["link_load"] = load.line
        common.say(f"[compare] {load.line}; {cell['h2d_left_gbps']:.1f} GB/s left to the cell")
    after = swapped_out_pages()
    cell["pages_swapped_out"] = None if swapped is None or after is None else after - swapped
    cell.update({k: v for k, v in res.items() if k not in ("config",)})
    cell["cell_wall_s"] = time.perf_counter() - t0
    return cell


def save(a, cells: list[dict], env: dict) -> tuple[str, list[str]]:
    """Write the report (the table, then one target line per RingSwap row) to --json and --md;
    return it and its target lines that read MISSED."""
    outputs(cells)   # the workflow cells' final latents against ComfyUI alone's
    joined = rounds_joined(cells)
    plain, flows = [c for c in joined if not c.get("workflow")], [c for c in joined if c.get("workflow")]
    out = compare_cache.header(joined)
    out += table(plain, small=a.small, link_gbps=env.get("h2d_gbps")) if plain or not flows else ""
    out += ("\n\n" if plain else "") + workflow_table(flows, a.small) if flows else ""
    judged = "\n".join(t for t in (targets(plain, env.get("h2d_gbps"), a.workers),
                                   workflow_targets(flows, env.get("h2d_gbps"))) if t)
    out += "\n\nTargets:\n" + judged if judged else ""
    common.write_json(a.json, {"env": env, "args": vars(a), "cells": cells, "table": out})
    if a.md:
        with open(a.md, "w") as f:
            f.write(out + "\n")
    return out, missed(judged)


def report(out: str, misses: list[str]) -> int:
    """Print the final report; the exit status: MISSED_EXIT where a target line reads MISSED."""
    print(out, flush=True)
    if not misses:
        return 0
    print(f"compare.py: {len(misses)} target line(s) MISSED, exit {MISSED_EXIT}:\n" + "\n".join(misses),
          file=sys.stderr, flush=True)
    return MISSED_EXIT


def merge(a) -> int:
    """Join the cells of several runs' JSON: a measured cell replaces one not run or failed."""
    cells: dict[tuple, dict] = {}
    env = {}
    for p in a.merge:
        with open(p) as f:
            data = json.load(f)
        env = data.get("env", env)
        for c in data["cells"]:
            key = scenario(c) + (c["config"], c["cap_gib"], c.get("round", 0))
            if key not in cells or "rows" in c or "rows" not in cells[key]:
                cells[key] = c
    return report(*save(a, list(cells.values()), env))


def parser() -> argparse.ArgumentParser:
    """compare.py's options."""
    ap = common.base_parser(__doc__, tuple(CONFIGS))
    ap.add_argument("--formats", nargs="+", default=None, choices=["bf16", "scaled_fp8", "fp32", "gguf_q8_0", "gguf_q4_k"],
                    help="default bf16 (--small: fp32, since 0.33's dynamic VRAM on a CPU runs bf16 weights uncast)")
    ap.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    ap.add_argument("--configs", nargs="+", metavar="NAME[@CAP]",
                    help=f"these instead of --groups ({', '.join(CONFIGS)}); @CAP: at that cap only")
    ap.add_argument("--caps", type=float, nargs="+", default=None, help="GiB left free; 0 = no cap; default 24 12")
    add_prompt_options(ap)
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every cell this many times, in whole rounds; the table shows each row's median")
    ap.add_argument("--rerun", action="store_true",
                    help="after each workload, one more run: the next prompt (load again, plan with what "
                         "the first run measured)")
    ap.add_argument("--rerun-steps", type=int, default=1, help="steps of the --rerun prompt after its first")
    ap.add_argument("--disk-steps", type=int, default=1,
                    help="home=disk cells: a prompt of 1 + this many steps (each reads the streamed blocks from disk)")
    ap.add_argument("--workers", type=int, default=8, help="disk_workers of the disk cells")
    ap.add_argument("--compress", choices=["off", "on", "auto"], default="off",
                    help="RingSwap's compress setting in its cells (on/auto need nvCOMP: carry .whl-nvcomp)")
    ap.add_argument("--window", type=int, default=0, help="RingSwap's window (0: auto, the configuration measured)")
    ap.add_argument("--cfgs", type=float, nargs="+", default=[1.0],
                    help="cfg of the sampling runs, one set of cells each (cfg > 1: cond + uncond a step)")
    ap.add_argument("--cfg", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--lora-rank", type=int, default=None,
                    help="a LoRA of this rank on every block linear, applied as LoraLoaderModelOnly does, "
                         "to the sampled configurations (0 = none; default 0, with --workflow 64)")
    ap.add_argument("--compile", default=None, metavar="BACKEND",
                    help="compile the sampled configurations as ComfyUI's TorchCompileModel does (e.g. inductor)")
    ap.add_argument("--rams", type=float, nargs="+", default=[0.0],
                    help="GB of RAM left to the cell by a RAM ballast process (bench/ram_ballast.py: a 32 or 64 "
                         "GB machine), page cache dropped first; 0 = all of it")
    ap.add_argument("--experts", type=int, default=1, choices=[1, 2],
                    help="2: the RingSwap Loader kinds sample two models of the file, Wan 2.2 style")
    ap.add_argument("--links", nargs="+", default=None, choices=["full", "halved"],
                    help="halved: a second process copies pinned memory to the GPU in a loop beside the cell "
                         "(bench/link_load.py: a PCIe 4.0-class link on the H200); default full, with --workflow "
                         "halved")
    add_workflow_options(ap)
    ap.add_argument("--resident-on-link", action="store_true",
                    help="also run the uncapped resident cells beside the link load of --links halved; the "
                         "streamed cells are then held to the resident run on their own emulated machine")
    ap.add_argument("--odirect-gb", type=float, default=4.0, help="GB read for the O_DIRECT rate; 0 = all")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall budget of the whole run")
    ap.add_argument("--cell-timeout-s", type=float, default=300.0)
    ap.add_argument("--md", default=None, help="also write the markdown table here")
    ap.add_argument("--merge", nargs="+", default=None, help="JSON of earlier runs: join, print, save; no runs")
    ap.add_argument("--runtime", default="auto", choices=["auto", "device", "local"])
    ap.add_argument("--comfy-0375", default=os.path.join(common.REPO, ".comfyui"), help="local runtime: ComfyUI 0.3.75")
    ap.add_argument("--comfy-033", default=os.path.join(common.REPO, ".comfyui-0.33"), help="local runtime: 0.33")
    ap.add_argument("--dry-run", action="store_true", help="list the cells and their estimates, then stop")
    return ap


def run_cells(a, cells: list[dict], env: dict, deadline: float) -> None:
    """Each cell in turn, its model file written first where the budget allows; the report
    saved after every cell (a part killed at its time limit keeps what it measured)."""
    measured: dict[tuple, float] = {}
    paths, rates = {}, env.setdefault("read_rates", {})
    for cell in cells:
        fmt, files = cell["format"], (cell["format"], bool(cell.get("workflow")))
        left = deadline - time.perf_counter()
        est = estimate(cell, measured, a) + (0.0 if fmt in rates else rates_s(a))
        if files not in paths and left > est:
            paths[files] = model_paths(a, fmt, files[1])
            left = deadline - time.perf_counter()
        if est > left or files not in paths:
            cell["skipped"] = f"not run (budget): ~{est:.0f} s > {max(0.0, left):.0f} s left"
            common.say(f"[compare] {fmt}/{cell['config']}@{cell['cap_gib']:g}: {cell['skipped']}")
        else:
            common.say(f"[compare] {fmt}/cfg {cell['cfg']:g}/{cell['link']}/{cell['config']}@{cell['cap_gib']:g}"
                       + (f" round {cell['round'] + 1}" if "round" in cell else "") + f" (~{est:.0f} s)")
            if fmt not in rates:   # once per format, in the same call as its cells
                rates[fmt] = compare_cache.read_rates(a, paths[files][0])
            cell.update(run=env["run"], read_rates=compare_cache.compact(rates[fmt]))
            run_cell(a, cell, paths[files], deadline)
            measured[(CONFIGS[cell["config"]].kind, fmt, files[1])] = cell["cell_wall_s"]
            if "error" in cell:
                common.say(f"[compare] FAILED (rc {cell.get('rc')}): {cell['error'][-1500:]}")
        save(a, cells, env)


def main(argv: list[str] | None = None) -> int:
    """Run the cells (or --merge earlier runs' JSON); the exit status, MISSED_EXIT where a
    target line of the report reads MISSED."""
    a = parser().parse_args(argv)
    a.prompt_steps, a.steps = prompt_steps(a), None
    workflow_defaults(a)
    if a.small:   # two workloads in one process, as on the GPU
        a.ctx_len, a.tokens = 16, a.tokens or [64, 256]
    a.formats = a.formats or (["fp32"] if a.small else ["bf16"])
    a.caps = a.caps if a.caps is not None else ([24] if a.small else [24, 12])
    if a.merge:
        return merge(a)
    if common.start(a, child):
        return 0
    deadline = common.T0 + a.budget_s
    cells = plan_cells(a)
    env = common.env_info(torch.device(a.device))
    env.update(run=time.strftime("%Y-%m-%d %H:%M:%S") + f" pid {os.getpid()}", cold=a.cold, prompt_steps=a.prompt_steps)
    if not a.dry_run:   # the pinned link's own rate, for the transfer-bound cells
        from io_rates import h2d_rate
        env["h2d_gbps"] = h2d_rate(torch.device(a.device), (64 if a.small else 1024) << 20)["gbps"]
    common.say(f"compare.py: {len(cells)} cells, runtime {runtime(a)}, budget {a.budget_s:.0f} s; "
               + ", ".join(f"{c['format']}/{c['config']}@{c['cap_gib']:g}" for c in cells))
    if a.dry_run:
        return dry_run(a, cells)
    run_cells(a, cells, env, deadline)
    return report(*save(a, cells, env))

if __name__ == "__main__":
    sys.exit(main())
