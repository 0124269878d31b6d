"""Wan-2.1-14B-shaped safetensors files with random weights, written block by block.

The keys of ComfyUI's WanModel (t2v) state dict, in the on-disk conventions of
tests/comfyui/support/quant_files.py (bf16, scaled fp8, nvfp4, ...); weights generated on the
device block by block and written at their offsets of a header computed up front
(tensor order as safetensors' save_file would use: dtype, then name), so the whole model
is never in RAM; safetensors.safe_open checks the result. Used by every benchmark here.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import gb, say

ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8",
            torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
            torch.float64: "F64", torch.int16: "I16"}
# safetensors' serializer writes tensors by dtype (this rank, highest first), then name.
ST_RANK = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32",
           "F32", "F64", "I64", "U64"]


def wan14b_file(directory: str, fmt: str, small: bool, device: str, layers_small: int = 2, layers: int = 40,
                seed: int = 0) -> str:
    """A Wan-2.1-14B-shaped file in `fmt` (tiny with `small`) under `directory`, written once;
    `layers` blocks (fewer: a shallower model of the same width), weights from `seed` (another
    seed: another model of the same shape, e.g. Wan 2.2's second expert)."""
    layers, dim, ffn = (layers_small, 128, 256) if small else (layers, 5120, 13824)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"wan_{fmt}_l{layers}_d{dim}" + (f"_s{seed}" if seed else "") + ".safetensors")
    if not os.path.exists(path):
        import quant_files
        wa = argparse.Namespace(layers=layers, dim=dim, ffn=ffn, seed=seed, small=small)
        info = write_model(path, fmt, wa, torch.device(device), quant_files, wan_template(layers, dim, ffn), 3 << 30)
        say(f"wrote {path}: {info}")
    return path


def wan_template(layers: int, dim: int, ffn: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of ComfyUI's WanModel (t2v) state dict, built on meta."""
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    m = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=dim, ffn_dim=ffn, freq_dim=256,
                 text_dim=4096, out_dim=16, num_heads=dim // 128, num_layers=layers, window_size=(-1, -1),
                 qk_norm=True, cross_attn_norm=True, eps=1e-6, device="meta", dtype=torch.float32,
                 operations=comfy.ops.disable_weight_init)
    out = [(k, tuple(v.shape)) for k, v in sorted(m.state_dict().items())]
    del m
    return out


def _block_of(name: str) -> int | None:
    head, _, rest = name.partition(".")
    idx = rest.split(".", 1)[0]
    return int(idx) if head == "blocks" and idx.isdigit() else None


def install_nvfp4_fallback(qf) -> None:
    """quant_files._nvfp4 uses comfy_kitchen's best backend; if that fails on this device
    (e.g. no kernel for it), use kitchen's eager backend on the same device, then the CPU."""
    orig = qf._nvfp4
    state = {"how": None}

    def nvfp4(w):
        if state["how"] is None:
            try:
                return orig(w)
            except Exception as e:   # noqa: BLE001
                say(f"  nvfp4 quantize with kitchen's default backend failed ({type(e).__name__}: {e}); "
                    "trying its eager backend")
                state["how"] = "eager"
        if state["how"] == "eager":
            try:
                from comfy_kitchen.registry import registry
                with registry.use_backend("eager"):
                    return orig(w)
            except Exception as e:   # noqa: BLE001
                say(f"  nvfp4 eager on {w.device} failed ({type(e).__name__}: {e}); quantizing on the CPU")
                state["how"] = "cpu"
        q, bs, s2 = orig(w.cpu())
        return q.to(w.device), bs.to(w.device), s2.to(w.device)

    qf._nvfp4 = nvfp4


def encode_block(qf, sd: dict, i: int, fmt: str) -> tuple[dict, dict]:
    """quant_files.encode_state_dict on block i alone (renamed to block 0 and back)."""
    pre = f"blocks.{i}."
    sd0 = {"blocks.0." + k[len(pre):]: v for k, v in sd.items()}
    out, meta = qf.encode_state_dict(sd0, fmt, 1)
    out.pop("scaled_fp8", None)   # the marker belongs to the non-block part
    return {pre + k[len("blocks.0."):]: v for k, v in out.items()}, meta


def _pwrite_all(fd: int, t: torch.Tensor, off: int) -> int:
    if t.numel() == 0:
        return 0
    mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    n = len(mv)
    while len(mv):
        k = os.pwrite(fd, mv, off)
        mv, off = mv[k:], off + k
    return n


def file_signature(fmt: str, a) -> str:
    return f"stream.py v1 fmt={fmt} layers={a.layers} dim={a.dim} ffn={a.ffn} seed={a.seed} std=0.02"


def existing_file_ok(path: str, sig: str) -> bool:
    if not os.path.isfile(path):
        return False
    try:
        from safetensors import safe_open
        with safe_open(path, framework="pt", device="cpu") as f:
            return (f.metadata() or {}).get("ringswap_bench") == sig
    except Exception:   # noqa: BLE001
        return False


