"""SafetensorsIndex: offsets agree with the safetensors library; every broken header gets a clear error."""
import json
import os
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringswap.loaders.model_file.safetensors_index import SafetensorsError, SafetensorsIndex, TensorInfo


def read_tensor(idx: SafetensorsIndex, name: str) -> torch.Tensor:
    """One tensor as a CPU tensor, reading just its bytes (read_tensors of one name)."""
    return idx.read_tensors([name])[name]


def _tensors():
    g = torch.Generator().manual_seed(0)
    out = {}
    for i in range(3):
        out[f"blocks.{i}.attn.weight"] = torch.randn(8, 16, generator=g, dtype=torch.float32).to(torch.bfloat16)
        out[f"blocks.{i}.ffn.0.weight"] = torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn)
        out[f"blocks.{i}.ffn.0.scale"] = torch.randn((), generator=g)
    out["blocks.10.norm.weight"] = torch.randn(16, generator=g, dtype=torch.float16)
    out["head.weight"] = torch.randn(5, 3, generator=g, dtype=torch.float64)
    out["pos"] = torch.arange(7, dtype=torch.int64)
    out["mask"] = torch.tensor([True, False, True])
    out["e5"] = torch.randn(6, generator=g).to(torch.float8_e5m2)
    out["empty"] = torch.zeros(0, 4)
    return out


@pytest.fixture
def model(tmp_path):
    path = str(tmp_path / "model.safetensors")
    save_file(_tensors(), path, metadata={"format": "pt", "modelspec.title": "tiny"})
    return path


def _write_raw(path, header, data=b"", hlen=None):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw) if hlen is None else hlen) + raw + data)
    return str(path)


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)) if a.numel() else True


def test_offsets_match_safetensors(model):
    idx = SafetensorsIndex.open(model)
    ref = load_file(model)
    assert set(idx.keys()) == set(ref)
    assert len(idx) == len(ref)
    for name, t in ref.items():
        _same(read_tensor(idx, name), t)
    got = idx.read_tensors(list(ref))
    for name, t in ref.items():
        _same(got[name], t)
    info = idx["blocks.1.attn.weight"]
    assert isinstance(info, TensorInfo) and info.dtype == torch.bfloat16 and info.shape == (8, 16)
    assert info.nbytes == 8 * 16 * 2 and info.start >= idx.data_start
    with open(model, "rb") as f:  # absolute offsets: the raw bytes are exactly the tensor's
        f.seek(info.start)
        assert f.read(info.nbytes) == ref["blocks.1.attn.weight"].view(torch.uint8).numpy().tobytes()
    (hlen,) = struct.unpack("<Q", open(model, "rb").read(8))
    assert idx.data_start == 8 + hlen and idx.file_size == os.path.getsize(model)
    starts = [t.start for t in idx.tensors.values()]
    assert starts == sorted(starts)  # file order
    assert "pos" in idx and "nope" not in idx
    assert idx["blocks.0.ffn.0.weight"].dtype == torch.float8_e4m3fn
    assert idx["e5"].dtype == torch.float8_e5m2


def test_metadata(model, tmp_path):
    assert SafetensorsIndex.open(model).metadata == {"format": "pt", "modelspec.title": "tiny"}
    plain = str(tmp_path / "plain.safetensors")
    save_file({"a": torch.ones(2)}, plain)
    assert SafetensorsIndex.open(plain).metadata == {}


def test_blocks_by_index_and_group(model):
    idx = SafetensorsIndex.open(model)
    blocks = idx.blocks_by_index()
    assert list(blocks) == [0, 1, 2, 10]
    for n, infos in blocks.items():
        assert all(t.name.startswith(f"blocks.{n}.") for t in infos)
        assert [t.start for t in infos] == sorted(t.start for t in infos)
    assert {t.name for t in blocks[1]} == {"blocks.1.attn.weight", "blocks.1.ffn.0.weight",
                                           "blocks.1.ffn.0.scale"}
    assert idx.blocks_by_index(prefix="head.") == {}
    by_kind = idx.group(r"blocks\.\d+\.(\w+)")
    assert set(by_kind) == {"attn", "ffn", "norm"} and len(by_kind["ffn"]) == 6
    assert [t.name for t in idx.group("head.")["head."]] == ["head.weight"]


