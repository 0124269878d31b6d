"""The pack inside a running ComfyUI server, driven over its HTTP API."""
import os

import pytest
import torch
from safetensors.torch import load_file

from support.wan_files import write_tiny_wan
from support.workflows import build_workflow

pytestmark = pytest.mark.server

UNET = "tiny_wan.safetensors"


@pytest.fixture(scope="module")
def server(shared_models, shared_server):
    write_tiny_wan(os.path.join(shared_models, "diffusion_models", UNET), dim=128, num_layers=6, ffn_dim=256)
    return shared_server


def latent_of(srv, entry):
    (path,) = [p for p in srv.output_files(entry, "latents") if os.path.isfile(p)]
    return load_file(path)["latent_tensor"]


def test_pack_imports_cleanly_and_nodes_are_listed(server):
    info = server.object_info()
    node = info["RingSwapPatch"]
    assert node["category"] == "RingSwap"
    required = node["input"]["required"]
    assert set(required) == {"model", "window", "prefetch", "pin_memory"}
    for name in ("window", "prefetch", "pin_memory"):
        assert required[name][1].get("tooltip"), f"{name} has no tooltip"
    assert required["prefetch"][1]["default"] == 1
    assert required["pin_memory"][0] == ["auto", "on", "off"]
    log = server.log_text()
    assert "IMPORT FAILED" not in log and "Cannot import" not in log
    assert not [ln for ln in log.splitlines() if "ringswap" in ln.lower() and
                ("warning" in ln.lower() or "error" in ln.lower() or "traceback" in ln.lower())]


def test_workflow_latent_equals_unpatched(server):
    seen = server.log_text().count("RingSwap run:")   # the server is shared: earlier modules ran too
    ref = latent_of(server, server.run(build_workflow(UNET, use_patch=False, seed=3,
                                                      filename_prefix="plain"), timeout=300))
    for window, prefetch in ((2, 1), (1, 0), (3, 2)):
        entry = server.run(build_workflow(UNET, use_patch=True, window=window, prefetch=prefetch,
                                          seed=3, filename_prefix=f"swap_{window}_{prefetch}"),
                           timeout=300)
        assert torch.equal(latent_of(server, entry), ref), (window, prefetch)
    runs = [ln for ln in server.log_text().splitlines() if "RingSwap run:" in ln][seen:]
    assert len(runs) == 3
    assert "6 blocks (1 resident, 5 streamed, ring 2), window 2, prefetch 1" in runs[0]


def test_interrupt_mid_sampling_then_next_run_matches(server):
    import time

    from support.comfy_server import ComfyServerError

    def workflow(steps, seed, prefix):
        return build_workflow(UNET, use_patch=True, window=2, prefetch=1, seed=seed, steps=steps,
                              filename_prefix=prefix)

    ref = latent_of(server, server.run(workflow(4, 9, "before"), timeout=300))
    loads_before = server.log_text().count("RingSwap plan:")
    pid = server.queue(workflow(2000, 10, "interrupted"))
    deadline = time.monotonic() + 120
    while server.log_text().count("RingSwap plan:") == loads_before:   # sampling has begun
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    server.interrupt()
    with pytest.raises(ComfyServerError, match="(?i)interrupt"):
        server.wait(pid, timeout=120)
    after = latent_of(server, server.run(workflow(4, 9, "after"), timeout=300))
    assert torch.equal(after, ref)


def test_web_extension_is_served(server):
    import json
    import urllib.request

    with urllib.request.urlopen(server.url + "/extensions", timeout=30) as r:
        files = json.loads(r.read())
    ours = [f for f in files if f.endswith("/ringswap.js")]
    assert ours, files
    with urllib.request.urlopen(server.url + ours[0], timeout=30) as r:
        js = r.read().decode()
    assert 'api.addEventListener("ringswap.run"' in js and "registerExtension" in js


def test_run_summary_reaches_the_browser_over_the_websocket(server):
    import asyncio
    import json

    import aiohttp

    async def listen():
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(f"{server.url}/ws?clientId={server.client_id}") as ws:
                server.queue(build_workflow(UNET, use_patch=True, window=2, seed=21, filename_prefix="ws"))
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    data = json.loads(msg.data)
                    if data.get("type") == "ringswap.run":
                        return data["data"]
                    if data.get("type") == "execution_error":
                        raise AssertionError(data)

    detail = asyncio.run(asyncio.wait_for(listen(), timeout=120))
    assert detail["line"].startswith("RingSwap run:") and detail["streamed"] == 5
    assert detail["bytes_copied"] > 0 and detail["window"] == 2
    plan = detail["plan"]   # the run's plan, with the same numbers as its log line
    assert plan["line"].startswith("RingSwap plan: window 2 of 6 (set;") and plan["window"] == 2
    assert plan["streamed"] == 5 and plan["streamed_bytes"] > 0 and plan["activation_bytes"] > 0
