"""Coded homes (swap/coding.py): streamed blocks kept in RAM as coded planes, decoded into their
slot or resident buffer; on the CPU with a real zlib plane coder (the GPU test uses nvCOMP)."""
import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan

from toy_blocks import N, FileLike, load_plan, make_blocks, run
from zlib_planes import StoredPlanes, ZlibPlanes

X = torch.randn(4, 32, dtype=torch.bfloat16)


def bf16_blocks():
    return make_blocks().to(torch.bfloat16)


def test_homes_held_in_the_modules_tensors_are_copied_into_ram_to_code_them():
    """Without a file the homes are the modules' own tensors (swap/held_tensors.py); an attach that
    codes copies them into RAM homes and codes those; exact before and after."""
    blocks = bf16_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = ZlibPlanes
    plan = ResidencyPlan.make(N, 3, 1)
    engine.attach("cpu", load_plan(plan))
    assert set(engine.pool.mapped) == set(range(N)) and torch.equal(run(blocks, X), ref)
    engine.detach()
    engine.link_bytes_per_s = 0.0   # the run timed the CPU's memcpy, no link: coding pays by size alone
    engine.attach("cpu", load_plan(plan, compress=True))
    assert not engine.pool.mapped and set(plan.streamed) <= set(engine.pool.coded)
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


@pytest.mark.parametrize("home", ["module", "ram", "auto"])
def test_coded_homes_are_bit_exact_at_every_window_and_prefetch(home):
    blocks = bf16_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks, delay=0.001)
    engine = BlockSwapEngine(list(blocks)) if home == "module" else \
        BlockSwapEngine(list(blocks), read_block=src.read, home=home, disk_workers=2)
    engine.coder_factory = ZlibPlanes
    raw = engine.states[0].layout.nbytes
    for window in (1, 3, N, 2):
        for prefetch in range(0, 3):
            plan = ResidencyPlan.make(N, window, prefetch)
            engine.attach("cpu", load_plan(plan, compress=True))
            coded = set(engine.pool.coded)
            assert set(plan.streamed) <= coded, (window, prefetch)   # every streamed RAM home coded
            assert not coded & set(engine.pool.blocks)                 # and its raw home gone
            for i in coded:
                assert engine.pool.coded[i].coded_bytes < 0.9 * raw
                assert len(engine.pool.coded[i].parts) > 1
            for _ in range(2):
                assert torch.equal(run(blocks, X), ref), (home, window, prefetch)
            stats = engine.end_run()
            assert stats is None or not plan.streamed or stats.copies > 0
            engine.detach()
    assert engine.coding.ratio < 0.9 and engine.coding.coder.decodes > 0 and engine.coding.decode_rate > 0
    if home != "auto":   # detached, a coded block points at no host copy; the others at their homes
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, N, 0), compress=True))   # coded blocks decoded into place
        assert torch.equal(run(blocks, X), ref)
        engine.detach()


def test_coded_homes_save_ram_and_stay_across_attaches():
    blocks = bf16_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = ZlibPlanes
    raw_total = engine.total_block_bytes()
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert engine.pool.nbytes < raw_total - 0.1 * engine.total_block_bytes() * (N - 2) / N
    first = {i: c.home for i, c in engine.pool.coded.items()}
    engine.detach()
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert {i: c.home for i, c in engine.pool.coded.items()} == first   # not coded again
    assert torch.equal(run(blocks, X), ref)
    engine.detach()
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 1, 1), compress=False))   # compress off: coded homes still serve
    assert set(engine.pool.coded) == set(first) and torch.equal(run(blocks, X), ref)
    engine.detach()


def test_a_coder_that_does_not_shrink_the_blocks_leaves_them_raw(caplog):
    blocks = bf16_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = StoredPlanes
    with caplog.at_level("INFO", logger="ringswap.coding"):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert not engine.pool.coded and engine.coding.pays is False
    assert "blocks stay raw" in caplog.text
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


def test_compress_without_a_coder_is_refused():
    engine = BlockSwapEngine(list(bf16_blocks()))
    with pytest.raises(RuntimeError, match="coder"):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert engine.att is None


def test_on_land_work_sees_the_decoded_block_and_the_home_stays_coded():
    """A LoRA-style fold on landing works on the decoded weights in the slot (here: the Linear's
    bias doubled); the coded home is untouched, so every landing and a re-attach stay exact."""
    blocks, doubled = bf16_blocks(), bf16_blocks()
    for b in doubled:
        b.lin.bias.data.mul_(2)
    want = run(doubled, X)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = ZlibPlanes
    bias = next(a.entries[0] for a in engine.states[0].layout.attrs if (a.path, a.name) == ("lin", "bias"))

    def on_land(block, tensors):
        tensors[bias].mul_(2)

    for window, prefetch in ((1, 0), (2, 1), (3, 2)):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, window, prefetch), compress=True), on_land=on_land)
        for _ in range(3):
            assert torch.equal(run(blocks, X), want), (window, prefetch)
        engine.end_run()
        engine.detach()


