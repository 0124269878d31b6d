"""LoadPlan: everything one load of a block-swapped model decides, decided in one pure function.

`plan_load(engine facts, run facts, settings)` gives the window plan (swap.window_plan), the RAM
split of the streamed blocks' homes (swap.ram_split), the coding choice (swap.coding_choice),
the dense/LoRA policy (in the window plan's inputs) and the plan line. Every path that changes
what is attached calls it, named by `RunFacts.change`: a load, the attachment kept between
prompts, the re-plan by the first calls' measured rates, the shrink after running out of
memory, and the RAM re-split once homes were coded. The plan route calls it too, so the route
and the run say the same plan line for the same facts. The engine reports its facts
(`BlockSwapEngine.facts`); the ComfyUI adapter gathers ComfyUI's numbers into RunFacts.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from . import coding_choice
from .coding_choice import COMPRESS_MODES, CodingChoice
from .home_policy import HomePolicy, home_policy
from .ram_split import RamSplit, home_ram, split_ram
from .residency import ResidencyPlan
from .window_plan import (NotEnoughVRAM, PlanInputs, WindowPlan, device_bytes, keep_attached, plan_step,
                          replan_with_rates, set_window, shrink_after_oom)

PIN_MODES = ("auto", "on", "off")
LOAD, KEEP, RATES, OOM, CODED = "load", "keep", "rates", "oom", "coded"
DISK_GUESS = 1e9   # bytes/s for reading blocks back from the file before any read was timed


@dataclass(frozen=True)
class SwapSettings:
    """The user's settings of a block-swapped model (the nodes' widgets)."""
    window: int          # blocks kept on the device; 0 = planned for each run
    prefetch: int = 1
    pin_memory: str = "auto"
    vram_budget_gb: float = 0.0   # VRAM this model may use in all (weights + activations); 0 = what is free
    ram_budget_gb: float = 0.0    # home=auto: host RAM for block homes; 0 = what is available
    compress: str = "auto"        # streamed RAM homes kept coded (swap.coding_choice)

    def __post_init__(self):
        if self.window < 0:
            raise ValueError(f"RingSwap: window must be 0 (automatic) or a number of blocks, got {self.window}")
        if self.prefetch < 0:
            raise ValueError(f"RingSwap: prefetch must be 0 or more, got {self.prefetch}")
        if not self.vram_budget_gb >= 0:
            raise ValueError(f"RingSwap: vram_budget_gb must be 0 (what is free) or more, got {self.vram_budget_gb}")
        if not self.ram_budget_gb >= 0:
            raise ValueError(f"RingSwap: ram_budget_gb must be 0 (what is available) or more, got {self.ram_budget_gb}")
        if self.pin_memory not in PIN_MODES:
            raise ValueError(f"RingSwap: pin_memory must be one of {PIN_MODES}, got {self.pin_memory!r}")
        if self.compress not in COMPRESS_MODES:
            raise ValueError(f"RingSwap: compress must be one of {COMPRESS_MODES}, got {self.compress!r}")


@dataclass(frozen=True)
class EngineFacts:
    """What the engine knows that a plan needs (BlockSwapEngine.facts)."""
    block_sizes: tuple[int, ...]          # each block's bytes on the device (and in a raw home)
    home_sizes: tuple[int, ...] = ()      # each block's bytes in RAM: coded, or at the ratio where coding pays
    homes_held: int = 0                   # bytes of RAM homes held now
    policy: HomePolicy = home_policy("disk")   # which blocks keep a RAM home (the engine's `home` setting)
    own_load: bool = False                # the blocks are read from the file by RingSwap
    read_buffers: int = 2                 # staging buffers a file-read block needs
    coded_any: bool = False               # some home is kept coded
    coding_ratio: float = 0.0             # measured coded/raw (0: nothing coded yet)
    coding_pays: bool | None = None       # None: not tried; False: blocks did not shrink enough
    decode_rate: float = 0.0              # decode bytes a second, measured (0: not timed)
    link_bytes_per_s: float = 0.0         # host-to-device rate of the last run's pinned copies
    read_bytes_per_s: float = 0.0         # file read rate of the last attach (0: none timed)
    pin_s_per_byte: float = 0.0           # page-locking time a byte, measured or guessed
    attached: ResidencyPlan | None = None  # the residency on the device now
    attached_coded: bool = False          # the attachment keeps its streamed homes coded
    pinned_copies: bool = False           # the attachment copies from page-locked homes
    homes: frozenset[int] = frozenset()   # blocks with a RAM home now
    pinned: frozenset[int] = frozenset()  # of those, page-locked
    coded: frozenset[int] = frozenset()   # of those, kept coded (their home_sizes are the coded bytes)
    memory: str | None = None             # how the attachment's copies leave host memory (None: detached)
    read_back: tuple[int, float] = (0, 0.0)   # bytes the last attach read from the file, and its seconds

    @property
    def total_block_bytes(self) -> int:
        return sum(self.block_sizes)

    def coding_line(self, why: str, streamed: tuple[int, ...], calls_per_step: int) -> str:
        """The plan line's coding words once attached: `why`, and with coded blocks the ratio and
        the GB saved in RAM and on the link a step."""
        coded = [i for i in streamed if i in self.coded]
        if not coded:
            return why
        raw = sum(self.block_sizes[i] for i in coded)
        saved = raw - sum(self.home_sizes[i] for i in coded)
        decode = f", decode ~{raw / len(coded) / self.decode_rate * 1e3:.1f} ms a block" if self.decode_rate else ""
        return (f"{why}: {len(coded)} blocks coded to {1 - saved / raw:.2f} x, {saved / 1e9:.1f} GB less in RAM "
                f"and {calls_per_step * saved / 1e9:.1f} GB less over the link a step{decode}")


@dataclass(frozen=True)
class CallFacts:
    """ComfyUI's numbers for one model call shape (conds in a call)."""
    activation_bytes: int = 0
    activation_source: str = "no latent known"
    reserve_bytes: int = 0
    tokens: int = 0
    compute_s: float = 0.0    # measured device time of one call (0: not measured)
    land_s: float = 0.0       # measured on-land work of a streamed block


