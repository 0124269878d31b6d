"""The window planner (swap/window_plan.py), table-driven: pure arithmetic, no ComfyUI."""
from dataclasses import replace

import pytest

from ringswap.swap.residency import ResidencyPlan
from ringswap.swap.window_plan import NotEnoughVRAM, PlanInputs, keep_attached, plan_step, plan_window, shrink_after_oom

GB = 10**9
BLOCK = GB // 2            # 0.5 GB blocks, 40 of them (a 20 GB model)
N = 40


def inputs(**kw) -> PlanInputs:
    base = dict(block_sizes=(BLOCK,) * N, nonblock_bytes=GB, free_bytes=24 * GB, reserve_bytes=GB,
                activation_bytes=2 * GB, prefetch=1, tokens=32_760)
    base.update(kw)
    return PlanInputs(**base)


# (case, inputs, window, prefetch, resident, ring slots)
CASES = [
    # room = 24 - 1 - 2 - 1 = 20 GB = exactly 40 blocks: all resident, no ring
    ("everything fits", inputs(), N, 1, N, 0),
    # room 16 GB = 32 blocks on the device: window + prefetch = 32
    ("partial", inputs(free_bytes=20 * GB), 31, 1, 30, 2),
    ("prefetch 2 takes a slot", inputs(free_bytes=20 * GB, prefetch=2), 30, 2, 29, 3),
    # budget 12 GB holds non-block (1) + activations (2): 9 GB = 18 blocks
    ("budget below the free VRAM", inputs(budget_bytes=12 * GB), 17, 1, 16, 2),
    ("budget above the free VRAM changes nothing", inputs(free_bytes=20 * GB, budget_bytes=40 * GB), 31, 1, 30, 2),
    # the reserve (ComfyUI's inference minimum + --reserve-vram) comes off the free VRAM
    ("reserve", inputs(free_bytes=20 * GB, reserve_bytes=3 * GB), 27, 1, 26, 2),
    # bigger activations (a longer video) leave room for fewer blocks
    ("activations", inputs(free_bytes=20 * GB, activation_bytes=6 * GB), 23, 1, 22, 2),
    # room for exactly one block: window 1, prefetch lowered to 0
    ("one block only", inputs(free_bytes=4 * GB + BLOCK), 1, 0, 0, 1),
    ("two blocks", inputs(free_bytes=5 * GB), 1, 1, 0, 2),
    # a manual window is kept as asked
    ("manual window", inputs(free_bytes=5 * GB, window=10), 10, 1, 9, 2),
]


@pytest.mark.parametrize("case,inp,window,prefetch,resident,ring", CASES, ids=[c[0] for c in CASES])
def test_plan(case, inp, window, prefetch, resident, ring):
    plan = plan_window(inp)
    r = plan.residency
    assert (plan.window, plan.prefetch, len(r.resident), r.ring_slots) == (window, prefetch, resident, ring)
    if inp.window == 0:
        assert plan.block_bytes_on_device <= inp.room_bytes
        assert plan.over_bytes == 0
    assert plan.streamed_bytes == len(r.streamed) * BLOCK


