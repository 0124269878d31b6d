"""compare.py's workflow cell (issue 53): its table and target lines from crafted cells (ok,
MISSED, a reference or a number missing) and the exit status they give, the outputs compared
against ComfyUI alone's, its options and cells, and the child's figures and KSamplerAdvanced
split with a stand-in sampler (no ComfyUI)."""
import copy
import hashlib
import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(BENCH)   # last: nothing here may shadow tests/comfyui/support

import compare  # noqa: E402
import compare_plan  # noqa: E402
import compare_table  # noqa: E402
import compare_workflow  # noqa: E402
import compare_workflow_report as report  # noqa: E402
from merged import merged  # noqa: E402

RUN = "2026-12-07 09:00:00 pid 1"
SCENARIO = "bf16 + LoRA rank 64, Wan 2.2 workflow, 20 blocks"


def _row(first: float, nxt: float, steady: float = 2.0, placed=(5e9, 5e9), load: bool = True, **extra) -> dict:
    """A 32,760-token row of 4 + 4 steps: the two switch steps 0.6 and 0.5 s over the steady one."""
    steps = [steady + 0.6] + [steady] * 3 + [steady + 0.5] + [steady] * 3
    return {"tokens": 32760, "first_prompt_s": first, "ttfs_load": load, "first_prompt_steps": [9.0] + [steady] * 7,
            "next_prompt_s": nxt, "next_prompt_steps": steps, "prompt_steps": 8, "steady_s": steady,
            "s_per_step": steady, "steady_sum_s": 8 * steady, "first_step_extra_s": 0.6, "switch_extra_s": 0.5,
            "placed_bytes": list(placed), "resident_placed_bytes": None if None in placed else sum(placed),
            "rss_peak": 30e9, "pinned": {"total": 7e9}, "first_latent_sha256": "aa", "next_latent_sha256": "bb",
            **extra}


def _cell(config: str, row: dict, **extra) -> dict:
    return {"format": "bf16", "cfg": 1.0, "link": "halved", "config": config, "cap_gib": 12.0, "run": RUN,
            "workflow": True, "lora_rank": 64, "layers": 20, "load_s": 3.0, "h2d_left_gbps": 25.0,
            "rows": [row], **extra}


def _comfy(config: str = "comfy-0.33-dyn", first: float = 100.0, nxt: float = 40.0) -> dict:
    return _cell(config, _row(first, nxt, 2.4, placed=(None, None)))


def _line(text: str, head: str) -> str:
    found = [ln for ln in text.splitlines() if ln.startswith(head)]
    assert len(found) == 1, (head, text)
    return found[0]


RS_LINE = f"- {SCENARIO} cfg 1 link halved 12 GiB rs-patch-0.33-dyn 32,760 tokens: "


def test_the_workflow_table_has_its_own_columns():
    cells = [_comfy(), _cell("rs-patch-0.33-dyn", _row(60.0, 17.0, expert_pinned=[6e9, 6e9]))]
    report.outputs(cells)
    out = report.workflow_table(cells)
    assert ("| first prompt s (8 steps) | loads s | next prompt s | next x ComfyUI alone | steady s/step | "
            "switch steps +s (first / mid) | next prompt's steps s | output vs ComfyUI alone (first / next) | "
            "host RSS peak GB | pinned GB | note |") in out
    rs = _line(out, f"| {SCENARIO}, cfg 1, link halved | 12 | rs-patch-0.33-dyn: ")
    assert ("| 32,760 | 60.0 | 3.0 | 17.0 | 0.425 | 2.000 | +0.60 / +0.50 | 2.60 2.00 2.00 2.00 2.50 2.00 2.00 2.00 | "
            "equal (sha256) / equal (sha256) vs comfy-0.33-dyn | 30.0 | 7.0 |") in rs, rs
    assert "resident placed in the next prompt 5.0 + 5.0 GB" in rs and "pinned per expert 6.0 / 6.0 GB" in rs
    comfy = _line(out, f"| {SCENARIO}, cfg 1, link halved | 12 | comfy-0.33-dyn: ")
    assert "| 100.0 | 3.0 | 40.0 | — | 2.400 |" in comfy and "reference (sha256 aa / bb)" in comfy


