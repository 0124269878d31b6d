"""A model file's tensor names against ComfyUI's names for the same tensors once loaded.

ComfyUI renames some families' tensors when it loads them (its model config's
`process_unet_state_dict`: HunyuanVideo's original names; Flux's and Chroma's `.scale` norms on
newer ComfyUI), and strips the file's prefix. Blocks are read from the file by name, so each
block tensor's file name is found by running ComfyUI's own function on the file's names.
"""
from __future__ import annotations

import logging
from typing import Iterable

import comfy.model_detection

log = logging.getLogger("ringswap.file_names")


def comfy_prefix(keys: Iterable[str]) -> str:
    """The prefix ComfyUI strips from a diffusion model file's keys ("" where none has it)."""
    keys = list(keys)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(dict.fromkeys(keys))
    return prefix if any(k.startswith(prefix) for k in keys) else ""


class FileNames:
    """ComfyUI's key of a tensor (without the file's prefix) -> the file's full key."""

    def __init__(self, model_config, file_keys: Iterable[str], prefix: str = ""):
        self.prefix = prefix
        stripped = {k[len(prefix):]: object() for k in file_keys if k.startswith(prefix)}
        self.renamed = _renames(model_config, stripped)

    def file_key(self, key: str) -> str:
        """The file's key of the tensor ComfyUI calls `key`."""
        return self.prefix + self.renamed.get(key, key)


def _renames(model_config, stripped: dict[str, object]) -> dict[str, str]:
    """{ComfyUI's key: the file's key} where they differ. Each name stands for a distinct
    object, so a renamed tensor is the same object under its new key; a tensor the function
    computes (a fused tensor split) has no file key of its own and is left out, and a function
    that cannot run on stand-ins (it computes on every tensor) renames nothing here."""
    file_key = {id(v): k for k, v in stripped.items()}
    try:
        out = model_config.process_unet_state_dict(dict(stripped))
    except Exception as e:   # noqa: BLE001 - any other computing function: names as they are
        log.debug("RingSwap: %s.process_unet_state_dict computes on tensors (%s); block names taken as they are",
                  type(model_config).__name__, type(e).__name__)
        return {}
    return {k: file_key[id(v)] for k, v in out.items() if id(v) in file_key and file_key[id(v)] != k}
