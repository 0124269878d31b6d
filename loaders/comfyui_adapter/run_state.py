"""Where a model's swap run keeps its state: a `RunState` on each SwapModelPatcher (its own
plan, request and fold). The state all patchers of one model share is swap_state.SwapState."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ...lora.fold import BlockFolder
    from ...swap.load_plan import LoadPlan
    from .run_facts import RunRequest


@dataclass
class RunState:
    """One patcher's sampling run. A clone starts with a fresh one (ComfyUI builds it anew)."""

    plan: LoadPlan | None = None
    """The plan of the current load (shrunk after out-of-memory, re-planned by rates): the only copy."""
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
