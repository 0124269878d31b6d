"""home=auto in-process: the streamed blocks get RAM homes as far as the RAM budget allows, the
rest stream from the file, resident blocks hold no RAM; outputs equal the stock loader's."""
import gc
import logging
import threading

import pytest
import torch

import comfy.model_management

from ringswap.loaders.comfyui_adapter.load_swapped import load_swapped_model
from ringswap.loaders.comfyui_adapter.swap_patcher import SwapModelPatcher, SwapSettings
from ringswap.swap import driver_turns
from wan_model import forward, inputs, load_stock, tiny_wan

BLOCKS = 8


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def wan(tmp_path_factory, request):
    """Homes in the file's own pages (swap/file_pages.py): an fp32 file's blocks as they are, a bf16
    file's cast as they land (on the CPU ComfyUI computes in fp32)."""
    path = tiny_wan(str(tmp_path_factory.mktemp("auto")), blocks=BLOCKS, dtype=request.param)
    want = forward(load_stock(path), *inputs(seed=0))
    comfy.model_management.unload_all_models()
    return path, want


def homes(engine) -> set[int]:
    """Blocks with a RAM home: read into one, or the file's own pages."""
    return set(engine.pool.blocks) | set(engine.pool.mapped)


def maps(engine) -> bool:
    return engine.map_block is not None and engine.map_block(0) is not None


def test_budget_splits_streamed_blocks_between_ram_and_file(wan, caplog):
    path, want = wan
    base = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    engine = base.swap_engine
    assert not engine.pool.nbytes, "home=auto reads nothing at load"
    block = engine.states[0].layout.nbytes
    budget = (2 + 2) * block / 1e9 + 1e-6   # two staging buffers + two homes
    model = SwapModelPatcher.wrap(base, SwapSettings(3, 1, ram_budget_gb=budget, compress="off"))
    with caplog.at_level(logging.INFO, logger="ringswap"):
        got = forward(model, *inputs(seed=0))
    assert torch.equal(got, want)
    plan = engine.plan
    assert len(plan.resident) == 2 and len(plan.streamed) == BLOCKS - 2
    assert homes(engine) <= set(plan.streamed) and len(homes(engine)) == 2
    assert engine.pool.nbytes == 2 * block
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap plan:"))
    assert "home auto: 2 blocks" in line and "2 (" in line and f"{BLOCKS - 4} (" in line, line
    assert "read from the file each step" in line and f"ram_budget_gb {budget:g}" in line, line
    stats = engine.end_run()
    assert stats is None or stats.memory in ("staged", "pinned")   # the RAM homes' copies (CPU / CUDA)
    comfy.model_management.unload_all_models()


def test_automatic_room_holds_every_streamed_block_and_plan_changes_read_back(wan, caplog):
    """Plenty of RAM: every streamed block gets a home, and a model taken off the device keeps
    its resident blocks in RAM, so a plan that streams them reads nothing; with no room left
    beside its homes (a RAM budget) they go back to the file and the next plan reads them back."""
    path, want = wan
    base = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    engine = base.swap_engine
    block = engine.states[0].layout.nbytes
    assert torch.equal(forward(base, *inputs(seed=0)), want)
    assert homes(engine) == set(engine.plan.streamed), "plenty of RAM: every streamed block in RAM"
    resident = set(engine.plan.resident)
    comfy.model_management.unload_all_models()
    if maps(engine):   # the file's pages hold them: nothing to keep
        assert homes(engine) == set(range(BLOCKS)) - resident and not engine.pool.blocks
    else:
        assert homes(engine) == set(range(BLOCKS)), "taken off the device: resident blocks kept in RAM"
    smaller = SwapModelPatcher.wrap(base, SwapSettings(1, 1, compress="off"))   # resident blocks now stream, from RAM
    assert torch.equal(forward(smaller, *inputs(seed=0)), want)
    assert engine.read_back[0] == 0
    comfy.model_management.unload_all_models()
    budget = (BLOCKS - len(resident)) * block / 1e9 + 1e-6   # the streamed homes, nothing beside them
    tight = SwapModelPatcher.wrap(base, SwapSettings(3, 1, ram_budget_gb=budget, compress="off"))
    assert torch.equal(forward(tight, *inputs(seed=0)), want)
    comfy.model_management.unload_all_models()
    assert homes(engine) == set(range(BLOCKS)) - resident, "no room: resident blocks back to the file"
    with caplog.at_level(logging.INFO, logger="ringswap"):
        assert torch.equal(forward(smaller, *inputs(seed=0)), want)
    assert engine.read_back[0] == (0 if maps(engine) else len(resident) * block)   # mapped: nothing read
    assert homes(engine) == set(range(BLOCKS))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap plan:"))
    # read as the first call reaches them (swap/first_use.py), said in the plan line
    assert f"the first call computes as its blocks arrive: {len(resident) * block / 1e9:.2f} GB from the file" in line, line
    comfy.model_management.unload_all_models()
    everything = SwapModelPatcher.wrap(base, SwapSettings(BLOCKS, 1, compress="off"))   # all resident: no RAM homes
    assert torch.equal(forward(everything, *inputs(seed=0)), want)
    assert not homes(engine)
    comfy.model_management.unload_all_models()


