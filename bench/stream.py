"""Streaming Wan-14B-shaped models from safetensors files: step time, disk read rate, host RAM (H200).

Issue 3's benchmark. For each format in --formats (default bf16, scaled_fp8, nvfp4):
  1. write a Wan 2.1 14B t2v-shaped diffusion-model file (40 blocks, dim 5120, ffn 13824,
     40 heads; the keys of ComfyUI's WanModel state dict; random weights, std 0.02, norm
     weights around 1) in the on-disk conventions of tests/support/quant_files.py. The
     weights are generated on the GPU block by block and written at their offsets of a
     header computed up front (tensor order as safetensors' save_file would use: dtype,
     then name), so the whole model is never in RAM; safetensors.safe_open checks it;
  2. measure the disk's own rate: O_DIRECT sequential 4 MiB reads of the file;
  3. drop the page cache (drop_caches as root, else posix_fadvise DONTNEED on the file)
     before every load and before every home=disk measurement;
  4. load it with RingSwap's loader (`load_swapped_model`), home=ram and home=disk,
     window --window, prefetch 1, pin auto, --workers read threads, and time steps at
     each token count (one step = one forward of the diffusion model). Reported: median
     s/step, the run's copy GB/s, for disk the achieved read GB/s against the O_DIRECT
     rate, for ram the achieved host->GPU rate (bytes copied per step / step time)
     against a measured pinned host->GPU rate, the host RAM high-water mark (VmHWM, and
     the peak RSS sampled during each configuration), load time and GB/s;
  5. delete the file (unless --keep) before the next format.
Issue-3 targets (PASS/FAIL): disk reads >= 85% of the O_DIRECT rate; home=ram at 4,096
tokens >= 85% of the pinned host->GPU rate. Everything goes to --json as well.

Usage (repo root; on the GPU machine after `source scripts/device_setup.sh`):
    python3 bench/stream.py --json $OUT/stream.json
Runs here on a CPU with tiny shapes (all code paths, meaningless numbers):
    .venv/bin/python bench/stream.py --device cpu --small
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY = os.environ.get("RINGSWAP_COMFYUI_DIR") or os.path.join(REPO, ".comfyui")
sys.path.insert(0, COMFY)
sys.path.insert(0, os.path.join(COMFY, "custom_nodes"))
sys.path.insert(0, os.path.join(REPO, "tests", "support"))

# latent (frames, height, width) for a token count: tokens = f * (h/2) * (w/2)
SHAPES = {32760: (21, 60, 104), 7800: (5, 60, 104), 75600: (21, 90, 160), 4096: (1, 128, 128)}

# H200 reference numbers (shared/FACTS.md) for the up-front time estimate; measured
# rates replace them as they come in.
REF = {"write_gbps": 1.0, "disk_gbps": 1.0, "cold_gbps": 1.4, "pin_gbps": 1.4, "link_gbps": 51.7,
       "gen_gbps": 3.0}
# Wan-14B block forward (bf16, H200): 4.1 ms @ 4,096 tokens, 68.6 @ 32,760, 279 @ 75,600.
_REF_BLOCK_MS = ((4096, 4.1), (32760, 68.6), (75600, 279.0))

ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
            torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.uint8: "U8",
            torch.int8: "I8", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL",
            torch.float64: "F64", torch.int16: "I16"}
# safetensors' serializer writes tensors by dtype (this rank, highest first), then name.
ST_RANK = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32",
           "F32", "F64", "I64", "U64"]

T0 = time.perf_counter()


# A separate process holding all but argv[1] GiB of the GPU's free memory (a smaller card).
BALLAST = ("import sys, time, torch\n"
           "free, _ = torch.cuda.mem_get_info()\n"
           "keep = int(float(sys.argv[1]) * 2**30)\n"
           "x = torch.empty(max(0, free - keep), dtype=torch.uint8, device='cuda')\n"
           "print('ready', x.numel(), flush=True)\n"
           "time.sleep(3600)\n")


def wan14b_file(directory: str, fmt: str, small: bool, device: str, layers_small: int = 2) -> str:
    """A Wan-2.1-14B-shaped file in `fmt` (tiny with `small`) under `directory`, written once."""
    layers, dim, ffn = (layers_small, 128, 256) if small else (40, 5120, 13824)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"wan_{fmt}_l{layers}_d{dim}.safetensors")
    if not os.path.exists(path):
        import quant_files
        wa = argparse.Namespace(layers=layers, dim=dim, ffn=ffn, seed=0, small=small)
        info = write_model(path, fmt, wa, torch.device(device), quant_files, wan_template(layers, dim, ffn), 3 << 30)
        say(f"wrote {path}: {info}")
    return path


def say(*args) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s]", *args, flush=True)


def gb(n: float) -> float:
    return n / 1e9


# ------------------------------------------------------------------------ host memory

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


def vmhwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class RssSampler:
    """Peak RSS sampled by a thread (VmHWM never resets, so per-configuration peaks need this)."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "RssSampler":
        self.peak = rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


# ------------------------------------------------------------------------ page cache, disk

def drop_page_cache(path: str, mode: str) -> str:
    """Evict `path` from the page cache; returns the method used."""
    if mode in ("auto", "root"):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            return "drop_caches"
        except OSError as e:
            if mode == "root":
                raise RuntimeError(f"cannot write /proc/sys/vm/drop_caches: {e}") from e
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd) if hasattr(os, "fdatasync") else None
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return "fadvise"


