"""compare.py's time to the first step and first prompt (issue 53): the table's TTFS and
first-prompt columns and the report's header of read rates from crafted cells, the TTFS target
lines (ok, MISSED, or no same-call reference to hold them to) and the exit status they give,
--cold / --prompt-steps / the older --steps, and the page-cache helpers on a small file."""
import copy
import os
import sys

import pytest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(BENCH)   # last: nothing here may shadow tests/comfyui/support

import compare  # noqa: E402
import compare_cache  # noqa: E402
import compare_table  # noqa: E402
import compare_targets  # noqa: E402
from merged import merged  # noqa: E402

RUN = "2026-12-06 09:00:00 pid 1"
RATES = {"file_bytes": 28.6e9, "pinned_best_gbps": 10.0, "pinned_gbps": [[1, 4.0], [4, 9.0], [8, 10.0], [16, 9.5]]}


def _cell(config: str, ttfs: float, wall: float, s: float = 1.0, **extra) -> dict:
    """A measured cell at 12 GiB, cfg 5, halved link: a 7,800-token first workload that paid the
    load and a 32,760-token one after it, 20-step prompts."""
    rows = [{"tokens": 7800, "s_per_step": s, "first_step_s": ttfs - 1.0, "ttfs_s": ttfs, "ttfs_load": True,
             "first_prompt_s": wall, "prompt_steps": 20},
            {"tokens": 32760, "s_per_step": 4 * s, "first_step_s": 5.0, "ttfs_s": 5.0, "ttfs_load": False,
             "first_prompt_s": 5.0 + 19 * 4 * s, "prompt_steps": 20}]
    return {"format": "bf16", "cfg": 5.0, "link": "halved", "config": config, "cap_gib": 12.0, "run": RUN,
            "read_rates": dict(RATES), "load_s": 1.0, "file_bytes": 28.6e9, "rows": rows, **extra}


def _line(text: str, head: str) -> str:
    found = [ln for ln in text.splitlines() if ln.startswith(head)]
    assert len(found) == 1, (head, text)
    return found[0]


RS_ROW = "| bf16, cfg 5, link halved | 12 | rs-patch-0.33-dyn: RingSwap Patch, auto window, ComfyUI 0.33 dynamic | "
TTFS_HEAD = "- TTFS bf16 cfg 5 link halved 12 GiB rs-patch-0.33-dyn 7,800 tokens: "


def test_the_table_has_ttfs_and_the_first_prompt_beside_s_per_step():
    cells = [_cell("comfy-0.33-dyn", 30.0, 55.0, 1.2), _cell("rs-patch-0.33-dyn", 12.34, 32.1, 1.05)]
    out = compare_table.table(cells)
    head = out.splitlines()[0]
    assert "| s/step | x floor | x ComfyUI resident | TTFS s | first prompt s (20 steps) | first step s |" in head
    assert "| 7,800 | 1.050 | — | — | 12.34 | 32.1 | 11.34 |" in _line(out, RS_ROW + "7,800 |")
    later = _line(out, RS_ROW + "32,760 |")
    assert "| 5.00 (no load) | 84.8 (no load) |" in later


def test_a_prompt_of_another_length_says_so_and_older_cells_show_dashes():
    disk = _cell("rs-disk-0.3.75", 40.0, 45.0)
    disk["rows"] = [dict(disk["rows"][0], prompt_steps=2)]
    old = _cell("comfy-0.3.75", 1.0, 1.0)
    for r in old["rows"]:   # a cell measured before issue 53
        for k in ("ttfs_s", "ttfs_load", "first_prompt_s", "prompt_steps"):
            r.pop(k)
    out = compare_table.table([_cell("comfy-0.33-dyn", 30.0, 55.0), _cell("rs-patch-0.33-dyn", 12.0, 32.0), disk, old])
    assert "| first prompt s (20 steps) |" in out.splitlines()[0]
    assert "| 40.00 | 45.0 (2 steps) |" in _line(out, "| bf16, cfg 5, link halved | 12 | rs-disk-0.3.75")
    assert "| — | — |" in _line(out, "| bf16, cfg 5, link halved | 12 | comfy-0.3.75: ComfyUI 0.3.75 (no cap: "
                                   "resident; cap: native partial load) | 7,800 |")


