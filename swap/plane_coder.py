"""Lossless byte-plane coding of a block's bytes for RAM and the link.

A bf16/fp16 weight's high byte (sign and exponent) is highly predictable, its low byte is not.
A block's flat bytes are cut into parts, each read as little-endian 16-bit words and split into
a plane of high bytes, entropy-coded by a `PlaneCoder` (nvCOMP's ANS on the GPU: `AnsPlanes`),
and a plane of low bytes kept raw; a block mostly of one-byte values (fp8, packed nvfp4) has
each part coded whole. Decoding copies each part's coded bytes into a small device
scratch, decodes and re-interleaves them into the slot: plain torch ops plus the coder, enqueued
on one stream with no host sync. Written here because no library splits float planes for a GPU
entropy coder; nvCOMP does the coding.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .host_pool import HostBuffer
from .plane_join import join_words

NVCOMP_PACKAGES = "nvidia-nvcomp-cu13 (torch built for CUDA 13) or nvidia-nvcomp-cu12 (CUDA 12)"
# The defaults of a coder's `part_bytes` and `parts_in_flight` (AnsPlanes takes others, e.g. from a
# benchmark): a part's raw bytes (the device scratch holds a few parts, not a block; larger parts
# decode in fewer, fuller nvCOMP calls) and the part buffers on CUDA (copies run this many parts less
# one ahead of the decodes).
PART_BYTES = 128 << 20
PARTS_IN_FLIGHT = 2
PAYS_RATIO = 0.9         # a block coded to more than this of its bytes stays raw
ALIGN = 16               # nvCOMP reads and writes device buffers at 16-byte aligned addresses


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def split_planes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high bytes, low bytes) of `flat` (uint8, even length) read as little-endian 16-bit words;
    each plane contiguous, half the length."""
    if flat.dtype != torch.uint8 or flat.numel() % 2:
        raise ValueError(f"split_planes needs an even number of bytes (uint8), got {flat.numel()} {flat.dtype}")
    words = flat.view(-1, 2)
    return words[:, 1].contiguous(), words[:, 0].contiguous()


class PlaneCoder(Protocol):
    """Codes high-byte planes on the device they live on. `stream`: where its work is enqueued
    (None on the CPU). `decode` must not synchronise the host. A coder may also carry
    `part_bytes` and `parts_in_flight` (swap/coding.py takes PART_BYTES, PARTS_IN_FLIGHT without)."""
    stream: "torch.cuda.Stream | None"

    def encode(self, high: torch.Tensor) -> torch.Tensor: ...            # coded bytes (uint8), same device

    def decode(self, coded: torch.Tensor, out: torch.Tensor) -> None: ...  # into `out` (uint8)


