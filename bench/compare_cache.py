"""compare.py's page cache before each cell and the run's read rates (issue 53: the time to the
first step). A warm run reads the model file once, whole, before each cell, so every cell starts
from the same page-cache state; --cold drops the page cache before each cell instead. Once per
format and run: the rate of reading the warm file into pinned memory (best of 1, 4, 8, 16
threads) and with --cold the disk's O_DIRECT rate (best of 1, 4, 8 threads), the bounds TTFS is
held to (compare_targets). The disk and RAM-ballast cells keep their own cache drops."""
from __future__ import annotations

import os

from common import gb, say
from compare_child import CONFIGS

PINNED_THREADS = (1, 4, 8, 16)
ODIRECT_THREADS = (1, 4, 8)
WARM_THREADS = 8


def drop_mode(a) -> str:
    """root (write /proc/sys/vm/drop_caches, fail where refused) on the device; a CPU check of
    the code paths evicts the file alone (posix_fadvise), leaving the machine's cache be."""
    return "fadvise" if a.small or a.device == "cpu" else "root"


def read_rates(a, path: str) -> dict:
    """The file's read rates, measured now: into pinned memory from the page cache over
    --pinned-gb (read once first, so that part is warm); with --cold also the disk's O_DIRECT
    rate over --odirect-gb."""
    from io_rates import odirect_rate, pinned_read_rate, warm_read
    limit = int(a.pinned_gb * 1e9)
    warm_read(path, WARM_THREADS, limit)
    pinned = [pinned_read_rate(path, limit, t) for t in PINNED_THREADS]
    out = {"file_bytes": os.path.getsize(path), "pinned": pinned, "pinned_best_gbps": max(p["gbps"] for p in pinned)}
    if a.cold:
        direct = [odirect_rate(path, int(a.odirect_gb * 1e9), True, drop_mode(a), t) for t in ODIRECT_THREADS]
        out.update(odirect=direct, odirect_best_gbps=max(o["gbps"] for o in direct))
    say("[compare] " + reads_text(out))
    return out


def compact(rates: dict) -> dict:
    """What a cell keeps of its run's read rates (a --merge of several runs keeps each cell's)."""
    out = {k: v for k, v in rates.items() if k in ("file_bytes", "pinned_best_gbps", "odirect_best_gbps")}
    for k in ("pinned", "odirect"):
        if k in rates:
            out[k + "_gbps"] = [[r["threads"], round(r["gbps"], 3)] for r in rates[k]]
    return out


def _rates(pairs: list, what: str) -> str:
    best = max(g for _, g in pairs)
    return (f"{what} " + " / ".join(f"{g:.2f}" for _, g in pairs) + " GB/s ("
            + " / ".join(str(t) for t, _ in pairs) + f" threads, best {best:.2f})")


def reads_text(rates: dict) -> str:
    """One line of a file's read rates (full or compact)."""
    r = compact(rates) if "pinned" in rates else rates
    bits = [_rates(r["pinned_gbps"], "page cache -> pinned memory")] if r.get("pinned_gbps") else []
    if r.get("odirect_gbps"):
        bits.append(_rates(r["odirect_gbps"], "disk O_DIRECT"))
    return f"reads of the {gb(r['file_bytes']):.1f} GB file: " + "; ".join(bits)


def header(cells: list[dict]) -> str:
    """The report's lines above the table: per run and format, its page-cache state and read
    rates; empty for runs without them (before issue 53)."""
    seen, lines = set(), []
    for c in cells:
        if c.get("read_rates") and (c.get("run"), c["format"]) not in seen:
            seen.add((c.get("run"), c["format"]))
            cache = "cold (page cache dropped before each cell)" if c.get("cold") else \
                "warm (the file read whole before each cell)"
            lines.append(f"Run {c.get('run')}, {c['format']}, {cache}: {reads_text(c['read_rates'])}")
    return "\n".join(lines) + "\n\n" if lines else ""


def prepare(a, cell: dict, path: str) -> None:
    """The page cache before `cell`: dropped (--cold) or the file read whole (warm); the disk and
    RAM-ballast cells drop it themselves and are left alone."""
    if CONFIGS[cell["config"]].kind == "disk" or cell.get("ram_gb"):
        return
    from io_rates import drop_page_cache, warm_read
    if a.cold:
        cell["page_cache"] = "cold: " + drop_page_cache(path, drop_mode(a))
    else:
        w = warm_read(path, WARM_THREADS)
        cell["page_cache"] = f"warm: read {gb(w['bytes']):.1f} GB in {w['seconds']:.1f} s ({w['gbps']:.1f} GB/s)"
