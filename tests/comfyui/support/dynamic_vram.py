"""Start ComfyUI 0.33's dynamic VRAM in-process, as its main.py does on NVIDIA GPUs.

main.py (`enables_dynamic_vram`): comfy-aimdo initialised (`control.init`, then
`control.init_devices` for each torch device), `ModelPatcherDynamic` as the core patcher
and `comfy.memory_management.aimdo_enabled` (lazy ops, mmapped file tensors). On a CPU
there is no device to initialise: ComfyUI then still builds lazily but gives models a
static patcher (ModelPatcherDynamic reroutes CPU devices). `init_library` before importing
ComfyUI's modules (comfy.cli_args aside), `enable` after.
"""
import torch


def init_library() -> None:
    """comfy-aimdo's library, loaded before any ComfyUI module imports aimdo's modules
    (they bind the library when imported), as main.py does first thing."""
    import comfy_aimdo.control
    if not comfy_aimdo.control.init():
        raise RuntimeError("dynamic VRAM: comfy_aimdo.control.init() failed")


def enable() -> None:
    """The devices, the dynamic patcher and the lazy ops (main.py, after its imports)."""
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    import comfy_aimdo.control
    if torch.cuda.is_available() and not comfy_aimdo.control.init_devices(
            (d.index, 0) for d in comfy.model_management.get_all_torch_devices()):
        raise RuntimeError("dynamic VRAM: comfy_aimdo.control.init_devices() failed on CUDA")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