def test_later_workloads_and_cells_not_run_read_so():
    later = _cell("rs-auto-0.3.75", _row(18.0, 17.0, load=False))
    skipped = dict(_comfy("comfy-0.3.75"), skipped="not run (budget): ~75 s > 20 s left")
    del skipped["rows"]
    report.outputs([later, skipped])
    out = report.workflow_table([later, skipped], small=True)
    assert "| 12 (not on CPU) | rs-auto-0.3.75: " in out
    row = _line(out, f"| {SCENARIO}, cfg 1, link halved | 12 (not on CPU) | rs-auto")
    assert "| 18.0 (no load) | — | 17.0 | — |" in row
    assert "| — | not run (budget): ~75 s > 20 s left |" in out
    assert "no comfy-0.3.75 cell in this call" in out


@pytest.mark.parametrize("first, nxt, says", [
    # bound: 8 steps at 2.0 s + 10 GB placed at 25 GB/s = 16.4 s; ComfyUI dynamic VRAM: 100 s / 40 s
    (60.0, 17.0, ["next prompt 17.0 s x1.037 the bound 16.4 s (8 steps at the steady step 16.0 s + 10.0 GB placed "
                  "at 25.0 GB/s) (ok <= 1.05)",
                  "first prompt 60.0 s x0.60 comfy-0.33-dyn's 100.0 s (ok <= 0.65, warm page cache)",
                  "next prompt x0.42 comfy-0.33-dyn's 40.0 s"]),
    (70.0, 17.5, ["next prompt 17.5 s x1.067 the bound 16.4 s", "(MISSED <= 1.05)",
                  "first prompt 70.0 s x0.70 comfy-0.33-dyn's 100.0 s (MISSED <= 0.65, warm page cache)"]),
])
def test_workflow_targets_read_ok_or_missed(first, nxt, says):
    lines = report.workflow_targets([_comfy(), _cell("rs-patch-0.33-dyn", _row(first, nxt))], None)
    line = _line(lines, RS_LINE)
    for s in says:
        assert s in line, line
    assert ("MISSED" in line) == any("MISSED" in s for s in says)
    assert not [ln for ln in lines.splitlines() if "comfy-0.33-dyn 32,760 tokens:" in ln]   # ComfyUI alone: no line


def test_without_the_reference_or_the_numbers_no_verdict_is_read():
    rs = _cell("rs-auto-0.3.75", _row(60.0, 30.0, placed=(None, 5e9)))
    rs.pop("h2d_left_gbps")
    line = _line(report.workflow_targets([rs], None), f"- {SCENARIO} cfg 1 link halved 12 GiB rs-auto-0.3.75")
    assert "next prompt 30.0 s: no bound (the resident bytes placed and a link rate not measured in this call)" in line
    assert "first prompt 60.0 s: no comfy-0.33-dyn workflow cell in this call at 12 GiB to hold it to" in line
    assert "no comfy-0.3.75 workflow cell in this call for the next prompt's ratio" in line and "MISSED" not in line
    other_call = dict(_comfy(), run="another call")
    line = report.workflow_targets([other_call, _cell("rs-patch-0.33-dyn", _row(90.0, 30.0))], 50.0)
    assert "no comfy-0.33-dyn workflow cell in this call" in line and "placed at 50.0 GB/s" not in line
    cold = _cell("rs-patch-0.33-dyn", _row(90.0, 16.0), cold=True)
    line = report.workflow_targets([dict(_comfy(), cold=True), cold], None)
    assert "x0.90 comfy-0.33-dyn's 100.0 s (cold page cache: the <= 0.65 target is for a warm one)" in line
    assert "MISSED" not in line


def test_the_link_rate_falls_back_to_the_runs_pinned_rate():
    rs = _cell("rs-patch-0.33-dyn", _row(60.0, 15.8))
    rs.pop("h2d_left_gbps")
    line = _line(report.workflow_targets([_comfy(), rs], 50.0), RS_LINE)
    assert "x0.975 the bound 16.2 s (8 steps at the steady step 16.0 s + 10.0 GB placed at 50.0 GB/s) (ok" in line


