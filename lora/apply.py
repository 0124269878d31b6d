"""Put a LoRA file's patches on a MODEL, the way ComfyUI's LoRA loaders do, with checks.

Same steps as `comfy.sd.load_lora_for_models(model, None, lora, strength, 0)`: ComfyUI's
key map (plus Wan's diffusers names, lora/keys.py), `comfy.lora_convert.convert_lora`,
`comfy.lora.load_lora`, `clone().add_patches`. On top: one summary warning instead of a
line per unknown key ("0 of N keys matched", model returned unchanged), and a ValueError
naming the key and both shapes where a patch does not fit its weight (ComfyUI only logs
that and skips the patch). On a RingSwap MODEL the patches of block weights are folded
on the device as blocks land (lora/fold.py); ComfyUI patches the rest itself.
"""
from __future__ import annotations

import logging
import os

import comfy.lora
import comfy.lora_convert
import comfy.utils

from .checks import capture_root_log, check_patcher
from .keys import model_key_map

log = logging.getLogger("ringswap.apply")

NOT_LOADED = "lora key not loaded: "
# keys of the text encoder part of a LoRA: expected to go unused by a model-only loader
TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "lora_prior_te", "te_", "te1_", "te2_")


def load_lora_file(path: str) -> dict:
    """The tensors of a LoRA file, through ComfyUI's safe loader; ValueError naming the
    file if it cannot be read."""
    try:
        sd = comfy.utils.load_torch_file(path, safe_load=True)
    except Exception as e:   # noqa: BLE001 - any reader error means a broken file
        raise ValueError(f"RingSwap LoRA: cannot read the LoRA file '{path}' ({type(e).__name__}: {e}); "
                         "the file is damaged or not a LoRA (download it again)") from e
    if not isinstance(sd, dict) or not sd:
        raise ValueError(f"RingSwap LoRA: the LoRA file '{path}' holds no tensors")
    return sd


def apply_lora(model, lora: dict, strength: float, name: str = "LoRA"):
    """A clone of `model` (a ComfyUI ModelPatcher) with `lora`'s patches at `strength`;
    `model` itself when strength is 0 or nothing in the LoRA matches the model."""
    if strength == 0:
        return model
    key_map = model_key_map(model.model)
    lora = comfy.lora_convert.convert_lora(lora)
    with capture_root_log(lambda m: m.startswith(NOT_LOADED)) as missing:
        loaded = comfy.lora.load_lora(lora, key_map)
    total = len(lora)
    new = model.clone()
    added = set(new.add_patches(loaded, strength)) if loaded else set()
    if not added:
        log.warning("RingSwap LoRA: %s: 0 of %d keys matched this %s model; the model is unchanged. "
                    "Is this a LoRA for another model?", name, total, type(model.model).__name__)
        return model
    refused = [k for k in loaded if k not in added]
    matched = total - len(missing)
    skipped = [m[len(NOT_LOADED):] for m in missing]
    skipped = [k for k in skipped if not k.startswith(TEXT_ENCODER_PREFIXES)] + [str(k) for k in refused]
    if skipped:
        log.warning("RingSwap LoRA: %s: %d of %d keys matched this %s model; not applied: %s%s", name,
                    matched, total, type(model.model).__name__, ", ".join(skipped[:8]),
                    f" (+{len(skipped) - 8} more)" if len(skipped) > 8 else "")
    check_patcher(new, keys=added)
    log.info("RingSwap LoRA: %s at strength %g: %d weights patched", name, strength, len(added))
    return new


class LoraFileCache:
    """The last few LoRA files read (a strength change does not read the file again)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.entries: dict[tuple, dict] = {}

    def get(self, path: str) -> dict:
        st = os.stat(path)
        key = (os.path.realpath(path), st.st_mtime_ns, st.st_size)
        sd = self.entries.get(key)
        if sd is None:
            sd = load_lora_file(path)
            self.entries[key] = sd
            while len(self.entries) > self.size:
                self.entries.pop(next(iter(self.entries)))
        return sd
