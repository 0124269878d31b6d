"""Bad input to the RingSwap Model Loader (issue 3): every broken file gives a clear error
naming the file and the problem and leaves nothing held (no open file descriptors, no
live engine/reader/model objects, flat RSS over repeated failing loads); a read that
fails mid-run (the file truncated after loading) raises promptly, and the next run after
the file is restored in place is exact again. Real ComfyUI on CPU, nothing mocked.
"""
import gc
import json
import os
import re
import struct
import threading

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

import comfy.model_management
import folder_paths
import nodes as comfy_nodes

from ringswap.loaders.model_file.range_reader import BlockReadError, FileChangedError, RangeReader
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ringswap.nodes.model_loader import RingSwapModelLoader
from ringswap.swap.engine import BlockSwapEngine
from wan_model import conditioning, forward, inputs, latent, load_stock, tiny_wan
from support.engine_plans import blocks_on_device

TIMEOUT = 60          # seconds a failing run may take before we call it a hang
RSS_SLACK = 3 << 20   # "a few MB" over 5 repeated failing loads


# ----- helpers ---------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _fast_and_quiet(fast_and_quiet):
    yield


def live_loader_objects() -> dict:
    """Objects a half-finished load could leave behind (call after gc.collect())."""
    from comfy.ldm.wan.model import WanModel
    kinds = (RangeReader, BlockSwapEngine, SwapModelPatcher, WanModel)
    out = {k.__name__: 0 for k in kinds}
    for o in gc.get_objects():
        t = type(o)   # exact type: isinstance() would trip lazy proxies' __class__
        if t in kinds:
            out[t.__name__] += 1
    return out


def held() -> tuple[int, dict, int]:
    """(open file descriptors, live loader objects, RSS bytes), after a full collection."""
    gc.collect()
    return (len(os.listdir("/proc/self/fd")), live_loader_objects(),
            psutil.Process().memory_info().rss)


def fd_count() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def failing_load(path, home="ram", **kw) -> tuple[type, str]:
    """Load that must fail; returns (exception type, message) and drops the traceback
    (its frames would keep the half-built model alive)."""
    try:
        load_swapped_model(str(path), SwapSettings(kw.pop("window", 2), kw.pop("prefetch", 1)),
                           home=home, disk_workers=kw.pop("disk_workers", 2))
    except Exception as e:  # noqa: BLE001 - the type is checked by the caller
        return type(e), str(e)
    raise AssertionError(f"loading {path} did not fail")


def read_header(path) -> tuple[dict, bytes]:
    with open(path, "rb") as f:
        raw = f.read()
    (hlen,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + hlen]), raw[8 + hlen:]


def write_with_header(path, header: dict, data: bytes) -> str:
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
    return str(path)


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    """A tiny bf16 Wan (5 blocks) and its raw bytes."""
    path = tiny_wan(str(tmp_path_factory.mktemp("wan_ok")), dtype=torch.bfloat16)
    # Warm up every code path once (ComfyUI's lazy imports and caches are not a leak).
    for home in ("ram", "disk"):
        forward(load_swapped_model(path, SwapSettings(2, 1), home=home, disk_workers=2), *inputs(seed=0))
        comfy.model_management.unload_all_models()
    gc.collect()
    with open(path, "rb") as f:
        return path, f.read()


# ----- every broken file ---------------------------------------------------------------
def _truncated(d, path, raw):
    p = os.path.join(d, "truncated.safetensors")
    with open(p, "wb") as f:
        f.write(raw[:len(raw) - 4096])     # header intact, data short
    return p, (r"tensor '[\w.]+' ends at byte \d+ of the data but the file holds "
               r"only \d+ data bytes \(truncated file\?\)")


def _header_too_long(d, path, raw):
    p = os.path.join(d, "hlen.safetensors")
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", 2 * len(raw)) + raw[8:])
    return p, rf"header length field says {2 * len(raw)} bytes but the file has only {len(raw) - 8}"


def _bad_json(d, path, raw):
    (hlen,) = struct.unpack("<Q", raw[:8])
    p = os.path.join(d, "json.safetensors")
    with open(p, "wb") as f:
        head = b'{"blocks.0.x": {"dtype": '
        f.write(raw[:8] + head + b" " * (hlen - len(head)) + raw[8 + hlen:])
    return p, r"header is not valid JSON"


def _overlap(d, path, raw):
    header, data = read_header(path)
    header["blocks.1.self_attn.k.weight"]["data_offsets"] = list(
        header["blocks.1.self_attn.q.weight"]["data_offsets"])    # same size, same bytes
    p = write_with_header(os.path.join(d, "overlap.safetensors"), header, data)
    return p, (r"tensor 'blocks\.1\.self_attn\.(q|k)\.weight' \(data bytes \d+\.\.\d+\) overlaps "
               r"tensor 'blocks\.1\.self_attn\.(q|k)\.weight'")


