"""bench/compare.py's table and target lines, on the cells measured on the H200 (kept in
bench/results/) and on cells made here for the cases that run lacks (a transfer-bound cell,
home=disk): each cell is held to the right resident run, and a miss reads as one."""
import copy
import json
import os
import sys

import pytest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(BENCH)   # last: nothing here may shadow tests/comfyui/support

import compare_table  # noqa: E402
import compare_targets  # noqa: E402

with open(os.path.join(BENCH, "results", "compare_bf16_2026-12-01.json")) as f:
    MEASURED = json.load(f)
LINK = MEASURED["env"]["h2d_gbps"]


def _line(lines: str, head: str) -> str:
    found = [ln for ln in lines.splitlines() if ln.startswith(head)]
    assert len(found) == 1, (head, lines)
    return found[0]


def _cell(config: str, cap) -> dict:
    return next(c for c in MEASURED["cells"] if c["config"] == config and c["cap_gib"] == cap)


def test_each_cell_is_held_to_its_own_comfyui_resident_run():
    assert compare_table.resident_of(compare_table.CONFIGS["rs-patch-0.33-dyn"]) == "comfy-0.33-dyn"
    assert compare_table.resident_of(compare_table.CONFIGS["comfy-0.33"]) == "comfy-0.33"
    assert compare_table.resident_of(compare_table.CONFIGS["diffusers"]) == "comfy-0.3.75"
    row = _line(compare_table.table(MEASURED["cells"], link_gbps=LINK),
                "| bf16, cfg 1, link full | 24 | rs-patch-0.33-dyn: RingSwap Patch, auto window, ComfyUI 0.33 dynamic | 7,800 |")
    # 0.507 s against 0.33 dynamic VRAM's resident 0.489, not against 0.3.75's 0.441
    assert "| 0.507 | 1.137 | 1.037 |" in row


def test_targets_of_the_measured_cells():
    lines = compare_targets.targets(MEASURED["cells"], LINK)
    miss = _line(lines, "- bf16 cfg 1 link full 24 GiB rs-patch-0.3.75 7,800 tokens")
    assert "x1.023 resident (MISSED <= 1.01)" in miss
    assert "ok vs comfy-0.3.75 0.483" in miss and "ok vs diffusers 0.545" in miss
    met = _line(lines, "- bf16 cfg 1 link full 24 GiB rs-patch-0.3.75 32,760 tokens")
    assert "x1.007 resident (ok <= 1.01)" in met and "RSS 1.01 x file (ok <= 1.05)" in met
    # 21.1 GB of copies take 0.384 s at the link, under the 0.441 s resident step
    bound = _line(lines, "- bf16 cfg 1 link full 12 GiB rs-patch-0.3.75 7,800 tokens")
    assert "not transfer-bound (copies 0.384 s < resident step 0.441 s): 83% of link of at most 87%" in bound
    assert "<= 1.01" not in bound   # that target is for 24 GiB only
    other = _line(lines, "- bf16 cfg 1 link full 24 GiB rs-patch-0.33-dyn 32,760 tokens")
    assert "SLOWER (+27.9%) vs diffusers (other ComfyUI) 3.090" in other and "ok vs comfy-0.33-dyn 4.001" in other


def test_a_transfer_bound_cell_is_held_to_ninety_percent_of_the_link():
    cells = copy.deepcopy(MEASURED["cells"])
    rs = next(c for c in cells if c["config"] == "rs-patch-0.3.75" and c["cap_gib"] == 12)
    row = rs["rows"][0]
    row["h2d_bytes_per_step"] = 0.5 * LINK * 1e9       # 0.5 s of copies against a 0.441 s step
    row["s_per_step"] = 0.52
    assert "transfer-bound: 96% of link (ok >= 90%)" in compare_targets.targets(cells, LINK)
    row["s_per_step"] = 0.60
    assert "transfer-bound: 83% of link (MISSED >= 90%)" in compare_targets.targets(cells, LINK)


