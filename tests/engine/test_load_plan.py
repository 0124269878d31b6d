"""One load's decisions (swap/load_plan.py plan_load), table-driven: pure, no ComfyUI, no device.

Each path that changes what is attached (RunFacts.change) gets its rows: a load, the attachment
kept between prompts, the re-plan by measured rates, the shrink after running out of memory and
the RAM re-split once homes were coded; then the RAM room arithmetic and place_seconds.
"""
from dataclasses import replace

import pytest

from ringswap.swap.coding_choice import SCRATCH_BYTES
from ringswap.swap.load_plan import (CODED, DISK_GUESS, KEEP, LOAD, OOM, RATES, CallFacts, EngineFacts, RunFacts,
                                     SwapSettings, bytes_before_attach, kept_at_unload, pins_ahead, place_seconds, plan_load,
                                     ram_homes)
from ringswap.swap.home_policy import home_policy
from ringswap.swap.ram_split import MARGIN_MIN, MARGIN_SHARE, home_ram
from ringswap.swap.residency import ResidencyPlan
from ringswap.swap.window_plan import NotEnoughVRAM

GB = 10**9
BLOCK = GB // 2          # 10 blocks of 0.5 GB: a 5 GB model
N = 10
CALL = CallFacts(activation_bytes=2 * GB, activation_source="ComfyUI's estimate", reserve_bytes=GB)


def engine(**kw) -> EngineFacts:
    """home=ram (every block keeps a RAM home), RingSwap's own load of the file."""
    base = dict(block_sizes=(BLOCK,) * N, policy=home_policy("ram"), own_load=True)
    base.update(kw)
    return EngineFacts(**base)


def auto_home(**kw) -> EngineFacts:
    """home=auto: streamed blocks get RAM homes as the RAM split allows, two read buffers."""
    return engine(policy=home_policy("auto"), read_buffers=2, **kw)


def run(change=LOAD, call=CALL, **kw) -> RunFacts:
    """A CUDA device with a coder; 7 GB this model can have: 1 GB non-block, 1 GB reserve and
    2 GB of activations leave 3 GB, six blocks."""
    base = dict(device="cuda:0", free_bytes=7 * GB, nonblock_bytes=GB, batched=call, single=call,
                ram_available=64 * GB, change=change)
    base.update(kw)
    return RunFacts(**base)


def timed(compute_s: float) -> CallFacts:
    return replace(CALL, compute_s=compute_s)


# ----- LOAD --------------------------------------------------------------------------------

# (case, engine facts, run facts, settings, window, prefetch, resident, automatic)
LOADS = [
    ("manual window", engine(), run(), SwapSettings(3), 3, 1, 2, False),
    ("automatic: the largest window in the room", engine(), run(), SwapSettings(0), 5, 1, 4, True),
    ("cpu: every block, as ComfyUI asks", engine(), run(device="cpu", all_asked=True), SwapSettings(0),
     N, 1, N, True),
    ("a full load on cuda: every block", engine(), run(all_asked=True), SwapSettings(0), N, 1, N, True),
    ("cpu with a set window: the window", engine(), run(device="cpu", all_asked=True), SwapSettings(3),
     3, 1, 2, False),
    # a budget of 6 GB holds non-block (1) + activations (2): 3 GB, six blocks
    ("cpu with a budget: the budget's window", engine(), run(device="cpu", all_asked=True, free_bytes=24 * GB),
     SwapSettings(0, vram_budget_gb=6.0), 5, 1, 4, True),
    ("budget below the free memory", engine(), run(free_bytes=24 * GB), SwapSettings(0, vram_budget_gb=5.0),
     3, 1, 2, True),
]


@pytest.mark.parametrize("case,eng,facts,settings,window,prefetch,resident,automatic", LOADS,
                         ids=[c[0] for c in LOADS])
def test_load(case, eng, facts, settings, window, prefetch, resident, automatic):
    plan = plan_load(eng, facts, settings)
    r = plan.residency
    assert (r.window, r.prefetch, len(r.resident), plan.window.automatic) == (window, prefetch, resident, automatic)
    assert r == ResidencyPlan.make(N, window, prefetch)
    assert plan.settings is settings and plan.ram is None and plan.ram_blocks is None and not plan.keeps
    assert plan.window.inputs.device == facts.device and plan.window.inputs.nonblock_bytes == GB


