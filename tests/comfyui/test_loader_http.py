"""RingSwap Model Loader inside a running ComfyUI server, driven over its HTTP API:
the node is listed with its widgets and tooltips, and RingSwapModelLoader -> KSampler ->
SaveLatent gives the same latent as the stock UNETLoader -> KSampler -> SaveLatent."""
import os
import re

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import CUDA
from ringswap.loaders.comfyui_adapter import comfy_features as features
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from support.comfy_server import ComfyServerError
from support.quant_files import file_offset, write_misaligned_quant_wan, write_quant_wan
from support.wan_files import write_tiny_wan
from support.workflows import build_workflow

pytestmark = pytest.mark.server

UNET = "tiny_wan_loader.safetensors"
BLOCKS = 6
WIDGETS = ("unet_name", "window", "prefetch", "home", "pin_memory", "disk_workers")


def build_loader_workflow(unet_name, home="ram", window=2, prefetch=1, pin_memory="auto",
                          disk_workers=2, seed=0, filename_prefix="ringswap_loader", **kw) -> dict:
    """build_workflow's graph with node "1" = RingSwapModelLoader feeding the KSampler
    directly (no UNETLoader, no RingSwapPatch)."""
    wf = build_workflow(unet_name, use_patch=False, seed=seed, filename_prefix=filename_prefix, **kw)
    wf["1"] = {"class_type": "RingSwapModelLoader",
               "inputs": {"unet_name": unet_name, "window": window, "prefetch": prefetch,
                          "home": home, "pin_memory": pin_memory, "disk_workers": disk_workers}}
    assert wf["6"]["inputs"]["model"] == ["1", 0]
    return wf


@pytest.fixture(scope="module")
def server(shared_models, shared_server):
    write_tiny_wan(os.path.join(shared_models, "diffusion_models", UNET), dim=128, num_layers=BLOCKS,
                   ffn_dim=256, dtype=torch.bfloat16, seed=7)
    return shared_server


def latent_of(srv, entry):
    (path,) = [p for p in srv.output_files(entry, "latents") if os.path.isfile(p)]
    return load_file(path)["latent_tensor"]


def test_loader_node_is_listed_with_widgets_and_tooltips(server):
    node = server.object_info("RingSwapModelLoader")["RingSwapModelLoader"]
    assert node["category"] == "RingSwap"
    assert node["output"] == ["MODEL"]
    required = node["input"]["required"]
    assert tuple(required) == WIDGETS, list(required)
    for name in WIDGETS:
        assert required[name][1].get("tooltip"), f"{name} has no tooltip"
    assert UNET in required["unet_name"][0]
    assert required["home"][0] == ["auto", "ram", "disk"] and required["home"][1]["default"] == "auto"
    ram = node["input"]["optional"]["ram_budget_gb"]
    assert ram[0] == "FLOAT" and ram[1]["default"] == 0.0 and ram[1]["min"] == 0.0 and ram[1].get("tooltip")
    assert required["pin_memory"][0] == ["auto", "on", "off"]
    dw = required["disk_workers"][1]
    assert (dw["min"], dw["max"], dw["default"]) == (0, 32, 0)   # 0: auto (range_reader.reader_workers)
    assert required["window"][1]["min"] == 0 and required["prefetch"][1]["min"] == 0