@pytest.mark.parametrize("held_blocks, workers, verdict", [(6.0, 2, "ok"), (14.0, 8, "ok"), (34.0, 2, "MISSED")])
def test_disk_rss_is_counted_in_blocks(held_blocks, workers, verdict):
    disk = copy.deepcopy(_cell("rs-patch-0.3.75", 24.0))
    disk["config"] = "rs-disk-0.3.75"
    row = disk["rows"][0]   # 29 resident + 11 streamed
    row["rss_steady"] = disk["rss_base"] + int(held_blocks * disk["file_bytes"] / 40)
    line = _line(compare_targets.targets([disk], LINK, workers), "- bf16 cfg 1 link full 24 GiB rs-disk-0.3.75 7,800 tokens")
    assert f"RSS {held_blocks:.1f} blocks' worth ({verdict} <= {29 + 2 + workers}: window + prefetch" in line


def test_disk_is_held_to_the_disks_own_rate_not_to_the_link_or_a_peer():
    disk = copy.deepcopy(_cell("rs-patch-0.3.75", 24.0))
    disk["config"] = "rs-disk-0.3.75"
    disk["odirect"] = [{"threads": 1, "gbps": 1.45}, {"threads": 8, "gbps": 1.27}]
    row = disk["rows"][0]
    row["s_per_step"], row["read_bytes_per_step"] = 6.5, 6.5 * 1.305e9
    cells = [c for c in MEASURED["cells"] if c["cap_gib"] == 24.0] + [disk]
    line = _line(compare_targets.targets(cells, LINK), "- bf16 cfg 1 link full 24 GiB rs-disk-0.3.75 7,800 tokens")
    assert line.startswith("- bf16 cfg 1 link full 24 GiB rs-disk-0.3.75 7,800 tokens 6.500 s/step: disk read 1.30 GB/s = 90% "
                           "of the disk's O_DIRECT 1.45 GB/s; RSS ")
    assert "resident" not in line.split("RSS")[0] and " vs " not in line and "of link" not in line


def test_rounds_of_a_cell_are_joined_into_their_median():
    one = _cell("rs-patch-0.3.75", 24.0)
    rounds = []
    for r, s in enumerate((0.451, 0.440, 0.446)):
        c = copy.deepcopy(one)
        c["round"] = r
        c["rows"][0]["s_per_step"] = s
        rounds.append(c)
    rounds[1]["rows"] = rounds[1]["rows"][:1]   # a round that measured one workload only
    joined = compare_table.rounds_joined(rounds + [_cell("comfy-0.3.75", 0.0)])
    assert [c["config"] for c in joined] == ["rs-patch-0.3.75", "comfy-0.3.75"]
    first, second = joined[0]["rows"]
    assert first["s_per_step"] == 0.446 and first["s_rounds"] == [0.451, 0.440, 0.446]
    assert second["s_rounds"] == [one["rows"][1]["s_per_step"]] * 2
    row = _line(compare_table.table(joined, link_gbps=LINK),
                "| bf16, cfg 1, link full | 24 | rs-patch-0.3.75: RingSwap Patch, auto window, ComfyUI 0.3.75 | 7,800 |")
    assert "| 0.446 |" in row and "median of rounds 0.451 / 0.440 / 0.446" in row
    assert "x1.011 resident" in compare_targets.targets(joined, LINK)   # 0.446 / 0.441