def _random_state(names_shapes, seed: int, gen: torch.Generator, dev: torch.device) -> dict:
    """Weights N(0, WEIGHT_STD) on `dev` from `seed`, norm weights around 1 (as wan_files writes)."""
    from wan_files import WEIGHT_STD, _is_norm_weight
    gen.manual_seed(seed)
    sd = {}
    for name, shape in names_shapes:
        t = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).mul_(WEIGHT_STD)
        if _is_norm_weight(name):
            t.add_(1.0)
        sd[name] = t
    return sd


def _every_layer_metadata(meta: dict, meta0: dict, layers: int) -> dict:
    """The quant_metadata header lists every quantized layer: block 0's, replicated."""
    if "_quantization_metadata" not in meta0:
        return meta
    qm = json.loads(meta0["_quantization_metadata"])
    lay = {}
    for i in range(layers):
        for k, v in qm["layers"].items():
            lay[f"blocks.{i}." + k[len("blocks.0."):]] = v
    qm["layers"] = lay
    return {**meta, "_quantization_metadata": json.dumps(qm)}


def _header(entries: dict, metadata: dict) -> tuple[dict, bytes, int]:
    """The safetensors header of `entries` (name -> (dtype, shape)) in save_file's tensor order,
    its JSON padded to 8 bytes, and the data's size."""
    order = sorted(entries, key=lambda k: (-ST_RANK.index(ST_DTYPE[entries[k][0]]), k))
    header, off = {}, 0
    for k in order:
        dt, shape = entries[k]
        n = math.prod(shape) * dt.itemsize
        header[k] = {"dtype": ST_DTYPE[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    hjson = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    return header, hjson + b" " * (-len(hjson) % 8), off


def _put(fd: int, tensors: dict, header: dict, data_start: int) -> int:
    return sum(_pwrite_all(fd, t, data_start + header[k]["data_offsets"][0]) for k, t in tensors.items())


def _write_blocks(fd: int, header: dict, data_start: int, blocks, layers: int, written: int, t_start: float,
                  check: dict) -> int:
    """Write each block of `blocks` (encoded on the device, one at a time) while the next one is
    made: its copy to the CPU, then its pwrite on a thread. Returns the bytes written in all;
    the last block's smallest tensor goes into `check`."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="bench-write")
    pending = None
    last_say = time.perf_counter()
    try:
        for i, enc in enumerate(blocks):
            cpu = {k: v.cpu() for k, v in enc.items()}   # waits for the device
            del enc
            if i == layers - 1:
                k = min(cpu, key=lambda k: (cpu[k].numel(), k))
                check[k] = cpu[k]
            if pending is not None:
                written += pending.result()
            pending = pool.submit(_put, fd, cpu, header, data_start)
            if time.perf_counter() - last_say > 15 or i == layers - 1:
                last_say = time.perf_counter()
                dt = last_say - t_start
                say(f"    block {i + 1}/{layers}: {gb(written):.1f} GB written, {gb(written) / dt:.2f} GB/s")
        return written + pending.result()
    finally:
        pool.shutdown(wait=True)


def _check_file(path: str, entries: dict, check: dict) -> int:
    """A valid safetensors file: the library reads the header and the spot checks back equal."""
    from safetensors import safe_open
    with safe_open(path, framework="pt", device="cpu") as f:
        keys = set(f.keys())
        if keys != set(entries):
            raise RuntimeError(f"{path}: safetensors reads {len(keys)} keys, we wrote {len(entries)}")
        for k, t in check.items():
            got = f.get_tensor(k)
            if got.dtype != t.dtype or tuple(got.shape) != tuple(t.shape) or not torch.equal(
                    got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)):
                raise RuntimeError(f"{path}: tensor {k} reads back different from what was written")
    return len(keys)


def _write_file(tmp: str, hjson: bytes, header: dict, data_start: int, parts: dict, layers: int,
                t_start: float) -> tuple[int, float, dict]:
    """Write the header, the non-block tensors and each block to `tmp`, fsync it and drop it from
    the page cache; `parts` ("nonblock": tensors on the CPU, "blocks": an iterator) is emptied as
    it goes, so nothing is held longer than its write. Returns (bytes written, fsync seconds, the
    spot checks: the smallest non-block tensor and the last block's)."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        written = _pwrite_all(fd, torch.tensor(list(len(hjson).to_bytes(8, "little")) + list(hjson),
                                               dtype=torch.uint8), 0)
        nb_out = parts.pop("nonblock")
        written += _put(fd, nb_out, header, data_start)
        small_nb = min(nb_out, key=lambda k: (nb_out[k].numel() == 0, nb_out[k].numel(), k))
        check = {small_nb: nb_out[small_nb]}
        del nb_out
        written = _write_blocks(fd, header, data_start, parts.pop("blocks"), layers, written, t_start, check)
        t_sync = time.perf_counter()
        os.fsync(fd)
        fsync_s = time.perf_counter() - t_sync
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except BaseException:
        os.close(fd)
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    os.close(fd)
    return written, fsync_s, check


def _blocks(qf, make, per_block: dict, fmt: str, seed: int, first: list):
    """Block i encoded on the device, one at a time; block 0 is `first`'s (made earlier for the
    layout) and let go once written."""
    for i in range(len(per_block)):
        yield first.pop() if i == 0 else encode_block(qf, make(per_block[i], seed + 1 + i), i, fmt)[0]


def write_model(path: str, fmt: str, a, dev: torch.device, qf, template, free_margin: int) -> dict:
    """Write the model in `fmt` to `path`, generating weights on `dev` block by block."""
    t_start = time.perf_counter()
    gen = torch.Generator(device=dev)

    def make(names_shapes, seed):
        return _random_state(names_shapes, seed, gen, dev)

    nonblock = [(n, s) for n, s in template if _block_of(n) is None]
    per_block: dict[int, list] = {}
    for n, s in template:
        if _block_of(n) is not None:
            per_block.setdefault(_block_of(n), []).append((n, s))
    layers = len(per_block)
    nb_out, meta = qf.encode_state_dict(make(nonblock, a.seed), fmt, 0)
    nb_out = {k: v.cpu() for k, v in nb_out.items()}
    b0, meta0 = encode_block(qf, make(per_block[0], a.seed + 1), 0, fmt)
    meta = _every_layer_metadata(meta, meta0, layers)
    block_tmpl = [(k[len("blocks.0."):], v.dtype, tuple(v.shape)) for k, v in b0.items()]
    entries = {k: (v.dtype, tuple(v.shape)) for k, v in nb_out.items()}
    for i in range(layers):
        for suffix, dt, shape in block_tmpl:
            entries[f"blocks.{i}.{suffix}"] = (dt, shape)
    header, hjson, data_bytes = _header(entries, {"ringswap_bench": file_signature(fmt, a), "format": fmt, **meta})
    data_start = 8 + len(hjson)
    total = data_start + data_bytes
    block_bytes = sum(math.prod(s) * dt.itemsize for _, dt, s in block_tmpl)

    d = os.path.dirname(path)
    free = shutil.disk_usage(d).free
    if free < total + free_margin:
        raise RuntimeError(f"not enough disk space in {d}: the {fmt} file needs {gb(total):.1f} GB, "
                           f"{gb(free):.1f} GB free (keeping {gb(free_margin):.1f} GB spare)")
    say(f"  {fmt}: writing {gb(total):.2f} GB ({len(entries)} tensors, {layers} blocks of "
        f"{gb(block_bytes):.3f} GB) to {path}")

    tmp = path + ".tmp"
    first = [b0]
    del b0
    parts = {"nonblock": nb_out, "blocks": _blocks(qf, make, per_block, fmt, a.seed, first)}
    del nb_out
    written, fsync_s, check = _write_file(tmp, hjson, header, data_start, parts, layers, t_start)
    os.replace(tmp, path)
    elapsed = time.perf_counter() - t_start
    if written != total or os.path.getsize(path) != total:
        raise RuntimeError(f"{path}: wrote {written} bytes, expected {total}")
    n_keys = _check_file(path, entries, check)
    say(f"  {fmt}: wrote {gb(total):.2f} GB in {elapsed:.1f} s ({gb(total) / elapsed:.2f} GB/s incl. "
        f"generation; fsync {fsync_s:.1f} s); safe_open reads {n_keys} tensors, spot checks equal")
    return {"path": path, "format": fmt, "bytes": total, "tensors": len(entries), "blocks": layers,
            "block_bytes": block_bytes, "write_s": elapsed, "fsync_s": fsync_s,
            "write_gbps": gb(total) / elapsed, "reused": False}


def estimate_file(fmt: str, template, qf) -> tuple[int, int]:
    """(file bytes, block bytes) of the model in `fmt`, without writing it."""
    lin = set(qf.QUANT_LINEARS)
    total = blk = 0
    for name, shape in template:
        n = math.prod(shape)
        b = _block_of(name)
        suffix = name.split(".", 2)[2] if b is not None else ""
        layer = suffix.rsplit(".", 1)[0]
        if fmt in qf.PLAIN_DTYPES:
            nbytes = n * qf.PLAIN_DTYPES[fmt].itemsize
        elif b is None or layer not in lin or not suffix.endswith(".weight"):
            nbytes = n * 2
        elif fmt == "nvfp4":   # packed codes + swizzled block scales + global scale + comfy_quant
            rows, cols = shape
            nbytes = (n // 2 + (-(-rows // 128) * 128) * (-(-(cols // 16) // 4) * 4) + 4
                      + len(json.dumps({"format": "nvfp4"})))
        elif fmt in qf.FP8_PLAIN_DTYPES:
            nbytes = n
        else:                  # fp8 + f32 scale (+ comfy_quant)
            nbytes = n + 4 + (len(json.dumps({"format": "float8_e4m3fn"})) if fmt == "comfy_quant" else 0)
        total += nbytes
        if b == 0:
            blk += nbytes
    return total, blk
