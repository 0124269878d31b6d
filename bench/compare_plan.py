"""bench/compare.py's cells: which run, in what order (plan_cells), and how long each takes
(estimate, for the budget and --dry-run); the prompt's length (--prompt-steps, or the older
--steps), the page-cache options and the workflow cell's defaults (workflow_defaults)."""
from __future__ import annotations

import argparse

from compare_child import CONFIGS

# (configuration, cap GiB or None = each of --caps); 0 = no cap
GROUPS = {
    "base": [("floor", 0), ("comfy-0.3.75", 0), ("comfy-0.33-dyn", 0), ("comfy-0.33", 0)],
    "peers": [("comfy-0.3.75", None), ("comfy-0.33-dyn", None), ("comfy-0.33", None), ("diffusers", None)],
    "ringswap": [("rs-patch-0.3.75", None), ("rs-loader-0.3.75", None), ("rs-patch-0.33-dyn", None),
                 ("rs-loader-0.33-dyn", None)],
    "disk": [("rs-disk-0.3.75", None)],
}
# --workflow without --configs: ComfyUI alone and RingSwap, as users wire them, on both versions
WORKFLOW = [("comfy-0.33-dyn", None), ("rs-patch-0.33-dyn", None), ("rs-auto-0.33-dyn", None), ("comfy-0.3.75", None),
            ("rs-auto-0.3.75", None)]
WORKFLOW_KINDS = ("comfy", "patch", "loader", "auto")
# Seconds per cell on the H200 (bf16, both workloads, 5 steps each; process start, load and
# the steps; the most measured on 2026-12-01), replaced by the measured wall time of a cell
# of the same kind in the run; EST_STEPS: the steps they ran, a step more or less costs
# about step_guess; the file's GB, read before a warm cell or by a cold cell's load.
EST_S = {"floor": 62, "comfy": 70, "diffusers": 85, "patch": 75, "loader": 75, "auto": 90, "disk": 240}
EST_STEPS = 5
FILE_GB = {"bf16": 28.6, "scaled_fp8": 15.4, "fp32": 57.2, "gguf_q8_0": 15.4, "gguf_q4_k": 8.4}
WARM_READ_GBPS, COLD_READ_GBPS, READ_RATES_S = 8.0, 1.5, 15.0
RAM_BALLAST_S = 40.0   # measured 35-40 s on the H200 (a 48-85 GB ballast)
# A workflow cell (guesses, not yet measured): process start, ComfyUI's import and the graphs;
# the nodes' loads of an expert from the page cache; an expert switch beyond a step; a step
# under a cap on the halved link with a LoRA over step_guess's resident one
WF_START_S, WF_LOAD_GBPS, WF_SWITCH_S, WF_SLOW = 20.0, 4.0, 3.0, 1.25
EXPERT_SEEDS = (0, 100)   # the workflow's high- and low-noise expert files (model_file.py's seeds)
WRITE_GBPS = 0.9          # model_file.py writes bf16 Wan-14B at ~0.9 GB/s, generation included (28.6 GB in 31 s)
FORMAT_SCALE = {"bf16": 1.0, "scaled_fp8": 0.7, "fp32": 2.0, "gguf_q8_0": 0.8, "gguf_q4_k": 0.7}


def config_at(arg: str) -> tuple[str, float | None]:
    """--configs entry: NAME (at each of --caps; the floor uncapped) or NAME@CAP (that cap only)."""
    name, _, cap = arg.partition("@")
    if name not in CONFIGS:
        raise SystemExit(f"compare.py: --configs {arg}: unknown configuration {name!r} (one of {', '.join(CONFIGS)})")
    try:
        return name, (float(cap) if cap else 0 if name == "floor" else None)
    except ValueError:
        raise SystemExit(f"compare.py: --configs {arg}: the cap after @ must be GiB (e.g. {name}@24)") from None


def _links_of(a, name: str, cap: float, link: str) -> tuple[str, ...]:
    """The links a cell runs on. The uncapped resident runs copy nothing a step: the full link,
    and with --resident-on-link also beside the link load (the streamed cells' emulated machine)."""
    if cap or CONFIGS[name].kind not in ("floor", "comfy"):
        return (link,)
    return ("full", link) if getattr(a, "resident_on_link", False) else ("full",)


