"""RingSwap Model Loader memory behaviour (issue 3), real ComfyUI on CPU:

- home=disk reads no block byte before sampling starts; home=ram reads every block
  exactly once, at load, and nothing while sampling (the RangeReader's counters);
- RSS during disk-mode sampling stays within (window + prefetch + disk_workers) blocks,
  and stays flat from run to run (psutil, sampled from a thread, in a fresh process);
- ram and disk homes give the same outputs as ComfyUI's stock loader, bit for bit.

Run as a script (`--rss-child ...`) this file is the child process of the RSS test.
"""
import gc
import json
import os
import shutil
import subprocess
import sys
import threading
import time

if __name__ == "__main__":    # child process of test_disk_home_rss_stays_within_bound
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import conftest  # noqa: F401  (ComfyUI on sys.path, CPU mode, the pack as `ringswap`)

import psutil
import pytest
import torch

import comfy.model_management
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.swap import host_pool
from ringswap.loaders.model_file.safetensors_index import MAPPED_MIN, SafetensorsIndex
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from wan_model import conditioning, forward, inputs, latent, load_stock, tiny_wan

BLOCKS = 8
MiB = 1 << 20


def reader_of(model):
    """The loader's RangeReader: engine.read_block is BlockReads.read_block (a bound method)."""
    return model.swap_engine.read_block.__self__.reader


def file_block_bytes(path) -> int:
    idx = SafetensorsIndex.open(path)
    return sum(sum(t.nbytes for t in ts) for ts in idx.blocks_by_index("blocks.").values())


def ksample(model, seed=11, steps=3):
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 1.0, "euler", "simple",
                                          conditioning(1), conditioning(2), latent())
    return out["samples"].clone()


def bound_blocks(model) -> list[int]:
    """Blocks whose weights are real (non-empty) tensors right now."""
    return [s.index for s in model.swap_engine.states
            if any(t.numel() for t in s.binding.current())]


@pytest.fixture(scope="module", autouse=True)
def _fast_and_quiet(fast_and_quiet):
    yield


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def wan(request, tmp_path_factory):
    path = tiny_wan(str(tmp_path_factory.mktemp("wan_mem")), blocks=BLOCKS, dtype=request.param, seed=2)
    stock = load_stock(path)
    outs = [forward(stock, *inputs(seed=s)) for s in range(3)]
    run = ksample(stock)
    comfy.model_management.unload_all_models()
    return path, outs, run


# ----- what is read, and when --------------------------------------------------------------
def test_disk_home_reads_nothing_before_sampling(wan):
    path, ref_outs, _ = wan
    model = load_swapped_model(path, SwapSettings(2, 1), home="disk", disk_workers=2)
    reader = reader_of(model)
    assert reader.bytes_read == 0 and reader.reads == 0, "home=disk read block bytes while loading"
    assert bound_blocks(model) == [], "home=disk holds block weights before sampling"
    assert model.swap_engine.pool.nbytes == 0
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    first = reader.bytes_read
    assert first >= file_block_bytes(path) * (BLOCKS - 1) // BLOCKS, \
        f"a forward read only {first} block bytes"
    assert reader.reads > 0
    forward(model, *inputs(seed=1))
    assert reader.bytes_read > first, "streamed blocks are read again on every forward"


def test_ram_home_reads_every_block_once_at_load(wan):
    path, ref_outs, ref_run = wan
    model = load_swapped_model(path, SwapSettings(2, 1), home="ram", disk_workers=2)
    reader = reader_of(model)
    total = file_block_bytes(path)
    assert reader.bytes_read == total, f"read {reader.bytes_read} bytes at load, blocks are {total}"
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    assert torch.equal(ksample(model), ref_run)
    comfy.model_management.unload_all_models()
    assert torch.equal(ksample(model), ref_run)
    assert reader.bytes_read == total, "home=ram read from the file while sampling"