def test_missing_key(model):
    idx = SafetensorsIndex.open(model)
    with pytest.raises(KeyError, match="no tensor 'nope'"):
        idx["nope"]
    with pytest.raises(SafetensorsError, match=re.escape(model)):
        read_tensor(idx, "nope")


def _err(path, match):
    with pytest.raises(SafetensorsError) as ei:
        SafetensorsIndex.open(path)
    msg = str(ei.value)
    assert str(path) in msg, msg
    assert re.search(match, msg), msg
    return msg


def test_tiny_file(tmp_path):
    p = tmp_path / "tiny.safetensors"
    p.write_bytes(b"\x01\x02\x03")
    _err(p, r"3 bytes, smaller than the 8-byte")


def test_truncated_file(model):
    size = os.path.getsize(model)
    with open(model, "r+b") as f:
        f.truncate(size - 10)
    msg = _err(model, r"tensor '.+' ends at byte \d+ of the data but the file holds only \d+ "
                      r"data bytes \(truncated file\?\)")
    assert "holds only" in msg


def test_header_cut_off(model):
    with open(model, "r+b") as f:
        f.truncate(40)
    _err(model, r"header length field says \d+ bytes but the file has only 32 bytes")


def test_header_length_larger_than_file(tmp_path):
    _err(_write_raw(tmp_path / "big.safetensors", {}, hlen=5000), r"says 5000 bytes but the file has only 2")
    _err(_write_raw(tmp_path / "absurd.safetensors", {}, hlen=1 << 40), r"limit \d+.*not a \.safetensors")


def test_invalid_json(tmp_path):
    _err(_write_raw(tmp_path / "j.safetensors", b'{"a": {"dtype": '), r"header is not valid JSON")
    _err(_write_raw(tmp_path / "u.safetensors", b'{"\xff\xfe": 1}'), r"not valid UTF-8")
    _err(_write_raw(tmp_path / "l.safetensors", b"[1, 2]"), r"header is a JSON list, expected a JSON object")
    _err(_write_raw(tmp_path / "d.safetensors", b'{"a": 1, "a": 2}'), r"duplicate key 'a'")


def test_bad_entries(tmp_path):
    e = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    p = tmp_path / "e.safetensors"
    for field in ("dtype", "shape", "data_offsets"):
        bad = {k: v for k, v in e.items() if k != field}
        _err(_write_raw(p, {"w": bad}, b"\0" * 8), rf"tensor 'w': entry has no '{field}'")
    _err(_write_raw(p, {"w": 3}, b"\0" * 8), r"tensor 'w': entry is a JSON int")
    _err(_write_raw(p, {"w": {**e, "shape": [2.5]}}, b"\0" * 8), r"tensor 'w': shape is \[2.5\]")
    _err(_write_raw(p, {"w": {**e, "shape": [-1]}}, b"\0" * 8), r"tensor 'w': shape is \[-1\]")
    _err(_write_raw(p, {"w": {**e, "dtype": 7}}, b"\0" * 8), r"tensor 'w': dtype is 7")
    _err(_write_raw(p, {"w": {**e, "data_offsets": [8, 0]}}, b"\0" * 8), r"data_offsets is \[8, 0\]")
    _err(_write_raw(p, {"w": {**e, "data_offsets": [0]}}, b"\0" * 8), r"data_offsets is \[0\]")
    _err(_write_raw(p, {"__metadata__": {"a": 1}, "w": e}, b"\0" * 8), r"__metadata__ must be")


