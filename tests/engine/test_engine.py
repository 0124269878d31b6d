"""The swap engine alone, on CPU, with plain torch modules (no ComfyUI involved)."""
import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.state import ResidentWork
from ringswap.swap.transfer import LAND_SAMPLE

from toy_blocks import N, FileLike, make_blocks, run

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
            engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, window, prefetch))
            seen = []
            probes = [b.lin.register_forward_pre_hook(
                lambda m, a: seen.append(len(engine.blocks_on_device()))) for b in blocks]
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
            plan = engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, window, prefetch), on_land=on_land)
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
        plan = engine.attach("cpu", ResidencyPlan.make(N, window, prefetch), on_land=on_land)
        for _ in range(2):
            assert torch.equal(run(blocks, X), want), (home, window, prefetch)
        live = sum(len(m) for m in made)
        assert live <= len(plan.resident) + plan.ring_slots, (live, window, prefetch)
        engine.end_run()
        engine.detach()
        assert sum(len(m) for m in made) == 0, "replacements go with the attachment"
    if home == "ram":
        assert torch.equal(run(blocks, X), run(make_blocks(), X)), "the homes were never written"


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

    first = engine.attach("cpu", ResidencyPlan.make(N, 4, 1), on_land=on_land)
    assert torch.equal(run(blocks, X), want)
    for window, prefetch in ((3, 2), (2, 1), (4, 1)):
        before = {i: engine.states[i].device_buffer for i in engine.plan.resident}
        plan = engine.plan.reshaped(window, prefetch)
        folds.clear()
        assert engine.reattach(plan, after_oom=False) is plan and engine.plan is plan
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


def test_resident_blocks_read_from_the_file_are_read_ahead_while_placing():
    """Placing resident blocks that have no RAM home (home=auto reading them back) keeps the
    disk busy: the next blocks' reads run in the free staging buffers while one is copied,
    not one read at a time; the result is exact."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks, delay=0.02)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    engine.attach("cpu", ResidencyPlan.make(N, N, 1))   # every block resident: all read while placing
    assert engine.read_back[0] == N * engine.states[0].layout.nbytes
    assert src.most_in_flight == 2, src.most_in_flight
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


@pytest.mark.parametrize("share", ["none", "alternate", "all"])
def test_auto_home_holds_only_the_streamed_blocks_it_is_given(share):
    """home=auto: the streamed blocks named RAM homes live in the pool, the other streamed
    blocks come from the file every time, resident blocks keep no host copy; every window
    and prefetch is bit-exact, and a plan that pushes resident blocks off the device reads
    them back from the file (counted in read_back)."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks, delay=0.001)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    for window in (N, 4, 1, 3):
        for prefetch in range(0, 3):
            plan = ResidencyPlan.make(N, window, prefetch)
            ram = {"none": [], "alternate": list(plan.streamed[::2]), "all": None}[share]
            reads = src.reads   # before attach: it primes the ring (reads counted when they land)
            engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, window, prefetch), ram_blocks=ram)
            want_ram = set(plan.streamed) if ram is None else set(ram)
            assert set(engine.pool.blocks) == want_ram, (window, prefetch)
            assert engine.att.ram_homes == want_ram
            for _ in range(3):
                assert torch.equal(run(blocks, X), ref), (share, window, prefetch)
            stats = engine.end_run()
            file_streamed = len(set(plan.streamed) - want_ram)
            if stats is not None:
                assert stats.bytes_read <= (src.reads - reads) * engine.states[0].layout.nbytes   # + read-ahead
                assert (stats.bytes_read > 0) == (file_streamed > 0)
                if plan.streamed:
                    assert engine.memory == ("disk" if file_streamed and not want_ram else "staged")
            engine.detach()
            for i in range(N):   # detached: only the RAM homes are bound to host memory
                on_host = engine.states[i].binding.current()[0].numel() > 0
                assert on_host == (i in want_ram), i
    # the plan shrinks: blocks resident before come back from the file (or RAM where they have a home)
    engine.release_home()
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, N, 1))
    assert engine.read_back[0] == N * engine.states[0].layout.nbytes and not engine.pool.blocks
    engine.detach()
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 3, 1), ram_blocks=[])
    assert engine.read_back[0] == 2 * engine.states[0].layout.nbytes
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    seen = []
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 3, 1), progress=lambda done, total: seen.append((done, total)))
    nbytes = (2 + 5) * engine.states[0].layout.nbytes   # streamed blocks now get RAM homes: read back once
    assert engine.read_back[0] == nbytes
    assert seen and seen[-1] == (nbytes, nbytes) and all(t == nbytes for _, t in seen), seen
    assert [d for d, _ in seen] == sorted(d for d, _ in seen), "progress went back"
    engine.detach()
    seen.clear()
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 3, 1), progress=lambda done, total: seen.append((done, total)))
    assert engine.read_back[0] == 2 * engine.states[0].layout.nbytes and seen[-1][0] == seen[-1][1]
    engine.detach()
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 3, 1))
    seen.clear()
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 3, 1), progress=lambda done, total: seen.append((done, total)))
    assert not seen, "the same attachment again reads nothing and reports nothing"
    engine.detach()
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 3, 1), ram_blocks=[])   # same plan, homes dropped: only the resident read
    assert engine.read_back[0] == 2 * engine.states[0].layout.nbytes and not engine.pool.blocks
    engine.detach()


