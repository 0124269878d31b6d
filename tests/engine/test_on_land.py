"""On-land work (a LoRA fold) in the swap engine, on CPU: once per landing, replacements bound
instead, resident blocks folded before each call."""
import time

import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.dense_arena import aligned
from ringswap.swap.state import ResidentWork
from ringswap.swap.transfer import LAND_SAMPLE

from toy_blocks import N, FileLike, load_plan, make_blocks, run

X = torch.randn(4, 32)


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_on_land_runs_once_per_landing_before_the_block_computes(home):
    """The on-land work (LoRA fold) runs once per landing of a streamed block, after its bytes
    land and before the block computes; resident blocks get it once at attach; a block that
    stays in its slot is not folded again. Here it doubles the Linear's bias: the output must
    equal the doubled model's at every window, every call."""
    blocks = make_blocks()
    doubled = make_blocks()
    for b in doubled:
        b.lin.bias.data.mul_(2)
    want = run(doubled, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home=home, disk_workers=2)
    bias = next(a.entries[0] for a in engine.states[0].layout.attrs if (a.path, a.name) == ("lin", "bias"))
    events = []

    def on_land(block, tensors):
        assert tensors[bias].data_ptr() != 0
        tensors[bias].mul_(2)
        events.append(("fold", block))

    probes = [b.register_forward_hook(lambda m, a, o, i=i: events.append(("run", i))) for i, b in enumerate(blocks)]
    try:
        for window, prefetch in ((1, 0), (2, 1), (3, 2), (N, 1)):
            events.clear()
            plan = engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, window, prefetch)), on_land=on_land)
            assert sorted(b for e, b in events if e == "fold") == sorted(plan.resident)
            for _ in range(3):
                assert torch.equal(run(blocks, X), want), (home, window, prefetch)
            stats = engine.end_run()
            folds = [b for e, b in events if e == "fold" and b in plan.streamed]
            for b in plan.streamed:
                runs = [k for k, e in enumerate(events) if e == ("run", b)]
                lands = [k for k, e in enumerate(events) if e == ("fold", b)]
                assert all(any(f < r for f in lands) for r in runs), (b, events)
            if stats is not None and folds:   # one landing in LAND_SAMPLE has its fold timed
                assert 1 <= len(stats.land_times) <= len(folds) // LAND_SAMPLE + 1
            engine.detach()
    finally:
        for p in probes:
            p.remove()