def odirect_rate(path: str, limit: int, allow_direct: bool, drop_mode: str, threads: int = 1) -> dict:
    """4 MiB reads of the first `limit` bytes (0 = all) with O_DIRECT into aligned (mmap)
    buffers, by `threads` threads taking chunks in turn (one fd and buffer each); buffered
    reads after a cache drop if O_DIRECT is refused."""
    size = os.path.getsize(path)
    want = min(size, limit) if limit > 0 else size
    bs = 4 << 20
    flags, mode = os.O_RDONLY, "O_DIRECT"
    if allow_direct and hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                probe = mmap.mmap(-1, bs)
                os.preadv(fd, [probe], 0)   # some file systems accept the open, refuse the read
                probe.close()
                flags = os.O_RDONLY | os.O_DIRECT
            finally:
                os.close(fd)
        except OSError as e:
            mode = f"buffered (O_DIRECT refused: {e.strerror or e})"
    else:
        mode = "buffered (O_DIRECT not tried)"
    if flags == os.O_RDONLY:
        mode += f", after {drop_page_cache(path, drop_mode)}"
    chunks = list(range(0, want, bs))
    lock = threading.Lock()
    got = [0]

    def worker() -> None:
        fd, buf = os.open(path, flags), mmap.mmap(-1, bs)
        try:
            while True:
                with lock:
                    if not chunks:
                        return
                    off = chunks.pop(0)
                k = os.preadv(fd, [buf], off)
                with lock:
                    got[0] += max(0, min(k, want - off))
        finally:
            os.close(fd)
            buf.close()

    t0 = time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(max(1, threads))]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    dt = time.perf_counter() - t0
    return {"mode": mode + (f", {threads} threads" if threads > 1 else ""), "bytes": got[0], "seconds": dt,
            "gbps": gb(got[0]) / dt if dt > 0 else 0.0, "threads": threads}


# ------------------------------------------------------------------------ host -> device rate

def h2d_rate(dev: torch.device, nbytes: int, reps: int = 5) -> dict:
    """Median of `reps` copies of one pinned host tensor to the device (CPU: a plain copy)."""
    cuda = dev.type == "cuda"
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    times = []
    for i in range(reps + 1):
        sync(dev)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        sync(dev)
        if i:
            times.append(time.perf_counter() - t0)
    del src, dst
    if cuda:
        try:
            torch._C._host_emptyCache()   # give the pinned 1 GiB back (RSS baselines)
        except Exception:   # noqa: BLE001
            pass
    med = statistics.median(times)
    return {"bytes": nbytes, "pinned": cuda, "times": times, "gbps": gb(nbytes) / med}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


# ------------------------------------------------------------------------ writing the files

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


def _install_nvfp4_fallback(qf) -> None:
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