@dataclass(frozen=True)
class RunFacts:
    """ComfyUI's numbers for a load (gathered by the adapter) and which path is asking."""
    device: str
    free_bytes: int                       # device memory this model can have now
    nonblock_bytes: int                   # weights always on the device (LoRA pairs, fold workspace included)
    batched: CallFacts = field(default_factory=CallFacts)   # all the step's conds in one call
    single: CallFacts = field(default_factory=CallFacts)    # one cond a call
    conds_per_step: int = 1
    all_asked: bool = False               # a CPU device or a full load: every block, unless a budget is set
    dense_bytes: tuple[int, ...] = ()     # each block's dense weights while it computes (GGUF fold), or ()
    coder_missing: str | None = None      # why no coder is installed here (None: there is one)
    ram_available: int = 0
    ram_kept_by_comfy: int = 0
    change: str = LOAD                    # LOAD, KEEP, RATES, OOM or CODED
    packed_only: bool = False             # GGUF weights stay packed in their layers (dense_bytes then ())
    ran_here: frozenset[int] = frozenset()   # KEEP: conds a call at which the attached plan ran this
    #                                          latent last time with no more device memory than now
    rates: tuple[float, float, float] = (0.0, 0.0, 0.0)   # RATES: compute s a call, link bytes/s, fold s a block
    calls_left: int = 0                   # RATES: model calls left in the run
    preview: bool = False                 # a plan shown before a run (the plan route): on's error goes in its words

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class LoadPlan:
    """One load's decisions. `fresh`: where an attached plan is kept (KEEP), the plan this run
    would have had; `packed_only`: GGUF weights stay packed (their dense forms did not fit);
    `note`: a line for the log about why the blocks are placed again."""
    window: WindowPlan
    ram: RamSplit | None
    coding: CodingChoice
    settings: SwapSettings
    fresh: WindowPlan | None = None
    packed_only: bool = False
    note: str = ""
    first_read: int = 0   # bytes the first call reads from the file as its blocks arrive (0: none, or read up front)

    @property
    def residency(self) -> ResidencyPlan:
        return self.window.residency

    @property
    def ram_blocks(self) -> frozenset[int] | None:
        """The streamed blocks that get a RAM home where RAM is split, else None (the engine's rule)."""
        return self.ram.ram_blocks if self.ram is not None else None

    @property
    def pin_memory(self) -> str:
        return self.settings.pin_memory

    @property
    def keeps(self) -> bool:
        return self.fresh is not None

    @property
    def stream_first(self) -> bool:
        """The first call computes as its blocks arrive from the file (swap/first_use.py)."""
        return self.first_read > 0

    def line(self, coding: str | None = None) -> str:
        """The plan line: the window plan, the RAM split and the coding choice (`coding`: its words
        once attached, EngineFacts.coding_line)."""
        coding = self.coding.why if coding is None else coding
        first = (f"the first call computes as its blocks arrive: {self.first_read / 1e9:.2f} GB from the file, "
                 "each block waiting only for its own bytes" if self.first_read else "")
        return "; ".join([self.window.line()] + ([self.ram.line()] if self.ram is not None else [])
                         + ([first] if first else []) + ([coding] if coding else []))

    def as_dict(self) -> dict:
        """The plan for the browser and GET /ringswap/plan (JSON-ready): the window plan's fields,
        the RAM split's and coding's, and the plan line."""
        d = self.window.as_dict()
        ram = self.ram
        d.update(line=self.line(), compress=self.coding.code, compress_why=self.coding.why, first_read=self.first_read,
                 ram_blocks=sorted(ram.ram_blocks) if ram is not None else None,
                 file_blocks=list(ram.file_blocks) if ram is not None else [],
                 home_ram_bytes=ram.ram_bytes if ram is not None else None)
        return d


