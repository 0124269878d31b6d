"""GGUF weights to the dense weight a layer computes from, plus LoRA pairs, in one Triton kernel.

Why our own kernels: ComfyUI-GGUF dequantizes op by op (Q8_0: four passes over the dense
weight; Q4_K: a dozen launches and a blocking host-to-device copy per weight), and nothing
adds low-rank products on the way. These do the pack's steps with its roundings (each op in
the dequant dtype, rounded as torch rounds it, then to the model's dtype; bit for bit without
pairs) and add the pairs' float32 delta (lora/kernels.py `_add_lora`), rounded once.
Where a kernel cannot build or run the caller is told (None) and dequantizes op by op.
"""
from __future__ import annotations

import torch

from . import kernels
from .kernels import TILES, Pairs, _launch, _usable, triton

DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}   # triton.language names
ROW_BYTES = {"Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
             "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24)}   # values, bytes of a GGML block
LAYOUT = {"Q4_0": dict(NBYTES=18, HIGH=False, MIN=False), "Q4_1": dict(NBYTES=20, HIGH=False, MIN=True),
          "Q5_0": dict(NBYTES=22, HIGH=True, MIN=False), "Q5_1": dict(NBYTES=24, HIGH=True, MIN=True),
          "Q4_K": dict(NBYTES=144, HIGH=False), "Q5_K": dict(NBYTES=176, HIGH=True)}   # a shared kernel's constants


if triton is not None:
    import triton.language as tl

    from .kernels import _add_lora

    @triton.jit
    def _f16_at(ptr, mask):
        """The float16 stored little-endian at byte pointers `ptr` (any alignment), as float32."""
        lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
        hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
        return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _store(w, rm, rn, M, N, out_ptr, up_ptr, down_ptr, scales_ptr, RANK: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        """A tile's dequantized values (in the dequant dtype, any shape of BM x BN) to the output
        dtype, plus the pairs' float32 delta rounded once, stored as rows rm, columns rn."""
        w = tl.reshape(w.to(out_ptr.dtype.element_ty).to(tl.float32), (BM, BN))
        w = _add_lora(w, rm, rn, M, N, up_ptr, down_ptr, scales_ptr, RANK, BR, PREC)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _q8_0_kernel(q_ptr, out_ptr, up_ptr, down_ptr, scales_ptr, M, N, MID: tl.constexpr, RANK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        """Q8_0 rows (per 32 values: an fp16 scale d, then 32 int8 q). The pack's steps: d in
        MID, d * q rounded to MID, then to the output dtype. A tile is loaded as [BM, BN / 32]
        scales and [BM, BN / 32, 32] values (bytewise: rows need no alignment)."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nb = tl.program_id(1) * (BN // 32) + tl.arange(0, BN // 32)
        bmask = (rm[:, None] < M) & (nb[None, :] < N // 32)
        blk = q_ptr + rm[:, None].to(tl.int64) * (N // 32 * 34) + (nb * 34)[None, :]
        d = _f16_at(blk, bmask).to(MID).to(tl.float32)
        q = tl.load(blk[:, :, None] + 2 + tl.arange(0, 32)[None, None, :], mask=bmask[:, :, None], other=0)
        w = d[:, :, None] * q.to(tl.int8, bitcast=True).to(tl.float32)   # exact in float32
        _store(w.to(MID), rm, rn, M, N, out_ptr, up_ptr, down_ptr, scales_ptr, RANK, BM, BN, BR, PREC)

    @triton.jit
    def _scale_min_k4(blk, g, gmask):
        """get_scale_min of a K-quant super-block's 12 scale bytes (at blk + 4): the 6-bit scale
        and min of each of its eight 32-value groups `g`, as int32."""
        b_g = tl.load(blk + 4 + g[None, :], mask=gmask, other=0).to(tl.int32)
        b_g4 = tl.load(blk + 8 + g[None, :], mask=gmask, other=0).to(tl.int32)
        b_lo = tl.load(blk + 4 + (g % 4)[None, :], mask=gmask, other=0).to(tl.int32)
        low = g[None, :] < 4
        sc = tl.where(low, b_g & 63, (b_g4 & 15) | ((b_lo >> 2) & 48))
        mn = tl.where(low, b_g4 & 63, (b_g4 >> 4) | ((b_g >> 2) & 48))
        return sc, mn

    @triton.jit
    def _q4_q5_k_kernel(q_ptr, out_ptr, up_ptr, down_ptr, scales_ptr, M, N, MID: tl.constexpr, RANK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr,
                        NBYTES: tl.constexpr, HIGH: tl.constexpr):
        """Q4_K / Q5_K rows (per 256 values: fp16 d and dmin, 12 bytes of 6-bit scales and mins for
        its eight 32-value groups, with HIGH (Q5_K) 32 bytes of fifth bits (bit g of byte l for
        value l of group g), then 128 bytes of 4-bit q: groups 2c and 2c + 1 in the low and high
        nibbles of bytes 32c..32c + 31). The pack's steps (dequantize_blocks_Q4_K / Q5_K): d and
        dmin in MID, d * scale and dmin * min rounded to MID, (d * scale) * q rounded, minus dmin *
        min rounded, then to the output dtype. Each product is exact in float32 and float32 holds
        twice MID's precision and more, so one rounding from float32 is torch's rounding."""
        G: tl.constexpr = BN // 32   # 32-value groups in a tile's row
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        grp = tl.program_id(1) * G + tl.arange(0, G)
        g = grp % 8
        gmask = (rm[:, None] < M) & (grp[None, :] < N // 32)
        blk = q_ptr + rm[:, None].to(tl.int64) * (N // 256 * NBYTES) + ((grp // 8) * NBYTES)[None, :]
        d = _f16_at(blk, gmask).to(MID).to(tl.float32)
        dmin = _f16_at(blk + 2, gmask).to(MID).to(tl.float32)
        sc, mn = _scale_min_k4(blk, g, gmask)
        dsc = (d * sc.to(tl.float32)).to(MID).to(tl.float32)
        dm = (dmin * mn.to(tl.float32)).to(MID).to(tl.float32)
        lane = tl.arange(0, 32)[None, None, :]
        vmask = gmask[:, :, None]
        lo = tl.load(blk[:, :, None] + (16 + 32 * HIGH) + ((g // 2) * 32)[None, :, None] + lane, mask=vmask, other=0)
        q = (lo.to(tl.int32) >> ((g % 2) * 4)[None, :, None]) & 15
        if HIGH:
            hi = tl.load(blk[:, :, None] + 16 + lane, mask=vmask, other=0).to(tl.int32)
            q = q | (((hi >> g[None, :, None]) & 1) << 4)
        w = (dsc[:, :, None] * q.to(tl.float32)).to(MID).to(tl.float32)
        w = (w - dm[:, :, None]).to(MID)
        _store(w, rm, rn, M, N, out_ptr, up_ptr, down_ptr, scales_ptr, RANK, BM, BN, BR, PREC)

    @triton.jit
    def _q6_k_kernel(q_ptr, out_ptr, up_ptr, down_ptr, scales_ptr, M, N, MID: tl.constexpr, RANK: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
        """Q6_K rows (per 256 values: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8
        scales, one per 16 values, then fp16 d). The pack's steps (dequantize_blocks_Q6_K): the
        scales and d in MID, d * scale rounded to MID, q = (low | high << 4) - 32, (d * scale) * q
        rounded, then to the output dtype. A tile is [BM, BN / 16] scales by 16 values."""
        S: tl.constexpr = BN // 16
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        sub = tl.program_id(1) * S + tl.arange(0, S)   # 16-value sub-blocks along the row
        j = sub % 16
        g = j // 2   # the 32-value group, and the half of it
        smask = (rm[:, None] < M) & (sub[None, :] < N // 16)
        blk = q_ptr + rm[:, None].to(tl.int64) * (N // 256 * 210) + ((sub // 16) * 210)[None, :]
        d = _f16_at(blk + 208, smask).to(MID).to(tl.float32)
        sc = tl.load(blk + 192 + j[None, :], mask=smask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        dsc = (d * sc.to(MID).to(tl.float32)).to(MID).to(tl.float32)
        lane = ((j % 2) * 16)[None, :, None] + tl.arange(0, 16)[None, None, :]   # l, within the group
        lo = tl.load(blk[:, :, None] + ((g // 4) * 64 + (g % 2) * 32)[None, :, None] + lane,
                     mask=smask[:, :, None], other=0).to(tl.int32)
        hi = tl.load(blk[:, :, None] + 128 + ((g // 4) * 32)[None, :, None] + lane,
                     mask=smask[:, :, None], other=0).to(tl.int32)
        lo = (lo >> (((g // 2) % 2) * 4)[None, :, None]) & 15
        q = (lo | (((hi >> ((g % 4) * 2)[None, :, None]) & 3) << 4)) - 32
        w = (dsc[:, :, None] * q.to(tl.float32)).to(MID)
        _store(w, rm, rn, M, N, out_ptr, up_ptr, down_ptr, scales_ptr, RANK, BM, BN, BR, PREC)

    @triton.jit
    def _q4_q5_kernel(q_ptr, out_ptr, up_ptr, down_ptr, scales_ptr, M, N, MID: tl.constexpr, RANK: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr,
                      NBYTES: tl.constexpr, HIGH: tl.constexpr, MIN: tl.constexpr):
        """Q4_0 / Q4_1 / Q5_0 / Q5_1 rows (per 32 values: fp16 d, with MIN an fp16 m, with HIGH 4
        bytes of fifth bits (bit j for value j), then 16 bytes of nibbles: value j < 16 in the low
        nibble of byte j, value j + 16 in its high one). The pack's steps: d (and m) in MID, q the
        nibble (| fifth bit << 4), minus 8 (16 with HIGH) without m, d * q rounded to MID, with m
        plus m rounded, then to the output dtype."""
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        nb = tl.program_id(1) * (BN // 32) + tl.arange(0, BN // 32)
        bmask = (rm[:, None] < M) & (nb[None, :] < N // 32)
        blk = q_ptr + rm[:, None].to(tl.int64) * (N // 32 * NBYTES) + (nb * NBYTES)[None, :]
        d = _f16_at(blk, bmask).to(MID).to(tl.float32)
        j = tl.arange(0, 32)[None, None, :]
        vmask = bmask[:, :, None]
        qs = blk[:, :, None] + (NBYTES - 16)
        q = (tl.load(qs + (j % 16), mask=vmask, other=0).to(tl.int32) >> ((j // 16) * 4)) & 15
        if HIGH:
            bits = tl.load(blk[:, :, None] + (2 + 2 * MIN) + j // 8, mask=vmask, other=0).to(tl.int32)
            q = q | (((bits >> (j % 8)) & 1) << 4)
        if not MIN:
            q = q - (8 + 8 * HIGH)
        w = (d[:, :, None] * q.to(tl.float32)).to(MID)
        if MIN:
            m = _f16_at(blk + 2, bmask).to(MID).to(tl.float32)
            w = (w.to(tl.float32) + m[:, :, None]).to(MID)
        _store(w, rm, rn, M, N, out_ptr, up_ptr, down_ptr, scales_ptr, RANK, BM, BN, BR, PREC)

    KERNELS = {"Q8_0": ("q8_0", _q8_0_kernel), "Q4_K": ("q4_k", _q4_q5_k_kernel),
               "Q5_K": ("q5_k", _q4_q5_k_kernel), "Q6_K": ("q6_k", _q6_k_kernel),
               "Q4_0": ("q4_0", _q4_q5_kernel), "Q4_1": ("q4_1", _q4_q5_kernel),
               "Q5_0": ("q5_0", _q4_q5_kernel), "Q5_1": ("q5_1", _q4_q5_kernel)}
else:
    KERNELS = {}


def dense(type_name: str, blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, mid: torch.dtype,
          pairs: Pairs | None, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """The dense [M, N] weight in `dtype` of GGUF bytes `blocks` (uint8) of type `type_name`,
    dequantized through `mid` (ComfyUI-GGUF's dequant dtype: float16 by default), plus the
    pairs' delta where `pairs` is given, written into `out` where given (contiguous, [M, N],
    `dtype`); None where no kernel can run."""
    m, n = shape if len(shape) == 2 else (0, 0)
    if type_name not in KERNELS or not kernels.enabled(blocks.device):
        return None
    values, nbytes = ROW_BYTES[type_name]
    name, kernel = KERNELS[type_name]
    if (blocks.dtype != torch.uint8 or n % values or blocks.numel() != m * n // values * nbytes
            or mid not in DTYPES or dtype not in DTYPES or not blocks.is_contiguous()
            or (pairs is not None and (pairs.up.shape[0] != m or pairs.down.shape[1] != n))
            or not _usable(name, blocks.view(m, -1), None)):
        return None
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=blocks.device)
    elif out.shape != (m, n) or out.dtype != dtype or not out.is_contiguous() or out.device != blocks.device:
        raise ValueError(f"dense: out is {tuple(out.shape)} {out.dtype} on {out.device}, not ({m}, {n}) {dtype}")
    bm, bn, warps = TILES[name]
    lora = (pairs.up, pairs.down, pairs.scales) if pairs is not None else (out, out, out)
    ran = _launch(name, blocks, kernel, (triton.cdiv(m, bm), triton.cdiv(n, bn)), (blocks, out, *lora, m, n), ({},),
                  dict(MID=getattr(tl, DTYPES[mid]), RANK=pairs.rank if pairs is not None else 0, BM=bm, BN=bn,
                       BR=pairs.br if pairs is not None else 32, PREC=pairs.prec if pairs is not None else None,
                       num_warps=warps, **LAYOUT.get(type_name, {})))
    return out if ran else None
