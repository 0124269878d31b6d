"""The swap engine alone, on CPU, with plain torch modules (no ComfyUI involved)."""
import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan

from toy_blocks import N, FileLike, blocks_on_device, load_plan, make_blocks, run

X = torch.randn(4, 32)


@pytest.mark.parametrize("home", ["module", "ram", "disk"])
def test_every_window_and_prefetch_is_bit_exact(home):
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks, delay=0.001)
    if home == "module":
        engine = BlockSwapEngine(list(blocks))
    else:
        engine = BlockSwapEngine(list(blocks), read_block=src.read, home=home, disk_workers=2)
    for window in range(1, N + 1):
        for prefetch in range(0, 3):
            engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, window, prefetch)))
            seen = []
            probes = [b.lin.register_forward_pre_hook(
                lambda m, a: seen.append(len(blocks_on_device(engine)))) for b in blocks]
            try:
                for _ in range(3):
                    assert torch.equal(run(blocks, X), ref), (home, window, prefetch)
            finally:
                for p in probes:
                    p.remove()
            assert max(seen) <= window + prefetch
            if home == "disk" and engine.att.readahead is not None:
                assert len(engine.att.readahead.staging) == 2
            engine.end_run()
            engine.detach()
    if home != "disk":
        assert torch.equal(run(blocks, X), ref), "detached blocks point at their home"


@pytest.mark.parametrize("home", ["module", "ram", "auto"])
def test_reattach_keeps_the_resident_blocks_both_plans_share(home):
    """A mid-run re-plan (reshaped: nearest the attached plan) keeps on the device the
    resident blocks both plans have: same buffers, not folded again; the blocks that join are
    placed and folded once; the output stays equal to the doubled model's."""
    blocks, doubled = make_blocks(), make_blocks()
    for b in doubled:
        b.lin.bias.data.mul_(2)
    want = run(doubled, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=None if home == "module" else src.read,
                             home="ram" if home == "module" else home, disk_workers=2)
    bias = next(a.entries[0] for a in engine.states[0].layout.attrs if (a.path, a.name) == ("lin", "bias"))
    folds = []

    def on_land(block, tensors):
        tensors[bias].mul_(2)
        folds.append(block)

    first = engine.attach("cpu", load_plan(ResidencyPlan.make(N, 4, 1)), on_land=on_land)
    assert torch.equal(run(blocks, X), want)
    for window, prefetch in ((3, 2), (2, 1), (4, 1)):
        before = {i: engine.states[i].device_buffer for i in engine.plan.resident}
        plan = engine.plan.reshaped(window, prefetch)
        folds.clear()
        assert engine.reattach(load_plan(plan), after_oom=False) is plan and engine.plan is plan
        for i in set(before) & set(plan.resident):   # still computing from its device buffer
            s = engine.states[i]
            assert s.device_buffer is before[i]
            assert s.binding.current()[0].data_ptr() == s.device_buffer.data_ptr()
        assert sorted(b for b in folds if b in plan.resident) == sorted(set(plan.resident) - set(before))
        for _ in range(2):
            assert torch.equal(run(blocks, X), want), (home, window, prefetch)
    assert engine.end_run().replans[0] == ((first.window, first.prefetch), (3, 2))
    engine.detach()
    assert all(s.device_buffer is None for s in engine.states)


def test_reshaped_plan_moves_only_the_difference():
    """reshaped: as many resident blocks as make gives; shrinking keeps a subset of the resident
    blocks, growing a superset, and both stay spread (no run of streamed blocks longer than
    twice make's)."""
    for n in (12, 40):
        for window in range(1, n):
            for new in range(1, n):
                old, even = ResidencyPlan.make(n, window, 1), ResidencyPlan.make(n, new, 2)
                got = old.reshaped(new, 2)
                assert (got.window, got.prefetch, len(got.resident)) == (new, 2, len(even.resident))
                assert sorted(got.resident + got.streamed) == list(range(n))
                if not old.streamed or not even.streamed:
                    assert got == even
                    continue
                small, large = sorted((set(old.resident), set(got.resident)), key=len)
                assert small <= large, (n, window, new)
                assert longest_streamed_run(got) <= 2 * longest_streamed_run(even), (n, window, new)


def longest_streamed_run(plan):
    """The longest run of streamed blocks, wrapping into the next call."""
    marks = sorted(plan.resident)
    if not marks:
        return plan.num_blocks
    return max((b - a - 1) % plan.num_blocks for a, b in zip(marks, marks[1:] + [marks[0] + plan.num_blocks]))


def test_plan():
    p = ResidencyPlan.make(40, 4, 1)
    assert len(p.resident) == 3 and len(p.streamed) == 37 and p.ring_slots == 2
    assert (len(p.resident) + p.ring_slots) == 5
    assert ResidencyPlan.make(8, 7, 1).streamed == ()
    with pytest.raises(ValueError, match="window must be at least 1"):
        ResidencyPlan.make(8, 0, 1)


def test_exception_mid_block_then_next_run_is_exact():
    blocks = make_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 2, 1)))

    def boom(module, args):
        raise KeyboardInterrupt("interrupted")
    h = blocks[3].lin.register_forward_pre_hook(boom)
    with pytest.raises(KeyboardInterrupt):
        run(blocks, X)
    h.remove()
    engine.end_run()
    assert all(s.slot is None for s in engine.states)
    assert torch.equal(run(blocks, X), ref)


def test_disk_read_failure_is_reported_and_recoverable():
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="disk", disk_workers=2)
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 2, 1)))
    assert torch.equal(run(blocks, X), ref)
    src.broken = True
    with pytest.raises(OSError, match="file ended early"):
        for _ in range(3):
            run(blocks, X)
    engine.end_run()
    engine.detach()
    src.broken = False
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 2, 1)))
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


def test_disk_home_with_one_staging_buffer_and_slow_reads():
    """More ring slots than staging buffers: a slot waiting for a buffer must not take
    the one another slot's block is being read into."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks, delay=0.003)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="disk", disk_workers=1)
    for prefetch in (1, 2):
        engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 1, prefetch)))
        for _ in range(6):
            assert torch.equal(run(blocks, X), ref), prefetch
        engine.end_run()
        engine.detach()


class Marked(torch.Tensor):
    """A packed-tensor stand-in: one part, rebuilt by its codec around the landed bytes."""


class MarkedCodec:
    def __init__(self, fresh_join):
        self.fresh_join = fresh_join
        self.joins = 0

    def split(self, t, name):
        return None, [(name, t.as_subclass(torch.Tensor))]

    def join(self, spec, parts):
        self.joins += 1
        return parts[0].as_subclass(Marked)


@pytest.mark.parametrize("fresh_join", [True, False])
def test_packed_tensors_join_afresh_only_where_their_codec_asks(fresh_join):
    """A codec's packed tensors are rebuilt at every bind when it says `fresh_join`; else one
    per ring slot serves every block landing there. Both bit-exact."""
    from ringswap.swap import layout
    codec = MarkedCodec(fresh_join)
    layout.register_codec(Marked, codec)
    try:
        blocks = make_blocks()
        want = run(blocks, X)
        for b in blocks:
            b.gain = b.gain.as_subclass(Marked)
        engine = BlockSwapEngine(list(blocks), home="ram")
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1)))
        codec.joins = 0
        for _ in range(3):
            assert torch.equal(run(blocks, X).as_subclass(torch.Tensor), want)
        streamed = 3 * len(engine.plan.streamed)
        assert codec.joins == streamed if fresh_join else codec.joins <= len(engine.att.ring.slots)
        engine.detach()
    finally:
        layout._CODECS.pop(Marked)
