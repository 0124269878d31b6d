"""Index of a .safetensors file: its header parsed and strictly checked, no tensor data read.

Written ourselves (not the `safetensors` library) because we need each tensor's absolute
file byte range for positioned reads, and strict validation with messages naming the
file, the tensor and what was expected.
"""
from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from typing import Iterable

import torch

from ...swap.file_pages import FilePages
from ...swap.host_pool import mapped_bytes
from .range_reader import BlockReadError, RangeReader

MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "I32": "int32", "I64": "int64",
    "U16": "uint16", "U32": "uint32", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}
# Only the dtypes this torch has. Sub-byte types (F4, F6_*) are not mapped: their shape
# counts elements, not bytes, and torch has no 1:1 dtype for them.
DTYPES: dict[str, torch.dtype] = {k: getattr(torch, v) for k, v in _DTYPE_NAMES.items()
                                  if hasattr(torch, v)}


class SafetensorsError(ValueError):
    """A .safetensors file is unreadable or its header is inconsistent."""


class MissingTensorError(SafetensorsError, KeyError):
    """A tensor key that the file does not hold."""
    __str__ = SafetensorsError.__str__


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset of the first byte
    end: int    # absolute file offset one past the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def _no_duplicates(pairs: list) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return d


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class SafetensorsIndex:
    def __init__(self, path: str, tensors: dict[str, TensorInfo], metadata: dict[str, str],
                 data_start: int, file_size: int):
        self.path = path
        self.tensors = tensors
        self.metadata = metadata
        self.data_start = data_start
        self.file_size = file_size

    @classmethod
    def open(cls, path: str) -> "SafetensorsIndex":
        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 8:
                    raise SafetensorsError(f"{path}: file is {size} bytes, smaller than the 8-byte "
                                           "header length of a .safetensors file (empty or truncated?)")
                (hlen,) = struct.unpack("<Q", f.read(8))
                if hlen > MAX_HEADER_BYTES:
                    raise SafetensorsError(f"{path}: header length field says {hlen} bytes (limit "
                                           f"{MAX_HEADER_BYTES}); not a .safetensors file?")
                if 8 + hlen > size:
                    raise SafetensorsError(f"{path}: header length field says {hlen} bytes but the file "
                                           f"has only {size - 8} bytes after it (truncated file, or "
                                           "not a .safetensors file?)")
                raw = f.read(hlen)
        except OSError as e:
            raise SafetensorsError(f"{path}: cannot read the header: {e.strerror or e}") from e
        if len(raw) != hlen:
            raise SafetensorsError(f"{path}: header ended after {len(raw)} of {hlen} bytes "
                                   "(file changed while reading?)")
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
        except UnicodeDecodeError as e:
            raise SafetensorsError(f"{path}: header is not valid UTF-8 ({e}); "
                                   "not a .safetensors file?") from None
        except ValueError as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e}); "
                                   "not a .safetensors file?") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{path}: header is a JSON {type(header).__name__}, "
                                   "expected a JSON object of tensor entries")
        data_start = 8 + hlen
        return cls(path, *cls._parse(path, header, data_start, size - data_start), data_start, size)

    @staticmethod
    def _parse(path: str, header: dict, data_start: int, data_size: int) -> tuple[dict, dict]:
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise SafetensorsError(f"{path}: __metadata__ must be a JSON object of string to string")
        entries = []
        for name, e in header.items():
            where = f"{path}: tensor {name!r}"
            if not isinstance(e, dict):
                raise SafetensorsError(f"{where}: entry is a JSON {type(e).__name__}, expected an "
                                       "object with dtype, shape, data_offsets")
            for field in ("dtype", "shape", "data_offsets"):
                if field not in e:
                    raise SafetensorsError(f"{where}: entry has no {field!r} (expected dtype, shape, "
                                           "data_offsets)")
            dt, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
            if not isinstance(dt, str):
                raise SafetensorsError(f"{where}: dtype is {dt!r}, expected a string")
            if dt not in DTYPES:
                raise SafetensorsError(f"{where}: unknown dtype {dt!r} (known: {' '.join(DTYPES)})")
            if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
                raise SafetensorsError(f"{where}: shape is {shape!r}, expected a list of "
                                       "non-negative integers")
            if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                    and offs[0] <= offs[1]):
                raise SafetensorsError(f"{where}: data_offsets is {offs!r}, expected "
                                       "[begin, end] with 0 <= begin <= end")
            dtype = DTYPES[dt]
            numel = 1
            for d in shape:
                numel *= d
            want = numel * dtype.itemsize
            if offs[1] - offs[0] != want:
                raise SafetensorsError(f"{where}: data_offsets {offs} span {offs[1] - offs[0]} bytes, "
                                       f"expected {want} for {dt} {shape}")
            if offs[1] > data_size:
                raise SafetensorsError(f"{where} ends at byte {offs[1]} of the data but the file "
                                       f"holds only {data_size} data bytes (truncated file?)")
            entries.append((offs[0], offs[1], name, dtype, tuple(shape)))
        entries.sort(key=lambda t: (t[0], t[1]))
        prev = None
        for b, e, name, _, _ in entries:
            if b == e:
                continue
            if prev is not None and b < prev[1]:
                raise SafetensorsError(f"{path}: tensor {name!r} (data bytes {b}..{e}) overlaps tensor "
                                       f"{prev[2]!r} (data bytes {prev[0]}..{prev[1]}); expected "
                                       "disjoint data_offsets (corrupt header)")
            prev = (b, e, name)
        tensors = {name: TensorInfo(name, dtype, shape, data_start + b, data_start + e)
                   for b, e, name, dtype, shape in entries}
        return tensors, metadata

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise MissingTensorError(f"{self.path}: no tensor {name!r} in the file "
                                     f"({len(self.tensors)} tensors)")
        return info

    def group(self, pattern: str) -> dict[str, list[TensorInfo]]:
        """Group keys by the first capture group of regex `pattern` (re.match on the key);
        a pattern without a group is taken as a literal prefix and gives one group."""
        rx = re.compile(pattern if re.compile(pattern).groups else "(" + re.escape(pattern) + ")")
        out: dict[str, list[TensorInfo]] = {}
        for name, info in self.tensors.items():
            m = rx.match(name)
            if m:
                out.setdefault(m.group(1), []).append(info)
        return out

    def blocks_by_index(self, prefix: str = "blocks.") -> dict[int, list[TensorInfo]]:
        """Keys "<prefix><N>.<rest>" grouped by N (ascending), each list in file order."""
        groups = self.group(re.escape(prefix) + r"(\d+)\.")
        return {int(k): groups[k] for k in sorted(groups, key=int)}

    def read_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors read from the file (the non-block weights, ~0.5 GB for Wan-14B) on
        READ_WORKERS threads at once, each into a buffer of its own; a big one in a mapping of its own,
        untouched until read (one thread zero-filling bytearrays, then reading, ran at ~1.7 GB/s:
        bench/RESULTS.md)."""
        infos = [self[n] for n in names]
        if not infos:
            return {}
        try:
            reader = RangeReader(self.path, workers=min(READ_WORKERS, len(infos)), drop_cache=False,
                                 chunk_bytes=READ_CHUNK)
        except BlockReadError as e:
            raise SafetensorsError(str(e)) from e
        with reader:
            raws = [_buffer_like_mmap(i.nbytes, i.start) for i in infos]
            reads = [reader.read_into(raw, [(i.start, i.nbytes, 0)]) for i, raw in zip(infos, raws)]
            for i, read in zip(infos, reads):
                try:
                    read.result()
                except BlockReadError as e:
                    raise self._read_error(i, e) from e
        return {i.name: (_typed(raw, i.dtype) if i.nbytes else torch.empty(0, dtype=i.dtype)).reshape(i.shape)
                for i, raw in zip(infos, raws)}

    def mapped_tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors as read-only views of the file's pages, nothing read: for weights a load
        casts into tensors of their own anyway (bf16 -> fp16: the cast reads the page cache once, where
        reading first wrote every byte twice). Nothing may write them or keep them past the load (a
        page cut off by a later truncation would crash the process when touched); `owned` copies one.
        A tensor the file no longer holds whole is named, as read_tensors does."""
        infos = [self[n] for n in names]
        if not infos:
            return {}
        data = FilePages(self.path).data
        for i in infos:
            if i.end > data.numel():
                raise self._read_error(i, BlockReadError(f"the mapping ends at byte {data.numel()}"))
        return {i.name: _typed(data[i.start:i.end], i.dtype).reshape(i.shape) for i in infos}

    def _read_error(self, info: TensorInfo, e: BlockReadError) -> SafetensorsError:
        """The error of a failed read of `info`: where the file ends before the tensor now, how far."""
        try:
            size = os.path.getsize(self.path)
        except OSError:
            size = None
        if size is not None and size < info.end:
            return SafetensorsError(f"{self.path}: tensor {info.name!r}: file ended after {max(0, size - info.start)} "
                                    f"of {info.nbytes} bytes at offset {info.start} (truncated or replaced after "
                                    "it was indexed?)")
        return SafetensorsError(f"{self.path}: reading tensor {info.name!r}: {e}")


