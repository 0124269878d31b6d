"""RingSwap beside ComfyUI 0.33's dynamic VRAM (RINGSWAP_DYNAMIC_VRAM=1, tests/conftest.py).

With dynamic VRAM ComfyUI's stock loader keeps the file's tensors (mmapped, in the file's
dtype, cast only by a dynamic patcher) and its lazy ops leave weights unset until a state
dict loads. RingSwap Patch clones such a MODEL onto RingSwap's own load of the same file
(patches and options kept); the Model Loader builds its model the static way. Both must
equal ComfyUI's own results, and a dynamic MODEL RingSwap cannot re-read is refused.
"""
import pytest
import torch

import comfy.model_management
import comfy.sd
import comfy.utils

from conftest import DYNAMIC_VRAM
from ringswap.loaders.comfyui_adapter import comfy_models
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_state import swap_state_on
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ringswap.nodes.patch import RingSwapPatch
from support.lora_files import build_lora
from wan_model import forward, inputs, load_static, tiny_wan

pytestmark = pytest.mark.skipif(not DYNAMIC_VRAM, reason="needs RINGSWAP_DYNAMIC_VRAM=1 (ComfyUI 0.33+)")


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    return tiny_wan(str(tmp_path_factory.mktemp("dyn")), blocks=5)


def load_stock(path):
    """Load Diffusion Model as ComfyUI builds it with dynamic VRAM on (lazy ops; on a CPU
    under a static patcher, correct for fp32 files)."""
    return comfy.sd.load_diffusion_model(path)


def outputs(model, seeds=(0, 1)):
    return [forward(model, *inputs(seed=s)) for s in seeds]


def test_stock_loader_builds_for_dynamic_vram(wan):
    """The premise: the stock MODEL holds lazily built layers over the file's tensors."""
    stock = load_stock(wan)
    assert comfy_models.built_for_dynamic_vram(stock)
    assert comfy_models.source_file(stock) == (wan, {})


@pytest.mark.parametrize("window,prefetch", [(1, 1), (2, 2), (5, 1)])
def test_patch_on_dynamic_model_equals_stock(wan, window, prefetch):
    stock = load_stock(wan)
    ref = outputs(stock)
    comfy.model_management.unload_all_models()
    (patched,) = RingSwapPatch().patch(stock, window, prefetch, "auto")
    assert isinstance(patched, SwapModelPatcher)
    assert patched.model is not stock.model, "cloned onto RingSwap's own load of the file"
    assert not comfy_models.built_for_dynamic_vram(patched)
    for run in range(2):
        got = outputs(patched)
        for k in range(2):
            assert torch.equal(got[k], ref[k]), f"run {run} input {k}"
        comfy.model_management.unload_all_models()
    # the stock MODEL's own blocks are untouched (RingSwap never swaps them)
    assert swap_state_on(stock.model.diffusion_model) is None


def test_patch_keeps_the_patches_of_the_dynamic_model(wan):
    """A LoRA applied before RingSwap Patch (stock LoraLoaderModelOnly) stays applied."""
    lora = build_lora("kohya", dim=128, ffn_dim=256, blocks=5)
    stock = load_stock(wan)
    with_lora, _ = comfy.sd.load_lora_for_models(stock, None, lora, 0.8, 0)
    ref = outputs(with_lora)
    comfy.model_management.unload_all_models()
    (patched,) = RingSwapPatch().patch(with_lora, 2, 1, "auto")
    assert patched.patches.keys() == with_lora.patches.keys()
    got = outputs(patched)
    for k in range(2):
        assert torch.equal(got[k], ref[k]) if got[k].device.type == "cpu" else \
            torch.allclose(got[k], ref[k], rtol=1e-2, atol=1e-3)


def test_patch_reuses_its_load_for_other_settings(wan):
    stock = load_stock(wan)
    (a,) = RingSwapPatch().patch(stock, 1, 1, "auto")
    (b,) = RingSwapPatch().patch(stock, 3, 0, "auto")
    assert a.model is b.model, "changing window/prefetch must not read the file again"