def test_load_that_holds_no_block_names_the_numbers():
    with pytest.raises(NotEnoughVRAM, match=r"not even one block fits on cuda:0: 4\.25 GB free"):
        plan_load(engine(), run(free_bytes=4 * GB + BLOCK // 2), SwapSettings(0))


def test_a_load_plans_the_steps_conds_batched_or_one_call_each():
    """cond + uncond: batched where both fit the same blocks; one call each where only one cond's
    activations leave room for a block."""
    two = dict(conds_per_step=2, batched=replace(CALL, activation_bytes=3 * GB))
    batched = plan_load(engine(), run(free_bytes=24 * GB, **two), SwapSettings(3))
    assert batched.window.batched and batched.window.inputs.calls_per_step == 1
    assert batched.window.inputs.activation_bytes == 3 * GB
    single = plan_load(engine(), run(free_bytes=4 * GB + BLOCK, **two), SwapSettings(0))
    assert not single.window.batched and single.window.inputs.calls_per_step == 2
    assert single.window.inputs.activation_bytes == 2 * GB and "batched would not fit" in single.window.choice


def test_copy_bound_auto_plans_again_counting_the_decode_scratch():
    """A plan that is copy-bound without the decode scratch is planned again with it under
    compress=auto (auto may code it); off, or copies that hide, count none; on always does."""
    slow = dict(batched=timed(0.1), single=timed(0.1))
    eng = engine(link_bytes_per_s=1e9)
    off = plan_load(eng, run(**slow), SwapSettings(0, compress="off"))
    auto = plan_load(eng, run(**slow), SwapSettings(0, compress="auto"))
    assert off.window.bound == "copy-bound" and off.window.inputs.nonblock_bytes == GB
    assert auto.window.inputs.nonblock_bytes == GB + SCRATCH_BYTES
    assert ((len(off.residency.resident) + off.residency.ring_slots), (len(auto.residency.resident) + auto.residency.ring_slots)) == (6, 5), "the scratch takes a block's room"
    hidden = plan_load(engine(link_bytes_per_s=1e12), run(**slow), SwapSettings(0, compress="auto"))
    assert hidden.window.bound == "hidden" and hidden.window.inputs.nonblock_bytes == GB
    on = plan_load(engine(link_bytes_per_s=1e12), run(**slow), SwapSettings(0, compress="on"))
    assert on.window.inputs.nonblock_bytes == GB + SCRATCH_BYTES
    no_coder = plan_load(eng, run(coder_missing="no nvCOMP", **slow), SwapSettings(0, compress="auto"))
    assert no_coder.window.inputs.nonblock_bytes == GB and no_coder.coding.note


def test_ram_split_under_a_ram_budget_and_ram_is_short():
    """home=auto with a RAM budget of two read buffers and two homes: two streamed blocks in RAM,
    the rest read from the file; auto codes (RAM is short) and counts the decode scratch."""
    plan = plan_load(auto_home(), run(free_bytes=24 * GB), SwapSettings(3, ram_budget_gb=2.0))
    ram = plan.ram
    assert plan.ram_blocks == ram.ram_blocks and len(ram.ram_blocks) == 2 and len(ram.file_blocks) == 6
    assert ram.ram_blocks <= set(plan.residency.streamed) and ram.ram_bytes == 2 * GB
    assert ram.line() == ("home auto: 2 blocks (1.0 GB) on the GPU, 2 (1.0 GB) in RAM, 6 (3.0 GB) read from the "
                          "file each step; RAM counted on 2.0 GB (ram_budget_gb 2)")
    assert (plan.coding.code, plan.coding.why, plan.coding.may_code) == (True, "compress auto: RAM is short", True)
    assert plan.window.inputs.nonblock_bytes == GB + SCRATCH_BYTES   # home=auto may run short: auto counts it
    assert plan.line() == f"{plan.window.line()}; {ram.line()}; compress auto: RAM is short"
    d = plan.as_dict()
    assert (d["line"], d["compress"], d["compress_why"]) == (plan.line(), True, "compress auto: RAM is short")
    assert (d["ram_blocks"], d["file_blocks"], d["home_ram_bytes"]) == \
        (sorted(ram.ram_blocks), list(ram.file_blocks), 2 * GB)


@pytest.mark.parametrize("eng, budget_gb, short", [
    (auto_home(), 4.5, True),    # the 4 GB streamed fit, but not all 5 GB of blocks raw
    (auto_home(), 5.0, False),   # exactly every block: enough
    (engine(), 4.5, False),      # home=ram: never short
])
def test_ram_is_short_where_the_room_cannot_hold_every_block_raw(eng, budget_gb, short):
    """compress=auto codes a home=auto model's homes where its home RAM cannot hold all its blocks
    raw (its streamed homes and its resident blocks kept at an unload); other homes never."""
    plan = plan_load(eng, run(free_bytes=24 * GB), SwapSettings(3, ram_budget_gb=budget_gb))
    assert plan.ram is None or not plan.ram.file_blocks
    assert plan.coding.code is short and ("RAM is short" in plan.coding.why) is short, plan.coding


def test_compress_on_without_cuda_is_a_clear_error_and_auto_gives_a_note():
    with pytest.raises(RuntimeError, match="^RingSwap: compress='on' but there is no CUDA device to decode on$"):
        plan_load(engine(), run(device="cpu"), SwapSettings(3, compress="on"))
    with pytest.raises(RuntimeError, match="shared with the node that loaded it"):
        plan_load(engine(own_load=False), run(), SwapSettings(3, compress="on"))
    auto = plan_load(engine(), run(device="cpu"), SwapSettings(3))
    assert not auto.coding.code and not auto.coding.may_code and auto.coding.why == ""
    assert auto.coding.note == "RingSwap compress auto: off (there is no CUDA device to decode on)"
    assert auto.line() == auto.window.line()   # nothing of coding in the plan line
    shown = plan_load(engine(), run(device="cpu", preview=True), SwapSettings(3, compress="on"))
    assert not shown.coding.code and shown.coding.why == \
        "compress='on' but there is no CUDA device to decode on: a run stops with this error"
    assert shown.line().endswith(shown.coding.why)   # the plan route shows it instead of failing


# ----- KEEP --------------------------------------------------------------------------------

def test_keep_the_attached_residency_where_it_is_this_runs_plan():
    attached = ResidencyPlan.make(N, 5, 1)
    plan = plan_load(engine(attached=attached), run(KEEP), SwapSettings(0))
    assert plan.keeps and plan.residency == attached and plan.fresh == plan.window and not plan.note


def test_keep_a_smaller_automatic_window_that_ran_here_where_copies_hide():
    """Window 5 fits, window 3 is attached and ran this size: its copies hide, so it stays (placing
    the blocks again costs seconds); where it did not run here, or compute is not timed, the new
    plan is placed."""
    attached = ResidencyPlan.make(N, 3, 1)
    eng, fast = engine(attached=attached, link_bytes_per_s=1e12), dict(batched=timed(10.0), single=timed(10.0))
    kept = plan_load(eng, run(KEEP, ran_here=frozenset({1}), **fast), SwapSettings(0))
    assert kept.keeps and kept.residency == attached and kept.fresh.window == 5
    for facts in (run(KEEP, **fast), run(KEEP, ran_here=frozenset({1}))):
        fresh = plan_load(eng, facts, SwapSettings(0))
        assert not fresh.keeps and fresh.fresh is None and fresh.residency == ResidencyPlan.make(N, 5, 1)


def test_keep_nothing_for_a_set_window_other_than_the_attached():
    plan = plan_load(engine(attached=ResidencyPlan.make(N, 4, 1)), run(KEEP, ran_here=frozenset({1})),
                     SwapSettings(3))
    assert not plan.keeps and plan.residency == ResidencyPlan.make(N, 3, 1)


def test_keep_with_nothing_attached_is_the_new_plan():
    assert plan_load(engine(), run(KEEP), SwapSettings(3)) == plan_load(engine(), run(), SwapSettings(3))


def test_keep_places_again_with_a_note_where_the_load_would_code_now():
    """The attached homes are raw, and this load codes them (RAM is short): the blocks are placed
    again, with a line saying why; not where they are coded already or coding did not pay."""
    settings = SwapSettings(3, ram_budget_gb=2.0)
    attached = plan_load(auto_home(), run(free_bytes=24 * GB), settings).residency
    facts = run(KEEP, free_bytes=24 * GB)
    again = plan_load(auto_home(attached=attached), facts, settings)
    assert not again.keeps and again.coding.code and again.residency == attached
    assert again.note == "RingSwap compress auto: RAM is short: placing the blocks again to code their homes"
    for eng in (auto_home(attached=attached, attached_coded=True), auto_home(attached=attached, coding_pays=False)):
        kept = plan_load(eng, facts, settings)
        assert kept.keeps and not kept.note and kept.residency == attached
        assert kept.ram_blocks == again.ram_blocks


# ----- RATES -------------------------------------------------------------------------------

B12 = (BLOCK,) * 12
ROOM_4 = 4 * GB + 4 * BLOCK + BLOCK // 2   # free bytes with room for four blocks


def _first_prompt(**eng):
    """12 equal blocks, room for 4, no rates: window 3, prefetch 1 (resident 5 and 11)."""
    facts = engine(block_sizes=B12, homes=frozenset(range(12)), **eng)
    plan = plan_load(facts, run(free_bytes=ROOM_4), SwapSettings(0))
    assert (plan.window.window, plan.window.prefetch, plan.residency.resident) == (3, 1, (5, 11))
    return facts, plan


def test_rates_choose_more_prefetch_where_it_pays_back():
    """Compute 1 s a call and a block's copy 1 / 10.5 s: window 3 prefetch 1 stalls on adjacent
    streamed blocks, window 2 prefetch 2 does not; its resident block is on the device already,
    so it places nothing and pays back with two calls left."""
    facts, current = _first_prompt()
    facts = replace(facts, attached=current.residency)
    for calls_left in (20, 2):
        new = plan_load(facts, run(RATES, free_bytes=ROOM_4, rates=(1.0, 10.5 * BLOCK, 0.0), calls_left=calls_left),
                        SwapSettings(0), current)
        assert (new.window.window, new.window.prefetch) == (2, 2) and new.window.timed
        assert set(new.residency.resident) <= set(current.residency.resident) and not new.keeps
        assert new.window.call_s == pytest.approx(1.05, abs=0.005)


def test_rates_keep_the_plan_where_untimed_no_gain_or_no_payback():
    facts, current = _first_prompt()
    attached = replace(facts, attached=current.residency)

    def rates(eng, compute_s, link, calls_left=20, plan=current):
        return plan_load(eng, run(RATES, free_bytes=ROOM_4, rates=(compute_s, link, 0.0), calls_left=calls_left),
                         SwapSettings(0), plan)
    assert rates(attached, 0.0, 0.0) is None                       # nothing measured
    assert rates(attached, 10.0, 1e12) is None                     # the copies hide: no gain
    timed_plan = replace(current, window=replace(current.window, inputs=replace(
        current.window.inputs, compute_s=1.0, link_bytes_per_s=10.5 * BLOCK)))
    assert rates(attached, 1.0, 10.5 * BLOCK, plan=timed_plan) is None   # planned with rates already
    # nothing attached: window 2's resident block is copied from RAM (0.1 s), two calls save 0.04 s
    assert rates(facts, 1.0, 10.5 * BLOCK, calls_left=2) is None
    assert rates(facts, 1.0, 10.5 * BLOCK, calls_left=20) is not None


def test_a_change_other_than_load_or_keep_needs_the_current_plan():
    with pytest.raises(ValueError, match="needs the current plan"):
        plan_load(engine(), run(RATES), SwapSettings(0))
    with pytest.raises(ValueError, match="unknown change"):
        plan_load(engine(), run("later"), SwapSettings(0), plan_load(engine(), run(), SwapSettings(0)))


# ----- OOM ---------------------------------------------------------------------------------

def test_oom_shrinks_the_window_and_keeps_the_ram_blocks():
    """After running out of memory: a smaller window, the same blocks keep their RAM homes (the
    newly streamed read the file, so the retry reads nothing up front); at window 1, prefetch 0: None."""
    settings = SwapSettings(4, ram_budget_gb=2.0)
    current = plan_load(auto_home(), run(free_bytes=24 * GB), settings)
    smaller = plan_load(auto_home(), run(OOM, free_bytes=24 * GB), settings, current)
    assert smaller.window.window < 4 and smaller.ram_blocks == current.ram_blocks and smaller.fresh is None
    assert smaller.ram.plan == smaller.residency and smaller.coding == current.coding
    assert "doubled after running out of memory" in smaller.window.line()
    smallest = plan_load(engine(), run(free_bytes=24 * GB), SwapSettings(1, 0))
    assert plan_load(engine(), run(OOM), SwapSettings(1, 0), smallest) is None


# ----- CODED -------------------------------------------------------------------------------

def test_coded_homes_leave_ram_for_more_blocks():
    """Once the streamed homes are coded (half their bytes), the same RAM budget holds more of
    them: a plan with more RAM blocks; none where nothing shrank, nothing is read from the file, or
    the load does not code."""
    settings = SwapSettings(3, ram_budget_gb=2.0)
    current = plan_load(auto_home(), run(free_bytes=24 * GB), settings)
    assert current.coding.code and len(current.ram_blocks) == 2
    coded = auto_home(home_sizes=(BLOCK // 2,) * N)
    more = plan_load(coded, run(CODED, free_bytes=24 * GB), settings, current)
    assert more.ram_blocks == frozenset(current.residency.streamed) and not more.ram.file_blocks
    assert more.residency == current.residency and more.coding == current.coding
    assert more.ram.line().startswith("home auto: 2 blocks (1.0 GB) on the GPU, 8 (2.0 GB) in RAM; RAM counted on")
    assert plan_load(auto_home(), run(CODED, free_bytes=24 * GB), settings, current) is None
    all_in_ram = plan_load(auto_home(), run(free_bytes=24 * GB), SwapSettings(3))
    assert plan_load(coded, run(CODED, free_bytes=24 * GB), SwapSettings(3), all_in_ram) is None
    off = plan_load(auto_home(), run(free_bytes=24 * GB), replace(settings, compress="off"))
    assert plan_load(coded, run(CODED, free_bytes=24 * GB), replace(settings, compress="off"), off) is None


# ----- home RAM, RAM homes, place_seconds --------------------------------------------------

@pytest.mark.parametrize("budget_gb, available, held, kept, room, why", [
    (1.5, 64 * GB, 0, 0, 1_500_000_000, "ram_budget_gb 1.5"),
    # 10% of 64 GB available: 6.4 GB margin
    (0.0, 64 * GB, 0, 0, 64 * GB - 6_400_000_000, "64.0 GB available + 0.0 GB of its homes - 6.4 GB margin"),
    # the homes it holds count as RAM to share
    (0.0, 60 * GB, 4 * GB, 0, 64 * GB - 6_400_000_000, "60.0 GB available + 4.0 GB of its homes - 6.4 GB margin"),
    # a small machine: at least MARGIN_MIN
    (0.0, 8 * GB, 0, 0, 6 * GB, "8.0 GB available + 0.0 GB of its homes - 2.0 GB margin"),
    (0.0, 8 * GB, 0, 3 * GB, 3 * GB, "8.0 GB available + 0.0 GB of its homes - 2.0 GB margin - 3.0 GB ComfyUI keeps"),
    (0.0, GB, 0, 0, 0, "1.0 GB available + 0.0 GB of its homes - 2.0 GB margin"),   # never below 0
])
def test_home_ram_is_available_ram_less_margin_and_comfys_keep(budget_gb, available, held, kept, room, why):
    assert home_ram(budget_gb, available, held, kept) == (room, why)
    assert (MARGIN_SHARE, MARGIN_MIN) == (0.10, 2 * GB)


def test_kept_at_unload_is_what_home_ram_leaves_beside_the_homes():
    """A home=auto model taken off the device keeps resident blocks in what its home RAM leaves
    beside its homes; other homes keep none."""
    assert kept_at_unload(auto_home(homes_held=GB), run(), SwapSettings(3, ram_budget_gb=3.0)) == 2 * GB
    assert kept_at_unload(auto_home(homes_held=4 * GB), run(), SwapSettings(3, ram_budget_gb=3.0)) == 0
    assert kept_at_unload(engine(homes_held=GB), run(), SwapSettings(3, ram_budget_gb=3.0)) == 0


@pytest.mark.parametrize("case,facts,ram,settings,want", [
    ("home auto, RAM for every block", auto_home(), 64 * GB, SwapSettings(0), True),
    ("home auto, RAM for 4 of 5 GB after the margin", auto_home(), 6 * GB, SwapSettings(0), False),
    ("home auto, a budget under the model", auto_home(), 64 * GB, SwapSettings(0, ram_budget_gb=4.9), False),
    ("home auto, a budget that holds it", auto_home(), 64 * GB, SwapSettings(0, ram_budget_gb=5), True),
    ("compress on: coded homes in RAM", auto_home(), 64 * GB, SwapSettings(0, compress="on"), False),
    ("pin_memory off", auto_home(), 64 * GB, SwapSettings(0, pin_memory="off"), False),
    ("home ram: read into RAM at load", engine(), 64 * GB, SwapSettings(0), False),
    ("home disk", engine(policy=home_policy("disk")), 64 * GB, SwapSettings(0), False),
    ("a CPU device: nothing to page-lock", auto_home(), 64 * GB, SwapSettings(0), "cpu"),
])
def test_pins_ahead_only_where_every_block_keeps_a_raw_home_in_ram(case, facts, ram, settings, want):
    device = "cpu" if want == "cpu" else "cuda:0"
    assert pins_ahead(facts, run(ram_available=ram, device=device), settings) is (want is True), case


def test_ram_homes_by_home_policy():
    r = ResidencyPlan.make(N, 3, 1)
    split = plan_load(auto_home(), run(free_bytes=24 * GB), SwapSettings(3, ram_budget_gb=2.0)).ram
    assert ram_homes(engine(), r, None) == frozenset(range(N))
    assert ram_homes(engine(policy=home_policy("disk")), r, None) == frozenset()   # home=disk
    assert ram_homes(auto_home(), r, None) == frozenset(r.streamed)
    assert ram_homes(auto_home(), r, split) == split.ram_blocks


def test_place_seconds():
    """Seconds attaching a residency takes: resident blocks not on the device copied from their RAM
    home at the link rate (none where a re-plan only drops one), RAM homes to fill from the file at
    the last read rate (a guess before one was timed), streamed homes to page-lock."""
    link = 10.5 * BLOCK
    attached = ResidencyPlan.make(12, 3, 1)   # (5, 11) resident
    facts = engine(block_sizes=B12, homes=frozenset(range(12)), attached=attached)
    assert place_seconds(facts, ResidencyPlan.make(12, 2, 2), None, link) == 0
    grown = ResidencyPlan.make(12, 4, 1)      # (3, 7, 11): two blocks to copy from RAM
    assert grown.resident == (3, 7, 11)
    assert place_seconds(facts, grown, None, link) == pytest.approx(2 * BLOCK / link)
    no_homes = replace(facts, homes=frozenset())   # home=ram with no home read yet: every block from the file
    assert place_seconds(no_homes, grown, None, link) == pytest.approx(12 * BLOCK / DISK_GUESS)
    assert place_seconds(replace(no_homes, read_bytes_per_s=2e9), grown, None, link) == pytest.approx(12 * BLOCK / 2e9)
    pinning = replace(facts, pinned_copies=True, pin_s_per_byte=1e-10, pinned=frozenset(grown.streamed[:3]))
    to_pin = (len(grown.streamed) - 3) * BLOCK
    assert place_seconds(pinning, grown, None, link) == pytest.approx(2 * BLOCK / link + to_pin * 1e-10)


@pytest.mark.parametrize("window, prefetch, blocks", [
    (0, 1, N),            # planned at load: every block counted until then
    (3, 1, 2 + 2),        # a set window: 2 resident + a ring of 2 slots
    (3, 0, 2 + 1),
    (N + 5, 1, N),        # past the model: all resident
])
def test_bytes_before_attach_follow_the_set_window_rule(window, prefetch, blocks):
    """What the model holds once loaded, known before the load plans (ComfyUI's full-load test
    asks): the same set-window rule and device-bytes count the planner uses."""
    assert bytes_before_attach(engine(), SwapSettings(window, prefetch)) == blocks * BLOCK


def test_first_read_is_what_the_first_call_takes_from_the_file():
    """The first call streams (LoadPlan.first_read) what RingSwap's own load of the file reads at
    attach: home=auto's resident blocks and the RAM homes it has not got yet. Not home=ram (read
    at load), not a shared MODEL's blocks, not where homes are coded (they are read, then coded)."""
    plan = plan_load(auto_home(), run(), SwapSettings(3, compress="off"))
    homes = set(plan.ram_blocks) | set(plan.residency.resident)
    assert plan.stream_first and plan.first_read == len(homes) * BLOCK
    assert "the first call computes as its blocks arrive: " f"{len(homes) * BLOCK / GB:.2f} GB from the file" in plan.line()
    held = plan_load(auto_home(homes=frozenset(plan.ram_blocks)), run(), SwapSettings(3, compress="off"))
    assert held.first_read == len(plan.residency.resident) * BLOCK   # the homes held are not read again
    assert plan_load(engine(), run(), SwapSettings(3)).first_read == 0                        # home=ram
    assert plan_load(auto_home(own_load=False), run(), SwapSettings(3, compress="off")).first_read == 0
    coded = plan_load(auto_home(), run(), SwapSettings(3, compress="on"))
    assert coded.coding.code and coded.first_read == 0 and "first call" not in coded.line()
