"""BlockReader: parallel positioned reads into one buffer, chunking, short reads, lifetime."""
import os
import random
import re

import pytest
import torch
from safetensors.torch import save_file

from ringswap.loaders.block_reader import BlockReadError, BlockReader
from ringswap.loaders.safetensors_index import SafetensorsIndex

TIMEOUT = 30


@pytest.fixture
def model(tmp_path):
    g = torch.Generator().manual_seed(1)
    path = str(tmp_path / "model.safetensors")
    save_file({f"blocks.{i}.w{j}": torch.randn(64, 256 + j, generator=g).to(torch.bfloat16)
               for i in range(8) for j in range(4)}, path)  # ~1 MB
    return path


def _file_bytes(path):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8)


def _fds():
    return set(os.listdir("/proc/self/fd"))


def test_many_ranges_into_one_buffer(model):
    raw = _file_bytes(model)
    idx = SafetensorsIndex.open(model)
    infos = list(idx.tensors.values())
    random.Random(0).shuffle(infos)
    ranges, pos = [], 0
    for t in infos:  # packed into the buffer in a different order than in the file
        ranges.append((t.start, t.nbytes, pos))
        pos += t.nbytes
    dest = torch.zeros(pos, dtype=torch.uint8)
    with BlockReader(model, workers=4, chunk_bytes=10_000) as r:
        n = r.read_into(dest, ranges).result(timeout=TIMEOUT)
        assert n == pos == r.bytes_read
        assert r.reads >= len(ranges) and r.read_seconds > 0
    for (off, length, doff) in ranges:
        assert torch.equal(dest[doff:doff + length], raw[off:off + length])


def test_block_tensors_land_correctly(model):
    idx = SafetensorsIndex.open(model)
    block = idx.blocks_by_index()[3]
    total = sum(t.nbytes for t in block)
    dest = torch.empty(total, dtype=torch.uint8)
    ranges, pos = [], 0
    for t in block:
        ranges.append((t.start, t.nbytes, pos))
        pos += t.nbytes
    with BlockReader(model, workers=2) as r:
        r.read_into(dest, ranges).result(timeout=TIMEOUT)
    for t, (_, length, doff) in zip(block, ranges):
        assert torch.equal(dest[doff:doff + length].view(t.dtype).view(t.shape), idx.read_tensor(t.name))


def test_large_range_is_chunked(model):
    raw = _file_bytes(model)
    size = raw.numel()
    dest = torch.zeros(size + 100, dtype=torch.uint8)
    with BlockReader(model, workers=3, chunk_bytes=4096, drop_cache=False) as r:
        assert r.read_into(dest, [(0, size, 100)]).result(timeout=TIMEOUT) == size
        assert r.reads >= -(-size // 4096)
    assert torch.equal(dest[100:], raw) and not dest[:100].any()


def test_no_ranges_and_bad_arguments(model):
    with BlockReader(model, workers=1) as r:
        assert r.read_into(torch.empty(0, dtype=torch.uint8), []).result(timeout=TIMEOUT) == 0
        with pytest.raises(ValueError, match="does not fit a destination of 10 bytes"):
            r.read_into(torch.empty(10, dtype=torch.uint8), [(0, 11, 0)])
        with pytest.raises(ValueError, match="contiguous CPU uint8"):
            r.read_into(torch.empty(10, dtype=torch.float32), [(0, 4, 0)])


def test_truncated_after_open(model):
    size = os.path.getsize(model)
    with BlockReader(model, workers=4, chunk_bytes=8192) as r:
        with open(model, "r+b") as f:
            f.truncate(size // 2)
        dest = torch.zeros(size, dtype=torch.uint8)
        fut = r.read_into(dest, [(0, size // 4, 0), (size // 4, size - size // 4, size // 4)])
        with pytest.raises(BlockReadError) as ei:
            fut.result(timeout=TIMEOUT)
        msg = str(ei.value)
        assert model in msg
        assert re.search(rf"reading {size - size // 4} bytes at offset {size // 4}: file ended after "
                         rf"{size // 2 - size // 4} of {size - size // 4} bytes — was it truncated", msg), msg
        # The reader still works for the part that exists.
        ok = torch.zeros(100, dtype=torch.uint8)
        assert r.read_into(ok, [(0, 100, 0)]).result(timeout=TIMEOUT) == 100


def test_missing_file(tmp_path):
    with pytest.raises(BlockReadError, match=re.escape(str(tmp_path / "gone.safetensors")) + ": cannot open"):
        BlockReader(str(tmp_path / "gone.safetensors"))


def test_close_is_idempotent_and_closes_fds(model):
    before = _fds()
    r = BlockReader(model, workers=5)
    assert len(_fds() - before) == 5
    dest = torch.empty(64, dtype=torch.uint8)
    r.read_into(dest, [(0, 64, 0)]).result(timeout=TIMEOUT)
    r.close()
    r.close()
    assert _fds() == before
    with pytest.raises(ValueError, match="BlockReader is closed"):
        r.read_into(dest, [(0, 64, 0)])


def test_close_waits_for_reads_in_flight(model):
    size = os.path.getsize(model)
    dest = torch.zeros(size, dtype=torch.uint8)
    r = BlockReader(model, workers=2, chunk_bytes=1024)
    fut = r.read_into(dest, [(0, size, 0)])
    r.close()
    assert fut.done() and fut.result() == size
    assert torch.equal(dest, _file_bytes(model))


def test_pinned_destination(model):
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    size = os.path.getsize(model)
    dest = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    with BlockReader(model) as r:
        r.read_into(dest, [(0, size, 0)]).result(timeout=TIMEOUT)
    assert torch.equal(dest, _file_bytes(model))
