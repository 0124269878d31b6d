"""bench/compare.py's targets (issue 13), judged from the cells of one table: RingSwap at least
as fast as every peer at the same cap; <= 1.01 x ComfyUI resident of its version at 24 GiB;
>= 90% of the pinned link where a cell is transfer-bound (else the bound it can reach);
steady host RSS <= 1.05 x the file with home=ram, a few blocks with home=disk (whose speed is
held to the disk's own O_DIRECT rate instead). home=auto under a RAM ballast (issue 25): no
swapping, peak RSS <= the RAM given, <= 1.02 x home=ram where the streamed blocks fit in RAM,
else the file's share read at >= 85% of O_DIRECT; an expert switch <= its resident bytes at
the disk's rate. GGUF at 8 GiB (issue 27): <= 0.8 x Unet Loader (GGUF) alone. The time to
the first step (issue 53), a line of its own under the row's: <= 0.6 x (warm) / 0.8 x (--cold)
ComfyUI dynamic VRAM's in the same call, <= 1.3 x reading the file at the best pinned rate (cold:
1.15 x at O_DIRECT) plus one step; the first prompt's wall <= 0.9 x ComfyUI dynamic VRAM's."""
from __future__ import annotations

import re

from compare_child import CONFIGS
from compare_table import resident_of, scenario, speeds_of, uncapped

RINGSWAP = ("patch", "loader", "disk", "auto")
PEERS = ("comfy", "diffusers")
TTFS_REF = "comfy-0.33-dyn"   # what a RingSwap row's TTFS and first prompt are held to


def _rows(cells: list[dict], kinds: tuple[str, ...]):
    for c in cells:
        if CONFIGS[c["config"]].kind in kinds and c.get("cap_gib") and not c.get("workflow"):   # its own lines
            for r in c.get("rows", []):
                if r.get("s_per_step"):
                    yield c, r


def _peers(cells: list[dict], c: dict, r: dict) -> list[str]:
    """What each peer at the same format, cap and tokens does against RingSwap's row."""
    out = []
    for p, pr in _rows(cells, PEERS):
        if scenario(p) + (p["cap_gib"], pr["tokens"]) != scenario(c) + (c["cap_gib"], r["tokens"]):
            continue
        other = "" if CONFIGS[p["config"]].comfy == CONFIGS[c["config"]].comfy else " (other ComfyUI)"
        x = r["s_per_step"] / pr["s_per_step"]
        verdict = "ok" if x <= 1 else f"SLOWER (+{100 * (x - 1):.1f}%)"
        out.append(f"{verdict} vs {p['config']}{other} {pr['s_per_step']:.3f}")
    return out


def _blocks(plan: str) -> tuple[int, int] | None:
    m = re.match(r"(\d+) resident \+ (\d+) streamed", plan or "")
    return (int(m[1]), int(m[2])) if m else None


def _link(c: dict, r: dict, resident: float | None, link_gbps: float | None) -> str:
    if not (link_gbps and r.get("h2d_bytes_per_step") and resident):
        return ""
    copy_s = r["h2d_bytes_per_step"] / 1e9 / link_gbps
    share = copy_s / r["s_per_step"]
    if copy_s >= resident:
        return f"transfer-bound: {100 * share:.0f}% of link ({'ok' if share >= 0.9 else 'MISSED'} >= 90%)"
    return (f"not transfer-bound (copies {copy_s:.3f} s < resident step {resident:.3f} s): "
            f"{100 * share:.0f}% of link of at most {100 * copy_s / resident:.0f}%")


def _rss(c: dict, r: dict, workers: int) -> str:
    if r.get("rss_steady") is None or not c.get("file_bytes"):
        return ""
    held = r["rss_steady"] - c.get("rss_base", 0)
    if CONFIGS[c["config"]].kind != "disk":
        x = held / c["file_bytes"]
        return f"RSS {x:.2f} x file ({'ok' if x <= 1.05 else 'MISSED'} <= 1.05)"
    n = _blocks(r.get("plan"))
    if not n:
        return ""
    blocks = held / (c["file_bytes"] / sum(n))   # a block's share of the file, non-block weights included
    allowed = n[0] + 1 + 1 + workers   # window (resident + its ring slot) + prefetch + readers
    return (f"RSS {blocks:.1f} blocks' worth ({'ok' if blocks <= allowed else 'MISSED'} <= {allowed}: "
            f"window + prefetch + readers, plus non-block weights)")