def write_model(path: str, fmt: str, a, dev: torch.device, qf, template, free_margin: int) -> dict:
    """Write the model in `fmt` to `path`, generating weights on `dev` block by block."""
    from wan_files import WEIGHT_STD, _is_norm_weight

    t_start = time.perf_counter()
    gen = torch.Generator(device=dev)

    def make(names_shapes, seed):
        gen.manual_seed(seed)
        sd = {}
        for name, shape in names_shapes:
            t = torch.randn(shape, generator=gen, device=dev, dtype=torch.float32).mul_(WEIGHT_STD)
            if _is_norm_weight(name):
                t.add_(1.0)
            sd[name] = t
        return sd

    nonblock = [(n, s) for n, s in template if _block_of(n) is None]
    per_block: dict[int, list] = {}
    for n, s in template:
        b = _block_of(n)
        if b is not None:
            per_block.setdefault(b, []).append((n, s))
    layers = len(per_block)

    nb_out, meta = qf.encode_state_dict(make(nonblock, a.seed), fmt, 0)
    nb_out = {k: v.cpu() for k, v in nb_out.items()}
    b0, meta0 = encode_block(qf, make(per_block[0], a.seed + 1), 0, fmt)
    # The quant_metadata header lists every quantized layer: replicate block 0's.
    if "_quantization_metadata" in meta0:
        qm = json.loads(meta0["_quantization_metadata"])
        lay = {}
        for i in range(layers):
            for k, v in qm["layers"].items():
                lay[f"blocks.{i}." + k[len("blocks.0."):]] = v
        qm["layers"] = lay
        meta = {**meta, "_quantization_metadata": json.dumps(qm)}
    block_tmpl = [(k[len("blocks.0."):], v.dtype, tuple(v.shape)) for k, v in b0.items()]

    entries = {k: (v.dtype, tuple(v.shape)) for k, v in nb_out.items()}
    for i in range(layers):
        for suffix, dt, shape in block_tmpl:
            entries[f"blocks.{i}.{suffix}"] = (dt, shape)
    order = sorted(entries, key=lambda k: (-ST_RANK.index(ST_DTYPE[entries[k][0]]), k))
    header, off = {}, 0
    for k in order:
        dt, shape = entries[k]
        n = math.prod(shape) * dt.itemsize
        header[k] = {"dtype": ST_DTYPE[dt], "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    data_bytes = off
    metadata = {"ringswap_bench": file_signature(fmt, a), "format": fmt, **meta}
    hjson = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    data_start = 8 + len(hjson)
    total = data_start + data_bytes

    d = os.path.dirname(path)
    free = shutil.disk_usage(d).free
    if free < total + free_margin:
        raise RuntimeError(f"not enough disk space in {d}: the {fmt} file needs {gb(total):.1f} GB, "
                           f"{gb(free):.1f} GB free (keeping {gb(free_margin):.1f} GB spare)")
    say(f"  {fmt}: writing {gb(total):.2f} GB ({len(entries)} tensors, {layers} blocks of "
        f"{gb(sum(math.prod(s) * dt.itemsize for _, dt, s in block_tmpl)):.3f} GB) to {path}")

    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    written = 0
    check = {}
    try:
        written += _pwrite_all(fd, torch.tensor(list(len(hjson).to_bytes(8, "little")) + list(hjson),
                                                dtype=torch.uint8), 0)

        def put(tensors: dict) -> int:
            n = 0
            for k, t in tensors.items():
                n += _pwrite_all(fd, t, data_start + header[k]["data_offsets"][0])
            return n

        written += put(nb_out)
        small_nb = min(nb_out, key=lambda k: (nb_out[k].numel() == 0, nb_out[k].numel(), k))
        check[small_nb] = nb_out[small_nb]
        del nb_out
        pool = ThreadPoolExecutor(1, thread_name_prefix="bench-write")
        pending = None
        last_say = time.perf_counter()
        try:
            for i in range(layers):
                if i == 0:
                    enc, b0 = b0, None
                else:
                    enc, _ = encode_block(qf, make(per_block[i], a.seed + 1 + i), i, fmt)
                cpu = {k: v.cpu() for k, v in enc.items()}   # waits for the device
                del enc
                if i == layers - 1:
                    k = min(cpu, key=lambda k: (cpu[k].numel(), k))
                    check[k] = cpu[k]
                if pending is not None:
                    written += pending.result()
                pending = pool.submit(put, cpu)
                if time.perf_counter() - last_say > 15 or i == layers - 1:
                    last_say = time.perf_counter()
                    dt = last_say - t_start
                    say(f"    block {i + 1}/{layers}: {gb(written):.1f} GB written, {gb(written) / dt:.2f} GB/s")
            written += pending.result()
        finally:
            pool.shutdown(wait=True)
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
    os.replace(tmp, path)
    elapsed = time.perf_counter() - t_start
    if written != total or os.path.getsize(path) != total:
        raise RuntimeError(f"{path}: wrote {written} bytes, expected {total}")
    # A valid safetensors file: the library reads the header and our spot checks.
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
    say(f"  {fmt}: wrote {gb(total):.2f} GB in {elapsed:.1f} s ({gb(total) / elapsed:.2f} GB/s incl. "
        f"generation; fsync {fsync_s:.1f} s); safe_open reads {len(keys)} tensors, spot checks equal")
    block_bytes = sum(math.prod(s) * dt.itemsize for _, dt, s in block_tmpl)
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


# ------------------------------------------------------------------------ time budget

class Budget:
    def __init__(self, a, dev: torch.device, layers: int):
        self.a = a
        self.rates = dict(REF)
        self.layers = layers
        # per-block compute (s) = c1 * t + c2 * t^2, least squares on the H200 points
        sxx = sum(t ** 2 for t, _ in _REF_BLOCK_MS)
        sx3 = sum(t ** 3 for t, _ in _REF_BLOCK_MS)
        sx4 = sum(t ** 4 for t, _ in _REF_BLOCK_MS)
        sxy = sum(t * ms / 1e3 for t, ms in _REF_BLOCK_MS)
        sx2y = sum(t * t * ms / 1e3 for t, ms in _REF_BLOCK_MS)
        det = sxx * sx4 - sx3 * sx3
        self.c1 = (sxy * sx4 - sx3 * sx2y) / det
        self.c2 = (sxx * sx2y - sx3 * sxy) / det
        self.scale = (a.dim / 5120) ** 2   # rough, for other shapes

    def deadline_left(self) -> float:
        return self.a.budget_s - (time.perf_counter() - T0)

    def step_compute(self, tokens: int) -> float:
        return self.layers * self.scale * (self.c1 * tokens + self.c2 * tokens * tokens)

    def write(self, total: int) -> float:
        return gb(total) / self.rates["write_gbps"] + gb(total) / self.rates["gen_gbps"] * 0.2

    def odirect(self, total: int) -> float:
        n = min(total, int(self.a.odirect_gb * 1e9)) if self.a.odirect_gb > 0 else total
        return gb(n) / self.rates["disk_gbps"]

    def ram_load(self, total: int, streamed: int) -> float:
        return gb(total) / self.rates["cold_gbps"] + gb(streamed) / self.rates["pin_gbps"] + 2.0

    def ram_tokens(self, tokens: int, streamed: int) -> float:
        per = max(self.step_compute(tokens), gb(streamed) / self.rates["link_gbps"])
        return (self.a.warmup + self.a.steps) * per + 0.5

    def disk_load(self, resident: int, block: int) -> float:
        return (gb(resident * block) / self.rates["disk_gbps"]
                + gb(self.a.workers * block) / self.rates["pin_gbps"] + 2.0)

    def disk_tokens(self, tokens: int, streamed: int) -> float:
        per = max(self.step_compute(tokens), gb(streamed) / (0.9 * self.rates["disk_gbps"]))
        return (self.a.disk_warmup + self.a.disk_steps) * per + 1.0


def plan_counts(layers: int, window: int, prefetch: int) -> tuple[int, int]:
    """(resident, streamed) blocks, as swap.plan.ResidencyPlan decides."""
    from ringswap.swap.plan import ResidencyPlan
    p = ResidencyPlan.make(layers, window, prefetch)
    return len(p.resident), len(p.streamed)


# ------------------------------------------------------------------------ measuring

def latent_shape(tokens: int) -> tuple[int, int, int]:
    if tokens in SHAPES:
        return SHAPES[tokens]
    s = math.isqrt(tokens)
    if s * s != tokens:
        raise SystemExit(f"--tokens {tokens}: no latent shape known; use one of {sorted(SHAPES)} "
                         "or a perfect square (an image of (2s)x(2s) latents)")
    return (1, 2 * s, 2 * s)


def compute_dtype(patcher, dev: torch.device) -> torch.dtype:
    """What ComfyUI's apply_model would cast the inputs to."""
    bm = patcher.model
    dt = getattr(bm, "manual_cast_dtype", None) or bm.get_dtype()
    if dt.itemsize == 1:
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dt


def make_inputs(tokens: int, dev: torch.device, dtype: torch.dtype, ctx_len: int, seed: int):
    f, h, w = latent_shape(tokens)
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(1, 16, f, h, w, device=dev, dtype=dtype, generator=g),
            torch.tensor([500.0], device=dev),
            torch.randn(1, ctx_len, 4096, device=dev, dtype=dtype, generator=g))


