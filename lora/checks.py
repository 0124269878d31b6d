"""Check ComfyUI weight patches against the model's weights before anything is folded.

ComfyUI only logs and skips a patch that does not fit its weight; here that is a ValueError
naming the key and both shapes, from a dry run of ComfyUI's own weight math on meta tensors.
Also where a patch key lands in a RingSwap model: its block, its tensor, its logical shape.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable

import torch

import comfy.lora
import comfy.utils

from .blocks import swapped_blocks



# ----- what a patch list does -------------------------------------------------------------
def effective_patches(patches) -> tuple:
    """The patches that change a weight: a patch at strength 0 adds exactly nothing (a
    `set` patch ignores its strength, so it stays)."""
    out = []
    for p in patches:
        v = p[1]
        is_set = isinstance(v, tuple) and len(v) == 2 and v[0] == "set"
        if p[0] == 0.0 and p[2] == 1.0 and not is_set:
            continue
        out.append(p)
    return tuple(out)


def patch_shape(v) -> tuple[int, ...] | None:
    """The shape of the weight a patch was made for, where it can be told."""
    try:
        name = getattr(v, "name", None)
        if name is not None:
            w = v.weights
            if name == "lora":
                up, down, mid = w[0], w[1], w[3]
                return (up.shape[0], down.shape[1], *mid.shape[2:]) if mid is not None \
                    else (up.shape[0], *down.shape[1:])
            if name == "loha":
                return (w[0].shape[0], w[1].shape[1])
            if name == "lokr":
                w1 = w[0].shape if w[0] is not None else (w[3].shape[0], w[4].shape[1])
                w2 = w[1].shape if w[1] is not None else (w[5].shape[0], w[6].shape[1])
                return (w1[0] * w2[0], w1[1] * w2[1], *w2[2:])
            return None
        if isinstance(v, list):
            return tuple(v[0][0].shape)
        t = v[0] if len(v) == 1 else v[1][0]
        return tuple(t.shape)
    except Exception:   # noqa: BLE001 - only used for messages
        return None


def _kind(v) -> str:
    name = getattr(v, "name", None)
    if name is not None:
        return name
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], str):
        return v[0]
    return "diff"


@contextmanager
def capture_root_log(match: Callable[[str], bool]):
    """Collect (and keep off the console) the warnings ComfyUI logs on the root logger
    whose message satisfies `match`; yields the list they are collected in."""
    caught: list[str] = []

    class _Filter(logging.Filter):
        def filter(self, record):
            if record.levelno >= logging.WARNING:
                msg = record.getMessage()
                if match(msg):
                    caught.append(msg)
                    return False
            return True

    root = logging.getLogger()
    f = _Filter()
    level = root.level
    root.addFilter(f)
    if level > logging.WARNING:
        root.setLevel(logging.WARNING)
    try:
        yield caught
    finally:
        root.removeFilter(f)
        root.setLevel(level)


def check_patches(key: str, patches, shape: tuple[int, ...]) -> None:
    """Raise ValueError if ComfyUI's weight math cannot apply `patches` to a weight of
    `shape` (it would only log and skip them): a dry run on a meta tensor."""
    trial = [(1.0,) + tuple(p[1:]) for p in patches]
    error = None
    with capture_root_log(lambda m: key in m or "Calculate Weight Failed" in m) as caught:
        try:
            out = comfy.lora.calculate_weight(trial, torch.empty(shape, dtype=torch.float32, device="meta"), key)
            if tuple(out.shape) != tuple(shape):
                error = f"the patched weight would have shape {tuple(out.shape)}"
        except NotImplementedError:
            return                      # an op without meta support: cannot check here
        except (RuntimeError, ValueError, IndexError) as e:
            error = str(e)
    if error is None and caught:
        error = caught[0]
    if error is None:
        return
    for p in patches:
        got = patch_shape(p[1])
        if got is not None and (torch.Size(got).numel() != torch.Size(shape).numel() or got[:1] != tuple(shape)[:1]):
            raise ValueError(
                f"RingSwap LoRA: shape mismatch at '{key}': the LoRA's {_kind(p[1])} patch is for a weight of "
                f"shape {tuple(got)}, but the model's weight has shape {tuple(shape)}; the LoRA was made for a "
                f"different model or model size (ComfyUI: {error})")
    raise ValueError(f"RingSwap LoRA: cannot apply the patch at '{key}' to the model's weight of shape "
                     f"{tuple(shape)}: {error}")


# ----- the block side ---------------------------------------------------------------------
def meta_tensors(entries, idx):
    return [torch.empty(entries[i].shape, dtype=entries[i].dtype, device="meta") for i in idx]


def attr_shape(layout, attr) -> tuple[int, ...]:
    """Logical shape of a block attribute (a packed tensor's unpacked shape)."""
    if attr.codec is None:
        return tuple(layout.entries[attr.entries[0]].shape)
    return tuple(attr.codec.join(attr.spec, meta_tensors(layout.entries, attr.entries)).shape)


def attr_index(layout) -> dict[str, int]:
    return {(a.path + "." if a.path else "") + a.name: i for i, a in enumerate(layout.attrs)}


def weight_shape(patcher, key: str) -> tuple[int, ...] | None:
    """The (logical) shape of the model weight `key`; for blocks of a RingSwap model from
    the block layout (their modules may hold placeholders)."""
    blocks = swapped_blocks(patcher)
    hit = blocks.block_of(key) if blocks is not None else None
    if hit is not None:
        layout = blocks.block(hit[0])[1]
        i = attr_index(layout).get(hit[1])
        return None if i is None else attr_shape(layout, layout.attrs[i])
    try:
        return tuple(comfy.utils.get_attr(patcher.model, key).shape)
    except AttributeError:
        return None


def check_patcher(patcher, keys=None) -> None:
    """check_patches for every patched key of `patcher` (or only `keys`)."""
    for key in (patcher.patches if keys is None else keys):
        if isinstance(key, tuple):
            key = key[0]
        patches = patcher.patches.get(key)
        if not patches:
            continue
        if any(p[3] is not None for p in patches):
            continue                    # offset patches address part of a weight
        shape = weight_shape(patcher, key)
        if shape is not None:
            check_patches(key, patches, shape)

