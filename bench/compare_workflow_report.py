"""bench/compare.py's report of the workflow cells (issue 53, compare_workflow.py): their own
table (the first and the next prompt's walls, the steady step, the expert switches' extra, each
step of the next prompt, the outputs against ComfyUI alone, host RSS, pinned bytes) and target
lines under each RingSwap row: the next prompt <= 1.05 x (its steps at the steady step + the
resident bytes it placed at the link rate measured in the same call); the first prompt, from a
warm page cache, <= 0.65 x ComfyUI 0.33 dynamic VRAM's on the same graph in the same call; the
next prompt against ComfyUI alone's (same version) as a ratio. Where a number is missing the
line says so and reads no verdict."""
from __future__ import annotations

import os

from common import fmt_num, gb, md_table
from compare_child import CONFIGS
from compare_table import resident_of, scenario

FIRST_REF = "comfy-0.33-dyn"   # the first prompt is held to ComfyUI 0.33 with dynamic VRAM on the same graph
NEXT_LIMIT, FIRST_LIMIT = 1.05, 0.65
HEADERS = ["format, cfg, link", "cap GiB", "configuration", "tokens", "first prompt s (N steps)", "loads s",
           "next prompt s", "next x ComfyUI alone", "steady s/step", "switch steps +s (first / mid)",
           "next prompt's steps s", "output vs ComfyUI alone (first / next)", "host RSS peak GB", "pinned GB", "note"]


def _peer(cells: list[dict], c: dict, config: str, same_round: bool = False) -> dict | None:
    """The measured workflow cell of `config` from the same call (run) as `c`, at its scenario and
    cap (and round, where `same_round`)."""
    for p in cells:
        if (p is not c and p["config"] == config and p.get("workflow") and "rows" in p and c.get("run")
                and p.get("run") == c["run"] and scenario(p) == scenario(c) and p["cap_gib"] == c["cap_gib"]
                and (not same_round or p.get("round", 0) == c.get("round", 0))):
            return p
    return None


def _row(cell: dict | None, tokens: int) -> dict | None:
    """`cell`'s measured row at `tokens`, or None."""
    return next((r for r in (cell or {}).get("rows", []) if r["tokens"] == tokens and "error" not in r), None)


def _same(r: dict, ref: dict, which: str) -> dict | None:
    """`which` prompt's final latent of `r` against `ref`'s: torch.equal (and the largest difference)
    where both saved latents are here, else their sha256; None where neither is known."""
    mine, theirs = (r.get("latents") or {}).get(which), (ref.get("latents") or {}).get(which)
    if mine and theirs and os.path.exists(mine) and os.path.exists(theirs):
        import torch
        x, y = torch.load(mine), torch.load(theirs)
        if x.shape != y.shape:
            return {"equal": False, "how": "torch.equal", "max_abs_diff": None}
        return {"equal": torch.equal(x, y), "how": "torch.equal",
                "max_abs_diff": float((x.float() - y.float()).abs().max()), "ref_max_abs": float(y.float().abs().max())}
    sha, ref_sha = r.get(f"{which}_latent_sha256"), ref.get(f"{which}_latent_sha256")
    return {"equal": sha == ref_sha, "how": "sha256"} if sha and ref_sha else None


def outputs(cells: list[dict]) -> None:
    """Each RingSwap workflow row's `output_vs`: its final latents (first and next prompt) against
    ComfyUI alone's of the same version, dynamic VRAM setting, call and round; kept once compared."""
    for c in cells:
        if not c.get("workflow") or "rows" not in c or CONFIGS[c["config"]].kind == "comfy":
            continue
        name = resident_of(CONFIGS[c["config"]])
        ref = _peer(cells, c, name, same_round=True)
        for r in c["rows"]:
            if (r.get("output_vs") or {}).get("next") is not None:
                continue
            theirs = _row(ref, r["tokens"])
            r["output_vs"] = {"ref": name, **({w: _same(r, theirs, w) for w in ("first", "next")} if theirs else {})}


