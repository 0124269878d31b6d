"""Byte-plane coding (swap/plane_coder.py) of one Wan-14B block on the GPU: ratio, link and decode.

One block of each format (bf16 and fp16 weights N(0, 0.02) as in the bench files; fp8 e4m3 of
the same, scaled per tensor; random bytes for nvfp4's packed codes) coded as the engine codes a
RAM home (32 MiB parts; bf16/fp16: the high-byte plane coded by nvCOMP's ANS, the low plane raw;
one-byte formats: parts coded whole), and bf16/fp16 once more with ANS's 16-bit float mode on
whole parts (`/f2` rows, no re-interleave); `fp16-of-bf16` is a bf16 file's weights cast to fp16,
as ComfyUI holds Wan 2.1 (it computes it in fp16), coded narrowed back to bf16 where exact (as the
engine does); `/torch-join` rows re-interleave with torch instead of the fused kernel. Per row: the ratio, pinned copies of the raw and the
coded block, copy + decode one after the other, the engine's pipelined decode (a ring of 2 or 4
part rooms) alone and beside a bf16 matmul loop (the GPU time it takes from compute), and
exactness; for planes also the re-interleave alone, three ways. Rows may set ANS's chunk size and
the part size (`/c16`, `/p64`: see --formats). Needs nvCOMP (`.whl-nvcomp`).

    python3 bench/probes/plane_probe.py [--params 351e6] [--repeat 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402

WAN_BLOCK_PARAMS = 351e6


def pack_without_comfyui():
    """This repo as the package `ringswap` where no ComfyUI tree links it (a machine with only
    torch and nvCOMP)."""
    if "ringswap" not in sys.modules:
        try:
            import ringswap  # noqa: F401  (linked in ComfyUI's custom_nodes)
        except ImportError:
            spec = importlib.util.spec_from_file_location("ringswap", os.path.join(common.REPO, "__init__.py"),
                                                          submodule_search_locations=[common.REPO])
            pack = importlib.util.module_from_spec(spec)
            sys.modules["ringswap"] = pack
            spec.loader.exec_module(pack)
    return sys.modules["ringswap"]


def block_bytes(fmt: str, params: int, dev: torch.device) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(params, generator=g, device=dev) * 0.02
    if fmt in ("bf16", "fp16"):
        return w.to(torch.bfloat16 if fmt == "bf16" else torch.float16).view(torch.uint8)
    if fmt == "fp16-of-bf16":   # a bf16 file's weights as ComfyUI holds Wan: cast to fp16
        return w.to(torch.bfloat16).to(torch.float16).view(torch.uint8)
    if fmt == "fp8":
        return (w / (w.abs().amax() / 448.0)).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.randint(0, 256, (params // 2,), dtype=torch.uint8, device=dev, generator=g)   # nvfp4 codes


def timed(fn, stream: torch.cuda.Stream, repeat: int) -> float:
    """Mean seconds of `fn()` on `stream`, by events, after one warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(repeat):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / repeat


