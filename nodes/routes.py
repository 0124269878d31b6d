"""GET /ringswap/plan: the plan a run would get, for the web extension; POST /ringswap/live:
a browser asks for live block maps during sampling (loaders/comfyui_adapter/live_feed.py).

Only a name from ComfyUI's own diffusion_models list is ever opened: anything else (a
path, a name with `..`) is refused before a file is touched.
"""
from __future__ import annotations

import asyncio

import folder_paths
from aiohttp import web

from ..loaders.comfyui_adapter import comfy_server, live_feed
from ..loaders.comfyui_adapter.gguf_file import model_names
from ..loaders.comfyui_adapter.file_plan import plan_for_file
from ..swap.window_plan import NotEnoughVRAM
from .widgets import COMPRESS, HOME, PREFETCH, VRAM_BUDGET, WINDOW, BadValue, Number

# query parameter -> its spec: the latent's size and the conds a step computes (from the graph
# around the node), then the node's own widgets (nodes/widgets.py), checked in this order
QUERY = {
    "width": Number(int, None, 16, 16384), "height": Number(int, None, 16, 16384),
    "frames": Number(int, 1, 1, 100000), "batch": Number(int, 1, 1, 4096),
    "window": WINDOW, "prefetch": PREFETCH, "vram_budget_gb": VRAM_BUDGET,
    "conds": Number(int, 1, 1, 16),
    "home": HOME, "compress": COMPRESS,
}


def parse(query) -> dict:
    """The plan's numbers and choices from the query, each checked against its spec's range or
    choices (BadValue names it)."""
    return {name: spec.parse(name, query.get(name)) for name, spec in QUERY.items()}


async def get_plan(request: web.Request) -> web.Response:
    query = request.rel_url.query
    name = query.get("model", "")
    if not name:
        return web.json_response({"error": "'model' is required: a name from ComfyUI's diffusion_models list"},
                                 status=400)
    if name not in model_names():
        return web.json_response({"error": f"no model named {name!r} in ComfyUI's diffusion_models list"},
                                 status=404)
    try:
        numbers = parse(query)
    except BadValue as e:
        return web.json_response({"error": str(e)}, status=400)
    path = folder_paths.get_full_path("diffusion_models", name)
    try:
        plan = await asyncio.get_running_loop().run_in_executor(None, lambda: plan_for_file(path, **numbers))
    except NotEnoughVRAM as e:
        return web.json_response({"model": name, "fits": False, "error": str(e)})
    except (ValueError, OSError) as e:
        return web.json_response({"model": name, "error": str(e)}, status=422)
    return web.json_response({"model": name, "fits": True, **plan.as_dict()})


async def post_live(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except ValueError:
        body = None
    client_id = body.get("client_id") if isinstance(body, dict) else None
    if not isinstance(client_id, str) or not 0 < len(client_id) <= 128:
        return web.json_response({"error": "'client_id' is required: the websocket client id"}, status=400)
    live_feed.subscribe(client_id)
    return web.json_response({"client_id": client_id, "max_per_s": live_feed.MAX_PER_S})


def register_routes() -> bool:
    """Add the routes to ComfyUI's server when one is running (not when imported in-process)."""
    instance = comfy_server.prompt_server()
    if instance is None:
        return False
    instance.routes.get("/ringswap/plan")(get_plan)
    instance.routes.post("/ringswap/live")(post_live)
    return True
