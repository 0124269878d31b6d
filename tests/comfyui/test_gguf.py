"""GGUF models (city96's ComfyUI-GGUF, the real pack from ../shared) block-swapped by RingSwap
Patch: the Unet Loader (GGUF) MODEL streams its quantized blocks in their GGUF bytes and the
output equals ComfyUI-GGUF's own run bit for bit."""
import os

import pytest
import torch

import comfy.model_management
import folder_paths

from conftest import COMFY
from ringswap.nodes.patch import RingSwapPatch
from support.gguf_files import QTYPES, comfyui_gguf_pack, write_wan_gguf
from wan_model import forward, inputs, tiny_wan

PACK = comfyui_gguf_pack(COMFY)
if PACK is None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"ComfyUI-GGUF is not linked into {COMFY}/custom_nodes (make test does it from ../shared)",
                    pytrace=False)
    pytestmark = pytest.mark.skip(reason=f"ComfyUI-GGUF not in {COMFY}/custom_nodes (no ../shared/comfyui-gguf)")

BLOCKS = 4
FILES = [(q, "F32") for q in QTYPES] + [("Q8_0", "F16")]   # (block linears, the other 2-D+ tensors)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("gguf_models"))
    src = tiny_wan(d, blocks=BLOCKS, dtype=torch.float32)
    for q, other in FILES:
        write_wan_gguf(src, os.path.join(d, f"wan_{q}_{other}.gguf"), q, other)
    folder_paths.add_model_folder_path("diffusion_models", d)   # "unet" is its legacy name
    yield d
    folder_paths.folder_names_and_paths["diffusion_models"][0].remove(d)


def load_gguf(name):
    (model,) = PACK.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(name)
    return model


@pytest.mark.parametrize("qtype,other", FILES)
def test_gguf_model_patched_equals_comfyui_gguf(gguf_dir, qtype, other):
    """Unet Loader (GGUF) alone vs -> RingSwap Patch at windows 1, 2 and all, prefetch 0-2,
    two runs each: bit-identical; the streamed blocks travel in their GGUF bytes."""
    name = f"wan_{qtype}_{other}.gguf"
    stock = load_gguf(name)
    assert type(stock).__name__ == "GGUFModelPatcher"
    types = {getattr(getattr(t, "tensor_type", None), "name", None) for t in stock.model.diffusion_model.parameters()}
    assert qtype in types and other in types, types
    want = forward(stock, *inputs(seed=0))
    comfy.model_management.unload_all_models()
    for window, prefetch in ((1, 0), (1, 1), (2, 2), (BLOCKS, 1)):
        (model,) = RingSwapPatch().patch(load_gguf(name), window, prefetch, "auto")
        engine = model.swap_engine
        for _ in range(2):
            assert torch.equal(forward(model, *inputs(seed=0)), want), (qtype, window, prefetch)
        qkv = next(a for a in engine.states[0].layout.attrs if (a.path, a.name) == ("self_attn.q", "weight"))
        entry = engine.states[0].layout.entries[qkv.entries[0]]
        assert entry.dtype == torch.uint8 and qkv.codec is not None, "the block weight travels as GGUF bytes"
        comfy.model_management.unload_all_models()


def test_lora_on_a_gguf_model_is_refused_clearly(gguf_dir):
    """Until LoRAs on GGUF fold once per landing, a LoRA on a GGUF MODEL under RingSwap Patch
    is refused with an error that says so (never a silently wrong fold of GGUF bytes)."""
    import comfy.sd
    from support.lora_files import build_lora, from_diffusers_names
    lora = from_diffusers_names(build_lora("kohya", blocks=BLOCKS))
    stock, _ = comfy.sd.load_lora_for_models(load_gguf("wan_Q8_0_F32.gguf"), None, lora, 1.0, 0)
    assert stock.patches
    (model,) = RingSwapPatch().patch(stock, 2, 1, "auto")
    with pytest.raises(Exception, match="GGUF") as ei:
        forward(model, *inputs(seed=0))
    assert "LoRA" in str(ei.value), str(ei.value)
    comfy.model_management.unload_all_models()


@pytest.mark.server
def test_gguf_workflow_over_http_equals_comfyui_gguf(shared_models, shared_server):
    """As a user would: Unet Loader (GGUF) -> KSampler vs Unet Loader (GGUF) -> RingSwap Patch
    (windows 1 and 2) -> KSampler on a server that loaded the real ComfyUI-GGUF pack: the same
    latent bit for bit, two runs each."""
    from safetensors.torch import load_file
    from support.workflows import build_workflow
    d = os.path.join(shared_models, "diffusion_models")
    os.makedirs(d, exist_ok=True)
    name = "tiny_wan_http_Q8_0.gguf"
    write_wan_gguf(tiny_wan(str(shared_models), blocks=BLOCKS, dtype=torch.float32, seed=3), os.path.join(d, name))
    assert "UnetLoaderGGUF" in shared_server.object_info(), "the server did not load ComfyUI-GGUF"

    def latent(use_patch, window=2, prefix="gguf_stock"):
        wf = build_workflow(name, use_patch=use_patch, window=window, seed=5, steps=2, filename_prefix=prefix)
        wf["1"] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": name}}
        entry = shared_server.run(wf, timeout=300)
        (path,) = [p for p in shared_server.output_files(entry, "latents") if os.path.isfile(p)]
        return load_file(path)["latent_tensor"]
    want = latent(False)
    for window in (1, 2):
        for run in range(2):
            assert torch.equal(latent(True, window, f"gguf_w{window}_{run}"), want), (window, run)

