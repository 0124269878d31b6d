"""Whether a load keeps its streamed RAM homes coded (the `compress` setting: auto / on / off).

Pure: swap.load_plan calls `choose` with the window plan, the RAM split and what the engine
measured of earlier coding (ratio, decode rate). auto codes where RAM is short, or where a
timed plan is copy-bound and the planner's own call model (swap.timing), with the streamed
copies shrunk to the ratio and their decodes added to compute, says a call gets AUTO_GAIN
faster. The decode scratch a plan must count is `scratch_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass

from .plane_coder import PART_BYTES, PARTS_IN_FLIGHT
from .timing import call_seconds
from .window_plan import WindowPlan

COMPRESS_MODES = ("auto", "on", "off")
SCRATCH_BYTES = PARTS_IN_FLIGHT * (PART_BYTES * 3 // 2 + (4 << 20))   # part buffers: coded bytes, low and high planes
AUTO_GAIN = 0.95          # auto codes a copy-bound plan only where a call gets at least 5% faster
RATIO_GUESS = 0.70        # 16-bit weights code to about this; the engine's own ratio once it coded
DECODE_GUESS = 200e9      # block bytes a second a decode gives back, before one was timed
BESIDE_COMPUTE = 0.8      # a decode timed alone runs at about this share of its rate beside compute
SHARED = ("this MODEL's blocks are shared with the node that loaded it, which must find them as it left them; "
          "compress works on RingSwap's own load of the file: RingSwap Model Loader, or RingSwap Patch on a MODEL "
          "built for ComfyUI's dynamic VRAM")


@dataclass(frozen=True)
class CodingChoice:
    """A load's compress decision: `code` the streamed RAM homes, `why` (for the plan line),
    `may_code` (resident blocks kept in RAM at an unload are coded, so an expert switch finds
    them small), and `note`: auto's reason for being off where nothing can code (logged once)."""
    code: bool = False
    why: str = ""
    may_code: bool = False
    note: str = ""


def cannot_code(cuda: bool, coder_missing: str | None, own_load: bool) -> str | None:
    """Why a load cannot keep blocks coded (None: it can). `coder_missing`: why no coder is
    installed here; `own_load`: the blocks are RingSwap's own load of the file (a shared MODEL's
    would be left without weights by a coded home)."""
    if not cuda:
        return "there is no CUDA device to decode on"
    return coder_missing or (None if own_load else SHARED)


def scratch_bytes(mode: str, may_run_short: bool, usable: bool, coded: bool = False,
                  copy_bound: bool = False) -> int:
    """The decode scratch a plan counts: where it may code (on; auto where RAM may run short or the
    plan without the scratch is copy-bound) and a coder is `usable`, or where homes are coded already."""
    if coded:
        return SCRATCH_BYTES
    may = mode == "on" or (mode == "auto" and (may_run_short or copy_bound))
    return SCRATCH_BYTES if may and usable else 0


def choose(mode: str, why_not: str | None, plan: WindowPlan, ram_short: bool, ram_homes: bool,
           ratio: float = 0.0, decode_rate: float = 0.0, preview: bool = False) -> CodingChoice:
    """The decision for `plan`. `why_not`: cannot_code's answer; `ram_short`: some streamed block
    is read from the file, or RAM cannot hold all the blocks raw; `ram_homes`: some streamed block
    has a RAM home; `ratio`/`decode_rate`: measured by earlier coding (0: use the guesses).
    on raises a clear error where nothing can code (a `preview`, the plan route, says it in `why`);
    auto is then off with a note."""
    may = mode != "off" and why_not is None
    if mode == "off":
        return CodingChoice()
    if why_not is not None:
        error = why_not if why_not.startswith("RingSwap") else f"RingSwap: compress='on' but {why_not}"
        if mode == "on" and preview:
            return CodingChoice(why=f"{error.removeprefix('RingSwap: ')}: a run stops with this error")
        if mode == "on":
            raise RuntimeError(error)
        return CodingChoice(note=f"RingSwap compress auto: off ({why_not.removeprefix('RingSwap compress: ')})")
    estimate = None
    if plan.bound == "copy-bound":
        rate = BESIDE_COMPUTE * decode_rate if decode_rate else DECODE_GUESS
        estimate = (plan.call_s, coded_call_s(plan, ratio or RATIO_GUESS, rate))
    code, why = decide(mode, plan.bound, ram_short, ram_homes, estimate)
    return CodingChoice(code, why, may)


def coded_call_s(plan: WindowPlan, ratio: float, decode_bytes_per_s: float) -> float:
    """Seconds of a model call under a timed `plan` with its streamed blocks' copies shrunk to
    `ratio` and their decodes (at `decode_bytes_per_s` of GPU time) added to the compute."""
    i, r = plan.inputs, plan.residency
    streamed = set(r.streamed)
    sizes = tuple(int(b * ratio) if k in streamed else b for k, b in enumerate(i.block_sizes))
    return call_seconds(sizes, r, i.compute_s + plan.streamed_bytes / decode_bytes_per_s, i.link_bytes_per_s)


def decide(mode: str, bound: str, ram_short: bool, ram_homes: bool,
           estimate: tuple[float, float] | None = None) -> tuple[bool, str]:
    """The decision where coding is possible: (code?, why). `bound`: the plan's verdict
    (WindowPlan.bound); `estimate`: (seconds of a call, the same coded) where the plan is timed
    and copy-bound."""
    if not ram_homes:
        return False, "compress: nothing streams from RAM"
    if mode == "on":
        return True, "compress on"
    if ram_short:
        return True, "compress auto: RAM is short"
    if bound in ("hidden", "resident"):
        return False, "compress auto: copies hide under compute, no block coded for this load"
    if estimate is None:
        return False, "compress auto: compute and link not measured yet (a later run decides); compress=on codes now"
    raw, coded = estimate
    if coded > AUTO_GAIN * raw:
        return False, (f"compress auto: copy-bound, but the decodes would cost about what shorter copies save "
                       f"(est. {coded:.2f} s a call coded vs {raw:.2f} s); compress=on codes anyway")
    return True, f"compress auto: copy-bound, est. {coded:.2f} s a call coded vs {raw:.2f} s"