def test_nonblock_weights_are_aligned_as_the_stock_loaders(wan):
    """A non-block weight the model keeps in the file's dtype (fp32 on the CPU) is copied out of the
    file's pages 64-byte aligned, where ComfyUI's load copies it into its own tensor (CPU matmuls
    round differently at other alignments: this file's tensors start off 64, some at 8 mod 16, which
    gave other outputs on an AVX2 CPU); a bf16 file's are cast to the model's fp32 as ComfyUI's load
    casts them. The same alignments as the stock loader's, and bit-exact."""
    path, ref_outs, _ = wan
    model = load_swapped_model(path, SwapSettings(2, 1), home="ram", disk_workers=2)
    index = SafetensorsIndex.open(path)
    kept = {n: p for n, p in model.model.diffusion_model.named_parameters() if not n.startswith("blocks.")}
    assert kept and all(p.dtype == torch.float32 for p in kept.values())
    assert any(index[n].start % 64 for n in kept), "every non-block tensor starts 64-aligned: the test shows nothing"
    stock = dict(load_stock(path).model.diffusion_model.named_parameters())
    assert {n: p.data_ptr() % 64 for n, p in kept.items()} == {n: stock[n].data_ptr() % 64 for n in kept}
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    comfy.model_management.unload_all_models()


def test_nonblock_weights_keep_nothing_of_the_file_mapped(wan, tmp_path):
    """The non-block weights are cast (bf16 file) or copied (fp32) from a mapping of the file
    (SafetensorsIndex.mapped_tensors), which nothing keeps after the load: the file is no longer
    mapped (Linux: /proc/self/maps), and truncated to nothing it leaves a home=ram model exact."""
    src, ref_outs, _ = wan
    path = str(tmp_path / os.path.basename(src))
    shutil.copyfile(src, path)
    model = load_swapped_model(path, SwapSettings(2, 1), home="ram", disk_workers=2)
    gc.collect()
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            assert os.path.realpath(path) not in f.read(), "the loaded model keeps the file mapped"
    os.truncate(path, 0)
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    comfy.model_management.unload_all_models()


def test_nonblock_weights_are_page_locked_for_comfyuis_copy(wan):
    """Every non-block weight of a RingSwap load of 1 MiB or more (smaller ones are read into or made in
    malloc's memory) lives in a mapping of its own (host_pool.mapped_bytes),
    which locked_while page-locks while ComfyUI's load copies it to the GPU (from pageable memory that
    copy ran at ~2.8 GB/s) and lets go after: on a GPU all its bytes at once, then again (nothing was
    left registered); on the CPU nothing."""
    path, ref_outs, _ = wan
    model = load_swapped_model(path, SwapSettings(2, 1), home="auto", disk_workers=2)
    kept = [t for n, t in (*model.model.diffusion_model.named_parameters(), *model.model.diffusion_model.named_buffers())
            if not n.startswith("blocks.") and t.untyped_storage().nbytes() >= MAPPED_MIN]
    assert kept and all(t.untyped_storage().data_ptr() in host_pool._REGIONS for t in kept)
    nbytes = sum(t.untyped_storage().nbytes() for t in kept)
    for _ in range(2):
        with host_pool.locked_while(kept) as locked:
            assert locked >= nbytes if torch.cuda.is_available() else locked == 0
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    comfy.model_management.unload_all_models()


def test_disk_home_holds_no_block_memory_after_unload(wan):
    """After ComfyUI unloads the model, no block of a disk-home model keeps weights: the
    resident blocks' device buffers must be given back too (on CUDA they are VRAM that
    ComfyUI believes free)."""
    path, ref_outs, _ = wan
    model = load_swapped_model(path, SwapSettings(3, 1), home="disk", disk_workers=2)
    assert torch.equal(forward(model, *inputs(seed=0)), ref_outs[0])
    resident = model.swap_engine.plan.resident
    assert resident, "the plan should keep some blocks resident"
    comfy.model_management.unload_all_models()
    assert not model.swap_engine.attached
    assert bound_blocks(model) == [], (f"blocks {bound_blocks(model)} still hold their weights after "
                                      f"unloading (resident: {list(resident)})")


