"""Window planner: how many blocks fit on the device for one sampling run, and what it costs.

Pure arithmetic: the caller measures (free VRAM, reserve, activation peak, link rate) and
this decides, so the choice is table-testable and the same function answers the web
extension's plan request. Recomputed for every run: latent size changes the activations.
With several conds a step (cond + uncond at cfg > 1), `plan_step` also decides whether they
run as one batched model call (each streamed block crosses the link once a step) or one
call each (smaller activations, more blocks resident), by its cost model.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import cached_property
from typing import Callable

from .residency import ResidencyPlan
from .timing import call_seconds

GB = 1e9
HIDDEN = 1.01       # a call within 1% of its compute time: the copies hide
GAIN = 0.995        # more prefetch is taken only where a call gets at least 0.5% faster
MORE_PREFETCH = 2   # an automatic window may copy up to this many blocks further ahead than `prefetch`
REPLAN_GAIN = 0.98  # a re-plan mid-run: each call at least 2% faster,
REPLAN_PAYBACK = 2  # and the run's remaining calls save at least twice what placing the blocks costs


class NotEnoughVRAM(RuntimeError):
    """Not even one block (plus the non-block weights and activations) fits on the device."""


@dataclass(frozen=True)
class PlanInputs:
    block_sizes: tuple[int, ...]     # bytes of each block, in engine order
    nonblock_bytes: int              # weights that always stay on the device
    free_bytes: int                  # device memory this model can have now (free + what it holds)
    reserve_bytes: int = 0           # kept free for others (ComfyUI's inference minimum, --reserve-vram)
    activation_bytes: int = 0        # activation peak of one model call at this latent size
    activation_source: str = "estimate"
    budget_bytes: int = 0            # the user's VRAM budget for this model (0 = no cap)
    window: int = 0                  # 0 = automatic
    prefetch: int = 1
    device: str = "cuda:0"
    tokens: int = 0                  # tokens of one model call (for the plan line; 0 = unknown)
    link_bytes_per_s: float = 0.0    # measured host-to-device copy rate (0 = not measured yet)
    compute_s: float = 0.0           # measured device time of one model call (0 = not measured yet)
    land_s: float = 0.0              # measured on-land work (LoRA fold) of a streamed block after its copy
    conds_per_step: int = 1          # conds the sampler computes each step (cond + uncond: 2)
    conds_per_call: int = 1          # of those, computed together in one model call under this plan
    dense_bytes: tuple[int, ...] = ()   # each block's dense weights while it computes (a GGUF LoRA fold), or ()
    dense_per_call: bool = False     # resident blocks make theirs before each call (else hold them: plan_window)

    @property
    def num_blocks(self) -> int:
        return len(self.block_sizes)

    @property
    def calls_per_step(self) -> int:
        return -(-self.conds_per_step // max(1, self.conds_per_call))

    @property
    def room_bytes(self) -> int:
        """Bytes the blocks may use: free minus reserve, activations and non-block weights,
        and within the budget (which holds the non-block weights and activations too)."""
        room = self.free_bytes - self.reserve_bytes - self.activation_bytes - self.nonblock_bytes
        if self.budget_bytes > 0:
            room = min(room, self.budget_bytes - self.activation_bytes - self.nonblock_bytes)
        return int(room)


def device_bytes(block_sizes: tuple[int, ...], plan: ResidencyPlan, dense_bytes: tuple[int, ...] = (),
                 dense_per_call: bool = False) -> int:
    """Block bytes on the device under `plan`: resident blocks plus ring slots of the largest
    streamed block. `dense_bytes`: a block's dense weights, made when it lands: a ring slot holds
    its block's; a resident block holds its own, or with `dense_per_call` makes them before each
    call, two sets alive at most (the one computing and the next, folded ahead)."""
    dense = dense_bytes or (0,) * len(block_sizes)
    ring = max((block_sizes[i] + dense[i] for i in plan.streamed), default=0)
    held = 0 if dense_per_call else sum(dense[i] for i in plan.resident)
    in_use = 2 * max((dense[i] for i in plan.resident), default=0) if dense_per_call else 0
    return sum(block_sizes[i] for i in plan.resident) + held + in_use + ring * plan.ring_slots


@dataclass(frozen=True)
class WindowPlan:
    inputs: PlanInputs
    residency: ResidencyPlan
    automatic: bool
    choice: str = ""   # why the conds run batched or one call each (plan_step), for the plan line

    @property
    def window(self) -> int:
        return self.residency.window

    @property
    def prefetch(self) -> int:
        return self.residency.prefetch

    @property
    def block_bytes_on_device(self) -> int:
        i = self.inputs
        return device_bytes(i.block_sizes, self.residency, i.dense_bytes, i.dense_per_call)

    @property
    def over_bytes(self) -> int:
        """How far a manual window goes past the room for blocks (0 when it fits)."""
        return max(0, self.block_bytes_on_device - self.inputs.room_bytes)

    @property
    def streamed_bytes(self) -> int:
        """Bytes copied to the device per model call (every streamed block once)."""
        return sum(self.inputs.block_sizes[i] for i in self.residency.streamed)

    @property
    def batched(self) -> bool:
        """Does one model call compute several of the step's conds together?"""
        return self.inputs.conds_per_call > 1 and self.inputs.conds_per_step > 1

    @property
    def timed(self) -> bool:
        """Are compute and (where blocks stream) the link rate measured?"""
        return self.inputs.compute_s > 0 and (self.inputs.link_bytes_per_s > 0 or not self.residency.streamed)

    @cached_property
    def call_s(self) -> float:
        """Seconds of one model call by the engine's rules (swap.timing); 0 when not timed."""
        if not self.timed:
            return 0.0
        i = self.inputs
        return call_seconds(i.block_sizes, self.residency, i.compute_s, i.link_bytes_per_s, i.land_s)

    @property
    def step_cost(self) -> tuple[float, int]:
        """(seconds a step takes, or where not timed the bytes streamed a step; model calls a step)."""
        calls = self.inputs.calls_per_step
        if self.timed:
            return calls * self.call_s, calls
        return float(calls * self.streamed_bytes), calls

    @property
    def copy_s(self) -> float:
        rate = self.inputs.link_bytes_per_s
        return self.streamed_bytes / rate if rate > 0 else 0.0

    @property
    def bound(self) -> str:
        """"resident", "hidden", "copy-bound" or "unknown" (compute or link rate not measured)."""
        if not self.residency.streamed:
            return "resident"
        if not self.timed:
            return "unknown"
        return "hidden" if self.call_s <= HIDDEN * self.inputs.compute_s else "copy-bound"

    def line(self) -> str:
        i, r = self.inputs, self.residency
        how = "auto" if self.automatic else "set"
        head = (f"RingSwap plan: window {r.window} of {r.num_blocks} ({how}; "
                + (f"{len(r.resident)} resident + ring {r.ring_slots}" if r.streamed else "all resident")
                + f"), {self.block_bytes_on_device / GB:.1f} GB of blocks + {i.nonblock_bytes / GB:.1f} GB "
                f"non-block on {i.device} of {i.free_bytes / GB:.1f} GB free"
                + (f" (budget {i.budget_bytes / GB:.1f} GB)" if i.budget_bytes else "")
                + f", reserve {i.reserve_bytes / GB:.1f} GB; activations ~{i.activation_bytes / GB:.1f} GB"
                + (f" at {i.tokens:,} tokens" if i.tokens else "") + f" ({i.activation_source})")
        if self.over_bytes:
            head += f"; the window is {self.over_bytes / GB:.1f} GB over the room for blocks"
        if r.prefetch > i.prefetch and r.streamed:
            head += (f"; prefetch {r.prefetch} (set {i.prefetch}): by the measured rates a step is "
                     "faster with more copies in flight")
        calls = i.calls_per_step
        step = (f"; {i.conds_per_step} conds a step " + ("batched in 1 model call" if self.batched else
                f"in {calls} model calls") + (f" ({self.choice})" if self.choice else "")
                if i.conds_per_step > 1 else "; 1 model call a step")
        if not r.streamed:
            return head + step + "; nothing streams"
        copy = (f"est. copy {self.copy_s:.2f} s" + (f" (then a fold of {i.land_s * 1e3:.1f} ms a block)"
                                                  if i.land_s else "") if self.copy_s else "copy rate not measured yet")
        compute = (f"compute ~{i.compute_s:.2f} s" if i.compute_s else "compute not measured yet")
        verdict = "" if self.bound == "unknown" else f": {self.bound}"
        return (f"{head}{step}; streams {self.streamed_bytes / GB:.1f} GB per model call "
                f"({calls * self.streamed_bytes / GB:.1f} GB a step), {copy} vs {compute}{verdict}")

    def as_dict(self) -> dict:
        """The plan for the browser and GET /ringswap/plan (JSON-ready)."""
        i, r = self.inputs, self.residency
        d = {k: v for k, v in asdict(i).items() if k not in ("block_sizes", "dense_bytes")}
        d.update(num_blocks=r.num_blocks, window=r.window, prefetch=r.prefetch, automatic=self.automatic,
                 resident=len(r.resident), streamed=len(r.streamed), ring_slots=r.ring_slots,
                 resident_blocks=list(r.resident),
                 block_bytes_on_device=self.block_bytes_on_device, room_bytes=i.room_bytes,
                 over_bytes=self.over_bytes, streamed_bytes=self.streamed_bytes, copy_s=self.copy_s,
                 bound=self.bound, batched=self.batched, calls_per_step=i.calls_per_step, choice=self.choice,
                 line=self.line())
        return d