def test_auto_window_is_the_largest_that_fits():
    for free in range(4 * GB + BLOCK, 26 * GB, GB // 7):
        plan = plan_window(inputs(free_bytes=free))
        assert plan.block_bytes_on_device <= plan.inputs.room_bytes
        if plan.window < N:
            bigger = plan_window(inputs(free_bytes=free, window=plan.window + 1))
            assert bigger.over_bytes > 0, free


def test_mixed_block_sizes_count_each_block():
    sizes = (BLOCK,) * 10 + (BLOCK // 2,) * 10     # e.g. Flux: double then single blocks
    plan = plan_window(inputs(block_sizes=sizes, free_bytes=4 * GB + 5 * BLOCK))
    assert plan.block_bytes_on_device <= plan.inputs.room_bytes
    assert plan_window(inputs(block_sizes=sizes, free_bytes=4 * GB + 5 * BLOCK,
                              window=plan.window + 1)).over_bytes > 0


def test_not_one_block_fits_names_the_numbers():
    with pytest.raises(NotEnoughVRAM) as e:
        plan_window(inputs(free_bytes=4 * GB + BLOCK // 2, device="cuda:0"))
    msg = str(e.value)
    assert "not even one block fits on cuda:0" in msg
    assert "4.25 GB free" in msg and "reserve 1.00 GB" in msg and "activations ~2.00 GB" in msg
    assert "1.00 GB of non-block weights" in msg and "one block needs 0.50 GB" in msg


def test_budget_too_small_is_refused_with_the_budget():
    with pytest.raises(NotEnoughVRAM, match="budget 3.00 GB"):
        plan_window(inputs(budget_bytes=3 * GB))


def test_plan_line():
    plan = plan_window(inputs(free_bytes=20 * GB, link_bytes_per_s=50 * GB, compute_s=2.9))
    line = plan.line()
    assert line.startswith("RingSwap plan: window 31 of 40 (auto; 30 resident + ring 2)")
    assert "16.0 GB of blocks + 1.0 GB non-block on cuda:0 of 20.0 GB free" in line
    assert "activations ~2.0 GB at 32,760 tokens (estimate)" in line
    assert "; 1 model call a step; streams 5.0 GB per model call (5.0 GB a step), est. copy 0.10 s vs compute " \
           "~2.90 s: hidden" in line
    assert plan_window(inputs(free_bytes=20 * GB, link_bytes_per_s=1 * GB, compute_s=2.9)).bound == "copy-bound"
    assert "copy rate not measured yet" in plan_window(inputs(free_bytes=20 * GB)).line()
    assert plan_window(inputs()).line().endswith("nothing streams")
    assert "over the room for blocks" in plan_window(inputs(free_bytes=5 * GB, window=10)).line()


def test_plan_as_dict_is_json_ready():
    import json
    d = plan_window(inputs(free_bytes=20 * GB)).as_dict()
    assert json.loads(json.dumps(d))["window"] == 31
    assert d["streamed_bytes"] == 10 * BLOCK and d["bound"] == "unknown" and "block_sizes" not in d


def test_shrink_after_oom_is_always_smaller_until_the_smallest():
    plan = plan_window(inputs(free_bytes=20 * GB))
    seen = [plan.window]
    while (plan := shrink_after_oom(plan)) is not None:
        assert (plan.window, plan.prefetch) < (seen[-1], 9)
        seen.append(plan.window)
        if len(seen) > 50:
            raise AssertionError(seen)
    assert seen[-1] == 1
    # the first shrink doubles the activation reserve: 2 GB more -> 4 fewer blocks
    assert shrink_after_oom(plan_window(inputs(free_bytes=20 * GB))).window == 27


def test_shrink_of_a_manual_window_and_of_all_resident():
    # nothing fits by the numbers any more: a quarter fewer blocks
    assert shrink_after_oom(plan_window(inputs(free_bytes=5 * GB, window=10))).window == 8
    assert shrink_after_oom(plan_window(inputs())).window < N
    smallest = plan_window(inputs(free_bytes=4 * GB + BLOCK))
    assert (smallest.window, smallest.prefetch) == (1, 0)
    assert shrink_after_oom(smallest) is None


def test_keep_attached_plan_that_ran_this_size():
    attached = plan_window(inputs(free_bytes=20 * GB)).residency            # window 31
    # the next run measured smaller activations: window 33 would fit, 31's copies hide under compute
    measured = dict(free_bytes=20 * GB, activation_bytes=GB, link_bytes_per_s=50 * GB, compute_s=0.4)
    fresh = plan_window(inputs(**measured))
    assert fresh.window == 33
    kept = keep_attached(fresh, attached, ran_here=True)
    assert kept.residency == attached and kept.automatic and kept.bound == "hidden"
    assert keep_attached(fresh, fresh.residency, ran_here=False) is fresh
    # another latent size (or less memory than when it ran): placed for this run
    assert keep_attached(fresh, attached, ran_here=False) is None
    # copy-bound at the attached window: place again at the larger one where it is 2% faster a
    # call (0.08 s against 0.10), keep the blocks where it is not (0.099 s against 0.100)
    assert keep_attached(plan_window(inputs(**dict(measured, compute_s=0.05))), attached, True) is None
    near = keep_attached(plan_window(inputs(**dict(measured, compute_s=0.099))), attached, True)
    assert near.residency == attached and near.bound == "copy-bound"
    assert keep_attached(plan_window(inputs(**dict(measured, compute_s=0.097))), attached, True) is None
    # not measured yet: no verdict, place again
    assert keep_attached(plan_window(inputs(free_bytes=20 * GB, activation_bytes=GB)), attached, True) is None
    # past the room by the numbers: kept only when it ran this size with no more memory than now
    over = plan_window(inputs(**dict(measured, activation_bytes=4 * GB)))
    assert keep_attached(over, attached, ran_here=True).residency == attached
    assert keep_attached(over, attached, ran_here=False) is None
    # a set window is kept only when it is the same
    assert keep_attached(plan_window(inputs(**dict(measured, window=33))), attached, True) is None
    assert keep_attached(fresh, ResidencyPlan.make(N - 1, 31, 1), True) is None


def step(single_act=2 * GB, batched_act=4 * GB, compute=0.0, **kw) -> tuple[PlanInputs, PlanInputs]:
    """(batched, one call each) inputs for a step of cond + uncond; compute: s per cond."""
    b = inputs(activation_bytes=batched_act, conds_per_step=2, conds_per_call=2, compute_s=2 * compute, **kw)
    s = inputs(activation_bytes=single_act, conds_per_step=2, conds_per_call=1, compute_s=compute, **kw)
    return b, s


# (case, (batched, single) inputs, batched?, window, calls a step)
STEP_CASES = [
    # everything fits either way: one call a step
    ("all resident", step(free_bytes=30 * GB), True, N, 1),
    # 20 GB free: batched leaves 14 GB = 28 blocks (window 27, 12 GB streamed once a step);
    # one call each 16 GB = 32 blocks (window 31, 10 GB streamed twice): batched moves fewer bytes
    ("link and compute not measured: fewer bytes", step(free_bytes=20 * GB), True, 27, 1),
    # copies hide under compute either way: the batched call's two conds cost the same compute
    ("copies hide", step(free_bytes=20 * GB, link_bytes_per_s=50 * GB, compute=2.0), True, 27, 1),
    # copy-bound on a slow link: batched 13 GB / 25 GB/s = 0.52 s vs 2 x 11 GB/25 = 0.88 s
    ("copy-bound, PCIe 4.0", step(free_bytes=20 * GB, link_bytes_per_s=25 * GB, compute=0.1), True, 27, 1),
    # a long video: batched activations push out most blocks; compute is cheap next to the link.
    # batched: room 2 GB = 4 blocks (window 3), streams 19 GB: 0.76 s a step; one call each:
    # room 14 GB = 28 blocks (window 27), streams 7 GB twice: 2 x 0.28 = 0.56 s
    ("long video, batched costs more", step(single_act=4 * GB, batched_act=16 * GB, free_bytes=20 * GB,
                                            link_bytes_per_s=25 * GB, compute=0.05), False, 27, 2),
    # the same memory picture, compute-heavy: batched hides its copies under 2 x 0.5 s of compute
    ("long video, compute-bound", step(single_act=4 * GB, batched_act=16 * GB, free_bytes=20 * GB,
                                       link_bytes_per_s=25 * GB, compute=0.5), True, 3, 1),
    # the batched call does not fit one block: one call each
    ("batched does not fit", step(single_act=6 * GB, batched_act=19 * GB, free_bytes=20 * GB), False, 23, 2),
    # a manual window holds the same blocks either way: batched
    ("manual window", step(free_bytes=20 * GB, window=10), True, 10, 1),
    # ... unless only the single call fits beside it
    ("manual window, batched over the room", step(free_bytes=10 * GB, single_act=2 * GB, batched_act=8 * GB,
                                                  window=10), False, 10, 2),
]


@pytest.mark.parametrize("case,both,batched,window,calls", STEP_CASES, ids=[c[0] for c in STEP_CASES])
def test_plan_step(case, both, batched, window, calls):
    plan = plan_step(*both)
    assert (plan.batched, plan.window, plan.inputs.calls_per_step) == (batched, window, calls), plan.line()
    assert plan.choice
    assert ("batched in 1 model call" in plan.line()) == batched
    assert plan.as_dict()["calls_per_step"] == calls
    if not batched:
        assert "in 2 model calls" in plan.line()
    other = plan_window(both[1] if batched else both[0]) if case != "batched does not fit" else None
    if other is not None and other.inputs.window == 0 and not other.over_bytes:
        assert plan.step_cost[0] <= other.step_cost[0] * 1.001


def test_plan_step_with_one_cond_is_the_window_plan():
    b, s = step(free_bytes=20 * GB)
    one = inputs(activation_bytes=2 * GB, free_bytes=20 * GB)
    assert plan_step(one, one).residency == plan_window(one).residency
    assert plan_step(one, one).line().count("1 model call a step") == 1


def test_plan_step_neither_fits_says_the_single_calls_numbers():
    with pytest.raises(NotEnoughVRAM, match="activations ~2.00 GB"):
        plan_step(*step(free_bytes=4 * GB))


# Wan-14B bf16 blocks (0.7045 GB), 40 of them; window 8 / 7 is what fits 12 GiB at cfg 5
WAN = (704_500_000,) * 40


@pytest.mark.parametrize("window,prefetch,compute,link,expect", [
    # measured 2026-12-02 (bench/RESULTS.md): 0.3.75 cfg 5, 12 GiB, halved link: resident 0.918 s,
    # RingSwap window 8 prefetch 1 0.955-0.968 s; 0.33 dynamic cfg 1: RingSwap window 10 0.794 s
    (8, 1, 0.918, 28.2e9, 0.957),
    (7, 2, 0.918, 28.2e9, 0.918),   # one block less, one copy more in flight: hidden
    (10, 1, 0.45, 27.7e9, 0.788),
    (9, 2, 0.45, 27.7e9, 0.815),
])
def test_call_seconds_follows_the_engines_rules(window, prefetch, compute, link, expect):
    from ringswap.swap.timing import call_seconds
    plan = ResidencyPlan.make(40, window, prefetch)
    assert call_seconds(WAN, plan, compute, link) == pytest.approx(expect, abs=0.003)
    assert call_seconds(WAN, plan, compute, 0.0) == compute
    assert call_seconds(WAN, ResidencyPlan.make(40, 40, 1), compute, link) == compute


def test_auto_window_copies_further_ahead_when_that_is_faster():
    """Measured compute and link: the auto plan takes prefetch 2 where prefetch 1 stalls
    (cfg 5, 12 GiB, halved link), and keeps prefetch 1 where the extra slot costs more than
    it hides (cfg 1, transfer-bound); not measured yet: the set prefetch."""
    base = dict(block_sizes=WAN, nonblock_bytes=500_000_000, reserve_bytes=400_000_000, prefetch=1)
    room8 = 9 * 704_500_000 + 500_000_000 + 400_000_000   # 7 resident + 2 slots: window 8, prefetch 1
    stalls = PlanInputs(free_bytes=room8 + 2_800_000_000, activation_bytes=2_800_000_000,
                        compute_s=0.918, link_bytes_per_s=28.2e9, **base)
    plan = plan_window(stalls)
    assert (plan.window, plan.prefetch, plan.bound) == (7, 2, "hidden"), plan.line()
    assert plan_window(replace(stalls, compute_s=0.0)).prefetch == 1
    assert plan_window(replace(stalls, window=8)).prefetch == 1
    bound = replace(stalls, compute_s=0.45, link_bytes_per_s=27.7e9)
    assert plan_window(bound).prefetch == 1 and plan_window(bound).bound == "copy-bound"
    assert "prefetch 2 (set 1): by the measured rates" in plan.line()


# Wan-14B Q8_0 blocks (0.373 GB): 2026-12-04 (sixth), 0.33 dynamic, cfg 1, 12 GiB, halved link, a
# rank-64 LoRA: 8 resident + 32 streamed at prefetch 1 ran 0.60 s a call, "LoRA fold 5.30 ms per block"
Q8 = (373_000_000,) * 40


def test_call_seconds_waits_for_each_fold_after_its_copy():
    """A streamed block computes once its copy is in and then its on-land work (a LoRA fold on
    the land stream) is done: where copies arrive just in time, each fold adds to the call;
    one more copy in flight hides them again."""
    from ringswap.swap.timing import call_seconds
    just_in_time = ResidencyPlan.make(40, 9, 1)
    assert call_seconds(Q8, just_in_time, 0.55, 27.6e9) == pytest.approx(0.55, abs=0.002)
    assert call_seconds(Q8, just_in_time, 0.55, 27.6e9, 0.0053) == pytest.approx(0.590, abs=0.003)
    assert call_seconds(Q8, ResidencyPlan.make(40, 6, 2), 0.55, 27.6e9, 0.0053) == pytest.approx(0.55, abs=0.002)
    assert call_seconds(Q8, ResidencyPlan.make(40, 40, 1), 0.55, 27.6e9, 0.0053) == 0.55


def test_auto_window_copies_further_ahead_where_folds_stall():
    """Measured folds: the auto plan copies a block further ahead where prefetch 1 would wait
    for folds past just-in-time copies; unmeasured (0), it keeps the larger window."""
    room = 9 * 373_000_000 + 2 * 700_000_000 + 500_000_000
    base = PlanInputs(block_sizes=Q8, nonblock_bytes=500_000_000, free_bytes=room, prefetch=1, compute_s=0.55,
                      link_bytes_per_s=27.6e9)
    unfolded = plan_window(base)
    assert unfolded.prefetch == 1 and unfolded.call_s == pytest.approx(0.55, abs=0.002)
    folded = plan_window(replace(base, land_s=0.0053))
    assert folded.prefetch == 2 and folded.call_s == pytest.approx(0.55, abs=0.002), folded.line()
    assert replace(unfolded, inputs=folded.inputs).call_s > 1.03 * folded.call_s   # prefetch 1 would stall
    assert "then a fold of 5.3 ms a block" in folded.line()


def test_compute_time_leaves_out_the_runs_first_call():
    from ringswap.swap.stats import RunStats
    st = RunStats(blocks=40, resident=7, streamed=33, ring_slots=2, window=8, prefetch=1, memory="pinned")
    st.call_times, st.wait_s = [1.30, 0.95, 0.95, 0.95], 0.12   # 0.03 s of waits a call
    assert st.compute_s == pytest.approx(0.92)
    st.call_times, st.wait_s = [1.30], 0.1
    assert st.compute_s == pytest.approx(1.20)
    st.land_stalls, st.landings = [0.002, 0.004], 30   # folds past their copies: ~0.09 s, sampled
    assert st.land_wait_s == pytest.approx(0.09)
    assert st.compute_s == pytest.approx(1.30 - 0.19)


def test_replan_with_rates_takes_the_timed_plan_where_it_pays_back():
    """A first prompt's plan (no rates) against the plan the first calls' rates choose: taken
    where each call gets >= 2% faster and the calls left save twice what placing costs;
    never for a timed, manual or all-resident plan."""
    from ringswap.swap.window_plan import replan_with_rates
    b = 1_000_000
    untimed = plan_window(PlanInputs(block_sizes=(b,) * 12, nonblock_bytes=0, free_bytes=4 * b, prefetch=1))
    assert (untimed.window, untimed.prefetch, untimed.timed) == (3, 1, False)
    new = replan_with_rates(untimed, 1.0, 10.5 * b, 20, lambda r: 0.1)
    assert (new.window, new.prefetch, new.automatic) == (2, 2, True)
    assert new.call_s == pytest.approx(1.048, abs=0.002)
    assert replan_with_rates(untimed, 1.0, 10.5 * b, 2, lambda r: 0.1) is None     # 2 calls save 0.05 s < 0.2
    assert replan_with_rates(untimed, 1.0, 10.5 * b, 20, lambda r: 0.3) is None    # 0.46 s < 0.6
    assert replan_with_rates(untimed, 1.0, 1e12, 20, lambda r: 0.0) is None        # the copies hide: same plan
    assert replan_with_rates(untimed, 0.0, 10.5 * b, 20, lambda r: 0.0) is None    # not measured
    timed = replace(untimed, inputs=replace(untimed.inputs, compute_s=1.0, link_bytes_per_s=10.5 * b))
    assert replan_with_rates(timed, 1.0, 10.5 * b, 20, lambda r: 0.0) is None
    manual = plan_window(replace(untimed.inputs, window=3))
    assert replan_with_rates(manual, 1.0, 10.5 * b, 20, lambda r: 0.0) is None
    resident = plan_window(replace(untimed.inputs, free_bytes=20 * b))
    assert replan_with_rates(resident, 1.0, 10.5 * b, 20, lambda r: 0.0) is None


def test_dense_folds_are_held_or_made_per_call_whichever_keeps_more_blocks_resident():
    """GGUF with a LoRA: each block copies its packed bytes (block_sizes) and computes from dense
    weights (dense_bytes). A ring slot holds both; a resident block holds its dense weights or
    makes them before each call (two sets alive). Little room: held (a tie keeps them held);
    more room: per call, more blocks resident; copies are counted at the packed bytes only."""
    q, d = GB // 4, 3 * GB // 4
    dense = inputs(block_sizes=(q,) * N, dense_bytes=(d,) * N)
    small = plan_window(replace(dense, free_bytes=4 * GB + 3 * (q + d)))
    assert not small.inputs.dense_per_call and len(small.residency.resident) == 1
    assert small.block_bytes_on_device == (q + d) * (1 + small.residency.ring_slots)
    big = plan_window(replace(dense, free_bytes=12 * GB))
    assert big.inputs.dense_per_call
    k = len(big.residency.resident)
    assert big.block_bytes_on_device == k * q + 2 * d + big.residency.ring_slots * (q + d) <= big.inputs.room_bytes
    assert k > (big.inputs.room_bytes - 2 * (q + d)) // (q + d), "more resident than holding dense weights allows"
    assert big.streamed_bytes == len(big.residency.streamed) * q
    assert plan_window(replace(dense, window=3)).inputs.dense_per_call is False, "2 resident: holding costs less"
    assert plan_window(replace(dense, window=6)).inputs.dense_per_call, "5 resident: per call costs less"
    smaller = shrink_after_oom(big)
    assert smaller.inputs.dense_per_call and smaller.window < big.window, "the recovery keeps the attached policy"