def plan_load(engine: EngineFacts, run: RunFacts, settings: SwapSettings,
              current: LoadPlan | None = None) -> LoadPlan | None:
    """The plan for `run.change`: LOAD a new plan (raises NotEnoughVRAM with the numbers); KEEP the
    attached residency where swap.window_plan.keep_attached and the coding choice allow (else the
    new plan, `keeps` False); RATES, OOM, CODED: the plan replacing `current`, or None to keep it."""
    if run.change == LOAD:
        return _new(engine, run, settings)
    if run.change == KEEP:
        return _keep(engine, run, settings)
    if current is None:
        raise ValueError(f"plan_load: {run.change!r} needs the current plan")
    if run.change == RATES:
        return _by_rates(engine, run, settings, current)
    if run.change == OOM:
        smaller = shrink_after_oom(current.window)
        return None if smaller is None else replace(current, window=smaller, ram=_moved(current.ram, smaller),
                                                    fresh=None)
    if run.change == CODED:
        if not (current.coding.code and current.ram is not None and current.ram.file_blocks):
            return None
        ram = _split(engine, run, settings, current.residency)
        return replace(current, ram=ram) if len(ram.ram_blocks) > len(current.ram.ram_blocks) else None
    raise ValueError(f"plan_load: unknown change {run.change!r}")


def _new(engine: EngineFacts, run: RunFacts, settings: SwapSettings) -> LoadPlan:
    window = _window(engine, run, settings, copy_bound=False)
    if window.bound == "copy-bound" and settings.compress == "auto":   # auto may code: its scratch counts
        window = _window(engine, run, settings, copy_bound=True)
    window = replace(window, automatic=not settings.window)
    ram = _split(engine, run, settings, window.residency)
    coding = _coding(engine, run, settings, window, ram)
    # home=ram reads every home when the model is loaded, before any plan: nothing left for the call
    streams = engine.own_load and not coding.code and not engine.policy.every_block
    first = _from_file(engine, window.residency, ram) if streams else 0
    return LoadPlan(window, ram, coding, settings, packed_only=run.packed_only, first_read=first)


