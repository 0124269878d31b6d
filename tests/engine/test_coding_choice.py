"""The compress choice (swap/coding_choice.py), table-driven: pure, no ComfyUI, no coder needed."""
import pytest

from ringswap.swap import coding_choice
from ringswap.swap.coding_choice import (DECODE_GUESS, RATIO_GUESS, SCRATCH_BYTES, SHARED, CodingChoice,
                                         cannot_code, choose, coded_call_s, decide, scratch_bytes)
from ringswap.swap.residency import ResidencyPlan
from ringswap.swap.window_plan import PlanInputs, WindowPlan

MISSING = "RingSwap compress: nvCOMP is not installed (pip install nvidia-nvcomp-cu13)"


@pytest.mark.parametrize("mode, bound, ram_short, ram_homes, estimate, code, why", [
    ("on", "hidden", False, True, None, True, "compress on"),
    ("on", "copy-bound", False, False, (0.8, 0.6), False, "nothing streams from RAM"),
    ("auto", "copy-bound", True, True, (0.8, 0.9), True, "RAM is short"),
    ("auto", "hidden", True, True, None, True, "RAM is short"),
    ("auto", "hidden", False, True, None, False, "copies hide"),
    ("auto", "resident", False, True, None, False, "copies hide"),
    ("auto", "copy-bound", False, True, (0.80, 0.60), True, "est. 0.60 s a call coded vs 0.80 s"),
    ("auto", "copy-bound", False, True, (0.95, 0.98), False, "compress=on codes anyway"),
    ("auto", "copy-bound", False, True, (1.00, 0.96), False, "compress=on codes anyway"),   # under 5%
    ("auto", "unknown", False, True, None, False, "not measured yet"),
    ("auto", "copy-bound", True, False, (0.8, 0.6), False, "nothing streams from RAM"),
])
def test_compress_decision_table(mode, bound, ram_short, ram_homes, estimate, code, why):
    """Where coding is possible, whether a load codes its streamed RAM homes: on codes what streams
    from RAM; auto where RAM is short (fewer file reads), not where copies hide, and where the run
    is copy-bound only if the call model says coded calls are at least 5% faster."""
    got, said = decide(mode, bound, ram_short, ram_homes, estimate)
    assert got is code and why in said


def _bench_cell(compute_s: float) -> WindowPlan:
    """The bench's copy-bound layout: 40 blocks of 702 MB, 9 resident + 31 streamed through 2 slots."""
    inputs = PlanInputs(block_sizes=(702_000_000,) * 40, nonblock_bytes=0, free_bytes=0,
                        link_bytes_per_s=27.7e9, compute_s=compute_s)
    return WindowPlan(inputs, ResidencyPlan.make(40, 10, 1), automatic=True)


@pytest.mark.parametrize("compute_s, code", [(0.438, True), (0.25, True), (0.876, False)])
def test_compress_estimate_by_the_call_model(compute_s, code):
    """The bench's copy-bound cells (Wan-14B bf16, 12 GiB: 9 resident + 31 streamed through 2 slots,
    27.7 GB/s): cfg 1 at 7,800 tokens and the 4,096-token image are copy-bound with compute to
    spare, so shorter copies pay; at cfg 5 the compute alone is near the raw copies' time and the
    decodes would make calls slower. `choose` (no measured ratio or decode rate: the guesses, the
    decode at its rate beside compute) comes to the same answer."""
    plan = _bench_cell(compute_s)
    assert plan.bound == "copy-bound" and plan.call_s > 0.78
    coded = coded_call_s(plan, RATIO_GUESS, DECODE_GUESS)
    got, _ = decide("auto", plan.bound, False, True, (plan.call_s, coded))
    assert got is code, (plan.call_s, coded)
    assert choose("auto", None, plan, False, True).code is code


def test_coded_call_is_the_call_model_with_shorter_copies_and_the_decodes_in_compute():
    """No shrink and free decodes: the raw call; decodes longer than the copies: slower than raw."""
    plan = _bench_cell(0.438)
    assert coded_call_s(plan, 1.0, float("inf")) == pytest.approx(plan.call_s)
    assert coded_call_s(plan, 1.0, plan.streamed_bytes / 2.0) > plan.call_s   # 2 s of decodes a call


