"""The copy stream's timings on a CPU "device": a long run holds a bounded number of
measurements, folded into totals that equal the sum of every copy's time."""
import pytest
import torch

from ringswap.swap import transfer
from ringswap.swap.transfer import CopyStream


def test_a_long_run_holds_few_timings_and_loses_none():
    copier = CopyStream(torch.device("cpu"))
    src, dst = torch.randn(1024), torch.empty(1024)
    for _ in range(10 * transfer.FOLD_AT + 3):
        copier.copy(dst, src, None)
        assert len(copier._copies.pairs) < transfer.FOLD_AT
    copier.timed_compute(lambda: None)
    copier.mark_call(start=True)
    copier.mark_call(start=False)
    held = copier._copies.sum + sum(p[0] for p in copier._copies.pairs)
    copy_s, wait_s, lands, calls = copier.take_times()
    assert copy_s == pytest.approx(held, rel=1e-12) and wait_s == copy_s > 0
    assert len(lands) == 1 and len(calls) == 1
    assert copier.take_times() == (0.0, 0.0, [], [])   # taken: the next run starts from nothing