def _save(path, tensor) -> str:
    torch.save(tensor, path)
    return str(path)


def test_outputs_are_compared_with_comfyui_alone_of_the_same_version(tmp_path):
    x = torch.randn(1, 16, 2, 4, 4)
    y = x.clone()
    y[0, 0, 0, 0, 0] += 0.25
    ref = _comfy("comfy-0.3.75")
    ref["rows"][0]["latents"] = {"first": _save(tmp_path / "r1.pt", x), "next": _save(tmp_path / "r2.pt", x)}
    rs = _cell("rs-auto-0.3.75", _row(50.0, 17.0, latents={"first": _save(tmp_path / "a.pt", x.clone()),
                                                            "next": _save(tmp_path / "b.pt", y)}))
    other = _cell("rs-patch-0.33-dyn", _row(50.0, 17.0, next_latent_sha256="cc"))
    report.outputs([ref, rs, other, _comfy()])
    vs = rs["rows"][0]["output_vs"]
    assert vs["ref"] == "comfy-0.3.75" and vs["first"]["equal"] and vs["first"]["how"] == "torch.equal"
    assert not vs["next"]["equal"] and vs["next"]["max_abs_diff"] == pytest.approx(0.25)
    assert other["rows"][0]["output_vs"] == {"ref": "comfy-0.33-dyn", "first": {"equal": True, "how": "sha256"},
                                             "next": {"equal": False, "how": "sha256"}}
    words = report._output_words(rs, rs["rows"][0])
    assert words == "equal / differs: max abs 2.50e-01 vs comfy-0.3.75"
    lonely = _cell("rs-auto-0.33-dyn", _row(50.0, 17.0))
    report.outputs([lonely])
    assert lonely["rows"][0]["output_vs"] == {"ref": "comfy-0.33-dyn"}


def test_a_missed_workflow_target_fails_the_merged_report(tmp_path):
    good = {"env": {"h2d_gbps": 50.0}, "cells": [_comfy(), _cell("rs-patch-0.33-dyn", _row(60.0, 17.0))]}
    bad = copy.deepcopy(good)
    bad["cells"][1]["rows"][0]["next_prompt_s"] = 19.0
    for data, status in ((good, 0), (bad, compare.MISSED_EXIT)):
        got, out = merged(tmp_path, data)
        assert got == status
        assert out["table"].startswith("Workflow cells (Wan 2.2's two experts")
        assert "| s/step | x floor |" not in out["table"]   # no plain cells: no plain table
        assert "\nTargets:\n- bf16 + LoRA rank 64, Wan 2.2 workflow" in out["table"]
        assert out["cells"][1]["rows"][0]["output_vs"]["next"] == {"equal": True, "how": "sha256"}


def test_workflow_defaults_and_overrides():
    a = compare.parser().parse_args(["--workflow"])
    assert compare.prompt_steps(a) == 8
    compare.workflow_defaults(a)
    assert (a.tokens, a.caps, a.links, a.lora_rank, a.formats) == ([32760], [12], ["halved"], 64, ["bf16"])
    assert a.layers == 40
    a = compare.parser().parse_args(["--workflow", "--tokens", "7800", "--caps", "24", "--links", "full",
                                     "--lora-rank", "0", "--prompt-steps", "6", "--layers", "20"])
    assert compare.prompt_steps(a) == 6
    compare.workflow_defaults(a)
    assert (a.tokens, a.caps, a.links, a.lora_rank, a.layers) == ([7800], [24.0], ["full"], 0, 20)
    plain = compare.parser().parse_args([])
    compare.workflow_defaults(plain)
    assert (plain.lora_rank, plain.links, plain.tokens, plain.caps) == (0, ["full"], None, None)
    assert compare.prompt_steps(plain) == 20
    with pytest.raises(SystemExit, match="no GGUF formats"):
        compare.workflow_defaults(compare.parser().parse_args(["--workflow", "--formats", "gguf_q8_0"]))
    with pytest.raises(SystemExit, match="the GGUF writer writes the 40 blocks"):
        compare.workflow_defaults(compare.parser().parse_args(["--layers", "20", "--formats", "gguf_q4_k"]))
    with pytest.raises(SystemExit, match="does not compile"):
        compare.workflow_defaults(compare.parser().parse_args(["--workflow", "--compile", "inductor"]))


