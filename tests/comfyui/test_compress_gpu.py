"""compress on CUDA with nvCOMP (RingSwap Model Loader): coded homes bit-exact at every window and
prefetch, homes ram and auto; an interrupted run and the next one; the RAM a coded home takes;
home=auto's RAM split widened by coding; auto coding on the next prompt of a copy-bound run. (LoRA folded after the decode: test_lora_gpu.py.)"""
import gc

import psutil
import pytest
import torch

import comfy.model_management

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapSettings
from ringswap.swap.plane_coder import coder_missing
import nodes as comfy_nodes
from wan_model import conditioning, forward, inputs, latent, tiny_wan

pytestmark = pytest.mark.gpu

BLOCKS = 8


@pytest.fixture(scope="module", autouse=True)
def nvcomp_here():
    if not torch.cuda.is_available() or coder_missing():
        pytest.skip("needs CUDA and nvCOMP (scripts/prepare_nvcomp_wheels.sh)")


def test_compressed_homes_are_bit_exact_on_cuda(wan512_stock, wan512_file, caplog):
    """compress=on with nvCOMP (RingSwap Model Loader, homes ram and auto): the streamed blocks'
    homes are coded, each landing decoded on the GPU; outputs bit-identical to the stock model at
    every window and prefetch; the plan line gives the ratio and the GB saved."""
    x = [inputs(seed=s, frames=3, size=16) for s in range(2)]
    ref = [forward(wan512_stock, *xi) for xi in x]
    comfy.model_management.unload_all_models()
    for home in ("ram", "auto"):
        for prefetch in (0, 1, 2):
            for window in (1, 3, BLOCKS - prefetch - 1):
                model = load_swapped_model(wan512_file, SwapSettings(window, prefetch, compress="on"), home=home)
                with caplog.at_level("INFO", logger="ringswap"):
                    for _ in range(2):
                        for k, xi in enumerate(x):
                            assert torch.equal(forward(model, *xi), ref[k]), (home, window, prefetch, k)
                engine = model.swap_engine
                assert set(engine.plan.streamed) <= set(engine.pool.coded) and engine.memory == "pinned"
                assert "compress on: " in caplog.text and "blocks coded to 0." in caplog.text
                comfy.model_management.unload_all_models()


def test_compress_widens_home_autos_ram_split_on_the_first_load(wan512_stock, wan512_file, caplog):
    """home=auto with a RAM budget that holds only part of the streamed blocks raw: once the first
    ones are coded, the load gives RAM homes to more of them (counted at their coded size);
    outputs stay bit-identical to the stock model."""
    xi = inputs(seed=3, frames=3, size=16)
    ref = forward(wan512_stock, *xi)
    comfy.model_management.unload_all_models()
    sizing = load_swapped_model(wan512_file, SwapSettings(2, 1, compress="off"), home="auto")
    staging = sizing.swap_engine.read_buffers   # the read-ahead's buffers, counted where blocks stream from the file
    budget = (staging + 2) * sizing.swap_engine.states[0].layout.nbytes / 1e9   # 2 of 7 streamed blocks raw
    del sizing
    raw_only = load_swapped_model(wan512_file, SwapSettings(2, 1, ram_budget_gb=budget, compress="off"), home="auto")
    assert torch.equal(forward(raw_only, *xi), ref)
    raw_split = raw_only.ringswap_run.plan.ram   # nothing coded: the split of the first plan stands
    comfy.model_management.unload_all_models()
    model = load_swapped_model(wan512_file, SwapSettings(2, 1, ram_budget_gb=budget, compress="on"), home="auto")
    assert torch.equal(forward(model, *xi), ref)
    engine = model.swap_engine
    facts = engine.facts()
    homes = facts.homes & set(engine.plan.streamed)   # the streamed blocks holding a RAM home
    assert raw_split.file_blocks and len(homes) > len(raw_split.ram_blocks)
    assert homes <= facts.coded and homes == model.ringswap_run.plan.ram_blocks
    comfy.model_management.unload_all_models()


def test_home_auto_keeps_resident_blocks_coded_and_codes_homes_where_ram_is_short(wan512_stock, wan512_file, caplog):
    """home=auto, compress auto. With RAM for all the blocks raw, a first load keeps its streamed homes
    raw (the rates are not measured yet); unloaded, the model keeps its resident blocks coded from the
    GPU (an expert switch), and the next load places them by decoding without reading the file. With a
    RAM budget one byte short of all the blocks raw, RAM is short: the streamed homes are coded too.
    Exact throughout. compress=off keeps the resident blocks raw."""
    xi = inputs(seed=5, frames=3, size=16)
    ref = forward(wan512_stock, *xi)
    comfy.model_management.unload_all_models()
    total = block_bytes(wan512_file)
    for mode, budget in (("auto", 0.0), ("auto", (total - 1) / 1e9), ("off", 0.0)):
        caplog.clear()
        model = load_swapped_model(wan512_file, SwapSettings(3, 1, ram_budget_gb=budget, compress=mode), home="auto")
        with caplog.at_level("INFO", logger="ringswap"):
            assert torch.equal(forward(model, *xi), ref)
        engine = model.swap_engine
        resident, streamed = engine.plan.resident, engine.plan.streamed
        assert resident and (set(streamed) <= set(engine.pool.coded)) is (budget > 0), (mode, budget)
        assert ("compress auto: RAM is short" in caplog.text) is (budget > 0), caplog.text
        with caplog.at_level("INFO", logger="ringswap"):
            comfy.model_management.unload_all_models()
        if mode == "off":   # raw: a RAM home where the file's pages cannot hold the block (else mapped again)
            assert not set(engine.pool.coded) & set(resident)
            assert all(i in engine.pool.blocks or engine.map_block(i) is not None for i in resident)
        else:
            assert set(resident) <= set(engine.pool.coded), caplog.text
            assert torch.equal(forward(model, *xi), ref)
            assert engine.read_back == (0, 0.0) and not set(engine.pool.coded) & set(resident)
            comfy.model_management.unload_all_models()
        del model, engine
        gc.collect()