READ_WORKERS = 8              # threads reading the tensors (from the page cache ~9 GB/s into fresh memory)
READ_CHUNK = 16 * 1024 * 1024  # bytes one read call takes: a 0.3 GB tensor spreads over the threads
MAPPED_MIN = 1024 * 1024      # smaller tensors in bytearrays (many small mappings cost more than zeroing)


ALIGN = 64   # a read tensor's address mod ALIGN equals its file offset's, as in a view into an mmap


def _buffer_like_mmap(nbytes: int, file_offset: int) -> torch.Tensor:
    """A host buffer (uint8) of `nbytes` whose address mod ALIGN equals `file_offset`'s, the
    alignment ComfyUI's own loader leaves a tensor at when it keeps a view into safetensors'
    mmap (CPU matmuls round differently at other alignments, so results would not be
    bit-identical to ComfyUI's). From MAPPED_MIN bytes in an anonymous mapping of its own,
    freed to the OS with the tensor (Linux and Windows)."""
    if nbytes >= MAPPED_MIN:
        whole = mapped_bytes(nbytes + ALIGN)
    else:
        whole = torch.frombuffer(bytearray(nbytes + ALIGN), dtype=torch.uint8)
    shift = (file_offset - whole.data_ptr()) % ALIGN
    return whole[shift:shift + nbytes]


def owned(view: torch.Tensor, aligned: bool = False) -> torch.Tensor:
    """A copy of `view` (e.g. of mapped_tensors) in memory of its own at the same address mod ALIGN,
    or with `aligned` at 0 mod ALIGN (where ComfyUI's load copies a tensor into its own)."""
    raw = _buffer_like_mmap(view.nbytes, 0 if aligned else view.data_ptr())
    raw.copy_(view.reshape(-1).view(torch.uint8))
    return _typed(raw, view.dtype).reshape(view.shape)


def _typed(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`raw` (uint8) as `dtype`; a copy where its address does not fit the dtype's size."""
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)