def _fits(i: PlanInputs, window: int, prefetch: int) -> ResidencyPlan | None:
    plan = ResidencyPlan.make(i.num_blocks, window, prefetch)
    return plan if device_bytes(i.block_sizes, plan, i.dense_bytes, i.dense_per_call) <= i.room_bytes else None


def _largest(i: PlanInputs, prefetch: int) -> WindowPlan | None:
    """The largest window that fits at this prefetch, or None."""
    for window in range(i.num_blocks, 0, -1):
        plan = _fits(i, window, prefetch)
        if plan is not None:
            return WindowPlan(i, plan, True)
    return None


def plan_window(i: PlanInputs) -> WindowPlan:
    """The largest window (and, if need be, a smaller prefetch) whose blocks fit in the room
    left; a manual window is kept as asked (the plan says how far over the room it goes).
    With dense folds, resident blocks hold their dense weights or make them before each call,
    whichever keeps more blocks resident (a manual window: takes fewer bytes; a tie: held, no
    fold per call). Raises NotEnoughVRAM when not even one block fits."""
    if not any(i.dense_bytes):
        return _plan_window(i)
    plans = []
    for per_call in (False, True):
        try:
            plans.append(_plan_window(replace(i, dense_per_call=per_call)))
        except NotEnoughVRAM:
            if per_call and not plans:
                raise
    return min(plans, key=lambda p: (-len(p.residency.resident), p.block_bytes_on_device, p.inputs.dense_per_call))