def test_loader_workflow_latent_equals_stock(server):
    lines_before = len(server.log_text().splitlines())   # the shared server logged other modules' runs
    ref = latent_of(server, server.run(build_workflow(UNET, use_patch=False, seed=3, steps=3,
                                                      filename_prefix="stock"), timeout=300))
    n_before = len(re.findall(r"RingSwap run:", server.log_text()))
    for home in ("ram", "disk"):
        entry = server.run(build_loader_workflow(UNET, home=home, seed=3, steps=3,
                                                 filename_prefix=f"loader_{home}"), timeout=300)
        assert torch.equal(latent_of(server, entry), ref), f"home={home}: latent differs from UNETLoader's"
    # The cached MODEL is sampled again with another seed: still exact, another run line.
    ref4 = latent_of(server, server.run(build_workflow(UNET, use_patch=False, seed=4, steps=3,
                                                       filename_prefix="stock4"), timeout=300))
    entry = server.run(build_loader_workflow(UNET, home="disk", seed=4, steps=3,
                                             filename_prefix="loader_disk4"), timeout=300)
    assert torch.equal(latent_of(server, entry), ref4)
    log = "\n".join(server.log_text().splitlines()[lines_before:])
    new = [ln for ln in log.splitlines() if "RingSwap run:" in ln]
    assert len(new) == 3 and len(re.findall(r"RingSwap run:", server.log_text())) - n_before == 3, new
    streamed = BLOCKS - 1
    for ln in new:
        assert f"{BLOCKS} blocks (1 resident, {streamed} streamed, ring 2), window 2, prefetch 1" in ln, ln
    assert "disk memory" not in new[0] and "disk memory" in new[1] and "disk memory" in new[2], new
    assert re.search(r"read [\d.]+ GB from disk", new[1]), new[1]
    assert re.search(r"RingSwap: read [\d.]+ GB of \d+ blocks from .*" + re.escape(UNET) +
                     r" into RAM in [\d.]+ s \([\d.]+ GB/s\)", log), "no RAM-load console line"
    assert "Exception during processing" not in log
    assert not [ln for ln in log.splitlines() if "ringswap" in ln.lower() and
                ("error" in ln.lower() or "traceback" in ln.lower() or "warning" in ln.lower())]


def test_auto_home_with_a_ram_budget_equals_stock(server, tmp_path):
    """home=auto, window 2 (1 resident + 5 streamed), a RAM budget of two staging buffers and
    two homes: 2 streamed blocks in RAM, 3 read from the file each step; the latent equals
    UNETLoader's and the plan line gives the split."""
    probe = str(tmp_path / "probe.safetensors")
    write_tiny_wan(probe, dim=128, num_layers=BLOCKS, ffn_dim=256, dtype=torch.bfloat16, seed=7)
    block = load_swapped_model(probe, SwapSettings(2, 1), home="disk").swap_engine.states[0].layout.nbytes
    budget = round((2 + 2) * block / 1e9 + 1e-6, 6)
    ref = latent_of(server, server.run(build_workflow(UNET, use_patch=False, seed=6, steps=2,
                                                      filename_prefix="stock6"), timeout=300))
    n_before = len(server.log_text().splitlines())
    wf = build_loader_workflow(UNET, home="auto", seed=6, steps=2, filename_prefix="loader_auto")
    wf["1"]["inputs"]["ram_budget_gb"] = budget
    entry = server.run(wf, timeout=300)
    assert torch.equal(latent_of(server, entry), ref), "home=auto: latent differs from UNETLoader's"
    new = server.log_text().splitlines()[n_before:]
    plan = [ln for ln in new if "RingSwap plan:" in ln]
    assert plan and "home auto: 1 blocks" in plan[-1] and ", 2 (" in plan[-1], plan
    assert ", 3 (" in plan[-1] and "read from the file each step" in plan[-1], plan
    assert f"RAM counted on {budget:.1f} GB (ram_budget_gb {budget:g})" in plan[-1], plan
    runs = [ln for ln in new if "RingSwap run:" in ln]
    assert runs and re.search(r"read [\d.]+ GB from disk", runs[-1]), runs


