"""RangeReader, the block read path's positioned reads: reads into one buffer, chunking, short reads, lifetime.

Every read test runs with both read methods: os.preadv/os.pread ("positioned") and the
per-worker-handle seek + readinto used where pread does not exist (Windows), forced here
with portable=True.
"""
import os
import random
import re
import shutil
import threading

import pytest
import torch
from safetensors.torch import save_file

from ringswap.loaders.model_file.range_reader import (PORTABLE_ENV, PREAD, PREADV, SEEK_READINTO, BlockReadError,
                                           FileChangedError, file_identity,
                                           RangeReader, read_method)
from ringswap.loaders.model_file.safetensors_index import SafetensorsIndex


def read_tensor(idx: SafetensorsIndex, name: str) -> torch.Tensor:
    """One tensor of the file, read on its own (the reference the ranges are compared with)."""
    return idx.read_tensors([name])[name]

TIMEOUT = 30


@pytest.fixture(params=[False, True], ids=["positioned", "portable"])
def portable(request):
    return request.param


@pytest.fixture
def open_reader(portable):
    """RangeReader(path, ...) with this test's read method, checked to be the one in use."""
    def make(path, **kw):
        r = RangeReader(path, portable=portable, **kw)
        assert r.method == (SEEK_READINTO if portable else read_method(False))
        return r
    return make


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


def test_many_ranges_into_one_buffer(model, open_reader):
    raw = _file_bytes(model)
    idx = SafetensorsIndex.open(model)
    infos = list(idx.tensors.values())
    random.Random(0).shuffle(infos)
    ranges, pos = [], 0
    for t in infos:  # packed into the buffer in a different order than in the file
        ranges.append((t.start, t.nbytes, pos))
        pos += t.nbytes
    dest = torch.zeros(pos, dtype=torch.uint8)
    with open_reader(model, workers=4, chunk_bytes=10_000) as r:
        n = r.read_into(dest, ranges).result(timeout=TIMEOUT)
        assert n == pos == r.bytes_read
        assert r.reads >= len(ranges) and r.read_seconds > 0
    for (off, length, doff) in ranges:
        assert torch.equal(dest[doff:doff + length], raw[off:off + length])


def test_block_tensors_land_correctly(model, open_reader):
    idx = SafetensorsIndex.open(model)
    block = idx.blocks_by_index()[3]
    total = sum(t.nbytes for t in block)
    dest = torch.empty(total, dtype=torch.uint8)
    ranges, pos = [], 0
    for t in block:
        ranges.append((t.start, t.nbytes, pos))
        pos += t.nbytes
    with open_reader(model, workers=2) as r:
        r.read_into(dest, ranges).result(timeout=TIMEOUT)
    for t, (_, length, doff) in zip(block, ranges):
        assert torch.equal(dest[doff:doff + length].view(t.dtype).view(t.shape), read_tensor(idx, t.name))


