"""When the prompt that a sampling run belongs to started, as far as RingSwap sees it.

RingSwap's nodes mark their start (a Model Loader's or Patch's own load is part of the prompt's
time to first step); a sampling run takes the mark of its own prompt (ComfyUI's server names the
prompt it runs), else starts the clock itself. The run line then says when its first step was done
after that start (swap/stats.py, `first_step_s`)."""
from __future__ import annotations

import time

from . import comfy_server

_mark: tuple[object, float] | None = None   # (the prompt, when a RingSwap node of it started)


def node_started() -> None:
    """A RingSwap node of the running prompt starts: the prompt's clock starts, if not yet. Without
    a server (ComfyUI in-process) prompts cannot be told apart: the clock starts again."""
    global _mark
    prompt = comfy_server.running_prompt()
    if _mark is None or _mark[0] != prompt or prompt is None:
        _mark = (prompt, time.perf_counter())


def run_started() -> float:
    """A sampling run starts: the time its prompt started (the mark of a RingSwap node of the same
    prompt, taken once), else now."""
    global _mark
    mark, _mark = _mark, None
    if mark is not None and mark[0] == comfy_server.running_prompt():
        return mark[1]
    return time.perf_counter()
