"""What every benchmark here shares: ComfyUI on sys.path, logging, host memory and VRAM
sampling, the ballast process that emulates a smaller GPU, inputs and step timing, the
environment line, JSON/markdown output, and child processes.

Importing it puts ComfyUI (RINGSWAP_COMFYUI_DIR, else .comfyui), its custom_nodes (this
repo as `ringswap`) and tests/comfyui/support on sys.path; it imports no ComfyUI module itself.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import threading
import time
from typing import Callable

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMFY = os.environ.get("RINGSWAP_COMFYUI_DIR") or os.path.join(REPO, ".comfyui")
sys.path.insert(0, COMFY)
sys.path.insert(0, os.path.join(COMFY, "custom_nodes"))
sys.path.insert(0, os.path.join(REPO, "tests", "comfyui", "support"))


# latent (frames, height, width) for a token count: tokens = f * (h/2) * (w/2)
SHAPES = {32760: (21, 60, 104), 7800: (5, 60, 104), 75600: (21, 90, 160), 4096: (1, 128, 128)}

T0 = time.perf_counter()


# A separate process holding all but argv[1] GiB of the GPU's free memory (a smaller card).
BALLAST = ("import sys, time, torch\n"
           "free, _ = torch.cuda.mem_get_info()\n"
           "keep = int(float(sys.argv[1]) * 2**30)\n"
           "x = torch.empty(max(0, free - keep), dtype=torch.uint8, device='cuda')\n"
           "print('ready', x.numel(), flush=True)\n"
           "time.sleep(3600)\n")
# The same on a machine without CUDA: holds nothing, so the code path runs (CPU smoke runs).
_BALLAST_CPU = "import time\nprint('ready 0 (no GPU: nothing held)', flush=True)\ntime.sleep(3600)\n"


class Ballast:
    """`with Ballast(cap_gib, device):` a process holding all but `cap_gib` GiB of the GPU's
    free memory while the block runs (nothing for a cap of 0); `line` is what it said.
    Subclasses hold something else by giving another `command` (ram_ballast.RamBallast)."""

    def __init__(self, cap_gib: float, device: str = "cuda"):
        self.cap_gib, self.device, self.proc, self.line = cap_gib, device, None, ""

    def command(self) -> list[str]:
        if self.device == "cuda":
            torch.cuda.empty_cache()   # it sizes itself from what is free now
        return [sys.executable, "-c", BALLAST if self.device == "cuda" else _BALLAST_CPU, str(self.cap_gib)]

    def __enter__(self) -> "Ballast":
        if self.cap_gib > 0:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, text=True)
            self.line = self.proc.stdout.readline().strip()
            if not self.line.startswith("ready"):
                self.__exit__(None, None, None)
                raise RuntimeError(f"{type(self).__name__} for {self.cap_gib:g} GB did not start "
                                   f"(rc {self.proc.returncode if self.proc else None}): {self.line!r}")
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


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


def device_used_bytes() -> int | None:
    """Memory in use on the current CUDA device by every process (total - free): sees
    allocations outside torch's allocator too (comfy-aimdo's dynamic VRAM)."""
    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return total - free


class RssSampler:
    """Peak RSS sampled by a thread (VmHWM never resets, so per-configuration peaks need this);
    with `vram=True` also the peak of device_used_bytes()."""

    def __init__(self, interval: float = 0.02, vram: bool = False):
        self.interval = interval
        self.peak = 0
        self.vram = vram and torch.cuda.is_available()
        self.vram_peak = None
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> "RssSampler":
        self.peak = rss_bytes()
        self.vram_peak = device_used_bytes() if self.vram else None
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, rss_bytes())
            if self.vram:
                self.vram_peak = max(self.vram_peak, device_used_bytes())

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, rss_bytes())
        return self.peak


def pinned_bytes() -> dict:
    """Page-locked host bytes this process holds, where it can be seen: ComfyUI's own count
    (cudaHostRegister, RingSwap's pins included: it counts them there) and torch's caching
    host allocator (pin_memory(), e.g. diffusers' group offloading)."""
    out = {}
    mm = sys.modules.get("comfy.model_management")
    if mm is not None and hasattr(mm, "TOTAL_PINNED_MEMORY"):
        out["comfy_registered"] = int(mm.TOTAL_PINNED_MEMORY)
    if torch.cuda.is_available() and hasattr(torch.cuda, "host_memory_stats"):
        try:
            st = torch.cuda.host_memory_stats()   # the host allocator's keys have no pool part
            out["torch_host_alloc"] = int(st.get("allocated_bytes.current", st.get("allocated_bytes.all.current", 0)))
        except Exception:   # noqa: BLE001  (older torch: no such counter)
            pass
    out["total"] = sum(out.values())
    return out


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


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


def make_inputs(tokens: int, dev: torch.device, dtype: torch.dtype, ctx_len: int, seed: int, batch: int = 1):
    """One model call's inputs; batch 2 = cond and uncond batched (a cfg > 1 step)."""
    f, h, w = latent_shape(tokens)
    g = torch.Generator(device=dev).manual_seed(seed)
    return (torch.randn(batch, 16, f, h, w, device=dev, dtype=dtype, generator=g),
            torch.tensor([500.0] * batch, device=dev),
            torch.randn(batch, ctx_len, 4096, device=dev, dtype=dtype, generator=g))


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



# ------------------------------------------------------------------------ output, child processes

def env_info(dev: torch.device) -> dict:
    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": str(dev),
            "cpus": os.cpu_count()}
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["gpu_uuid"] = str(getattr(torch.cuda.get_device_properties(dev), "uuid", "")) or None   # which card
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
        git = ["git", "-C", REPO]
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        # the device's copy of the tree can carry an older .git: "+changes" says the tree is not HEAD
        info["commit"] = (head.stdout.strip() + ("+changes" if dirty else "")) or None
    except Exception:   # noqa: BLE001
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gb"] = int(f.readline().split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return info


def fmt_num(v, spec: str = ".2f", none: str = "—") -> str:
    return none if v is None else format(v, spec)


def md_table(headers: list[str], rows: list[list]) -> str:
    """A markdown table; cells are str()-ed."""
    out = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def write_json(path: str | None, data: dict) -> None:
    """Write `data` to `path` atomically (a run killed at its time limit keeps the last one)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


def child_result(cmd: list[str], timeout_s: float, env: dict | None = None, cwd: str | None = None) -> dict:
    """Run a benchmark child process; its result is the JSON after the last `RESULT ` line of
    its stdout. On failure: {"error": tail of its output, "rc": exit status}."""
    t0 = time.perf_counter()
    env = dict(os.environ if env is None else env, RINGSWAP_CHILD_TIMEOUT_S=str(timeout_s))
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return {"error": f"timed out after {timeout_s:.0f} s: {tail[-12000:]}", "rc": 124}
    found = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not found:
        return {"error": (p.stderr or p.stdout)[-3000:], "rc": p.returncode}
    r = json.loads(found[-1][len("RESULT "):])
    r["wall_s"] = time.perf_counter() - t0
    r["log_tail"] = [ln for ln in p.stderr.splitlines() if "RingSwap" in ln][-6:]
    return r


def base_parser(doc: str, child_choices: tuple | None = None) -> argparse.ArgumentParser:
    """The options every parent/child benchmark here shares (compare, and the probes
    auto_window and dynamic_vram): device, --small, token counts, text length, model directory, --json."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if child_choices:
        ap.add_argument("--child", choices=child_choices, help=argparse.SUPPRESS)
    else:
        ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny model (CPU check of the code paths)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default 7800 32760 (--small: 64)")
    ap.add_argument("--ctx-len", type=int, default=512)
    ap.add_argument("--dir", default="/tmp/ringswap_bench")
    ap.add_argument("--json", default=None)
    return ap


def start(a, child) -> bool:
    """The shared start of a parent/child benchmark: default token counts; in a child
    (--child) print `RESULT <json of child(a)>` and return True; in a parent on the CPU
    tell ComfyUI so before it looks for CUDA."""
    a.tokens = a.tokens or ([64] if a.small else [7800, 32760])
    if a.child:
        if os.environ.get("RINGSWAP_CHILD_TIMEOUT_S"):   # a hang shows its stacks before the kill
            import faulthandler
            faulthandler.dump_traceback_later(max(5.0, float(os.environ["RINGSWAP_CHILD_TIMEOUT_S"]) - 8.0))
        print("RESULT " + json.dumps(child(a), default=str), flush=True)
        return True
    if a.device == "cpu":
        from comfy.cli_args import args
        args.cpu = True
    return False


def sample_steps(model, tokens: int, steps: int, ctx_len: int,
                 on_step: Callable[[int], None] | None = None, cfg: float = 1.0) -> list[float]:
    """Seconds per step of ComfyUI's own sampling path (comfy.sample.sample, euler; cfg 1:
    the cond alone; cfg > 1: cond and a different uncond, batched or not as ComfyUI and the
    model's patcher decide), from the step callback's time stamps; `on_step(i)` runs in
    that callback after step i's time stamp. The device is synchronised before the first
    and the last stamp only: a path that never waits for the GPU runs ahead of it by a
    varying part of a step (its second step reads short), so only the sum of the steps
    after the first is exact: see steady_s."""
    import comfy.sample
    f, h, w = latent_shape(tokens)
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(1, 16, f, h, w, generator=g)
    cond = [[torch.randn(1, ctx_len, 4096, generator=g), {}]]
    uncond = [[torch.randn(1, ctx_len, 4096, generator=g), {}]]
    stamps = []

    dev = getattr(model, "load_device", None)

    def step_done(i: int, *_) -> None:
        if i in (0, steps - 1) and isinstance(dev, torch.device):
            sync(dev)
        stamps.append(time.perf_counter())
        if on_step is not None:
            on_step(i)

    t0 = time.perf_counter()
    comfy.sample.sample(model, noise, steps, cfg, "euler", "simple", cond, uncond, torch.zeros_like(noise),
                        callback=step_done, disable_pbar=True, seed=0)
    return [b - a_ for a_, b in zip([t0] + stamps[:-1], stamps)]


def steady_s(times: list[float]) -> float | None:
    """s/step after the first (warm-up, load) step: the mean of the others, exact between
    sample_steps' two synchronisations (a median of unsynchronised steps is not)."""
    rest = times[1:]
    return sum(rest) / len(rest) if rest else None


def child_args(a, names: list[str]) -> list[str]:
    """The options `names` (attributes of `a`) as command-line arguments for a child."""
    out = []
    for n in names:
        v = getattr(a, n)
        if v is None or v is False:
            continue
        out.append("--" + n.replace("_", "-"))
        if isinstance(v, (list, tuple)):
            out += [str(x) for x in v]
        elif v is not True:
            out.append(str(v))
    return out