def _planned(argv: list[str]) -> tuple:
    a = compare.parser().parse_args(argv)
    a.prompt_steps, a.steps = compare.prompt_steps(a), None
    compare.workflow_defaults(a)
    return a, compare.plan_cells(a)


def test_workflow_cells_and_their_child_command():
    a, cells = _planned(["--workflow", "--layers", "20", "--dir", "/tmp/wfx"])
    expected = [(n, 12.0, "halved") for n, _ in compare_plan.WORKFLOW]
    assert [(c["config"], c["cap_gib"], c["link"]) for c in cells] == expected
    assert all(c["workflow"] and c["layers"] == 20 and c["lora_rank"] == 64 and "experts" not in c for c in cells)
    assert compare_table.scenario(cells[0]) == (SCENARIO, 1.0, "halved")
    cell = dict(cells[1], run="2026-12-07 09:00:00 pid 7")
    cmd, env = compare.child_command(a, cell, "/tmp/wfx/high.safetensors", "/tmp/wfx/low.safetensors")
    assert cmd[cmd.index("--child") + 1] == "rs-patch-0.33-dyn" and "--workflow" in cmd
    assert cmd[cmd.index("--low-path") + 1] == "/tmp/wfx/low.safetensors"
    assert cmd[cmd.index("--prompt-steps") + 1] == "8" and cmd[cmd.index("--lora-rank") + 1] == "64"
    assert cmd[cmd.index("--latent-dir") + 1].startswith("/tmp/wfx/latents/2026_12_07_09_00_00_pid_7/")
    assert env["RINGSWAP_DYNAMIC_VRAM"] == "1"
    plain_cmd, _ = compare.child_command(a, dict(cell, workflow=None), "/tmp/wfx/high.safetensors")
    assert "--low-path" not in plain_cmd and "--latent-dir" not in plain_cmd
    _, named = _planned(["--workflow", "--configs", "rs-loader-0.3.75@24"])
    assert [(c["config"], c["cap_gib"]) for c in named] == [("rs-loader-0.3.75", 24.0)]
    for wrong in ("floor", "diffusers@12", "rs-disk-0.3.75@12"):
        with pytest.raises(SystemExit, match="--workflow runs the comfy, patch, loader, auto kinds, not"):
            _planned(["--workflow", "--configs", wrong])


def test_workflow_estimates_fit_the_part(capsys):
    a, cells = _planned(["--workflow", "--layers", "20"])
    # 20 s start + two 14.3 GB experts loaded at 4 GB/s and read warm at 8 GB/s + 16 steps at half a
    # 32,760-token step x 1.25 + four switches of 3 s
    est = compare.estimate(cells[0], {}, a)
    step = compare_plan.step_guess(32760, 1.0)
    assert est == pytest.approx(20 + 2 * 14.3 / 4 + 2 * 14.3 / 8 + 16 * step * 0.5 * 1.25 + 12)
    assert compare.estimate(cells[0], {("comfy", "bf16", True): 50.0, ("comfy", "bf16", False): 9.0}, a) == 50.0
    assert compare.dry_run(a, cells) == 0
    out = capsys.readouterr().out
    total = float(out.split("\n~")[-1].split(" s in all")[0])
    assert total < 515 and "writing the 2 model file(s) where the machine lacks them: ~32 s more" in out


