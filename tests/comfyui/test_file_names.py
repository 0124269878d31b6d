"""Files that name their tensors otherwise than ComfyUI's model: HunyuanVideo's original names
and Flux's `.scale` norms (ComfyUI renames both at load where its version does), a `model.`
prefix; and GGUF float tensors the model holds in another dtype. RingSwap Model Loader reads
each block tensor under the file's own name (cast where the model's dtype differs): equal to
the stock loader or ComfyUI-GGUF bit for bit, homes ram and disk."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import comfy.model_management
import folder_paths
from comfy.cli_args import args

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from support import family_files as ffs
from support import family_models as fm
from support.gguf_case import PACK, pack_mark
from support.gguf_files import write_wan_gguf
from wan_model import forward, inputs, load_stock, tiny_wan

# ComfyUI's key -> HunyuanVideo's original (Tencent) key: the inverse of its process_unet_state_dict
HUNYUAN = [("_mod.lin.", "_mod.linear."), ("_attn.qkv.", "_attn_qkv."), ("_attn.proj.", "_attn_proj."),
           ("mlp.0.", "mlp.fc1."), ("mlp.2.", "mlp.fc2."), (".modulation.lin.", ".modulation.linear."),
           ("_attn.norm.query_norm.scale", "_attn_q_norm.weight"), ("_attn.norm.key_norm.scale", "_attn_k_norm.weight"),
           (".norm.query_norm.scale", ".q_norm.weight"), (".norm.key_norm.scale", ".k_norm.weight")]
FLUX = [("query_norm.weight", "query_norm.scale"), ("key_norm.weight", "key_norm.scale")]


def file_names(family: str, sd: dict, model_config) -> dict:
    """`sd` (ComfyUI's block keys) under the family's file names, checked against ComfyUI's
    own rename: its process_unet_state_dict gives ComfyUI's keys back."""
    table = HUNYUAN if family == "hunyuan_video" else FLUX

    def rename(k):
        if not k.startswith(("double_blocks.", "single_blocks.")):
            return k
        for a, b in table:
            k = k.replace(a, b) if k.endswith(a) or a.endswith(".") else k
        return k
    out = {rename(k): v for k, v in sd.items()}
    back = model_config.process_unet_state_dict(dict(out))
    if set(back) != set(sd):   # this ComfyUI does not rename them: the file keeps ComfyUI's names
        return dict(sd)
    return out


def need_pack() -> None:
    """Skip without ComfyUI-GGUF (pack_mark fails in CI instead)."""
    mark = pack_mark()
    if mark:
        pytest.skip(mark.kwargs["reason"])


def pack_or_stock(path: str):
    """The stock loader's MODEL of `path`: ComfyUI-GGUF's Unet Loader (GGUF) for a .gguf."""
    if not path.endswith(".gguf"):
        return load_stock(path)
    folder = os.path.dirname(path)
    folder_paths.add_model_folder_path("diffusion_models", folder)
    try:
        assert folder_paths.get_full_path("diffusion_models", os.path.basename(path)) == path, "a unique name"
        return PACK.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]().load_unet(os.path.basename(path))[0]
    finally:
        folder_paths.folder_names_and_paths["diffusion_models"][0].remove(folder)


def assert_model_loader_equals(path: str, x, homes=("ram", "disk")):
    want = fm.forward(pack_or_stock(path), *x)
    comfy.model_management.unload_all_models()
    for home in homes:
        model = load_swapped_model(path, SwapSettings(1), home=home, disk_workers=2)
        assert model.swap_engine.read_block is not None or home == "ram"
        assert torch.equal(fm.forward(model, *x), want), (path, home)
        comfy.model_management.unload_all_models()


@pytest.mark.parametrize("family", ["hunyuan_video", "flux"])
@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_model_loader_reads_blocks_under_the_files_own_names(tmp_path, family, fmt):
    ff = ffs.BY_NAME[family]
    src = ffs.write(ff, str(tmp_path / "comfy_names.safetensors"))
    if ffs.unsupported(ff, src):
        pytest.skip(ffs.unsupported(ff, src))
    if fmt == "gguf":
        need_pack()
    config = load_stock(src).model.model_config
    renamed = file_names(family, load_file(src), config)
    path = str(tmp_path / f"{family}_file_names.safetensors")
    save_file(renamed, path)
    if fmt == "gguf":
        path = write_wan_gguf(path, str(tmp_path / f"{family}_file_names.gguf"), "Q8_0",
                              arch="hyvid" if family == "hunyuan_video" else "flux")
    assert_model_loader_equals(path, ff.family.inputs(seed=1))


@pytest.mark.parametrize("prefix", ["model.diffusion_model.", "model."])
def test_model_loader_reads_gguf_blocks_under_a_prefix(tmp_path, prefix):
    need_pack()
    sd = load_file(tiny_wan(str(tmp_path), blocks=2))
    path = str(tmp_path / "prefixed.safetensors")
    save_file({prefix + k: v for k, v in sd.items()}, path)
    assert_model_loader_equals(write_wan_gguf(path, str(tmp_path / f"prefixed_{prefix.replace('.', '_')}.gguf"), "Q8_0"), (*inputs(seed=0), {}))


@pytest.mark.parametrize("case", ["bf16_1d", "f16_in_a_bf16_model"])
def test_gguf_float_tensors_the_model_holds_otherwise_are_cast_on_read(tmp_path, monkeypatch, case):
    """A file's BF16 1-D tensors (the pack loads them as F32), and F16 tensors in a model ComfyUI
    makes bf16 (as on a bf16 GPU: the quantized bytes outweigh everything): homes disk and auto
    read and cast them as the pack's load does."""
    need_pack()
    src = tiny_wan(str(tmp_path), blocks=2)
    if case == "bf16_1d":
        path = write_wan_gguf(src, str(tmp_path / "names_bf16_1d.gguf"), "Q8_0", bf16_1d=True)
    else:
        monkeypatch.setattr(args, "bf16_unet", True)
        path = write_wan_gguf(src, str(tmp_path / "names_f16.gguf"), "Q8_0", "F16")
        assert pack_or_stock(path).model.diffusion_model.blocks[0].modulation.dtype == torch.bfloat16
    assert_model_loader_equals(path, (*inputs(seed=0), {}), homes=("disk", "auto"))