def set_window(num_blocks: int, window: int, prefetch: int) -> ResidencyPlan | None:
    """The residency a set window gives, kept as asked (past the model's blocks: all of them);
    None for window 0, which the planner sizes."""
    return ResidencyPlan.make(num_blocks, min(window, num_blocks), prefetch) if window > 0 else None


def _plan_window(i: PlanInputs) -> WindowPlan:
    if i.num_blocks < 1:
        raise ValueError("the model has no transformer blocks")
    if i.window > 0:
        return WindowPlan(i, set_window(i.num_blocks, i.window, i.prefetch), False)
    best = None
    for prefetch in range(i.prefetch, i.prefetch + 1 + MORE_PREFETCH):
        plan = _largest(i, prefetch)
        if plan is None or (best is not None and not plan.timed):
            break
        if best is None or plan.call_s < best.call_s * GAIN:
            best = plan
    if best is not None:
        return best
    for prefetch in range(i.prefetch - 1, -1, -1):
        plan = _fits(i, 1, prefetch)
        if plan is not None:
            return WindowPlan(i, plan, True)
    need = max(b + d for b, d in zip(i.block_sizes, i.dense_bytes or (0,) * i.num_blocks))
    raise NotEnoughVRAM(
        f"RingSwap: not even one block fits on {i.device}: {i.free_bytes / GB:.2f} GB free"
        + (f", budget {i.budget_bytes / GB:.2f} GB" if i.budget_bytes else "")
        + f", minus reserve {i.reserve_bytes / GB:.2f} GB, activations ~{i.activation_bytes / GB:.2f} GB "
        f"({i.activation_source}) and {i.nonblock_bytes / GB:.2f} GB of non-block weights leaves "
        f"{i.room_bytes / GB:.2f} GB, and one block needs {need / GB:.2f} GB; free VRAM (close other "
        "programs, lower --reserve-vram), raise vram_budget_gb, or use a smaller latent or a quantized model")


def plan_step(batched: PlanInputs, single: PlanInputs) -> WindowPlan:
    """The plan for a step of `batched.conds_per_step` conds: the step's conds in one model
    call (`batched`: activations of the batched call) or one call each (`single`), whichever
    the cost model (WindowPlan.step_cost) says is faster; a tie goes to fewer calls. A manual
    window holds the same blocks either way, so it batches unless only the single call fits.
    Raises NotEnoughVRAM (the single call's numbers) when neither fits one block."""
    if batched.conds_per_step <= 1 or batched.conds_per_call <= 1:
        return plan_window(batched)
    plans, error = [], None
    for i in (batched, single):
        try:
            plans.append(plan_window(i))
        except NotEnoughVRAM as e:
            error = e
    if not plans:
        raise error
    if len(plans) == 1:
        only = plans[0]
        return replace(only, choice="batched" if only.batched else "batched would not fit one block")
    b, s = plans
    if b.over_bytes and not s.over_bytes:
        return replace(s, choice=f"batched is {b.over_bytes / GB:.1f} GB over the room")
    if b.step_cost[0] <= s.step_cost[0] * 1.001:   # a tie (within rounding) goes to fewer calls
        return replace(b, choice=_versus(b, s))
    return replace(s, choice=_versus(s, b))