def test_the_header_gives_the_runs_read_rates_and_cache_state():
    warm = compare_cache.header([_cell("rs-patch-0.33-dyn", 12.0, 32.0)])
    assert warm == (f"Run {RUN}, bf16, warm (the file read whole before each cell): reads of the 28.6 GB file: page "
                    "cache -> pinned memory 4.00 / 9.00 / 10.00 / 9.50 GB/s (1 / 4 / 8 / 16 threads, best 10.00)\n\n")
    cold = _cell("rs-patch-0.33-dyn", 12.0, 32.0, cold=True)
    cold["read_rates"].update(odirect_best_gbps=2.0, odirect_gbps=[[1, 2.0], [4, 1.8], [8, 1.6]])
    text = compare_cache.header([cold])
    assert "bf16, cold (page cache dropped before each cell)" in text
    assert "; disk O_DIRECT 2.00 / 1.80 / 1.60 GB/s (1 / 4 / 8 threads, best 2.00)" in text
    assert compare_cache.header([{k: v for k, v in cold.items() if k != "read_rates"}]) == ""


@pytest.mark.parametrize("ttfs, wall, cold, says", [
    # 28.6 GB at 10 GB/s + one 1.05 s step = 3.91 s; ComfyUI dynamic VRAM: TTFS 30 s, first prompt 55 s
    (4.5, 32.0, False, ["x0.15 comfy-0.33-dyn's TTFS 30.00 s (ok <= 0.6, warm)",
                        "x1.15 the read bound 3.91 s (28.6 GB at the best pinned read 10.00 GB/s + one step 1.050 s) "
                        "(ok <= 1.3)", "first prompt x0.58 comfy-0.33-dyn's 55.0 s (ok <= 0.9)"]),
    (21.0, 52.0, False, ["x0.70 comfy-0.33-dyn's TTFS 30.00 s (MISSED <= 0.6, warm)", "(MISSED <= 1.3)",
                         "first prompt x0.95 comfy-0.33-dyn's 55.0 s (MISSED <= 0.9)"]),
    # cold: 28.6 GB at O_DIRECT 2 GB/s + one step = 15.35 s
    (21.0, 45.0, True, ["x0.70 comfy-0.33-dyn's TTFS 30.00 s (ok <= 0.8, cold)",
                        "x1.37 the read bound 15.35 s (28.6 GB at the best O_DIRECT 2.00 GB/s + one step 1.050 s) "
                        "(MISSED <= 1.15)"]),
])
def test_ttfs_lines_hold_ringswap_to_comfyui_dynamic_vram_and_the_read_bound(ttfs, wall, cold, says):
    extra = {"cold": True} if cold else {}
    ref, rs = _cell("comfy-0.33-dyn", 30.0, 55.0, 1.2, **extra), _cell("rs-patch-0.33-dyn", ttfs, wall, 1.05, **extra)
    if cold:
        rs["read_rates"]["odirect_best_gbps"] = 2.0
    lines = compare_targets.targets([ref, rs], None)
    line = _line(lines, TTFS_HEAD.replace("bf16", "bf16, cold") if cold else TTFS_HEAD)
    assert f"TTFS {ttfs:.2f} s, first prompt {wall:.1f} s (20 steps): " in line
    for s in says:
        assert s in line, line
    assert "- TTFS bf16 cfg 5 link halved 12 GiB rs-patch-0.33-dyn 32,760" not in lines   # no load: no TTFS targets
    assert (line in compare_targets.missed(lines)) == ("MISSED" in " ".join(says))


