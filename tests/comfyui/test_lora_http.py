"""RingSwap LoRA in a running ComfyUI server: strength changes between queued workflows."""
import os

import pytest
import torch
from safetensors.torch import load_file

from support.lora_files import build_lora, write_lora
from support.wan_files import write_tiny_wan
from support.workflows import build_workflow

pytestmark = pytest.mark.server

UNET = "tiny_wan_lora.safetensors"
LORA = "wan_mixed.safetensors"


@pytest.fixture(scope="module")
def server(shared_models, shared_server):
    write_tiny_wan(os.path.join(shared_models, "diffusion_models", UNET), dim=128, num_layers=4, ffn_dim=256)
    write_lora(os.path.join(shared_models, "loras", LORA), build_lora("mixed", dim=128, ffn_dim=256, blocks=4))
    return shared_server


def workflow(strength, prefix, lora=True):
    wf = build_workflow(UNET, use_patch=True, window=2, prefetch=1, seed=4, steps=3, filename_prefix=prefix)
    if lora:
        wf["8"] = {"class_type": "RingSwapLoRA",
                   "inputs": {"model": ["2", 0], "lora_name": LORA, "strength_model": strength}}
        wf["6"]["inputs"]["model"] = ["8", 0]
    return wf


def latent(srv, strength, prefix, lora=True):
    entry = srv.run(workflow(strength, prefix, lora), timeout=300)
    (path,) = [p for p in srv.output_files(entry, "latents") if os.path.isfile(p)]
    return load_file(path)["latent_tensor"]


def free(srv):
    """Unload everything and drop ComfyUI's node cache: the next run loads afresh."""
    srv._request("POST", "/free", {"unload_models": True, "free_memory": True})


def test_nodes_listed_with_tooltips(server):
    info = server.object_info()
    for key in ("RingSwapLoRA", "RingSwapLoRAStack"):
        node = info[key]
        assert node["category"] == "RingSwap"
        for name, spec in node["input"]["required"].items():
            assert spec[1].get("tooltip"), f"{key}.{name}"
    assert LORA in info["RingSwapLoRA"]["input"]["required"]["lora_name"][0]


def test_strength_changes_between_runs_equal_fresh_loads(server):
    base = latent(server, 0, "base", lora=False)
    loads = server.log_text().count("RingSwap: read") + server.log_text().count("model weight dtype")
    got = {s: latent(server, s, f"s{s}") for s in (1.0, 0.5, 0.0)}
    assert server.log_text().count("RingSwap: read") + server.log_text().count("model weight dtype") == loads, \
        "a strength change must not load the model again"
    assert torch.equal(got[0.0], base), "strength 0 must give the base model exactly"
    assert not torch.equal(got[0.5], base) and not torch.equal(got[0.5], got[1.0])
    for s in (0.5, 1.0):
        free(server)
        assert torch.equal(latent(server, s, f"fresh{s}"), got[s]), s
    runs = [ln for ln in server.log_text().splitlines() if "RingSwap run:" in ln]
    assert any("fold on landing" in ln for ln in runs), runs[-1:]
