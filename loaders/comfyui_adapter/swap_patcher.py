"""SwapModelPatcher: a ComfyUI ModelPatcher whose transformer blocks stream.

ComfyUI's loader keeps managing everything but the blocks; the swap engine (resident blocks +
GPU slot ring) lives on the diffusion model (shared by all clones), the settings on each patcher.
Every load is decided by swap.load_plan.plan_load from the engine's facts and ComfyUI's numbers.

| override | why |
| --- | --- |
| `clone` | carries the settings, the Patch's base and the node id to ComfyUI's clones |
| `_load_list` | leaves the block modules out, so ComfyUI never moves or patches their weights |
| `load` | plans the load, attaches the engine (LoRA folded as blocks land) and reports its VRAM |
| `model_size` | non-block weights plus the plan's block bytes, not the whole model |
| `partially_load` | keeps the last run's blocks where the plan allows; else detaches and loads |
| `partially_unload` | frees the ring and resident blocks before ComfyUI unloads anything else |
| `detach` | gives the blocks back, unless this patcher is the one loading again (`is_clone`) |
| `is_clone` | notes that ComfyUI is loading this same patcher again (its detach keeps the blocks) |
| `unpatch_model` | detaches the engine and drops the fold and GGUF patches hung on weights |
| `patch_weight_to_device` | GGUF: hangs patches on quantized non-block weights, as ComfyUI-GGUF does |
| `get_free_memory` | calc_cond_batch's free memory follows the plan's batched-or-not choice |
| `cleanup` | ends the run: stats for the next plan, the summary line and the browser's message |

Hand edits of ComfyUI's accounting: `wrap` sets `size` to 0 and a fresh `patches_uuid` (another
patcher's weights are fully unloaded first); `load` sets `model_loaded_weight_memory` to
`model_size()` (or adds the engine's bytes in lowvram); releasing the engine subtracts what it
freed and sets `model_lowvram` so the next load attaches again; an out-of-memory shrink or a
re-plan changes it by the difference (sampling.py).
"""
from __future__ import annotations

import logging
import sys
import time
import uuid
import weakref
from itertools import chain

import torch

import comfy.model_management
import comfy.model_patcher

from ...lora.fold import BlockFolder, block_folder
from ...swap import BlockSwapEngine, driver_turns
from ...swap.host_pool import locked_while, set_pin_budget
from ...swap.page_out import mapped_tensors, page_out_moved
from ...swap.plane_coder import ans_coder
from ...swap.load_plan import CODED, KEEP, LOAD, LoadPlan, NotEnoughVRAM, SwapSettings, bytes_before_attach, kept_at_unload, pins_ahead, plan_load
from . import comfy_memory, comfy_models, comfy_server
from . import gguf_tensors, live_feed, run_facts, sampling
from .live_payload import RUN_EVENT, run_payload
from .run_state import RunState
from .swap_state import SwapState

log = logging.getLogger("ringswap.swap_patcher")
_said: set[str] = set()   # notes already logged (one line each per process)

if comfy_memory.ComfyPinBudget.available():   # RingSwap's pins count in ComfyUI's pin budget
    set_pin_budget(comfy_memory.ComfyPinBudget())