def _disk(c: dict, r: dict) -> str:
    """home=disk is held to the disk's own O_DIRECT rate (best of its reader counts)."""
    best = max((o["gbps"] for o in c.get("odirect") or []), default=None)
    if not (best and r.get("read_bytes_per_step")):
        return ""
    rate = r["read_bytes_per_step"] / 1e9 / r["s_per_step"]
    return f"disk read {rate:.2f} GB/s = {100 * rate / best:.0f}% of the disk's O_DIRECT {best:.2f} GB/s"


def _ram_targets(speeds: dict, c: dict, r: dict) -> list[str]:
    """Issue 25, home=auto on a smaller machine (a RAM ballast leaving ram_gb)."""
    ram = c.get("ram_gb")
    if not ram:
        return []
    swapped = c.get("pages_swapped_out")
    out = [f"pages swapped out {swapped} ({'ok' if swapped == 0 else 'MISSED'} none)",
           f"RSS peak {r.get('rss_peak', 0) / 1e9:.1f} GB ({'ok' if r.get('rss_peak', 0) <= ram * 1e9 else 'MISSED'} "
           f"<= {ram:g} GB given)"]
    best = max((o["gbps"] for o in c.get("odirect") or []), default=None)
    cfg = CONFIGS[c["config"]]
    ref_config = next((k for k, v in CONFIGS.items() if v.kind == "loader" and (v.comfy, v.dynamic) ==
                       (cfg.comfy, cfg.dynamic)), None)
    ref = speeds.get(scenario({**c, "ram_gb": 0, "experts": 1, "compress": None}) + (ref_config, c["cap_gib"], r["tokens"]))
    if not r.get("read_bytes_per_step"):
        if ref:
            x = r["s_per_step"] / ref
            out.append(f"streamed blocks in RAM: x{x:.3f} home=ram {ref:.3f} ({'ok' if x <= 1.02 else 'MISSED'} <= 1.02)")
    elif best:
        rate = r["read_bytes_per_step"] / 1e9 / r["s_per_step"]
        hidden = ref and r["s_per_step"] <= 1.02 * ref
        ok = "ok" if rate >= 0.85 * best or hidden else "MISSED"
        out.append(f"file share read at {rate:.2f} GB/s = {100 * rate / best:.0f}% of O_DIRECT {best:.2f} GB/s "
                   f"({ok} >= 85%{', or hidden: <= 1.02 x home=ram' if hidden else ''})")
    on_gpu = _on_gpu(c, r)
    if r.get("switch_step_s") is not None and on_gpu and best:
        bound = on_gpu[1] / 1e9 / best
        extra = r["switch_step_s"] - r["s_per_step"]
        out.append(f"expert switch +{extra:.2f} s ({'ok' if extra <= bound else 'MISSED'} <= {bound:.2f} s: "
                   f"{on_gpu[0]} resident blocks at O_DIRECT)")
    return out


def _on_gpu(c: dict, r: dict) -> tuple[int, float] | None:
    """(resident blocks, their bytes): from the home=auto split of the plan line, else the plan."""
    for ln in reversed(r.get("log", [])):
        m = re.search(r"home auto: (\d+) blocks \(([\d.]+) GB\) on the GPU", ln)
        if m:
            return int(m[1]), float(m[2]) * 1e9
    n = _blocks(r.get("plan"))
    return (n[0], n[0] * c["file_bytes"] / sum(n)) if n and c.get("file_bytes") else None


def _resident_targets(c: dict, r: dict, resident: float | None, rate: float | None) -> str:
    """Issue 24: <= 1.02 x resident where the step's copies at the cell's link rate take less
    than the resident step; <= 1.05 x at cfg 5, 12 GiB, halved link, 7,800 tokens."""
    if not resident:
        return ""
    x = r["s_per_step"] / resident
    fmt, cfg, link = scenario(c)
    if (cfg, link, c["cap_gib"], r["tokens"]) == (5.0, "halved", 12, 7800):
        return f"x{x:.3f} resident ({'ok' if x <= 1.05 else 'MISSED'} <= 1.05, cfg 5 12 GiB halved)"
    if rate and r.get("h2d_bytes_per_step") is not None and r["h2d_bytes_per_step"] / 1e9 / rate < resident:
        return f"copies hide: x{x:.3f} resident ({'ok' if x <= 1.02 else 'MISSED'} <= 1.02)"
    return ""