# ----- outputs ----------------------------------------------------------------------------
@pytest.mark.parametrize("window,prefetch,workers", [(2, 1, 2), (1, 0, 1), (BLOCKS, 1, 4)])
def test_ram_and_disk_equal_stock_bit_for_bit(wan, window, prefetch, workers):
    path, ref_outs, ref_run = wan
    results = {}
    for home in ("ram", "disk"):
        model = load_swapped_model(path, SwapSettings(window, prefetch), home=home, disk_workers=workers)
        outs = [forward(model, *inputs(seed=s)) for s in range(3)]
        run = ksample(model)
        for k, (a, b) in enumerate(zip(outs, ref_outs)):
            assert torch.equal(a, b), f"home={home}: forward {k} differs from the stock loader"
        assert torch.equal(run, ref_run), f"home={home}: sampling differs from the stock loader"
        results[home] = (outs, run)
        comfy.model_management.unload_all_models()
        del model
    assert all(torch.equal(a, b) for a, b in zip(results["ram"][0], results["disk"][0]))
    assert torch.equal(results["ram"][1], results["disk"][1])


# ----- RSS in disk mode ---------------------------------------------------------------------
# Bound (issue 3): host memory held for blocks <= (window + prefetch + disk_workers) blocks.
# On the CPU the compute "device" is host RAM too, so it all shows in RSS:
#   - device buffers: (window - 1) resident blocks + a ring of (prefetch + 1) slots
#     = window + prefetch blocks (engine.device_bytes());
#   - host staging for reads ahead: disk_workers buffers of one block each;
# each block counted at its size in memory (`engine.block_bytes()`): ComfyUI on CPU upcasts
# bf16 weights to fp32, so that is twice the block's bytes in the file.
# SLACK covers what is not block weights: activations, the temporary each file tensor is
# read into before its cast to fp32 (the largest is 4 MiB here), thread stacks and malloc
# arenas (measured: 10-35 MiB). It is kept below one block (48 MiB) so that one block
# too many fails.
RSS_DIM, RSS_FFN, RSS_BLOCKS = 1024, 2048, 8     # 25 MB per block in bf16 on disk, 50 MB in RAM
RSS_WINDOW, RSS_PREFETCH, RSS_WORKERS = 2, 1, 2
RSS_RUNS = 5
SLACK = 40 * MiB


def write_big_wan(path, dim, blocks, ffn, seed=5):
    """A Wan t2v file in bf16 with ComfyUI's keys and shapes (from a meta-device WanModel),
    written tensor by tensor: this process never holds more than one tensor of it."""
    import struct
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    from support.wan_files import WEIGHT_STD, _is_norm_weight
    from ringswap.loaders.comfyui_adapter.comfy_models import static_construction
    with torch.device("meta"), static_construction():
        m = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=dim, ffn_dim=ffn,
                     freq_dim=256, text_dim=4096, out_dim=16, num_heads=dim // 128, num_layers=blocks,
                     qk_norm=True, cross_attn_norm=True, eps=1e-6, device="meta",
                     operations=comfy.ops.disable_weight_init)
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    header, pos = {}, 0
    for k in sorted(shapes):
        n = 2
        for d in shapes[k]:
            n *= d
        header[k] = {"dtype": "BF16", "shape": list(shapes[k]), "data_offsets": [pos, pos + n]}
        pos += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    # Values: windows of one pool of random numbers (generating 100 M of them is slow).
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 23, generator=g) * WEIGHT_STD).to(torch.bfloat16)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for i, k in enumerate(sorted(shapes)):
            n = header[k]["data_offsets"][1] // 2 - header[k]["data_offsets"][0] // 2
            start = (i * 7919) % (pool.numel() - n + 1)     # every tensor is < 8 M values
            t = pool[start:start + n]
            if _is_norm_weight(k):
                t = t + 1.0
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes())
    return path


@pytest.fixture(scope="module")
def big_wan(tmp_path_factory):
    path = write_big_wan(os.path.join(str(tmp_path_factory.mktemp("wan_big")), "wan_big.safetensors"),
                         RSS_DIM, RSS_BLOCKS, RSS_FFN)
    yield path
    os.remove(path)    # 210 MB: do not leave it in pytest's kept temp folders