def plan_cells(a) -> list[dict]:
    """The cells to run, in priority order, without repeats."""
    if a.configs:
        picked = [config_at(n) for n in a.configs]
    elif getattr(a, "workflow", False):
        picked = list(WORKFLOW)
    else:
        picked = [e for g in a.groups for e in GROUPS[g]]
    wrong = [n for n, _ in picked if getattr(a, "workflow", False) and CONFIGS[n].kind not in WORKFLOW_KINDS]
    if wrong:
        raise SystemExit(f"compare.py: --workflow runs the {', '.join(WORKFLOW_KINDS)} kinds, not {', '.join(wrong)}")
    fixed = [(n, c) for n, c in picked if c is not None]
    per_cap = [n for n, c in picked if c is None and CONFIGS[n].kind != "disk"]
    disk = [n for n, c in picked if c is None and CONFIGS[n].kind == "disk"]
    cells, seen = [], set()
    for fmt in a.formats:
        order = fixed + [(n, cap) for cap in a.caps for n in per_cap] + [(n, cap) for cap in a.caps for n in disk]
        for cfg in a.cfgs:
            for link in a.links or ["full"]:
                for ram, (name, cap) in ((r, e) for r in getattr(a, "rams", [0.0]) for e in order):
                    for on in _links_of(a, name, cap, link):
                        if (fmt, cfg, on, name, cap, ram) not in seen:
                            seen.add((fmt, cfg, on, name, cap, ram))
                            cells.append({"format": fmt, "cfg": cfg, "link": on, "config": name, "cap_gib": cap,
                                          **({"ram_gb": ram} if ram else {}),
                                          **({"cold": True} if getattr(a, "cold", False) else {}),
                                          **_workflow_keys(a),
                                          **({"lora_rank": a.lora_rank} if getattr(a, "lora_rank", 0) else {}),
                                          **({"compile": a.compile} if getattr(a, "compile", None) else {}),
                                          **({"compress": a.compress} if getattr(a, "compress", "off") != "off"
                                             and CONFIGS[name].kind in ("patch", "loader", "auto") else {})})
    if a.repeat > 1:   # whole rounds, so a drift of the machine spreads over every cell alike
        cells = [dict(c, round=r) for r in range(a.repeat) for c in cells]
    return cells


def _workflow_keys(a) -> dict:
    """A cell's keys for --workflow (two experts, its own measures), --experts and --layers."""
    if getattr(a, "workflow", False):
        keys = {"workflow": True}
    else:
        keys = {"experts": a.experts} if getattr(a, "experts", 1) > 1 else {}
    return dict(keys, **({"layers": a.layers} if getattr(a, "layers", 40) != 40 else {}))


def step_guess(tokens: int, cfg: float) -> float:
    """A bf16 Wan-14B step's seconds, roughly (0.45-1.9 s at 7,800 tokens by cell, 3-4 s at 32,760)."""
    return 0.5 * (tokens / 7800) ** 1.3 * (2 if cfg > 1 else 1)


def estimate(cell: dict, measured: dict, a) -> float:
    """A cell's seconds: one of the same kind measured in this run, else EST_S with the steps
    beyond EST_STEPS and the page cache (the warm read before it, or a cold load from disk)."""
    kind = CONFIGS[cell["config"]].kind
    if (kind, cell["format"], bool(cell.get("workflow"))) in measured:
        return measured[(kind, cell["format"], bool(cell.get("workflow")))]
    if a.small:
        return 20.0
    if cell.get("workflow"):
        return workflow_estimate(cell, a)
    ballast = RAM_BALLAST_S if cell.get("ram_gb") else 0.0   # the disk probe, cache drop and locking the RAM
    steps = (1 + a.disk_steps if kind == "disk" else a.prompt_steps) - EST_STEPS
    steps_s = steps * sum(step_guess(t, cell.get("cfg", 1.0)) for t in a.tokens) * cell.get("experts", 1)
    cache_gb = 0.0 if kind == "disk" or cell.get("ram_gb") else file_gb(cell)
    cache_s = cache_gb / (COLD_READ_GBPS if cell.get("cold") else WARM_READ_GBPS)
    return EST_S[kind] * FORMAT_SCALE.get(cell["format"], 1.0) * cell.get("experts", 1) + ballast + steps_s + cache_s


def file_gb(cell: dict) -> float:
    """GB of a cell's model file (of --layers blocks of the 40: the non-block weights are small)."""
    return FILE_GB.get(cell["format"], 28.6) * cell.get("layers", 40) / 40


def workflow_estimate(cell: dict, a) -> float:
    """A workflow cell's seconds: start, both experts read into the page cache (or from disk
    with --cold) and loaded, two prompts of --prompt-steps steps per workload, four switches."""
    depth, gb = cell.get("layers", 40) / 40, file_gb(cell)
    steps_s = 2 * a.prompt_steps * sum(step_guess(t, cell.get("cfg", 1.0)) for t in a.tokens) * depth * WF_SLOW
    cache_s = 2 * gb / (COLD_READ_GBPS if cell.get("cold") else WARM_READ_GBPS)
    return WF_START_S + 2 * gb / WF_LOAD_GBPS + cache_s + steps_s + 4 * WF_SWITCH_S * len(a.tokens)