def test_auto_codes_the_homes_on_the_next_prompt_once_the_last_run_was_copy_bound(wan512_stock, wan512_file, caplog):
    """compress=auto, home=ram: the first prompt runs raw (nothing measured yet); when its measured
    rates make the next prompt's plan copy-bound (a slow link, set here), that prompt places the blocks
    again with the streamed homes coded instead of keeping them raw; the prompt after keeps them.
    Exact throughout."""
    def ksample(model):
        (out,) = comfy_nodes.KSampler().sample(model, 7, 2, 1.0, "euler", "simple", conditioning(1),
                                               conditioning(2), latent(frames=3, size=16))
        return out["samples"].clone()
    ref = ksample(wan512_stock)
    comfy.model_management.unload_all_models()
    model = load_swapped_model(wan512_file, SwapSettings(3, 1, compress="auto"), home="ram")
    assert torch.equal(ksample(model), ref)
    engine = model.swap_engine
    att = engine.att   # the attachment: the same object while the blocks stay placed
    assert not engine.pool.coded and not engine.facts().attached_coded
    engine.link_bytes_per_s = 1e8   # ~80 ms a block's copy against a few ms of compute: copy-bound
    with caplog.at_level("INFO", logger="ringswap"):
        assert torch.equal(ksample(model), ref)
    assert engine.att is not att and engine.facts().attached_coded, caplog.text
    assert set(engine.plan.streamed) <= set(engine.pool.coded)
    assert "placing the blocks again to code their homes" in caplog.text and "blocks coded to 0." in caplog.text
    att = engine.att
    engine.link_bytes_per_s = 1e8
    assert torch.equal(ksample(model), ref)
    assert engine.att is att
    comfy.model_management.unload_all_models()


def block_bytes(path: str) -> int:
    """The bytes of all blocks of `path` as a home=auto load holds them."""
    model = load_swapped_model(path, SwapSettings(2, 1, compress="off"), home="auto")
    nbytes = model.swap_engine.total_block_bytes()
    del model
    gc.collect()
    return nbytes


def test_an_interrupted_run_then_the_next_is_exact(wan512_stock, wan512_file):
    """ComfyUI's interrupt raised inside a streamed block while coded blocks are in flight: the
    next run (and the one after) gives the stock output."""
    xi = inputs(seed=4, frames=3, size=16)
    ref = forward(wan512_stock, *xi)
    comfy.model_management.unload_all_models()
    model = load_swapped_model(wan512_file, SwapSettings(2, 2, compress="on"), home="ram")
    assert torch.equal(forward(model, *xi), ref)
    engine = model.swap_engine
    victim = engine.plan.streamed[len(engine.plan.streamed) // 2]

    def interrupt(module, args):
        raise comfy.model_management.InterruptProcessingException()
    hook = model.model.diffusion_model.blocks[victim].register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(comfy.model_management.InterruptProcessingException):
            forward(model, *xi)
    finally:
        hook.remove()
    for _ in range(2):
        assert torch.equal(forward(model, *xi), ref)
    assert engine.pool.coded
    comfy.model_management.unload_all_models()


def _rss_not_file(proc: psutil.Process) -> int:
    """Resident bytes not backed by files: homes live in anonymous shared mappings (RssAnon +
    RssShmem on Linux); a library's code, e.g. nvCOMP's on its first use, is file-backed
    (RssFile). Elsewhere the whole RSS."""
    try:
        with open("/proc/self/status") as f:
            return sum(int(line.split()[1]) * 1024 for line in f if line.startswith(("RssAnon:", "RssShmem:")))
    except OSError:
        return proc.memory_info().rss


def test_a_coded_home_takes_at_most_072_of_the_raw_ones_ram(tmp_path):
    """home=auto (only streamed blocks keep a home): with compress=on the homes are coded to at most
    0.72 x the blocks' bytes, and the process's RSS not backed by files grows from before the load to
    after a run by those coded bytes and little more (no raw copy left behind). With off it hardly
    grows: the raw homes are the file's own pages. A first unmeasured round of each pays CUDA's,
    nvCOMP's and the allocators' start-up. 15 streamed blocks of ~34 MB dwarf the noise."""
    path = tiny_wan(str(tmp_path), blocks=16, dim=1024, ffn_dim=4096, dtype=torch.bfloat16)
    xi = inputs(seed=1, frames=3, size=16)
    proc, grew = psutil.Process(), {}
    for k, mode in enumerate(("off", "on", "off", "on")):
        comfy.model_management.unload_all_models()
        comfy.model_management.soft_empty_cache()
        gc.collect()
        before = _rss_not_file(proc)
        model = load_swapped_model(path, SwapSettings(1, 1, compress=mode), home="auto")
        forward(model, *xi)
        pool, states = model.swap_engine.pool, model.swap_engine.states
        grew[mode, k > 1] = (_rss_not_file(proc) - before, sum(c.coded_bytes for c in pool.coded.values()),
                             sum(states[i].layout.nbytes for i in pool.coded))
        assert bool(pool.coded) == (mode == "on")
        del model, pool, states
    comfy.model_management.unload_all_models()
    (off, _, _), (on, coded, raw) = grew["off", True], grew["on", True]
    assert raw > 15 * 25e6 and coded <= 0.72 * raw, grew
    assert on <= coded + (64 << 20) and off < 64 << 20, grew
