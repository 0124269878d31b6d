"""The engine and the planner import and run with torch alone: the pack registers nodes only
when ComfyUI loads it."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = """
import sys
sys.path.insert(0, {here!r})
import conftest  # the repository as `ringswap`
import ringswap
from ringswap.swap import BlockSwapEngine, ResidencyPlan
from ringswap.swap.window_plan import PlanInputs, plan_window
from ringswap.swap.load_plan import RunFacts, SwapSettings, plan_load
from ringswap.lora import kernels
import torch
blocks = [torch.nn.Linear(8, 8) for _ in range(4)]
x = torch.randn(2, 8)
want = x
for b in blocks:
    want = b(want)
engine = BlockSwapEngine(blocks)
plan = plan_load(engine.facts(), RunFacts(device="cpu", free_bytes=10**9, nonblock_bytes=0), SwapSettings(window=2))
assert plan.residency == ResidencyPlan.make(4, 2, 1)
engine.attach("cpu", plan)
got = x
for b in blocks:
    got = b(got)
assert torch.equal(got, want)
assert plan_window(PlanInputs(block_sizes=(10,) * 4, nonblock_bytes=0, free_bytes=25, prefetch=1)).window == 1
assert ringswap.NODE_CLASS_MAPPINGS == {{}}
print("COMFY" if any(m == "comfy" or m.startswith("comfy.") for m in sys.modules) else "NO COMFY")
"""


def test_the_engine_imports_and_runs_without_comfyui():
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RINGSWAP_COMFYUI_DIR")}
    p = subprocess.run([sys.executable, "-c", CHILD.format(here=HERE)], capture_output=True, text=True,
                       timeout=120, env=env, cwd=HERE)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().splitlines()[-1] == "NO COMFY", p.stdout
