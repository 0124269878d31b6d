"""Tiny random LoRA files for the tiny Wan models of ``wan_files``/``quant_files``.

Every format ComfyUI's ``comfy.lora.load_lora`` reads, with the key names found in the
wild for Wan (``<L>`` = a block Linear, e.g. block 0's self-attention q):

- ``kohya``: ``lora_unet_blocks_0_self_attn_q.lora_down.weight`` (r, in),
  ``.lora_up.weight`` (out, r), ``.alpha`` (scalar).
- ``peft``: ComfyUI's module names with PEFT suffixes:
  ``diffusion_model.blocks.0.self_attn.q.lora_A.weight`` (r, in), ``.lora_B.weight`` (out, r).
- ``diffusers``: diffusers' WanTransformer3DModel names (``attn1`` = self-attention,
  ``attn2`` = cross-attention, ``ffn.net.0.proj``, ``ffn.net.2``) with PEFT suffixes:
  ``diffusion_model.blocks.0.attn1.to_q.lora_A.weight``; ``to_diffusers_names`` renames a
  ``peft`` dict to these.
- ``loha``: ``.hada_w1_a`` (out, r), ``.hada_w1_b`` (r, in), ``.hada_w2_a``, ``.hada_w2_b``, ``.alpha``.
- ``lokr``: ``.lokr_w1`` (a, b) full, ``.lokr_w2_a`` (out/a, r), ``.lokr_w2_b`` (r, in/b), ``.alpha``.
- ``dora``: ``kohya`` plus ``.dora_scale`` (out, 1) (DoRA magnitude, near the row norms).
- ``diff``: ``diffusion_model.blocks.0.ffn.2.diff`` (full weight delta) and the same for
  ``norm3`` / ``self_attn.norm_q`` weights and the bare ``modulation`` parameter.
- ``diff_b``: ``diffusion_model.blocks.0.self_attn.q.diff_b`` (bias delta).
- ``set``: ``diffusion_model.blocks.0.norm3.set_weight`` (replaces the weight).
- ``mixed``: one file using all of the above on different weights of every block, plus a
  LoRA on two non-block weights (``head.head``, ``text_embedding.0``).

``other_arch_lora`` gives a Flux-named LoRA (matches nothing in Wan).
"""
from __future__ import annotations

import os

import torch

LINEARS = ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o",
           "cross_attn.q", "cross_attn.k", "cross_attn.v", "cross_attn.o", "ffn.0", "ffn.2")
TO_DIFFUSERS = {"self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
                "self_attn.o": "attn1.to_out.0", "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k",
                "cross_attn.v": "attn2.to_v", "cross_attn.o": "attn2.to_out.0",
                "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2"}
FORMATS = ("kohya", "peft", "diffusers", "loha", "lokr", "dora", "diff", "diff_b", "set", "mixed")
STD = 0.05


def linear_shape(name: str, dim: int, ffn_dim: int) -> tuple[int, int]:
    if name == "ffn.0":
        return ffn_dim, dim
    if name == "ffn.2":
        return dim, ffn_dim
    return dim, dim


class _Gen:
    def __init__(self, seed):
        self.g = torch.Generator().manual_seed(seed)

    def randn(self, *shape, std=STD):
        return torch.randn(shape, generator=self.g) * std


def kohya(i, name):
    return f"lora_unet_blocks_{i}_{name.replace('.', '_')}"


def comfy_name(i, name):
    return f"diffusion_model.blocks.{i}.{name}"


def _lora(g, x, out, inn, rank, alpha=True, peft=False):
    d = {}
    if peft:
        d[f"{x}.lora_A.weight"] = g.randn(rank, inn)
        d[f"{x}.lora_B.weight"] = g.randn(out, rank)
    else:
        d[f"{x}.lora_down.weight"] = g.randn(rank, inn)
        d[f"{x}.lora_up.weight"] = g.randn(out, rank)
    if alpha:
        d[f"{x}.alpha"] = torch.tensor(float(rank))
    return d


def _loha(g, x, out, inn, rank):
    return {f"{x}.hada_w1_a": g.randn(out, rank, std=0.2), f"{x}.hada_w1_b": g.randn(rank, inn, std=0.2),
            f"{x}.hada_w2_a": g.randn(out, rank, std=0.2), f"{x}.hada_w2_b": g.randn(rank, inn, std=0.2),
            f"{x}.alpha": torch.tensor(float(rank))}


