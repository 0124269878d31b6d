"""RingSwap: run diffusion transformers bigger than the GPU by streaming their blocks.

Nodes and routes are registered when ComfyUI loads the pack (its model management is
running by then); imported without it (the engine's own tests, tools), `swap/` and the
pure parts of `lora/` need only torch."""
import sys

WEB_DIRECTORY = "./web"

if "comfy.model_management" in sys.modules:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .nodes.routes import register_routes

    register_routes()
else:
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