def doubled_weight_engine(home: str):
    """Toy blocks on an engine reading them from a file-like source, the output of the same
    blocks with `lin.weight` doubled, and the attribute index and entry of `lin.weight`."""
    blocks, doubled = make_blocks(), make_blocks()
    for b in doubled:
        b.lin.weight.data.mul_(2)
    engine = BlockSwapEngine(list(blocks), read_block=FileLike(blocks).read, home=home, disk_workers=2)
    k = next(i for i, a in enumerate(engine.states[0].layout.attrs) if (a.path, a.name) == ("lin", "weight"))
    return blocks, run(doubled, X), engine, k, engine.states[0].layout.attrs[k].entries[0]


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_on_land_replacements_are_bound_instead_and_dropped_at_refill(home):
    """on_land may hand back another tensor for an attribute (a packed weight's dense form):
    the block computes from it, its own landed bytes stay unchanged, and a streamed block's
    replacement lives only while its slot holds that block (released when the slot is refilled)."""
    blocks, want, engine, k, entry = doubled_weight_engine(home)
    made: list = []

    def on_land(block, tensors):
        dense = tensors[entry] * 2
        made.append(torch.utils.weak.WeakTensorKeyDictionary())   # a weak view on each replacement
        made[-1][dense] = block
        return {k: dense}

    for window, prefetch in ((1, 0), (2, 1), (N, 1)):
        made.clear()
        plan = engine.attach("cpu", load_plan(ResidencyPlan.make(N, window, prefetch)), on_land=on_land)
        for _ in range(2):
            assert torch.equal(run(blocks, X), want), (home, window, prefetch)
        live = sum(len(m) for m in made)
        assert live <= len(plan.resident) + plan.ring_slots, (live, window, prefetch)
        engine.end_run()
        engine.detach()
        assert sum(len(m) for m in made) == 0, "replacements go with the attachment"
    if home == "ram":
        assert torch.equal(run(blocks, X), run(make_blocks(), X)), "the homes were never written"


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_resident_blocks_named_fold_per_call_hold_their_dense_weights_only_while_they_compute(home):
    """resident_work (a GGUF LoRA fold): a resident block gets its in-place work once, at
    placing, keeps its own weights bound between calls and gets its dense replacement before
    each call, bound only while it computes; streamed blocks fold once per landing as before;
    outputs stay the doubled model's over several calls and re-plans, and the reattach carries
    the split over."""
    blocks, want, engine, k, entry = doubled_weight_engine(home)
    folds: list[int] = []
    placed: list[int] = []
    seen: list = []

    def on_land(block, tensors):
        folds.append(block)
        return {k: tensors[entry] * 2}

    probes = [b.lin.register_forward_pre_hook(lambda m, a, i=i: seen.append((i, m.weight.data_ptr())))
              for i, b in enumerate(blocks)]
    try:
        work = ResidentWork(frozenset(range(N)), lambda block, tensors: placed.append(block), on_land)
        plan = engine.attach("cpu", load_plan(ResidencyPlan.make(N, 3, 1)), on_land=on_land, resident_work=work)
        assert sorted(placed) == sorted(plan.resident), "their in-place work runs once, at placing"
        own = {i: blocks[i].lin.weight.data_ptr() for i in plan.resident}
        assert folds == [], "resident blocks are not folded at placing"
        for call in range(3):
            folds.clear()
            assert torch.equal(run(blocks, X), want), call
            assert sorted(f for f in folds if f in plan.resident) == sorted(plan.resident), "once per call"
        assert engine.att.resident_folds.packed == {}, "dense weights dropped after each block"
        for i in plan.resident:
            assert blocks[i].lin.weight.data_ptr() == own[i], "its own weight bound between calls"
            assert all(p != own[i] for j, p in seen if j == i), "it computed from the dense weight"
        smaller = engine.reattach(load_plan(plan.reshaped(2, 1)), after_oom=False)
        assert engine.att.resident_work is work
        assert torch.equal(run(blocks, X), want)
        assert engine.att.resident_folds is not None and len(smaller.resident) >= 1
        engine.end_run()
        engine.detach()
        if home == "ram":
            assert torch.equal(run(blocks, X), run(make_blocks(), X)), "nothing folded stays behind"
    finally:
        for p in probes:
            p.remove()


class ArenaFold:
    """On-land work that cuts its replacement (the doubled weight) from the `out=` arena it is given."""

    def __init__(self, k: int, entry: int, nbytes: int):
        self.k, self.entry, self.nbytes = k, entry, nbytes
        self.arenas: list = []   # (block, the arena it was given)

    def dense_bytes(self, block: int) -> int:
        return self.nbytes

    def __call__(self, block, tensors, out=None):
        w = tensors[self.entry]
        dense = out.take(tuple(w.shape), w.dtype) if out is not None else torch.empty_like(w)   # held: placed once
        torch.mul(w, 2, out=dense)
        self.arenas.append((block, out))
        return {self.k: dense}


@pytest.mark.parametrize("home", ["ram", "disk"])
def test_dense_replacements_are_cut_from_the_slots_and_the_resident_sets_arenas(home):
    """On-land work with `dense_bytes` is given `out=`: a streamed block's arena is its slot's
    (sized from dense_bytes, refilled with the slot), a resident block folded per call gets one
    of two arenas in turn; outputs stay the doubled model's, and no landing allocates its own."""
    blocks, want, engine, k, entry = doubled_weight_engine(home)
    w = make_blocks()[0].lin.weight
    fold = ArenaFold(k, entry, w.numel() * w.element_size())
    work = ResidentWork(frozenset(range(N)), lambda block, tensors: None, fold)
    for window, prefetch, resident_work in ((1, 0, None), (2, 1, None), (3, 1, work), (N, 1, work)):
        plan = engine.attach("cpu", load_plan(ResidencyPlan.make(N, window, prefetch)), on_land=fold, resident_work=resident_work)
        for call in range(2):
            fold.arenas.clear()
            assert torch.equal(run(blocks, X), want), (home, window, prefetch, call)
            slots = {id(s.dense): s for s in engine.att.ring.slots} if engine.att.ring is not None else {}
            assert all(s.dense.nbytes >= fold.nbytes for s in slots.values())
            streamed = [a for b, a in fold.arenas if b in plan.streamed]
            assert streamed or not plan.streamed
            assert all(id(a) in slots for a in streamed), "a streamed block's dense weight is in its slot's arena"
            per_call = [a for b, a in fold.arenas if b in plan.resident]
            if resident_work is not None and plan.resident:
                sets = engine.att.resident_folds.arenas
                assert len(sets) == 2 and all(any(a is s for s in sets) for a in per_call)
                assert all(a is not b for a, b in zip(per_call, per_call[1:])), "the two in turn"
            else:
                assert per_call == [], "held dense weights are made once, at placing"
            per_call_sets = 2 * aligned(fold.nbytes) if resident_work is not None and plan.resident else 0
            held = 0 if resident_work is not None else len(plan.resident) * fold.nbytes
            assert engine.att.dense_held_bytes() == len(slots) * aligned(fold.nbytes) + per_call_sets + held
        engine.end_run()
        engine.detach()