class SwapModelPatcher(comfy.model_patcher.ModelPatcher):
    ringswap: SwapSettings | None = None   # set by wrap(); None only inside wrap's clone call
    ringswap_base: comfy.model_patcher.ModelPatcher | None = None   # wrap's `onto`, kept alive (its cache is weak)
    ringswap_node: str | None = None   # id of the RingSwap node that made this MODEL (for the browser)
    _swap_run: RunState | None = None   # made by ringswap_run on first use

    @classmethod
    def wrap(cls, model: comfy.model_patcher.ModelPatcher, settings: SwapSettings,
             onto: comfy.model_patcher.ModelPatcher | None = None, node: object = None) -> "SwapModelPatcher":
        """A clone of `model` (any ModelPatcher class) that block-swaps with `settings`;
        with `onto` (RingSwap's own load of the same file), a clone whose model is onto's,
        keeping `model`'s patches, options and wrappers. The source's class is swapped only
        for the clone call, as ComfyUI-GGUF does, so the clone is built as a plain
        SwapModelPatcher (never a dynamic-VRAM patcher). `node`: the RingSwap node's id
        (ComfyUI's UNIQUE_ID), for the browser's live view."""
        if getattr(model, "model", None) is None or getattr(model.model, "diffusion_model", None) is None:
            raise ValueError(f"RingSwap: expected a diffusion MODEL (a ComfyUI ModelPatcher with a "
                             f"diffusion_model), got {type(model).__name__}")
        if onto is not None:
            n = comfy_models.clone_onto(model, onto)
            n.ringswap_base = onto
        else:
            src_cls = model.__class__
            model.__class__ = cls
            try:
                n = comfy.model_patcher.ModelPatcher.clone(model)
            finally:
                model.__class__ = src_cls
        n.__class__ = cls
        state = SwapState.of(n)
        n.size = 0
        n.ringswap = settings
        n.ringswap_node = None if node is None else str(node)
        sampling.install(n)
        # Our own weight state: ComfyUI then fully unloads whatever another patcher of
        # the same model left on the GPU before loading this one (partially_load).
        n.patches_uuid = uuid.uuid4()
        if pins_ahead(state.engine.facts(), run_facts.host_ram(n.load_device), settings):
            state.engine.pin_ahead(n.load_device)
            if state.engine.ahead is not None:   # ComfyUI's CUDA calls up to the attach go first (PATIENCE_S at most)
                driver_turns.Hold()
        if settings.window > state.engine.num_blocks:
            log.warning("RingSwap: window=%d is more than the model's %d blocks; using %d (all resident)",
                        settings.window, state.engine.num_blocks, state.engine.num_blocks)
        return n

    @property
    def ringswap_run(self) -> RunState:
        """This patcher's run state, made on first use: every clone (ComfyUI builds a new
        object, never copying this one's attributes) starts with a fresh one."""
        if self._swap_run is None:
            self._swap_run = RunState()
        return self._swap_run

    @property
    def swap_state(self) -> SwapState:
        return SwapState.of(self)

    @property
    def swapped_blocks(self) -> SwapState:
        """This model's blocks as lora.blocks.SwappedBlocks (what the LoRA checks read)."""
        return self.swap_state

    @property
    def swap_engine(self) -> BlockSwapEngine:
        return self.swap_state.engine

    def clone(self, *args, **kwargs):
        n = super().clone(*args, **kwargs)
        n.ringswap, n.ringswap_base, n.ringswap_node = self.ringswap, self.ringswap_base, self.ringswap_node
        return n

    # ----- what ComfyUI loads itself: everything but the blocks --------------------------
    def _load_list(self, *args, **kwargs):
        prefixes = self.swap_state.prefixes
        return [x for x in super()._load_list(*args, **kwargs)
                if not any(isinstance(v, str) and (v + ".").startswith(prefixes) for v in x)]

    def _unload_other_rings(self) -> int:
        """Unload every other block-swapped model (e.g. the other Wan 2.2 expert), so at
        most one model's ring is on the GPU. Returns how many were unloaded."""
        loaded = comfy.model_management.current_loaded_models
        others = [lm for lm in loaded if isinstance(lm.model, SwapModelPatcher) and lm.model.model is not self.model
                  and lm.model.swap_engine.attached]
        for lm in others:
            loaded.remove(lm)
            lm.model_unload()
        return len(others)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False, *args, **kwargs):
        t0 = time.perf_counter()
        run = self.ringswap_run
        run.reloading = False
        switched = self._unload_other_rings()
        device = self._device(device_to)
        engine = self.swap_engine
        plan = run.plan = self._plan(device, full_load)
        if plan.coding.may_code:
            engine.coder_factory = ans_coder
        folder = self.block_folder_on(device)
        engine.attach(device, plan, owner=weakref.ref(self), on_land=folder, progress=live_feed.progress_bar(),
                      resident_work=folder.resident_work() if folder is not None and plan.window.inputs.dense_per_call
                      else None)
        resplit = plan_load(engine.facts(), run_facts.gather(self, device, full_load, CODED), self.ringswap, plan)
        if resplit is not None:   # coded homes left RAM for more blocks
            engine.reattach(resplit, after_oom=False)
            plan = run.plan = resplit
        live_feed.observe(engine, self.ringswap_node)
        mapped = mapped_tensors(self.model)   # non-block weights still views of the file's map (.gguf)
        # GGUF: the pack's layers never read lowvram weight functions, so its patches are always
        # hung on the weights (GGUFModelPatcher.load forces this too)
        force_patch_weights = force_patch_weights or gguf_tensors.holds_ggml(self.model)
        try:   # its copies (non-block weights) as one burst, from page-locked memory where RingSwap's load made them
            with driver_turns.copies(), locked_while(self._host_weights(device, plan)):
                super().load(device_to, lowvram_model_memory, force_patch_weights, full_load, *args, **kwargs)
        except BaseException:
            engine.detach()
            raise
        given_back = page_out_moved(mapped)
        if not self.model.model_lowvram:
            self.model.model_loaded_weight_memory = self.model_size()
        else:
            self.model.model_loaded_weight_memory += engine.device_bytes()
        log.info(_load_line(plan, engine.facts(), folder, device, given_back, time.perf_counter() - t0, switched))

    def _host_weights(self, device: torch.device, plan: LoadPlan) -> list[torch.Tensor]:
        """The non-block weights ComfyUI's load copies to `device` (page-locked for it unless pinning is off)."""
        if device.type != "cuda" or plan.pin_memory == "off":
            return []
        inside = {id(t) for s in self.swap_engine.states for t in chain(s.block.parameters(), s.block.buffers())}
        return [t for t in chain(self.model.parameters(), self.model.buffers()) if id(t) not in inside]

    def _plan(self, device: torch.device, full_load: bool, change: str = LOAD, **extra) -> LoadPlan:
        """swap.load_plan's plan for this load; where the GGUF weights made dense on landing do not
        fit, the plan with them kept packed in their layers."""
        run = self.ringswap_run
        run.packed_only = False
        engine = self.swap_engine
        try:
            plan = plan_load(engine.facts(), run_facts.gather(self, device, full_load, change, **extra), self.ringswap)
        except NotEnoughVRAM as e:
            folder = self.block_folder_on(device)
            if folder is None or not folder.dense_unpatched:
                raise
            run.packed_only = True
            plan = plan_load(engine.facts(), run_facts.gather(self, device, full_load, change, **extra), self.ringswap)
            log.info("RingSwap: GGUF weights made dense on landing do not fit (%s); they stay packed in "
                     "their layers for this load", str(e).splitlines()[0])
        if plan.coding.note and plan.coding.note not in _said:
            _said.add(plan.coding.note)
            log.info(plan.coding.note)
        return plan

    def _device(self, device_to) -> torch.device:
        device = torch.device(device_to) if device_to is not None else self.load_device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def block_folder_on(self, device: torch.device) -> BlockFolder | None:
        """The fold to run on each block as it lands: its LoRA patches, and the GGUF weights made
        dense on landing unless this load keeps them packed (lora/fold.py; None where there is
        neither). Cached per patches_uuid and device, so re-attaching with unchanged patches keeps
        the ring."""
        run = self.ringswap_run
        key = (self.patches_uuid, device, not run.packed_only)
        if run.folder_key != key:
            run.folder = block_folder(self.swap_state, self.patches, comfy_models.lora_patch_dtype(device),
                                      comfy_models.inference_dtype(self.model), dense_on_land=not run.packed_only)
            run.folder_key = key
        return run.folder

    def model_size(self):
        state = self.swap_state
        engine = state.engine
        if engine.plan is not None:
            return state.nonblock_bytes + engine.device_bytes()
        return self._size_before_attach()

    def _size_before_attach(self) -> int:
        """model_size() while the engine is not attached (ComfyUI's full-load test uses it)."""
        state = self.swap_state
        if self.ringswap is None:
            return state.nonblock_bytes + state.engine.total_block_bytes()
        return state.nonblock_bytes + bytes_before_attach(state.engine.facts(), self.ringswap)

    # ----- unloading -------------------------------------------------------------------
    def _owns_engine(self) -> bool:
        return self.swap_engine.owner is self

    def _release_engine(self) -> int:
        """Detach the engine if this patcher attached it (frees ring and resident blocks);
        returns the bytes freed and marks the model partially loaded so the next load
        attaches again. A sibling clone being evicted or garbage-collected leaves the
        engine alone."""
        engine = self.swap_engine
        if sys.is_finalizing() or not self._owns_engine():
            return 0
        freed = engine.device_bytes()
        engine.detach(kept_at_unload(engine.facts(), run_facts.host_ram(engine.device), self.ringswap))
        self._release_folder()
        if self.model.model_loaded_weight_memory > 0:
            self.model.model_loaded_weight_memory = max(0, self.model.model_loaded_weight_memory - freed)
            self.model.model_lowvram = True
        return freed

    def _release_folder(self) -> None:
        folder = self.ringswap_run.folder
        if folder is not None:
            folder.release()

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, *args, **kwargs):
        if key in self.patches and gguf_tensors.hang_patches(self, key, device_to, inplace_update):
            return None
        return super().patch_weight_to_device(key, device_to, inplace_update, *args, **kwargs)

    def unpatch_model(self, device_to=None, unpatch_weights=True, *args, **kwargs):
        if unpatch_weights:
            self.swap_engine.detach()
            self._release_folder()
            gguf_tensors.drop_patches(self.model)
        return super().unpatch_model(device_to, unpatch_weights, *args, **kwargs)

    def is_clone(self, other):
        # ComfyUI's load_models_gpu asks a model it loads again whether it is a clone of
        # itself right before detaching it (unpatch_all=False): that detach keeps the blocks.
        if other is self:
            self.ringswap_run.reloading = True
        return super().is_clone(other)

    def detach(self, unpatch_all=True, *args, **kwargs):
        # Another patcher of the same model may load next: give the blocks back, unless
        # this patcher is the one loading again (see is_clone).
        run = self.ringswap_run
        reloading, run.reloading = run.reloading, False
        if unpatch_all or not reloading:
            self._release_engine()
        return super().detach(unpatch_all, *args, **kwargs)

    def partially_load(self, device_to, extra_memory=0, *args, **kwargs):
        """Keep the blocks of the last run when this run's plan is the same (nothing is
        copied again); otherwise take them back and let ComfyUI load the model through
        `load`. ComfyUI counted the kept blocks as loaded, so `extra_memory` (what more it
        offers) grows by what they free; the planner, not that number, decides the window,
        as it does on every load."""
        self.ringswap_run.reloading = False
        kept = self._plan_to_keep(device_to, extra_memory) if self._owns_engine() else None
        if kept is None:
            out = super().partially_load(device_to, extra_memory + self._release_engine(), *args, **kwargs)
            if self._owns_engine():
                return out
            # ComfyUI returns without `load` where it only unloads (less memory offered than the
            # model holds) or counts the model loaded: the blocks still attach for the run
            used = self.model.model_loaded_weight_memory
            self.load(device_to, lowvram_model_memory=used, force_patch_weights=kwargs.get(
                "force_patch_weights", args[0] if args else False))
            return out + self.model.model_loaded_weight_memory - used
        self.ringswap_run.plan = kept
        out = super().partially_load(device_to, max(0, extra_memory), *args, **kwargs)
        facts = self.swap_engine.facts()
        plan, fresh = kept.window, kept.fresh
        why = ("" if fresh == plan else f" (window {fresh.window} would fit; the copies hide already)"
               if fresh.window > plan.window else f" (it ran this size last time with no more memory than "
               f"now; the planner's numbers give window {fresh.window})")
        log.info("%s; %s memory, %.2f GB at home; kept on the device from the last run%s", kept.line(),
                 facts.memory, facts.homes_held / 1e9, why)
        return out

    def _plan_to_keep(self, device_to, extra_memory: float) -> LoadPlan | None:
        """The plan keeping the attached blocks (same device and weight patches, the model fully
        loaded but for the blocks, and swap.load_plan keeps the attached residency), else None."""
        engine = self.swap_engine
        device = self._device(device_to)
        if engine.device != device or self.model.model_lowvram or \
                self.model.current_weight_patches_uuid != self.patches_uuid:
            return None
        full = self.model.model_loaded_weight_memory + extra_memory > self._size_before_attach()
        try:
            plan = self._plan(device, full, KEEP, ran_here=run_facts.ran_here(self, device, engine.plan))
        except NotEnoughVRAM:   # load() plans again and fails with the message
            return None
        if plan.note:
            log.info(plan.note)
        return plan if plan.keeps else None

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        freed = self._release_engine()
        if memory_to_free > freed:
            freed += super().partially_unload(device_to, memory_to_free - freed, *args, **kwargs)
        return freed

    # ----- sampling runs ---------------------------------------------------------------
    def get_free_memory(self, device):
        """What ComfyUI's calc_cond_batch counts on for the step's conds: the plan decided
        whether they run batched (sampling.free_for_batching)."""
        return sampling.free_for_batching(self, comfy_memory.patcher_free_memory(self, device))

    def cleanup(self, *args, **kwargs):
        engine = self.swap_engine
        stats = engine.end_run()
        run_facts.record_run(self, stats, engine.plan, engine.device)
        feed = live_feed.feed_of(self.swap_engine)
        if stats is not None:
            _publish(stats, self.ringswap_run.plan, self.ringswap_node,
                     feed.finish() if feed is not None else (0.0, 0, 0))
        return super().cleanup(*args, **kwargs)