@pytest.mark.parametrize("change", ["other run", "other cap", "absent"])
def test_without_a_same_call_reference_the_line_says_so(change):
    ref, rs = _cell("comfy-0.33-dyn", 30.0, 55.0), _cell("rs-patch-0.33-dyn", 4.5, 32.0, 1.05)
    cells = {"other run": [dict(ref, run="another call"), rs], "other cap": [dict(ref, cap_gib=24.0), rs],
             "absent": [rs]}[change]
    lines = compare_targets.targets(cells, None)
    line = _line(lines, TTFS_HEAD)
    assert "no comfy-0.33-dyn cell in this call at 12 GiB to hold it to; x1.15 the read bound" in line
    assert "first prompt x" not in line and "MISSED" not in line and not compare_targets.missed(lines)


def test_without_read_rates_the_bound_is_not_judged():
    rs = _cell("rs-loader-0.3.75", 4.5, 32.0)
    del rs["read_rates"]
    line = _line(compare_targets.targets([_cell("comfy-0.33-dyn", 30.0, 55.0), rs], None), "- TTFS bf16")
    assert "no pinned read rate measured in this call to hold TTFS to" in line
    assert "x0.15 comfy-0.33-dyn's TTFS" in line   # the 0.3.75 Loader is held to it too


@pytest.mark.parametrize("ttfs, says", [(14.0, "x0.93 comfy-0.3.75's own TTFS 15.00 s (ok <= 1.1, stock MODEL)"),
                                         (17.0, "x1.13 comfy-0.3.75's own TTFS 15.00 s (MISSED <= 1.1, stock MODEL)")])
def test_the_patch_on_a_stock_model_is_held_to_that_models_own_ttfs(ttfs, says):
    cells = [_cell("comfy-0.33-dyn", 30.0, 55.0), _cell("comfy-0.3.75", 15.0, 40.0), _cell("rs-patch-0.3.75", ttfs, 35.0)]
    lines = compare_targets.targets(cells, None)
    line = _line(lines, "- TTFS bf16 cfg 5 link halved 12 GiB rs-patch-0.3.75 7,800 tokens: ")
    assert line.endswith(says) and "comfy-0.33-dyn's TTFS 30.00 s" in line
    assert "MISSED" not in says or line in compare_targets.missed(lines)
    assert "stock MODEL" not in _line(compare_targets.targets([_cell("rs-patch-0.33-dyn", 4.0, 30.0)], None), TTFS_HEAD)
    alone = _line(compare_targets.targets([_cell("rs-patch-0.3.75", ttfs, 35.0)], None), "- TTFS bf16")
    assert alone.endswith("no comfy-0.3.75 cell in this call to hold it to")


def test_the_patch_on_0_33_without_dynamic_vram_is_held_to_that_stock_models_ttfs():
    """0.33 with dynamic VRAM disabled gives the Patch a stock MODEL too: held to comfy-0.33's own TTFS."""
    cells = [_cell("comfy-0.33", 15.0, 40.0), _cell("rs-patch-0.33", 16.0, 35.0)]
    line = _line(compare_targets.targets(cells, None), "- TTFS bf16 cfg 5 link halved 12 GiB rs-patch-0.33 7,800 tokens: ")
    assert line.endswith("x1.07 comfy-0.33's own TTFS 15.00 s (ok <= 1.1, stock MODEL)")


def test_a_missed_ttfs_target_fails_the_merged_report(tmp_path):
    good = {"env": {}, "cells": [_cell("comfy-0.33-dyn", 30.0, 55.0), _cell("rs-patch-0.33-dyn", 4.5, 32.0, 1.05)]}
    bad = copy.deepcopy(good)
    bad["cells"][1]["rows"][0]["ttfs_s"] = 25.0
    for data, status in ((good, 0), (bad, compare.MISSED_EXIT)):
        got, out = merged(tmp_path, data)
        assert got == status
        report = out["table"]
        assert report.startswith(f"Run {RUN}, bf16, warm") and "| TTFS s | first prompt s (20 steps) |" in report


