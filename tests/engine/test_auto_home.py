"""home=auto in the swap engine, on CPU (two GPU tests): homes held only where given, read back
ahead while placing, failures that leave nothing behind, resident blocks kept in RAM, file
mappings given back; without a file, homes held in the module's own tensors."""
import copy

import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan

from toy_blocks import N, FileLike, load_plan, make_blocks, run

X = torch.randn(4, 32)


def test_resident_blocks_read_from_the_file_are_read_ahead_while_placing():
    """Placing resident blocks that have no RAM home (home=auto reading them back) keeps the
    disk busy: the next blocks' reads run in the free staging buffers while one is copied,
    not one read at a time; the result is exact."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks, delay=0.02)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, N, 1)))   # every block resident: all read while placing
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
            engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, window, prefetch), ram_blocks=ram))
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
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, N, 1)))
    assert engine.read_back[0] == N * engine.states[0].layout.nbytes and not engine.pool.blocks
    engine.detach()
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 3, 1), ram_blocks=[]))
    assert engine.read_back[0] == 2 * engine.states[0].layout.nbytes
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    seen = []
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 3, 1)), progress=lambda done, total: seen.append((done, total)))
    nbytes = (2 + 5) * engine.states[0].layout.nbytes   # streamed blocks now get RAM homes: read back once
    assert engine.read_back[0] == nbytes
    assert seen and seen[-1] == (nbytes, nbytes) and all(t == nbytes for _, t in seen), seen
    assert [d for d, _ in seen] == sorted(d for d, _ in seen), "progress went back"
    engine.detach()
    seen.clear()
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 3, 1)), progress=lambda done, total: seen.append((done, total)))
    assert engine.read_back[0] == 2 * engine.states[0].layout.nbytes and seen[-1][0] == seen[-1][1]
    engine.detach()
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 3, 1)))
    seen.clear()
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 3, 1)), progress=lambda done, total: seen.append((done, total)))
    assert not seen, "the same attachment again reads nothing and reports nothing"
    engine.detach()
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 3, 1), ram_blocks=[]))   # same plan, homes dropped: only the resident read
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
        engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 2, 1)))
    assert not engine.pool.blocks and engine.att is None
    src.broken = False
    engine.attach("cpu", load_plan(ResidencyPlan.make(engine.num_blocks, 2, 1)))
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


@pytest.mark.parametrize("room_blocks", [0, 1, N])
def test_auto_home_keeps_resident_blocks_in_ram_as_far_as_given(room_blocks):
    """A home=auto model taken off the device with room for resident blocks keeps them in RAM
    (copied from the device, as many whole blocks as fit): the next attach places them without
    reading the file, drops those homes again once placed, and is exact. On-land work that may
    write the blocks (a LoRA fold changes the device copy) keeps nothing; work that only hands
    back replacements (`writes_blocks` False) keeps them."""
    blocks = make_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    plan = ResidencyPlan.make(N, 4, 1)
    size = engine.states[0].layout.nbytes
    engine.attach("cpu", load_plan(plan))
    engine.detach(capture_bytes=room_blocks * size)
    kept = sorted(set(engine.pool.blocks) - set(plan.streamed))
    assert kept == list(plan.resident[:min(room_blocks, len(plan.resident))])
    if room_blocks == N:   # every block has a home again: the detached model computes from RAM
        assert torch.equal(run(blocks, X), ref)
    reads = src.reads
    engine.attach("cpu", load_plan(plan))
    assert src.reads - reads == len(plan.resident) - len(kept)
    assert sorted(engine.pool.blocks) == sorted(plan.streamed)
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    engine.attach("cpu", load_plan(plan), on_land=lambda block, tensors: None)
    engine.detach(capture_bytes=N * size)
    assert sorted(engine.pool.blocks) == sorted(plan.streamed)
    replaces = ReplacesOnly()   # on-land work that only hands back new tensors keeps them again
    engine.attach("cpu", load_plan(plan), on_land=replaces)
    engine.detach(capture_bytes=N * size)
    assert sorted(engine.pool.blocks) == list(range(N)) and replaces.calls
    assert torch.equal(run(blocks, X), ref), "the kept homes hold the placed weights"


class ReplacesOnly:
    """On-land work that writes no block tensor (as a GGUF dense fold): `writes_blocks` False."""
    writes_blocks = False

    def __init__(self):
        self.calls = 0

    def __call__(self, block, tensors):
        self.calls += 1
        return None


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
        engine.attach(dev, load_plan(plan))
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
    """Blocks whose weights are views of a memory-mapped file, where they cannot be held as they are
    (packed, as ComfyUI-GGUF builds them; here held homes are turned off): capturing their homes
    copies them exactly, and on Linux the file's pages leave the RSS as each block is copied (no
    file mapping plus a second copy). Without page-out (other systems: FileMaps with no ranges) the
    capture is as exact."""
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
    from ringswap.swap import homes, ram_homes
    monkeypatch.setattr(ram_homes, "FileMaps", lambda: maps)   # the capture's file mappings: these
    monkeypatch.setattr(homes, "holdable", lambda *a: False)   # the copy path (held homes: below)
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1)))
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    assert torch.equal(run(blocks, X), ref)
    after = _rss_file()
    if page_out:   # the copied blocks' file pages left the RSS
        _skip_without_page_out(tmp_path, touched, maps)
        assert touched - after >= 0.8 * N * big, (touched, after)


def test_blocks_without_a_file_are_held_in_their_own_tensors(tmp_path):
    """Without a file to read (the Patch on a MODEL ComfyUI loaded), each block's home is its
    module's own tensors (swap/held_tensors.py): nothing copied in RAM, the same tensors before and
    after, exact at every window; a block whose tensors were replaced from outside is held anew."""
    blocks = make_blocks()
    ref = run(blocks, X)
    first = [t.data_ptr() for t in blocks.parameters()]
    engine = BlockSwapEngine(list(blocks), home="ram")
    for window in (1, 3, N):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, window, 1)))
        assert set(engine.pool.mapped) == set(range(N)) and not engine.pool.blocks
        for _ in range(2):
            assert torch.equal(run(blocks, X), ref), window
        engine.detach()
        assert [t.data_ptr() for t in blocks.parameters()] == first   # the module's own tensors again
    assert engine.pool.mapped[0].pageable_bytes == sum(e.nbytes for e in engine.states[0].layout.entries)   # CPU: none locked
    blocks[0].lin.weight = torch.nn.Parameter(blocks[0].lin.weight.detach().clone(), requires_grad=False)
    new = blocks[0].lin.weight.data_ptr()
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 1, 1)))
    assert any(t.data_ptr() == new for t in engine.pool.mapped[0].tensors)
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    engine.release_home()


def _skip_without_page_out(tmp_path, touched, maps=None) -> None:
    """Skip (naming the probe that failed) where this process cannot show a file mapping's pages
    leaving its RSS: the giving back is then not checked, so the test must not pass."""
    from ringswap.swap.page_out import FileMaps
    maps = FileMaps() if maps is None else maps
    if not maps.ranges:
        pytest.skip("page-out probe negative: FileMaps lists no file mappings (no /proc/self/maps)")
    if touched is None:
        pytest.skip("page-out probe negative: no RssFile in /proc/self/status")
    if maps._madvise is None:
        pytest.skip("page-out probe negative: madvise(MADV_PAGEOUT) failed (Linux before 5.4?)")
    if not _kernel_pages_out(tmp_path):
        pytest.skip("page-out probe negative: _kernel_pages_out: this kernel keeps a file mapping's pages")


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


def test_weights_moved_off_a_file_mapping_give_its_pages_back(tmp_path):
    """The non-block weights of a model mapped from its file (ComfyUI-GGUF), once ComfyUI has
    moved them (here: new data in the same Parameter, as Module.to does), leave the RSS; those
    still held in the map are found and kept, and read the same."""
    import os
    import warnings

    import numpy as np
    from ringswap.swap import page_out as po
    big = 2 << 20
    path = tmp_path / "weights.bin"
    data = torch.randn(3, big // 4)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    mm = np.memmap(path, dtype=np.float32, mode="r")
    model = torch.nn.Module()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for i, name in enumerate(("moved", "replaced", "kept")):
            view = torch.from_numpy(mm[i * (big // 4):(i + 1) * (big // 4)])
            model.register_parameter(name, torch.nn.Parameter(view, requires_grad=False))
    float(sum(p.sum() for p in model.parameters()))   # every page read once
    mapped = po.mapped_tensors(model)
    if not po.FileMaps().ranges:   # off Linux nothing is mapped or given back
        assert mapped == [] and po.page_out_moved(mapped) == 0
        _skip_without_page_out(tmp_path, _rss_file())
    assert sorted(m.name for m in mapped) == ["kept", "moved", "replaced"]
    assert po.page_out_moved(mapped) == 0   # nothing moved yet
    touched = _rss_file()
    model.moved.data = model.moved.data.clone()   # the same Parameter, its data elsewhere
    model.replaced = torch.nn.Parameter(model.replaced.detach().clone(), requires_grad=False)
    gave = po.page_out_moved(mapped)
    assert gave == 0 or 2 * big - 2 * po.PAGE <= gave <= 2 * big, gave   # 0: a kernel without MADV_PAGEOUT
    assert torch.equal(model.kept, data[2]) and torch.equal(model.moved, data[0])
    _skip_without_page_out(tmp_path, touched)
    assert gave and touched - _rss_file() >= 0.8 * 2 * big, (gave, touched, _rss_file())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_held_homes_on_cuda_are_page_locked_in_place_and_exact():
    """On CUDA the held tensors' pages are page-locked in place (large ones registered, the rest in
    a small page-locked buffer: no copy from pageable memory); home=ram keeps them page-locked over a
    detach, as its RAM homes, and gives them back with the homes; exact."""
    big = torch.nn.ModuleList([torch.nn.Linear(1024, 1024) for _ in range(N)])   # 4 MiB weights: registered
    x = torch.randn(4, 1024)
    cpu_ref = [b(x) for b in big]
    ref = [b(x.cuda()) for b in copy.deepcopy(big).cuda()]
    engine = BlockSwapEngine(list(big), home="ram")
    engine.attach("cuda", load_plan(ResidencyPlan.make(N, 2, 1)))
    for _ in range(2):
        assert all(torch.equal(b(x.cuda()), r) for b, r in zip(big, ref))
    held = [engine.pool.mapped[i] for i in engine.plan.streamed]
    assert engine.memory == "pinned" and all(h.pinned and h.pageable_bytes == 0 for h in held)
    engine.detach()
    assert engine.pool.pinned_bytes >= sum(h.nbytes for h in held) - 2 * len(held) * 4096
    assert all(torch.equal(b(x), r) for b, r in zip(big, cpu_ref))   # the module's own tensors again
    engine.release_home()
    assert engine.pool.pinned_bytes == 0 and not engine.pool.mapped
