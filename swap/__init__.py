"""RingSwap's block-swap engine. Imports torch only, never ComfyUI."""
from .engine import PIN_MODES, BlockSwapEngine
from .residency import ResidencyPlan
from .stats import RunStats

__all__ = ["BlockSwapEngine", "ResidencyPlan", "RunStats", "PIN_MODES"]