def test_figures_of_a_workload():
    first = {"wall": 30.0, "steps": [9.0] + [2.0] * 7, "placed": [4e9, 4e9]}
    nxt = {"wall": 17.1, "steps": [3.0, 2.0, 2.0, 2.0, 2.6, 2.0, 2.0, 2.0], "placed": [1e9, 2e9]}
    row = compare_workflow.figures(first, nxt, 5.0, 8)
    assert (row["first_prompt_s"], row["ttfs_s"], row["ttfs_load"], row["next_prompt_s"]) == (35.0, 14.0, True, 17.1)
    assert row["steady_s"] == pytest.approx(2.0) and row["steady_sum_s"] == pytest.approx(16.0)
    assert (row["first_step_extra_s"], row["switch_extra_s"]) == (pytest.approx(1.0), pytest.approx(0.6))
    assert row["resident_placed_bytes"] == 3e9 and row["first_placed_bytes"] == [4e9, 4e9]
    later = compare_workflow.figures(first, dict(nxt, placed=[None, None]), None, 8)
    assert later["first_prompt_s"] == 30.0 and not later["ttfs_load"] and later["resident_placed_bytes"] is None
    short = compare_workflow.figures(first, {"wall": 2.0, "steps": [1.0, 0.5, 0.4], "placed": [0, 0]}, None, 3)
    assert short["steady_sum_s"] == pytest.approx(1.2)   # the high expert's one step is its switch: the low's steady
    none = compare_workflow.figures(first, {"wall": 2.0, "steps": [1.0, 1.0], "placed": [0, 0]}, None, 2)
    assert none["steady_sum_s"] is None and none["switch_extra_s"] is None and none["steady_s"] is None


def test_resident_bytes_placed_by_a_run():
    att = object()
    states = [SimpleNamespace(layout=SimpleNamespace(nbytes=n)) for n in (10, 20, 30)]
    engine = SimpleNamespace(att=att, plan=SimpleNamespace(resident=(0, 2)), states=states)
    model = SimpleNamespace(swap_engine=engine)
    assert compare_workflow._resident_placed(model, None) == 40
    assert compare_workflow._resident_placed(model, att) == 0   # the last run's blocks kept
    assert compare_workflow._resident_placed(SimpleNamespace(), None) is None   # ComfyUI alone


def test_latents_keep_a_checksum_and_a_file(tmp_path):
    x = torch.arange(6, dtype=torch.float32).reshape(1, 6)
    a = SimpleNamespace(latent_dir=str(tmp_path / "lat"))
    out = compare_workflow.keep_latents(a, 64, {"next": x})
    assert out["next_latent_sha256"] == hashlib.sha256(x.numpy().tobytes()).hexdigest()
    assert torch.equal(torch.load(out["latents"]["next"]), x)
    assert "latents" not in compare_workflow.keep_latents(SimpleNamespace(latent_dir=None), 64, {"first": x})


def test_the_prompt_samples_as_ksampleradvanced_does_for_wan_22(monkeypatch):
    calls = []

    def sample(model, noise, steps, cfg, sampler, scheduler, positive, negative, latent, **kw):
        calls.append((model, steps, cfg, sampler, scheduler, kw["start_step"], kw["last_step"], kw["disable_noise"],
                      kw["force_full_denoise"], kw["seed"], bool(noise.abs().sum() > 0), float(latent.sum())))
        for _ in range(kw["start_step"], min(kw["last_step"], steps)):
            kw["callback"](0, None, None, steps)
        return latent + 1

    fake = types.ModuleType("comfy")
    fake.sample = SimpleNamespace(sample=sample, prepare_noise=lambda x, seed: torch.ones_like(x) * (seed + 1))
    monkeypatch.setitem(sys.modules, "comfy", fake)
    monkeypatch.setitem(sys.modules, "comfy.sample", fake.sample)
    a = SimpleNamespace(ctx_len=4, prompt_steps=8, cfg=1.0)
    out = compare_workflow.run_prompt(["high", "low"], a, 64, 1, torch.device("cpu"))
    assert [c[:10] for c in calls] == [("high", 8, 1.0, "euler", "simple", 0, 4, False, False, 1),
                                       ("low", 8, 1.0, "euler", "simple", 4, 10000, True, True, 1)]
    assert [c[10] for c in calls] == [True, False]                # noise added by the high expert only
    assert (calls[0][11], calls[1][11]) == (0.0, float(out["latent"].numel()))   # the low expert goes on from the high
    assert len(out["steps"]) == 8 and out["placed"] == [None, None] and out["wall"] >= sum(out["steps"])