def step_times(dm, inputs, n: int, dev: torch.device) -> list[float]:
    times = []
    with torch.no_grad():
        for _ in range(n):
            sync(dev)
            t0 = time.perf_counter()
            dm(*inputs)
            sync(dev)
            times.append(time.perf_counter() - t0)
    return times


def unload(mm, patcher, dev: torch.device) -> None:
    mm.unload_all_models()
    if patcher is not None:
        engine = patcher.swap_engine
        source = getattr(engine.read_block, "__self__", None)
        engine.release_home()
        if source is not None and hasattr(source, "close"):
            source.close()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def compute_only(patcher, fmt: str, a, dev: torch.device, mm, rows: list, budget: Budget) -> None:
    """The step time at the home=ram target's token count with every block resident (no
    streaming, where the device holds the model): the compute bound of that row. When it
    is longer than the copies of a step, the link cannot reach the pinned rate per step
    wall time however well the copies overlap."""
    from ringswap.loaders.swap_patcher import SwapModelPatcher, SwapSettings
    row = next((r for r in rows if r.get("format") == fmt and r.get("home") == "ram"
                and r.get("tokens") == a.ram_target_tokens and "error" not in r), None)
    engine = patcher.swap_engine
    need = sum(engine.states[i].layout.nbytes for i in range(engine.num_blocks))
    if row is None or (dev.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(dev)[0]) \
            or 3 * row["median_s"] > budget.deadline_left():
        return
    mm.unload_all_models()
    full = SwapModelPatcher.wrap(patcher, SwapSettings(engine.num_blocks, 0, a.pin))
    mm.load_models_gpu([full])
    inputs = make_inputs(a.ram_target_tokens, dev, compute_dtype(full, dev), a.ctx_len, a.seed)
    step_times(full.model.diffusion_model, inputs, 1, dev)
    times = step_times(full.model.diffusion_model, inputs, max(1, a.steps), dev)
    engine.end_run()
    mm.unload_all_models()
    del full
    row["compute_only_s"] = statistics.median(times)
    say(f"  {fmt} home=ram tokens={a.ram_target_tokens}: every block resident (no streaming): "
        f"{row['compute_only_s']:.3f} s/step vs {row['median_s']:.3f} s streamed")


def compute_note(r: dict, h2d: dict) -> str:
    """What the compute bound of a home=ram row allows the link per step wall time."""
    c = r.get("compute_only_s")
    if not c:
        return ""
    ceiling = gb(r["bytes_copied"]) / r["steps"] / c / h2d["gbps"]   # a step's bytes in compute-only time
    return (f"; every block resident (no copies) {c:.3f} s/step, streamed {r['median_s']:.3f} s "
            f"(+{100 * (r['median_s'] / c - 1):.0f}%): with this compute the link can reach at most "
            f"{100 * min(1.0, ceiling):.0f}% of pinned per step wall")


