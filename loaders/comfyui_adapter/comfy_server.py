"""ComfyUI's running process as RingSwap reaches it: the prompt server, its websocket
clients, and the node classes ComfyUI registered.

ComfyUI's own top-level `nodes` module is reached here under the name `comfy_nodes`, never
imported as `nodes`, so it cannot be mistaken for the pack's own `nodes/` package.
"""
from __future__ import annotations

import importlib
import sys


def prompt_server():
    """ComfyUI's running PromptServer, or None (imported in-process, no server)."""
    server = sys.modules.get("server")
    return getattr(getattr(server, "PromptServer", None), "instance", None)


def running_prompt():
    """The id of the prompt ComfyUI's server is running (`PromptServer.last_prompt_id`), or None."""
    return getattr(prompt_server(), "last_prompt_id", None)


def client_connected(sid: str) -> bool:
    """Is the websocket client `sid` connected now (`PromptServer.instance.sockets`)?"""
    sockets = getattr(prompt_server(), "sockets", None)
    return isinstance(sockets, dict) and sid in sockets


def send_to_client(event: str, data: dict, sid: str | None = None) -> None:
    """Send a websocket message to client `sid` (None: every client), from any thread."""
    instance = prompt_server()
    if instance is not None:
        instance.send_sync(event, data, sid)


def comfy_nodes():
    """ComfyUI's own `nodes` module (its node registry, NODE_CLASS_MAPPINGS included)."""
    return importlib.import_module("nodes")


def node_class(name: str):
    """The node class ComfyUI registered under `name` (its own or a custom pack's), or None."""
    return getattr(comfy_nodes(), "NODE_CLASS_MAPPINGS", {}).get(name)
