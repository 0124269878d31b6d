"""Coded homes: streamed blocks kept in RAM as their coded bytes (swap/plane_coder.py), and
the copy of such a block into a ring slot or a resident buffer (copy, decode, re-interleave on
the coder's stream)."""
from __future__ import annotations

import logging
import time

import torch

from .host_pool import HostPool, empty_bytes
from .plane_coder import (PART_BYTES, PARTS_IN_FLIGHT, PAYS_RATIO, CodedBlock, PlaneCoder, decode_block,
                          encode_block, wants_planes)
from .staged_copy import PinnedChunks

log = logging.getLogger("ringswap.coding")


def _form(coder: PlaneCoder, layout) -> dict:
    """How a block is coded: in byte planes where mostly 16-bit floats (unless the coder codes
    16-bit words itself: AnsPlanes in ANS's float mode), and those of fp16 blocks narrowed to
    bf16 where exact (plane_coder.narrow_fp16)."""
    by_size: dict[int, int] = {}
    fp16 = 0
    for e in layout.entries:
        size = torch.empty(0, dtype=e.dtype).element_size()
        by_size[size] = by_size.get(size, 0) + e.nbytes
        fp16 += e.nbytes if e.dtype == torch.float16 else 0
    planes = not getattr(coder, "words", False) and wants_planes(by_size, layout.nbytes)
    return {"planes": planes, "fp16": planes and 2 * fp16 >= layout.nbytes}


def coding_for(coding: "Coding | None", factory, device: torch.device) -> "Coding":
    """`coding` if it is for `device`, else a new one with `factory(device)`'s coder."""
    if factory is None:
        raise RuntimeError("compress needs a plane coder (BlockSwapEngine.coder_factory)")
    return coding if coding is not None and coding.device == device else Coding(factory(device), device)


def keep_coder(coding: "Coding | None", factory, att) -> "Coding | None":
    """The coding that resident blocks kept in RAM at a detach go through (None: kept raw): where
    the load codes or may code (`att.compress`, `att.may_code`) and coding has not failed to pay,
    the engine's coding for the device. Coded they take a good part less RAM (bench/RESULTS.md has
    the ratios), so two models (e.g. Wan 2.2's two experts) can keep their resident blocks where raw
    they could not, and cost about the same to keep (a GPU encode, a smaller download) and to place
    (a smaller upload, a GPU decode)."""
    if factory is None or not (att.compress or att.may_code) or (coding is not None and coding.pays is False):
        return None
    return coding_for(coding, factory, att.device)


