"""The ring follows the order a model really calls its blocks in (engine alone, CPU).

A model that interleaves two block lists and calls some blocks twice per call (as Wan
VACE does with its vace_blocks, once per context) stays bit-exact at every window and
prefetch, both homes; the first call fetches out-of-order blocks when they are called
(counted), and once the order is learned later calls fetch none.
"""
import pytest
import torch
from torch import nn

from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.call_order import CallOrder
from toy_blocks import Block, FileLike, load_plan

MAIN, SIDE = 6, 2
AFTER = {0: 0, 3: 1}          # side block k runs after main block i, once per context
CONTEXTS = 2


class Interleaved(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.blocks = nn.ModuleList([Block() for _ in range(MAIN)])
        self.side_blocks = nn.ModuleList([Block() for _ in range(SIDE)])

    def forward(self, x):
        cs = [x * 0.5, x * 0.25]
        for i, block in enumerate(self.blocks):
            x = block(x)
            k = AFTER.get(i)
            if k is not None:
                for j in range(CONTEXTS):
                    cs[j] = self.side_blocks[k](cs[j])
                    x = x + 0.1 * cs[j]
        return x


def engine_blocks(model):
    return list(model.blocks) + list(model.side_blocks)   # list order: side blocks last


def call(engine, model, x):
    engine.begin_call()
    with torch.no_grad():
        out = model(x)
    engine.end_call()
    return out


X = torch.randn(4, 32)
N = MAIN + SIDE


@pytest.mark.parametrize("home", ["ram", "disk"])
@pytest.mark.parametrize("window", range(1, N + 1))
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_interleaved_calls_are_bit_exact_and_learned(home, window, prefetch):
    model = Interleaved()
    with torch.no_grad():
        ref = model(X)
    reader = FileLike(engine_blocks(model)) if home == "disk" else None
    engine = BlockSwapEngine(engine_blocks(model), read_block=reader.read if reader else None, home=home,
                             disk_workers=2)
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, window, prefetch)))
    try:
        first = [call(engine, model, X) for _ in range(2)]
        stats1 = engine.end_run()
        second = [call(engine, model, X) for _ in range(2)]
        stats2 = engine.end_run()
    finally:
        engine.detach()
    assert all(torch.equal(o, ref) for o in first + second)
    assert stats1.calls == 2 and stats2.calls == 2
    if stats1.streamed:
        assert stats2.unplanned == 0, (window, prefetch, stats2.unplanned)
        (order,) = engine.orders.values()
        assert len(set(order)) == stats1.streamed


def test_out_of_order_fetches_are_counted_then_gone():
    model = Interleaved()
    engine = BlockSwapEngine(engine_blocks(model))
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 1, 1)))             # every block streams
    try:
        call(engine, model, X)
        first = engine.end_run()
        call(engine, model, X)
        second = engine.end_run()
    finally:
        engine.detach()
    assert first.unplanned > 0 and "out-of-order fetches" in first.line()
    assert second.unplanned == 0 and "out-of-order" not in second.line()
    (order,) = engine.orders.values()
    # main 0, side 0 twice, main 1-3, side 1 twice, main 4-5
    assert order == (0, 6, 6, 1, 2, 3, 7, 7, 4, 5)


def test_call_order_cursor():
    o = CallOrder((0, 1, 2, 3), (0, 3, 3, 1, 2))
    assert o.upcoming() == [0, 3, 1, 2]
    assert o.observe(0) and o.upcoming() == [3, 1, 2, 0]
    assert o.observe(3) and o.upcoming() == [3, 1, 2, 0]      # called again next
    assert o.observe(3) and o.upcoming() == [1, 2, 0, 3]
    assert not o.observe(2) and o.upcoming() == [0, 3, 1, 2]   # skipped 1: not the expected call
    o.start(learn=True)
    for b in (2, 1, 0):
        o.observe(b)
    assert o.finish() == (2, 1, 0, 3) and o.upcoming() == [2, 1, 0, 3]
