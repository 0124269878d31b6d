"""The copy stream's timings: a long run holds a bounded number of measurements, folded into
totals that equal the sum of every copy's time (CPU); on CUDA, copies timed from the stream's
order (no start event) agree with the copy stream's own busy time, and the engine records at
most one event per streamed block beyond the two that order the streams."""
import time

import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan, transfer
from ringswap.swap.staged_copy import CHUNK, PinnedChunks
from ringswap.swap.host_pool import mapped_bytes
from ringswap.swap.transfer import CopyStream


def test_a_long_run_holds_few_timings_and_loses_none():
    copier = CopyStream(torch.device("cpu"))
    src, dst = torch.randn(1024), torch.empty(1024)
    for _ in range(10 * transfer.FOLD_AT + 3):
        copier.copy(dst, src, None)
        assert len(copier._copies.held) < transfer.FOLD_AT
    ran = []
    for k in range(2 * transfer.LAND_SAMPLE + 1):   # each block right after the last: may be sampled
        copier.record_compute(k - 1)
        copier.compute_wait(None, k)
        copier.landed(ran.append, k)
    for k in range(2 * transfer.LAND_SAMPLE):   # after another block, or where blocks interleave: never
        copier.record_compute(k)
        copier.compute_wait(None, k + 2 if k % 2 else None)
        copier.landed(ran.append, k)
    copier.mark_call(start=True)
    copier.mark_call(start=False)
    held = copier._copies.sum + sum(m[0] for m in copier._copies.held)
    t = copier.take_times()
    assert t.copy_s == pytest.approx(held, rel=1e-12) and t.wait_s == t.copy_s > 0
    assert ran == list(range(2 * transfer.LAND_SAMPLE + 1)) + list(range(2 * transfer.LAND_SAMPLE))   # all ran
    assert len(t.land_times) == 3 and len(t.call_times) == 1   # one landing in LAND_SAMPLE of those that follow
    assert t.landings == 2 * transfer.LAND_SAMPLE + 1 and t.land_stalls == []   # no stream to stall on the CPU
    assert copier.take_times() == transfer.Times(0.0, 0.0, [], [], [], 0)   # taken: the next run starts from nothing


@pytest.mark.gpu
def test_cuda_copies_timed_from_the_stream_order():
    """Back-to-back copies, then copies that wait for compute (a slot's free event): the copy
    time counts the copies, not the compute they waited for, and stalls are measured."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    copier = CopyStream(dev)
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=dev)
    a = torch.randn(4096, 4096, device=dev)
    copier.copy(dst, src, None)
    copier.take_times()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(8):
        copier.copy(dst, src, None)
    copier.synchronize()
    wall = time.perf_counter() - t0
    copy_s = copier.take_times().copy_s
    assert 0.8 * wall <= copy_s <= 1.02 * wall, (copy_s, wall)
    per_copy = copy_s / 8
    for _ in range(4):   # each copy waits for ~50 ms of compute; the compute then waits for it
        for _ in range(60):
            a = a @ a / 64
        ready = copier.copy(dst, src, copier.record_compute(0))
        copier.compute_wait(ready)
    t = copier.take_times()
    copy_s, wait_s = t.copy_s, t.wait_s
    assert 0.8 * 4 * per_copy <= copy_s <= 1.25 * 4 * per_copy, (copy_s, per_copy)
    assert 0.8 * copy_s <= wait_s <= 1.05 * copy_s, (wait_s, copy_s)
    for k in range(4):   # the same, the stall timed from the slot-free event of the block before
        for _ in range(60):
            a = a @ a / 64
        ready = copier.copy(dst, src, copier.record_compute(k))
        copier.compute_wait(ready, k + 1)
    t = copier.take_times()
    copy_s, wait_s = t.copy_s, t.wait_s
    assert 0.8 * 4 * per_copy <= copy_s <= 1.25 * 4 * per_copy, (copy_s, per_copy)
    assert 0.8 * copy_s <= wait_s <= 1.05 * copy_s, (wait_s, copy_s)


@pytest.mark.gpu
def test_cuda_fold_stall_past_the_copy_is_measured():
    """A sampled landing whose on-land work is long while the compute stream is idle: the
    compute's wait for it is measured, about the fold's own span."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    copier = CopyStream(dev)
    a = torch.randn(4096, 4096, device=dev)

    def fold():
        b = a
        for _ in range(20):
            b = b @ a / 64
        return {0: b}
    for k in range(2 * transfer.LAND_SAMPLE + 1):
        copier.record_compute(k - 1)
        copier.compute_wait(None, k)
        copier.landed(fold)
    t = copier.take_times()
    assert len(t.land_stalls) == len(t.land_times) == 3 and t.landings == 2 * transfer.LAND_SAMPLE + 1
    assert all(0.8 * span <= stall <= 1.05 * span + 1e-4 for stall, span in zip(t.land_stalls, t.land_times)), t


@pytest.mark.gpu
@pytest.mark.parametrize("window", [1, 3])
def test_at_most_one_measuring_event_per_streamed_block(monkeypatch, window):
    """Over a run of several calls with a LoRA-like on-land step, the events the copy stream
    records: two per streamed block order the streams (the copy's end, the slot's free event;
    a landing's end orders the compute after it with an untimed event); beyond them at most one
    per streamed block, plus a few per call and run."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from toy_blocks import N, load_plan, make_blocks, run
    dev = torch.device("cuda")
    made = []
    real = transfer._timing_event
    monkeypatch.setattr(transfer, "_timing_event", lambda: made.append(1) or real())
    blocks = make_blocks()
    want = run(make_blocks().to(dev), torch.ones(4, 32, device=dev))
    engine = BlockSwapEngine(list(blocks))
    plan = ResidencyPlan.make(N, window, 1)
    engine.attach(dev, load_plan(plan), on_land=lambda block, tensors: None)
    made.clear()
    calls = 20
    for _ in range(calls):
        engine.begin_call()
        assert torch.equal(run(blocks, torch.ones(4, 32, device=dev)), want)
        engine.end_call()
    stats = engine.end_run()
    streamed = calls * len(plan.streamed)
    assert stats.forwards == streamed
    assert len(made) <= 3 * streamed + 2 * calls + 2, (len(made), streamed)
    assert stats.land_times and stats.copy_s > 0
    engine.detach()


@pytest.mark.gpu
def test_staged_copies_through_pinned_chunks_are_exact():
    """PinnedChunks copies a device buffer into fresh pageable memory and back through two
    pinned chunks: every byte lands, across chunk borders and a short last chunk, call after
    call (an upload refills a chunk only after its last DMA)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with PinnedChunks() as chunks:
        for n in (CHUNK * 2 + 12345, 1000, CHUNK * 3):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
            host = mapped_bytes(n)
            chunks.download(src, host)
            assert torch.equal(host, src.cpu())
            back = torch.empty_like(src)
            chunks.upload(host, back)
            chunks.synchronize()
            assert torch.equal(back, src)
        assert all(c.pinned for c in chunks.chunks)
    assert not chunks.chunks
