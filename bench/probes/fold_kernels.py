"""Time lora/kernels.py's fused folds per Wan-14B block (10 Linears, rank-64 bf16 LoRA) for
several tile shapes, first landing (two passes) and later ones (the kept amax), and check
each fp8 type against the op-by-op fold (mismatch counts); GGUF Q8_0's and K-quants' dense folds
(lora/gguf_kernels.py) beside the ops they replace (the pack's dequantize, to bf16, addmm_), the
pack's dequantize alone and the kernels without pairs. Imports no ComfyUI module (the pack's
dequant.py is read from ComfyUI's custom_nodes where linked). Usage: python bench/probes/fold_kernels.py [--reps 5]"""
import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (the repo as `ringswap` on sys.path)
from ringswap.lora import gguf_kernels as G  # noqa: E402
from ringswap.lora import kernels as K  # noqa: E402
from gguf_files import HALF_FIELDS  # noqa: E402  (tests/comfyui/support)

DEV = torch.device("cuda")
SHAPES = [(5120, 5120)] * 8 + [(13824, 5120), (5120, 13824)]
CONFIGS = {"fp8": [(64, 64, 4), (64, 128, 4), (128, 128, 4), (128, 64, 4), (32, 64, 4)],
           "nvfp4": [(64, 64, 4), (128, 32, 4), (32, 64, 4), (64, 32, 4), (128, 64, 4)],
           "q8_0": [(128, 128, 8), (64, 128, 4), (64, 256, 8), (128, 64, 4), (32, 128, 4), (64, 64, 4)],
           "q4_k": [(64, 128, 4), (64, 256, 8), (32, 256, 4), (128, 128, 4), (64, 256, 4), (128, 64, 4),
                    (32, 128, 4), (64, 64, 4), (128, 256, 8), (16, 256, 4)],
           "q5_k": [(64, 128, 4), (64, 256, 8), (32, 256, 4), (128, 128, 4)],
           "q6_k": [(64, 128, 4), (64, 256, 8), (32, 256, 4), (128, 128, 4)]}


