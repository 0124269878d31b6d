"""A load's first call computes as its blocks arrive from the file (swap/first_use.py), on CPU and
(marked gpu) CUDA: it starts before the file is read in full, is bit-exact at every window,
prefetch and home, and a read error or an exception during it leaves nothing half-placed."""
import time

import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.recovery import run_call

from toy_blocks import N, FileLike, blocks_on_device, load_plan, make_blocks, run

X = torch.randn(4, 32)


def _engine(blocks, home="auto", delay=0.0):
    src = FileLike(blocks, delay=delay)
    return BlockSwapEngine(list(blocks), read_block=src.read, home=home, disk_workers=2), src


def test_first_block_computes_before_the_file_is_read():
    """attach returns with reads started; block 0 computes once its own bytes are in, while
    later blocks are still being read (a reader taking 30 ms a block, two at a time)."""
    blocks = make_blocks()
    ref = run(blocks, X)
    engine, src = _engine(blocks, delay=0.03)
    seen = []
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: seen.append((i, src.reads))) for i, b in enumerate(blocks)]
    shown = []
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1), stream_first=True),
                  progress=lambda done, total: shown.append((done, total)))
    assert engine.loading and src.reads < N
    assert torch.equal(run(blocks, X), ref)
    for h in hooks:
        h.remove()
    total = N * engine.states[0].layout.nbytes   # the load's progress moves with the bytes in
    assert len(shown) > 2 and shown[-1] == (total, total) and all(t == total for _, t in shown)
    assert [d for d, _ in shown] == sorted(d for d, _ in shown)
    assert [i for i, _ in seen] == list(range(N))
    assert seen[0][1] < N - 1, seen   # block 0 ran with most of the file still to read
    assert not engine.loading and src.reads == N   # every block read once: into its home or its device buffer
    stats = engine.end_run()
    assert stats is None or stats.first_call.read == N * engine.states[0].layout.nbytes
    engine.detach()


@pytest.mark.parametrize("home,share", [("auto", "all"), ("auto", "alternate"), ("auto", "none"), ("disk", None),
                                        ("ram", None)])
def test_streamed_first_call_is_exact_at_every_window(home, share):
    """Windows 1 to all, prefetch 0-2: the first call (blocks arriving) and the calls after
    (homes settled) equal the blocks run alone; the homes are the plan's, read once."""
    ref = run(make_blocks(), X)
    for window in (1, 2, 4, N):
        for prefetch in range(3):
            blocks = make_blocks()   # an engine takes the blocks' weights over: a fresh set each
            engine, src = _engine(blocks, home, delay=0.002)
            plan = ResidencyPlan.make(N, window, prefetch)
            ram = {"all": None, "alternate": list(plan.streamed[::2]), "none": [], None: None}[share]
            engine.attach("cpu", load_plan(plan, ram_blocks=ram, stream_first=True))
            for k in range(3):
                assert torch.equal(run(blocks, X), ref), (home, share, window, prefetch, k)
                assert not engine.loading
            homes = {"disk": set(), "ram": set(range(N))}.get(home, set(plan.streamed) if ram is None else set(ram))
            assert set(engine.pool.blocks) == homes and not engine.pool.filling, (home, window, prefetch)
            file_streamed = len(set(plan.streamed) - homes)
            assert src.reads <= N + 3 * file_streamed + 4, src.reads   # + the file-streamed blocks each call
            engine.detach()
            engine.release_home()


def test_read_error_in_the_first_call_leaves_nothing_behind_and_a_new_load_is_exact():
    """The file fails mid-call: the error propagates, the engine is detached with no block on
    the device and no home half-read; once readable, a new attach is exact."""
    blocks = make_blocks()
    ref = run(blocks, X)
    engine, src = _engine(blocks, delay=0.01)
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1), stream_first=True))
    src.broken = True
    with pytest.raises(OSError, match="file ended early"):
        run(blocks, X)
    assert not engine.attached and not blocks_on_device(engine) and not engine.pool.filling
    src.broken = False
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1), stream_first=True))
    assert torch.equal(run(blocks, X), ref) and torch.equal(run(blocks, X), ref)
    engine.detach()


