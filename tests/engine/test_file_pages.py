"""Homes in the file's own pages (swap/file_pages.py): a block whose tensors are the file's bytes
as they are is copied from a read-only mapping, piece by piece, into its layout; nothing is read.
Exact at every window, with the first call streaming; on CUDA the pages wholly inside a home are
page-locked in place and given back at detach."""
import copy
import os

import pytest
import torch

from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.file_pages import PAGE, FilePages, MappedBlock
from ringswap.swap.layout import BlockBinding, BlockLayout

from toy_blocks import N, FileLike, load_plan, make_blocks, run
from zlib_planes import ZlibPlanes

X = torch.randn(4, 32)


def write_file(blocks, path, gap=3):
    """Each block's tensors written in reverse order at odd offsets (not the layout's), the
    blocks back to back so that neighbours share pages; returns map_block over a FilePages."""
    parts, pos, raw = [], 5, bytearray(5)
    for b in blocks:
        layout = BlockLayout.of(b)
        flat = torch.empty(layout.nbytes, dtype=torch.uint8)
        layout.pack(BlockBinding(b, layout).current(), flat)
        mine = []
        for e in reversed(layout.entries):
            raw += bytes(gap) + flat[e.offset:e.offset + e.nbytes].numpy().tobytes()
            mine.append((pos + gap, e.nbytes, e.offset))
            pos += gap + e.nbytes
        parts.append((mine, layout.nbytes))
    return map_blocks(path, raw, parts)


def map_blocks(path, raw, parts):
    """`raw` written to `path`; map_block over a MappedBlock of each block's (parts, bytes)."""
    with open(path, "wb") as f:
        f.write(raw)
    pages = FilePages(path)
    homes = [MappedBlock(pages, p, n) for p, n in parts]
    return lambda i: homes[i]


def write_file_cast(blocks, path):
    """Each block's tensors written back to back as bf16 (the blocks hold fp16): map_block over
    homes whose every part is cast as it lands."""
    parts, raw = [], bytearray()
    for b in blocks:
        layout = BlockLayout.of(b)
        mine = []
        for e, t in zip(layout.entries, BlockBinding(b, layout).current()):
            data = t.detach().to(torch.bfloat16).reshape(-1).view(torch.uint8).numpy().tobytes()
            mine.append((len(raw), len(data), e.offset, (torch.bfloat16, torch.float16)))
            raw += data
        parts.append((mine, layout.nbytes))
    return map_blocks(path, raw, parts)


@pytest.mark.parametrize("stream_first", [False, True])
def test_mapped_homes_are_exact_and_read_nothing(tmp_path, stream_first):
    ref = run(make_blocks(), X)
    for window in (1, 3, N):
        for prefetch in (0, 1, 2):
            blocks = make_blocks()
            map_block = write_file(blocks, os.path.join(tmp_path, f"m{window}{prefetch}.bin"))
            src = FileLike(blocks)
            engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2, map_block=map_block)
            plan = ResidencyPlan.make(N, window, prefetch)
            engine.attach("cpu", load_plan(plan, stream_first=stream_first))
            for _ in range(3):
                assert torch.equal(run(blocks, X), ref), (window, prefetch, stream_first)
            assert set(engine.pool.mapped) == set(plan.streamed) and not engine.pool.blocks
            # the first call places the resident blocks from the file's pages too; else they are read
            assert src.reads == (0 if stream_first else len(plan.resident))
            engine.detach()
            assert set(engine.pool.mapped) == set(plan.streamed)   # kept: the next attach reads nothing
            engine.attach("cpu", load_plan(ResidencyPlan.make(N, 1, 1)))
            assert torch.equal(run(blocks, X), ref)
            assert src.reads == (0 if stream_first else len(plan.resident)) and set(engine.pool.mapped) == set(range(N))
            engine.detach()
            engine.release_home()