def test_patch_refuses_a_dynamic_model_it_cannot_read(wan):
    """A MODEL built for dynamic VRAM from a state dict (no file ComfyUI can rebuild it from)."""
    sd, metadata = comfy.utils.load_torch_file(wan, return_metadata=True)
    stock = comfy.sd.load_diffusion_model_state_dict(sd, metadata=metadata)
    assert comfy_models.built_for_dynamic_vram(stock) and comfy_models.source_file(stock) is None
    with pytest.raises(ValueError, match="dynamic VRAM.*RingSwap Model Loader.*--disable-dynamic-vram"):
        RingSwapPatch().patch(stock, 2, 1, "auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_loader_under_dynamic_vram_equals_static_stock(tmp_path, dtype):
    """The loader's model is built statically although ComfyUI's ops are lazy: it equals
    ComfyUI's own static load of the file (cast to the model's dtypes while loading)."""
    path = tiny_wan(str(tmp_path), blocks=4, dtype=dtype)
    ref = outputs(load_static(path))
    comfy.model_management.unload_all_models()
    for home in ("ram", "disk"):
        model = load_swapped_model(path, SwapSettings(2, 1), home=home, disk_workers=2)
        assert not comfy_models.built_for_dynamic_vram(model)
        got = outputs(model)
        for k in range(2):
            assert torch.equal(got[k], ref[k]), f"{dtype} home={home} input {k}"
        comfy.model_management.unload_all_models()


def test_patch_keeps_the_stock_loaders_options(wan):
    """Load Diffusion Model's weight_dtype (model_options) is what RingSwap's own load uses too."""
    options = {"dtype": torch.float8_e4m3fn}
    stock = comfy.sd.load_diffusion_model(wan, model_options=options)
    assert comfy_models.source_file(stock) == (wan, options)
    ref = outputs(load_static(wan, options))
    comfy.model_management.unload_all_models()
    (patched,) = RingSwapPatch().patch(stock, 2, 1, "auto")
    assert patched.model.diffusion_model.blocks[0].self_attn.q.weight.dtype == torch.float8_e4m3fn
    got = outputs(patched)
    for k in range(2):
        assert torch.equal(got[k], ref[k]), f"input {k}"


@torch.no_grad()
def test_two_patch_nodes_on_clones_of_one_model_share_its_weight_backups(wan):
    """Two RingSwap Patch nodes on LoRA'd clones of one dynamic MODEL run on RingSwap's one load
    of the file; each restores what the other patched (ComfyUI's clones of one model share their
    backups): each equals ComfyUI's own LoRA run, in turn and again."""
    def with_lora(model, seed):
        return comfy.sd.load_lora_for_models(model, None, build_lora("mixed", blocks=5, seed=seed), 1.0, 0)[0]
    refs = []
    for seed in (1, 2):
        refs.append(forward(with_lora(load_static(wan), seed), *inputs(seed=0)))
        comfy.model_management.unload_all_models()
    stock = load_stock(wan)
    (a,) = RingSwapPatch().patch(with_lora(stock, 1), 2, 1, "auto")
    (b,) = RingSwapPatch().patch(with_lora(stock, 2), 3, 1, "auto")
    assert a.model is b.model
    for model, ref in ((a, refs[0]), (b, refs[1]), (a, refs[0])):
        assert torch.equal(forward(model, *inputs(seed=0)), ref)
    comfy.model_management.unload_all_models()


def test_static_construction_is_seen_only_by_the_thread_that_builds(tmp_path, monkeypatch):
    """The plan route builds a file's outline on a worker thread, statically: the prompt thread
    (loading a model with dynamic VRAM at that moment) must see dynamic VRAM on throughout, and
    overlapping static builds each see it off until they end."""
    import threading

    import comfy.memory_management as memory_management
    from ringswap.loaders.comfyui_adapter import file_plan
    monkeypatch.setattr(memory_management, "aimdo_enabled", True)   # as on a CUDA machine
    path = tiny_wan(str(tmp_path), blocks=12, seed=3)
    seen, done = set(), threading.Event()
    worker = threading.Thread(target=lambda: (file_plan.file_facts(path), done.set()))
    worker.start()
    while not done.is_set():
        seen.add(memory_management.aimdo_enabled)
    worker.join()
    assert seen == {True}
    first_in, first_out, inside = threading.Event(), threading.Event(), []

    def first():
        with comfy_models.static_construction():
            first_in.set()
            first_out.wait(5)
    t = threading.Thread(target=first)
    t.start()
    first_in.wait(5)
    with comfy_models.static_construction():
        first_out.set()
        t.join()
        inside.append(memory_management.aimdo_enabled)
    assert inside == [False] and memory_management.aimdo_enabled
