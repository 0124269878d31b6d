"""Whether a load keeps its streamed RAM homes coded (the `compress` setting: auto / on / off),
the coder it uses (nvCOMP's ANS, swap/plane_codec.py), the VRAM its decodes need, and the
plan line's words for it."""
from __future__ import annotations

import functools
import logging

import torch

from ...swap.plane_codec import PART_BYTES, PARTS_IN_FLIGHT, AnsPlanes, nvcomp_module
from ...swap.planner import WindowPlan
from ...swap.ram_plan import RamSplit

log = logging.getLogger("ringswap.compress")

COMPRESS_MODES = ("auto", "on", "off")
SCRATCH_BYTES = PARTS_IN_FLIGHT * (PART_BYTES * 3 // 2 + (4 << 20))   # part rooms: coded bytes, low and high planes
# Copy-bound runs are not coded by `auto` yet: on the H200 at 12 GiB with a halved link (cfg 1) the
# decode took about as much GPU time as the shorter copies saved (1.04 x, bench/RESULTS.md 2026-12-04).
AUTO_WHEN_COPY_BOUND = False
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


def scratch_bytes(mode: str, device: torch.device, home: str, own_load: bool, coded: bool = False) -> int:
    """The decode scratch a load's plan counts: where it may code blocks (see `choose`; auto codes
    copy-bound runs only with AUTO_WHEN_COPY_BOUND, else only where home=auto may run short of RAM),
    or holds coded homes already (`coded`: decoded whatever the setting is now)."""
    if coded:
        return SCRATCH_BYTES
    may = mode == "on" or (mode == "auto" and (AUTO_WHEN_COPY_BOUND or home == "auto"))
    usable = own_load and device.type == "cuda" and nvcomp_missing() is None
    return SCRATCH_BYTES if may and usable else 0


SHARED = ("this MODEL's blocks are shared with the node that loaded it, which must find them as it left them; "
          "compress works on RingSwap's own load of the file: RingSwap Model Loader, or RingSwap Patch on a MODEL "
          "built for ComfyUI's dynamic VRAM")


def choose(mode: str, device: torch.device, plan: WindowPlan, split: RamSplit | None, ram_homes: bool,
           own_load: bool) -> tuple[bool, str]:
    """(code the streamed RAM homes?, why). `ram_homes`: some streamed block has a RAM home;
    `own_load`: the blocks are RingSwap's own (read from the file), not a shared MODEL's, which a
    coded home would leave without weights. on: a clear error where nothing can code; auto: off
    with one log line."""
    if mode == "off":
        return False, ""
    why_not = ("there is no CUDA device to decode on" if device.type != "cuda" else nvcomp_missing()
               or (None if own_load else SHARED))
    if why_not is not None:
        if mode == "on":
            raise RuntimeError(why_not if why_not.startswith("RingSwap") else f"RingSwap: compress='on' but {why_not}")
        if why_not not in _said:
            _said.add(why_not)
            log.info("RingSwap compress auto: off (%s)", why_not.removeprefix("RingSwap compress: "))
        return False, ""
    return decide(mode, plan.bound, bool(split is not None and split.file_blocks), ram_homes)


def decide(mode: str, bound: str, ram_short: bool, ram_homes: bool) -> tuple[bool, str]:
    """The decision where coding is possible: (code?, why). `bound`: the plan's verdict
    (swap.planner.WindowPlan.bound); `ram_short`: home=auto reads some streamed blocks from the file."""
    if not ram_homes:
        return False, "compress: nothing streams from RAM"
    if mode == "on":
        return True, "compress on"
    if ram_short:
        return True, "compress auto: RAM is short"
    if bound in ("hidden", "resident"):
        return False, "compress auto: copies hide under compute, no block coded for this load"
    if not AUTO_WHEN_COPY_BOUND:
        return False, f"compress auto: {bound}, but decoding costs about what it saves here; compress=on codes anyway"
    return True, f"compress auto: {bound}"


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
