"""What a ComfyUI sampling run tells RingSwap about its shape: the steps of a run (from the
function an OUTER_SAMPLE wrapper runs) and a latent format's pixels per latent cell and frames
per latent frame. Where ComfyUI versions differ, the attribute is asked for first.
"""
from __future__ import annotations

import inspect

import torch


def sampling_steps(executor, args: tuple, kwargs: dict) -> int | None:
    """Steps of a sampling run, from the `sigmas` argument of the function an OUTER_SAMPLE
    wrapper's executor runs (CFGGuider.outer_sample), found by name in its signature; None
    where it has none."""
    try:
        bound = inspect.signature(executor.original).bind_partial(*args, **kwargs)
    except (AttributeError, TypeError, ValueError):
        return None
    sigmas = bound.arguments.get("sigmas")
    return max(0, len(sigmas) - 1) if isinstance(sigmas, torch.Tensor) and sigmas.ndim == 1 else None


def spatial_downscale(latent_format) -> int:
    """Pixels per latent cell along a side (`spacial_downscale_ratio` where the format has
    it, from 0.33 on; before that 8, ComfyUI's VAE default)."""
    return int(getattr(latent_format, "spacial_downscale_ratio", 8))


def temporal_downscale(latent_format) -> int:
    """Frames per latent frame of a video format (`temporal_downscale_ratio`; else 4, the
    causal video VAEs' 1 + 4k frames)."""
    ratio = getattr(latent_format, "temporal_downscale_ratio", None)
    return int(ratio) if ratio and ratio > 1 else 4
