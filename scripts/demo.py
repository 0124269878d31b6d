#!/usr/bin/env python
"""`make demo`: run a tiny random Wan model through RingSwap inside a real ComfyUI.

Writes a small random Wan 2.1 model (dim 256, 8 blocks) into a temporary
models/diffusion_models folder, starts ComfyUI (CUDA if available, else --cpu) as a
subprocess, queues UNETLoader -> RingSwapPatch -> KSampler -> SaveLatent, waits for it,
prints the engine's "RingSwap run:" log line(s) and the output latent path.

Environment: RINGSWAP_COMFYUI_DIR (default: <repo>/.comfyui).
Options: --no-patch runs the same graph without the RingSwap node (stock baseline).
Exit status 0 only if everything worked.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Import the helpers as top-level "support" (tests/ is not a package, and ComfyUI's own
# folder has a "tests" package that would shadow "tests.support").
sys.path.insert(0, os.path.join(REPO, "tests", "comfyui"))

RUN_MARK = "RingSwap run:"


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--comfyui", default=os.environ.get("RINGSWAP_COMFYUI_DIR")
                    or os.path.join(REPO, ".comfyui"))
    ap.add_argument("--no-patch", action="store_true",
                    help="run without the RingSwapPatch node (stock ComfyUI baseline)")
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cpu", action="store_true", help="force --cpu even if CUDA exists")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--keep", action="store_true", help="keep the temp folders")
    return ap.parse_args(argv)


def report(srv, entry, use_patch: bool) -> bool:
    """Print the run lines and copy the output latents to ./out; False where the run did
    not write a latent or (with the patch) did not log RingSwap's run line."""
    latents = [p for p in srv.output_files(entry, "latents") if os.path.isfile(p)]
    lines = [ln for ln in srv.log_text().splitlines() if RUN_MARK in ln]
    for ln in lines:
        print(ln)
    if not latents:
        print("demo: FAILED: no latent file was written", file=sys.stderr)
        return False
    if use_patch and not lines:
        print(f"demo: FAILED: no '{RUN_MARK}' line in the server log; tail:\n"
              + srv.log_tail(), file=sys.stderr)
        return False
    out_dir = os.path.join(REPO, "out")
    os.makedirs(out_dir, exist_ok=True)
    for p in latents:
        kept = shutil.copy(p, os.path.join(out_dir, os.path.basename(p)))
        print(f"demo: output latent {kept} ({os.path.getsize(kept)} bytes)")
    return True


def main(argv=None) -> int:
    a = parse_args(argv)
    use_patch = not a.no_patch

    comfy_dir = os.path.abspath(a.comfyui)
    if not os.path.isfile(os.path.join(comfy_dir, "main.py")):
        print(f"demo: no ComfyUI at {comfy_dir} (set RINGSWAP_COMFYUI_DIR or run "
              f"`make env`)", file=sys.stderr)
        return 2
    import torch
    from support.comfy_server import ComfyServer, ComfyServerError
    from support.workflows import build_workflow
    sys.path.append(comfy_dir)  # for comfy.* (after ours: ComfyUI has a "tests" package)
    from support.wan_files import write_tiny_wan

    cuda = torch.cuda.is_available() and not a.cpu
    models = tempfile.mkdtemp(prefix="ringswap_demo_models_")
    ok = False
    t0 = time.perf_counter()
    try:
        unet_name = "ringswap_demo_wan_tiny.safetensors"
        info = write_tiny_wan(os.path.join(models, "diffusion_models", unet_name),
                              dim=256, num_layers=8, ffn_dim=512, seed=a.seed)
        print(f"demo: wrote random Wan model {info['path']} ({info['blocks']} blocks, "
              f"dim {info['dim']}, {info['bytes'] / 2**20:.1f} MiB)")
        wf = build_workflow(unet_name, use_patch=use_patch, window=a.window,
                            prefetch=a.prefetch, seed=a.seed, steps=a.steps)
        with ComfyServer(comfy_dir, models, cpu=not cuda, keep_workdir=a.keep) as srv:
            print(f"demo: ComfyUI up on {srv.url} ({'CUDA' if cuda else 'CPU'}) "
                  f"in {srv.startup_s:.1f}s; log {srv.log_path}")
            if use_patch and "RingSwapPatch" not in srv.object_info():
                print("demo: ComfyUI has no RingSwapPatch node: the pack failed to load. "
                      "Log tail:\n" + srv.log_tail(), file=sys.stderr)
                return 1
            t1 = time.perf_counter()
            try:
                entry = srv.run(wf, timeout=a.timeout)
            except (ComfyServerError, TimeoutError) as e:
                print(f"demo: FAILED: {e}", file=sys.stderr)
                return 1
            run_s = time.perf_counter() - t1
            if not report(srv, entry, use_patch):
                return 1
            if a.keep:
                print(f"demo: server folder kept: {srv.workdir}")
            print(f"demo: OK: sampling {run_s:.1f}s, total {time.perf_counter() - t0:.1f}s"
                  + ("" if use_patch else " (without RingSwapPatch)"))
            ok = True
    except ComfyServerError as e:
        print(f"demo: FAILED: {e}", file=sys.stderr)
    finally:
        if a.keep:
            print(f"demo: models folder kept: {models}")
        else:
            shutil.rmtree(models, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