def test_configs_name_their_own_cap_and_rounds_repeat_whole():
    import argparse
    import compare
    a = argparse.Namespace(configs=["comfy-0.3.75@0", "rs-patch-0.3.75@24", "rs-loader-0.3.75", "floor"],
                           groups=[], formats=["bf16"], caps=[24.0, 12.0], repeat=2, cfgs=[1.0], links=["full"])
    cells = [(c["config"], c["cap_gib"], c.get("round")) for c in compare.plan_cells(a)]
    once = [("comfy-0.3.75", 0.0), ("rs-patch-0.3.75", 24.0), ("floor", 0), ("rs-loader-0.3.75", 24.0),
            ("rs-loader-0.3.75", 12.0)]
    assert cells == [n + (0,) for n in once] + [n + (1,) for n in once]
    with pytest.raises(SystemExit, match="unknown configuration 'rs-patch'"):
        compare.config_at("rs-patch@24")
    with pytest.raises(SystemExit, match="the cap after @ must be GiB"):
        compare.config_at("floor@none")


def test_steady_s_is_the_mean_after_the_first_step():
    import common
    # ComfyUI resident, bf16, 7,800 tokens, as measured: the second step reads short because
    # the CPU ran ahead of the GPU; the median of the last four would say 0.441
    assert common.steady_s([6.834, 0.2, 0.454, 0.435, 0.448]) == pytest.approx(0.38425)
    assert common.steady_s([2.0, 0.45, 0.44]) == pytest.approx(0.445)
    assert common.steady_s([3.0]) is None


def test_the_next_prompt_reads_in_the_note():
    """compare.py --rerun: the next prompt's first step and the step after it, under each row."""
    with open(os.path.join(BENCH, "results", "compare_24_rerun_2026-12-02.json")) as f:
        cells = json.load(f)["cells"]
    out = compare_table.table(cells)
    row = _line(out, "| bf16, cfg 1, link full | 24 | rs-loader-0.3.75: RingSwap Loader, home ram, ComfyUI 0.3.75 | 7,800 |")
    assert "| 0.441 | — | 1.006 |" in row and "next prompt: first step 4.004 s, then 0.432" in row
    resident = _line(out, "| bf16, cfg 1, link full | none | comfy-0.3.75: ComfyUI 0.3.75 (no cap: resident; cap: native partial load) |")
    assert "next prompt: first step 0.435 s, then 0.441" in resident
    cells[0]["rows"][0].pop("rerun_first_step_s")
    assert "next prompt" not in _line(compare_table.table(cells), "| bf16, cfg 1, link full | none | comfy-0.3.75")


@pytest.mark.parametrize("lines, says", [
    (["RingSwap plan: window 29 of 40 (auto; ...); kept on the device from the last run"], " (blocks kept)"),
    (["RingSwap plan: window 30 of 40 (auto; ...); placed in 3.89 s"], " (blocks placed again)"),
    ([], "")])
def test_the_next_prompt_says_whether_the_blocks_stayed(lines, says):
    with open(os.path.join(BENCH, "results", "compare_24_rerun_2026-12-02.json")) as f:
        cells = json.load(f)["cells"]
    rs = next(c for c in cells if c["config"] == "rs-loader-0.3.75")
    rs["rows"][0]["rerun_log"] = lines + ["RingSwap run: 40 blocks"]
    row = _line(compare_table.table(cells), "| bf16, cfg 1, link full | 24 | rs-loader-0.3.75")
    assert f"next prompt: first step 4.004 s, then 0.432 = 0.981 x this row{says} |" in row


