"""Test set-up: a real ComfyUI runtime (0.3.75 or 0.33), in-process (nothing mocked).

ComfyUI's folder (RINGSWAP_COMFYUI_DIR, default .comfyui/) goes on sys.path; on a
machine without CUDA it is told so before `comfy.model_management` is imported, as its
own `--cpu` flag would. The pack is imported under its ComfyUI module name `ringswap`
through the custom_nodes folder, as ComfyUI itself imports it.
RINGSWAP_DYNAMIC_VRAM=1 (ComfyUI 0.33+) starts dynamic VRAM as its main.py does on
NVIDIA: comfy-aimdo initialised, `aimdo_enabled` (lazy ops, mmapped file tensors) and
`ModelPatcherDynamic` as the core patcher. On a CPU ComfyUI then still gives models a
static patcher (ModelPatcherDynamic reroutes CPU devices) over its lazily built layers.
"""
import gc
import os
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMFY = os.environ.get("RINGSWAP_COMFYUI_DIR") or os.path.join(REPO, ".comfyui")
if not os.path.isfile(os.path.join(COMFY, "main.py")):
    raise RuntimeError(f"no ComfyUI at {COMFY}: run `make env` (or set RINGSWAP_COMFYUI_DIR)")
sys.path.insert(0, COMFY)
sys.path.insert(0, os.path.join(COMFY, "custom_nodes"))
link = os.path.join(COMFY, "custom_nodes", "ringswap")
if not os.path.exists(link):
    os.symlink(REPO, link)

from comfy.cli_args import args  # noqa: E402

if not torch.cuda.is_available():
    args.cpu = True
CUDA = torch.cuda.is_available()
DYNAMIC_VRAM = os.environ.get("RINGSWAP_DYNAMIC_VRAM") == "1"
if DYNAMIC_VRAM:
    from support import dynamic_vram
    dynamic_vram.init_library()

import comfy.model_management  # noqa: E402,F401
import comfy.sd  # noqa: E402,F401

if DYNAMIC_VRAM:
    dynamic_vram.enable()

# Servers run in the same mode as the in-process tests: ComfyUI 0.33 turns dynamic VRAM on
# by itself on NVIDIA, so without RINGSWAP_DYNAMIC_VRAM=1 a CUDA server is told not to.
SERVER_ARGS = ("--disable-dynamic-vram",) if CUDA and not DYNAMIC_VRAM and hasattr(args, "disable_dynamic_vram") else ()


def pytest_report_header(config):
    import comfyui_version
    return (f"ComfyUI {comfyui_version.__version__} at {COMFY}"
            + (", dynamic VRAM started as by its main.py" if DYNAMIC_VRAM else ""))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _unload_models():
    """Each test starts with no model loaded, as after ComfyUI's 'Unload models'."""
    yield
    gc.collect()   # models dropped by the test go first (ComfyUI's finalizers edit the list)
    comfy.model_management.unload_all_models()
    comfy.model_management.soft_empty_cache()


@pytest.fixture(scope="module")
def fast_and_quiet():
    """For modules with many gc.collect() calls and tiny matmuls: freeze what is alive so far
    (torch, ComfyUI, ...) out of the cyclic collector, whose full passes otherwise dominate,
    and use one thread (2 OpenMP threads thrash on a busy 2-core machine)."""
    gc.collect()
    gc.freeze()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    gc.unfreeze()


@pytest.fixture(scope="module")
def wan512_file(tmp_path_factory) -> str:
    """A bf16 Wan of 8 blocks at dim 512 (~8 MB a block): large enough for the GPU tests' copies
    and for compress to pay."""
    from wan_model import tiny_wan
    return tiny_wan(str(tmp_path_factory.mktemp("wan")), blocks=8, dim=512, ffn_dim=2048, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def wan512_stock(wan512_file):
    """wan512_file through the stock Load Diffusion Model path."""
    from wan_model import load_stock
    return load_stock(wan512_file)


@pytest.fixture(scope="session")
def shared_models(tmp_path_factory) -> str:
    """The models folder of the shared server: each module writes its own files into it."""
    return str(tmp_path_factory.mktemp("shared_models"))


@pytest.fixture(scope="session")
def shared_server(shared_models):
    """One ComfyUI server for the HTTP tests that need no server of their own (a start costs
    ~6 s on a CPU); ComfyUI lists files written into its folders after it started."""
    from support.comfy_server import ComfyServer
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with ComfyServer(COMFY, shared_models, cpu=not CUDA, extra_args=SERVER_ARGS, env=env) as srv:
        yield srv
