"""The block-list table (loaders/comfyui_adapter/block_lists.py) against this ComfyUI's own model classes.

Each family's class exists in ComfyUI's source and builds every listed ModuleList in its
constructor, so an upstream rename fails here rather than leaving blocks resident.
"""
import importlib
import inspect
import re

import pytest

from ringswap.loaders.comfyui_adapter.block_lists import ALL_NAMES, FAMILIES, GENERIC, interleaved, list_names

MODULES = {   # where ComfyUI defines each family's diffusion model class
    "WanModel": "comfy.ldm.wan.model", "VaceWanModel": "comfy.ldm.wan.model", "Flux": "comfy.ldm.flux.model",
    "Chroma": "comfy.ldm.chroma.model", "HunyuanVideo": "comfy.ldm.hunyuan_video.model",
    "HiDreamImageTransformer2DModel": "comfy.ldm.hidream.model",
    "QwenImageTransformer2DModel": "comfy.ldm.qwen_image.model", "NextDiT": "comfy.ldm.lumina.model",
    "LTXVModel": "comfy.ldm.lightricks.model", "MMDiT": "comfy.ldm.modules.diffusionmodules.mmdit",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_class_builds_its_lists(family):
    assert family in MODULES, f"add {family} to MODULES"
    try:
        module = importlib.import_module(MODULES[family])
    except ImportError as e:
        pytest.skip(f"this ComfyUI has no {MODULES[family]}: {e}")
    cls = getattr(module, family, None)
    if cls is None:
        pytest.skip(f"this ComfyUI has no {family}")
    source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("comfy."))
    for name in FAMILIES[family]:
        assert re.search(rf"self\.{name}\s*=\s*(torch\.)?nn\.ModuleList", source), f"{family} has no {name}"
    assert list_names(cls.__new__(cls)) == FAMILIES[family]


def test_unknown_models_use_the_generic_names_and_all_names_cover_every_list():
    import torch
    assert list_names(torch.nn.Linear(2, 2)) == GENERIC
    assert set(GENERIC) <= set(ALL_NAMES)
    assert all(set(names) <= set(ALL_NAMES) for names in FAMILIES.values())


def test_only_vace_lists_interleave():
    """The engine times a block's stall from the block before's slot-free event only where
    nothing runs between them: every family but VACE (whose vace blocks run between main blocks)."""
    assert [f for f, names in FAMILIES.items() if interleaved(list(names))] == ["VaceWanModel"]
    assert not interleaved(["vace_blocks"])
