"""A part's byte planes re-interleaved into 16-bit words on CUDA in one Triton pass.

Why our own: torch writes two byte planes into words only as two strided byte copies (each
pass writes every other byte of the output); this kernel reads both planes and writes whole
words once. Where Triton is missing (CPU-only torch, Windows without triton) or the kernel
fails its first check on a device, the caller joins with torch (logged once). Off with
RINGSWAP_FUSED_KERNELS=0, as the LoRA fold kernels.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("ringswap.join_kernel")

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

BLOCK = 4096
_checked: dict = {}   # device -> whether the kernel gave the torch join's bytes on its first run

if triton is not None:
    @triton.jit
    def _interleave(high_ptr, low_ptr, out_ptr, count, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < count
        high = tl.load(high_ptr + offs, mask=keep).to(tl.int16)
        low = tl.load(low_ptr + offs, mask=keep).to(tl.int16)
        tl.store(out_ptr + offs, (high << 8) | low, mask=keep)


def _launch(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor) -> None:
    n = high.numel()
    _interleave[(triton.cdiv(n, BLOCK),)](high, low, out.view(torch.int16), n, BLOCK=BLOCK)


def _usable(device: torch.device, torch_join) -> bool:
    """Whether the kernel runs on `device` and gives torch's bytes (checked once a device)."""
    if triton is None or device.type != "cuda" or os.environ.get("RINGSWAP_FUSED_KERNELS", "1") == "0":
        return False
    ok = _checked.get(device)
    if ok is None:
        g = torch.Generator(device=device).manual_seed(0)
        high, low = (torch.randint(0, 256, (BLOCK + 37,), dtype=torch.uint8, device=device, generator=g)
                     for _ in range(2))
        want, got = (torch.empty(2 * high.numel(), dtype=torch.uint8, device=device) for _ in range(2))
        torch_join(high, low, want)
        try:
            _launch(high, low, got)
            ok = bool(torch.equal(got, want))
            why = "" if ok else "its bytes differ from torch's"
        except Exception as e:   # noqa: BLE001 - a GPU or Triton that cannot build it
            ok, why = False, str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if not ok:
            log.warning("RingSwap compress: the fused re-interleave cannot run on %s (%s); joining with torch",
                        device, why)
        _checked[device] = ok
    return ok


def join(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor, torch_join) -> bool:
    """Write `high` and `low` (uint8, contiguous) into the words of `out` with the kernel, where
    it may run (`out` contiguous, 2-byte aligned); False: the caller joins with `torch_join`."""
    if not (out.is_contiguous() and out.data_ptr() % 2 == 0 and _usable(out.device, torch_join)):
        return False
    _launch(high, low, out)
    return True
