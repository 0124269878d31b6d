"""The live block-map message (loaders/comfyui_adapter/live_payload.py) and its throttle (loaders/comfyui_adapter/live_feed.py).

A 200-block model of tiny linear blocks runs on the CPU engine with a LiveFeed as its
observer: with a subscribed client at most 10 messages go out in any second, each a
well-formed block map; with no client connected none is built or sent.
"""
import json
import time

import pytest
import torch
from torch import nn

from ringswap.loaders.comfyui_adapter import live_feed
from ringswap.loaders.comfyui_adapter.live_payload import live_payload
from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.facts import PLACES as CODES
from ringswap.swap.facts import live_view

from support.engine_plans import load_plan

BLOCKS = 200


def block_map(engine: BlockSwapEngine) -> str:
    """The state code of every block of an attached engine ("" when detached): the message's `states`."""
    view = live_view(engine)
    return view.places if view is not None else ""


@pytest.fixture
def engine():
    torch.manual_seed(0)
    blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(BLOCKS)])
    e = BlockSwapEngine(list(blocks))
    e.attach("cpu", load_plan(ResidencyPlan.make(e.num_blocks, 20, 2)))
    e.modules = blocks
    yield e
    e.release_home()


def run_for(engine, seconds: float) -> int:
    """Model calls of all blocks for `seconds`; returns how many calls ran."""
    x, calls, end = torch.randn(1, 8), 0, time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            engine.begin_call()
            for b in engine.modules:
                b(x)
            engine.end_call()
            calls += 1
    return calls


def test_block_map_codes(engine):
    states = block_map(engine)
    plan = engine.plan
    assert len(states) == BLOCKS and set(states) <= set(CODES)
    assert all(states[i] == "G" for i in plan.resident)
    assert states.count("R") == plan.ring_slots and states.count("H") == len(plan.streamed) - plan.ring_slots
    engine.detach()
    assert block_map(engine) == ""


def test_payload_schema(engine):
    p = live_payload(engine, "7", 2, 10, 1.23456)
    assert set(p) == {"v", "node", "blocks", "states", "current", "window", "prefetch", "ring_slots", "resident",
                      "streamed", "home", "step", "steps", "calls", "forwards", "copies", "bytes_copied",
                      "unplanned", "elapsed_s"}
    assert (p["v"], p["node"], p["blocks"], p["window"], p["prefetch"]) == (1, "7", BLOCKS, 20, 2)
    assert (p["step"], p["steps"], p["elapsed_s"], p["current"], p["home"]) == (2, 10, 1.235, -1, "ram")
    assert p["resident"] + p["streamed"] == BLOCKS and p["ring_slots"] == 3
    assert len(json.dumps(p)) < 1000   # small enough for 10 a second


def test_throttle_at_most_ten_per_second(engine):
    sent = []
    feed = live_feed.LiveFeed(engine, "3", send=lambda event, data, sid: sent.append((time.monotonic(), event, data)),
                              clients=lambda: ["browser"])
    engine.observer = feed
    calls = run_for(engine, 2.5)
    assert calls > 10, "the run is too short to test the throttle"
    times = [t for t, _, _ in sent]
    assert 15 <= len(times) <= 26, len(times)
    for i, t in enumerate(times):   # any one-second span holds at most 10 messages
        assert sum(1 for u in times[i:] if u < t + 1.0) <= live_feed.MAX_PER_S
    assert all(event == live_feed.EVENT for _, event, _ in sent)
    seen = {data["states"] for _, _, data in sent}
    assert len(seen) >= 2, "the ring's owners change during a run"
    assert all(len(s) == BLOCKS for s in seen) and feed.sent == len(sent)
    assert any(data["current"] >= 0 for _, _, data in sent)


def test_no_client_no_messages(engine):
    sent = []
    engine.observer = live_feed.LiveFeed(engine, "3", send=lambda *a: sent.append(a), clients=lambda: [])
    run_for(engine, 0.5)
    assert sent == [] and engine.observer.sent == 0


def test_no_server_no_subscribers():
    """In-process (no PromptServer) nobody is connected, whatever subscribed."""
    live_feed.subscribe("someone")
    assert live_feed.connected_subscribers() == []


def test_step_lookup_finds_the_call_in_the_schedule():
    """The step of a model call: its noise level's index in the sampler's sigmas."""
    from ringswap.loaders.comfyui_adapter.live_feed import StepLookup
    sigmas = torch.tensor([14.6, 7.0, 3.1, 1.2, 0.0])
    assert [StepLookup(sigmas[i:i + 1].clone(), sigmas).step() for i in range(4)] == [0, 1, 2, 3]
    assert StepLookup(torch.tensor([[3.05]]), sigmas).step() == 2   # a batch: its first entry