def run_home(fmt: str, home: str, info: dict, a, dev: torch.device, mm, budget: Budget,
             rows: list, skipped: list, save=lambda: None) -> None:
    from ringswap.loaders.model_loader import load_swapped_model
    from ringswap.loaders.swap_patcher import SwapSettings

    path, total, block = info["path"], info["bytes"], info["block_bytes"]
    resident, streamed = plan_counts(info["blocks"], a.window, a.prefetch)
    streamed_bytes = streamed * block
    is_disk = home == "disk"
    load_est = budget.disk_load(resident, block) if is_disk else budget.ram_load(total, streamed_bytes)
    first_tok_est = min((budget.disk_tokens(t, streamed_bytes) if is_disk else budget.ram_tokens(t, streamed_bytes))
                        for t in a.tokens)
    if load_est + first_tok_est > budget.deadline_left():
        msg = (f"SKIP {fmt} home={home}: load ~{load_est:.0f} s + a step set ~{first_tok_est:.0f} s "
               f"> {budget.deadline_left():.0f} s left of --budget-s {a.budget_s:.0f}")
        say(msg)
        skipped.append({"format": fmt, "home": home, "reason": msg})
        return
    steps, warm = (a.disk_steps, a.disk_warmup) if is_disk else (a.steps, a.warmup)
    patcher = None
    sampler = RssSampler()
    try:
        method = drop_page_cache(path, a.drop)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        rss0 = rss_bytes()
        sampler.start()
        t0 = time.perf_counter()
        patcher = load_swapped_model(path, SwapSettings(a.window, a.prefetch, a.pin), home=home,
                                     disk_workers=a.workers)
        load_s = time.perf_counter() - t0
        engine = patcher.swap_engine
        reader = engine.read_block.__self__.reader
        load_bytes = reader.bytes_read
        rss_loaded = rss_bytes()
        t0 = time.perf_counter()
        mm.load_models_gpu([patcher])
        attach_s = time.perf_counter() - t0
        plan = engine.plan
        streamed_bytes = sum(engine.states[i].layout.nbytes for i in plan.streamed)
        dm = patcher.model.diffusion_model
        dtype = compute_dtype(patcher, dev)
        base = {"format": fmt, "home": home, "window": a.window, "prefetch": a.prefetch, "pin": a.pin,
                "workers": a.workers, "memory": engine.memory, "plan": plan.describe(),
                "block_bytes": engine.block_bytes(), "streamed_bytes_per_step": streamed_bytes,
                "file_bytes": total, "compute_dtype": str(dtype), "load_s": load_s,
                "load_bytes_read": load_bytes, "load_gbps": gb(load_bytes) / load_s if load_bytes else None,
                "attach_s": attach_s, "load_cache_drop": method, "rss_before_load": rss0,
                "rss_after_load": rss_loaded,
                "gpu_allocated_after_attach": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None}
        if is_disk:
            bound = (a.window + a.prefetch + a.workers) * engine.block_bytes()
            base["rss_bound_bytes"] = bound
            # the disk's own rate now, next to the rows (a rate taken right after writing the
            # file can come from a host-side cache of a virtual disk): 1 and `workers` threads
            base["odirect_now"] = [odirect_rate(path, int(a.odirect_gb * 1e9), not a.no_odirect, a.drop, t)
                                   for t in sorted({1, a.workers})]
            for od in base["odirect_now"]:
                say(f"  {fmt} home=disk: disk read now, {od['mode']}: {gb(od['bytes']):.2f} GB in "
                    f"{od['seconds']:.1f} s = {od['gbps']:.2f} GB/s")
        say(f"  {fmt} home={home}: loaded in {load_s:.1f} s"
            + (f" ({gb(load_bytes):.2f} GB read, {gb(load_bytes) / load_s:.2f} GB/s, after {method})"
               if load_bytes else f" (no block read, after {method})")
            + f"; load_models_gpu {attach_s:.1f} s: {plan.describe()}, {engine.memory} memory; "
            f"RSS {gb(rss0):.1f} -> {gb(rss_loaded):.1f} GB; compute dtype {dtype}")
        for tok in a.tokens:
            est = budget.disk_tokens(tok, streamed_bytes) if is_disk else budget.ram_tokens(tok, streamed_bytes)
            if est > budget.deadline_left():
                msg = (f"SKIP {fmt} home={home} tokens={tok}: ~{est:.0f} s > {budget.deadline_left():.0f} s "
                       f"left of --budget-s {a.budget_s:.0f}")
                say(msg)
                skipped.append({"format": fmt, "home": home, "tokens": tok, "reason": msg})
                continue
            try:
                inputs = make_inputs(tok, dev, dtype, a.ctx_len, a.seed)
                drop = drop_page_cache(path, a.drop) if is_disk else None
                engine.end_run()
                warm_times = step_times(dm, inputs, warm, dev)
                engine.end_run()
                n_steps = steps
                if warm_times and n_steps > 1:   # slower than estimated: fewer steps, never none
                    fit = int(budget.deadline_left() // max(warm_times))
                    if fit < n_steps:
                        n_steps = max(1, fit)
                        say(f"  {fmt} home={home} tokens={tok}: warm-up took {max(warm_times):.1f} s; "
                            f"timing {n_steps} step(s) instead of {steps} to stay within --budget-s")
                r0, rs0 = reader.bytes_read, reader.read_seconds
                times = step_times(dm, inputs, n_steps, dev)
                st = engine.end_run()
                r1, rs1 = reader.bytes_read, reader.read_seconds
                wall = sum(times)
                row = dict(base, tokens=tok, steps=n_steps, warmup=warm, median_s=statistics.median(times),
                           times=times, warmup_times=warm_times, cache_drop=drop,
                           copies=st.copies, bytes_copied=st.bytes_copied, copy_s=st.copy_s, wait_s=st.wait_s,
                           copy_gbps=st.gbps, h2d_gbps=gb(st.bytes_copied) / wall,
                           stats_bytes_read=st.bytes_read, read_wait_s=st.read_wait_s,
                           reader_bytes=r1 - r0, reader_thread_s=rs1 - rs0,
                           read_gbps=gb(r1 - r0) / wall if is_disk else None,
                           rss_peak=sampler.peak, vmhwm=vmhwm_bytes(),
                           gpu_peak_allocated=torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
                           stats_line=st.line())
                if is_disk and row["read_gbps"]:
                    # steady state: a step reads its streamed blocks' file bytes at the achieved rate
                    row["disk_bound_s_per_step"] = gb(len(plan.streamed) * block) / row["read_gbps"]
                rows.append(row)
                save()
                extra = (f"read {gb(r1 - r0):.2f} GB at {row['read_gbps']:.2f} GB/s (waited {st.read_wait_s:.1f} s)"
                         if is_disk else f"host->GPU {row['h2d_gbps']:.1f} GB/s per step wall")
                say(f"  {fmt} home={home} tokens={tok}: {row['median_s']:.3f} s/step "
                    f"{['%.3f' % x for x in times]} (warm-up {['%.3f' % x for x in warm_times]}); "
                    f"copy {st.gbps:.1f} GB/s; {extra}; RSS peak {gb(sampler.peak):.1f} GB")
                if is_disk and row["read_gbps"]:
                    budget.rates["disk_gbps"] = min(budget.rates["disk_gbps"], row["read_gbps"] / 0.9)
            except Exception as e:   # noqa: BLE001  (e.g. out of memory at one token count)
                import traceback
                traceback.print_exc()
                msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                say(f"  {fmt} home={home} tokens={tok}: FAILED: {msg}")
                rows.append({"format": fmt, "home": home, "tokens": tok, "error": msg})
                engine.end_run()
                inputs = None
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if not is_disk and load_bytes:
            budget.rates["cold_gbps"] = gb(load_bytes) / load_s
        if not is_disk and a.ram_target_tokens in a.tokens:
            compute_only(patcher, fmt, a, dev, mm, rows, budget)
    except Exception as e:   # noqa: BLE001
        import traceback
        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        say(f"  {fmt} home={home}: FAILED: {msg}")
        rows.append({"format": fmt, "home": home, "error": msg})
    finally:
        sampler.stop()
        try:
            unload(mm, patcher, dev)
        except Exception as e:   # noqa: BLE001
            say(f"  {fmt} home={home}: unload failed: {type(e).__name__}: {e}")
        patcher = None
        gc.collect()
        rss_after = rss_bytes()
        for r in rows:
            if r.get("format") == fmt and r.get("home") == home and "tokens" in r:
                r["rss_peak_config"] = sampler.peak
                r["rss_after_unload"] = rss_after
        say(f"  {fmt} home={home}: unloaded; RSS {gb(rss_after):.1f} GB, VmHWM {gb(vmhwm_bytes() or 0):.1f} GB")


# ------------------------------------------------------------------------ main

def env_info(dev: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(dev),
            "cpus": os.cpu_count()}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    try:
        import comfyui_version
        info["comfyui"] = comfyui_version.__version__
    except Exception:   # noqa: BLE001
        pass
    try:
        from importlib.metadata import version
        info["comfy_kitchen"] = version("comfy-kitchen")
    except Exception:   # noqa: BLE001
        pass
    try:
        info["commit"] = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True, timeout=5).stdout.strip() or None
    except Exception:   # noqa: BLE001
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = int(f.readline().split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return info


def fmt_num(v, spec=".2f", none="—"):
    return none if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes for a CPU check of every code path (4 blocks, dim 256, ffn 512, tokens 64, "
                         "window 2, 2 workers)")
    ap.add_argument("--formats", nargs="+", default=["bf16", "scaled_fp8", "nvfp4"])
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 32760 4096 (--small: 64)")
    ap.add_argument("--homes", nargs="+", default=["ram", "disk"], choices=["ram", "disk"])
    ap.add_argument("--window", type=int, default=None, help="default 4 (--small: 2)")
    ap.add_argument("--prefetch", type=int, default=1)
    ap.add_argument("--pin", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--workers", type=int, default=None, help="disk_workers; default 8 (--small: 2)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps, home=ram")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up steps, home=ram")
    ap.add_argument("--disk-steps", type=int, default=1, help="timed steps, home=disk")
    ap.add_argument("--disk-warmup", type=int, default=0, help="warm-up steps, home=disk")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--ffn", type=int, default=None)
    ap.add_argument("--ctx-len", type=int, default=None, help="text tokens; default 512 (--small: 16)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/ringswap_bench")
    ap.add_argument("--keep", action="store_true", help="keep the model files (reused by a later run)")
    ap.add_argument("--no-reuse", action="store_true", help="rewrite files even if a matching one is in --dir")
    ap.add_argument("--max-files-gb", type=float, default=45.0, help="cap on model files on disk at once")
    ap.add_argument("--free-margin-gb", type=float, default=3.0, help="disk space to leave free")
    ap.add_argument("--odirect-gb", type=float, default=None,
                    help="GB of the file read for the O_DIRECT rate; 0 = all; default 4 (--small: 0)")
    ap.add_argument("--no-odirect", action="store_true", help="measure the disk with buffered reads")
    ap.add_argument("--drop", default="auto", choices=["auto", "root", "fadvise"],
                    help="page-cache drop: drop_caches if writable (auto) / required (root), or fadvise only")
    ap.add_argument("--h2d-mib", type=int, default=None, help="pinned copy size for the link rate; default 1024")
    ap.add_argument("--ram-target-tokens", type=int, default=None,
                    help="token count of the home=ram link-rate target; default 4096 (--small: smallest)")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the time estimate, then stop")
    a = ap.parse_args()

    small = a.small
    a.layers = a.layers or (4 if small else 40)
    a.dim = a.dim or (256 if small else 5120)
    a.ffn = a.ffn or (512 if small else 13824)
    a.tokens = a.tokens or ([64] if small else [32760, 4096])
    a.window = a.window or (2 if small else 4)
    a.workers = a.workers or (2 if small else 8)
    a.ctx_len = a.ctx_len or (16 if small else 512)
    a.odirect_gb = a.odirect_gb if a.odirect_gb is not None else (0.0 if small else 4.0)
    a.h2d_mib = a.h2d_mib or (64 if small else 1024)
    a.ram_target_tokens = a.ram_target_tokens or (min(a.tokens) if small else 4096)
    for t in a.tokens:
        latent_shape(t)
    if a.dim % 128:
        raise SystemExit("--dim must be a multiple of 128 (ComfyUI derives num_heads = dim // 128)")

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device (use --device cpu --small here)")
    if a.device == "cpu":
        from comfy.cli_args import args as comfy_args
        comfy_args.cpu = True
    link = os.path.join(COMFY, "custom_nodes", "ringswap")
    if not os.path.exists(link):
        os.symlink(REPO, link)
    import comfy.model_management as mm
    import quant_files as qf

    for f in a.formats:
        if f not in qf.FORMATS:
            raise SystemExit(f"unknown format {f!r}; expected some of {qf.FORMATS}")
    _install_nvfp4_fallback(qf)
    dev = mm.get_torch_device()
    if dev.type != a.device:
        raise SystemExit(f"ComfyUI chose {dev}, asked for {a.device}")

    env = env_info(dev)
    say(f"stream.py on {env.get('gpu', 'CPU')}: torch {env['torch']}, ComfyUI {env.get('comfyui')}, "
        f"comfy-kitchen {env.get('comfy_kitchen')}, commit {env.get('commit')}; RAM {env.get('mem_total_gb', 0):.0f} GB")
    say(f"model: {a.layers} blocks, dim {a.dim}, ffn {a.ffn}, heads {a.dim // 128}; formats {a.formats}; "
        f"tokens {a.tokens}; homes {a.homes}; window {a.window}, prefetch {a.prefetch}, pin {a.pin}, "
        f"workers {a.workers}; ram {a.warmup}+{a.steps} steps, disk {a.disk_warmup}+{a.disk_steps} steps")

    template = wan_template(a.layers, a.dim, a.ffn)
    budget = Budget(a, dev, a.layers)
    resident, streamed = plan_counts(a.layers, a.window, a.prefetch)
    say(f"plan: {resident} resident + {streamed} streamed blocks per step")

    # ---- the estimate up front
    est_total = 0.0
    say("estimated time (H200 reference rates: write 1.0, O_DIRECT 1.0, cold read 1.4, pinning 1.4, "
        "link 51.7 GB/s; bf16 compute" + ("; meaningless on CPU)" if dev.type == "cpu" else ")"))
    for fmt in a.formats:
        total, blk = estimate_file(fmt, template, qf)
        parts = {"write": budget.write(total), "odirect": budget.odirect(total)}
        if "ram" in a.homes:
            parts["ram"] = budget.ram_load(total, streamed * blk) + sum(
                budget.ram_tokens(t, streamed * blk) for t in a.tokens)
        if "disk" in a.homes:
            parts["disk"] = budget.disk_load(resident, blk) + sum(
                budget.disk_tokens(t, streamed * blk) for t in a.tokens)
        s = sum(parts.values())
        est_total += s
        say(f"  {fmt:>10}: file ~{gb(total):.1f} GB (block {gb(blk):.3f} GB): "
            + ", ".join(f"{k} {v:.0f} s" for k, v in parts.items()) + f" = {s:.0f} s")
    say(f"  total ~{est_total:.0f} s against --budget-s {a.budget_s:.0f}"
        + (" (configurations that would overrun are skipped)" if est_total > a.budget_s else ""))
    if a.dry_run:
        return

    # ---- the link
    h2d = h2d_rate(dev, a.h2d_mib << 20)
    if dev.type == "cuda":
        budget.rates["link_gbps"] = h2d["gbps"]
    say(f"{'pinned host->GPU' if h2d['pinned'] else 'host copy (CPU)'}: {a.h2d_mib} MiB, median of 5: "
        f"{h2d['gbps']:.1f} GB/s")

    os.makedirs(a.dir, exist_ok=True)
    for name in os.listdir(a.dir):
        if name.endswith(".safetensors.tmp"):
            os.remove(os.path.join(a.dir, name))
    files, rows, skipped, kept = {}, [], [], []
    targets: list = []

    def save() -> None:
        """Write --json now (again after every measurement: a run killed at its time limit
        keeps what it measured)."""
        if not a.json:
            return
        out = {"env": env, "args": vars(a), "h2d": h2d, "files": files, "rows": rows, "skipped": skipped,
               "targets": targets, "elapsed_s": time.perf_counter() - T0}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json + ".tmp", "w") as f:
            json.dump(out, f, indent=1, default=str)
        os.replace(a.json + ".tmp", a.json)

    try:
        for fmt in a.formats:
            path = os.path.join(a.dir, f"wan14b_shape_{fmt}.safetensors" if not small
                                else f"wan_small_{fmt}.safetensors")
            total_est, _ = estimate_file(fmt, template, qf)
            sig = file_signature(fmt, a)
            reuse = not a.no_reuse and existing_file_ok(path, sig)
            if not reuse:
                if os.path.exists(path):
                    os.remove(path)
                on_disk = sum(os.path.getsize(p) for p in kept if os.path.exists(p))
                if on_disk + total_est > a.max_files_gb * 1e9:
                    msg = (f"SKIP {fmt}: {gb(total_est):.1f} GB more would put {gb(on_disk + total_est):.1f} GB "
                           f"of model files on disk (--max-files-gb {a.max_files_gb:.0f}; drop --keep)")
                    say(msg)
                    skipped.append({"format": fmt, "reason": msg})
                    continue
                need = budget.write(total_est) + budget.odirect(total_est)
                if need > budget.deadline_left():
                    msg = (f"SKIP {fmt}: writing + O_DIRECT ~{need:.0f} s > {budget.deadline_left():.0f} s left "
                           f"of --budget-s {a.budget_s:.0f}")
                    say(msg)
                    skipped.append({"format": fmt, "reason": msg})
                    continue
            say(f"== {fmt}")
            try:
                if reuse:
                    from safetensors import safe_open
                    with safe_open(path, framework="pt", device="cpu") as f:
                        n = len(f.keys())
                    total, blk = estimate_file(fmt, template, qf)
                    info = {"path": path, "format": fmt, "bytes": os.path.getsize(path), "tensors": n,
                            "blocks": a.layers, "block_bytes": blk, "reused": True}
                    say(f"  {fmt}: reusing {path} ({gb(info['bytes']):.2f} GB, written by an earlier run)")
                else:
                    info = write_model(path, fmt, a, dev, qf, template,
                                       free_margin=int(a.free_margin_gb * 1e9))
                    budget.rates["write_gbps"] = info["write_gbps"]
                kept.append(path)
                files[fmt] = info
                od = odirect_rate(path, int(a.odirect_gb * 1e9), not a.no_odirect, a.drop)
                info["odirect"] = od
                if od["gbps"] > 0:
                    budget.rates["disk_gbps"] = od["gbps"]
                say(f"  {fmt}: disk read {od['mode']}: {gb(od['bytes']):.2f} GB in {od['seconds']:.1f} s = "
                    f"{od['gbps']:.2f} GB/s")
                save()
                for home in a.homes:
                    run_home(fmt, home, info, a, dev, mm, budget, rows, skipped, save)
            except Exception as e:   # noqa: BLE001
                import traceback
                traceback.print_exc()
                msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
                say(f"  {fmt}: FAILED: {msg}")
                files.setdefault(fmt, {})["error"] = msg
            finally:
                if not a.keep and os.path.exists(path):
                    os.remove(path)
                    say(f"  {fmt}: deleted {path}")
    finally:
        if not a.keep:
            for p in kept:
                if os.path.exists(p):
                    os.remove(p)
            try:
                os.rmdir(a.dir)
            except OSError:
                pass

    # ---- targets
    for r in rows:
        if "error" in r:
            continue
        if r["home"] == "disk":
            od = files.get(r["format"], {}).get("odirect", {}).get("gbps")
            if r.get("odirect_now"):   # measured next to the row: the better reference
                od = max(x["gbps"] for x in r["odirect_now"])
            if od and r.get("read_gbps") is not None:
                r["odirect_ref_gbps"] = od
                r["read_vs_odirect"] = r["read_gbps"] / od
                targets.append({"format": r["format"], "home": "disk", "tokens": r["tokens"],
                                "what": "disk read rate / O_DIRECT rate", "value": r["read_vs_odirect"],
                                "pass": r["read_vs_odirect"] >= a.target})
        else:
            r["h2d_vs_pinned"] = r["h2d_gbps"] / h2d["gbps"]
            r["copy_vs_pinned"] = r["copy_gbps"] / h2d["gbps"]
            if r["tokens"] == a.ram_target_tokens:
                targets.append({"format": r["format"], "home": "ram", "tokens": r["tokens"],
                                "what": "host->GPU bytes per step wall / pinned rate", "value": r["h2d_vs_pinned"],
                                "pass": r["h2d_vs_pinned"] >= a.target,
                                "note": f"copy stream alone {100 * r['copy_vs_pinned']:.0f}% "
                                        f"({r['copy_gbps']:.1f} GB/s while copying)" + compute_note(r, h2d)})

    # ---- report
    print("\n| format | file GB | O_DIRECT GB/s | write GB/s |", flush=True)
    print("| --- | --- | --- | --- |")
    for fmt, f in files.items():
        if "error" in f and "bytes" not in f:
            print(f"| {fmt} | error: {f['error']} | | |")
            continue
        od = f.get("odirect", {})
        print(f"| {fmt} | {gb(f['bytes']):.2f} | {fmt_num(od.get('gbps'))} ({od.get('mode', '—')}) | "
              f"{'reused' if f.get('reused') else fmt_num(f.get('write_gbps'))} |")
    print(f"\npinned host->GPU: {h2d['gbps']:.1f} GB/s ({a.h2d_mib} MiB, median of 5)"
          if h2d["pinned"] else f"\nhost copy (no GPU): {h2d['gbps']:.1f} GB/s")
    print("\n| format | home | tokens | s/step (median) | copy GB/s | read GB/s (vs O_DIRECT) "
          "| host->GPU GB/s per step (vs pinned) | load s (GB/s) + load_models_gpu s | RSS before -> peak GB | VmHWM GB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['format']} | {r['home']} | {r.get('tokens', '—')} | error: {r['error'][:120]} | | | | | | |")
            continue
        read = (f"{r['read_gbps']:.2f} ({100 * r['read_vs_odirect']:.0f}% of {r['odirect_ref_gbps']:.2f})"
                if r.get("read_vs_odirect") is not None
                else "—")
        h2 = (f"{r['h2d_gbps']:.1f} ({100 * r['h2d_vs_pinned']:.0f}%)" if r["home"] == "ram" else
              f"{r['h2d_gbps']:.1f}")
        load = (f"{r['load_s']:.1f}" + (f" ({r['load_gbps']:.2f})" if r.get("load_gbps") else "")
                + f" + {r['attach_s']:.1f}")
        if r["home"] == "disk" and r.get("disk_bound_s_per_step"):
            load += f"; steady ~{r['disk_bound_s_per_step']:.2f} s/step"
        print(f"| {r['format']} | {r['home']} | {r['tokens']} | {r['median_s']:.3f} | {r['copy_gbps']:.1f} | {read} "
              f"| {h2} | {load} | {gb(r['rss_before_load']):.1f} -> {gb(r.get('rss_peak_config', r['rss_peak'])):.1f} "
              f"| {gb(r['vmhwm'] or 0):.1f} |")
    disk_rows = [r for r in rows if r.get("home") == "disk" and "error" not in r]
    if disk_rows:
        print("\nhome=disk host RAM growth during the run (peak RSS - RSS before load) vs the issue's bound "
              "(window + prefetch + disk_workers) blocks:")
        for r in disk_rows:
            grow = r.get("rss_peak_config", r["rss_peak"]) - r["rss_before_load"]
            print(f"- {r['format']} tokens={r['tokens']}: {gb(grow):.2f} GB vs {gb(r['rss_bound_bytes']):.2f} GB "
                  f"({grow / r['block_bytes']:.1f} of {r['rss_bound_bytes'] // r['block_bytes']} blocks)")
    if skipped:
        print("\nskipped:")
        for s in skipped:
            print(f"- {s['reason']}")
    print("\ntargets (issue 3):")
    if not targets:
        print("- none measured")
    for t in targets:
        print(f"- {'PASS' if t['pass'] else 'FAIL'} {t['format']} home={t['home']} tokens={t['tokens']}: "
              f"{t['what']} = {100 * t['value']:.0f}% (target >= {100 * a.target:.0f}%)"
              + (f"; {t['note']}" if t.get("note") else ""))
    methods = sorted({r.get("load_cache_drop") for r in rows if r.get("load_cache_drop")}
                     | {r.get("cache_drop") for r in rows if r.get("cache_drop")})
    print(f"page cache dropped with: {', '.join(methods) or '—'}; total {time.perf_counter() - T0:.0f} s", flush=True)
    if a.json:
        save()
        say(f"wrote {a.json}")


if __name__ == "__main__":
    main()