def test_large_range_is_chunked(model, open_reader):
    raw = _file_bytes(model)
    size = raw.numel()
    dest = torch.zeros(size + 100, dtype=torch.uint8)
    with open_reader(model, workers=3, chunk_bytes=4096, drop_cache=False) as r:
        assert r.read_into(dest, [(0, size, 100)]).result(timeout=TIMEOUT) == size
        assert r.reads >= -(-size // 4096)
    assert torch.equal(dest[100:], raw) and not dest[:100].any()


def test_no_ranges_and_bad_arguments(model, open_reader):
    with open_reader(model, workers=1) as r:
        assert r.read_into(torch.empty(0, dtype=torch.uint8), []).result(timeout=TIMEOUT) == 0
        with pytest.raises(ValueError, match="does not fit a destination of 10 bytes"):
            r.read_into(torch.empty(10, dtype=torch.uint8), [(0, 11, 0)])
        with pytest.raises(ValueError, match="contiguous CPU uint8"):
            r.read_into(torch.empty(10, dtype=torch.float32), [(0, 4, 0)])


def test_truncated_after_open(model, open_reader):
    """A file truncated after the reader opened it: every read is refused with an error that
    names the file and says what happened (the blocks would not be the model loaded)."""
    size = os.path.getsize(model)
    with open_reader(model, workers=4, chunk_bytes=8192) as r:
        with open(model, "r+b") as f:
            f.truncate(size // 2)
        for length in (size, 100):
            with pytest.raises(FileChangedError) as ei:
                r.read_into(torch.zeros(size, dtype=torch.uint8), [(0, length, 0)]).result(timeout=TIMEOUT)
            msg = str(ei.value)
            assert model in msg and f"truncated from {size} to {size // 2} bytes" in msg, msg
            assert "load the model again" in msg, msg


def test_short_read_names_offset_and_length(model, open_reader):
    """A file that ends during a read (truncated after the check): the short read names the
    file, offset and length; the part that exists still reads."""
    size = os.path.getsize(model)
    with open_reader(model, workers=4, chunk_bytes=8192) as r:
        with open(model, "r+b") as f:
            f.truncate(size // 2)
        r.identity = file_identity(model)   # as if the truncation came after read_into's check
        dest = torch.zeros(size, dtype=torch.uint8)
        fut = r.read_into(dest, [(0, size // 4, 0), (size // 4, size - size // 4, size // 4)])
        with pytest.raises(BlockReadError) as ei:
            fut.result(timeout=TIMEOUT)
        msg = str(ei.value)
        assert model in msg and not isinstance(ei.value, FileChangedError)
        assert re.search(rf"reading {size - size // 4} bytes at offset {size // 4}: file ended after "
                         rf"{size // 2 - size // 4} of {size - size // 4} bytes — was it truncated", msg), msg
        ok = torch.zeros(100, dtype=torch.uint8)
        assert r.read_into(ok, [(0, 100, 0)]).result(timeout=TIMEOUT) == 100


@pytest.mark.parametrize("change", ["replaced", "removed", "written"])
def test_changed_file_is_refused_by_name(model, open_reader, tmp_path, change):
    """Replaced (a new file renamed over it), removed, or written in place with the same
    size: the next read fails with FileChangedError naming the file."""
    path = str(tmp_path / "copy.safetensors")
    shutil.copyfile(model, path)
    size = os.path.getsize(path)
    with open_reader(path, workers=2) as r:
        assert r.read_into(torch.zeros(100, dtype=torch.uint8), [(0, 100, 0)]).result(timeout=TIMEOUT) == 100
        if change == "replaced":
            shutil.copyfile(model, path + ".new")
            os.replace(path + ".new", path)
        elif change == "removed":
            os.remove(path)
        else:
            st = os.stat(path)
            with open(path, "r+b") as f:
                f.write(b"\0" * 8)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        with pytest.raises(FileChangedError) as ei:
            r.read_into(torch.zeros(size, dtype=torch.uint8), [(0, size, 0)]).result(timeout=TIMEOUT)
        want = {"replaced": "replaced by another file", "removed": "was removed",
                "written": "written to"}[change]
        assert path in str(ei.value) and want in str(ei.value), str(ei.value)


def test_missing_file(tmp_path, portable):
    with pytest.raises(BlockReadError, match=re.escape(str(tmp_path / "gone.safetensors")) + ": cannot open"):
        RangeReader(str(tmp_path / "gone.safetensors"), portable=portable)


def test_close_is_idempotent_and_closes_fds(model, open_reader):
    before = _fds()
    r = open_reader(model, workers=5)
    assert len(_fds() - before) == 5
    dest = torch.empty(64, dtype=torch.uint8)
    r.read_into(dest, [(0, 64, 0)]).result(timeout=TIMEOUT)
    r.close()
    r.close()
    assert _fds() == before
    with pytest.raises(ValueError, match="RangeReader is closed"):
        r.read_into(dest, [(0, 64, 0)])


def test_close_waits_for_reads_in_flight(model, open_reader):
    size = os.path.getsize(model)
    dest = torch.zeros(size, dtype=torch.uint8)
    r = open_reader(model, workers=2, chunk_bytes=1024)
    fut = r.read_into(dest, [(0, size, 0)])
    r.close()
    assert fut.done() and fut.result() == size
    assert torch.equal(dest, _file_bytes(model))


def test_pinned_destination(model, open_reader):
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs CUDA")
    size = os.path.getsize(model)
    dest = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    with open_reader(model) as r:
        r.read_into(dest, [(0, size, 0)]).result(timeout=TIMEOUT)
    assert torch.equal(dest, _file_bytes(model))


def test_concurrent_reads_from_several_threads(model, open_reader):
    """Several callers at once, each many small chunks, all workers busy: every byte right."""
    raw = _file_bytes(model)
    size = raw.numel()
    rng = random.Random(2)
    jobs = []
    for _ in range(12):
        ranges, pos = [], 0
        for _ in range(20):
            off = rng.randrange(size)
            length = rng.randrange(1, min(50_000, size - off) + 1)
            ranges.append((off, length, pos))
            pos += length
        jobs.append((torch.zeros(pos, dtype=torch.uint8), ranges))
    futures = [None] * len(jobs)
    with open_reader(model, workers=6, chunk_bytes=3000) as r:
        def submit(i):
            futures[i] = r.read_into(*jobs[i])
        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        total = sum(f.result(timeout=TIMEOUT) for f in futures)
        assert total == sum(d.numel() for d, _ in jobs) == r.bytes_read
    for dest, ranges in jobs:
        for off, length, doff in ranges:
            assert torch.equal(dest[doff:doff + length], raw[off:off + length])


def test_read_method_choice(model, monkeypatch):
    positioned = PREADV if hasattr(os, "preadv") else PREAD if hasattr(os, "pread") else SEEK_READINTO
    monkeypatch.delenv(PORTABLE_ENV, raising=False)
    assert read_method() == read_method(False) == positioned
    assert read_method(True) == SEEK_READINTO
    monkeypatch.setenv(PORTABLE_ENV, "1")
    assert read_method() == SEEK_READINTO and read_method(False) == positioned
    with RangeReader(model, workers=1) as r:  # the loader's call: the variable decides
        assert r.method == SEEK_READINTO
    monkeypatch.setenv(PORTABLE_ENV, "0")
    assert read_method() == positioned

