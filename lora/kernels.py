"""Fused LoRA folds on CUDA (Triton): quantized weight + LoRA pairs -> requantized weight.

Why our own kernels: neither torch, ComfyUI nor comfy_kitchen has an op that adds low-rank
products to a quantized weight. Op by op, folding a per-tensor-scaled fp8 weight is five
float32 passes over the block (bench/probes/fold.py measures what that costs), so:
- `fold_fp8_` (per-tensor scaled fp8) and `fold_nvfp4_` (comfy_kitchen's nvfp4 layout) read
  the quantized bytes twice, once for the folded weight's amax and once to requantize in
  place with the fresh scales, recomputing the rank-r product per tile from LoRA factors
  that stay in L2; later folds of the same weight (a streamed block landing again) keep
  the first fold's amax and run only the second pass;
- `add_pairs_` adds the pairs to a float32 weight in place and returns its amax (other
  comfy_kitchen layouts, between their dequantize and quantize);
- GGUF's dense folds are in lora/gguf_kernels.py.
Math: products of bf16 (or fp16) LoRA factors are exact in float32 and summed in float32,
as ComfyUI's float32 `mm` does, in another order; float32 factors use Triton's tf32x3.
Division and fp8 rounding are to nearest even, subnormals included, as torch (CPU) and
comfy_kitchen's quantize do; fp8 is coded by bit arithmetic, so no fp8 type is needed.
Where a kernel cannot build or run, the caller is told (False / None) and folds op by op;
the failure is logged once.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("ringswap.kernels")

try:
    import triton
    import triton.language as tl
except ImportError:   # CPU-only torch: the callers fold op by op
    triton = None

_FAILED: set = set()   # (kernel, device) pairs that failed to build or run
_BUILT: set = set()    # (kernel, device) pairs that ran
_RAN: set = set()      # (kernel, device, compiled variant) that ran: a later failure is a real error
FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}   # mantissa bits, min exponent
WIDE_BR = 64   # ranks per dot for 16-bit factors whose ranks allow it (32 otherwise)
# rows, columns, warps of a tile (bench/probes/fold_kernels.py); the GGUF ones are lora/gguf_kernels.py's
TILES = {"fp8": (64, 64, 4), "add": (128, 128, 8), "nvfp4": (64, 64, 4), "q8_0": (128, 128, 8),
         "q4_k": (64, 128, 4), "q5_k": (64, 128, 4), "q6_k": (64, 128, 4), "q4_0": (128, 128, 8),
         "q4_1": (128, 128, 8), "q5_0": (128, 128, 8), "q5_1": (128, 128, 8)}


def enabled(device: torch.device) -> bool:
    """May the fused kernels run on `device`? (RINGSWAP_FUSED_KERNELS=0 turns them off.)"""
    return (triton is not None and device.type == "cuda"
            and os.environ.get("RINGSWAP_FUSED_KERNELS", "1") != "0")


class Pairs:
    """LoRA pairs of one weight laid out for the kernels: the ups side by side [M, R] and
    the downs stacked [R, N], each pair's rank padded with zeros to a multiple of `br`
    (the ranks one dot takes), and one scale (strength * alpha / rank) per `br` ranks,
    on the device."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor, float]], device: torch.device):
        self.dtype, self.br, ranks = self.layout(pairs)
        m, n = pairs[0][0].shape[0], pairs[0][1].shape[1]
        self.rank = sum(ranks)
        self.up = torch.zeros(m, self.rank, dtype=self.dtype, device=device)
        self.down = torch.zeros(self.rank, n, dtype=self.dtype, device=device)
        scales, k = [], 0
        for (u, d, scale), r in zip(pairs, ranks):
            self.up[:, k:k + u.shape[1]].copy_(u)
            self.down[k:k + d.shape[0]].copy_(d)
            scales += [scale] * (r // self.br)
            k += r
        self.scales = torch.tensor(scales, dtype=torch.float32, device=device)
        self.prec = "tf32x3" if self.dtype == torch.float32 else None
        # [amax, amax, old scale]: the first fold takes its amax in slot 0 (the kernels can
        # alternate two slots; only the first fold computes one) and the old scale in 2
        self.scratch = torch.zeros(3, dtype=torch.float32, device=device)
        # every later fold of this weight has the same base (a block lands from the same home
        # each time), so it skips the amax pass and requantizes with the kept amax, bit for bit
        self.amax_kept = False

    @staticmethod
    def layout(pairs: list[tuple[torch.Tensor, torch.Tensor, float]]) -> tuple[torch.dtype, int, list[int]]:
        """(dtype, ranks per dot, each pair's padded rank) of these pairs laid out for the kernels."""
        dtypes = {t.dtype for u, d, _ in pairs for t in (u, d)}
        dtype = dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.bfloat16, torch.float16} else torch.float32
        br = 32 if dtype != torch.float32 else 16
        ranks = [-(-d.shape[0] // br) * br for _, d, _ in pairs]
        if dtype != torch.float32 and all(r % WIDE_BR == 0 for r in ranks):
            br = WIDE_BR   # e.g. one rank-64 pair: one dot per tile instead of two
        return dtype, br, ranks

    @classmethod
    def nbytes(cls, pairs: list[tuple[torch.Tensor, torch.Tensor, float]]) -> int:
        """Device bytes of the ups and downs these pairs take once laid out."""
        dtype, _, ranks = cls.layout(pairs)
        return (pairs[0][0].shape[0] + pairs[0][1].shape[1]) * sum(ranks) * dtype.itemsize

    def fold_passes(self) -> tuple[int, tuple]:
        """(scratch slot, passes) of the next fold: both passes until a fold has run (`ran`),
        then the requantize pass with the kept amax."""
        return 0, REQUANT_PASS if self.amax_kept else TWO_PASSES

    def ran(self, done: bool) -> bool:
        """Note a fold's outcome (the amax is kept once one has run); returns `done`."""
        self.amax_kept = self.amax_kept or done
        return done


if triton is not None:
    @triton.jit
    def _add_lora(w, rm, rn, M, N, up_ptr, down_ptr, scales_ptr,
                  RANK: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        """w + the low-rank products of a tile, BR ranks (one pair's) at a time."""
        rk = tl.arange(0, BR)
        for k in tl.static_range(0, RANK, BR):
            a = tl.load(up_ptr + rm[:, None].to(tl.int64) * RANK + (k + rk)[None, :],
                        mask=rm[:, None] < M, other=0.0)
            b = tl.load(down_ptr + (k + rk)[:, None].to(tl.int64) * N + rn[None, :],
                        mask=rn[None, :] < N, other=0.0)
            w += tl.load(scales_ptr + k // BR) * tl.dot(a, b, input_precision=PREC)
        return w

    @triton.jit
    def _round_fp8(x, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """x (float32, within the format's range) rounded to nearest even onto the grid of an
        fp8 format with MBITS mantissa bits and smallest normal exponent EMIN, subnormals
        included, sign kept."""
        bits = x.to(tl.int32, bitcast=True)
        exp = tl.maximum(((bits >> 23) & 0xFF) - 127, EMIN)
        step = ((exp - MBITS + 127) << 23).to(tl.float32, bitcast=True)   # powers of two
        q = tl.abs(x) * ((MBITS - exp + 127) << 23).to(tl.float32, bitcast=True)   # |x| / step, exact
        r = ((q + 12582912.0) - 12582912.0) * step                      # 1.5 * 2**23: round to even
        return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_decode(byte, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """fp8 bytes (uint8) to float32, exactly: the byte's exponent and mantissa bits placed
        in a float16 (whose range holds every fp8 value, subnormals included), scaled by the
        power of two between the two biases. No fp8 type needed (any GPU Triton runs on)."""
        b = byte.to(tl.int16)
        h = ((b & 0x80) << 8) | ((b & 0x7F) << (10 - MBITS))
        return h.to(tl.float16, bitcast=True).to(tl.float32) * (2.0 ** (EMIN + 14))

    @triton.jit
    def _fp8_encode(r, MBITS: tl.constexpr, EMIN: tl.constexpr):
        """float32 values on the fp8 grid (from _round_fp8) to their fp8 bytes: the inverse of
        _fp8_decode (the float16 is exact, every value being on the grid)."""
        h = (r * (2.0 ** (-EMIN - 14))).to(tl.float16).to(tl.int16, bitcast=True)
        return (((h >> 8) & 0x80) | ((h >> (10 - MBITS)) & 0x7F)).to(tl.uint8)

    @triton.jit(do_not_specialize=["slot"])   # one build for both scratch slots
    def _fp8_kernel(q_ptr, s_ptr, scratch_ptr, slot, up_ptr, down_ptr, scales_ptr, M, N, fmax, min_scale,
                    RANK: tl.constexpr, REQUANT: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        """Per-tensor scaled fp8 (bytes at q_ptr, scale at s_ptr). Pass 1 takes the amax of the
        folded weight into scratch[slot] and keeps the old scale in scratch[2]; pass 2 folds
        again, requantizes in place, writes the new scale and clears scratch[1 - slot]."""
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None].to(tl.int64) * N + rn[None, :]
        s = tl.load(scratch_ptr + 2) if REQUANT else tl.load(s_ptr).to(tl.float32)
        w = _fp8_decode(tl.load(q_ptr + offs, mask=mask, other=0), MBITS, EMIN) * s
        w = _add_lora(w, rm, rn, M, N, up_ptr, down_ptr, scales_ptr, RANK, BR, PREC)
        if REQUANT:
            new = tl.maximum(tl.math.div_rn(tl.load(scratch_ptr + slot), fmax), min_scale)
            out = _round_fp8(tl.clamp(tl.math.div_rn(w, new), -fmax, fmax), MBITS, EMIN)
            tl.store(q_ptr + offs, _fp8_encode(out, MBITS, EMIN), mask=mask)
            if first:
                tl.store(s_ptr, new)
                tl.store(scratch_ptr + 1 - slot, 0.0)
        else:
            tl.atomic_max(scratch_ptr + slot, tl.max(tl.max(tl.where(mask, tl.abs(w), 0.0), axis=1), axis=0))
            if first:
                tl.store(scratch_ptr + 2, s)

    @triton.jit
    def _add_kernel(w_ptr, amax_ptr, up_ptr, down_ptr, scales_ptr, M, N, RANK: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None].to(tl.int64) * N + rn[None, :]
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        w = _add_lora(w, rm, rn, M, N, up_ptr, down_ptr, scales_ptr, RANK, BR, PREC)
        tl.store(w_ptr + offs, w, mask=mask)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.where(mask, tl.abs(w), 0.0), axis=1), axis=0))


    @triton.jit
    def _e2m1_decode(code):
        """fp4 e2m1 codes (0..15, any integer type) to float32 / 2**14, exactly: the code's
        exponent and mantissa bits placed in a float16 (the e2m1 values scaled by 2**-14,
        subnormals included). The caller folds the 2**14 into the scale."""
        c = code.to(tl.int16)
        return (((c & 8) << 12) | ((c & 7) << 9)).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _e2m1_encode(d):
        """float32 in [-6, 6] to e2m1 codes, round to nearest even, the sign kept (-0 too):
        rounded onto the e2m1 grid by _round_fp8 (1 mantissa bit, smallest exponent 0), then
        the inverse of _e2m1_decode's float16 bit placement."""
        h = (_round_fp8(d, 1, 0) * (2.0 ** -14)).to(tl.float16).to(tl.int16, bitcast=True)
        return (((h >> 12) & 8) | ((h >> 9) & 7)).to(tl.uint8)

    @triton.jit(do_not_specialize=["slot"])
    def _nvfp4_kernel(q_ptr, bs_ptr, gs_ptr, scratch_ptr, slot, up_ptr, down_ptr, scales_ptr,
                      M, N, col_groups, max_value, min_scale, RANK: tl.constexpr, REQUANT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        """nvfp4 as comfy_kitchen stores it: two e2m1 codes per byte (high nibble first),
        one e4m3 scale per 16 values in cuBLAS's blocked layout, a float32 global scale.
        The passes and the scratch slots are those of _fp8_kernel."""
        first = (tl.program_id(0) == 0) & (tl.program_id(1) == 0)
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        rb = tl.program_id(1) * (BN // 16) + tl.arange(0, BN // 16)      # 16-value blocks
        rp = tl.program_id(1) * (BN // 2) + tl.arange(0, BN // 2)        # packed bytes
        rows = rm[:, None] < M
        qoffs = rm[:, None].to(tl.int64) * (N // 2) + rp[None, :]
        qmask = rows & (rp[None, :] < N // 2)
        ri = rm % 128
        soffs = ((rm // 128)[:, None].to(tl.int64) * col_groups + (rb // 4)[None, :]) * 512 \
            + ((ri % 32) * 16 + (ri // 32) * 4)[:, None] + (rb % 4)[None, :]
        smask = rows & (rb[None, :] < N // 16)
        packed = tl.load(q_ptr + qoffs, mask=qmask, other=0)
        codes = tl.interleave(packed >> 4, packed & 15)
        gs = tl.load(scratch_ptr + 2) if REQUANT else tl.load(gs_ptr).to(tl.float32)
        total = (gs * 16384.0) * _fp8_decode(tl.load(bs_ptr + soffs, mask=smask, other=0), 3, -6)   # 2**14: _e2m1_decode
        total = tl.reshape(tl.broadcast_to(total[:, :, None], (BM, BN // 16, 16)), (BM, BN))
        w = _e2m1_decode(codes) * total
        w = _add_lora(w, rm, rn, M, N, up_ptr, down_ptr, scales_ptr, RANK, BR, PREC)
        if REQUANT:   # comfy_kitchen's quantize_nvfp4, step by step
            new_gs = tl.maximum(tl.math.div_rn(tl.load(scratch_ptr + slot), max_value), min_scale)
            w3 = tl.reshape(w, (BM, BN // 16, 16))
            block = tl.math.div_rn(tl.max(tl.abs(w3), axis=2), 6.0)
            block = tl.minimum(tl.math.div_rn(block, new_gs), 448.0)
            block = _round_fp8(block, 3, -6)
            total = new_gs * block
            zero = total == 0.0
            d = tl.math.div_rn(w3, tl.where(zero, 1.0, total)[:, :, None])
            d = tl.clamp(tl.where(zero[:, :, None], 0.0, d), -6.0, 6.0)
            codes = _e2m1_encode(tl.reshape(d, (BM, BN)))
            hi, lo = tl.split(tl.reshape(codes, (BM, BN // 2, 2)))
            tl.store(q_ptr + qoffs, (hi << 4) | lo, mask=qmask)
            tl.store(bs_ptr + soffs, _fp8_encode(block, 3, -6), mask=smask)
            if first:
                tl.store(gs_ptr, new_gs)
                tl.store(scratch_ptr + 1 - slot, 0.0)
        else:
            tl.atomic_max(scratch_ptr + slot, tl.max(tl.max(tl.abs(w), axis=1), axis=0))
            if first:
                tl.store(scratch_ptr + 2, gs)


def _usable(name: str, w: torch.Tensor, pairs: Pairs | None) -> bool:
    return ((name, w.device) not in _FAILED and w.dim() == 2 and w.is_contiguous()
            and (pairs is None or (pairs.up.shape[0] == w.shape[0] and pairs.down.shape[1] == w.shape[1])))


def fold_fp8_(q: torch.Tensor, scale: torch.Tensor, pairs: Pairs, min_scale: float) -> bool:
    """q * scale + the pairs' delta, requantized into `q` with a fresh per-tensor scale
    amax / fp8_max (at least `min_scale`) written into `scale`. False (nothing changed)
    where the kernel cannot run."""
    if not _usable("fp8", q, pairs) or scale.numel() != 1 or q.dtype not in FP8_GRID:
        return False
    m, n = q.shape
    mbits, emin = FP8_GRID[q.dtype]
    bm, bn, warps = TILES["fp8"]
    slot, passes = pairs.fold_passes()
    args = (q.view(torch.uint8), scale, pairs.scratch, slot, pairs.up, pairs.down, pairs.scales,
            m, n, torch.finfo(q.dtype).max, min_scale)
    return pairs.ran(_launch("fp8", q, _fp8_kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)), args, passes,
                             dict(RANK=pairs.rank, MBITS=mbits, EMIN=emin, BM=bm, BN=bn, BR=pairs.br,
                                  PREC=pairs.prec, num_warps=warps)))


def fold_nvfp4_(qdata: torch.Tensor, scale: torch.Tensor, block_scale: torch.Tensor, pairs: Pairs,
                max_value: float, min_scale: float) -> bool:
    """Dequantize comfy_kitchen's nvfp4 (qdata, global scale, blocked block scales), add the
    pairs' delta and requantize in place as comfy_kitchen's quantize_nvfp4 does, with a fresh
    global scale amax / max_value (at least `min_scale`). False (nothing changed) where the
    kernel cannot run or the tensors are not laid out as expected."""
    m, half = qdata.shape if qdata.dim() == 2 else (0, 0)
    n = 2 * half
    groups = -(-(n // 16) // 4)
    if (qdata.dtype != torch.uint8 or n % 16 or scale.numel() != 1 or not block_scale.is_contiguous()
            or block_scale.dtype != torch.float8_e4m3fn or block_scale.numel() != -(-m // 128) * 128 * groups * 4
            or pairs.up.shape[0] != m or pairs.down.shape[1] != n or not _usable("nvfp4", qdata, None)):
        return False
    bm, bn, warps = TILES["nvfp4"]
    slot, passes = pairs.fold_passes()
    args = (qdata, block_scale.view(torch.uint8), scale, pairs.scratch, slot, pairs.up, pairs.down,
            pairs.scales, m, n, groups, max_value, min_scale)
    return pairs.ran(_launch("nvfp4", qdata, _nvfp4_kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)), args,
                             passes, dict(RANK=pairs.rank, BM=bm, BN=bn, BR=pairs.br, PREC=pairs.prec,
                                          num_warps=warps)))


TWO_PASSES = ({"REQUANT": False}, {"REQUANT": True})   # the amax pass, then the requantize pass
REQUANT_PASS = TWO_PASSES[1:]


def _variant(args: tuple, meta: dict) -> tuple:
    """What Triton compiles a kernel for: its constexprs, the tensors' dtypes and 16-byte
    alignment, and which integers are 1 or multiples of 16."""
    return (tuple(sorted((k, repr(v)) for k, v in meta.items())),
            tuple((str(a.dtype), a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                  else (a == 1, a % 16 == 0) if isinstance(a, int) else type(a).__name__ for a in args))


def _launch(name: str, target: torch.Tensor, kernel, grid: tuple, args: tuple, passes: tuple, meta: dict) -> bool:
    """Launch `kernel` once per entry of `passes` (only the last may write the target); False
    (logged once, the kernel not tried again on that device) where a variant of it not run
    before cannot build or run (e.g. the first with LoRA pairs, after the dequantize-only one).
    A variant that has run and then fails raises."""
    for extra in passes:
        variant = (name, target.device, _variant(args, {**extra, **meta}))
        try:
            kernel[grid](*args, **extra, **meta)
        except Exception as e:   # noqa: BLE001 - a GPU or Triton that cannot build it
            if variant in _RAN:
                raise
            _FAILED.add((name, target.device))
            log.warning("RingSwap LoRA: the fused %s fold cannot run on %s (%s); folding op by op instead", name,
                        target.device, str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__)
            return False
        _RAN.add(variant)
    _BUILT.add((name, target.device))
    return True


def add_pairs_(w: torch.Tensor, pairs: Pairs) -> torch.Tensor | None:
    """Add the pairs' delta to the float32 weight `w` in place; returns amax(|w|) after it
    (a 0-dim device tensor), or None (nothing changed) where the kernel cannot run."""
    if w.dtype != torch.float32 or not _usable("add", w, pairs):
        return None
    m, n = w.shape
    amax = torch.zeros((), dtype=torch.float32, device=w.device)
    bm, bn, warps = TILES["add"]
    ran = _launch("add", w, _add_kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)),
                  (w, amax, pairs.up, pairs.down, pairs.scales, m, n), ({},),
                  dict(RANK=pairs.rank, BM=bm, BN=bn, BR=pairs.br, PREC=pairs.prec, num_warps=warps))
    return amax if ran else None