def lora(m, n, g):
    return [((torch.randn(m, 64, device=DEV, generator=g) * .05).bfloat16(),
             (torch.randn(64, n, device=DEV, generator=g) * .05).bfloat16(), 0.7)]


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def device_ms(fn, reps):
    """Kernel time on the device per call of `fn` (torch.profiler's CUDA events), apart from the
    host's launch time, which bounds the wall time of the smaller kernels."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages())
    return total / 1e3 / reps


def check_fp8(qdtype, g):
    m = n = 5120
    w0 = torch.randn(m, n, device=DEV, generator=g) * 0.03
    fmax = torch.finfo(qdtype).max
    s = (w0.abs().amax() / fmax).reshape(())
    q = (w0 / s).to(qdtype)
    pairs = lora(m, n, g)
    want = q.float() * s
    want.addmm_(pairs[0][0].float(), pairs[0][1].float(), alpha=pairs[0][2])
    ws = (want.abs().amax() / fmax).clamp_min(1e-12)
    x = want / ws
    wq = x.clamp(-fmax, fmax).to(qdtype)
    gq, gs = q.clone(), s.clone()
    assert K.fold_fp8_(gq, gs, K.Pairs(pairs, DEV), 1e-12)
    gf, wf = gq.float(), wq.float()
    bad = (gf - wf).abs() > (wf.abs() * torch.finfo(qdtype).eps
                             + torch.finfo(qdtype).smallest_normal * torch.finfo(qdtype).eps)
    print(f"{qdtype}: scale {gs.item():.6e} vs {ws.item():.6e}; differing codes {(gf != wf).sum().item()}, "
          f"more than one step {bad.sum().item()}, nan {gf.isnan().sum().item()}, inf {gf.isinf().sum().item()}")
    for i, j in bad.nonzero()[:6].tolist():
        print(f"   [{i},{j}] w/scale {x[i, j].item():.6f}: kernel {gf[i, j].item()}, torch {wf[i, j].item()}")


def pack_dequant():
    """ComfyUI-GGUF's dequant module from ComfyUI's custom_nodes, or None where not linked."""
    path = os.path.join(common.COMFY, "custom_nodes", "ComfyUI-GGUF", "dequant.py")
    if not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("gguf_pack_dequant", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gguf_ops(weights, reps):
    """What the GGUF dense folds do without their kernels, the pack's dequantize alone (what a
    block's forward pays without a LoRA) and the kernels without pairs, per Wan-14B block."""
    dq = pack_dequant()
    if dq is None:
        print("no ComfyUI-GGUF in custom_nodes: the pack's ops not timed", flush=True)
        return
    import gguf
    for kind in ("Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        qt = getattr(gguf.GGMLQuantizationType, kind)

        def dequant(wt):
            blocks, shape = wt[kind.lower()][:2]
            return dq.dequantize(blocks, qt, shape).to(torch.bfloat16)

        def ops():
            for wt in weights:
                (up, down, scale), = wt["lora"]
                dequant(wt).addmm_(up, down, alpha=scale)
        print(f"{kind} op by op (the pack's dequantize, to bf16, addmm_): {timed(ops, reps):.2f} ms per block; "
              f"the pack's dequantize alone: {timed(lambda: [dequant(wt) for wt in weights], reps):.2f} ms; "
              f"the kernel without pairs: {timed(lambda: [G.dense(kind, *wt[kind.lower()], None) for wt in weights], reps):.2f} ms",
              flush=True)


K_QUANTS = ("q4_k", "q5_k", "q6_k")


def k_quant_bytes(kind, m, n, g):
    """Random K-quant bytes of an [m, n] weight with small finite fp16 fields (d, dmin)."""
    nbytes = G.ROW_BYTES[kind.upper()][1]
    blocks = torch.randint(0, 256, (m * n // 256, nbytes), device=DEV, generator=g, dtype=torch.uint8)
    for at in HALF_FIELDS[kind.upper()]:
        blocks[:, at:at + 2] = (torch.rand(blocks.shape[0], 1, device=DEV, generator=g) * 5e-4).half().view(torch.uint8)
    return blocks.reshape(m, -1)


def make_weights(g: torch.Generator) -> list[dict]:
    """The 10 Linears of a Wan-14B block in every format timed (Q8_0, the K-quants, fp8, nvfp4),
    each with a rank-64 LoRA."""
    weights = []
    for m, n in SHAPES:
        w = torch.randn(m, n, device=DEV, generator=g) * 0.03
        s = (w.abs().amax() / 448.0).reshape(())
        nv_scale = (w.abs().amax() / 2688.0).reshape(())
        from comfy_kitchen.registry import registry
        from comfy_kitchen.tensor import QuantizedTensor
        with registry.use_backend("eager"):
            nv = QuantizedTensor.from_float(w, "TensorCoreNVFP4Layout", scale=nv_scale)
        d = (w.reshape(-1, 32).abs().amax(1, keepdim=True) / 127).half()
        q8 = torch.cat([d.view(torch.uint8), (w.reshape(-1, 32) / d).round().to(torch.int8).view(torch.uint8)], 1)
        weights.append({"q8_0": (q8.reshape(m, -1), (m, n), torch.bfloat16, torch.float16),
                        **{k: (k_quant_bytes(k, m, n, g), (m, n), torch.bfloat16, torch.float16) for k in K_QUANTS},
                        "fp8": ((w / s).to(torch.float8_e4m3fn), s.clone()),
                        "nvfp4": (nv._qdata, nv._params.scale.float().clone(), nv._params.block_scale),
                        "lora": lora(m, n, g)})
        del w
    return weights


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                    help="the kernels whose tiles are timed (the GGUF ones also without pairs)")
    a = ap.parse_args()
    g = torch.Generator(device=DEV).manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    for qdtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        check_fp8(qdtype, g)
    weights = make_weights(g)
    best = {}
    for kind, configs in ((k, CONFIGS[k]) for k in a.kinds):
        for cfg in configs + [cfg + ("br32",) for cfg in configs[:1]]:
            K.TILES[kind] = cfg[:3]
            for wt in weights:   # ranks per dot: K.WIDE_BR, or 32 for the "br32" row
                K.WIDE_BR = 32 if cfg[3:] else 64
                wt["pairs"] = K.Pairs(wt["lora"], DEV)

            def block(first=False):
                for wt in weights:
                    if first:   # as the first landing: both passes (later ones keep its amax)
                        wt["pairs"].amax_kept = False
                    if kind == "q8_0" or kind in K_QUANTS:
                        assert G.dense(kind.upper(), *wt[kind], wt["pairs"]) is not None
                    elif kind == "fp8":
                        assert K.fold_fp8_(*wt["fp8"], wt["pairs"], 1e-12)
                    else:
                        assert K.fold_nvfp4_(*wt["nvfp4"], wt["pairs"], 2688.0, 1e-12)
            try:
                first = timed(lambda: block(True), a.reps)
                ms = timed(block, a.reps)
                bare = ""
                if kind == "q8_0" or kind in K_QUANTS:   # the pairs' share on the device: the tile without them
                    on = device_ms(block, a.reps)
                    alone = device_ms(lambda: [G.dense(kind.upper(), *wt[kind], None) for wt in weights], a.reps)
                    bare = f"; on the device {on:.2f} ms, without pairs {alone:.2f} ms: the pairs add {on - alone:.2f} ms"
                print(f"{kind} tile {cfg}: {ms:.2f} ms per Wan-14B block landing again "
                      f"({first:.2f} ms the first time){bare}", flush=True)
                if not cfg[3:] and (kind not in best or ms < best[kind][0]):
                    best[kind] = (ms, cfg)
            except Exception as e:   # noqa: BLE001
                print(f"{kind} tile {cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                K._FAILED.clear()
    K.WIDE_BR = 64
    gguf_ops(weights, a.reps)
    print("BEST " + " ".join(f"{k}={','.join(map(str, c))}" for k, (_, c) in best.items()), flush=True)


if __name__ == "__main__":
    main()