def test_interrupt_in_the_first_call_then_the_next_call_is_exact():
    """An exception from the model (an interrupt) in the first call: through run_call the load is
    taken down and its device bytes given back; called directly, the next call goes on landing
    the blocks. Either way the next run is exact."""
    ref = run(make_blocks(), X)
    for through_run_call in (True, False):
        blocks = make_blocks()
        engine, _ = _engine(blocks, delay=0.005)
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1), stream_first=True))
        held = engine.device_bytes()

        def stop(m, a):
            raise KeyboardInterrupt("interrupted")
        h = blocks[3].register_forward_pre_hook(stop)
        changes = []
        with pytest.raises(KeyboardInterrupt):
            if through_run_call:
                run_call(engine, lambda: run(blocks, X), lambda: None, lambda old, new: changes.append((old, new)))
            else:
                run(blocks, X)
        h.remove()
        if through_run_call:
            assert not engine.attached and changes == [(held, 0)] and not engine.pool.filling
            engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1), stream_first=True))
        else:
            assert engine.loading
        assert torch.equal(run(blocks, X), ref) and torch.equal(run(blocks, X), ref)
        assert not engine.loading
        engine.detach()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("pin_memory", ["auto", "off"])
def test_streamed_first_call_on_cuda_is_exact_and_pins_the_homes(pin_memory):
    """CUDA: the first call's homes are page-locked as they are read (pin_memory auto) and the
    run copies from them; outputs equal the blocks run alone at every window."""
    ref_cuda = run(make_blocks().cuda(), X.cuda())
    for window in (1, 3, N):
        blocks = make_blocks()
        engine, _ = _engine(blocks, delay=0.002)
        engine.attach("cuda", load_plan(ResidencyPlan.make(N, window, 1), stream_first=True, pin_memory=pin_memory))
        x = X.cuda()
        for _ in range(3):
            assert torch.equal(run(blocks, x), ref_cuda), window
        assert not engine.loading
        if engine.plan.streamed:
            assert engine.memory == ("pinned" if pin_memory == "auto" else "pageable")
            assert all(engine.pool.buffer(i).pinned == (pin_memory == "auto") for i in engine.plan.streamed)
        engine.detach()
        engine.release_home()


def test_the_first_call_keeps_what_the_pins_made_ahead_had_done():
    """The first call's record keeps EarlyPins.by_attach (the pins made ahead, done by the attach), read
    before the first use lets go of its pinning: the run line's "pinned ahead were done by the attach"
    never showed on a GPU while it was read after (bench/RESULTS.md, twenty-first session)."""
    from ringswap.swap.ram_homes import EarlyPins
    blocks = make_blocks()
    engine, _ = _engine(blocks)
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1), stream_first=True))
    pinning = EarlyPins(engine.pool, [])   # on CPU the attach pins nothing: hand one over as a GPU's would be
    pinning.by_attach, pinning.done_at = (5, 9), time.perf_counter() - 5.0   # every pin ended before the attach
    engine.att.first_use.pinning = pinning
    run(blocks, X)
    first = engine.end_run().first_call
    assert first.ahead == (5, 9) and first.pins_end_s == 0.0   # not "the last -5 s after the attach"
    engine.detach()


def test_the_run_line_says_what_the_first_call_waited_for():
    """The run line's first-call words: what it read and when, when page-locking ended, and what
    its thread waited for, reads and page-locking apart (where a first call's time goes on a GPU)."""
    from ringswap.swap.stats import FirstCall, RunStats
    stats = RunStats(blocks=40, resident=7, streamed=33, ring_slots=2, window=8, prefetch=1, memory="pinned")
    stats.first_call = FirstCall(read=0, seconds=1.91, read_wait_s=0.0, reads_s=0.0, pin_s=3.66, pin_wait_s=0.62,
                                 pins_end_s=1.7)
    words = stats.first_words()
    assert "homes page-locked in 3.66 s, the last 1.70 s after the attach, all in 1.91 s" in words, words
    assert "compute waited 0.00 s for reads and 0.62 s for page-locking" in words, words
    stats.first_call = FirstCall(read=0, seconds=1.6, read_wait_s=0.0, reads_s=0.0, pin_s=0.0, pin_wait_s=0.4,
                                 pins_end_s=1.5, ahead=(14 * 10**9, 28 * 10**9))
    assert "the last 1.50 s after the attach (14.00 of 28.00 GB pinned ahead were done by the attach)" in \
        stats.first_words()
    stats.first_call = FirstCall(read=10**9, seconds=0.5, read_wait_s=0.1, reads_s=0.25, pin_s=0.0)
    assert "1.00 GB read from the file in 0.25 s (4.0 GB/s), homes page-locked in 0.00 s, all in 0.50 s" in \
        stats.first_words()
