"""lora/kernels.py's launch policy, with a stand-in for a Triton kernel (the kernels themselves
run in tests/comfyui/test_lora_kernels.py on CUDA): a variant that never ran and cannot build
falls back with one warning, a variant that ran and then fails raises, and a LoRA pair's amax
is kept only once a fold has run."""
import logging

import pytest
import torch

from ringswap.lora import kernels


class StandIn:
    """Indexed by a grid and called like a Triton kernel; fails for the variants in `fails`
    (values of the RANK constexpr), and counts the launches."""

    def __init__(self, fails=()):
        self.fails, self.runs = set(fails), []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            if meta["RANK"] in self.fails:
                raise RuntimeError(f"out of resources: RANK={meta['RANK']}\nmore")
            self.runs.append(meta)
        return launch


@pytest.fixture(autouse=True)
def fresh_sets(monkeypatch):
    for name in ("_FAILED", "_BUILT", "_RAN"):
        monkeypatch.setattr(kernels, name, set())


def launch(kernel, rank, target, passes=({},)):
    return kernels._launch("q4_k", target, kernel, (1, 1), (target, target.numel()), passes, dict(RANK=rank))


def test_a_new_variant_that_cannot_build_falls_back_once(caplog):
    """GGUF's dequantize-only variant (RANK=0) runs first; the first fold with pairs (RANK=64)
    then cannot build: the caller is told (False), the kernel is off on that device, one
    warning names it."""
    target, kernel = torch.zeros(4, 4), StandIn(fails={64})
    assert launch(kernel, 0, target)
    with caplog.at_level(logging.WARNING, logger="ringswap.kernels"):
        assert not launch(kernel, 64, target)
    assert ("q4_k", target.device) in kernels._FAILED
    assert [r.getMessage() for r in caplog.records] == [
        "RingSwap LoRA: the fused q4_k fold cannot run on cpu (out of resources: RANK=64); folding op by op instead"]


def test_a_variant_that_ran_and_then_fails_raises():
    target, kernel = torch.zeros(4, 4), StandIn()
    assert launch(kernel, 64, target)
    kernel.fails.add(64)
    with pytest.raises(RuntimeError, match="RANK=64"):
        launch(kernel, 64, target)
    assert not kernels._FAILED


def test_a_second_pass_that_cannot_build_changes_nothing_and_falls_back():
    """The two-pass folds: the amax pass (which writes no weight) ran, the requantize pass of
    a new variant cannot build: False, so the caller folds op by op from the same bytes."""
    target = torch.zeros(4, 4)

    class SecondFails(StandIn):
        def __getitem__(self, grid):
            inner = super().__getitem__(grid)

            def launch(*args, **meta):
                if meta["REQUANT"]:
                    raise RuntimeError("cannot build the requantize pass")
                inner(*args, **meta)
            return launch
    kernel = SecondFails()
    assert not launch(kernel, 8, target, kernels.TWO_PASSES)
    assert [m["REQUANT"] for m in kernel.runs] == [False]


def test_the_amax_is_kept_only_once_a_fold_has_run():
    pairs = kernels.Pairs([(torch.randn(4, 2), torch.randn(2, 4), 1.0)], torch.device("cpu"))
    assert pairs.fold_passes() == (0, kernels.TWO_PASSES)
    assert pairs.ran(False) is False
    assert pairs.fold_passes() == (0, kernels.TWO_PASSES), "a fold that did not run keeps no amax"
    assert pairs.ran(True) is True
    assert pairs.fold_passes() == (0, kernels.REQUANT_PASS)
    pairs.ran(False)
    assert pairs.fold_passes() == (0, kernels.REQUANT_PASS)
