"""stream.py's targets (issue 3) and its report: the files, one row per format, home and token
count, the home=disk RAM growth, what was skipped, and PASS/FAIL per target."""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]   # bench/probes/ (stream_*.py) and bench/ (common and its support)
from common import T0, fmt_num, gb  # noqa: E402
from stream_home import compute_note  # noqa: E402


def judge(rows: list, files: dict, h2d: dict, a) -> list:
    """Issue 3's targets of the rows (their ratios written into the rows too): disk reads at
    >= --target of the O_DIRECT rate; home=ram at --ram-target-tokens >= --target of the
    pinned host->GPU rate per step wall time."""
    targets = []
    for r in rows:
        if "error" in r:
            continue
        if r["home"] == "disk":
            od = files.get(r["format"], {}).get("odirect", {}).get("gbps")
            if r.get("odirect_now"):   # measured next to the row: the better reference
                od = max(x["gbps"] for x in r["odirect_now"])
            if od and r.get("read_gbps") is not None:
                r["odirect_ref_gbps"] = od
                r["read_vs_odirect"] = r["read_gbps"] / od
                targets.append({"format": r["format"], "home": "disk", "tokens": r["tokens"],
                                "what": "disk read rate / O_DIRECT rate", "value": r["read_vs_odirect"],
                                "pass": r["read_vs_odirect"] >= a.target})
        else:
            r["h2d_vs_pinned"] = r["h2d_gbps"] / h2d["gbps"]
            r["copy_vs_pinned"] = r["copy_gbps"] / h2d["gbps"]
            if r["tokens"] == a.ram_target_tokens:
                targets.append({"format": r["format"], "home": "ram", "tokens": r["tokens"],
                                "what": "host->GPU bytes per step wall / pinned rate", "value": r["h2d_vs_pinned"],
                                "pass": r["h2d_vs_pinned"] >= a.target,
                                "note": f"copy stream alone {100 * r['copy_vs_pinned']:.0f}% "
                                        f"({r['copy_gbps']:.1f} GB/s while copying)" + compute_note(r, h2d)})
    return targets


def _files_table(a, files: dict, h2d: dict) -> None:
    """Each format's file (size, the disk's O_DIRECT rate over it, write rate) and the link."""
    print("\n| format | file GB | O_DIRECT GB/s | write GB/s |", flush=True)
    print("| --- | --- | --- | --- |")
    for fmt, f in files.items():
        if "error" in f and "bytes" not in f:
            print(f"| {fmt} | error: {f['error']} | | |")
            continue
        od = f.get("odirect", {})
        print(f"| {fmt} | {gb(f['bytes']):.2f} | {fmt_num(od.get('gbps'))} ({od.get('mode', '—')}) | "
              f"{'reused' if f.get('reused') else fmt_num(f.get('write_gbps'))} |")
    print(f"\npinned host->GPU: {h2d['gbps']:.1f} GB/s ({a.h2d_mib} MiB, median of 5)"
          if h2d["pinned"] else f"\nhost copy (no GPU): {h2d['gbps']:.1f} GB/s")


def _rows_table(rows: list) -> None:
    """One row per format, home and token count."""
    print("\n| format | home | tokens | s/step (median) | copy GB/s | read GB/s (vs O_DIRECT) "
          "| host->GPU GB/s per step (vs pinned) | load s (GB/s) + load_models_gpu s | RSS before -> peak GB | VmHWM GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['format']} | {r['home']} | {r.get('tokens', '—')} | error: {r['error'][:120]} | | | | | | |")
            continue
        read = (f"{r['read_gbps']:.2f} ({100 * r['read_vs_odirect']:.0f}% of {r['odirect_ref_gbps']:.2f})"
                if r.get("read_vs_odirect") is not None
                else "—")
        h2 = (f"{r['h2d_gbps']:.1f} ({100 * r['h2d_vs_pinned']:.0f}%)" if r["home"] == "ram" else
              f"{r['h2d_gbps']:.1f}")
        load = (f"{r['load_s']:.1f}" + (f" ({r['load_gbps']:.2f})" if r.get("load_gbps") else "")
                + f" + {r['attach_s']:.1f}")
        if r["home"] == "disk" and r.get("disk_bound_s_per_step"):
            load += f"; steady ~{r['disk_bound_s_per_step']:.2f} s/step"
        print(f"| {r['format']} | {r['home']} | {r['tokens']} | {r['median_s']:.3f} | {r['copy_gbps']:.1f} | {read} "
              f"| {h2} | {load} | {gb(r['rss_before_load']):.1f} -> {gb(r.get('rss_peak_config', r['rss_peak'])):.1f} "
              f"| {gb(r['vmhwm'] or 0):.1f} |")


def report(a, files: dict, rows: list, skipped: list, targets: list, h2d: dict) -> None:
    """Print the tables, the home=disk RAM growth, what was skipped, and the targets."""
    _files_table(a, files, h2d)
    _rows_table(rows)
    disk_rows = [r for r in rows if r.get("home") == "disk" and "error" not in r]
    if disk_rows:
        print("\nhome=disk host RAM growth during the run (peak RSS - RSS before load) vs the issue's bound "
              "(window + prefetch + disk_workers) blocks:")
        for r in disk_rows:
            grow = r.get("rss_peak_config", r["rss_peak"]) - r["rss_before_load"]
            print(f"- {r['format']} tokens={r['tokens']}: {gb(grow):.2f} GB vs {gb(r['rss_bound_bytes']):.2f} GB "
                  f"({grow / r['block_bytes']:.1f} of {r['rss_bound_bytes'] // r['block_bytes']} blocks)")
    if skipped:
        print("\nskipped:")
        for s in skipped:
            print(f"- {s['reason']}")
    print("\ntargets (issue 3):")
    if not targets:
        print("- none measured")
    for t in targets:
        print(f"- {'PASS' if t['pass'] else 'FAIL'} {t['format']} home={t['home']} tokens={t['tokens']}: "
              f"{t['what']} = {100 * t['value']:.0f}% (target >= {100 * a.target:.0f}%)"
              + (f"; {t['note']}" if t.get("note") else ""))
    methods = sorted({r.get("load_cache_drop") for r in rows if r.get("load_cache_drop")}
                     | {r.get("cache_drop") for r in rows if r.get("cache_drop")})
    print(f"page cache dropped with: {', '.join(methods) or '—'}; total {time.perf_counter() - T0:.0f} s", flush=True)
