"""Live block maps for the browser during sampling (throttled, and only for browsers that
asked), and progress bars for long reads.

The RingSwap web extension subscribes its websocket client id (POST /ringswap/live). The
engine calls a LiveFeed before every streamed block and model call; until the throttle's
next slot (at most MAX_PER_S messages a second, over all models) that costs one clock read
and a compare, and with no subscribed browser connected nothing is built or sent, so a
headless API client or a server without the frontend is never slowed.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

import comfy.utils

from ...swap import BlockSwapEngine
from . import comfy_server
from .live_payload import live_payload

log = logging.getLogger("ringswap.live_feed")

EVENT = "ringswap.live"
MAX_PER_S = 10
MAX_SUBSCRIBERS = 64

_subscribers: dict[str, None] = {}   # client ids, oldest first
_due = [0.0]                         # monotonic time of the next allowed message (shared by all feeds)

Send = Callable[[str, dict, str], None]


def progress_bar() -> Callable[[int, int], None]:
    """progress(done, total) for a long read, shown on the executing node through ComfyUI's
    progress bar; the bar is made at the first report (no bar where nothing is read)."""
    bar = []

    def report(done: int, total: int) -> None:
        if not bar:
            bar.append(comfy.utils.ProgressBar(100))
        bar[0].update_absolute(int(100 * done / max(total, 1)), 100)
    return report


def subscribe(client_id: str) -> None:
    """Send live messages to this websocket client while it is connected (kept across reconnects)."""
    _subscribers.pop(client_id, None)
    _subscribers[client_id] = None
    while len(_subscribers) > MAX_SUBSCRIBERS:
        _subscribers.pop(next(iter(_subscribers)))


def connected_subscribers() -> list[str]:
    return [sid for sid in list(_subscribers) if comfy_server.client_connected(sid)]


class LiveFeed:
    """The engine's observer for one loaded model: sends its block map to subscribed browsers.
    `send` and `clients` default to ComfyUI's server (tests pass their own)."""

    def __init__(self, engine: BlockSwapEngine, node: str | None, send: Send | None = None,
                 clients: Callable[[], list[str]] | None = None):
        self.engine = engine
        self.node = node
        self.send = send or comfy_server.send_to_client
        self.clients = clients or connected_subscribers
        self.sent = 0
        self.step, self.steps = -1, 0
        self.started: float | None = None
        self._lookup: StepLookup | None = None

    def __call__(self) -> None:
        now = time.monotonic()
        if now < _due[0]:
            return
        _due[0] = now + 1.0 / MAX_PER_S
        if self.started is None:
            self.started = now
        sids = self.clients()
        if not sids or not self.engine.attached:
            return
        if self._lookup is not None and (step := self._lookup.step()) is not None:
            self.step = step
        payload = live_payload(self.engine, self.node, self.step, self.steps, now - self.started)
        for sid in sids:
            self.send(EVENT, payload, sid)
        self.sent += 1
        _due[0] = time.monotonic() + 1.0 / MAX_PER_S   # from the send: building the payload may take a while

    def on_call(self, sigma, sigmas) -> None:
        """A model call at noise level `sigma` of the schedule `sigmas` (the sampler's steps).
        Only while a browser listens, its noise level is copied to the host (without waiting)."""
        if self.started is None:
            self.started = time.monotonic()
        if sigmas is None:
            return
        self.steps = max(0, len(sigmas) - 1)
        if sigma is not None and _subscribers and self.clients():
            self._lookup = StepLookup(sigma, sigmas, self._lookup)

    def finish(self) -> tuple[float, int, int]:
        """End of a run: (seconds since its first model call, steps, messages sent); resets."""
        wall = time.monotonic() - self.started if self.started is not None else 0.0
        out = (wall, self.steps, self.sent)
        self.sent, self.step, self.steps, self.started, self._lookup = 0, -1, 0, None, None
        return out


class StepLookup:
    """The sampler's step from a model call's noise level, copied to the host without waiting
    for the GPU: reading it on the device would stall the queued kernels once per call."""

    def __init__(self, sigma: torch.Tensor, sigmas: torch.Tensor, last: "StepLookup | None" = None):
        cuda = sigma.device.type == "cuda" or sigmas.device.type == "cuda"   # elsewhere: a plain copy
        self.schedule = sigmas   # the sampler's tensor: one schedule per run, copied once (`last`'s)
        self.sigma = sigma.detach().reshape(-1)[:1].to("cpu", non_blocking=cuda)
        self.sigmas = last.sigmas if last is not None and last.schedule is sigmas else \
            sigmas.detach().reshape(-1).to("cpu", non_blocking=cuda)
        self.done = None
        if cuda:
            self.done = torch.cuda.Event()
            self.done.record()

    def step(self) -> int | None:
        """0-based index of the call's noise level in the schedule; None while the copy runs."""
        if self.done is not None and not self.done.query():
            return None
        return int((self.sigmas.float() - self.sigma.float()).abs().argmin())


def feed_of(engine: BlockSwapEngine) -> LiveFeed | None:
    observer = engine.observer
    return observer if isinstance(observer, LiveFeed) else None


def observe(engine: BlockSwapEngine, node: str | None) -> LiveFeed:
    """The engine's LiveFeed for `node`, installed once (a later load keeps its counters)."""
    feed = feed_of(engine)
    if feed is None:
        feed = LiveFeed(engine, node)
        engine.observer = feed
    feed.node = node
    return feed


def on_model_call(engine: BlockSwapEngine, args: tuple, kwargs: dict) -> None:
    """A model call of `engine`'s run starts (APPLY_MODEL's arguments: x, t, ...,
    transformer_options): tell its feed the sampler's step. Called from sampling.py's one
    APPLY_MODEL wrapper, which has found the engine already."""
    feed = feed_of(engine)
    if feed is None:
        return
    t = args[1] if len(args) > 1 else kwargs.get("t")
    options = kwargs.get("transformer_options", args[5] if len(args) > 5 else None)
    feed.on_call(t, options.get("sample_sigmas") if isinstance(options, dict) else None)