def _output_words(c: dict, r: dict) -> str:
    """The output column: ComfyUI alone's checksums, or a RingSwap row's comparison with it."""
    if CONFIGS[c["config"]].kind == "comfy":
        sums = [str(r.get(f"{w}_latent_sha256", ""))[:8] for w in ("first", "next")]
        return f"reference (sha256 {sums[0]} / {sums[1]})"
    vs = r.get("output_vs") or {}
    if not vs.get("next") and not vs.get("first"):
        return f"no {vs.get('ref', 'ComfyUI alone')} cell in this call"

    def one(v: dict | None) -> str:
        if v is None:
            return "—"
        if v["equal"]:
            return "equal" + (" (sha256)" if v["how"] == "sha256" else "")
        diff = v.get("max_abs_diff")
        return "differs" + (f": max abs {diff:.2e}" if diff is not None else f" ({v['how']})")
    return f"{' / '.join(one(vs.get(w)) for w in ('first', 'next'))} vs {vs['ref']}"


def _next_ratio(cells: list[dict], c: dict, r: dict) -> tuple[float, float] | None:
    """(the next prompt's wall over ComfyUI alone's, ComfyUI alone's) of the same version in the
    same call; None for ComfyUI's own rows and where either is missing."""
    if CONFIGS[c["config"]].kind == "comfy":
        return None
    theirs = _row(_peer(cells, c, resident_of(CONFIGS[c["config"]])), r["tokens"])
    if not (theirs and theirs.get("next_prompt_s") and r.get("next_prompt_s")):
        return None
    return r["next_prompt_s"] / theirs["next_prompt_s"], theirs["next_prompt_s"]


def _note(c: dict, r: dict) -> str:
    bits = []
    if r.get("first_prompt_steps"):
        bits.append("first prompt's steps " + " ".join(f"{t:.2f}" for t in r["first_prompt_steps"]))
    placed = r.get("placed_bytes") or []
    if placed and None not in placed:
        bits.append("resident placed in the next prompt " + " + ".join(f"{gb(p):.1f}" for p in placed) + " GB")
    if r.get("expert_pinned"):
        bits.append("pinned per expert " + " / ".join(f"{gb(p):.1f}" for p in r["expert_pinned"]) + " GB")
    if c.get("link_load"):
        bits.append(f"{c['link_load']}, {c.get('h2d_left_gbps', 0):.1f} GB/s left to the cell")
    plans = [ln for ln in r.get("log", []) if ln.startswith("RingSwap plan:")]
    if plans:
        bits.append(plans[-1][:90])
    if r.get("error"):
        bits.append(r["error"][:120])
    return "; ".join(bits).replace("|", "/")


def _cols(cells: list[dict], c: dict, r: dict) -> list[str]:
    """A measured row's columns after its tokens."""
    load = r.get("ttfs_load", True)
    first = fmt_num(r.get("first_prompt_s"), ".1f") + ("" if load or r.get("first_prompt_s") is None else " (no load)")
    extra = [r.get("first_step_extra_s"), r.get("switch_extra_s")]
    pinned = (r.get("pinned") or {}).get("total")
    ratio = _next_ratio(cells, c, r)
    return [first, fmt_num(c.get("load_s") if load else None, ".1f"), fmt_num(r.get("next_prompt_s"), ".1f"),
            fmt_num(ratio and ratio[0], ".3f"), fmt_num(r.get("steady_s"), ".3f"),
            " / ".join(fmt_num(e, "+.2f") for e in extra), " ".join(f"{t:.2f}" for t in r.get("next_prompt_steps", [])),
            _output_words(c, r), fmt_num(None if r.get("rss_peak") is None else gb(r["rss_peak"]), ".1f"),
            fmt_num(None if pinned is None else gb(pinned), ".1f"), _note(c, r)]