class Coding:
    """An engine's coder on one device, whether coding pays for its blocks, and the device
    scratch decodes go through while attached."""

    def __init__(self, coder: PlaneCoder, device: torch.device):
        self.coder = coder
        self.device = device
        self.part_bytes = getattr(coder, "part_bytes", PART_BYTES)   # a coder may ask for other parts
        self.part_bufs = getattr(coder, "parts_in_flight", PARTS_IN_FLIGHT)   # part buffers on CUDA (decode_block)
        self.pays: bool | None = None     # None: not tried yet; False: the first block did not shrink
        self.scratch: torch.Tensor | None = None
        self.encoded = (0, 0)             # raw bytes, coded bytes: what was coded so far
        self.decode_rate = 0.0            # bytes a second the decode alone gives back, from the check; 0: not timed
        self.checked = False
        self.freed: list = [None] * self.part_bufs   # the decodes last done with each scratch part buffer (decode_block)

    @property
    def ratio(self) -> float:
        raw, coded = self.encoded
        return coded / raw if raw else 1.0

    def code_homes(self, states: list, pool: HostPool, blocks: list[int], link_bytes_per_s: float = 0.0) -> int:
        """Replace the raw RAM homes of `blocks` by coded ones (each uploaded, coded on the device,
        downloaded); the blocks' parameters are unbound from the dropped home. Stops, leaving the
        rest raw, if a block does not shrink below PAYS_RATIO, or if at `link_bytes_per_s` (the
        link measured earlier; 0: not yet) its coded copy followed by its decode takes longer than
        a raw copy. Returns the bytes saved."""
        todo = [i for i in blocks if i in pool.blocks and i not in pool.coded and states[i].layout.nbytes]
        if not todo or self.pays is False:
            return 0
        t0, raw, coded, count = time.perf_counter(), 0, 0, 0
        try:
            work = empty_bytes(max(states[i].layout.nbytes for i in todo), self.device)
        except torch.cuda.OutOfMemoryError:   # e.g. re-planned after running out of memory
            log.info("RingSwap compress: no device memory to code %d blocks now; they stay raw", len(todo))
            return 0
        with PinnedChunks(pin=self.device.type == "cuda") as chunks:
            for i in todo:
                n = states[i].layout.nbytes
                chunks.upload(pool.blocks[i].flat, work[:n])
                chunks.synchronize()
                block = encode_block(self.coder, work[:n], self.part_bytes, download=chunks.download,
                                     **_form(self.coder, states[i].layout))
                if block.coded_bytes > PAYS_RATIO * n:
                    self.pays = False
                    log.info("RingSwap compress: a block codes to %.2f of its bytes (over %.2f): blocks stay raw",
                             block.coded_bytes / n, PAYS_RATIO)
                    break
                if not self.checked:
                    self._check(block, work[:n])
                if not self.faster(block, link_bytes_per_s):
                    self.pays = False
                    log.info("RingSwap compress: at the link's %.1f GB/s a coded copy (%.2f x) and its decode "
                             "(%.1f GB/s) take longer than a raw copy: blocks stay raw", link_bytes_per_s / 1e9,
                             block.coded_bytes / n, self.decode_rate / 1e9)
                    break
                self.pays = True
                pool.drop(i)
                pool.coded[i] = block
                states[i].unbind(torch.device("cpu"))
                raw, coded, count = raw + n, coded + block.coded_bytes, count + 1
        self.encoded = (self.encoded[0] + raw, self.encoded[1] + coded)
        if raw:
            log.info("RingSwap compress: coded %d blocks, %.2f GB -> %.2f GB (%.3f) in %.2f s", count, raw / 1e9,
                     coded / 1e9, coded / raw, time.perf_counter() - t0)
        return raw - coded

    def faster(self, block: CodedBlock, link_bytes_per_s: float) -> bool:
        """Whether a coded copy then its decode beat a raw copy at `link_bytes_per_s` (true where
        either is not measured). Counted one after the other: a decode that hides under the next
        part's copy still takes the GPU from compute."""
        if link_bytes_per_s <= 0 or self.decode_rate <= 0:
            return True
        return block.coded_bytes / link_bytes_per_s + block.nbytes / self.decode_rate < block.nbytes / link_bytes_per_s

    def keep(self, s, pool: HostPool, ram_left: int, chunks: PinnedChunks | None = None) -> int | None:
        """A coded home for resident block `s`, coded straight from its device buffer; its bytes
        (0: it does not fit in `ram_left`; None: it does not shrink below PAYS_RATIO, so coding stops
        paying). See ram_homes.capture_resident."""
        block = encode_block(self.coder, s.device_buffer, self.part_bytes,
                             download=chunks.download if chunks is not None else None, **_form(self.coder, s.layout))
        if block.coded_bytes > PAYS_RATIO * s.layout.nbytes:
            self.pays = False
            return None
        if block.coded_bytes > ram_left:
            return 0
        if not self.checked:   # a load that coded nothing before: its first block checked bit for bit
            self._check(block, s.device_buffer)
        pool.coded[s.index] = block
        return block.coded_bytes

    def _check(self, block: CodedBlock, raw: torch.Tensor) -> None:
        """Decode the first coded block and compare it with its bytes (a coder that is not bit-exact
        is refused here, not found in the output), timing the decode alone."""
        out = torch.empty_like(raw)
        self.scratch = empty_bytes(block.scratch_bytes(), self.device)   # one part buffer: copies on the decode stream
        stream = self.coder.stream
        if stream is None:
            t0 = time.perf_counter()
            self.decode(block, out)
            secs = time.perf_counter() - t0
        else:   # after a warm-up, a copy of the coded bytes, then the copies and decodes: the difference
            pinned = block.home.pin()
            landed = empty_bytes(block.coded_bytes, self.device)
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.decode(block, out)
                marks[0].record(stream)
                landed.copy_(block.home.flat, non_blocking=True)
                marks[1].record(stream)
                self.decode(block, out)
                marks[2].record(stream)
            marks[2].synchronize()
            copy_ms, both_ms = marks[0].elapsed_time(marks[1]), marks[1].elapsed_time(marks[2])
            secs = max(both_ms - copy_ms, 0.02 * both_ms) / 1000.0 if pinned else 0.0
            block.home.unpin()
        self.scratch = None
        if not torch.equal(out, raw):
            raise RuntimeError("RingSwap compress: the plane coder did not give a block back bit for bit; "
                               "use compress=off and report this (nvCOMP version, GPU)")
        self.checked = True
        self.decode_rate = raw.numel() / secs if secs > 0 else 0.0

    def make_scratch(self, pool: HostPool, blocks) -> None:
        """Device scratch for decoding these blocks' coded homes: the coder's part buffers on CUDA
        (see decode_block)."""
        need = max((pool.coded[i].scratch_bytes() for i in blocks if i in pool.coded), default=0)
        need *= self.part_bufs if self.coder.stream is not None else 1
        if need and (self.scratch is None or self.scratch.numel() < need):
            self._new_scratch(empty_bytes(need, self.device))

    def _new_scratch(self, scratch: torch.Tensor | None) -> None:
        """A scratch whose part buffers no decode has used yet (or none)."""
        self.scratch = scratch
        self.freed = [None] * self.part_bufs

    def decode(self, block: CodedBlock, out: torch.Tensor, copy_stream: "torch.cuda.Stream | None" = None,
               after: "torch.cuda.Event | None" = None) -> None:
        """Enqueue the block's copy (on `copy_stream` where given, on CUDA, once `after` has
        happened) and decode into `out` (on the current stream)."""
        if self.coder.stream is None:
            decode_block(self.coder, block, self.scratch, out)
        else:
            decode_block(self.coder, block, self.scratch, out, copy_stream, after, self.freed)

    def land(self, copier, block: CodedBlock, out: torch.Tensor, after):
        """Copy and decode `block` into `out` once `after` has happened: the parts on `copier`'s
        stream, the decodes on the coder's; returns the completion event, timed as a copy."""
        return copier.enqueue(lambda: self.decode(block, out, copier.stream, after), after, stream=self.coder.stream)

    def release(self) -> None:
        self._new_scratch(None)
