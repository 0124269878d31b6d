"""Byte-plane coding (swap/plane_codec.py) of one Wan-14B block on the GPU: ratio, link and decode.

One block of each format (bf16 and fp16 weights N(0, 0.02) as in the bench files; fp8 e4m3 of
the same, scaled per tensor; random bytes for nvfp4's packed codes), coded as the engine codes
a RAM home (swap/plane_codec.py: 64 MiB parts; bf16/fp16: the high-byte plane of each part coded
with nvCOMP's ANS, the low plane raw; one-byte formats: each part coded whole; the engine keeps
a block raw above 0.9), then: the ratio, a
pinned host-to-device copy of the raw block and of the coded one, the copy and decode into a
slot (events on the coder's stream), and whether the result is the block bit for bit. Needs nvCOMP: carry `.whl-nvcomp` (scripts/prepare_nvcomp_wheels.sh) and
install it with `pip install --no-deps --target /tmp/nvc .whl-nvcomp/*.whl`, PYTHONPATH=/tmp/nvc.

    python3 bench/plane_probe.py [--params 351e6] [--repeat 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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


def probe(fmt: str, params: int, repeat: int, dev: torch.device) -> dict:
    """One block of `fmt` through the engine's own coding path (swap/plane_codec: parts, planes,
    ANS): ratio, encode time, pinned copies raw and coded, copy + decode into a slot, exactness."""
    pack_without_comfyui()
    from ringswap.swap.plane_codec import AnsPlanes, decode_block, encode_block
    flat = block_bytes(fmt, params, dev)
    planes = AnsPlanes(dev)
    t0 = time.perf_counter()
    block = encode_block(planes, flat, planes=fmt in ("bf16", "fp16"))   # one-byte formats: coded whole
    out = {"format": fmt, "bytes": flat.numel(), "coded_bytes": block.coded_bytes,
           "ratio": block.coded_bytes / flat.numel(), "parts": len(block.parts),
           "coded_share": sum(c for *_, c in block.parts) / (flat.numel() // (2 if block.planes else 1)),
           "encode_s": time.perf_counter() - t0}
    block.home.pin()
    raw_host = flat.cpu().pin_memory()
    slot = torch.zeros_like(flat)
    stream = planes.stream
    out["copy_raw_s"] = timed(lambda: slot.copy_(raw_host, non_blocking=True), torch.cuda.current_stream(dev), repeat)
    landed = torch.empty(block.coded_bytes, dtype=torch.uint8, device=dev)

    def copy_coded():
        with torch.cuda.stream(stream):
            landed.copy_(block.home.flat, non_blocking=True)
    out["copy_coded_s"] = timed(copy_coded, stream, repeat)
    scratch = torch.empty(block.scratch_bytes(), dtype=torch.uint8, device=dev)
    slot.zero_()

    def copy_and_decode():
        with torch.cuda.stream(stream):
            decode_block(planes, block, scratch, slot)
    out["copy_and_decode_s"] = timed(copy_and_decode, stream, repeat)
    out["decode_only_s"] = max(0.0, out["copy_and_decode_s"] - out["copy_coded_s"])
    stream.synchronize()
    out["bit_exact"] = bool(torch.equal(slot, flat))
    out.update(pipelined(planes, block, slot, dev, repeat))
    if block.planes:
        out.update(join_variants(block.nbytes // 2, dev, repeat))
    out["bit_exact"] = out["bit_exact"] and bool(torch.equal(slot, flat))
    block.home.unpin()
    return out


def pipelined(planes, block, slot: torch.Tensor, dev: torch.device, repeat: int) -> dict:
    """The engine's way (copies on a copy stream into two scratch halves, decodes on the coder's
    stream): `repeat` blocks alone, a bf16 matmul loop alone, and both at once (wall by events):
    whether the decode hides under compute or takes its SMs."""
    from ringswap.swap.plane_codec import decode_block
    copy_stream, stream, compute = torch.cuda.Stream(dev), planes.stream, torch.cuda.current_stream(dev)
    scratch = torch.empty(2 * block.scratch_bytes(), dtype=torch.uint8, device=dev)
    freed: list = [None, None]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def decodes():
        with torch.cuda.stream(stream):
            for _ in range(repeat):
                decode_block(planes, block, scratch, slot, copy_stream, None, freed)

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
    t0 = time.perf_counter()
    matmuls()
    decodes()   # behind a busy GPU: a host that waits here means a sync in the decode path
    enqueue_s = (time.perf_counter() - t0) / repeat
    torch.cuda.synchronize(dev)
    return {"pipelined_s": alone, "compute_s": compute_s, "both_s": both,
            "decode_cost_under_compute_s": max(0.0, both - compute_s), "enqueue_s": enqueue_s,
            **host_waits(planes, block, scratch, slot, matmuls, dev)}



def busy_stream_waits(planes, block, dev: torch.device) -> dict:
    """Host seconds of each call a part's decode makes while the coder's own stream is busy
    (matmuls queued on it): a call that synchronizes that stream shows their time here."""
    from ringswap.swap.plane_codec import aligned, decode_block, join_planes
    nv, codec, stream = planes.nvcomp, planes.codec, planes.stream
    off, size, pos, c = block.parts[0]
    half = size // 2
    coded = torch.empty(c, dtype=torch.uint8, device=dev)
    coded.copy_(block.home.flat[pos:pos + c])
    high, low = (torch.empty(half, dtype=torch.uint8, device=dev) for _ in range(2))
    out = torch.empty(size, dtype=torch.uint8, device=dev)
    cfg = planes._config(half)[1]
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    arr_s, arr = nv.as_array(coded, cuda_stream=stream.cuda_stream), nv.as_array(coded)
    calls = {"as_array_stream": lambda: nv.as_array(coded, cuda_stream=stream.cuda_stream),
             "as_array": lambda: nv.as_array(coded),
             "decode_array_stream": lambda: codec.decode(arr_s, out=high, decompression_config=cfg),
             "decode_array": lambda: codec.decode(arr, out=high, decompression_config=cfg),
             "decode_out_array": lambda: codec.decode(arr_s, out=nv.as_array(high, cuda_stream=stream.cuda_stream),
                                                      decompression_config=cfg),
             "join": lambda: join_planes(high, low, out)}
    copy_stream = torch.cuda.Stream(dev)
    scratch = torch.empty(2 * block.scratch_bytes(), dtype=torch.uint8, device=dev)
    slot = torch.empty(block.nbytes, dtype=torch.uint8, device=dev)
    whole = encode_whole(planes, block, dev)
    calls.update({"event": lambda: torch.cuda.Event().record(stream),
                  "copy_on_copy_stream": lambda: copy_part(copy_stream, low, block.home.flat[pos + aligned(c):pos + aligned(c) + half]),
                  "decode_into_slot": lambda: codec.decode(arr_s, out=slot[:half], decompression_config=cfg),
                  "decode_block": lambda: decode_block(planes, block, scratch, slot, copy_stream, None, [None, None]),
                  "decode_block_whole": lambda: decode_block(planes, whole, scratch, slot, copy_stream, None, [None, None])})
    res = {}
    for where in ("coder", "default"):   # matmuls queued on the coder's stream, then on torch's default one
        for name, call in calls.items():
            try:
                with torch.cuda.stream(stream):
                    call()
                    torch.cuda.synchronize(dev)
                    with torch.cuda.stream(stream if where == "coder" else torch.cuda.default_stream(dev)):
                        for _ in range(12):
                            a @ a
                    t0 = time.perf_counter()
                    call()
                    res[f"busy_{where}_{name}_s"] = time.perf_counter() - t0
            except Exception as e:   # noqa: BLE001  (a call this nvCOMP does not take: say so, go on)
                res[f"busy_{where}_{name}_s"] = f"{type(e).__name__}: {e}"[:120]
            torch.cuda.synchronize(dev)
    return res


def join_variants(n: int, dev: torch.device, repeat: int) -> dict:
    """Seconds to re-interleave `n` high and low bytes into words: two strided copies (join_planes),
    one torch.stack, and a Triton kernel storing whole 16-bit words."""
    from ringswap.swap.plane_codec import join_planes
    high, low = (torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev) for _ in range(2))
    out = torch.empty(2 * n, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    res = {"join_copies_s": timed(lambda: join_planes(high, low, out), stream, repeat),
           "join_stack_s": timed(lambda: torch.stack((low, high), dim=1, out=out.view(-1, 2)), stream, repeat)}
    ref = out.clone()
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def interleave(high_ptr, low_ptr, out_ptr, count, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            keep = offs < count
            h = tl.load(high_ptr + offs, mask=keep).to(tl.int16)
            lo = tl.load(low_ptr + offs, mask=keep).to(tl.int16)
            tl.store(out_ptr + offs, (h << 8) | lo, mask=keep)

        words = out.view(torch.int16)
        run = lambda: interleave[(triton.cdiv(n, 4096),)](high, low, words, n, BLOCK=4096)  # noqa: E731
        out.zero_()
        res["join_triton_s"] = timed(run, stream, repeat)
        res["join_triton_exact"] = bool(torch.equal(out, ref))
    except Exception as e:   # noqa: BLE001
        res["join_triton_s"] = f"{type(e).__name__}: {e}"[:160]
    return res


def copy_part(stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)


def encode_whole(planes, block, dev: torch.device):
    """The same block coded without planes (each part whole), to tell the join's cost from the decode's."""
    from ringswap.swap.plane_codec import encode_block
    flat = (torch.randn(block.nbytes // 2, device=dev) * 0.02).to(torch.bfloat16).view(torch.uint8)
    return encode_block(planes, flat, planes=False)


def host_waits(planes, block, scratch: torch.Tensor, slot: torch.Tensor, matmuls, dev: torch.device) -> dict:
    """Host seconds to enqueue each step of one part's decode behind a busy GPU: a step that
    waits for the GPU shows the matmuls' time here."""
    from ringswap.swap.plane_codec import aligned, join_planes
    off, size, pos, c = block.parts[0]
    half = size // 2 if block.planes else size
    span = aligned(c) + half if block.planes else c
    landed, high = scratch[:span], scratch[aligned(span):aligned(span) + half]
    steps = {"copy": lambda: landed.copy_(block.home.flat[pos:pos + span], non_blocking=True),
             "decode": lambda: planes.decode(landed[:c], high if block.planes else slot[off:off + size])}
    if block.planes:
        steps["join"] = lambda: join_planes(high, landed[aligned(c):], slot[off:off + size])
    out = {}
    for name, step in steps.items():
        with torch.cuda.stream(planes.stream):
            step()
            torch.cuda.synchronize(dev)
            matmuls()
            t0 = time.perf_counter()
            step()
            out[f"host_wait_{name}_s"] = time.perf_counter() - t0
        torch.cuda.synchronize(dev)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=WAN_BLOCK_PARAMS)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--formats", nargs="+", default=["fp16", "fp8", "nvfp4", "bf16"])   # bf16 last: it swaps nvCOMP's allocator
    ap.add_argument("--json")
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for fmt in a.formats:
        try:
            row = probe(fmt, int(a.params), a.repeat, dev)
        except Exception as e:   # noqa: BLE001  (an API mismatch is the finding: report it, go on)
            row = {"format": fmt, "error": f"{type(e).__name__}: {e}"}
        rows.append(row)
        common.say(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    common.write_json(a.json, {"rows": rows, "env": common.env_info(dev)})


if __name__ == "__main__":
    main()
