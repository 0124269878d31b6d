"""GET /ringswap/plan over a real ComfyUI server's HTTP API, and vram_budget_gb in a run.

A listed model gets the plan a run would get (the window of a budgeted run is the one the
route said, and a run's plan line starts with the route's); names outside ComfyUI's
diffusion_models list (a path with `..`, an absolute path) get 404 without the file being
opened (it is a FIFO here: opening it would hang the server), bad numbers get 400, and the
server stays healthy.
"""
import json
import os
import re
import urllib.error
import urllib.parse
import urllib.request

import pytest
import torch

from conftest import CUDA
from ringswap.swap import ResidencyPlan
from support.wan_files import write_tiny_wan
from support.workflows import build_workflow

pytestmark = pytest.mark.server

UNET = "tiny_wan_plan.safetensors"
BLOCKS = 6


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A file next to the models folder that the route must never open."""
    d = tmp_path_factory.mktemp("outside")
    path = os.path.join(d, "secret.safetensors")
    if hasattr(os, "mkfifo"):
        os.mkfifo(path)
    else:
        open(path, "wb").close()
    return path


@pytest.fixture(scope="module")
def server(shared_models, shared_server, outside):
    write_tiny_wan(os.path.join(shared_models, "diffusion_models", UNET), dim=128, num_layers=BLOCKS,
                   ffn_dim=256, dtype=torch.bfloat16, seed=3)
    return shared_server


def get(srv, **query):
    url = srv.url + "/ringswap/plan?" + urllib.parse.urlencode(query)
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_budget_widget_is_listed_as_optional(server):
    for node in ("RingSwapPatch", "RingSwapModelLoader"):
        spec = server.object_info(node)[node]["input"]["optional"]["vram_budget_gb"]
        assert spec[0] == "FLOAT" and spec[1]["default"] == 0.0 and spec[1]["tooltip"]


def test_plan_for_a_listed_model(server):
    status, plan = get(server, model=UNET, width=64, height=64, frames=5)
    assert status == 200 and plan["fits"] and plan["model"] == UNET
    assert plan["num_blocks"] == BLOCKS and plan["line"].startswith("RingSwap plan: window")
    if not CUDA:   # a CPU holds every block unless a budget says otherwise
        assert plan["window"] == BLOCKS and plan["streamed"] == 0
    # a longer video needs more activations
    _, longer = get(server, model=UNET, width=64, height=64, frames=81)
    assert longer["activation_bytes"] > plan["activation_bytes"] and longer["tokens"] > plan["tokens"]
    # a budget sizes the window: the largest whose blocks fit
    block = plan["block_bytes_on_device"] / BLOCKS
    budget = (plan["nonblock_bytes"] + plan["activation_bytes"] + 3.5 * block) / 1e9
    _, budgeted = get(server, model=UNET, width=64, height=64, frames=5, vram_budget_gb=budget)
    assert (budgeted["window"], budgeted["prefetch"], budgeted["ring_slots"]) == (2, 1, 2), budgeted["line"]
    # the block indices the browser draws (it copies no formula): the plan's own resident blocks
    assert budgeted["resident_blocks"] == list(ResidencyPlan.make(BLOCKS, 2, 1).resident)
    assert plan["resident_blocks"] == list(range(BLOCKS))
    _, over = get(server, model=UNET, width=64, height=64, frames=5, vram_budget_gb=budget, window=3)
    assert over["over_bytes"] > 0 and "over the room for blocks" in over["line"]
    # cond + uncond (conds=2): the plan for their batched call, the same budget, fewer blocks
    _, cfg = get(server, model=UNET, width=64, height=64, frames=5, vram_budget_gb=budget, conds=2)
    assert cfg["batched"] and cfg["calls_per_step"] == 1 and cfg["activation_bytes"] > plan["activation_bytes"]
    assert cfg["window"] < budgeted["window"] and "2 conds a step batched in 1 model call" in cfg["line"]
    _, none = get(server, model=UNET, width=64, height=64, frames=5, vram_budget_gb=0.0001)
    assert none["fits"] is False and "not even one block fits" in none["error"]


def test_plan_for_a_gguf_model(server, shared_models):
    """A .gguf in diffusion_models (read with ComfyUI-GGUF's loader code, none of its weights
    read): its plan has every block, sized as the GGUF bytes that travel (a quarter of bf16 for Q4_K)."""
    from conftest import COMFY
    if not os.path.isfile(os.path.join(COMFY, "custom_nodes", "ComfyUI-GGUF", "nodes.py")):
        pytest.skip("ComfyUI-GGUF not linked into this ComfyUI (make test does it)")
    from support.gguf_files import write_wan_gguf
    src = os.path.join(shared_models, "diffusion_models", UNET)
    write_wan_gguf(src, os.path.join(shared_models, "diffusion_models", "tiny_wan_plan.gguf"), "Q4_0")
    status, plan = get(server, model="tiny_wan_plan.gguf", width=64, height=64, frames=5)
    assert status == 200 and plan["fits"] and plan["num_blocks"] == BLOCKS, plan
    _, bf16 = get(server, model=UNET, width=64, height=64, frames=5)
    assert plan["block_bytes_on_device"] < 0.5 * bf16["block_bytes_on_device"], (plan["line"], bf16["line"])


def test_a_budgeted_run_gets_the_routes_window(server):
    _, plan = get(server, model=UNET, width=64, height=64, frames=5)
    block = plan["block_bytes_on_device"] / BLOCKS
    budget = (plan["nonblock_bytes"] + plan["activation_bytes"] + 4.5 * block) / 1e9
    _, expected = get(server, model=UNET, width=64, height=64, frames=5, vram_budget_gb=budget)
    wf = build_workflow(UNET, use_patch=True, window=0, prefetch=1, width=64, height=64, length=5,
                        steps=2, filename_prefix="plan_run")
    wf["2"]["inputs"]["vram_budget_gb"] = budget
    before = server.log_text().count("RingSwap plan:")
    server.run(wf, timeout=300)
    lines = [ln for ln in server.log_text().splitlines() if "RingSwap plan:" in ln][before:]
    assert len(lines) == 1, lines
    window = int(re.search(r"window (\d+) of", lines[0]).group(1))
    assert window == expected["window"] == 3, (lines[0], expected["line"])


LINE_UNET = "tiny_wan_plan_line.safetensors"
AT_THE_MOMENT = [   # numbers of the plan line that follow the free VRAM and RAM at the moment it is made
    (re.compile(r"of [0-9.]+ GB free"), "of <free> GB free"),
    (re.compile(r"RAM counted on [0-9.]+ GB"), "RAM counted on <room> GB"),
    (re.compile(r"\([0-9.]+ GB available"), "(<available> GB available"),
    (re.compile(r"- [0-9.]+ GB margin"), "- <margin> GB margin"),
]


def at_any_moment(line: str) -> str:
    """`line` from "RingSwap plan:" on, with the numbers that follow free VRAM and RAM replaced."""
    line = line[line.index("RingSwap plan:"):]
    for pattern, word in AT_THE_MOMENT:
        line = pattern.sub(word, line)
    return line


@pytest.mark.parametrize("home", ["auto", "ram"])
def test_the_route_and_a_run_say_the_same_plan_line(server, shared_models, home):
    """The plan route and a RingSwap Model Loader run of the same file, size, window, prefetch, home
    and compress say the same plan line: the route's `line` is the start of the run's plan line
    (which goes on with what the attach did: memory, homes held, seconds). Both come from
    swap.load_plan.plan_load. A set window keeps the plan itself apart from the free memory, but
    the line still says the free VRAM, and with home=auto the RAM counted on (RAM available, less
    a margin that follows it): those numbers move between the two moments (other work, the page
    cache, the run's own allocations), so they are compared with the numbers replaced. A fresh file
    for each home: its engine has measured no rates yet, as the route assumes."""
    name = f"{home}_{LINE_UNET}"
    write_tiny_wan(os.path.join(shared_models, "diffusion_models", name), dim=128, num_layers=BLOCKS,
                   ffn_dim=256, dtype=torch.bfloat16, seed=5)
    status, plan = get(server, model=name, width=64, height=64, frames=5, window=2, prefetch=1, home=home,
                       compress="auto", conds=1)   # cfg 1: one cond a step
    assert status == 200 and plan["fits"], plan
    wf = build_workflow(name, use_patch=False, width=64, height=64, length=5, cfg=1.0, steps=2,
                        filename_prefix=f"plan_line_{home}")
    wf["1"] = {"class_type": "RingSwapModelLoader",
               "inputs": {"unet_name": name, "window": 2, "prefetch": 1, "home": home, "pin_memory": "auto",
                          "disk_workers": 2, "compress": "auto"}}
    before = server.log_text().count("RingSwap plan:")
    server.run(wf, timeout=300)
    lines = [ln for ln in server.log_text().splitlines() if "RingSwap plan:" in ln][before:]
    assert len(lines) == 1, lines
    route, ran = at_any_moment(plan["line"]), at_any_moment(lines[0])
    assert ran.startswith(route + "; "), f"\nroute: {route}\nrun:   {ran}"
    assert route.startswith(f"RingSwap plan: window 2 of {BLOCKS} (set; 1 resident + ring 2)"), route
    assert ("home auto: " in route) is (home == "auto"), route
    assert " memory, " in ran[len(route):] and "placed in " in ran[len(route):], ran


@pytest.mark.parametrize("name", ["../../etc/passwd", "/etc/passwd", "..", "sub/../" + UNET,
                                  UNET + "/..", "nothing.safetensors", "../outside/secret.safetensors"])
def test_names_outside_the_list_are_refused(server, name):
    status, body = get(server, model=name, width=64, height=64)
    assert status == 404 and "diffusion_models list" in body["error"]


def test_the_outside_file_is_not_opened(server, outside):
    relative = os.path.relpath(outside, os.path.join(server.models, "diffusion_models"))
    for name in (outside, relative):
        status, body = get(server, model=name, width=64, height=64)
        assert status == 404 and "diffusion_models list" in body["error"], name


@pytest.mark.parametrize("query,needle", [
    ({}, "'model' is required"),
    ({"model": UNET}, "'width' is required"),
    ({"model": UNET, "width": "wide", "height": 64}, "'width' must be an integer"),
    ({"model": UNET, "width": 64, "height": 64, "frames": 0}, "'frames' must be from 1"),
    ({"model": UNET, "width": 64, "height": 64, "vram_budget_gb": "-1"}, "'vram_budget_gb' must be from 0.0"),
    ({"model": UNET, "width": 64, "height": 64, "vram_budget_gb": "lots"}, "'vram_budget_gb' must be a number"),
    ({"model": UNET, "width": 64, "height": 64, "compress": "sometimes"}, "'compress' must be one of auto, on, off"),
    ({"model": UNET, "width": 64, "height": 64, "home": "cloud"}, "'home' must be one of"),
])
def test_bad_numbers_are_refused(server, query, needle):
    status, body = get(server, **query)
    assert status == 400 and needle in body["error"], body


def test_plan_counts_the_decode_scratch_where_the_load_may_code(server):
    """compress and home as on the Model Loader: the decode scratch is in the plan's non-block
    bytes where that load may code (on; auto with home=auto), on CUDA with nvCOMP only."""
    from ringswap.swap.coding_choice import SCRATCH_BYTES
    from ringswap.swap.plane_coder import coder_missing
    base = {"model": UNET, "width": 64, "height": 64}
    got = {(home, mode): get(server, **base, home=home, compress=mode)[1]["nonblock_bytes"]
           for home in ("auto", "ram") for mode in ("auto", "on", "off")}
    scratch = SCRATCH_BYTES if CUDA and coder_missing() is None else 0
    off = got[("ram", "off")]
    assert got == {("auto", "auto"): off + scratch, ("auto", "on"): off + scratch, ("auto", "off"): off,
                   ("ram", "auto"): off, ("ram", "on"): off + scratch, ("ram", "off"): off}


def test_server_is_healthy_after(server):
    assert "RingSwapPatch" in server.object_info()
    status, plan = get(server, model=UNET, width=64, height=64)
    assert status == 200 and plan["fits"]
