"""ComfyUI's running process as RingSwap reaches it: the prompt server and its websocket
clients."""
from __future__ import annotations

import sys


def prompt_server():
    """ComfyUI's running PromptServer, or None (imported in-process, no server)."""
    server = sys.modules.get("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def client_connected(sid: str) -> bool:
    """Is the websocket client `sid` connected now (`PromptServer.instance.sockets`)?"""
    sockets = getattr(prompt_server(), "sockets", None)
    return isinstance(sockets, dict) and sid in sockets


def send_to_client(event: str, data: dict, sid: str | None = None) -> None:
    """Send a websocket message to client `sid` (None: every client), from any thread."""
    instance = prompt_server()
    if instance is not None:
        instance.send_sync(event, data, sid)

