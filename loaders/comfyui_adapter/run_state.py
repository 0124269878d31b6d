"""Where a model's swap run keeps its state: a `RunState` on each SwapModelPatcher (its own
plan, request and fold) and the `SwapState` on the diffusion model (shared by all
patchers of that model, as `ringswap_state`)."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ...lora.fold import BlockFolder
    from ...swap.window_plan import WindowPlan
    from .run_plan import RunRequest
    from .swap_state import SwapState


@dataclass
class RunState:
    """One patcher's sampling run. A clone starts with a fresh one (ComfyUI builds it anew)."""

    plan: WindowPlan | None = None
    """The plan of the current load (shrunk after out-of-memory, re-planned by rates)."""
    request: RunRequest | None = None
    """What the current sampling run asks of the model (set by PREPARE_SAMPLING)."""
    folder_key: tuple[uuid.UUID, torch.device, bool] | None = None
    """(patches_uuid, device, dense on landing) that `folder` was made for; None before one was made."""
    folder: BlockFolder | None = None
    """The cached fold run on each block as it lands (LoRA patches, GGUF weights made dense; or None)."""
    packed_only: bool = False
    """Unpatched GGUF weights stay packed in their layers this load: made dense on landing, the
    plan did not fit (lora/fold.py block_folder's `dense_on_land`)."""
    reloading: bool = False
    """ComfyUI is loading this patcher again (is_clone(self)): its next detach keeps the blocks."""


def swap_state_on(diffusion_model: nn.Module) -> SwapState | None:
    """The SwapState installed on `diffusion_model` itself, or None. Read from the module's
    own attributes, not getattr: a wrapper module that forwards attribute reads (torch.compile's
    OptimizedModule, swapped in by ComfyUI's compile wrapper during a model call) has none."""
    return vars(diffusion_model).get("ringswap_state")
