"""A run's step time with and without a browser following the live block map (issue 14).

A real ComfyUI server (its own main.py: dynamic VRAM on where 0.33 turns it on) samples a
Wan-shaped file through Load Diffusion Model -> RingSwap Patch -> KSampler, alternately
with no websocket client and with one that subscribed to `ringswap.live` (POST
/ringswap/live) the way the web extension does, counting the messages it gets. s/step is
the server's own `RingSwap steps:` line. Target: the same s/step within noise.

    source scripts/device_setup.sh && python3 bench/probes/live_overhead.py --json $OUT/live.json
Tiny CPU run (meaningless numbers): .venv/bin/python bench/probes/live_overhead.py --small
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import urllib.request
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402  (ComfyUI and tests/comfyui/support on sys.path)
from comfy_server import ComfyServer  # noqa: E402
from wan_files import write_tiny_wan  # noqa: E402
from workflows import build_workflow  # noqa: E402

STEPS_LINE = re.compile(r"RingSwap steps: (\d+) in ([\d.]+) s, ([\d.]+) s/step")


class LiveClient:
    """A websocket client of the server, subscribed to live block maps; counts them."""

    def __init__(self, url: str):
        self.url, self.cid, self.count = url, uuid.uuid4().hex, 0
        self.ready, self.stop = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        import aiohttp
        async with aiohttp.ClientSession() as s, s.ws_connect(f"{self.url.replace('http', 'ws', 1)}/ws"
                                                               f"?clientId={self.cid}") as ws:
            self.ready.set()
            while not self.stop.is_set():
                try:
                    msg = await ws.receive(timeout=0.2)
                except asyncio.TimeoutError:
                    continue
                if msg.type == aiohttp.WSMsgType.TEXT and '"ringswap.live"' in msg.data:
                    self.count += 1
                elif msg.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break

    def __enter__(self) -> "LiveClient":
        self.thread.start()
        if not self.ready.wait(20):
            raise RuntimeError(f"no websocket connection to {self.url}")
        req = urllib.request.Request(self.url + "/ringswap/live", data=json.dumps({"client_id": self.cid}).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        urllib.request.urlopen(req, timeout=10).read()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(10)


def run_once(srv: ComfyServer, wf: dict, timeout: float) -> dict:
    before = len(STEPS_LINE.findall(srv.log_text()))
    srv.run(wf, timeout=timeout)
    found = STEPS_LINE.findall(srv.log_text())
    if len(found) <= before:
        raise RuntimeError(f"no 'RingSwap steps:' line for the run; log tail:\n{srv.log_tail()}")
    steps, wall, per = found[-1]
    return {"steps": int(steps), "wall_s": float(wall), "s_per_step": float(per)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny model on the CPU (code paths only)")
    ap.add_argument("--pairs", type=int, default=3, help="runs without / with a browser, alternating")
    ap.add_argument("--steps", type=int, default=None, help="default 8 (--small: 6)")
    ap.add_argument("--window", type=int, default=None, help="RingSwap window (default 8 of 20; --small: 4 of 12)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.small
    dim, layers, ffn = (128, 12, 256) if not cuda else (1536, 20, 8960)
    steps = a.steps or (6 if not cuda else 8)
    window = a.window or (4 if not cuda else 8)
    size = (64, 64, 5) if not cuda else (832, 480, 33)   # width, height, frames: 480p 33f on CUDA
    with tempfile.TemporaryDirectory() as models:
        os.makedirs(os.path.join(models, "diffusion_models"))
        info = write_tiny_wan(os.path.join(models, "diffusion_models", "wan_live.safetensors"), dim=dim,
                              num_layers=layers, ffn_dim=ffn, dtype=torch.bfloat16 if cuda else torch.float32)
        common.say(f"[live] {layers} blocks, dim {dim}: {info['bytes'] / 1e9:.2f} GB")
        wf = build_workflow("wan_live.safetensors", window=window, steps=steps, width=size[0], height=size[1],
                            length=size[2])
        rows = []
        with ComfyServer(common.COMFY, models, cpu=not cuda) as srv:
            run_once(srv, wf, 600)   # warm-up: load, pin, learn the call order
            for pair in range(a.pairs):
                for browser in (False, True):
                    wf["6"]["inputs"]["seed"] = 1 + len(rows)   # a new prompt each time (no cache hit)
                    if browser:
                        with LiveClient(srv.url) as client:
                            row = run_once(srv, wf, 600)
                        row["live_messages"] = client.count
                    else:
                        row = {**run_once(srv, wf, 600), "live_messages": 0}
                    rows.append({"browser": browser, **row})
                    common.say(f"[live] browser={browser}: {row}")
    med = {b: statistics.median(r["s_per_step"] for r in rows if r["browser"] == b) for b in (False, True)}
    table = common.md_table(["browser", "s/step per run", "median", "live messages", "ratio"],
                            [[("yes" if b else "no"),
                              ", ".join(f"{r['s_per_step']:.3f}" for r in rows if r["browser"] == b),
                              f"{med[b]:.3f}", ", ".join(str(r["live_messages"]) for r in rows if r["browser"] == b),
                              f"{med[b] / med[False]:.3f}"] for b in (False, True)])
    print(table, flush=True)
    common.write_json(a.json, {"env": common.env_info(torch.device("cuda" if cuda else "cpu")), "rows": rows,
                               "blocks": layers, "window": window, "steps": steps, "size": size, "table": table})


if __name__ == "__main__":
    main()
