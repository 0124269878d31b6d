"""The widgets of RingSwap's nodes, written once.

Each widget's kind, default, range or choices and tooltip live here; the nodes build their
INPUT_TYPES from these specs and the plan route (nodes/routes.py) checks its query against
the same specs, so a widget and the route's parameter of the same name cannot drift apart.
web/ringswap.js reads the node widgets by these names (window, prefetch, home,
vram_budget_gb, compress) to ask the route for a plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..swap import PIN_MODES
from ..swap.coding_choice import COMPRESS_MODES
from ..swap.home_policy import HOMES


class BadValue(ValueError):
    """A value a widget's spec refuses; the message names the widget."""


@dataclass(frozen=True)
class Number:
    """An INT or FLOAT widget. `default=None`: no default (a query must give it)."""
    kind: type
    default: Any
    lo: Any
    hi: Any
    step: Any = None
    tooltip: str = ""

    def input(self, tooltip: str | None = None) -> tuple:
        """The node's INPUT_TYPES entry."""
        opts = {"default": self.default, "min": self.lo, "max": self.hi}
        if self.step is not None:
            opts["step"] = self.step
        opts["tooltip"] = self.tooltip if tooltip is None else tooltip
        return ("INT" if self.kind is int else "FLOAT", opts)

    def parse(self, name: str, raw: str | None):
        """The value of query text `raw` (None or "": the default), checked against the range."""
        if raw is None or raw == "":
            if self.default is None:
                raise BadValue(f"'{name}' is required ({self.kind.__name__} from {self.lo} to {self.hi})")
            return self.default
        try:
            value = self.kind(raw)
        except ValueError:
            raise BadValue(f"'{name}' must be a{'n integer' if self.kind is int else ' number'}, got {raw!r}") from None
        if not self.lo <= value <= self.hi:
            raise BadValue(f"'{name}' must be from {self.lo} to {self.hi}, got {raw}")
        return value


@dataclass(frozen=True)
class Choice:
    """A combo widget: one of `choices`."""
    choices: tuple[str, ...]
    default: str
    tooltip: str = ""

    def input(self) -> tuple:
        """The node's INPUT_TYPES entry."""
        return (list(self.choices), {"default": self.default, "tooltip": self.tooltip})

    def parse(self, name: str, raw: str | None) -> str:
        """The choice named by query text `raw` (None or "": the default)."""
        value = raw or self.default
        if value not in self.choices:
            raise BadValue(f"'{name}' must be one of {', '.join(self.choices)}, got {value!r}")
        return value


# ----- block swapping (RingSwap Patch, RingSwap Model Loader; the plan route) ------------------
WINDOW = Number(int, 0, 0, 1000, tooltip=(
    "Transformer blocks kept on the GPU. window-1 blocks stay resident for the whole run; the "
    "others stream through a small ring of GPU slots. 0 = automatic: as many as fit beside this "
    "run's activations in the free VRAM (or vram_budget_gb), planned again every run; the log's "
    "'RingSwap plan:' line says why. Values above the model's block count are clamped."))
PREFETCH = Number(int, 1, 0, 8, tooltip=(
    "Blocks copied ahead of the one computing (extra GPU slots). 1 hides copies under "
    "compute on most cards; 0 uses the least VRAM."))
VRAM_BUDGET = Number(float, 0.0, 0.0, 1024.0, 0.5, tooltip=(
    "VRAM in GB this model may use in all (its weights on the GPU and the activations of a step), "
    "for keeping the rest of the card for other programs. 0 = whatever is free (after ComfyUI's "
    "--reserve-vram). With window 0 the window is sized to fit; a set window is kept."))
COMPRESS = Choice(COMPRESS_MODES, "auto", tooltip=(
    "Keep the blocks that stream from RAM losslessly compressed (bf16/fp16: their sign-and-exponent "
    "bytes coded with NVIDIA nvCOMP's ANS, about 0.7 x the bytes): less RAM and fewer bytes over the "
    "link, decoded on the GPU, bit-identical output. auto: when nvCOMP and CUDA are there and RAM is "
    "short, or where a measured run was copy-bound and coding is estimated at least 5% faster a call (the plan line says why); on: always (an error "
    "without nvCOMP: pip install nvidia-nvcomp-cu13, or -cu12 for a CUDA 12 torch); off: never."))
PIN_MEMORY = Choice(PIN_MODES, "auto", tooltip=(
    "Page-lock the host copies of streamed blocks for fast async copies. auto: pin, and fall back "
    "to pageable memory + a pinned staging ring if pinning fails; on: pin or fail; off: never pin "
    "(slow copies, for systems where pinning misbehaves)."))

# ----- the file's blocks (RingSwap Model Loader) ---------------------------------------------
HOME = Choice(("auto",) + tuple(h for h in HOMES if h != "auto"), "auto", tooltip=(
    "Where blocks that are not on the GPU live. auto: the blocks that stream every step get RAM "
    "first (as much as ram_budget_gb or the free RAM allows), the rest is read from the file each "
    "step; blocks kept on the GPU hold no RAM; the plan line says the split. ram: the whole model "
    "is read once into (pinned) host RAM at load. disk: every streamed block is read from the file "
    "ahead of need on every step; host RAM stays at a few blocks, speed is bound by the disk."))
RAM_BUDGET = Number(float, 0.0, 0.0, 4096.0, 1.0, tooltip=(
    "home=auto: host RAM (GB) this model's streamed blocks may hold. 0 = automatic: the RAM "
    "available when sampling starts, less a margin of 10% of it (at least 2 GB) and what ComfyUI "
    "keeps for its RAM cache."))
DISK_WORKERS = Number(int, 0, 0, 32, tooltip=(
    "Reader threads for the file (positioned reads, one file handle each). 0 (auto): one per CPU "
    "core, 4 to 16, which reads a file in the page cache at the memory's rate. A disk that reads "
    "slower with many parallel streams (HDD, some network/virtual disks) may do better with 1-4. "
    "With home=disk, host RAM for blocks is about min(this, 4) blocks (at least 2)."))
UNET_NAME_TIP = ("A .safetensors diffusion model (bf16, fp16, fp32, fp8, scaled fp8), or a "
                 ".gguf one (read with the ComfyUI-GGUF pack's loader, which must be installed).")

# ----- LoRAs (RingSwap LoRA, RingSwap LoRA Stack) --------------------------------------------
LORA_MODEL_TIP = "The diffusion model to apply the LoRA to (a RingSwap MODEL or any other MODEL)."
LORA_NAME_TIP = ("A LoRA file from the loras folder (any format ComfyUI reads: LoRA/LoCon, LoHa, LoKr, "
                 "DoRA, diff, set; kohya, ComfyUI and diffusers key names).")
STRENGTH = Number(float, 1.0, -100.0, 100.0, 0.01, tooltip=(
    "How strongly the LoRA changes the model (1.0 = as trained, 0 = off, negative values "
    "invert it). Changing it needs no reload: blocks are patched on the GPU as they arrive."))
LORA_ON_TIP = "Apply this row's LoRA (off: skipped, as if its name were None)."