def test_auto_home_read_failure_leaves_nothing_half_loaded():
    """A read that fails while attach reads homes back: the error comes through, no RAM home
    is left behind, and the next attach with a good file is exact."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    src.broken = True
    with pytest.raises(OSError, match="file ended early"):
        engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 2, 1))
    assert not engine.pool.blocks and engine.att is None
    src.broken = False
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 2, 1))
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


@pytest.mark.parametrize("room_blocks", [0, 1, N])
def test_auto_home_keeps_resident_blocks_in_ram_as_far_as_given(room_blocks):
    """A home=auto model taken off the device with room for resident blocks keeps them in RAM
    (copied from the device, as many whole blocks as fit): the next attach places them without
    reading the file, drops those homes again once placed, and is exact. On-land work (a LoRA
    fold changes the device copy) keeps nothing."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    plan = ResidencyPlan.make(N, 4, 1)
    size = engine.states[0].layout.nbytes
    engine.attach("cpu", plan)
    engine.detach(capture_bytes=room_blocks * size)
    kept = sorted(set(engine.pool.blocks) - set(plan.streamed))
    assert kept == list(plan.resident[:min(room_blocks, len(plan.resident))])
    if room_blocks == N:   # every block has a home again: the detached model computes from RAM
        assert torch.equal(run(blocks, X), ref)
    reads = src.reads
    engine.attach("cpu", plan)
    assert src.reads - reads == len(plan.resident) - len(kept)
    assert sorted(engine.pool.blocks) == sorted(plan.streamed)
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    engine.attach("cpu", plan, on_land=lambda block, tensors: None)
    engine.detach(capture_bytes=N * size)
    assert sorted(engine.pool.blocks) == sorted(plan.streamed)


def test_plan():
    p = ResidencyPlan.make(40, 4, 1)
    assert len(p.resident) == 3 and len(p.streamed) == 37 and p.ring_slots == 2
    assert p.max_on_device == 5
    assert ResidencyPlan.make(8, 7, 1).streamed == ()
    with pytest.raises(ValueError, match="window must be at least 1"):
        ResidencyPlan.make(8, 0, 1)


def test_exception_mid_block_then_next_run_is_exact():
    blocks = make_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 2, 1))

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
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 2, 1))
    assert torch.equal(run(blocks, X), ref)
    src.broken = True
    with pytest.raises(OSError, match="file ended early"):
        for _ in range(3):
            run(blocks, X)
    engine.end_run()
    engine.detach()
    src.broken = False
    engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 2, 1))
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
        engine.attach("cpu", ResidencyPlan.make(engine.num_blocks, 1, prefetch))
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
        engine.attach("cpu", ResidencyPlan.make(N, 2, 1))
        codec.joins = 0
        for _ in range(3):
            assert torch.equal(run(blocks, X).as_subclass(torch.Tensor), want)
        streamed = 3 * len(engine.plan.streamed)
        assert codec.joins == streamed if fresh_join else codec.joins <= len(engine.att.ring.slots)
        engine.detach()
    finally:
        layout._CODECS.pop(Marked)


