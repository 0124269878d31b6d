"""LoRA fold cost per Wan-14B block on the GPU ring, for bf16, fp8, nvfp4 and GGUF (gguf_q8_0, gguf_q4_k) bases.

Writes a short Wan-14B-width file (a few blocks, dim 5120, ffn 13824) per base format with
bench/model_file.py's writer, loads it with RingSwap (window 1: every block streams, so every
block is folded at every step), applies a random rank-64 LoRA on all ten block linears
through ComfyUI's own LoRA loading, and runs steps at `--tokens` (default 32,760: 480p 81
frames). Reports the fold's span per block (the engine's timed on-land work, on its own
stream beside the compute) and the step with and without LoRA; the verdict is the step's:
target (issue 4) <= 1.03 x at 480p.
GGUF files are written by bench/gguf_model.py and need ComfyUI-GGUF (carry .comfyui-gguf).
Usage: python bench/probes/fold.py [--formats bf16 quant_metadata nvfp4 gguf_q4_k] [--blocks 3] [--profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (sets up ComfyUI on sys.path)
import gguf_model  # noqa: E402
import model_file  # noqa: E402

if not torch.cuda.is_available():   # CPU smoke test: tell ComfyUI before it looks for CUDA
    from comfy.cli_args import args
    args.cpu = True

import comfy.model_management as mm  # noqa: E402
import comfy.sd  # noqa: E402

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model  # noqa: E402
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings  # noqa: E402

LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
           "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")


def rank_lora(blocks: int, dim: int, ffn: int, rank: int) -> dict:
    shapes = {"ffn.0": (ffn, dim), "ffn.2": (dim, ffn)}
    g = torch.Generator().manual_seed(0)
    sd = {}
    for i in range(blocks):
        for lin in LINEARS:
            out_f, in_f = shapes.get(lin, (dim, dim))
            base = f"diffusion_model.blocks.{i}.{lin}"
            sd[base + ".lora_A.weight"] = (torch.randn(rank, in_f, generator=g) * 0.01).to(torch.bfloat16)
            sd[base + ".lora_B.weight"] = (torch.randn(out_f, rank, generator=g) * 0.01).to(torch.bfloat16)
    return sd


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(model, inputs, steps: int, profile: bool = False):
    mm.load_models_gpu([model])
    dm = model.model.diffusion_model
    times = []
    prof = None
    with torch.no_grad():
        for k in range(steps + 1):
            if k == 1 and profile and torch.cuda.is_available():
                # CPU too: the table's totals tell launch-bound folds (CPU time > CUDA time) from GPU-bound ones
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.__enter__()
            sync()
            t0 = time.perf_counter()
            dm(*inputs)
            sync()
            if k:
                times.append(time.perf_counter() - t0)
            if k == 0:
                model.swap_engine.end_run()
    if prof is not None:
        prof.__exit__(None, None, None)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    stats = model.swap_engine.end_run()
    return sorted(times)[len(times) // 2], stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", nargs="+", default=["bf16", "quant_metadata", "nvfp4"])
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32760)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--dim", type=int, default=5120)
    ap.add_argument("--ffn", type=int, default=13824)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--profile", action="store_true", help="print the device kernels of the LoRA steps")
    ap.add_argument("--tiles", nargs="*", default=[],
                    help="kernel tile shapes, e.g. fp8=64,64,4 nvfp4=64,64,4 (rows, columns, warps)")
    a = ap.parse_args()
    from ringswap.lora import kernels
    for t in a.tiles:
        kind, cfg = t.split("=")
        kernels.TILES[kind] = tuple(int(x) for x in cfg.split(","))
    print(f"fused kernel tiles: {kernels.TILES}", flush=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import quant_files as qf   # tests/comfyui/support, on sys.path through common.py
    model_file.install_nvfp4_fallback(qf)
    template = model_file.wan_template(a.blocks, a.dim, a.ffn)
    lora = rank_lora(a.blocks, a.dim, a.ffn, a.rank)
    rows = []
    for fmt in a.formats:
        if gguf_model.is_gguf_format(fmt):   # RingSwap Model Loader reads it through ComfyUI-GGUF's loader
            gguf_model.load_pack()
            path = gguf_model.wan14b_gguf(a.dir, fmt, False, shape=(a.blocks, a.dim, a.ffn))
        else:
            path = os.path.join(a.dir, f"fold_{fmt}.safetensors")
            model_file.write_model(path, fmt, SimpleNamespace(layers=a.blocks, dim=a.dim, ffn=a.ffn, seed=0), dev,
                                   qf, template, 0)
        base = load_swapped_model(path, SwapSettings(1, 1, "auto"), home="ram", disk_workers=4)
        dtype = common.compute_dtype(base, dev)
        inputs = common.make_inputs(a.tokens, dev, dtype, 512, 0)
        plain_s, _ = run(base, inputs, a.steps)
        mm.unload_all_models()
        patched = comfy.sd.load_lora_for_models(base, None, lora, 1.0, 0)[0]
        lora_s, st = run(patched, inputs, a.steps, a.profile)
        mm.unload_all_models()
        fold_ms = 1e3 * st.fold_s_per_block
        block_ms = 1e3 * plain_s / a.blocks
        rows.append((fmt, block_ms, fold_ms, 100 * fold_ms / block_ms, plain_s, lora_s))
        each = sorted(1e3 * t for t in st.land_times)
        if each:
            print(f"{fmt}: fold per landing (ms): median {each[len(each) // 2]:.2f}, min {each[0]:.2f}, "
                  f"max {each[-1]:.2f} over {len(each)} landings", flush=True)
        print(f"{fmt}: block compute {block_ms:.1f} ms, fold {fold_ms:.2f} ms per block "
              f"({100 * fold_ms / block_ms:.1f}%); step {plain_s:.3f} s -> {lora_s:.3f} s with LoRA; {st.line()}",
              flush=True)
        os.remove(path)
        del base, patched
    print(f"\n| base | block compute (ms, {a.tokens} tokens) | rank-{a.rank} fold span per block (ms) | fold / compute |"
          " step without / with LoRA (s) | with / without |")
    print("| --- | --- | --- | --- | --- | --- |")
    for fmt, b, f, pct, p, l in rows:
        print(f"| {fmt} | {b:.1f} | {f:.2f} | {pct:.1f}% | {p:.3f} / {l:.3f} | {l / p:.3f} "
              f"{'PASS' if l <= 1.03 * p else 'FAIL'} |")


if __name__ == "__main__":
    main()
