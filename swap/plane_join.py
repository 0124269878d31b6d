"""A part's byte planes re-interleaved into 16-bit words: torch's two strided byte copies, or on
CUDA one Triton pass that writes whole words (and, for parts held narrowed to bf16, the fp16
words they came from, converted in the same pass).

Why our own kernel: torch writes two byte planes into words only as two strided byte copies
(each writes every other byte of the output) and converts bf16 to fp16 in a third pass. Where
Triton is missing (CPU-only torch, Windows without triton) or the kernel fails its first check
on a device, the join is torch's (logged once). Off with RINGSWAP_FUSED_KERNELS=0, as the LoRA
fold kernels.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("ringswap.plane_join")

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096
_checked: dict = {}   # device -> whether the kernel gave torch's bytes on its first run, both ways

if triton is not None:
    @triton.jit
    def _interleave(high_ptr, low_ptr, out_ptr, count, WIDEN: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < count
        high = tl.load(high_ptr + offs, mask=keep).to(tl.int16)
        low = tl.load(low_ptr + offs, mask=keep).to(tl.int16)
        words = (high << 8) | low
        if WIDEN:   # bf16 words -> the fp16 words they convert to (round to nearest even, as torch)
            words = words.to(tl.bfloat16, bitcast=True).to(tl.float32).to(tl.float16).to(tl.int16, bitcast=True)
        tl.store(out_ptr + offs, words, mask=keep)


def join_planes(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the words of `high` and `low` back into `out` (uint8, twice their length): the
    inverse of plane_coder.split_planes, bit for bit."""
    words = out.view(-1, 2)
    words[:, 1].copy_(high)
    words[:, 0].copy_(low)
    return out


def _torch_join(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor, widen: bool) -> None:
    join_planes(high, low, out)
    if widen:
        out.view(torch.float16).copy_(out.view(torch.bfloat16))


def _launch(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor, widen: bool) -> None:
    n = high.numel()
    _interleave[(triton.cdiv(n, BLOCK),)](high, low, out.view(torch.int16), n, WIDEN=widen, BLOCK=BLOCK)


def _usable(device: torch.device) -> bool:
    """Whether the kernel runs on `device` and gives torch's bytes, plain and widened (checked
    once a device, on finite bf16 words)."""
    if triton is None or device.type != "cuda" or os.environ.get("RINGSWAP_FUSED_KERNELS", "1") == "0":
        return False
    ok = _checked.get(device)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        words = (torch.randn(BLOCK + 37, device=device, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
        high, low = words.view(-1, 2)[:, 1].contiguous(), words.view(-1, 2)[:, 0].contiguous()
        why = ""
        try:
            for widen in (False, True):
                want, got = (torch.empty_like(words) for _ in range(2))
                _torch_join(high, low, want, widen)
                _launch(high, low, got, widen)
                if not torch.equal(got, want):
                    why = f"its bytes differ from torch's ({'widened' if widen else 'plain'})"
        except Exception as e:   # noqa: BLE001 - a GPU or Triton that cannot build it
            why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        ok = not why
        if not ok:
            log.warning("RingSwap compress: the fused re-interleave cannot run on %s (%s); joining with torch",
                        device, why)
        _checked[device] = ok
    return ok


def join_words(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor, widen: bool = False) -> None:
    """Write `high` and `low` (uint8, contiguous) into the words of `out`; `widen`: they are bf16
    words to be written as fp16 (plane_coder.narrow_fp16). One fused pass where it can run (`out`
    contiguous and 2-byte aligned, on CUDA), else torch's."""
    if out.is_contiguous() and out.data_ptr() % 2 == 0 and _usable(out.device):
        _launch(high, low, out, widen)
    else:
        _torch_join(high, low, out, widen)