def test_a_file_changed_on_disk_is_loaded_again_or_named(server):
    """home=disk reads blocks from the file every step. The file replaced by another model:
    the next prompt loads it again (not the old blocks from the new file); replaced by a
    truncated copy: that prompt fails naming the file and the server stays healthy; the good
    file back: exact again."""
    path = os.path.join(server.models, "diffusion_models", "swap_me.safetensors")
    write_tiny_wan(path, dim=128, num_layers=BLOCKS, ffn_dim=256, dtype=torch.bfloat16, seed=7)   # = UNET
    ref_a = latent_of(server, server.run(build_workflow(UNET, use_patch=False, seed=5, steps=2,
                                                        filename_prefix="stock_a"), timeout=300))
    wf = build_loader_workflow("swap_me.safetensors", home="disk", seed=5, steps=2, filename_prefix="swap_me")
    assert torch.equal(latent_of(server, server.run(wf, timeout=300)), ref_a)

    other = path + ".new"
    write_tiny_wan(other, dim=128, num_layers=BLOCKS, ffn_dim=256, dtype=torch.bfloat16, seed=8)
    with open(other, "rb") as f:
        raw_b = f.read()
    os.replace(other, path)
    got_b = latent_of(server, server.run(wf, timeout=300))
    ref_b = latent_of(server, server.run(build_workflow("swap_me.safetensors", use_patch=False, seed=5, steps=2,
                                                        filename_prefix="stock_b"), timeout=300))
    assert not torch.equal(ref_b, ref_a) and torch.equal(got_b, ref_b), "the replaced file was not loaded again"

    with open(other, "wb") as f:
        f.write(raw_b[:len(raw_b) // 2])
    os.replace(other, path)
    with pytest.raises(ComfyServerError) as ei:
        server.run(wf, timeout=300)
    assert "swap_me.safetensors" in str(ei.value), str(ei.value)
    with open(other, "wb") as f:
        f.write(raw_b)
    os.replace(other, path)
    assert torch.equal(latent_of(server, server.run(wf, timeout=300)), ref_b)


def test_auto_home_rss_stays_within_the_ram_budget(server):
    """home=auto with a RAM budget of two homes and the two staging buffers, on a model whose
    blocks (~19 MB in RAM) dwarf the server's noise: its RSS grows by the budget, plus what
    sits on the device (on a CPU server: in RAM too), not by the
    streamed blocks the budget leaves in the file."""
    name = "auto_rss.safetensors"
    path = os.path.join(server.models, "diffusion_models", name)
    write_tiny_wan(path, dim=512, num_layers=BLOCKS, ffn_dim=2560, dtype=torch.bfloat16, seed=9)
    block = load_swapped_model(path, SwapSettings(2, 1), home="disk").swap_engine.states[0].layout.nbytes
    budget = round((2 + 2) * block / 1e9 + 1e-6, 6)
    wf = build_loader_workflow(name, home="auto", seed=6, steps=2, filename_prefix="loader_auto_rss")
    wf["1"]["inputs"]["ram_budget_gb"] = budget
    proc = psutil.Process(server.proc.pid)
    server.run(build_loader_workflow(UNET, home="auto", seed=1, steps=2, filename_prefix="warm"), timeout=300)
    server.free(unload_models=True, free_memory=True)   # the same path warmed up once, on a small model
    rss0 = proc.memory_info().rss
    server.run(wf, timeout=300)
    grew = proc.memory_info().rss - rss0
    # on a CPU server the "device" is host memory: one resident block, two ring slots, and the
    # ring's staging pair for homes that cannot be pinned there
    on_device = 0 if CUDA else (3 + 2) * block
    allowed = budget * 1e9 + on_device + 24 * 2**20   # + 24 MiB: the model's other weights, latents, allocator
    all_homes = (BLOCKS - 1 + 2) * block + on_device   # what holding every streamed block would take
    assert grew <= allowed < all_homes, (f"RSS grew {grew / 2**20:.1f} MiB, allowed {allowed / 2**20:.1f} MiB, "
                                         f"every streamed block in RAM {all_homes / 2**20:.1f} MiB")


QUANT_FORMATS = ("scaled_fp8", "quant_metadata") + (("comfy_quant", "nvfp4") if features.reads_comfy_quant() else ())
MISALIGNED_FORMATS = ("quant_metadata",) + (("comfy_quant", "nvfp4") if features.reads_comfy_quant() else ())


@pytest.fixture(scope="module")
def quant_server(shared_models, shared_server):
    """The shared server with quantized files (4 blocks) in every format its stock loader reads."""
    models = shared_models
    os.makedirs(os.path.join(models, "diffusion_models"), exist_ok=True)
    for fmt in QUANT_FORMATS:
        write_quant_wan(os.path.join(models, "diffusion_models", f"q_{fmt}.safetensors"), fmt,
                        dim=256, num_layers=4, ffn_dim=1024)
    for fmt in MISALIGNED_FORMATS:   # float32 non-block tensors at 8 mod 16 in the file
        path = os.path.join(models, "diffusion_models", f"q32_{fmt}.safetensors")
        write_misaligned_quant_wan(path, fmt, dim=256, num_layers=4, ffn_dim=1024)
        assert file_offset(path, "time_embedding.0.weight") % 16 == 8
    return shared_server


@pytest.mark.parametrize("unet", [f"q_{f}.safetensors" for f in QUANT_FORMATS]
                         + [f"q32_{f}.safetensors" for f in MISALIGNED_FORMATS])
def test_quantized_loader_workflow_equals_stock(quant_server, unet):
    """As a new user would: UNETLoader and RingSwapModelLoader (window 2, prefetch 1) on the
    same quantized file, both homes, give the same latent bit for bit (q32_: float32 non-block
    tensors at file offsets 8 mod 16)."""
    fmt = unet[:-len(".safetensors")]
    ref = latent_of(quant_server, quant_server.run(
        build_workflow(unet, use_patch=False, seed=5, steps=2, filename_prefix=f"stock_{fmt}"), timeout=300))
    for home in ("ram", "disk"):
        entry = quant_server.run(build_loader_workflow(unet, home=home, window=2, prefetch=1, seed=5, steps=2,
                                                       filename_prefix=f"rs_{fmt}_{home}"), timeout=300)
        got = latent_of(quant_server, entry)
        err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert torch.equal(got, ref), f"{fmt} home={home}: relative difference {err:.2e} from UNETLoader's latent"


def test_compress_over_http_off_and_auto_exact_on_names_what_is_missing(server):
    """compress through the server: off and auto give the stock latent; on where it cannot code
    (no CUDA in CI, or no nvCOMP) fails the prompt with a message naming what is missing, and the
    next prompt runs."""
    from ringswap.swap.plane_coder import coder_missing
    node = server.object_info("RingSwapModelLoader")["RingSwapModelLoader"]
    kind, opts = node["input"]["optional"]["compress"]
    assert kind == ["auto", "on", "off"] and opts["default"] == "auto" and "nvidia-nvcomp" in opts["tooltip"]
    ref = latent_of(server, server.run(build_workflow(UNET, use_patch=False, seed=5, steps=2,
                                                      filename_prefix="stock_c"), timeout=300))
    for mode in ("off", "auto"):
        wf = build_loader_workflow(UNET, seed=5, steps=2, filename_prefix=f"compress_{mode}")
        wf["1"]["inputs"]["compress"] = mode
        assert torch.equal(latent_of(server, server.run(wf, timeout=300)), ref), mode
    if CUDA and coder_missing() is None:
        pytest.skip("nvCOMP and CUDA are here: compress=on codes (tests/comfyui/test_gpu.py)")
    wf = build_loader_workflow(UNET, seed=5, steps=2, filename_prefix="compress_on")
    wf["1"]["inputs"]["compress"] = "on"
    with pytest.raises(ComfyServerError) as ei:
        server.run(wf, timeout=300)
    assert ("no CUDA device" if not CUDA else "nvidia-nvcomp-cu13") in str(ei.value), str(ei.value)
    wf["1"]["inputs"]["compress"] = "off"
    assert torch.equal(latent_of(server, server.run(wf, timeout=300)), ref)