def rss_child(path, small_dir, window, prefetch, workers, runs, experts=1):
    """In a fresh process: warm up ComfyUI's sampling on a tiny stock model, load `path`
    with home=disk, then run KSampler `runs` times while a thread samples RSS every 2 ms."""
    proc = psutil.Process()
    small = load_stock(tiny_wan(small_dir, dtype=torch.bfloat16))
    ksample(small)
    comfy.model_management.unload_all_models()
    del small
    models = [load_swapped_model(path, SwapSettings(window, prefetch), home="disk", disk_workers=workers)
              for _ in range(experts)]
    model = models[0]
    engine = model.swap_engine
    gc.collect()
    base = proc.memory_info().rss
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    peaks, after, held = [], [], []
    try:
        for _ in range(runs):
            if experts == 1:
                ksample(model, seed=5, steps=2)
            else:   # Wan 2.2 style: the first expert for step 1, the second for step 2
                adv = comfy_nodes.KSamplerAdvanced()
                (mid,) = adv.sample(models[0], "enable", 5, 2, 1.0, "euler", "simple", conditioning(1),
                                    conditioning(2), latent(), 0, 1, "enable")
                adv.sample(models[1], "disable", 5, 2, 1.0, "euler", "simple", conditioning(1),
                           conditioning(2), mid, 1, 10000, "disable")
            rss_now = proc.memory_info().rss
            peak[0] = max(peak[0], rss_now)
            peaks.append(peak[0] - base)
            after.append(rss_now)
            att = engine.att
            held.append(engine.device_bytes() + (att.readahead.nbytes if att and att.readahead else 0))
    finally:
        stop.set()
        t.join()
    return {"base": base, "peaks": peaks, "after": after, "engine_held": held,
            "block_bytes": engine.block_bytes(), "blocks": engine.num_blocks,
            "bytes_read": reader_of(model).bytes_read}


@pytest.mark.parametrize("experts", [1, 2])
def test_disk_home_rss_stays_within_bound(big_wan, tmp_path, experts):
    """One model: the bound below. Two (Wan 2.2's experts, alternating every run): within
    1.2 x one expert's bound, since only the active expert holds staging buffers."""
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", big_wan, str(tmp_path),
           str(RSS_WINDOW), str(RSS_PREFETCH), str(RSS_WORKERS), str(RSS_RUNS), str(experts)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"},
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RSS_RESULT ")]
    assert p.returncode == 0 and lines, \
        f"child failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    r = json.loads(lines[-1][len("RSS_RESULT "):])
    block = r["block_bytes"]
    assert block >= 20e6, f"blocks of {block / MiB:.1f} MiB in RAM: below the issue's 20 MB"
    assert r["bytes_read"] > 0
    bound_n = RSS_WINDOW + RSS_PREFETCH + RSS_WORKERS
    bound = bound_n * block
    # What the engine itself holds at the end of each run is exactly the bound.
    assert all(h <= bound for h in r["engine_held"]), r["engine_held"]
    peaks = ", ".join(f"{x / MiB:.0f}" for x in r["peaks"])
    detail = (f"peak RSS growth per run (MiB, cumulative): {peaks}; bound {bound_n} blocks x "
              f"{block / MiB:.1f} MiB = {bound / MiB:.0f} MiB + slack {SLACK / MiB:.0f} MiB; "
              f"RSS after each run (MiB): {[round(a / MiB) for a in r['after']]}")
    limit = (bound + SLACK) * (1.0 if experts == 1 else 1.2)
    assert max(r["peaks"]) <= limit, f"RSS grew beyond the disk-home bound ({experts} experts): " + detail
    growth = (r["after"][-1] - r["after"][1]) / r["after"][1]
    assert growth < 0.02, f"RSS grew {100 * growth:.1f}% from run 2 to run {RSS_RUNS}: " + detail


if __name__ == "__main__" and sys.argv[1:2] == ["--rss-child"]:
    path, small_dir, w, pf, dw, n, ex = sys.argv[2:9]
    result = rss_child(path, small_dir, int(w), int(pf), int(dw), int(n), int(ex))
    print("RSS_RESULT " + json.dumps(result), flush=True)