def probe(fmt: str, params: int, repeat: int, dev: torch.device, words: bool = False,
          chunk_kib: int | None = None, part_mib: int | None = None, latency: bool = False) -> dict:
    """One block of `fmt` through the engine's coding path (`words`: ANS's 16-bit float mode on
    whole parts instead of planes; `chunk_kib`: ANS's chunk size; `part_mib`: the part size;
    `latency`: nvCOMP's execution policy for latency instead of concurrency with other work)."""
    pack_without_comfyui()
    from ringswap.swap.plane_coder import PART_BYTES, AnsPlanes, decode_block, encode_block, nvcomp_module
    flat = block_bytes(fmt, params, dev)
    options = {"uncomp_chunk_size": chunk_kib << 10} if chunk_kib else {}
    if latency:
        options["execution_policy"] = nvcomp_module().ExecutionPolicy.LATENCY
    coder = AnsPlanes(dev, data_type="<f2" if words else "|u1", **options)
    t0 = time.perf_counter()
    sixteen = fmt in ("bf16", "fp16", "fp16-of-bf16") and not words
    block = encode_block(coder, flat, part_mib << 20 if part_mib else PART_BYTES, planes=sixteen,
                         fp16=sixteen and fmt != "bf16")
    out = {"format": fmt, "bytes": flat.numel(), "coded_bytes": block.coded_bytes,
           "ratio": block.coded_bytes / flat.numel(), "parts": len(block.parts), "encode_s": time.perf_counter() - t0}
    block.home.pin()
    raw_host = flat.cpu().pin_memory()
    slot = torch.zeros_like(flat)
    stream = coder.stream
    out["copy_raw_s"] = timed(lambda: slot.copy_(raw_host, non_blocking=True), torch.cuda.current_stream(dev), repeat)
    landed = torch.empty(block.coded_bytes, dtype=torch.uint8, device=dev)

    def copy_coded():
        with torch.cuda.stream(stream):
            landed.copy_(block.home.flat, non_blocking=True)
    out["copy_coded_s"] = timed(copy_coded, stream, repeat)
    scratch = torch.empty(block.scratch_bytes(), dtype=torch.uint8, device=dev)
    slot.zero_()

    def serial():
        with torch.cuda.stream(stream):
            decode_block(coder, block, scratch, slot)
    out["copy_then_decode_s"] = timed(serial, stream, repeat)
    out["decode_only_s"] = max(0.0, out["copy_then_decode_s"] - out["copy_coded_s"])
    stream.synchronize()
    exact = torch.equal(slot, flat)
    for rooms in (2, 4):
        slot.zero_()
        out.update({f"{k}_rooms{rooms}": v for k, v in pipelined(coder, block, slot, dev, repeat, rooms).items()})
        exact = exact and torch.equal(slot, flat)
    out["bit_exact"] = bool(exact)
    if block.planes:
        out.update(join_variants(block.nbytes // 2, dev, repeat))
    block.home.unpin()
    return out


def pipelined(coder, block, slot: torch.Tensor, dev: torch.device, repeat: int, rooms: int) -> dict:
    """The engine's way (copies on a copy stream into `rooms` part rooms, decodes on the coder's
    stream): `repeat` blocks alone, a bf16 matmul loop alone, and both at once (wall clock)."""
    from ringswap.swap.plane_coder import decode_block
    copy_stream, stream = torch.cuda.Stream(dev), coder.stream
    scratch = torch.empty(rooms * block.scratch_bytes(), dtype=torch.uint8, device=dev)
    freed: list = [None] * rooms
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def decodes():
        with torch.cuda.stream(stream):
            for _ in range(repeat):
                decode_block(coder, block, scratch, slot, copy_stream, None, freed)

    def matmuls():
        for _ in range(12 * repeat):
            a @ a

    def wall(*work) -> float:
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for w in work:
            w()
        torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    wall(decodes, matmuls)   # warm-up
    alone, compute_s = wall(decodes) / repeat, wall(matmuls) / repeat
    both = wall(decodes, matmuls) / repeat
    return {"pipelined_s": alone, "compute_s": compute_s, "both_s": both,
            "decode_cost_under_compute_s": max(0.0, both - compute_s)}


def join_variants(n: int, dev: torch.device, repeat: int) -> dict:
    """Seconds to re-interleave `n` high and low bytes into words: two strided copies (join_planes),
    one torch.stack, and the fused kernel (swap/plane_join.py) storing whole 16-bit words; and
    widened (bf16 words written as fp16) by torch and by the kernel."""
    from ringswap.swap import plane_join
    from ringswap.swap.plane_join import join_planes
    high, low = (torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev) for _ in range(2))
    out = torch.empty(2 * n, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    res = {"join_copies_s": timed(lambda: join_planes(high, low, out), stream, repeat),
           "join_stack_s": timed(lambda: torch.stack((low, high), dim=1, out=out.view(-1, 2)), stream, repeat)}
    ref = out.clone()
    if not plane_join._usable(dev):
        return {**res, "join_fused_s": "the fused join cannot run here"}
    out.zero_()
    res["join_fused_s"] = timed(lambda: plane_join._launch(high, low, out, False), stream, repeat)
    res["join_fused_exact"] = bool(torch.equal(out, ref))
    res["join_torch_widen_s"] = timed(lambda: plane_join._torch_join(high, low, out, True), stream, repeat)
    res["join_fused_widen_s"] = timed(lambda: plane_join._launch(high, low, out, True), stream, repeat)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=WAN_BLOCK_PARAMS)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--formats", nargs="+",
                    default=["bf16", "bf16/torch-join", "fp16-of-bf16", "fp16-of-bf16/torch-join", "bf16/f2", "fp16",
                             "fp16/f2", "fp8", "nvfp4"],
                    help="a format, then options after slashes: torch-join, f2 (16-bit float mode), cN (ANS "
                         "chunks of N KiB), pN (parts of N MiB), lat (nvCOMP's latency policy); e.g. "
                         "fp16-of-bf16/c16/p64")
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for fmt in a.formats:
        os.environ["RINGSWAP_FUSED_KERNELS"] = "0" if "/torch-join" in fmt else "1"
        try:
            base, *opts = fmt.split("/")
            sizes = {o[0]: int(o[1:]) for o in opts if o[:1] in ("c", "p") and o[1:].isdigit()}
            row = probe(base, int(a.params), a.repeat, dev, words="f2" in opts,
                        chunk_kib=sizes.get("c"), part_mib=sizes.get("p"), latency="lat" in opts)
            row["format"] = fmt
        except Exception as e:   # noqa: BLE001  (an API mismatch is the finding: report it, go on)
            row = {"format": fmt, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        common.say(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    common.write_json(a.json, {"rows": rows, "env": common.env_info(dev)})


if __name__ == "__main__":
    main()