def test_bad_ram_budget_is_refused():
    with pytest.raises(ValueError, match="ram_budget_gb must be 0"):
        SwapSettings(3, 1, ram_budget_gb=-1.0)


def test_automatic_room_is_available_ram_less_margin_and_comfys_keep(wan):
    """The RAM numbers a load gathers from ComfyUI (RAM available, what its RAM cache keeps) reach
    the plan's RAM split: room = available + homes held - margin - ComfyUI's keep (the arithmetic:
    tests/engine/test_load_plan.py)."""
    from ringswap.loaders.comfyui_adapter import comfy_memory, run_facts
    from ringswap.swap.ram_split import MARGIN_MIN, home_ram
    path, _ = wan
    model = load_swapped_model(path, SwapSettings(3, 1), home="auto")
    engine, device = model.swap_engine, model.load_device
    before = comfy_memory.ram_available()
    facts = run_facts.gather(model, device)
    plan = model._plan(device, False)
    available, kept = max(before, comfy_memory.ram_available()), comfy_memory.ram_kept_by_comfy()
    assert facts.ram_kept_by_comfy == kept and 0 < facts.ram_available <= available
    nbytes, why = home_ram(0.0, facts.ram_available, engine.facts().homes_held, facts.ram_kept_by_comfy)
    assert 0 <= nbytes <= max(0, available - MARGIN_MIN - kept)
    assert "GB available" in why and "margin" in why and (("ComfyUI keeps" in why) == bool(kept)), why
    assert 0 <= plan.ram.ram_bytes <= max(0, available - MARGIN_MIN - kept)
    assert "GB available" in plan.ram.ram_why and plan.ram.ram_why in plan.line(), plan.line()
    budgeted = SwapModelPatcher.wrap(model, SwapSettings(3, 1, ram_budget_gb=1.5))._plan(device, False)
    assert (budgeted.ram.ram_bytes, budgeted.ram.ram_why) == (1_500_000_000, "ram_budget_gb 1.5")
    import comfy.cli_args
    if isinstance(comfy.cli_args.args.cache_ram, list) and not comfy.cli_args.args.cache_classic:
        assert kept >= 2 * 2**30, "0.33's RAM cache keeps at least 2 GB headroom by default"


