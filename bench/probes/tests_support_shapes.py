"""Meta-tensor state dicts of ComfyUI's WanModel at any size (for benchmarks)."""
import torch


def wan_meta_state_dict(layers: int, dim: int, ffn: int) -> dict:
    import comfy.ops
    from comfy.ldm.wan.model import WanModel
    with torch.device("meta"):
        m = WanModel(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=dim, ffn_dim=ffn, freq_dim=256,
                     text_dim=4096, out_dim=16, num_heads=dim // 128, num_layers=layers,
                     operations=comfy.ops.disable_weight_init)
    return dict(m.state_dict())