def test_copies_split_where_the_registered_pages_begin_and_end(tmp_path):
    """A home registers only the pages wholly inside its bytes (neighbours share the others): a
    copy is never part registered and part not."""
    path = os.path.join(tmp_path, "p.bin")
    with open(path, "wb") as f:
        f.write(bytes(10 * PAGE))
    pages = FilePages(path)

    def cuts(home, k):   # part k's pieces as file ranges
        s = home.parts[k][0].data_ptr() - pages.data.data_ptr()
        return [(s + x, s + y) for j, x, y, _ in home.pieces() if j == k]

    def register_pages_1_and_2(home):   # as pin() registers for a block over [100, 3 * PAGE + 100)
        home._spans, home.pinned = [(pages.data[PAGE:].data_ptr(), 2 * PAGE, None)], True

    home = MappedBlock(pages, [(100, PAGE, 0), (PAGE + 100, 2 * PAGE, PAGE)], 3 * PAGE)
    assert cuts(home, 0) == [(100, PAGE + 100)] and home.pageable_bytes == 3 * PAGE
    register_pages_1_and_2(home)
    assert cuts(home, 0) == [(100, PAGE), (PAGE, PAGE + 100)]
    assert cuts(home, 1) == [(PAGE + 100, 3 * PAGE), (3 * PAGE, 3 * PAGE + 100)]
    home.pinned, home._spans = False, []
    home = MappedBlock(pages, [(PAGE - 8, 2 * PAGE + 16, 0)], 2 * PAGE + 16)
    register_pages_1_and_2(home)
    assert cuts(home, 0) == [(PAGE - 8, PAGE), (PAGE, 3 * PAGE), (3 * PAGE, 3 * PAGE + 8)]
    home.pinned, home._spans = False, []


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.float16])
def test_a_tensor_held_in_another_dtype_is_cast_as_it_lands(tmp_path, model_dtype):
    """The file's bf16 bytes, the model's fp32 (a size apart) or fp16 (the same size, as ComfyUI 0.33
    builds Wan from a bf16 file) tensor: the home copies and casts them into the layout, exactly as a
    cast on read would. On a GPU the copy leaves the casts to the stream that uses the block."""
    values = torch.randn(3000).to(torch.bfloat16)
    path = os.path.join(tmp_path, "c.bin")
    with open(path, "wb") as f:
        f.write(bytes(6) + values.view(torch.uint8).numpy().tobytes())
    scale = torch.tensor(0.25)   # a scalar the file lacks (scaled fp8's scale_input): written beside
    size = 3000 * torch.empty(0, dtype=model_dtype).element_size()
    home = MappedBlock(FilePages(path), [(6, 6000, 512, (torch.bfloat16, model_dtype))], 512 + size, [(scale, 0)])
    out = torch.zeros(512 + size, dtype=torch.uint8)
    left = home.land(out)
    if model_dtype == torch.float16:   # crossed as the file has them, into their own place
        assert torch.equal(out[512:], values.view(torch.uint8))
    left()
    assert torch.equal(out[512:].view(model_dtype), values.to(model_dtype)) and not out[4:512].any()
    assert out[:4].view(torch.float32).item() == 0.25
    if torch.cuda.is_available():
        dev = torch.zeros_like(out, device="cuda")
        left = home.land(dev)
        assert left is not None
        land = torch.cuda.Stream()
        land.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(land):
            left()
        torch.cuda.current_stream().wait_stream(land)
        assert torch.equal(dev.cpu(), out)
        dev.zero_()
        home.copy_into(dev)
        assert torch.equal(dev.cpu(), out)


def test_homes_cast_as_they_land_are_exact_at_every_window(tmp_path):
    """Blocks held in fp16 whose file holds bf16 (ComfyUI 0.33's Wan): mapped, cast where each block
    lands; exact against the same blocks loaded at once, on the CPU and on a GPU."""
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        for window in (1, 3, N):
            for stream_first in (False, True):
                blocks = make_blocks().to(torch.bfloat16).to(torch.float16)   # the file's values, held in fp16
                ref = run(copy.deepcopy(blocks).to(device), X.to(device, torch.float16))
                map_block = write_file_cast(blocks, os.path.join(tmp_path, f"h{device}{window}{stream_first}.bin"))
                engine = BlockSwapEngine(list(blocks), read_block=FileLike(blocks).read, home="auto",
                                         disk_workers=2, map_block=map_block)
                engine.attach(device, load_plan(ResidencyPlan.make(N, window, 1), stream_first=stream_first))
                for _ in range(3):
                    assert torch.equal(run(blocks, X.to(device, torch.float16)), ref), (device, window, stream_first)
                engine.detach()
                engine.release_home()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mapped_homes_on_cuda_are_page_locked_and_exact(tmp_path):
    ref = run(make_blocks().cuda(), X.cuda())
    blocks = make_blocks()
    map_block = write_file(blocks, os.path.join(tmp_path, "c.bin"), gap=3000)   # blocks over several pages
    engine = BlockSwapEngine(list(blocks), read_block=FileLike(blocks).read, home="auto", disk_workers=2,
                             map_block=map_block)
    assert map_block(0).pages.pinnable()   # asked before any page is registered, as the loader does
    engine.attach("cuda", load_plan(ResidencyPlan.make(N, 2, 1), stream_first=True))
    for _ in range(3):
        assert torch.equal(run(blocks, X.cuda()), ref)
    assert engine.memory == "pinned" and all(engine.pool.mapped[i].pinned for i in engine.plan.streamed)
    # the bytes outside a home's own pages come from a small page-locked copy: no copy is pageable
    assert all(engine.pool.mapped[i].pageable_bytes == 0 for i in engine.plan.streamed)
    engine.detach()
    assert engine.pool.pinned_bytes == 0
    engine.release_home()