def test_rounds_join_ttfs_and_the_prompts_wall_into_their_medians():
    rounds = [dict(_cell("rs-patch-0.33-dyn", t, w), round=i) for i, (t, w) in enumerate([(5.0, 30.0), (7.0, 33.0),
                                                                                         (6.0, 31.0)])]
    row = compare_table.rounds_joined(rounds)[0]["rows"][0]
    assert (row["ttfs_s"], row["first_prompt_s"]) == (6.0, 31.0)


@pytest.mark.parametrize("argv, steps", [([], 20), (["--prompt-steps", "5"], 5), (["--steps", "4"], 5),
                                         (["--steps", "4", "--prompt-steps", "5"], 5)])
def test_prompt_steps_and_the_older_steps_parse(argv, steps):
    a = compare.parser().parse_args(argv)
    assert compare.prompt_steps(a) == steps and a.cold is False


@pytest.mark.parametrize("argv, says", [(["--steps", "4", "--prompt-steps", "6"], "give one of them"),
                                        (["--prompt-steps", "1"], "2 or more")])
def test_prompt_steps_that_disagree_or_leave_no_steady_step_are_refused(argv, says):
    with pytest.raises(SystemExit, match=says):
        compare.prompt_steps(compare.parser().parse_args(argv))


def test_cold_marks_the_cells_and_the_child_gets_the_prompts_length():
    a = compare.parser().parse_args(["--cold", "--prompt-steps", "7", "--configs", "comfy-0.33-dyn@12",
                                     "rs-patch-0.33-dyn@12", "--formats", "bf16", "--tokens", "7800"])
    a.prompt_steps, a.steps, a.caps = compare.prompt_steps(a), None, [12.0]
    cells = compare.plan_cells(a)
    assert [c.get("cold") for c in cells] == [True, True]
    assert compare_table.scenario(cells[0])[0] == "bf16, cold"
    cmd, _ = compare.child_command(a, cells[1], "/tmp/x.safetensors")
    assert cmd[cmd.index("--prompt-steps") + 1] == "7" and "--steps" not in cmd and "--cold" not in cmd
    warm = compare.estimate(dict(cells[1], cold=None), {}, a)
    assert compare.estimate(cells[1], {}, a) == pytest.approx(warm + 28.6 / 1.5 - 28.6 / 8.0)


def test_page_cache_helpers_on_a_small_file(tmp_path, monkeypatch):
    import io_rates
    path = tmp_path / "model.safetensors"
    path.write_bytes(os.urandom(3 << 20))
    a = compare.parser().parse_args(["--small", "--device", "cpu", "--pinned-gb", "0"])
    rates = compare_cache.read_rates(a, str(path))
    assert [p["threads"] for p in rates["pinned"]] == [1, 4, 8, 16] and "odirect" not in rates
    assert all(p["bytes"] == 3 << 20 for p in rates["pinned"])
    assert rates["pinned_best_gbps"] == max(p["gbps"] for p in rates["pinned"])
    cell = {"config": "rs-patch-0.33-dyn"}
    compare_cache.prepare(a, cell, str(path))
    assert cell["page_cache"].startswith("warm: read 0.0 GB in ")
    dropped = []
    monkeypatch.setattr(io_rates, "drop_page_cache", lambda p, mode: dropped.append((p, mode)) or "fadvise")
    a.cold = True
    compare_cache.prepare(a, cell, str(path))
    assert cell["page_cache"] == "cold: fadvise" and dropped == [(str(path), "fadvise")]
    disk = {"config": "rs-disk-0.3.75"}
    compare_cache.prepare(a, disk, str(path))   # the disk cells drop the cache themselves
    assert "page_cache" not in disk and len(dropped) == 1
