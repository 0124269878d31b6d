"""RingSwap Patch is bit-exact on ComfyUI's big DiT families, not only Wan.

ComfyUI's stock detection hard-codes the real sizes of most DiT families, so each is a tiny
instance of ComfyUI's own classes built in-process (support/family_models.py: its model
config, BaseModel subclass and diffusion model, in a plain ModelPatcher): Qwen-Image,
Chroma, HiDream, Lumina 2 / Z-Image, Flux, HunyuanVideo, LTX-Video and Wan VACE. For each,
windows 1, 2 and all blocks at prefetch 0-2 give the plain patcher's outputs bit for bit
on two consecutive calls, the engine swaps the family's block lists (loaders/comfyui_adapter/block_lists.py)
and at window 1 every block of every list streams. Wan VACE calls its vace_blocks
interleaved with the main blocks, once per context: they stream, are not counted as
non-block bytes, and the engine learns that order (a stock KSampler's second run has no
out-of-order fetches). A family this ComfyUI lacks is skipped, naming what is missing.
"""
import logging

import pytest
import torch

import comfy.model_management
import nodes as comfy_nodes

from ringswap.loaders.comfyui_adapter import block_lists
from ringswap.nodes.patch import RingSwapPatch
from support import family_models as fm
from support.family_models import FAMILIES, VACE_BLOCKS, VACE_MAIN, VACE_STRENGTH, forward

SEEDS = (1, 2)   # two consecutive calls, on different inputs


@pytest.fixture(scope="module", autouse=True)
def _fast_and_quiet(fast_and_quiet):
    yield


class Built(tuple):
    """(family, plain ModelPatcher, its outputs for SEEDS); a short repr in failure reports."""

    def __repr__(self):
        return f"<{self[0].name} reference>"


def _built(family):
    reason = family.missing()
    if reason:
        pytest.skip(f"{family.name}: {reason}")
    plain = fm.build(family)
    refs = [forward(plain, *family.inputs(s)) for s in SEEDS]
    comfy.model_management.unload_all_models()
    return Built((family, plain, refs))


@pytest.fixture(scope="module", params=FAMILIES, ids=[f.name for f in FAMILIES])
def built(request):
    return _built(request.param)


@pytest.fixture(scope="module")
def vace():
    return _built(fm.BY_NAME["wan_vace"])


def patched(model, window, prefetch):
    (m,) = RingSwapPatch().patch(model, window, prefetch, "auto")
    return m


def counted_call(model, x, sigma, ctx, extra):
    """forward() on a RingSwap MODEL: (output, streamed-block forwards its hooks saw in that call)."""
    comfy.model_management.load_models_gpu([model])
    engine = model.swap_engine
    assert engine.attached, "loading must attach the engine"
    before = engine.stats.forwards
    with torch.no_grad():
        out = model.model.apply_model(x, sigma, c_crossattn=ctx, **extra).clone()
    assert engine.attached, "the engine must stay attached while the model is loaded"
    return out, engine.stats.forwards - before


def num_blocks(family, plain):
    dm = plain.model.diffusion_model
    return sum(len(getattr(dm, n)) for n in family.lists)


@pytest.mark.parametrize("window", ["1", "2", "all"])
def test_bit_exact_every_window_and_prefetch(built, window):
    family, plain, refs = built
    n = num_blocks(family, plain)
    assert n >= 4, f"{family.name}: too few blocks for windows to matter"
    w = n if window == "all" else int(window)
    for prefetch in (0, 1, 2):
        model = patched(plain, w, prefetch)
        engine = model.swap_engine
        outs, forwards = zip(*(counted_call(model, *family.inputs(s)) for s in SEEDS))
        plan = engine.plan
        comfy.model_management.unload_all_models()
        assert not engine.attached, "unloading must detach the engine"
        for k, (a, b) in enumerate(zip(outs, refs)):
            assert torch.isfinite(b).all()
            assert torch.equal(a, b), (f"{family.name}: call {k} differs at window={w} prefetch={prefetch} "
                                       f"(max abs diff {(a - b).abs().max().item():.3g})")
        assert plan.num_blocks == n
        if w == 1:
            assert tuple(plan.streamed) == tuple(range(n)), f"{family.name}: at window 1 every block streams"
            assert forwards == (family.block_calls or n,) * len(SEEDS), "every block call runs through the ring"
        if w + prefetch >= n:   # the whole model fits: all resident
            assert tuple(plan.streamed) == () and len(plan.resident) == n
        else:                   # window - 1 resident, the rest streams
            assert len(plan.streamed) == n - w + 1 and len(plan.resident) == w - 1


