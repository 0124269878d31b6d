"""bench/compare.py's one table: per cell and workload the s/step (the mean after the first
step), its ratio to the floor (WanModel alone, resident) and to ComfyUI-resident of the same
ComfyUI version, the time to the first step (TTFS: the node's load + the prompt's first step,
for the first workload; later workloads' first step, "no load") and the prompt's wall (TTFS +
its other steps), and the first step, load time, peak VRAM, host RSS (peak / steady) and
pinned bytes."""
from __future__ import annotations

import re
import statistics
from collections import Counter

from common import fmt_num, gb, md_table
from compare_child import CONFIGS

HEADERS = ["format, cfg, link", "cap GiB", "configuration", "tokens", "s/step", "x floor", "x ComfyUI resident",
           "TTFS s", "first prompt s (N steps)", "first step s", "load s", "peak VRAM GB (torch)", "host RSS peak / steady GB", "pinned GB", "note"]


def scenario(c: dict) -> tuple:
    """(format with LoRA rank, compile backend, experts or the workflow, depth, ..., cfg, link) of a
    cell: the workload it ran (cells of older runs: no LoRA, not compiled, cfg 1, full link)."""
    lora = f" + LoRA rank {c['lora_rank']}" if c.get("lora_rank") else ""
    compiled = f" + compile {c['compile']}" if c.get("compile") else ""
    experts = f", {c['experts']} experts" if c.get("experts", 1) > 1 else ", Wan 2.2 workflow" if c.get("workflow") else ""
    experts += f", {c['layers']} blocks" if c.get("layers", 40) != 40 else ""
    ram = f", RAM {c['ram_gb']:g} GB" if c.get("ram_gb") else ""
    compress = f", compress {c['compress']}" if c.get("compress") else ""
    cold = ", cold" if c.get("cold") else ""
    return c["format"] + lora + compiled + experts + ram + compress + cold, c.get("cfg", 1.0), c.get("link", "full")


def rounds_joined(cells: list[dict]) -> list[dict]:
    """The cells of several rounds (--repeat) as one cell per format, configuration and cap:
    the first measured round's cell, each row's s/step, TTFS and prompts' walls the median over the
    measured rounds and the rounds' own s/step kept in `s_rounds`."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault(scenario(c) + (c["config"], c["cap_gib"]), []).append(c)
    out = []
    for group in groups.values():
        measured = [c for c in group if "rows" in c]
        if len(measured) < 2:
            out.append(measured[0] if measured else group[0])
            continue
        joined = dict(measured[0], rows=[])
        for r in measured[0]["rows"]:
            row = dict(r)
            for key in ("s_per_step", "ttfs_s", "first_prompt_s", "next_prompt_s"):
                if key not in r:
                    continue
                runs = [v for c in measured for x in c["rows"] if x["tokens"] == r["tokens"] and (v := x.get(key))]
                row[key] = statistics.median(runs) if runs else None
                if key == "s_per_step":
                    row["s_rounds"] = runs
            joined["rows"].append(row)
        out.append(joined)
    return out


def speeds_of(cells: list[dict]) -> dict:
    """(format, cfg, link, config, cap, tokens) -> s/step of every measured row."""
    out = {}
    for c in cells:
        for r in c.get("rows", []):
            if r.get("s_per_step"):
                out[scenario(c) + (c["config"], c["cap_gib"], r["tokens"])] = r["s_per_step"]
    return out


def uncapped(speeds: dict, c: dict, config: str, tokens: int) -> float | None:
    """s/step of the uncapped `config` in `c`'s workload: on the same link, else the full one."""
    fmt, cfg, link = scenario(c)
    return speeds.get((fmt, cfg, link, config, 0, tokens)) or speeds.get((fmt, cfg, "full", config, 0, tokens))


def resident_of(cfg) -> str:
    """The uncapped ComfyUI configuration a cell is held to: same version, same dynamic VRAM."""
    return next(n for n, c in CONFIGS.items() if c.kind == "comfy" and (c.comfy, c.dynamic) == (cfg.comfy, cfg.dynamic))