def test_a_mid_run_re_plan_keeps_coding_and_stays_exact():
    """reattach (a smaller window after running out of memory, or the rates' re-plan) keeps
    compress: blocks newly streamed get coded homes, blocks newly resident are decoded into place."""
    blocks = bf16_blocks()
    ref = run(blocks, X)
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="ram", disk_workers=2)
    engine.coder_factory = ZlibPlanes
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 5, 1), compress=True))
    assert torch.equal(run(blocks, X), ref)
    for window in (2, 6, 1):
        plan = ResidencyPlan.make(N, window, 1)
        engine.reattach(load_plan(plan))
        assert set(plan.streamed) <= set(engine.pool.coded)
        assert torch.equal(run(blocks, X), ref), window
    engine.end_run()
    engine.detach()
    engine.release_home()
    assert not engine.pool.coded and engine.pool.nbytes == 0


def test_a_coder_that_is_not_bit_exact_is_refused_at_coding():
    """The first coded block is decoded and compared with its bytes before its raw home goes:
    a coder that changes a bit is refused with a clear error, and the homes stay raw."""
    class Flips(ZlibPlanes):
        def decode(self, coded, out):
            super().decode(coded, out)
            out[0] ^= 1

    blocks = bf16_blocks()
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = Flips
    with pytest.raises(RuntimeError, match="bit for bit"):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert not engine.pool.coded and engine.att is None
    assert torch.equal(run(blocks, X), run(bf16_blocks(), X))   # the homes are whole


def auto_engine(coder=ZlibPlanes):
    """bf16 toy blocks, their reference output, their file and a home=auto engine on it with `coder`."""
    blocks = bf16_blocks()
    ref = run(blocks, X)   # before the engine: with a reader it drops the modules' weights
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2)
    engine.coder_factory = coder
    return blocks, ref, src, engine


def test_home_auto_keeps_an_outgoing_models_resident_blocks_coded():
    """home=auto with compress, taken off the device with room to keep its resident blocks (an
    expert switch): they are coded straight from the device into coded homes, and the next attach
    places them by decoding, without reading the file; exact."""
    blocks, ref, src, engine = auto_engine()
    plan = ResidencyPlan.make(N, 4, 1)
    engine.attach("cpu", load_plan(plan, compress=True))
    assert torch.equal(run(blocks, X), ref)
    engine.end_run()
    engine.link_bytes_per_s = 0.0   # the run timed the CPU's memcpy, no link: coding pays by size alone
    engine.detach(capture_bytes=10 ** 9)
    assert set(engine.pool.coded) == set(range(N)) and not engine.pool.blocks
    raw = sum(s.layout.nbytes for s in engine.states)
    assert engine.pool.nbytes < 0.9 * raw
    reads = src.reads
    engine.attach("cpu", load_plan(plan, compress=True))
    assert src.reads == reads and engine.read_back == (0, 0.0)
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


def test_coding_slower_than_the_measured_link_leaves_the_blocks_raw(caplog):
    """Where at the link measured earlier the first block's coded copy and its decode take longer
    than a raw copy: nothing is coded (said in the log), and the run is exact."""
    blocks = bf16_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = ZlibPlanes
    engine.link_bytes_per_s = 1e18   # a link no decode keeps up with
    with caplog.at_level("INFO", logger="ringswap.coding"):
        engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert not engine.pool.coded and engine.coding.pays is False and engine.coding.decode_rate > 0
    assert "take longer than a raw copy" in caplog.text
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


@pytest.mark.parametrize("link_gbps, decode_gbps, faster", [
    (55.4, 168.0, False),   # the H200's full link: 0.682/55.4 + 1/168 s a GB is more than 1/55.4
    (27.7, 168.0, True),    # a PCIe 4.0-class link: the coded copy saves more than the decode costs
    (27.7, 40.0, False),    # a decode slower than the bytes it saves
    (0.0, 168.0, True),     # the link not measured yet: coded (the plan chose to)
    (27.7, 0.0, True),      # the decode not timed (a CPU coder)
])
def test_coding_pays_where_coded_copy_and_decode_beat_a_raw_copy(link_gbps, decode_gbps, faster):
    from ringswap.swap.coding import Coding
    from ringswap.swap.host_pool import HostBuffer
    from ringswap.swap.plane_coder import CodedBlock
    coding = Coding(ZlibPlanes(), torch.device("cpu"))
    coding.decode_rate = decode_gbps * 1e9
    block = CodedBlock(HostBuffer(682), ((0, 1000, 0, 682),), 1000)
    assert coding.faster(block, link_gbps * 1e9) is faster


class FastZlib(ZlibPlanes):
    """zlib at level 1: the RSS test codes ~100 MB."""

    def encode(self, high: torch.Tensor) -> torch.Tensor:
        import zlib
        return torch.frombuffer(bytearray(zlib.compress(high.numpy().tobytes(), 1)), dtype=torch.uint8)