def _lora_target(speeds: dict, c: dict, r: dict) -> str:
    """Issue 24: with a LoRA on every block linear, <= 1.03 x the same cell without it."""
    if not c.get("lora_rank"):
        return ""
    plain = speeds.get(scenario({**c, "lora_rank": 0}) + (c["config"], c["cap_gib"], r["tokens"]))
    if not plain:
        return "LoRA: no run without it to hold it to"
    x = r["s_per_step"] / plain
    return f"LoRA x{x:.3f} the same run without it ({'ok' if x <= 1.03 else 'MISSED'} <= 1.03)"


def _compress_target(speeds: dict, c: dict, r: dict) -> str:
    """Issue 29: with compress, <= 0.75 x the same RingSwap run without it where that run was
    copy-bound (over 1.05 x the resident run), else <= 1.01 x (no cost where copies hide)."""
    if not c.get("compress"):
        return ""
    without = {**c, "compress": None}
    plain = speeds.get(scenario(without) + (c["config"], c["cap_gib"], r["tokens"]))
    resident = uncapped(speeds, without, resident_of(CONFIGS[c["config"]]), r["tokens"])
    if not plain:
        return "compress: no run without it to hold it to"
    bound = 0.75 if resident and plain > 1.05 * resident else 1.01
    x = r["s_per_step"] / plain
    return (f"compress x{x:.3f} the same run without it {plain:.3f} ({'ok' if x <= bound else 'MISSED'} <= "
            f"{bound:g}, {'copy-bound' if bound < 1 else 'copies hide or no resident run to tell'})")


def _gguf_target(cells: list[dict], c: dict, r: dict) -> str:
    """Issue 27: a GGUF model at 8 GiB through RingSwap <= 0.8 x Unet Loader (GGUF) alone on the
    same ComfyUI version (its own offloading), at the same cap, cfg, link, LoRA and tokens."""
    if not scenario(c)[0].startswith("gguf") or c["cap_gib"] != 8:
        return ""
    for p, pr in _rows(cells, ("comfy",)):
        same = scenario(p) + (p["cap_gib"], pr["tokens"]) == scenario(c) + (c["cap_gib"], r["tokens"])
        if same and CONFIGS[p["config"]].comfy == CONFIGS[c["config"]].comfy:
            x = r["s_per_step"] / pr["s_per_step"]
            return f"x{x:.3f} Unet Loader (GGUF) alone {pr['s_per_step']:.3f} ({'ok' if x <= 0.8 else 'MISSED'} <= 0.8)"
    return ""


def _same_call(cells: list[dict], c: dict, r: dict, config: str) -> dict | None:
    """The row of `config` measured in the same call (run) as `c`, at its cap, format, cfg, link
    and tokens, whose prompt paid the load as `r`'s did; None where there is none."""
    key = scenario(c) + (c["cap_gib"], r["tokens"], r.get("ttfs_load"))
    for p in cells:
        if p["config"] == config and c.get("run") and p.get("run") == c["run"]:
            for pr in p.get("rows", []):
                if scenario(p) + (p["cap_gib"], pr["tokens"], pr.get("ttfs_load")) == key and pr.get("ttfs_s"):
                    return pr
    return None


def _read_bound(c: dict, r: dict) -> str:
    """TTFS against reading the file at its run's best rate plus one steady step: warm, from the
    page cache into pinned memory (<= 1.3 x); --cold, the disk's O_DIRECT rate (<= 1.15 x)."""
    rates, cold = c.get("read_rates") or {}, bool(c.get("cold"))
    rate = rates.get("odirect_best_gbps" if cold else "pinned_best_gbps")
    what, limit = ("O_DIRECT", 1.15) if cold else ("pinned read", 1.3)
    if not rate:
        return f"no {what} rate measured in this call to hold TTFS to"
    bound = rates["file_bytes"] / 1e9 / rate + r["s_per_step"]
    x = r["ttfs_s"] / bound
    return (f"x{x:.2f} the read bound {bound:.2f} s ({rates['file_bytes'] / 1e9:.1f} GB at the best {what} "
            f"{rate:.2f} GB/s + one step {r['s_per_step']:.3f} s) ({'ok' if x <= limit else 'MISSED'} <= {limit:g})")


