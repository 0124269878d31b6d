"""Is a home=ram step bound by the host or the GPU, and what do streaming's copies cost the
kernels? For each format: a Wan-14B-shaped file (40 blocks, 4,096 tokens on CUDA), one
step streamed (window 4, prefetch 1) and one with every block resident; prints wall time,
host enqueue time (until the forward returns, before synchronising), device kernel time
and copy time per step (torch.profiler), and the top kernels of each.
Usage: python bench/probes/step_profile.py [nvfp4 scaled_fp8 bf16 ...]   (CPU: a tiny model)
"""
import os
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (sets up ComfyUI on sys.path)
import model_file  # noqa: E402

CUDA = torch.cuda.is_available()
if not CUDA:
    from comfy.cli_args import args
    args.cpu = True
import comfy.model_management as mm  # noqa: E402

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model  # noqa: E402
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings  # noqa: E402

LAYERS, DIM, FFN, TOKENS, CTX = (40, 5120, 13824, 4096, 512) if CUDA else (6, 256, 512, 64, 16)
DEV = torch.device("cuda" if CUDA else "cpu")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def measure(patcher, label: str, top: int = 22) -> None:
    mm.load_models_gpu([patcher])
    dm = patcher.model.diffusion_model
    inputs = common.make_inputs(TOKENS, DEV, common.compute_dtype(patcher, DEV), CTX, 0)
    enqueue, wall = [], []
    kernels = copies = 0.0
    with torch.no_grad():
        for _ in range(2):
            dm(*inputs)
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            dm(*inputs)
            t1 = time.perf_counter()
            sync()
            enqueue.append(t1 - t0)
            wall.append(time.perf_counter() - t0)
        if CUDA:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                dm(*inputs)
                sync()
            events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
            kernels = sum(e.self_device_time_total for e in events if "Memcpy" not in e.key) / 1e3
            copies = sum(e.self_device_time_total for e in events if "Memcpy" in e.key) / 1e3
            for e in events[:top]:
                print(f"   {label[:14]} {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:110]}")
    patcher.swap_engine.end_run()
    print(f"{label}: wall {min(wall) * 1e3:.1f} ms/step, host enqueue {min(enqueue) * 1e3:.1f} ms, "
          f"device kernels {kernels:.1f} ms, copies {copies:.1f} ms", flush=True)
    mm.unload_all_models()


def main() -> None:
    import quant_files as qf   # tests/comfyui/support, on sys.path through common.py
    model_file.install_nvfp4_fallback(qf)
    template = model_file.wan_template(LAYERS, DIM, FFN)
    for fmt in sys.argv[1:] or ["nvfp4"]:
        path = os.path.join("/tmp", f"step_profile_{fmt}.safetensors")
        model_file.write_model(path, fmt, SimpleNamespace(layers=LAYERS, dim=DIM, ffn=FFN, seed=0), DEV, qf, template, 0)
        patcher = load_swapped_model(path, SwapSettings(4, 1, "auto"), home="ram", disk_workers=4)
        measure(patcher, f"{fmt} streamed (window 4)")
        measure(SwapModelPatcher.wrap(patcher, SwapSettings(LAYERS, 0, "auto")), f"{fmt} all resident")
        patcher.swap_engine.release_home()
        mm.unload_all_models()
        os.remove(path)


if __name__ == "__main__":
    main()
