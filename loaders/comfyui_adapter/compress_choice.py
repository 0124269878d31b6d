"""Whether a load keeps its streamed RAM homes coded (the `compress` setting: auto / on / off),
the coder it uses (nvCOMP's ANS, swap/plane_coder.py), the VRAM its decodes need, and the
plan line's words for it."""
from __future__ import annotations

import functools
import logging

import torch

from ...swap.plane_coder import PART_BYTES, PARTS_IN_FLIGHT, AnsPlanes, nvcomp_module
from ...swap.window_plan import WindowPlan
from ...swap.timing import call_seconds
from ...swap.ram_split import RamSplit

log = logging.getLogger("ringswap.compress")

COMPRESS_MODES = ("auto", "on", "off")
SCRATCH_BYTES = PARTS_IN_FLIGHT * (PART_BYTES * 3 // 2 + (4 << 20))   # part rooms: coded bytes, low and high planes
# auto codes a copy-bound run where the planner's call model, with the streamed blocks' copies shrunk
# to the ratio and their decodes added to compute, makes a call AUTO_GAIN faster (bench/RESULTS.md).
AUTO_GAIN = 0.95
RATIO_GUESS = 0.70        # 16-bit weights code to ~0.68 (plane_probe); the engine's own ratio once it coded
DECODE_GUESS = 200e9      # block bytes a second the decode gives back beside compute (H200, 128 MiB parts)
BESIDE_COMPUTE = 0.8      # a decode timed alone runs at about this share of its rate beside compute
ANS_DATA_TYPE = "|u1"   # byte planes; "<f2": ANS codes whole 16-bit words (no re-interleave), see bench/plane_probe.py
_said: set[str] = set()   # auto's "off" reasons already logged (one line each per process)


@functools.lru_cache(maxsize=1)
def nvcomp_missing() -> str | None:
    """Why nvCOMP cannot be used here (the ImportError's words), or None; looked up once."""
    try:
        nvcomp_module()
    except ImportError as e:
        return str(e)
    return None


def scratch_bytes(mode: str, device: torch.device, home: str, own_load: bool, coded: bool = False,
                  copy_bound: bool = False) -> int:
    """The decode scratch a load's plan counts: where it may code blocks (see `choose`: auto codes
    where home=auto may run short of RAM, or where the load's plan without the scratch is
    copy-bound: `copy_bound`), or holds coded homes already (`coded`: decoded whatever the setting
    is now)."""
    if coded:
        return SCRATCH_BYTES
    may = mode == "on" or (mode == "auto" and (home == "auto" or copy_bound))
    usable = own_load and device.type == "cuda" and nvcomp_missing() is None
    return SCRATCH_BYTES if may and usable else 0


SHARED = ("this MODEL's blocks are shared with the node that loaded it, which must find them as it left them; "
          "compress works on RingSwap's own load of the file: RingSwap Model Loader, or RingSwap Patch on a MODEL "
          "built for ComfyUI's dynamic VRAM")


def cannot_code(device: torch.device, own_load: bool) -> str | None:
    """Why a load cannot keep blocks coded on `device` (None: it can); `own_load` as in `choose`."""
    return "there is no CUDA device to decode on" if device.type != "cuda" else nvcomp_missing() \
        or (None if own_load else SHARED)


def may_code(mode: str, device: torch.device, own_load: bool) -> bool:
    """Whether a load may code at all (auto or on, and a coder here): its resident blocks kept in RAM
    at an unload are then coded, so an expert switch finds them in RAM. Any load `choose` codes may."""
    return mode != "off" and cannot_code(device, own_load) is None


def choose(mode: str, device: torch.device, plan: WindowPlan, split: RamSplit | None, ram_homes: bool,
           own_load: bool, coding=None, whole_short: bool = False) -> tuple[bool, str]:
    """(code the streamed RAM homes?, why). `ram_homes`: some streamed block has a RAM home;
    `whole_short`: the RAM cannot hold all the model's blocks raw (ram_room.short_of_whole);
    `own_load`: the blocks are RingSwap's own (read from the file), not a shared MODEL's, which a
    coded home would leave without weights; `coding`: the engine's swap.coding.Coding, whose measured
    ratio and decode rate replace the guesses. on: a clear error where nothing can code; auto: off
    with one log line."""
    if mode == "off":
        return False, ""
    why_not = cannot_code(device, own_load)
    if why_not is not None:
        if mode == "on":
            raise RuntimeError(why_not if why_not.startswith("RingSwap") else f"RingSwap: compress='on' but {why_not}")
        if why_not not in _said:
            _said.add(why_not)
            log.info("RingSwap compress auto: off (%s)", why_not.removeprefix("RingSwap compress: "))
        return False, ""
    estimate = None
    if plan.bound == "copy-bound":
        ratio = coding.ratio if coding is not None and coding.encoded[0] else RATIO_GUESS
        rate = BESIDE_COMPUTE * coding.decode_rate if coding is not None and coding.decode_rate else DECODE_GUESS
        estimate = (plan.call_s, coded_call_s(plan, ratio, rate))
    return decide(mode, plan.bound, bool(split is not None and split.file_blocks) or whole_short, ram_homes, estimate)


def coded_call_s(plan: WindowPlan, ratio: float, decode_bytes_per_s: float) -> float:
    """Seconds of a model call under a timed `plan` with its streamed blocks' copies shrunk to
    `ratio` and their decodes (at `decode_bytes_per_s` of GPU time) added to the compute: the
    planner's own call model (swap.timing)."""
    i, r = plan.inputs, plan.residency
    streamed = set(r.streamed)
    sizes = tuple(int(b * ratio) if k in streamed else b for k, b in enumerate(i.block_sizes))
    return call_seconds(sizes, r, i.compute_s + plan.streamed_bytes / decode_bytes_per_s, i.link_bytes_per_s)


def decide(mode: str, bound: str, ram_short: bool, ram_homes: bool,
           estimate: tuple[float, float] | None = None) -> tuple[bool, str]:
    """The decision where coding is possible: (code?, why). `bound`: the plan's verdict
    (swap.window_plan.WindowPlan.bound); `ram_short`: home=auto reads some streamed blocks from the file, or
    cannot hold all the model's blocks raw;
    `estimate`: (seconds of a call, the same coded) where the plan is timed and copy-bound."""
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


def coder_factory(device: torch.device) -> AnsPlanes:
    return AnsPlanes(device, data_type=ANS_DATA_TYPE)   # ANS's 64 KiB chunks: 16 or 32 KiB code worse (plane_probe)


def line(engine, why: str, streamed: tuple[int, ...], calls_per_step: int) -> str:
    """The plan line's part: why, and with coded blocks the ratio and the GB saved in RAM and on
    the link a step."""
    coded = [i for i in streamed if i in engine.pool.coded]
    if not coded:
        return why
    raw = sum(engine.states[i].layout.nbytes for i in coded)
    saved = raw - sum(engine.pool.coded[i].coded_bytes for i in coded)
    rate = engine.coding.decode_rate if engine.coding is not None else 0.0
    decode = f", decode ~{raw / len(coded) / rate * 1e3:.1f} ms a block" if rate else ""
    return (f"{why}: {len(coded)} blocks coded to {1 - saved / raw:.2f} x, {saved / 1e9:.1f} GB less in RAM "
            f"and {calls_per_step * saved / 1e9:.1f} GB less over the link a step{decode}")