def test_measured_ratio_and_decode_rate_replace_the_guesses():
    """A ratio that saves nothing or a decode too slow to hide turn auto off where the guesses code."""
    plan = _bench_cell(0.438)
    assert choose("auto", None, plan, False, True).code
    assert not choose("auto", None, plan, False, True, ratio=0.99).code
    assert not choose("auto", None, plan, False, True, decode_rate=1e9).code
    assert choose("auto", None, plan, False, True, ratio=0.5, decode_rate=1e12).code


@pytest.mark.parametrize("cuda, missing, own_load, why", [
    (False, None, True, "there is no CUDA device to decode on"),
    (False, MISSING, False, "there is no CUDA device to decode on"),   # no CUDA is said first
    (True, MISSING, True, MISSING),
    (True, MISSING, False, MISSING),
    (True, None, False, SHARED),        # a shared MODEL's blocks must stay as its loader left them
    (True, None, True, None),
])
def test_cannot_code(cuda, missing, own_load, why):
    assert cannot_code(cuda, missing, own_load) == why


UNTIMED = WindowPlan(PlanInputs(block_sizes=(100,) * 4, nonblock_bytes=0, free_bytes=0),
                     ResidencyPlan.make(4, 2, 1), automatic=True)


@pytest.mark.parametrize("mode, why_not, may", [
    ("auto", None, True), ("on", None, True), ("off", None, False),
    ("auto", SHARED, False), ("auto", "there is no CUDA device to decode on", False), ("off", MISSING, False),
])
def test_may_code_only_where_a_coder_can_and_the_setting_allows(mode, why_not, may):
    """A load may code (its resident blocks kept in RAM at an unload are then coded) where compress
    is auto or on and nothing stops it; any load that codes may."""
    got = choose(mode, why_not, UNTIMED, True, True)
    assert got.may_code is may and (not got.code or got.may_code)


def test_on_where_nothing_can_code_is_a_clear_error_and_auto_is_off_with_a_note():
    with pytest.raises(RuntimeError, match="^RingSwap: compress='on' but there is no CUDA device to decode on$"):
        choose("on", cannot_code(False, None, True), UNTIMED, True, True)
    with pytest.raises(RuntimeError, match=r"^RingSwap compress: nvCOMP is not installed"):   # said as it is
        choose("on", MISSING, UNTIMED, True, True)
    with pytest.raises(RuntimeError, match="shared with the node that loaded it"):
        choose("on", SHARED, UNTIMED, True, True)
    off = choose("auto", MISSING, UNTIMED, True, True)
    assert off == CodingChoice(note="RingSwap compress auto: off (nvCOMP is not installed (pip install "
                                    "nvidia-nvcomp-cu13))")
    assert choose("auto", cannot_code(False, None, True), UNTIMED, True, True).note == \
        "RingSwap compress auto: off (there is no CUDA device to decode on)"
    assert choose("off", MISSING, UNTIMED, True, True) == CodingChoice()


def test_auto_codes_where_ram_is_short_and_says_why():
    assert choose("auto", None, UNTIMED, True, True) == CodingChoice(True, "compress auto: RAM is short", True)
    assert choose("auto", None, UNTIMED, True, False) == \
        CodingChoice(False, "compress: nothing streams from RAM", True)
    untimed = choose("auto", None, UNTIMED, False, True)
    assert not untimed.code and "not measured yet" in untimed.why


@pytest.mark.parametrize("mode, short, usable, coded, copy_bound, scratch", [
    ("on", False, True, False, False, SCRATCH_BYTES),
    ("on", False, False, False, False, 0),               # nothing can code: no scratch
    ("auto", True, True, False, False, SCRATCH_BYTES),   # RAM may run short (home=auto)
    ("auto", False, True, False, False, 0),              # home=ram, not copy-bound
    ("auto", False, True, False, True, SCRATCH_BYTES),   # copy-bound: auto may code
    ("auto", True, False, False, True, 0),
    ("off", True, True, False, True, 0),
    ("off", False, False, True, False, SCRATCH_BYTES),   # coded homes are decoded whatever the setting
])
def test_the_decode_scratch_a_plan_counts(mode, short, usable, coded, copy_bound, scratch):
    assert scratch_bytes(mode, short, usable, coded, copy_bound) == scratch


def test_scratch_is_the_part_buffers_in_flight():
    from ringswap.swap.plane_coder import PART_BYTES, PARTS_IN_FLIGHT
    assert SCRATCH_BYTES == PARTS_IN_FLIGHT * (PART_BYTES * 3 // 2 + (4 << 20))
    assert coding_choice.COMPRESS_MODES == ("auto", "on", "off")
