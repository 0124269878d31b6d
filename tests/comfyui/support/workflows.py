"""API-format ComfyUI workflows used by the integration tests and ``make demo``."""
from __future__ import annotations


def build_workflow(unet_name, use_patch=True, window=2, prefetch=1, seed=0, steps=4,
                   pin_memory="auto", width=64, height=64, length=5, cfg=1.0,
                   sampler_name="euler", scheduler="simple", denoise=1.0,
                   cond_length=16, filename_prefix="ringswap_demo") -> dict:
    """UNETLoader -> [RingSwapPatch] -> KSampler -> SaveLatent, conditioning from
    RingSwapDemoConditioning, latent from EmptyHunyuanLatentVideo (16 channels, Wan's).

    Node ids: "1" UNETLoader, "2" RingSwapPatch (only when use_patch), "3"/"4" positive/
    negative conditioning, "5" latent, "6" KSampler, "7" SaveLatent.
    """
    wf = {
        "1": {"class_type": "UNETLoader",
              "inputs": {"unet_name": unet_name, "weight_dtype": "default"}},
        "3": {"class_type": "RingSwapDemoConditioning",
              "inputs": {"seed": seed + 1, "length": cond_length, "dim": 4096}},
        "4": {"class_type": "RingSwapDemoConditioning",
              "inputs": {"seed": seed + 2, "length": cond_length, "dim": 4096}},
        "5": {"class_type": "EmptyHunyuanLatentVideo",
              "inputs": {"width": width, "height": height, "length": length,
                         "batch_size": 1}},
        "6": {"class_type": "KSampler",
              "inputs": {"model": ["2", 0] if use_patch else ["1", 0],
                         "seed": seed, "steps": steps, "cfg": cfg,
                         "sampler_name": sampler_name, "scheduler": scheduler,
                         "positive": ["3", 0], "negative": ["4", 0],
                         "latent_image": ["5", 0], "denoise": denoise}},
        "7": {"class_type": "SaveLatent",
              "inputs": {"samples": ["6", 0], "filename_prefix": filename_prefix}},
    }
    if use_patch:
        wf["2"] = {"class_type": "RingSwapPatch",
                   "inputs": {"model": ["1", 0], "window": window, "prefetch": prefetch,
                              "pin_memory": pin_memory}}
    return wf