def rates_s(a) -> float:
    """Seconds the read rates of a format take (compare_cache.read_rates)."""
    return 2.0 if a.small else READ_RATES_S + (10.0 if a.cold else 0.0)


def add_prompt_options(ap) -> None:
    """compare.py's options for the prompt's length and the page cache (issue 53)."""
    ap.add_argument("--prompt-steps", type=int, default=None,
                    help="steps of each workload's prompt, one sampling call (default 20; 5 for a quick check): "
                         "TTFS from its first, s/step from the rest, its wall")
    ap.add_argument("--steps", type=int, default=None, help="older form: --prompt-steps STEPS+1")
    ap.add_argument("--cold", action="store_true",
                    help="drop the page cache before each cell and measure the disk's O_DIRECT rate "
                         "(default: each cell starts from the file read whole, a warm page cache)")
    ap.add_argument("--pinned-gb", type=float, default=8.0,
                    help="GB of the file read into pinned memory per thread count for its read rate; 0 = all")


def add_workflow_options(ap) -> None:
    """compare.py's options for the workflow cell (issue 53) and the model files' depth."""
    ap.add_argument("--workflow", action="store_true",
                    help="the workflow cell: Wan 2.2's two experts with a LoRA each, sampled 4 + 4 steps as "
                         "KSamplerAdvanced does, first and next prompt, ComfyUI alone against RingSwap")
    ap.add_argument("--layers", type=int, default=40,
                    help="blocks of the written model files (Wan-14B has 40; 20: half-depth experts)")
    ap.add_argument("--low-path", help=argparse.SUPPRESS)
    ap.add_argument("--latent-dir", help=argparse.SUPPRESS)


def prompt_steps(a) -> int:
    """--prompt-steps, or the older --steps N as a prompt of N + 1 steps; 20 by default."""
    if a.steps is not None and a.prompt_steps not in (None, a.steps + 1):
        raise SystemExit("compare.py: --steps N is --prompt-steps N+1; give one of them")
    default = 8 if getattr(a, "workflow", False) else 20
    n = a.prompt_steps if a.prompt_steps is not None else default if a.steps is None else a.steps + 1
    if n < 2:
        raise SystemExit("compare.py: --prompt-steps must be 2 or more (s/step is the mean of steps 2..N)")
    return n


def workflow_defaults(a) -> None:
    """--workflow's defaults where not given: the users' cell (32,760 tokens, 12 GiB, halved link,
    a rank-64 LoRA); other runs: no LoRA, the full link. Refuses GGUF (no seeded writer, 40 blocks
    only) and --compile."""
    wf = getattr(a, "workflow", False)
    if a.lora_rank is None:
        a.lora_rank = 64 if wf else 0
    a.links = a.links or (["halved"] if wf else ["full"])
    if a.layers != 40 and any(f.startswith("gguf") for f in a.formats or []):
        raise SystemExit("compare.py: --layers: the GGUF writer writes the 40 blocks of Wan-14B only")
    if wf:
        a.tokens = a.tokens or ([64] if a.small else [32760])
        a.caps = a.caps if a.caps is not None else [12]
        a.formats = a.formats or (["fp32"] if a.small else ["bf16"])
        if any(f.startswith("gguf") for f in a.formats):
            raise SystemExit("compare.py: --workflow writes two seeded safetensors experts; no GGUF formats")
        if getattr(a, "compile", None):
            raise SystemExit("compare.py: --workflow does not compile (its graph has no TorchCompileModel)")


def dry_run(a, cells: list[dict]) -> int:
    """List the cells and their estimated seconds, and the whole."""
    ests = [estimate(c, {}, a) for c in cells]
    for c, est in zip(cells, ests):
        print(f"{c['format']:>10} {c['config']:>20} cap {c['cap_gib']:>4g}: ~{est:.0f} s")
    total = sum(ests) + rates_s(a) * len({c["format"] for c in cells})
    files = {(c["format"], c.get("layers", 40), seed): file_gb(c) for c in cells
             for seed in (EXPERT_SEEDS if c.get("workflow") else EXPERT_SEEDS[:1])}
    print(f"~{total:.0f} s in all (read rates included); writing the {len(files)} model file(s) where the machine "
          f"lacks them: ~{sum(files.values()) / WRITE_GBPS:.0f} s more")
    return 0