def _ttfs_line(cells: list[dict], c: dict, r: dict) -> str:
    """Issue 53, a RingSwap row whose prompt paid the node's load: TTFS against ComfyUI dynamic
    VRAM's in the same call and against the read bound; the first prompt's wall against
    ComfyUI dynamic VRAM's. Without that cell in the call, the line says so."""
    fmt, cfg, link = scenario(c)
    cold = bool(c.get("cold"))
    head = (f"- TTFS {fmt} cfg {cfg:g} link {link} {c['cap_gib']:g} GiB {c['config']} {r['tokens']:,} tokens: "
            f"TTFS {r['ttfs_s']:.2f} s, first prompt {r['first_prompt_s']:.1f} s ({r.get('prompt_steps')} steps): ")
    ref = _same_call(cells, c, r, TTFS_REF)
    if ref is None:
        return head + f"no {TTFS_REF} cell in this call at {c['cap_gib']:g} GiB to hold it to; " + _read_bound(c, r)
    x, limit = r["ttfs_s"] / ref["ttfs_s"], 0.8 if cold else 0.6
    wall = r["first_prompt_s"] / ref["first_prompt_s"]
    return head + "; ".join([
        f"x{x:.2f} {TTFS_REF}'s TTFS {ref['ttfs_s']:.2f} s ({'ok' if x <= limit else 'MISSED'} <= {limit:g}, "
        f"{'cold' if cold else 'warm'})", _read_bound(c, r),
        f"first prompt x{wall:.2f} {TTFS_REF}'s {ref['first_prompt_s']:.1f} s ({'ok' if wall <= 0.9 else 'MISSED'} <= 0.9)"])


def _stock_ttfs(cells: list[dict], c: dict, r: dict) -> str:
    """The Patch on a stock MODEL (no dynamic VRAM: it starts from ComfyUI's own load): its TTFS
    against that stock MODEL's own in the same call (<= 1.1 x); "" for any other row."""
    cfg = CONFIGS[c["config"]]
    if cfg.kind != "patch" or cfg.dynamic:
        return ""
    stock = "comfy-" + cfg.comfy
    ref = _same_call(cells, c, r, stock)
    if ref is None:
        return f"no {stock} cell in this call to hold it to"
    x = r["ttfs_s"] / ref["ttfs_s"]
    return f"x{x:.2f} {stock}'s own TTFS {ref['ttfs_s']:.2f} s ({'ok' if x <= 1.1 else 'MISSED'} <= 1.1, stock MODEL)"


def _has_ttfs(c: dict, r: dict) -> bool:
    """A row held to the TTFS targets: its prompt paid the load, from the run's page cache (not
    home=disk nor under a RAM ballast, which drop it themselves)."""
    return (r.get("ttfs_load") and r.get("ttfs_s") is not None and r.get("first_prompt_s") is not None
            and CONFIGS[c["config"]].kind != "disk" and not c.get("ram_gb"))


def targets(cells: list[dict], link_gbps: float | None, workers: int = 8) -> str:
    """One line per RingSwap row under a cap, every target it is held to; a TTFS line under it
    where its prompt paid the load."""
    speeds = speeds_of(cells)
    lines = []
    for c, r in _rows(cells, RINGSWAP):
        s = r["s_per_step"]
        resident = uncapped(speeds, c, resident_of(CONFIGS[c["config"]]), r["tokens"])
        fmt, cfg, link = scenario(c)
        rate = c.get("h2d_left_gbps") or link_gbps
        if CONFIGS[c["config"]].kind == "disk":   # bound by the disk, not by the link or a peer
            bits = [_disk(c, r), _rss(c, r, workers)]
        elif c.get("ram_gb"):   # a smaller machine: held to home=ram and the disk
            bits = _ram_targets(speeds, c, r)
        else:
            bits = []
            if resident and c["cap_gib"] == 24 and cfg == 1 and link == "full":
                x = s / resident
                bits.append(f"x{x:.3f} resident ({'ok' if x <= 1.01 else 'MISSED'} <= 1.01)")
            bits += [_resident_targets(c, r, resident, rate), _lora_target(speeds, c, r), _gguf_target(cells, c, r),
                     _compress_target(speeds, c, r)]
            bits += _peers(cells, c, r) + [_link(c, r, resident, rate), _rss(c, r, workers)]
        bits = [b for b in bits if b]
        lines.append(f"- {fmt} cfg {cfg:g} link {link} {c['cap_gib']:g} GiB {c['config']} {r['tokens']:,} tokens "
                     f"{s:.3f} s/step: " + "; ".join(bits))
        if _has_ttfs(c, r):
            lines.append("; ".join(b for b in (_ttfs_line(cells, c, r), _stock_ttfs(cells, c, r)) if b))
    return "\n".join(lines)


def missed(judged: str) -> list[str]:
    """The target lines of `targets(...)` that read MISSED (compare.py then exits non-zero)."""
    return [ln for ln in judged.splitlines() if "MISSED" in ln]