def _lokr(g, x, out, inn, rank, factor=4):
    return {f"{x}.lokr_w1": g.randn(factor, factor, std=0.3),
            f"{x}.lokr_w2_a": g.randn(out // factor, rank, std=0.1),
            f"{x}.lokr_w2_b": g.randn(rank, inn // factor, std=0.1),
            f"{x}.alpha": torch.tensor(float(rank))}


def _dora(g, x, out, inn, rank, peft=False):
    d = _lora(g, x, out, inn, rank, peft=peft)
    row_norm = 0.02 * inn ** 0.5
    d[f"{x}.dora_scale"] = (row_norm * (1 + 0.1 * torch.randn(out, 1, generator=g.g))).abs()
    return d


def build_lora(fmt: str, dim=128, ffn_dim=256, blocks=4, rank=4, seed=0) -> dict[str, torch.Tensor]:
    """A LoRA state dict in format ``fmt`` (see FORMATS) for a Wan of these sizes."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown LoRA format {fmt!r}; expected one of {FORMATS}")
    g = _Gen(seed)
    sd: dict[str, torch.Tensor] = {}
    for i in range(blocks):
        if fmt in ("kohya", "peft", "diffusers", "loha", "lokr", "dora"):
            for name in LINEARS:
                out, inn = linear_shape(name, dim, ffn_dim)
                if fmt == "kohya":
                    sd.update(_lora(g, kohya(i, name), out, inn, rank))
                elif fmt == "peft":
                    sd.update(_lora(g, comfy_name(i, name), out, inn, rank, alpha=False, peft=True))
                elif fmt == "diffusers":
                    x = f"diffusion_model.blocks.{i}.{TO_DIFFUSERS[name]}"
                    sd.update(_lora(g, x, out, inn, rank, alpha=False, peft=True))
                elif fmt == "loha":
                    sd.update(_loha(g, kohya(i, name), out, inn, rank))
                elif fmt == "lokr":
                    sd.update(_lokr(g, kohya(i, name), out, inn, rank))
                else:
                    sd.update(_dora(g, kohya(i, name), out, inn, rank))
        elif fmt == "diff":
            sd[comfy_name(i, "ffn.2") + ".diff"] = g.randn(dim, ffn_dim, std=0.01)
            sd[comfy_name(i, "norm3") + ".diff"] = g.randn(dim, std=0.1)
            sd[comfy_name(i, "self_attn.norm_q") + ".diff"] = g.randn(dim, std=0.1)
            sd[comfy_name(i, "modulation") + ".diff"] = g.randn(1, 6, dim, std=0.01)
        elif fmt == "diff_b":
            for name in LINEARS:
                out, _ = linear_shape(name, dim, ffn_dim)
                sd[comfy_name(i, name) + ".diff_b"] = g.randn(out, std=0.05)
        elif fmt == "set":
            sd[comfy_name(i, "norm3") + ".set_weight"] = 1.0 + g.randn(dim, std=0.1)
            sd[comfy_name(i, "self_attn.norm_k") + ".set_weight"] = 1.0 + g.randn(dim, std=0.1)
        else:   # mixed: every format on some weight of every block
            sd.update(_lora(g, kohya(i, "self_attn.q"), dim, dim, rank))
            sd.update(_loha(g, kohya(i, "self_attn.k"), dim, dim, rank))
            sd.update(_lokr(g, kohya(i, "self_attn.v"), dim, dim, rank))
            sd.update(_dora(g, comfy_name(i, "self_attn.o"), dim, dim, rank, peft=True))
            sd.update(_lora(g, f"diffusion_model.blocks.{i}.attn2.to_q", dim, dim, rank, alpha=False, peft=True))
            sd.update(_lora(g, comfy_name(i, "cross_attn.k"), dim, dim, rank, alpha=False, peft=True))
            sd.update(_lora(g, kohya(i, "ffn.0"), ffn_dim, dim, rank))
            sd[comfy_name(i, "ffn.0") + ".diff_b"] = g.randn(ffn_dim, std=0.05)
            sd[comfy_name(i, "ffn.2") + ".diff"] = g.randn(dim, ffn_dim, std=0.01)
            sd[comfy_name(i, "cross_attn.o") + ".diff_b"] = g.randn(dim, std=0.05)
            sd[comfy_name(i, "norm3") + ".set_weight"] = 1.0 + g.randn(dim, std=0.1)
            sd[comfy_name(i, "self_attn.norm_q") + ".diff"] = g.randn(dim, std=0.1)
            sd[comfy_name(i, "modulation") + ".diff"] = g.randn(1, 6, dim, std=0.01)
    if fmt == "mixed":
        sd.update(_lora(g, "lora_unet_head_head", 64, dim, rank))
        sd.update(_lora(g, "lora_unet_text_embedding_0", dim, 4096, rank))
    return {k: v.contiguous() for k, v in sd.items()}


def to_diffusers_names(sd: dict) -> dict:
    """The same LoRA with ComfyUI module names turned into diffusers' (and back is ComfyUI's job)."""
    out = {}
    for k, v in sd.items():
        for name, dn in TO_DIFFUSERS.items():
            k = k.replace(f".{name}.lora_", f".{dn}.lora_")
        out[k] = v
    return out


def from_diffusers_names(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        for name, dn in TO_DIFFUSERS.items():
            k = k.replace(f".{dn}.lora_", f".{name}.lora_")
        out[k] = v
    return out


def other_arch_lora(rank=4, seed=0) -> dict:
    """A LoRA for Flux (double/single stream blocks): nothing in it names a Wan weight."""
    g = _Gen(seed)
    sd = {}
    for i in range(2):
        sd.update(_lora(g, f"lora_unet_double_blocks_{i}_img_attn_qkv", 3 * 128, 128, rank))
        sd.update(_lora(g, f"lora_unet_single_blocks_{i}_linear1", 4 * 128, 128, rank))
    return sd


def write_lora(path, sd: dict) -> str:
    from safetensors.torch import save_file
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    return path