def _window(engine: EngineFacts, run: RunFacts, settings: SwapSettings, copy_bound: bool) -> WindowPlan:
    """The window plan (batched or one call per cond: swap.window_plan.plan_step)."""
    everything = run.all_asked and not settings.vram_budget_gb
    window = len(engine.block_sizes) if everything and not settings.window else settings.window
    usable = coding_choice.cannot_code(run.cuda, run.coder_missing, engine.own_load) is None
    scratch = coding_choice.scratch_bytes(settings.compress, engine.policy.splits_ram, usable, engine.coded_any, copy_bound)

    def inputs(call: CallFacts, conds: int) -> PlanInputs:
        return PlanInputs(
            block_sizes=engine.block_sizes, dense_bytes=run.dense_bytes, nonblock_bytes=run.nonblock_bytes + scratch,
            free_bytes=run.free_bytes, reserve_bytes=call.reserve_bytes, activation_bytes=call.activation_bytes,
            activation_source=call.activation_source, budget_bytes=int(settings.vram_budget_gb * 1e9),
            window=window, prefetch=settings.prefetch, device=run.device, tokens=call.tokens,
            link_bytes_per_s=engine.link_bytes_per_s, compute_s=call.compute_s, land_s=call.land_s,
            conds_per_step=run.conds_per_step, conds_per_call=min(conds, run.conds_per_step))
    return plan_step(inputs(run.batched, run.conds_per_step), inputs(run.single, 1))


def _split(engine: EngineFacts, run: RunFacts, settings: SwapSettings, residency: ResidencyPlan) -> RamSplit | None:
    """The RAM split of `residency`'s streamed blocks where the engine splits RAM, else None."""
    if not engine.policy.splits_ram:
        return None
    nbytes, why = _home_ram(engine, run, settings)
    return split_ram(residency, engine.home_sizes or engine.block_sizes, nbytes, why, engine.read_buffers,
                     engine.block_sizes)


def _home_ram(engine: EngineFacts, run: RunFacts, settings: SwapSettings) -> tuple[int, str]:
    """(bytes the block homes may use, why): swap.ram_split.home_ram of this load's numbers."""
    return home_ram(settings.ram_budget_gb, run.ram_available, engine.homes_held, run.ram_kept_by_comfy)


def ram_homes(engine: EngineFacts, residency: ResidencyPlan, ram: RamSplit | None) -> frozenset[int]:
    """The blocks that hold a RAM home under `residency` (swap.home_policy; `ram`: the split)."""
    return engine.policy.ram_homes(len(engine.block_sizes), residency, ram.ram_blocks if ram is not None else None)


def _coding(engine: EngineFacts, run: RunFacts, settings: SwapSettings, window: WindowPlan,
            ram: RamSplit | None) -> CodingChoice:
    why_not = coding_choice.cannot_code(run.cuda, run.coder_missing, engine.own_load)
    short = bool(ram is not None and ram.file_blocks) or \
        (engine.policy.splits_ram and _home_ram(engine, run, settings)[0] < engine.total_block_bytes)
    homed = bool(ram_homes(engine, window.residency, ram) & set(window.residency.streamed))
    return coding_choice.choose(settings.compress, why_not, window, short, homed, engine.coding_ratio,
                                engine.decode_rate, run.preview)


def _keep(engine: EngineFacts, run: RunFacts, settings: SwapSettings) -> LoadPlan:
    """The attached residency kept where it may be, else the new plan (keeps False)."""
    fresh = _new(engine, run, settings)
    if engine.attached is None:
        return fresh
    kept = keep_attached(fresh.window, engine.attached, fresh.window.inputs.conds_per_call in run.ran_here)
    if kept is None:
        return fresh
    if fresh.coding.code and not engine.attached_coded and engine.coding_pays is not False:
        return replace(fresh, note=f"RingSwap {fresh.coding.why}: placing the blocks again to code their homes")
    return replace(fresh, window=kept, ram=_split(engine, run, settings, kept.residency), fresh=fresh.window)


