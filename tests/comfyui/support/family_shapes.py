"""Flux-, Qwen-Image- and Wan-VACE-14B-shaped families: the real widths with a few blocks per
list ("shaped", for CUDA), or the same structure and block counts at small widths ("tiny",
which runs anywhere), as support/family_models.py Families for its build().

shaped (bf16): Flux 3 double + 4 single blocks of width 3072 (24 heads of 128, MLP 4x),
3.2 GB; Qwen-Image 5 blocks of width 3072 (24 heads of 128), 3.4 GB; Wan VACE 14B 4 main
+ 2 vace blocks of width 5120 (40 heads, FFN 13824), 4.3 GB.
"""
from __future__ import annotations

import dataclasses

import torch

from support import family_models as fm

SHAPES = ("tiny", "shaped")
NAMES = ("flux", "qwen_image", "wan_vace")
BLOCKS = {"flux": dict(depth=3, depth_single_blocks=4), "qwen_image": dict(num_layers=5),
          "wan_vace": dict(num_layers=4, vace_layers=2)}
REAL = {
    "flux": dict(hidden_size=3072, num_heads=24, axes_dim=[16, 56, 56], mlp_ratio=4.0, context_in_dim=4096,
                 vec_in_dim=768),
    "qwen_image": dict(num_attention_heads=24, attention_head_dim=128, joint_attention_dim=3584,
                       axes_dims_rope=(16, 56, 56)),
    "wan_vace": dict(dim=5120, ffn_dim=13824, num_heads=40, text_dim=4096),
}
SIZE = {"tiny": 8, "shaped": 16}   # latent height and width


def _randn(g, *shape):
    return torch.randn(*shape, generator=g)


def _inputs(name: str, config: dict, size: int):
    """The family's (x, sigma, context, extra) maker for the context widths of `config`."""
    sigma = torch.tensor([0.7])
    if name == "flux":
        return lambda g: (_randn(g, 1, 16, size, size), sigma, _randn(g, 1, 8, config["context_in_dim"]),
                          {"y": _randn(g, 1, config["vec_in_dim"]), "guidance": torch.tensor([3.5])})
    if name == "qwen_image":
        return lambda g: (_randn(g, 1, 16, 1, size, size), sigma, _randn(g, 1, 8, config["joint_attention_dim"]), {})
    if name == "wan_vace":
        contexts = len(fm.VACE_STRENGTH)
        return lambda g: (_randn(g, 1, 16, 2, size, size), sigma, _randn(g, 1, 8, config["text_dim"]), {
            "vace_context": _randn(g, 1, contexts, config["vace_in_dim"], 2, size, size),
            "vace_strength": list(fm.VACE_STRENGTH)})
    raise KeyError(name)


def family(name: str, shape: str) -> fm.Family:
    """The `name` family of support/family_models.py at `shape` ("tiny" or "shaped")."""
    base = fm.BY_NAME[name]
    config = dict(base.unet_config, **BLOCKS[name], **(REAL[name] if shape == "shaped" else {}))
    calls = 0
    if name == "wan_vace":
        calls = config["num_layers"] + config["vace_layers"] * len(fm.VACE_STRENGTH)
    return dataclasses.replace(base, name=f"{name}-{shape}", unet_config=config,
                               make_inputs=_inputs(name, config, SIZE[shape]), block_calls=calls)