@pytest.mark.gpu
def test_auto_home_pins_its_streamed_homes_while_placing_on_cuda():
    """home=auto on CUDA: a detached model holds its streamed homes unpinned; attaching again
    page-locks them (on a thread of its own while the resident blocks are read and placed)
    and the run is exact against the same blocks wholly on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    x = X.to(dev)
    want = run(make_blocks().to(dev), x)
    blocks = make_blocks()
    engine = BlockSwapEngine(list(blocks), read_block=FileLike(blocks).read, home="auto", disk_workers=2)
    plan = ResidencyPlan.make(N, 3, 1)
    streamed = sum(engine.states[i].layout.nbytes for i in plan.streamed)
    for _ in range(2):
        engine.attach(dev, plan)
        assert engine.memory == "pinned" and engine.pool.pinned_bytes >= streamed
        assert torch.equal(run(blocks, x), want)
        engine.detach()
        assert engine.pool.pinned_bytes == 0 and sorted(engine.pool.blocks) == sorted(plan.streamed)


def _rss_file() -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile:"))
    except (OSError, StopIteration):
        return None


@pytest.mark.parametrize("page_out", [True, False])
def test_capture_from_a_file_mapping_gives_its_pages_back(tmp_path, monkeypatch, page_out):
    """Blocks whose weights are views of a memory-mapped file (as ComfyUI-GGUF builds them):
    capturing their homes copies them exactly, and on Linux the file's pages leave the RSS as
    each block is copied (no file mapping plus a second copy). Without page-out (other systems:
    FileMaps with no ranges) the capture is as exact."""
    import os
    import warnings

    import numpy as np
    from ringswap.swap import page_out as po
    blocks = make_blocks()
    ref = run(blocks, X)
    big = 2 << 20   # each block's weight padded to 2 MiB of file, so pages show in RSS
    path = tmp_path / "weights.bin"
    with open(path, "wb") as f:
        for b in blocks:
            f.write(b.lin.weight.detach().numpy().tobytes().ljust(big, b"\0"))
        f.flush()
        os.fsync(f.fileno())   # clean pages, as a model file's are (dirty ones are not paged out)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    with warnings.catch_warnings():   # torch: the array is not writable (the pack silences this too)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        views = [torch.from_numpy(mm[i * big:(i + 1) * big]) for i in range(N)]
    for b, v in zip(blocks, views):   # the weight and the rest of its 2 MiB, as a buffer, from the map
        b.lin.weight = torch.nn.Parameter(v[:32 * 32 * 4].view(torch.float32).view(32, 32), requires_grad=False)
        b.register_buffer("pad", v[32 * 32 * 4:])
        float(v.float().sum())   # every page of the file read once
    touched = _rss_file()
    engine = BlockSwapEngine(list(blocks), home="ram")
    maps = po.FileMaps() if page_out else po.FileMaps(ranges=[])
    from ringswap.swap import home
    monkeypatch.setattr(home, "FileMaps", lambda: maps)   # the capture's file mappings: these
    engine.attach("cpu", ResidencyPlan.make(N, 2, 1))
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    assert torch.equal(run(blocks, X), ref)
    after = _rss_file()
    if page_out and maps.ranges and touched is not None and maps._madvise is not None and _kernel_pages_out(tmp_path):
        assert touched - after >= 0.8 * N * big, (touched, after)   # the copied blocks' file pages left


def _kernel_pages_out(tmp_path) -> bool:
    """Does this kernel drop a file mapping's pages on MADV_PAGEOUT (Linux 5.4+; a sandbox's
    kernel may accept the call and keep them)? Probed on a file of its own."""
    import os
    import warnings

    import numpy as np
    from ringswap.swap.page_out import FileMaps
    path = tmp_path / "probe.bin"
    with open(path, "wb") as f:
        f.write(b"\1" * (8 << 20))
        f.flush()
        os.fsync(f.fileno())
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    before = _rss_file()
    int(mm[::4096].sum())
    touched = _rss_file()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        FileMaps().page_out([torch.from_numpy(mm)])
    return touched - _rss_file() >= 4 << 20 and touched > before


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
        plan = engine.attach("cpu", ResidencyPlan.make(N, 3, 1), on_land=on_land, resident_work=work)
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
        smaller = engine.reattach(plan.reshaped(2, 1), after_oom=False)
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