def test_cfg_and_halved_link_are_dimensions_of_the_cells():
    """--cfgs and --links: a set of cells each; the uncapped resident runs only on the full
    link (they copy nothing a step); every cell's workload in its table row and target line."""
    import argparse
    import compare
    a = argparse.Namespace(configs=["comfy-0.33-dyn@0", "rs-patch-0.33-dyn@12"], groups=[], formats=["bf16"],
                           caps=[12.0], repeat=1, cfgs=[1.0, 5.0], links=["full", "halved"])
    cells = [(c["cfg"], c["link"], c["config"]) for c in compare.plan_cells(a)]
    assert cells == [(1.0, "full", "comfy-0.33-dyn"), (1.0, "full", "rs-patch-0.33-dyn"),
                     (1.0, "halved", "rs-patch-0.33-dyn"), (5.0, "full", "comfy-0.33-dyn"),
                     (5.0, "full", "rs-patch-0.33-dyn"), (5.0, "halved", "rs-patch-0.33-dyn")]
    resident = copy.deepcopy(_cell("comfy-0.33-dyn", 0.0))
    rs = copy.deepcopy(_cell("rs-patch-0.33-dyn", 24.0))
    for c in (resident, rs):
        c["cfg"], c["rows"] = 5.0, [r for r in c["rows"] if r["tokens"] == 7800]
    rs.update(cap_gib=12.0, link="halved", h2d_left_gbps=28.0, link_load="link load took 24.0 GB/s over 60 s")
    rs["rows"][0].update(s_per_step=1.02 * resident["rows"][0]["s_per_step"], calls_per_step=1.0)
    row = _line(compare_table.table([resident, rs], link_gbps=LINK), "| bf16, cfg 5, link halved | 12 |")
    assert "| 1.020 |" in row and "link load took 24.0 GB/s over 60 s, 28.0 GB/s left to the cell" in row
    assert "1.00 model calls a step" in row
    line = _line(compare_targets.targets([resident, rs], LINK), "- bf16 cfg 5 link halved 12 GiB rs-patch-0.33-dyn")
    assert "x1.020 resident (ok <= 1.05, cfg 5 12 GiB halved)" in line


def test_resident_on_link_holds_streamed_cells_to_a_resident_run_beside_the_load():
    """--resident-on-link: the uncapped resident run also beside the link load, and a halved
    cell's "x ComfyUI resident" is then against that one, not the full-link run."""
    import argparse
    import compare
    a = argparse.Namespace(configs=["rs-patch-0.3.75@12", "comfy-0.3.75@0"], groups=[], formats=["gguf_q8_0"],
                           caps=[12.0], repeat=1, cfgs=[1.0], links=["halved"], resident_on_link=True)
    cells = [(c["link"], c["config"]) for c in compare.plan_cells(a)]
    assert cells == [("halved", "rs-patch-0.3.75"), ("full", "comfy-0.3.75"), ("halved", "comfy-0.3.75")]
    a.resident_on_link = False
    assert [(c["link"], c["config"]) for c in compare.plan_cells(a)] == cells[:2]
    full = copy.deepcopy(_cell("comfy-0.3.75", 0.0))
    full["rows"] = [r for r in full["rows"] if r["tokens"] == 7800]
    beside = copy.deepcopy(full)
    beside["link"] = "halved"
    beside["rows"][0]["s_per_step"] = 1.01 * full["rows"][0]["s_per_step"]
    rs = copy.deepcopy(beside)
    rs.update(config="rs-patch-0.3.75", cap_gib=12.0)
    rs["rows"][0]["s_per_step"] = 1.02 * full["rows"][0]["s_per_step"]
    out = compare_table.table([rs, full, beside], link_gbps=LINK)
    assert "| 1.010 |" in _line(out, "| bf16, cfg 1, link halved | 12 |")
    assert "| 1.020 |" in _line(compare_table.table([rs, full], link_gbps=LINK), "| bf16, cfg 1, link halved | 12 |")


