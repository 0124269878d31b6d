"""What the GGUF tests share: the real ComfyUI-GGUF pack (its absence a skip, in CI a failure),
tiny Wan GGUF files of every type in one folder, the pack's own loader and the stock LoRA loader."""
import os

import pytest
import torch

import folder_paths

from conftest import COMFY, CUDA
from support.gguf_files import QTYPES, comfyui_gguf_pack, write_wan_gguf
from wan_model import tiny_wan

PACK = comfyui_gguf_pack(COMFY)
BLOCKS = 4
FILES = [(q, "F32") for q in QTYPES] + [("Q8_0", "F16")]   # (block linears, the other 2-D+ tensors)


def same_lora(got: torch.Tensor, want: torch.Tensor) -> bool:
    """A LoRA run on GGUF against ComfyUI-GGUF's own: bit for bit on the CPU; on CUDA plain LoRA
    pairs fold with a fused addmm_ (one rounding per weight), so within 5e-3 (relative L2)."""
    if not CUDA:
        return torch.equal(got, want)
    return ((got.float() - want.float()).norm() / want.float().norm()).item() <= 5e-3


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


def pack_mark():
    """The test module's mark: none with the pack linked; a skip without it (a failure in CI)."""
    if PACK is not None:
        return []
    if os.environ.get("CI") == "true":
        pytest.fail(f"ComfyUI-GGUF is not linked into {COMFY}/custom_nodes (make test does it from ../shared)",
                    pytrace=False)
    return pytest.mark.skip(reason=f"ComfyUI-GGUF not in {COMFY}/custom_nodes (no ../shared/comfyui-gguf)")


def lora_on(model, fmt, strength=1.0):
    """What the stock LoraLoaderModelOnly does: comfy.sd.load_lora_for_models(model, None, ...).
    `diffusers` (Wan's diffusers names, which ComfyUI's key map does not know): RingSwap's
    LoRA loader (lora.apply), which adds them to ComfyUI's map."""
    import comfy.sd
    from ringswap.lora.apply import apply_lora
    from support.lora_files import build_lora
    if fmt == "diffusers":
        patched = apply_lora(model, build_lora(fmt, blocks=BLOCKS), strength)
    else:
        patched, _ = comfy.sd.load_lora_for_models(model, None, build_lora(fmt, blocks=BLOCKS), strength, 0)
    assert patched.patches, fmt
    return patched
