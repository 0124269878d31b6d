"""home=disk read-ahead: blocks that hold tensors to cast (e.g. bf16 biases in an fp8 file)
are read ahead in parallel, like blocks read straight into their buffers."""
import threading
import time

import torch

from ringswap.loaders.model_file.block_reads import BlockReads
from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from support.quant_files import write_quant_wan
from wan_model import forward, inputs


def test_blocks_with_casts_are_read_ahead_in_parallel(tmp_path, monkeypatch):
    path = str(tmp_path / "scaled_fp8.safetensors")
    write_quant_wan(path, "scaled_fp8", dim=128, num_layers=6, ffn_dim=256)
    lock, active, peak = threading.Lock(), [0], [0]
    original = BlockReads._read_with_casts

    def slow_disk(self, block, dest):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)
            return original(self, block, dest)
        finally:
            with lock:
                active[0] -= 1

    monkeypatch.setattr(BlockReads, "_read_with_casts", slow_disk)
    model = load_swapped_model(path, SwapSettings(1, 1), home="disk", disk_workers=3)
    source = model.swap_engine.read_block.__self__
    assert all(source.cast), "the file should have tensors to cast in every block"
    want = forward(load_swapped_model(path, SwapSettings(1, 1), home="ram"), *inputs(seed=0))
    got = forward(model, *inputs(seed=0))
    assert torch.equal(got, want)
    assert peak[0] >= 2, f"at most {peak[0]} block read(s) with casts in flight: read-ahead is serialised"
