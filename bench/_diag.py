"""Temporary (not committed): is a home=ram nvfp4 step at 4,096 tokens bound by the CPU
(enqueue time ~ wall) or the GPU; kernel time per step streamed vs all resident."""
import os, sys, time
from types import SimpleNamespace
import torch
HERE = os.path.dirname(os.path.abspath(__file__)); sys.path.insert(0, HERE)
import stream as S
cuda = torch.cuda.is_available()
if not cuda:
    from comfy.cli_args import args; args.cpu = True
import comfy.model_management as mm
from ringswap.loaders.model_loader import load_swapped_model
from ringswap.loaders.swap_patcher import SwapSettings, SwapModelPatcher
layers, dim, ffn, tokens = (40, 5120, 13824, 4096) if cuda else (6, 256, 512, 64)
fmts = sys.argv[1:] or ["nvfp4"]
dev = torch.device("cuda" if cuda else "cpu")
import quant_files as qf
S._install_nvfp4_fallback(qf)
template = S.wan_template(layers, dim, ffn)
def sync():
    if cuda: torch.cuda.synchronize()
def measure(p, label):
    mm.load_models_gpu([p])
    dm = p.model.diffusion_model
    inputs = S.make_inputs(tokens, dev, S.compute_dtype(p, dev), 512 if cuda else 16, 0)
    with torch.no_grad():
        for _ in range(2): dm(*inputs)
        sync()
        enq, wall = [], []
        for _ in range(3):
            sync(); t0 = time.perf_counter(); dm(*inputs); t1 = time.perf_counter(); sync(); t2 = time.perf_counter()
            enq.append(t1 - t0); wall.append(t2 - t0)
        prof = None
        if cuda:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                dm(*inputs); sync()
            ev = [e for e in prof.key_averages()]
            kern = sum(e.self_device_time_total for e in ev if "Memcpy" not in e.key) / 1e3
            memcpy = sum(e.self_device_time_total for e in ev if "Memcpy" in e.key) / 1e3
            for e in sorted(ev, key=lambda e: -e.self_device_time_total)[:22]:
                print(f"   {label[:14]} {e.self_device_time_total / 1e3:8.2f} ms {e.count:5d}x  {e.key[:110]}")
        else:
            kern = memcpy = 0.0
    p.swap_engine.end_run()
    print(f"{label}: wall {min(wall)*1e3:.1f} ms/step, CPU enqueue {min(enq)*1e3:.1f} ms, "
          f"GPU kernels {kern:.1f} ms, memcpy {memcpy:.1f} ms", flush=True)
    mm.unload_all_models()
for fmt in fmts:
    path = f"/tmp/diag_{fmt}.safetensors"
    S.write_model(path, fmt, SimpleNamespace(layers=layers, dim=dim, ffn=ffn, seed=0), dev, qf, template, 0)
    p = load_swapped_model(path, SwapSettings(4, 1, "auto"), home="ram", disk_workers=4)
    measure(p, f"{fmt} streamed (window 4)")
    full = SwapModelPatcher.wrap(p, SwapSettings(layers, 0, "auto"))
    measure(full, f"{fmt} all resident")
    del full
    p.swap_engine.release_home(); mm.unload_all_models(); del p
    os.remove(path)