def test_a_dense_arena_hands_out_aligned_views_until_full():
    from ringswap.swap.dense_arena import ALIGN, DenseArena
    arena = DenseArena(3 * ALIGN, torch.device("cpu"))
    a = arena.take((3, 5), torch.float32)
    b = arena.take((ALIGN // 2,), torch.bfloat16)
    assert a.shape == (3, 5) and a.dtype == torch.float32 and b.dtype == torch.bfloat16
    assert (b.data_ptr() - a.data_ptr()) % ALIGN == 0 and b.data_ptr() != a.data_ptr()
    assert arena.take((ALIGN + 1,), torch.uint8) is None, "no room left: the caller allocates"
    assert arena.restart().take((3, 5), torch.float32).data_ptr() == a.data_ptr()


@pytest.mark.gpu
def test_what_the_on_land_work_keeps_on_the_device_is_not_an_activation():
    """LoRA pairs moved to the device by their first fold are weights, planned as such: the
    first call's activation peak leaves out what the on-land work keeps from then on (its
    `kept_bytes`), and counts it where the work does not say."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ringswap.swap.recovery import run_call
    device, kept = torch.device("cuda", torch.cuda.current_device()), 64 * 2**20
    blocks = make_blocks()
    engine = BlockSwapEngine(list(blocks))

    class KeepsPairs:
        def __init__(self):
            self.pairs = None

        def __call__(self, block, tensors):
            if self.pairs is None:   # moved to the device by the first fold, kept from then on
                self.pairs = torch.ones(kept, dtype=torch.uint8, device=tensors[0].device)

        def kept_bytes(self, on: torch.device) -> int:
            return self.pairs.numel() if self.pairs is not None and self.pairs.device == on else 0

    class Unsaid(KeepsPairs):
        kept_bytes = None

    peaks = {}
    for work in (KeepsPairs(), Unsaid()):
        engine.attach(device, load_plan(ResidencyPlan.make(N, 1, 1)), on_land=work)
        x = X.to(device)
        run_call(engine, lambda: run(blocks, x), lambda: None, lambda old, new: None)
        peaks[type(work).__name__] = engine.att.stats.activation_peak
        engine.end_run()
        engine.detach()
    assert peaks["KeepsPairs"] < kept <= peaks["Unsaid"], peaks


def test_a_blocks_first_fold_is_not_timed_where_the_work_says_it_is_cold():
    """A block's first fold may do one-time work (LoRA pairs moved to the device and laid out):
    where the on-land work says so (`warm(block)` False) that landing is not timed, so the fold
    time the planner reads is what later landings cost; without `warm` every landing may be."""
    class FirstFoldSlow:
        def __init__(self):
            self.folded = set()

        def __call__(self, block, tensors):
            if block not in self.folded:
                time.sleep(0.03)
            self.folded.add(block)

        def warm(self, block: int) -> bool:
            return block in self.folded

    class Unsaid(FirstFoldSlow):
        warm = None

    blocks = make_blocks()
    engine = BlockSwapEngine(list(blocks))
    spans = {}
    for work in (FirstFoldSlow(), Unsaid()):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 1, 0)), on_land=work)
        for _ in range(8):
            run(blocks, X)
        spans[type(work).__name__] = engine.end_run().land_times
        engine.detach()
    assert spans["FirstFoldSlow"] and max(spans["FirstFoldSlow"]) < 0.01, spans
    assert max(spans["Unsaid"]) >= 0.03, spans
