"""Flux-, Qwen-Image- and Wan-VACE-14B-shaped models in bf16: RingSwap Patch at windows 1 and 2,
prefetch 1 and 2, gives the all-resident output bit for bit on two calls, streams what the plan
says through the ring, and unloading it returns the GPU's allocated memory to where it was.

Built in-process from ComfyUI's own classes (support/family_shapes.py). "shaped" is the real
width with a few blocks per list, on CUDA (marker gpu); "tiny" is the same structure at small
widths through the same code, wherever the tests run (the CPU in CI, CUDA on a GPU machine).
"""
import gc

import pytest
import torch

import comfy.model_management

from ringswap.nodes.patch import RingSwapPatch
from support import family_models as fm
from support import family_shapes as shapes

SEEDS = (1, 2)   # two consecutive calls, on different inputs
CASES = [pytest.param((name, shape), id=f"{name}-{shape}", marks=[pytest.mark.gpu] if shape == "shaped" else [])
         for shape in shapes.SHAPES for name in shapes.NAMES]


def device():
    return comfy.model_management.get_torch_device()


def allocated() -> int:
    """Bytes torch holds on the GPU (0 on the CPU, where there is nothing to return)."""
    if device().type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(device())


def reset_peak() -> int:
    if device().type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device())
    return allocated()


def peak() -> int:
    return torch.cuda.max_memory_allocated(device()) if device().type == "cuda" else 0


def calls(model, family):
    """Both calls through ComfyUI's loading: their outputs (on the CPU), the peak GPU bytes above
    the start and, for a RingSwap MODEL, the streamed-block forwards the engine saw in each."""
    start = reset_peak()
    outs, forwards = [], []
    for seed in SEEDS:
        comfy.model_management.load_models_gpu([model])
        engine = getattr(model, "swap_engine", None)
        before = engine.stats.forwards if engine else 0
        outs.append(fm.forward(model, *family.inputs(seed)).cpu())
        forwards.append(engine.stats.forwards - before if engine else 0)
    return outs, peak() - start, forwards


class Resident(tuple):
    """(family, plain ModelPatcher, its outputs for SEEDS, their peak GPU bytes); a short repr."""

    def __repr__(self):
        return f"<{self[0].name} resident>"


@pytest.fixture(scope="module", params=CASES)
def resident(request, fast_and_quiet):
    name, shape = request.param
    family = shapes.family(name, shape)
    if family.missing():
        pytest.skip(f"{family.name}: {family.missing()}")
    plain = fm.build(family, dtype=torch.bfloat16, init_device=device())
    dm = plain.model.diffusion_model
    assert {p.dtype for lst in family.lists for p in getattr(dm, lst).parameters()} == {torch.bfloat16}
    # The first calls load the weights (the resident peak) and warm up: a process's first CUDA
    # calls on 0.33 + dynamic VRAM gave a Flux-shaped output 1 bf16 ulp off its later calls.
    _, top, _ = calls(plain, family)
    outs, _, _ = calls(plain, family)
    comfy.model_management.unload_all_models()
    for out in outs:
        assert torch.isfinite(out).all() and out.abs().max() > 0
    assert not torch.equal(*outs)
    yield Resident((family, plain, outs, top))
    del plain
    gc.collect()


@pytest.mark.parametrize("window", [1, 2])
@pytest.mark.parametrize("prefetch", [1, 2])
def test_bit_exact_streams_and_gives_vram_back(resident, window, prefetch):
    family, plain, refs, resident_peak = resident
    base = allocated()
    (model,) = RingSwapPatch().patch(plain, window, prefetch, "auto")
    engine = model.swap_engine
    outs, top, forwards = calls(model, family)
    plan, n = engine.plan, engine.num_blocks
    comfy.model_management.unload_all_models()
    assert not engine.attached, "unloading must detach the engine"
    for seed, got, want in zip(SEEDS, outs, refs):
        assert torch.equal(got, want), (f"{family.name} window {window} prefetch {prefetch}: seed {seed} differs "
                                        f"(max abs diff {(got.float() - want.float()).abs().max().item():.3g})")
    assert model.swap_state.list_names == list(family.lists)
    assert n == sum(len(getattr(plain.model.diffusion_model, lst)) for lst in family.lists) > window + prefetch
    assert len(plan.streamed) == n - window + 1 and len(plan.resident) == window - 1
    if window == 1:
        assert forwards == [family.block_calls or n] * len(SEEDS), "every block call runs through the ring"
    after = allocated()
    assert after <= base, f"{after - base} bytes stay on the GPU after unloading"
    if device().type == "cuda":
        assert 0 < top < resident_peak, f"swapped peak {top} vs resident {resident_peak}"
