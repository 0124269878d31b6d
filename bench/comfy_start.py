"""How a benchmark child process starts ComfyUI and hears RingSwap's log lines.

Shared by compare_child.py and the probes in bench/probes/ (auto_window, families, gap_profile):
on the CPU ComfyUI is told so before it looks for CUDA; with dynamic VRAM (ComfyUI 0.33) it
starts as 0.33's main.py does.
"""
from __future__ import annotations

import logging


class RingSwapLines(logging.Handler):
    """Collects the messages of the `ringswap` loggers (plan and run lines) at INFO."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logger = logging.getLogger("ringswap")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def start_comfy(device: str, dynamic: bool, disable_dynamic: bool = False):
    """ComfyUI's modules, started for `device` ("cuda" or "cpu"), with 0.33's dynamic VRAM
    when `dynamic`, or with --disable-dynamic-vram's setting; returns comfy.model_management."""
    from comfy.cli_args import args
    if device == "cpu":
        args.cpu = True
    if disable_dynamic and hasattr(args, "disable_dynamic_vram"):
        args.disable_dynamic_vram = True
    if dynamic:
        import dynamic_vram   # tests/comfyui/support: what ComfyUI 0.33's main.py does
        dynamic_vram.init_library()
    import comfy.model_management as mm
    import comfy.sample  # noqa: F401  (imported before enable(), as main.py has them)
    import comfy.sd  # noqa: F401
    if dynamic:
        dynamic_vram.enable()
    return mm