def test_an_attach_that_codes_reads_its_mapped_homes_into_ram(tmp_path):
    """Coded homes are RAM buffers: a load that codes (compress) after one that mapped the homes
    reads them into RAM and codes them there; exact either way."""
    blocks = make_blocks().to(torch.bfloat16)   # bytes the stand-in coder shrinks
    ref = run(blocks, X.to(torch.bfloat16))
    map_block = write_file(blocks, os.path.join(tmp_path, "k.bin"))
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2, map_block=map_block)
    engine.coder_factory = ZlibPlanes
    plan = ResidencyPlan.make(N, 3, 1)
    engine.attach("cpu", load_plan(plan))
    assert set(engine.pool.mapped) == set(plan.streamed) and torch.equal(run(blocks, X.to(torch.bfloat16)), ref)
    engine.detach()
    engine.link_bytes_per_s = 0.0   # the run timed the CPU's memcpy, no link: coding pays by size alone
    engine.attach("cpu", load_plan(plan, compress=True))
    assert not engine.pool.mapped and set(engine.pool.coded) == set(plan.streamed)
    assert torch.equal(run(blocks, X.to(torch.bfloat16)), ref)
    engine.detach()


def test_closing_the_file_pages_leaves_the_views_readable(tmp_path):
    """FilePages.close lets go of the mapping; a view taken before (a home's tensor, a pin in flight)
    still reads the file's bytes: the mapping goes with the last view (unmapped under it, a read would crash)."""
    path = os.path.join(tmp_path, "c.bin")
    raw = torch.arange(3 * PAGE, dtype=torch.int32).to(torch.uint8)
    with open(path, "wb") as f:
        f.write(raw.numpy().tobytes())
    pages = FilePages(path)
    view = pages.data[PAGE + 7:2 * PAGE + 9]
    pages.close()
    assert torch.equal(view.clone(), raw[PAGE + 7:2 * PAGE + 9])


def test_homes_mapped_ahead_leave_the_first_call_streaming(tmp_path):
    """engine.pin_ahead (every block's pages page-locked from the node on, where
    swap.load_plan.pins_ahead says so) maps the homes before any plan, yet the plan sees none
    held, so the first call still streams. The attach takes the mapped homes over and drops
    the one its plan leaves to the file; outputs stay exact."""
    ref = run(make_blocks(), X)
    blocks = make_blocks()
    src = FileLike(blocks)
    engine = BlockSwapEngine(list(blocks), read_block=src.read, home="auto", disk_workers=2,
                             map_block=write_file(blocks, os.path.join(tmp_path, "a.bin")))
    engine.pin_ahead("cpu")
    assert set(engine.pool.mapped) == set(range(N)) and engine.ahead is not None
    assert engine.facts().homes == frozenset()   # so plan_load's first_read counts every block
    plan = ResidencyPlan.make(N, 3, 1)
    to_file, kept = plan.streamed[0], plan.streamed[1:]
    engine.attach("cpu", load_plan(plan, ram_blocks=kept, stream_first=True))
    assert engine.ahead is None and engine.att.first_use is not None
    assert to_file not in engine.pool.mapped
    for _ in range(3):
        assert torch.equal(run(blocks, X), ref)
    assert set(engine.pool.mapped) == set(kept)   # the resident blocks' pages given back once placed
    engine.detach()
    engine.release_home()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pins_made_ahead_on_cuda_go_on_through_the_attach(tmp_path):
    """CUDA: engine.pin_ahead's pins are handed over at the attach (EarlyPins.hand_over) and go on;
    the first call records their bytes (the run line's "pinned ahead were done by the attach"),
    the streamed homes end page-locked and outputs equal the blocks run alone."""
    ref = run(make_blocks().cuda(), X.cuda())
    blocks = make_blocks()
    engine = BlockSwapEngine(list(blocks), read_block=FileLike(blocks).read, home="auto", disk_workers=2,
                             map_block=write_file(blocks, os.path.join(tmp_path, "p.bin"), gap=3000))
    engine.pin_ahead("cuda")
    assert engine.ahead is not None
    engine.attach("cuda", load_plan(ResidencyPlan.make(N, 2, 1), stream_first=True))
    for _ in range(3):
        assert torch.equal(run(blocks, X.cuda()), ref)
    done, total = engine.end_run().first_call.ahead
    assert 0 <= done <= total and total >= sum(engine.pool.mapped[i].nbytes for i in engine.plan.streamed) > 0
    assert all(engine.pool.mapped[i].pinned for i in engine.plan.streamed)
    engine.detach()
    assert engine.pool.pinned_bytes == 0
    engine.release_home()