def _by_rates(engine: EngineFacts, run: RunFacts, settings: SwapSettings, current: LoadPlan) -> LoadPlan | None:
    compute_s, link, fold_s = run.rates

    def place_s(residency: ResidencyPlan) -> float:
        return place_seconds(engine, residency, _split(engine, run, settings, residency), link)
    new = replan_with_rates(current.window, compute_s, link, run.calls_left, place_s, fold_s)
    if new is None:
        return None
    return replace(current, window=new, ram=_split(engine, run, settings, new.residency), fresh=None)


def place_seconds(engine: EngineFacts, residency: ResidencyPlan, ram: RamSplit | None, link_bytes_per_s: float) -> float:
    """Seconds attaching `residency` takes: the resident blocks not on the device yet, copied from
    their RAM home at the link rate or read from the file at the last read rate, RAM homes to fill
    from the file, and the streamed homes to page-lock."""
    disk = engine.read_bytes_per_s or DISK_GUESS
    placing = _placing(engine, residency)
    homes, size, has = ram_homes(engine, residency, ram), engine.block_sizes, engine.homes
    from_file = _from_file(engine, residency, ram)
    from_ram = sum(size[i] for i in placing if i in has)
    to_pin = sum(size[i] for i in homes & set(residency.streamed) if i not in engine.pinned) \
        if engine.pinned_copies else 0
    return from_file / disk + from_ram / link_bytes_per_s + to_pin * engine.pin_s_per_byte


def _placing(engine: EngineFacts, residency: ResidencyPlan) -> set[int]:
    """`residency`'s resident blocks not on the device now."""
    on_device = set(engine.attached.resident) if engine.attached is not None else set()
    return set(residency.resident) - on_device


def _from_file(engine: EngineFacts, residency: ResidencyPlan, ram: RamSplit | None) -> int:
    """Bytes attaching `residency` reads from the file: resident blocks to place and RAM homes to
    fill that have no home now."""
    homes, has = ram_homes(engine, residency, ram), engine.homes
    return sum(engine.block_sizes[i] for i in _placing(engine, residency) | homes if i not in has)


def _moved(ram: RamSplit | None, window: WindowPlan) -> RamSplit | None:
    """`ram` for a shrunk window: the same blocks keep their RAM homes (the newly streamed ones read
    the file), so a retry after running out of memory reads nothing up front."""
    return None if ram is None else replace(ram, plan=window.residency)


def bytes_before_attach(engine: EngineFacts, settings: SwapSettings) -> int:
    """Block bytes a load will hold on the device, known before it is planned: a set window's
    (swap.window_plan.set_window), else every block's."""
    plan = set_window(len(engine.block_sizes), settings.window, settings.prefetch)
    return device_bytes(engine.block_sizes, plan) if plan is not None else engine.total_block_bytes


def pins_ahead(engine: EngineFacts, run: RunFacts, settings: SwapSettings) -> bool:
    """Whether a load page-locks every block's file pages before its first plan (engine.pin_ahead):
    on CUDA, homes split RAM and stay raw, and the home RAM holds every block, so whatever window the
    plan takes, its split keeps every streamed block in RAM (pages locked beyond it would be RAM lost).
    The plan still streams the first call (swap/facts.py does not count these homes as held)."""
    return (run.cuda and engine.policy.splits_ram and settings.compress != "on" and settings.pin_memory != "off"
            and _home_ram(engine, run, settings)[0] >= engine.total_block_bytes)


def kept_at_unload(engine: EngineFacts, run: RunFacts, settings: SwapSettings) -> int:
    """Bytes of resident blocks a model taken off the GPU may keep in RAM (the next attach then
    places them without reading the file): what the home RAM leaves beside the homes it holds,
    where the engine splits RAM; 0 otherwise."""
    if not engine.policy.splits_ram:
        return 0
    return max(0, _home_ram(engine, run, settings)[0] - engine.homes_held)


__all__ = ["CODED", "KEEP", "LOAD", "OOM", "RATES", "CallFacts", "EngineFacts", "LoadPlan", "NotEnoughVRAM",
           "RunFacts", "SwapSettings", "bytes_before_attach", "kept_at_unload", "pins_ahead", "place_seconds", "plan_load",
           "ram_homes"]
