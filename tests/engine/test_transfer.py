"""The copy stream's timings: a long run holds a bounded number of measurements, folded into
totals that equal the sum of every copy's time (CPU); on CUDA, copies timed from the stream's
order (no start event) agree with the copy stream's own busy time."""
import time

import pytest
import torch

from ringswap.swap import transfer
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
    for k in range(2 * transfer.LAND_SAMPLE + 1):
        copier.landed(ran.append, k)
    copier.mark_call(start=True)
    copier.mark_call(start=False)
    held = copier._copies.sum + sum(m[0] for m in copier._copies.held)
    copy_s, wait_s, lands, calls = copier.take_times()
    assert copy_s == pytest.approx(held, rel=1e-12) and wait_s == copy_s > 0
    assert ran == list(range(2 * transfer.LAND_SAMPLE + 1))   # every landing's work runs
    assert len(lands) == 3 and len(calls) == 1                # one landing in LAND_SAMPLE is timed
    assert copier.take_times() == (0.0, 0.0, [], [])   # taken: the next run starts from nothing


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
    copy_s = copier.take_times()[0]
    assert 0.8 * wall <= copy_s <= 1.02 * wall, (copy_s, wall)
    per_copy = copy_s / 8
    for _ in range(4):   # each copy waits for ~50 ms of compute; the compute then waits for it
        for _ in range(60):
            a = a @ a / 64
        ready = copier.copy(dst, src, copier.record_compute())
        copier.compute_wait(ready)
    copy_s, wait_s, _, _ = copier.take_times()
    assert 0.8 * 4 * per_copy <= copy_s <= 1.25 * 4 * per_copy, (copy_s, per_copy)
    assert 0.8 * copy_s <= wait_s <= 1.05 * copy_s, (wait_s, copy_s)


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