def test_ram_and_experts_are_dimensions_of_the_cells():
    """--rams and --experts: one set of cells per RAM left to the cell; the table names the
    workload (experts, RAM), the RAM ballast, the home=auto split and the expert switch."""
    import argparse
    import compare
    a = argparse.Namespace(configs=["rs-loader-0.3.75@24", "rs-auto-0.3.75@12"], groups=[], formats=["bf16"],
                           caps=[12.0], repeat=1, cfgs=[1.0], links=["full"], rams=[0.0, 32.0], experts=2)
    cells = compare.plan_cells(a)
    assert [(c["config"], c.get("ram_gb"), c["experts"]) for c in cells] == [
        ("rs-loader-0.3.75", None, 2), ("rs-auto-0.3.75", None, 2),
        ("rs-loader-0.3.75", 32.0, 2), ("rs-auto-0.3.75", 32.0, 2)]
    auto = copy.deepcopy(_cell("rs-patch-0.33-dyn", 24.0))
    auto.update(config="rs-auto-0.3.75", cap_gib=12.0, ram_gb=32.0, experts=2, pages_swapped_out=0,
                ram_ballast="ready: locked 90.0 GB of 122.0 GB available, 32.0 GB left")
    auto["rows"] = auto["rows"][:1]
    auto["rows"][0].update(switch_step_s=3.5, expert_pinned=[0, 7_000_000_000], log=[
        "RingSwap plan: window 9 of 40 (auto); pinned memory, 7.0 GB at home; home auto: 8 blocks (5.6 GB) on "
        "the GPU, 32 (22.5 GB) in RAM; RAM counted on 26.8 GB (why); placed in 4.00 s"])
    row = _line(compare_table.table([auto], link_gbps=LINK), "| bf16, 2 experts, RAM 32 GB, cfg 1, link full | 12 |")
    assert "RAM ballast ready: locked 90.0 GB" in row and "pages swapped out 0" in row, row
    assert "home auto: 8 blocks (5.6 GB) on the GPU, 32 (22.5 GB) in RAM; RAM counted on 26.8 GB (why)" in row, row
    assert "expert switch step 3.50 s; pinned per expert 0.0 / 7.0 GB" in row, row


@pytest.mark.parametrize("read, swapped, rss, says", [
    (0, 0, 20e9, "streamed blocks in RAM: x1.010 home=ram 1.000 (ok <= 1.02)"),
    (1.9e9, 0, 20e9, "file share read at 1.90 GB/s = 95% of O_DIRECT 2.00 GB/s (ok >= 85%, or hidden: <= 1.02 x "
                     "home=ram)"),
    (1.5e9, 3, 33e9, "pages swapped out 3 (MISSED none); RSS peak 33.0 GB (MISSED <= 32 GB given)"),
])
def test_home_auto_on_a_smaller_machine_is_held_to_home_ram_and_the_disk(read, swapped, rss, says):
    """Issue 25: a home=auto cell under a RAM ballast: no swapping and RSS within the RAM given;
    as fast as home=ram on the whole machine where its streamed blocks fit in RAM, else its file
    share at >= 85% of the disk's O_DIRECT rate; the expert switch within reading the resident
    blocks at that rate."""
    ref = copy.deepcopy(_cell("rs-patch-0.3.75", 24.0))
    ref.update(config="rs-loader-0.3.75")
    ref["rows"] = ref["rows"][:1]
    ref["rows"][0]["s_per_step"] = 1.0
    auto = copy.deepcopy(ref)
    auto.update(config="rs-auto-0.3.75", ram_gb=32.0, experts=2, pages_swapped_out=swapped,
                odirect=[{"threads": 1, "gbps": 1.5}, {"threads": 8, "gbps": 2.0}], file_bytes=40e9)
    auto["rows"][0].update(s_per_step=1.01, read_bytes_per_step=read * 1.01, rss_peak=rss, switch_step_s=9.0,
                           plan="29 resident + 11 streamed through 2 slots")
    line = _line(compare_targets.targets([ref, auto], LINK), "- bf16, 2 experts, RAM 32 GB cfg 1 link full 24 GiB")
    assert says in line, line
    assert "expert switch +7.99 s (ok <= 14.50 s: 29 resident blocks at O_DIRECT)" in line, line


def test_a_lora_cell_is_its_own_workload_held_to_the_run_without_it():
    plain = copy.deepcopy(_cell("rs-patch-0.33-dyn", 24.0))
    lora = copy.deepcopy(plain)
    lora["lora_rank"] = 64
    for r in lora["rows"]:
        r["s_per_step"] *= 1.02
    out = compare_table.table([plain, lora])
    assert _line(out, "| bf16 + LoRA rank 64, cfg 1, link full | 24 | rs-patch-0.33-dyn: RingSwap Patch, auto window, "
                 "ComfyUI 0.33 dynamic | 7,800 |")
    line = _line(compare_targets.targets([plain, lora], LINK), "- bf16 + LoRA rank 64 cfg 1 link full 24 GiB "
                 "rs-patch-0.33-dyn 7,800 tokens")
    assert "LoRA x1.020 the same run without it (ok <= 1.03)" in line


