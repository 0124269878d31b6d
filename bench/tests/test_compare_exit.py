"""compare.py exits non-zero (MISSED_EXIT) when a target line of its report reads MISSED, and 0
when none does: its --merge report, run as a process on result JSON recorded on the H200
(bench/results/), and in-process on a recorded cell made to miss its target."""
import copy
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(BENCH)   # last: nothing here may shadow tests/comfyui/support

import compare  # noqa: E402
import compare_targets  # noqa: E402

RESULTS = os.path.join(BENCH, "results")


def _merge(tmp_path, *names: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, os.path.join(BENCH, "compare.py"), "--merge", *(os.path.join(RESULTS, n) for n in names),
           "--json", str(tmp_path / "all.json"), "--md", str(tmp_path / "all.md")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("names, status", [
    # 12 target lines, 6 MISSED (e.g. rs-patch-0.3.75 at 24 GiB, 7,800 tokens: x1.023 resident, MISSED <= 1.01)
    (("compare_bf16_2026-12-01.json",), compare.MISSED_EXIT),
    # 8 target lines, none MISSED
    (("compare_bf16_lease2_2026-12-01.json",), 0),
    # one report of both: a miss in any part of it fails the whole
    (("compare_bf16_lease2_2026-12-01.json", "compare_bf16_2026-12-01.json"), compare.MISSED_EXIT),
])
def test_the_merged_report_exits_non_zero_where_a_target_is_missed(tmp_path, names, status):
    p = _merge(tmp_path, *names)
    assert p.returncode == status, p.stderr[-2000:]
    report = (tmp_path / "all.md").read_text()
    lines = report.split("\nTargets:\n", 1)[1].splitlines()
    misses = [ln for ln in lines if "MISSED" in ln]
    assert bool(misses) == bool(status) and "\nTargets:\n" in p.stdout
    for ln in misses:   # each missed target line is named on stderr
        assert ln in p.stderr
    if not status:
        assert len(lines) == 8 and "MISSED" not in p.stderr


def test_one_missed_target_turns_a_clean_report_into_a_failure(tmp_path):
    """The recorded report without a miss, then the same with one row holding 1.2 x the file in
    RAM (target <= 1.05 x): the exit status follows the target line."""
    with open(os.path.join(RESULTS, "compare_bf16_lease2_2026-12-01.json")) as f:
        data = json.load(f)
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps(data))
    assert compare.main(["--merge", str(clean), "--json", str(tmp_path / "out.json")]) == 0
    heavy = copy.deepcopy(data)
    rs = next(c for c in heavy["cells"] if (c["config"], c["cap_gib"]) == ("rs-loader-0.3.75", 12.0))
    rs["rows"][0]["rss_steady"] = rs.get("rss_base", 0) + 1.2 * rs["file_bytes"]
    missed = tmp_path / "missed.json"
    missed.write_text(json.dumps(heavy))
    assert compare.main(["--merge", str(missed), "--json", str(tmp_path / "out.json")]) == compare.MISSED_EXIT
    judged = json.loads((tmp_path / "out.json").read_text())["table"].split("\nTargets:\n", 1)[1]
    assert compare_targets.missed(judged) == [
        next(ln for ln in judged.splitlines() if "12 GiB rs-loader-0.3.75 7,800 tokens" in ln)]
    assert "RSS 1.20 x file (MISSED <= 1.05)" in compare_targets.missed(judged)[0]