def test_unknown_dtype(tmp_path):
    p = _write_raw(tmp_path / "q.safetensors", {"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 2]}},
                   b"\0\0")
    msg = _err(p, r"tensor 'w': unknown dtype 'Q7' \(known: BOOL U8 I8 I16 I32 I64 .*F16 BF16 F32 F64")
    assert "F8_E4M3" in msg and "F8_E5M2" in msg


def test_size_mismatch(tmp_path):
    p = _write_raw(tmp_path / "s.safetensors", {"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}},
                   b"\0" * 12)
    _err(p, r"tensor 'w': data_offsets \[0, 8\] span 8 bytes, expected 12 for BF16 \[3, 2\]")


def test_overlap(tmp_path):
    h = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    _err(_write_raw(tmp_path / "o.safetensors", h, b"\0" * 24),
         r"tensor 'b' \(data bytes 8..24\) overlaps tensor 'a' \(data bytes 0..16\)")


def test_offsets_past_data(tmp_path):
    h = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
         "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}
    _err(_write_raw(tmp_path / "p.safetensors", h, b"\0" * 20),
         r"tensor 'b' ends at byte 32 of the data but the file holds only 20 data bytes")


def test_read_after_truncation(model):
    idx = SafetensorsIndex.open(model)
    last = max(idx.tensors.values(), key=lambda t: t.end)
    with open(model, "r+b") as f:
        f.truncate(last.start + 1)
    with pytest.raises(SafetensorsError, match=rf"{re.escape(model)}: tensor '{re.escape(last.name)}': "
                                              r"file ended after 1 of \d+ bytes"):
        read_tensor(idx, last.name)


def test_header_of_many_tensors_is_fast(tmp_path):
    import time
    path = str(tmp_path / "many.safetensors")
    save_file({f"blocks.{i // 30}.p{i % 30}": torch.zeros(2) for i in range(1500)}, path)
    t0 = time.perf_counter()
    idx = SafetensorsIndex.open(path)
    assert time.perf_counter() - t0 < 0.5
    assert len(idx.blocks_by_index()) == 50


def test_big_tensors_read_in_parallel_chunks(tmp_path):
    """Tensors of MAPPED_MIN bytes and more go into mappings of their own and are read in READ_CHUNK
    pieces on several threads: bytes exact, each at its file offset's alignment (as a view into
    ComfyUI's mmap would be), a big tensor past a truncation named with how far the file goes."""
    from ringswap.loaders.model_file import safetensors_index as si
    g = torch.Generator().manual_seed(1)
    tensors = {"a.small": torch.randn(3, generator=g),
               "b.big": torch.randn(si.READ_CHUNK // 2 + 1000, generator=g).to(torch.bfloat16).reshape(-1, 4),
               "c.bigger": torch.randn(si.READ_CHUNK // 4 * 3 + 7, generator=g),
               "d.small": torch.randn(5, 2, generator=g, dtype=torch.float16)}
    path = str(tmp_path / "big.safetensors")
    save_file(tensors, path)
    idx = SafetensorsIndex.open(path)
    got = idx.read_tensors(list(tensors))
    for name, t in tensors.items():
        _same(got[name], t)
        assert got[name].data_ptr() % si.ALIGN == idx[name].start % si.ALIGN
    assert idx["c.bigger"].nbytes > si.READ_CHUNK and idx["b.big"].nbytes >= si.MAPPED_MIN
    big = max((idx[n] for n in ("b.big", "c.bigger")), key=lambda i: i.start)   # the later one in the file
    with open(path, "r+b") as f:
        f.truncate(big.start + 12345)
    with pytest.raises(SafetensorsError, match=rf"{re.escape(path)}: tensor '{big.name}': file ended after 12345 "
                                               rf"of {big.nbytes} bytes at offset {big.start}"):
        idx.read_tensors([big.name])
    with pytest.raises(SafetensorsError, match=r"file ended after \d+ of \d+ bytes"):
        idx.read_tensors(list(tensors))