@pytest.mark.parametrize("ratio,says", [(0.7, "ok <= 0.8"), (0.9, "MISSED <= 0.8")])
def test_gguf_at_8_gib_is_held_to_the_packs_own_run(ratio, says):
    """A GGUF cell at 8 GiB: RingSwap Patch against Unet Loader (GGUF) alone on its ComfyUI version."""
    alone = copy.deepcopy(_cell("comfy-0.3.75", 24.0))
    rs = copy.deepcopy(_cell("rs-patch-0.3.75", 24.0))
    for c in (alone, rs):
        c.update(format="gguf_q4_k", cap_gib=8.0)
        c["rows"] = [r for r in c["rows"] if r["tokens"] == 7800]
    rs["rows"][0]["s_per_step"] = ratio * alone["rows"][0]["s_per_step"]
    line = _line(compare_targets.targets([alone, rs], LINK), "- gguf_q4_k cfg 1 link full 8 GiB rs-patch-0.3.75")
    assert f"x{ratio:.3f} Unet Loader (GGUF) alone" in line and says in line


@pytest.mark.parametrize("slow,ratio,says", [(1.5, 0.7, "ok <= 0.75, copy-bound"), (1.5, 0.8, "MISSED <= 0.75"),
                                             (1.0, 1.005, "ok <= 1.01, copies hide")])
def test_a_compress_cell_is_held_to_the_same_run_without_it(slow, ratio, says):
    """With compress: <= 0.75 x the run without it where that run was copy-bound (slower than
    1.05 x resident), else <= 1.01 x."""
    resident = copy.deepcopy(_cell("comfy-0.3.75", 0.0))
    plain = copy.deepcopy(_cell("rs-loader-0.3.75", 24.0))
    res_row = next(r for r in resident["rows"] if r["tokens"] == 7800)
    plain["rows"] = [dict(r, s_per_step=slow * res_row["s_per_step"]) for r in plain["rows"] if r["tokens"] == 7800]
    coded = copy.deepcopy(plain)
    coded["compress"] = "on"
    coded["rows"][0]["s_per_step"] *= ratio
    out = compare_table.table([resident, plain, coded])
    assert "| bf16, compress on, cfg 1, link full | 24 | rs-loader-0.3.75" in out
    line = _line(compare_targets.targets([resident, plain, coded], LINK),
                 "- bf16, compress on cfg 1 link full 24 GiB rs-loader-0.3.75")
    assert f"compress x{ratio:.3f} the same run without it" in line and says in line


def test_coded_experts_on_a_smaller_machine_are_held_to_home_ram_without_compress():
    """Issue 29: two bf16 experts with compress under a RAM ballast, held to home=ram on the whole
    machine (a run without compress) within 1.02 x."""
    ref = copy.deepcopy(_cell("rs-patch-0.3.75", 24.0))
    ref.update(config="rs-loader-0.3.75")
    ref["rows"] = ref["rows"][:1]
    ref["rows"][0]["s_per_step"] = 1.0
    coded = copy.deepcopy(ref)
    coded.update(config="rs-auto-0.3.75", ram_gb=48.0, experts=2, pages_swapped_out=0, compress="auto")
    coded["rows"][0].update(s_per_step=1.015, rss_peak=40e9)
    line = _line(compare_targets.targets([ref, coded], LINK), "- bf16, 2 experts, RAM 48 GB, compress auto cfg 1")
    assert "streamed blocks in RAM: x1.015 home=ram 1.000 (ok <= 1.02)" in line, line