def _note(c: dict, r: dict, link_gbps: float | None) -> str:
    bits = []
    if len(r.get("s_rounds") or []) > 1:
        bits.append("median of rounds " + " / ".join(f"{v:.3f}" for v in r["s_rounds"]))
    if r.get("plan"):
        bits.append(r["plan"][:90])
    s = r.get("s_per_step")
    if c.get("link_load"):
        bits.append(f"{c['link_load']}, {c.get('h2d_left_gbps', 0):.1f} GB/s left to the cell")
    if r.get("calls_per_step"):
        bits.append(f"{r['calls_per_step']:.2f} model calls a step")
    if r.get("h2d_bytes_per_step") and s:
        rate = gb(r["h2d_bytes_per_step"]) / s
        bits.append(f"host->GPU {rate:.1f} GB/s per step wall"
                    + (f" ({100 * rate / link_gbps:.0f}% of pinned {link_gbps:.1f})" if link_gbps else "")
                    + f", copy stream {r['copy_gbps']:.1f} GB/s")
    if r.get("rerun_first_step_s") is not None:
        plans = [ln for ln in r.get("rerun_log", []) if ln.startswith("RingSwap plan:")]
        how = ("" if not plans else " (blocks kept)" if all("kept on the device" in ln for ln in plans)
               else " (blocks placed again)")
        then = r.get("rerun_step_s")
        ratio = f" = {then / s:.3f} x this row" if then and s else ""
        bits.append(f"next prompt: first step {r['rerun_first_step_s']:.3f} s, then {fmt_num(then, '.3f')}{ratio}{how}")
    if r.get("read_bytes_per_step") and s:
        bits.append(f"disk read {gb(r['read_bytes_per_step']) / s:.2f} GB/s")
    if c.get("odirect"):
        bits.append("disk O_DIRECT " + " / ".join(f"{o['gbps']:.2f}" for o in c["odirect"])
                    + f" GB/s (1 / {c['odirect'][-1]['threads']} readers)")
    if str(c.get("page_cache", "")).startswith("warm"):
        bits.append("page cache " + c["page_cache"])
    if c.get("ram_ballast"):
        bits.append(f"RAM ballast {c['ram_ballast']}; pages swapped out {c.get('pages_swapped_out')}")
    splits = [m[1] for ln in r.get("log", []) if (m := re.search(r"; home auto: (.*?RAM counted on [^(]*\([^)]*\))", ln))]
    if splits:
        bits.append("home auto: " + splits[-1])
    if r.get("switch_step_s") is not None:
        first = r.get("first_prompt_switch_s")
        bits.append(f"expert switch step {r['switch_step_s']:.2f} s"
                    + (f" (first prompt, loading the second expert: {first:.2f} s)" if first is not None else "")
                    + "; pinned per expert "
                    + " / ".join(f"{gb(p):.1f}" for p in r["expert_pinned"]) + " GB")
    if r.get("error"):
        bits.append(r["error"][:120])
    return "; ".join(bits).replace("|", "/")


def _of_file(r: dict, c: dict) -> str:
    """Steady RSS above the process's start, as a multiple of the model file."""
    if r.get("rss_steady") is None or not c.get("file_bytes"):
        return ""
    return f" ({(r['rss_steady'] - c.get('rss_base', 0)) / c['file_bytes']:.2f}x file)"


def _prompt_cols(r: dict, n: int | None) -> list[str]:
    """The TTFS and first-prompt cells of a row: "(no load)" where the workload ran after the
    first (the node's load is not in it); the prompt's steps where they differ from the header's `n`."""
    load = [] if r.get("ttfs_load", True) else ["no load"]
    steps = [] if r.get("prompt_steps") in (None, n) else [f"{r['prompt_steps']} steps"]
    ttfs, wall = r.get("ttfs_s"), r.get("first_prompt_s")
    return [fmt_num(ttfs, ".2f") + (f" ({load[0]})" if load and ttfs is not None else ""),
            fmt_num(wall, ".1f") + (f" ({', '.join(steps + load)})" if steps + load and wall is not None else "")]


def _gb(v) -> str:
    return fmt_num(None if v is None else gb(v), ".1f")


def table(cells: list[dict], small: bool = False, link_gbps: float | None = None) -> str:
    """The markdown table of `cells` (compare.py's cell dicts, measured or not); `link_gbps`:
    the pinned host->GPU rate measured in the same run."""
    speeds = speeds_of(cells)
    lengths = Counter(r["prompt_steps"] for c in cells for r in c.get("rows", []) if r.get("prompt_steps"))
    n = lengths.most_common(1)[0][0] if lengths else None   # the header's; other lengths are said in the cell
    headers = [h.replace("N steps", f"{n} steps") if n else h for h in HEADERS]
    rows = []
    for c in cells:
        cfg = CONFIGS[c["config"]]
        cap = "none" if not c["cap_gib"] else f"{c['cap_gib']:g}" + (" (not on CPU)" if small else "")
        fmt, cfg_scale, link = scenario(c)
        head = [f"{fmt}, cfg {cfg_scale:g}, link {link}", cap, f"{c['config']}: {cfg.label}"]
        if "rows" not in c:
            why = c.get("skipped") or f"failed (rc {c.get('rc')}): " + (c.get("error") or "")[-160:].replace("\n", " ")
            rows.append(head + ["—", why.replace("|", "/")] + [""] * (len(HEADERS) - 5))
            continue
        for r in c["rows"]:
            s = r.get("s_per_step")
            floor = uncapped(speeds, c, "floor", r["tokens"])
            resident = uncapped(speeds, c, resident_of(cfg), r["tokens"])
            pinned = (r.get("pinned") or {}).get("total")
            vram = f"{_gb(r.get('vram_peak'))} ({_gb(r.get('vram_torch_peak'))})"
            rows.append(head + [f"{r['tokens']:,}", fmt_num(s, ".3f"),
                                fmt_num(s / floor if s and floor else None, ".3f"),
                                fmt_num(s / resident if s and resident else None, ".3f"), *_prompt_cols(r, n),
                                fmt_num(r.get("first_step_s"), ".2f"), fmt_num(c.get("load_s"), ".1f"), vram,
                                f"{_gb(r.get('rss_peak'))} / {_gb(r.get('rss_steady'))}" + _of_file(r, c),
                                _gb(pinned),
                                _note(c, r, link_gbps)])
    return md_table(headers, rows)
