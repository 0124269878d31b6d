"""The engine tests' LoadPlan and device-blocks helpers (tests/engine/toy_blocks.py), for the
ComfyUI tests that drive an engine directly."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "engine"))
from toy_blocks import blocks_on_device, load_plan  # noqa: E402

__all__ = ["blocks_on_device", "load_plan"]