def test_coding_gives_the_raw_homes_ram_back():
    """The process's RSS falls by what coding saves: a dropped raw home is not held elsewhere. A
    twin codes first, so the allocator's heaps already hold what coding's temporaries take."""
    import psutil
    from torch import nn

    def engine():
        torch.manual_seed(0)
        blocks = nn.ModuleList([nn.Linear(2048, 2048, bias=False) for _ in range(6)])
        with torch.no_grad():
            for b in blocks:
                b.weight.normal_(0, 0.02)
        blocks = blocks.to(torch.bfloat16)   # 8 MB a block
        e = BlockSwapEngine(list(blocks), read_block=FileLike(blocks).read, home="ram", disk_workers=2)
        e.coder_factory = FastZlib
        return e
    plan = ResidencyPlan.make(6, 1, 1)
    twin = engine()
    twin.attach("cpu", load_plan(plan, compress=True))
    twin.detach()
    del twin
    eng, proc = engine(), psutil.Process()
    eng.attach("cpu", load_plan(plan))
    raw_rss, raw_pool = proc.memory_info().rss, eng.pool.nbytes
    eng.detach()
    eng.attach("cpu", load_plan(plan, compress=True))
    coded_rss, coded_pool = proc.memory_info().rss, eng.pool.nbytes
    saved = raw_pool - coded_pool
    assert saved > 0.2 * 5 * 8 * 2**20
    assert raw_rss - coded_rss > 0.8 * saved, (raw_rss - coded_rss, saved)
    eng.detach()


def test_a_coder_of_whole_words_gets_bf16_blocks_without_planes():
    """A coder that codes 16-bit words itself (ANS's float mode on the GPU) gets whole parts."""
    class WordsZlib(ZlibPlanes):
        words = True
    blocks = bf16_blocks()
    ref = run(blocks, X)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = WordsZlib
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    assert engine.pool.coded and not any(c.planes for c in engine.pool.coded.values())
    assert torch.equal(run(blocks, X), ref)
    engine.detach()


def test_fp16_blocks_cast_from_bf16_are_coded_narrowed_and_exact():
    """Blocks whose weights are fp16 cast from bf16 (how ComfyUI holds Wan): coded as bf16 words,
    every part narrowed, the run bit-exact."""
    blocks = make_blocks().to(torch.bfloat16).to(torch.float16)
    x = X.to(torch.float16)
    ref = run(blocks, x)
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = ZlibPlanes
    engine.attach("cpu", load_plan(ResidencyPlan.make(N, 2, 1), compress=True))
    coded = engine.pool.coded
    assert coded and all(c.narrowed == frozenset(range(len(c.parts))) for c in coded.values())
    for _ in range(2):
        assert torch.equal(run(blocks, x), ref)
    engine.detach()


def test_home_auto_allowed_to_code_keeps_its_resident_blocks_coded():
    """home=auto attached raw but allowed to code (`may_code`: compress auto with a coder), taken off
    the device: its resident blocks are kept coded (as many as fit the room), and the next attach
    places them by decoding, reading only the others from the file; exact. Without `may_code` they
    are kept raw; with a coder that does not shrink them (coding stops paying) raw; with one that is
    not bit-exact none is kept coded."""
    blocks, ref, src, engine = auto_engine()
    plan = ResidencyPlan.make(N, 4, 1)
    raw = sum(engine.states[i].layout.nbytes for i in plan.resident)
    engine.attach("cpu", load_plan(plan, may_code=True))
    assert torch.equal(run(blocks, X), ref) and not engine.pool.coded
    engine.detach(capture_bytes=raw)
    assert set(engine.pool.coded) == set(plan.resident) and engine.coding.checked
    assert not set(engine.pool.blocks) & set(plan.resident)
    coded = sum(engine.pool.coded[i].coded_bytes for i in plan.resident)
    reads = src.reads
    engine.attach("cpu", load_plan(plan, may_code=True))
    assert src.reads == reads and torch.equal(run(blocks, X), ref)
    assert not engine.pool.coded   # placed: home=auto keeps no home for a resident block
    engine.detach(capture_bytes=coded - 1)   # room for all but the last
    assert set(engine.pool.coded) == set(plan.resident[:-1])
    engine.attach("cpu", load_plan(plan))
    assert src.reads == reads + 1 and torch.equal(run(blocks, X), ref)
    engine.detach(capture_bytes=raw)
    assert not engine.pool.coded and set(plan.resident) <= set(engine.pool.blocks)

    _, _, _, stored = auto_engine(StoredPlanes)
    stored.attach("cpu", load_plan(plan, may_code=True))
    stored.detach(capture_bytes=raw)
    assert not stored.pool.coded and set(plan.resident) <= set(stored.pool.blocks) and stored.coding.pays is False

    class Flips(ZlibPlanes):
        def decode(self, coded, out):
            super().decode(coded, out)
            out[0] ^= 1
    fb, _, _, flipping = auto_engine(Flips)
    flipping.attach("cpu", load_plan(plan, may_code=True))
    flipping.detach(capture_bytes=raw)
    assert not flipping.pool.coded
    flipping.attach("cpu", load_plan(plan, may_code=True))
    assert torch.equal(run(fb, X), ref)
    flipping.detach()