def test_block_lists_are_the_family_lists(built):
    family, plain, _ = built
    dm = plain.model.diffusion_model
    assert type(dm).__name__ == family.dm_class
    assert block_lists.list_names(dm) == family.lists
    model = patched(plain, 2, 1)
    state = model.swap_state
    assert state.list_names == list(family.lists)
    blocks = [b for n in family.lists for b in getattr(dm, n)]
    assert len(blocks) == state.engine.num_blocks
    assert all(s.block is b for s, b in zip(state.engine.states, blocks))
    listed = sum(fm.block_bytes(getattr(dm, n)) for n in family.lists)
    assert state.nonblock_bytes == fm.block_bytes(dm) - listed


@pytest.mark.parametrize("name", ["lumina2", "z_image"])
def test_nextdit_refiners_stay_resident(name):
    """NextDiT's noise_refiner / context_refiner are not block lists: non-block bytes."""
    family, plain, refs = _built(fm.BY_NAME[name])
    dm = plain.model.diffusion_model
    model = patched(plain, 1, 1)
    refiners = fm.block_bytes(dm.noise_refiner) + fm.block_bytes(dm.context_refiner)
    assert refiners > 0
    assert model.swap_state.nonblock_bytes == fm.block_bytes(dm) - fm.block_bytes(dm.layers)
    refiner_ids = {id(m) for m in list(dm.noise_refiner) + list(dm.context_refiner)}
    assert not any(id(s.block) in refiner_ids for s in model.swap_engine.states)
    assert torch.equal(forward(model, *family.inputs(SEEDS[0])), refs[0])


# ----- Wan VACE ----------------------------------------------------------------------------
def test_vace_blocks_stream_and_stay_exact_with_two_contexts(vace):
    family, plain, refs = vace
    assert family.inputs(1)[3]["vace_context"].shape[1] == len(VACE_STRENGTH) == 2
    dm = plain.model.diffusion_model
    assert len(dm.blocks) == VACE_MAIN and len(dm.vace_blocks) == VACE_BLOCKS
    for prefetch in (0, 1, 2):
        model = patched(plain, 1, prefetch)
        outs = [forward(model, *family.inputs(s)) for s in SEEDS]
        streamed = set(model.swap_engine.plan.streamed)
        comfy.model_management.unload_all_models()
        assert set(range(VACE_MAIN, VACE_MAIN + VACE_BLOCKS)) <= streamed
        assert not model.swap_engine.in_order   # vace blocks run between main blocks: no arrival reused
        assert all(torch.equal(a, b) for a, b in zip(outs, refs)), f"prefetch {prefetch}"


def test_vace_nonblock_bytes_exclude_vace_blocks(vace):
    _, plain, _ = vace
    dm = plain.model.diffusion_model
    state = patched(plain, 2, 1).swap_state
    main, side = fm.block_bytes(dm.blocks), fm.block_bytes(dm.vace_blocks)
    assert side > 0
    assert state.nonblock_bytes == fm.block_bytes(dm) - main - side
    assert state.engine.num_blocks == VACE_MAIN + VACE_BLOCKS


def _vace_conditioning(seed):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, 8, 64, generator=g)
    frames = [torch.randn(1, 32, 2, 8, 8, generator=g) for _ in VACE_STRENGTH]
    masks = [torch.ones(1, 64, 2, 8, 8) for _ in VACE_STRENGTH]
    return [[ctx, {"vace_frames": frames, "vace_mask": masks, "vace_strength": list(VACE_STRENGTH)}]]


def ksample(model, seed, steps=3):
    latent = {"samples": torch.zeros(1, 16, 2, 8, 8)}
    (out,) = comfy_nodes.KSampler().sample(model, seed, steps, 1.0, "euler", "simple",
                                          _vace_conditioning(1), _vace_conditioning(2), latent)
    return out["samples"].clone()


def test_vace_sampling_learns_the_interleaved_order(vace, caplog):
    """The first model call fetches the vace blocks out of order and records the order; the
    second sampling run follows it (no out-of-order fetches) and both equal the stock runs."""
    _, plain, _ = vace
    stock = [ksample(plain, seed) for seed in (11, 12)]
    comfy.model_management.unload_all_models()
    v0, v1 = VACE_MAIN, VACE_MAIN + 1
    expected = (0, v0, v0, 1, 2, v1, v1, 3)   # vace block k after main block 2k, once per context
    for prefetch in (0, 1, 2):
        model = patched(plain, 1, prefetch)
        engine = model.swap_engine
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ringswap"):
            runs = [ksample(model, seed) for seed in (11, 12)]
        comfy.model_management.unload_all_models()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("RingSwap run:")]
        assert len(lines) == 2, lines
        if prefetch == 0:   # the first run of this model learns the order...
            assert "out-of-order fetches" in lines[0], lines[0]
        else:               # ...which later plans with the same streamed blocks reuse
            assert "out-of-order" not in lines[0], lines[0]
        assert "out-of-order" not in lines[1], lines[1]
        assert list(engine.orders.values()) == [expected]
        for k, (a, b) in enumerate(zip(runs, stock)):
            assert torch.equal(a, b), f"sampling run {k} differs at window 1 prefetch {prefetch}"