def workflow_table(cells: list[dict], small: bool = False) -> str:
    """The markdown table of the workflow cells (measured or not)."""
    n = next((r["prompt_steps"] for c in cells for r in c.get("rows", []) if r.get("prompt_steps")), None)
    headers = [h.replace("N steps", f"{n} steps") if n else h for h in HEADERS]
    rows = []
    for c in cells:
        fmt, cfg, link = scenario(c)
        cap = "none" if not c["cap_gib"] else f"{c['cap_gib']:g}" + (" (not on CPU)" if small else "")
        head = [f"{fmt}, cfg {cfg:g}, link {link}", cap, f"{c['config']}: {CONFIGS[c['config']].label}"]
        if "rows" not in c:
            why = c.get("skipped") or f"failed (rc {c.get('rc')}): " + (c.get("error") or "")[-160:].replace("\n", " ")
            rows.append(head + ["—", why.replace("|", "/")] + [""] * (len(HEADERS) - 5))
            continue
        rows += [head + [f"{r['tokens']:,}"] + _cols(cells, c, r) for r in c["rows"]]
    title = "Workflow cells (Wan 2.2's two experts with a LoRA each, first and next prompt):"
    return title + "\n\n" + md_table(headers, rows)


def _bound(c: dict, r: dict, link_gbps: float | None) -> str:
    """The next prompt against its steps at the steady step plus its resident bytes placed at the
    cell's link rate (beside the link load where halved, else the run's pinned rate)."""
    rate = c.get("h2d_left_gbps") or link_gbps
    missing = [what for what, v in (("a steady step", r.get("steady_sum_s")),
                                    ("the resident bytes placed", r.get("resident_placed_bytes")),
                                    ("a link rate", rate or None)) if v is None]
    head = f"next prompt {r['next_prompt_s']:.1f} s"
    if missing:
        return f"{head}: no bound ({' and '.join(missing)} not measured in this call)"
    placed = r["resident_placed_bytes"] / 1e9
    bound = r["steady_sum_s"] + placed / rate
    x = r["next_prompt_s"] / bound
    return (f"{head} x{x:.3f} the bound {bound:.1f} s ({r['prompt_steps']} steps at the steady step "
            f"{r['steady_sum_s']:.1f} s + {placed:.1f} GB placed at {rate:.1f} GB/s) "
            f"({'ok' if x <= NEXT_LIMIT else 'MISSED'} <= {NEXT_LIMIT:g})")


def _first(cells: list[dict], c: dict, r: dict) -> str:
    """The first prompt (the nodes' loads included) against ComfyUI 0.33 dynamic VRAM's on the
    same graph in the same call; judged from a warm page cache only."""
    if not r.get("ttfs_load"):
        return ""
    mine, theirs = r["first_prompt_s"], _row(_peer(cells, c, FIRST_REF), r["tokens"])
    if theirs is None or not theirs.get("ttfs_load"):
        return (f"first prompt {mine:.1f} s: no {FIRST_REF} workflow cell in this call at {c['cap_gib']:g} GiB "
                "to hold it to")
    x = mine / theirs["first_prompt_s"]
    head = f"first prompt {mine:.1f} s x{x:.2f} {FIRST_REF}'s {theirs['first_prompt_s']:.1f} s"
    if c.get("cold"):
        return head + f" (cold page cache: the <= {FIRST_LIMIT:g} target is for a warm one)"
    return head + f" ({'ok' if x <= FIRST_LIMIT else 'MISSED'} <= {FIRST_LIMIT:g}, warm page cache)"


def workflow_targets(cells: list[dict], link_gbps: float | None) -> str:
    """One line per measured RingSwap workflow row: the next prompt's bound, the first prompt
    against ComfyUI dynamic VRAM's, the next prompt's ratio to ComfyUI alone's."""
    lines = []
    for c in cells:
        if CONFIGS[c["config"]].kind == "comfy":
            continue
        for r in c.get("rows", []):
            if "error" in r or r.get("next_prompt_s") is None:
                continue
            fmt, cfg, link = scenario(c)
            name, ratio = resident_of(CONFIGS[c["config"]]), _next_ratio(cells, c, r)
            versus = (f"next prompt x{ratio[0]:.2f} {name}'s {ratio[1]:.1f} s" if ratio is not None
                      else f"no {name} workflow cell in this call for the next prompt's ratio")
            bits = [_bound(c, r, link_gbps), _first(cells, c, r), versus]
            lines.append(f"- {fmt} cfg {cfg:g} link {link} {c['cap_gib']:g} GiB {c['config']} "
                         f"{r['tokens']:,} tokens: " + "; ".join(b for b in bits if b))
    return "\n".join(lines)