def _past_data(d, path, raw):
    header, data = read_header(path)
    e = header["blocks.2.ffn.0.weight"]
    b, end = e["data_offsets"]
    e["data_offsets"] = [len(data) - (end - b) + 512, len(data) + 512]
    p = write_with_header(os.path.join(d, "past.safetensors"), header, data)
    return p, (rf"tensor 'blocks\.2\.ffn\.0\.weight' ends at byte {len(data) + 512} of the data but "
               rf"the file holds only {len(data)} data bytes")


def _unknown_dtype(d, path, raw):
    header, data = read_header(path)
    header["blocks.3.norm3.weight"]["dtype"] = "Q3_K"
    p = write_with_header(os.path.join(d, "dtype.safetensors"), header, data)
    return p, r"tensor 'blocks\.3\.norm3\.weight': unknown dtype 'Q3_K' \(known: .*BF16"


def _not_a_dit(d, path, raw):
    p = os.path.join(d, "random.safetensors")
    g = torch.Generator().manual_seed(0)
    save_file({"encoder.weight": torch.randn(64, 32, generator=g),
               "encoder.bias": torch.randn(64, generator=g),
               "layers.0.weight": torch.randn(32, 32, generator=g)}, p)
    return p, r"ComfyUI does not recognise this diffusion model"


def _missing(key):
    def make(d, path, raw):
        sd = load_file(path)
        del sd[key]
        p = os.path.join(d, f"missing_{key}.safetensors")
        save_file(sd, p)
        return p, rf"(missing|no) tensor '{re.escape(key)}'|'{re.escape(key)}'.*missing"
    make.__name__ = f"_missing_{key}"
    return make