def test_ram_is_short_where_the_room_cannot_hold_every_block_raw(wan):
    """compress=auto codes a home=auto model's homes where its room cannot hold all its blocks raw
    (its homes and its kept resident blocks); a room of exactly that is enough; other homes never.
    The engine's own facts and ComfyUI's numbers, planned as on a CUDA device with a coder (the
    rule itself: tests/engine/test_load_plan.py)."""
    from dataclasses import replace

    from ringswap.loaders.comfyui_adapter import run_facts
    from ringswap.swap.load_plan import plan_load
    path, _ = wan

    def short(home: str, budget_gb: float) -> bool:
        model = load_swapped_model(path, SwapSettings(3, 1), home=home)
        facts = replace(run_facts.gather(model, model.load_device), device="cuda:0", coder_missing=None)
        plan = plan_load(model.swap_engine.facts(), facts, SwapSettings(3, 1, ram_budget_gb=budget_gb))
        assert plan.ram is None or not plan.ram.file_blocks, "every streamed block fits: only the whole is short"
        return plan.coding.code and "RAM is short" in plan.coding.why
    total = load_swapped_model(path, SwapSettings(3, 1), home="auto").swap_engine.total_block_bytes()
    assert short("auto", (total - 1) / 1e9) and not short("auto", (total + 1) / 1e9)
    assert not short("ram", (total - 1) / 1e9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocks_cast_to_another_size_on_a_gpu_map_only_where_those_casts_are_small(wan, monkeypatch):
    """On a GPU a mapped home's tensors cast to another size cross into device buffers outside the
    plan (block_reads.RESIZED_MAX): over the limit the blocks keep RAM homes read from the file and
    cast there; exact either way."""
    from ringswap.loaders.model_file import block_reads
    path, want = wan
    for limit, mapped in ((block_reads.RESIZED_MAX, True), (0, False)):
        monkeypatch.setattr(block_reads, "RESIZED_MAX", limit)
        model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
        engine = model.swap_engine
        resized = any(i.dtype.itemsize != e.dtype.itemsize for c in engine.read_block.__self__.cast for i, e in c)
        assert torch.equal(forward(model, *inputs(seed=0)), want)
        reads = engine.read_block.__self__
        pages = reads._pages._pinnable if reads._pages is not None else "not asked"
        assert bool(engine.pool.mapped) == (mapped or not resized), (limit, pages, engine.plan.describe(),
                                                                    sorted(engine.pool.blocks))
        comfy.model_management.unload_all_models()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_first_call_holds_page_locking_off_until_its_end(wan):
    """On a GPU a load's first call, its homes page-locked as it runs, holds page-locking off except
    while it waits for a home (driver_turns.Hold): held when its first block computes, not in the
    next call, none left once the model is off the device; outputs equal the stock loader's."""
    path, want = wan
    model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    engine = model.swap_engine
    if not maps(engine):
        pytest.skip("this file's blocks keep RAM homes on this GPU")
    held = []
    hook = engine.states[0].block.register_forward_pre_hook(
        lambda m, a: held.append(threading.current_thread() in driver_turns._holds))
    try:
        for _ in range(2):
            assert torch.equal(forward(model, *inputs(seed=0)), want)
    finally:
        hook.remove()
    assert held[0] and not any(held[1:]), held
    comfy.model_management.unload_all_models()
    assert not driver_turns._holds and not engine.pool.pinned_bytes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_file_pages_are_page_locked_from_the_node_on(wan):
    """On a GPU a home=auto load page-locks every block's file pages from the node on (engine.pin_ahead,
    in call order, before any sampling); the first attach takes the pins over and its first call still
    streams (it holds page-locking off: a Hold when block 0 computes), the streamed blocks' homes stay
    locked, the resident blocks' pages are given back at the settle; outputs equal the stock loader's,
    and a model taken off the device holds no pinned memory."""
    path, want = wan
    model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    engine = model.swap_engine
    if not maps(engine):
        pytest.skip("this file's blocks keep RAM homes on this GPU")
    assert engine.ahead is not None and set(engine.ahead.pins) == set(engine.pool.mapped) == set(range(BLOCKS))
    held = []
    hook = engine.states[0].block.register_forward_pre_hook(
        lambda m, a: held.append(threading.current_thread() in driver_turns._holds))
    try:
        assert torch.equal(forward(model, *inputs(seed=0)), want)
    finally:
        hook.remove()
    assert held and held[0], held
    plan = engine.plan
    assert engine.ahead is None
    assert all(engine.pool.buffer(i).pinned for i in plan.streamed)
    assert not set(plan.resident) & set(engine.pool.mapped)
    comfy.model_management.unload_all_models()
    assert not engine.pool.pinned_bytes
    assert torch.equal(forward(model, *inputs(seed=0)), want)
    comfy.model_management.unload_all_models()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_dropped_while_its_pages_are_page_locked_leaves_the_next_exact(wan):
    """A model dropped right after its node (its pins still running on their threads) lets go of
    its mapping only once they end: no crash, nothing left page-locked, and the next load is exact."""
    path, want = wan
    for _ in range(3):
        model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
        del model
        gc.collect()
    model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    assert torch.equal(forward(model, *inputs(seed=0)), want)
    comfy.model_management.unload_all_models()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_blocks_pages_page_lock_from_the_header_on_and_the_homes_take_them_over(wan):
    """On a GPU the load starts page-locking every block's file pages as soon as it has read the
    header (FilePages.lock_ahead), while it builds the model; each home in those pages takes its
    block's registration over instead of registering again, so after the first call nothing is
    left to the loader's own registrations; outputs equal the stock loader's; a model taken off
    the device holds no pinned memory."""
    path, want = wan
    model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    engine = model.swap_engine
    if not maps(engine):
        pytest.skip("this file's blocks keep RAM homes on this GPU")
    pages = engine.read_block.__self__._pages
    assert pages is not None and pages._ahead, "nothing page-locking ahead"
    assert torch.equal(forward(model, *inputs(seed=0)), want)
    assert not pages._ahead   # every range taken over by its home
    assert all(engine.pool.buffer(i).pinned for i in engine.plan.streamed)
    comfy.model_management.unload_all_models()
    assert not engine.pool.pinned_bytes
    assert torch.equal(forward(model, *inputs(seed=0)), want)
    comfy.model_management.unload_all_models()


def test_the_block_ranges_read_from_the_header_are_the_homes_ranges(wan):
    """The byte ranges the load page-locks from the header on (load_swapped.block_ranges, before the
    model exists) are exactly those of the homes the engine later maps in the file's pages, block by
    block, so each home can take its registration over (FilePages.take needs the same pages)."""
    from ringswap.loaders.comfyui_adapter.load_swapped import block_ranges
    from ringswap.loaders.model_file.safetensors_index import SafetensorsIndex
    path, _ = wan
    model = load_swapped_model(path, SwapSettings(3, 1, compress="off"), home="auto", disk_workers=2)
    engine = model.swap_engine
    homes = [engine.map_block(i) for i in range(engine.num_blocks)]
    if any(h is None for h in homes):
        pytest.skip("this file's blocks keep RAM homes here")
    assert block_ranges(SafetensorsIndex.open(path)) == [(h.start, h.end) for h in homes]