@dataclass
class CodedBlock:
    """A block's bytes as they wait in RAM and cross the link, in one host buffer. With `planes`
    (blocks mostly of 16-bit floats) per part its coded high plane, padded to ALIGN, then its raw
    low plane; without (one-byte formats: fp8, packed nvfp4) per part all its bytes coded.
    `parts`: (offset in the block, the part's bytes, offset in `home`, coded bytes); `narrowed`:
    the parts whose fp16 words are held as the bf16 words they convert to exactly (see
    `narrow_fp16`), turned back into fp16 as they are re-interleaved."""
    home: HostBuffer
    parts: tuple[tuple[int, int, int, int], ...]
    nbytes: int
    planes: bool = True
    narrowed: frozenset[int] = frozenset()

    @property
    def coded_bytes(self) -> int:
        return self.home.nbytes

    def scratch_bytes(self) -> int:
        """Device scratch a decode needs, a multiple of ALIGN: the largest part's coded bytes (with
        planes, plus its raw low plane and its decoded high plane, each from an aligned offset)."""
        return max(aligned(c) + (2 * aligned(n // 2) if self.planes else 0) for _, n, _, c in self.parts)


def wants_planes(dtypes_bytes: dict[int, int], nbytes: int) -> bool:
    """Split into planes where at least half a block's bytes are 16-bit floats (element size 2);
    `dtypes_bytes`: bytes per element size."""
    return nbytes % 2 == 0 and 2 * dtypes_bytes.get(2, 0) >= nbytes


def narrow_fp16(part: torch.Tensor) -> torch.Tensor | None:
    """The bf16 bytes of a part's fp16 words (uint8, even length) where every word comes back bit
    for bit through fp16 -> bf16 -> fp16 and none is a NaN, else None. fp16 weights cast from a
    bf16 file (ComfyUI computes Wan in fp16) always do; their bf16 high bytes hold sign and
    exponent only, so they code much smaller than fp16's, whose high bytes carry two mantissa
    bits (the ratios: bench/RESULTS.md)."""
    words = part.view(torch.float16)
    narrow = words.to(torch.bfloat16)
    if words.isnan().any() or not torch.equal(narrow.to(torch.float16).view(torch.int16), words.view(torch.int16)):
        return None   # (a NaN's bits may differ between the conversions of torch and of the fused join)
    return narrow.view(torch.uint8)


def encode_block(coder: PlaneCoder, flat: torch.Tensor, part_bytes: int = PART_BYTES, planes: bool = True,
                 download: "Callable[[torch.Tensor, torch.Tensor], None] | None" = None,
                 fp16: bool = False) -> CodedBlock:
    """Code a block's bytes (uint8 on the coder's device) into a new pageable host buffer: the
    parts are laid out on the device as the home holds them, then downloaded in one go
    (`download(device, host)`, e.g. PinnedChunks.download: a plain copy into fresh pageable
    pages runs far below the link, its page faults taken on one thread). `fp16`: the block's
    16-bit words are fp16, so each part is narrowed to bf16 where that is exact (`narrow_fp16`)."""
    n, pieces, narrowed = flat.numel(), [], set()
    for k, off in enumerate(range(0, n, part_bytes)):
        part = flat[off:off + part_bytes]
        if planes:
            narrow = narrow_fp16(part) if fp16 else None
            if narrow is not None:
                narrowed.add(k)
                part = narrow
            high, low = split_planes(part)
            pieces.append((off, part.numel(), coder.encode(high), low))
        else:
            pieces.append((off, part.numel(), coder.encode(part), part[:0]))
    staged = torch.empty(sum(aligned(c.numel()) + low.numel() for _, _, c, low in pieces), dtype=torch.uint8,
                         device=flat.device)
    parts, pos = [], 0
    for off, size, coded, low in pieces:
        c = coded.numel()
        staged[pos:pos + c].copy_(coded)
        staged[pos + aligned(c):pos + aligned(c) + low.numel()].copy_(low)
        parts.append((off, size, pos, c))
        pos += aligned(c) + low.numel()
    del pieces
    home = HostBuffer(staged.numel())
    (download or _copy)(staged, home.flat)
    return CodedBlock(home, tuple(parts), n, planes, frozenset(narrowed))


def _copy(src: torch.Tensor, dest: torch.Tensor) -> None:
    dest.copy_(src)


def decode_block(coder: PlaneCoder, block: CodedBlock, scratch: torch.Tensor, out: torch.Tensor,
                 copy_stream: "torch.cuda.Stream | None" = None, after: "torch.cuda.Event | None" = None,
                 freed: "list | None" = None) -> None:
    """Enqueue each part's copy into the scratch, its decode and its re-interleave into `out` (the
    block's bytes), the decodes on the current stream. `scratch`: device uint8 of at least
    `block.scratch_bytes()`; with `copy_stream` (CUDA) `len(freed)` times that (one part buffer without
    `freed`), a ring of part buffers: the copies run on `copy_stream` up to that many parts ahead of
    the decodes, waiting only for `after` (the slot is free) and for the decode last done with their
    part_buf (`freed`: one event a part_buf, kept by the caller from block to block), not for the previous
    block's decodes."""
    freed = freed or [None]
    part_bufs = len(freed) if copy_stream is not None else 1
    part_buf = scratch.numel() // part_bufs // ALIGN * ALIGN
    decoding = torch.cuda.current_stream(scratch.device) if copy_stream is not None else None
    if decoding is not None and after is not None:
        copy_stream.wait_event(after)
    for k, (off, size, pos, c) in enumerate(block.parts):
        half = size // 2 if block.planes else 0
        span = aligned(c) + half if block.planes else c   # coded, padding, low plane: one copy
        base = (k % part_bufs) * part_buf
        landed = scratch[base:base + span]
        if decoding is None:
            landed.copy_(block.home.flat[pos:pos + span], non_blocking=True)
        else:
            if freed[k % part_bufs] is not None:
                copy_stream.wait_event(freed[k % part_bufs])
            with torch.cuda.stream(copy_stream):
                landed.copy_(block.home.flat[pos:pos + span], non_blocking=True)
                arrived = torch.cuda.Event()
                arrived.record(copy_stream)
            decoding.wait_event(arrived)
        if not block.planes:
            coder.decode(landed, out[off:off + size])
        else:
            high = scratch[base + aligned(span):base + aligned(span) + half]
            coder.decode(landed[:c], high)
            join_words(high, landed[aligned(c):], out[off:off + size], widen=k in block.narrowed)
        if decoding is not None:
            freed[k % part_bufs] = torch.cuda.Event()
            freed[k % part_bufs].record(decoding)


def nvcomp_module():
    """nvidia.nvcomp, or ImportError naming the package to install."""
    try:
        from nvidia import nvcomp
    except ImportError as e:
        raise ImportError(f"RingSwap compress: nvCOMP's Python package is not installed; install {NVCOMP_PACKAGES} "
                          "(pip install nvidia-nvcomp-cu13; wheels exist for Linux and Windows)") from e
    return nvcomp


class AnsPlanes:
    """nvCOMP's ANS on one CUDA stream of its own. Each part size gets a compression config and
    the decompression config built from it, so a decode never reads a header back to the host."""

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream | None" = None, data_type: str = "|u1",
                 part_bytes: int = PART_BYTES, parts_in_flight: int = PARTS_IN_FLIGHT, **codec_options):
        self.nvcomp = nvcomp_module()
        self.part_bytes, self.parts_in_flight = part_bytes, parts_in_flight
        self.device = torch.device(device)
        self.stream = stream or torch.cuda.Stream(self.device, priority=-1)   # decodes first where SMs free up
        self.words = data_type == "<f2"   # ANS's 16-bit float mode: parts coded whole, as 16-bit words
        self.codec = self.nvcomp.Codec(algorithm="ANS", device_id=self.device.index or 0,   # options: nvcomp.Codec's
                                       cuda_stream=self.stream.cuda_stream, data_type=data_type, **codec_options)
        self._configs: dict[int, tuple] = {}

    def _config(self, nbytes: int) -> tuple:
        cfg = self._configs.get(nbytes)
        if cfg is None:
            comp = self.codec.compression_config(nbytes)
            cfg = self._configs[nbytes] = (comp, self.codec.decompression_config(comp))
        return cfg

    def _array(self, t: torch.Tensor):
        return self.nvcomp.as_array(t, cuda_stream=self.stream.cuda_stream)

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            source = data.view(torch.float16) if self.words else data
            coded = self.codec.encode(self._array(source), compression_config=self._config(data.numel())[0])
            out = torch.as_tensor(coded, device=self.device).view(torch.uint8).reshape(-1).clone()
        self.stream.synchronize()
        return out

    def decode(self, coded: torch.Tensor, out: torch.Tensor) -> None:
        self.codec.decode(self._array(coded), out=out, decompression_config=self._config(out.numel())[1])


ANS_DATA_TYPE = "|u1"   # byte planes; "<f2" codes whole 16-bit words instead (no re-interleave)


def ans_coder(device: torch.device) -> AnsPlanes:
    """The coder a load that may code uses: nvCOMP's ANS on byte planes (its 64 KiB chunks)."""
    return AnsPlanes(device, data_type=ANS_DATA_TYPE)


@functools.lru_cache(maxsize=1)
def coder_missing() -> str | None:
    """Why no coder can be used here (the ImportError's words), or None; looked up once."""
    try:
        nvcomp_module()
    except ImportError as e:
        return str(e)
    return None