def _versus(pick: WindowPlan, other: WindowPlan) -> str:
    """Why `pick` and not `other`, for the plan line: seconds where both are timed, else bytes."""
    name = "batched" if other.batched else "one call each"
    (cost, _), (other_cost, _) = pick.step_cost, other.step_cost
    if pick.timed and other.timed:
        return f"{name} est. {other_cost:.2f} s a step vs {cost:.2f} s"
    if other.residency.streamed or pick.residency.streamed:
        return f"{name} would stream {other_cost / GB:.1f} GB a step vs {cost / GB:.1f} GB"
    return f"{name}: more model calls" if other.inputs.calls_per_step > pick.inputs.calls_per_step else name


def replan_with_rates(plan: WindowPlan, compute_s: float, link_bytes_per_s: float, calls_left: int,
                      place_s: Callable[[ResidencyPlan], float], land_s: float = 0.0) -> WindowPlan | None:
    """After a run's first model calls measured compute and link (a first prompt plans
    without them): the automatic plan those rates choose for the same room and conds a call,
    when it makes each call at least 2% faster (REPLAN_GAIN) and the `calls_left` calls
    save at least REPLAN_PAYBACK x `place_s(new residency)`, the seconds its blocks take to
    place; else None. `land_s`: the measured on-land work of a streamed block (a LoRA fold)."""
    if not plan.automatic or plan.timed or not plan.residency.streamed or calls_left < 1 \
            or compute_s <= 0 or link_bytes_per_s <= 0:
        return None
    inputs = replace(plan.inputs, compute_s=compute_s, link_bytes_per_s=link_bytes_per_s, land_s=land_s)
    now = replace(plan, inputs=inputs)   # the plan that ran, timed
    try:
        new = _plan_window(inputs)   # the dense policy of the plan attached (reattach keeps its work)
    except NotEnoughVRAM:
        return None
    new = _near(new, plan.residency)
    if new.residency == now.residency or new.over_bytes or new.call_s > now.call_s * REPLAN_GAIN:
        return None
    if (now.call_s - new.call_s) * calls_left < REPLAN_PAYBACK * place_s(new.residency):
        return None
    return replace(new, choice=plan.choice)


def keep_attached(new: WindowPlan, attached: ResidencyPlan, ran_here: bool) -> WindowPlan | None:
    """The plan to run with while `attached` is on the device, given this run's plan `new`:
    `new` taken nearest the attached blocks (ResidencyPlan.reshaped) when that is the attached
    plan (e.g. one re-planned mid-run); for an automatic plan that ran this latent size last
    time with no more memory than now (`ran_here`), the attached residency when it is past the
    room by the numbers (the first run's own start-up allocations, e.g. kernels, came out of
    the free memory), its copies hide under compute, or `new` is not REPLAN_GAIN faster a call
    (a larger window saves little per step, while placing the blocks again costs seconds);
    None when the blocks must be placed again."""
    if attached.num_blocks == new.residency.num_blocks:
        new = _near(new, attached)
    if new.residency == attached:
        return new
    if not (new.automatic and ran_here) or attached.num_blocks != new.residency.num_blocks:
        return None
    kept = replace(new, residency=attached)
    if kept.over_bytes or kept.bound in ("hidden", "resident"):
        return kept
    return kept if kept.timed and new.call_s > kept.call_s * REPLAN_GAIN else None


def shrink_after_oom(plan: WindowPlan) -> WindowPlan | None:
    """The plan to retry a model call with after running out of memory: re-planned with the
    activation reserve doubled (at least +1 GiB), and always smaller than `plan`; None when
    the plan is already the smallest (window 1, prefetch 0)."""
    r = plan.residency
    if r.window <= 1 and (r.prefetch == 0 or not r.streamed):
        return None
    extra = max(plan.inputs.activation_bytes, 2**30)
    inputs = replace(plan.inputs, window=0, activation_bytes=plan.inputs.activation_bytes + extra,
                     activation_source="doubled after running out of memory")
    try:
        smaller = _plan_window(inputs)
    except NotEnoughVRAM:
        smaller = None
    if smaller is None or smaller.window >= r.window:
        if r.window > 1:
            window, prefetch = max(1, min(r.window - 1, math.ceil(r.window * 0.75))), r.prefetch
        else:
            window, prefetch = 1, 0
        smaller = WindowPlan(inputs, ResidencyPlan.make(r.num_blocks, window, prefetch), True)
    return _near(smaller, r)


def _near(new: WindowPlan, current: ResidencyPlan) -> WindowPlan:
    """`new` with the resident blocks nearest `current`'s (ResidencyPlan.reshaped: only the
    difference moves when a run changes plans), where those fit the room as well."""
    r = new.residency
    residency = current.reshaped(r.window, r.prefetch)
    if residency == r:
        return new
    near = replace(new, residency=residency)
    return near if near.over_bytes <= new.over_bytes else new