BROKEN = {
    "truncated": _truncated,
    "header_length_larger_than_file": _header_too_long,
    "invalid_json": _bad_json,
    "overlapping_offsets": _overlap,
    "offsets_past_data": _past_data,
    "unknown_dtype": _unknown_dtype,
    "not_a_dit": _not_a_dit,
    "missing_block1_key": _missing("blocks.1.ffn.0.weight"),
    "missing_last_block_key": _missing("blocks.4.self_attn.q.weight"),
    # blocks.0 keys are also what ComfyUI's model detection reads (ffn_dim, ...)
    "missing_block0_key": _missing("blocks.0.ffn.0.weight"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_file_gives_clear_error_and_holds_nothing(wan, tmp_path, case):
    path, raw = wan
    bad, pattern = BROKEN[case](str(tmp_path), path, raw)
    # A warm-up failing load of each home first: one-time imports/caches are not a leak.
    failing_load(bad, "ram")
    failing_load(bad, "disk")
    fds, objs, mem = held()
    for home in ("ram", "disk", "ram", "disk", "ram"):
        etype, msg = failing_load(bad, home)
        gc.collect()   # as ComfyUI's prompt loop does: a half-built model may be cyclic garbage
        assert issubclass(etype, (ValueError, OSError)), f"home={home}: {etype.__name__}: {msg}"
        assert bad in msg, f"home={home}: the error does not name the file: {etype.__name__}: {msg}"
        assert re.search(pattern, msg), f"home={home}: unclear error: {etype.__name__}: {msg}"
    fds2, objs2, mem2 = held()
    assert fds2 == fds, "file descriptors left open by failing loads"
    assert objs2 == objs, f"failing loads left objects alive: {objs} -> {objs2}"
    assert mem2 - mem < RSS_SLACK, f"RSS grew by {(mem2 - mem) / 2**20:.1f} MiB over 5 failing loads"


@pytest.fixture
def models_folder(tmp_path):
    """tmp_path as a ComfyUI diffusion_models folder (removed again afterwards)."""
    folder_paths.add_model_folder_path("diffusion_models", str(tmp_path))
    yield str(tmp_path)
    folder_paths.folder_names_and_paths["diffusion_models"][0].remove(str(tmp_path))


def test_node_reports_bad_file_by_name(wan, models_folder):
    """Through the node class, with the file found by ComfyUI's folder_paths."""
    path, raw = wan
    bad, pattern = _truncated(models_folder, path, raw)
    name = os.path.basename(bad)
    assert name in folder_paths.get_filename_list("diffusion_models")
    fds = fd_count()
    for home in ("ram", "disk"):
        with pytest.raises(ValueError) as ei:
            RingSwapModelLoader().load(name, 2, 1, home, "auto", 2)
        assert bad in str(ei.value) and re.search(pattern, str(ei.value)), str(ei.value)
        del ei
    assert fd_count() == fds
    # and the same node loads a good file from that folder
    with open(os.path.join(models_folder, "good.safetensors"), "wb") as f:
        f.write(raw)
    (model,) = RingSwapModelLoader().load("good.safetensors", 2, 1, "disk", "auto", 2)
    assert isinstance(model, SwapModelPatcher)
    ref = forward(load_stock(path), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    assert torch.equal(forward(model, *inputs(seed=0)), ref)


# ----- a read failing mid-run -------------------------------------------------------------
def run_with_timeout(fn, timeout=TIMEOUT):
    """fn() on a thread; (result, exception). Fails the test if it does not finish."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung: still running after {timeout} s"
    return box.get("result"), box.get("error")


def ksample(model, seed=11, steps=3):
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 1.0, "euler", "simple",
                                          conditioning(1), conditioning(2), latent())
    return out["samples"].clone()


@pytest.fixture
def wan8(tmp_path):
    """A private copy (it gets truncated) of a tiny 8-block bf16 Wan, and references."""
    path = tiny_wan(str(tmp_path), blocks=8, dtype=torch.bfloat16, seed=4)
    with open(path, "rb") as f:
        raw = f.read()
    stock = load_stock(path)
    ref_fwd = forward(stock, *inputs(seed=0))
    ref_run = ksample(stock)
    comfy.model_management.unload_all_models()
    del stock
    return path, raw, ref_fwd, ref_run


def truncate_half(path, raw):
    os.truncate(path, len(raw) // 2)


def restore_in_place(path, raw):
    """Write the original bytes back into the same inode (as the loader's fds see it)."""
    ino = os.stat(path).st_ino
    with open(path, "r+b") as f:
        f.write(raw)
    assert os.stat(path).st_ino == ino and os.path.getsize(path) == len(raw)


def check_read_error(err, path):
    assert err is not None, "the run after truncation did not fail"
    assert isinstance(err, OSError), f"{type(err).__name__}: {err}"
    assert path in str(err), f"the error does not name the file: {err}"
    assert re.search(r"truncated|ended|short", str(err)), str(err)


def test_truncated_between_runs_raises_then_recovers(wan8):
    """home=disk: truncate after a good forward; the next forward fails with a clear error
    naming the file (no hang); the model keeps refusing the file once it is restored (its
    blocks would not be the model loaded), a new load of the restored file is exact, and
    no file descriptor outlives the models."""
    path, raw, ref_fwd, _ = wan8
    fds = fd_count()
    model = load_swapped_model(path, SwapSettings(2, 1), home="disk", disk_workers=2)
    assert torch.equal(forward(model, *inputs(seed=0)), ref_fwd)
    truncate_half(path, raw)
    _, err = run_with_timeout(lambda: forward(model, *inputs(seed=0)))
    check_read_error(err, path)
    del err
    restore_in_place(path, raw)
    comfy.model_management.unload_all_models()
    _, err = run_with_timeout(lambda: forward(model, *inputs(seed=0)))
    assert isinstance(err, FileChangedError) and path in str(err) and "load the model again" in str(err), err
    assert not model.swap_engine.attached and not blocks_on_device(model.swap_engine)
    del err
    comfy.model_management.unload_all_models()
    fresh = load_swapped_model(path, SwapSettings(2, 1), home="disk", disk_workers=2)
    out, err = run_with_timeout(lambda: forward(fresh, *inputs(seed=0)))
    assert err is None, err
    assert torch.equal(out, ref_fwd)
    comfy.model_management.unload_all_models()
    del model, fresh, out
    gc.collect()
    assert fd_count() == fds, "the loader's file descriptors outlived the models"


def test_truncated_inside_a_sampling_run_raises_then_recovers(wan8):
    """The file is truncated while a block runs (mid-step, streamed blocks still to read):
    KSampler fails with the read error, no block stays bound to a ring slot, and a new
    load of the restored file samples as the stock run."""
    path, raw, _, ref_run = wan8
    fds = fd_count()
    model = load_swapped_model(path, SwapSettings(1, 0), home="disk", disk_workers=1)
    engine = model.swap_engine
    assert torch.equal(ksample(model), ref_run)
    calls = []

    def truncate_once(module, args):
        calls.append(1)
        if len(calls) == 12:          # step 2, block 3 of 8
            truncate_half(path, raw)

    hooks = [s.block.register_forward_pre_hook(truncate_once) for s in engine.states]
    try:
        _, err = run_with_timeout(lambda: ksample(model))
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) >= 12
    check_read_error(err, path)
    del err
    assert all(s.slot is None for s in engine.states), "a block was left bound to a ring slot"
    restore_in_place(path, raw)
    comfy.model_management.unload_all_models()
    fresh = load_swapped_model(path, SwapSettings(1, 0), home="disk", disk_workers=1)
    out, err = run_with_timeout(lambda: ksample(fresh))
    assert err is None, err
    assert torch.equal(out, ref_run)
    comfy.model_management.unload_all_models()
    del model, engine, fresh, out
    gc.collect()
    assert fd_count() == fds, "the loader's file descriptors outlived the models"


def test_read_error_type_is_block_read_error(wan8):
    """The mid-run error is a BlockReadError (an OSError): here the file check's
    FileChangedError, which names the file and the truncation."""
    path, raw, _, _ = wan8
    model = load_swapped_model(path, SwapSettings(1, 0), home="disk", disk_workers=1)
    forward(model, *inputs(seed=0))
    truncate_half(path, raw)
    _, err = run_with_timeout(lambda: forward(model, *inputs(seed=0)))
    restore_in_place(path, raw)
    assert isinstance(err, BlockReadError), f"{type(err).__name__}: {err}"
    assert re.search(rf"truncated from {len(raw)} to {len(raw) // 2} bytes", str(err)), str(err)