def _publish(stats, plan, node: str | None, run: tuple[float, int, int]) -> None:
    """Log the run's steps and send its summary to the browser (web/ringswap.js), when a
    server is running. `run`: (seconds since the first model call, steps, live messages sent)."""
    wall_s, steps, live = run
    if steps:
        planned = f" (planned {plan.window.inputs.calls_per_step})" if plan is not None else ""
        log.info("RingSwap steps: %d in %.2f s, %.3f s/step, %.2f model calls a step%s%s", steps, wall_s,
                 wall_s / steps, stats.calls / steps, planned,
                 f"; {live} live block maps sent to the browser" if live else "")
    if comfy_server.prompt_server() is not None:
        comfy_server.send_to_client(RUN_EVENT, run_payload(stats, plan, node, wall_s, steps, live))


def _load_line(plan: LoadPlan, facts, folder: BlockFolder | None, device: torch.device, given_back: int,
               seconds: float, switched: int) -> str:
    """The load's plan line: the plan's (swap.load_plan), then what the attach did."""
    streamed = plan.residency.streamed
    dense = max((folder.dense_bytes(i) for i in range(len(facts.block_sizes))), default=0) if folder else 0
    pairs = folder.pair_bytes(device) if folder else 0
    read, read_s = facts.read_back
    per_call = ", made before each call where resident" if plan.window.inputs.dense_per_call else ""
    return (plan.line(facts.coding_line(plan.coding.why, streamed, plan.window.inputs.calls_per_step))
            + f"; {facts.memory} memory, {facts.homes_held / 1e9:.2f} GB at home"
            + (f"; {given_back / 1e9:.2f} GB of the file's pages given back" if given_back else "")
            + (f"; LoRA pairs: {pairs / 1e9:.2f} GB kept on the device (planned as non-block)" if pairs else "")
            + (f"; GGUF dense weights: {dense / 1e9:.2f} GB a block on the device (planned{per_call})" if dense else "")
            + f"; placed in {seconds:.2f} s" + (f" (read {read / 1e9:.2f} GB from the file in {read_s:.2f} s)" if read else "")
            + (" (switched from another block-swapped model)" if switched else ""))
