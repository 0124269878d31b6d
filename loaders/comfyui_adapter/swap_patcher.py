"""SwapModelPatcher: a ComfyUI ModelPatcher whose transformer blocks stream.

ComfyUI's loader keeps managing everything but the blocks: `_load_list` leaves the
block modules out, so ComfyUI never moves or patches their weights; `load` attaches
the swap engine (resident blocks + GPU slot ring) and reports its true VRAM to
ComfyUI's memory accounting; unloading, or another patcher of the model loading, frees
the ring, while loading the same patcher again (every sampling run) keeps its blocks. The
engine lives on the diffusion model (shared by all clones), the settings on each patcher.
"""
from __future__ import annotations

import logging
import sys
import time
import uuid
import weakref
from dataclasses import dataclass

import torch

import comfy.model_management
import comfy.model_patcher

from ...lora.fold import BlockFolder, block_folder
from ...swap import PIN_MODES, BlockSwapEngine, ResidencyPlan
from ...swap.host_pool import set_pin_budget
from ...swap.page_out import mapped_tensors, page_out_moved
from ...swap.window_plan import NotEnoughVRAM, keep_attached
from . import comfy_memory, comfy_models, comfy_server
from . import compress_choice, gguf_tensors, live_feed, ram_room, run_plan
from .live_payload import RUN_EVENT, run_payload
from .run_state import RunState
from .swap_state import SwapState

log = logging.getLogger("ringswap.patcher")

if comfy_memory.ComfyPinBudget.available():   # RingSwap's pins count in ComfyUI's pin budget
    set_pin_budget(comfy_memory.ComfyPinBudget())


@dataclass(frozen=True)
class SwapSettings:
    window: int          # blocks kept on the device; 0 = planned for each run (swap.window_plan)
    prefetch: int = 1
    pin_memory: str = "auto"
    vram_budget_gb: float = 0.0   # VRAM this model may use in all (weights + activations); 0 = what is free
    ram_budget_gb: float = 0.0    # home=auto: host RAM for block homes; 0 = what is available (loaders/comfyui_adapter/ram_room.py)
    compress: str = "auto"        # streamed RAM homes kept coded (loaders/comfyui_adapter/compress_choice.py)

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
        if self.compress not in compress_choice.COMPRESS_MODES:
            raise ValueError(f"RingSwap: compress must be one of {compress_choice.COMPRESS_MODES}, got {self.compress!r}")


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
        run_plan.install(n)
        # Our own weight state: ComfyUI then fully unloads whatever another patcher of
        # the same model left on the GPU before loading this one (partially_load).
        n.patches_uuid = uuid.uuid4()
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
                  and lm.model.swap_engine.att is not None]
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
        plan = run_plan.plan_for_load(self, device, full_load)
        run.plan = plan
        split = ram_room.split_for(engine, plan.residency, self.ringswap.ram_budget_gb)
        ram_blocks = split.ram_blocks if split is not None else None
        compress, why = self._compress_for(plan, device, split)
        may_code = compress_choice.may_code(self.ringswap.compress, device, engine.read_block is not None)
        if may_code:
            engine.coder_factory = compress_choice.coder_factory
        folder = self.block_folder_on(device)
        engine.attach(device, plan.residency, self.ringswap.pin_memory,
                      owner=weakref.ref(self), on_land=folder, ram_blocks=ram_blocks,
                      progress=live_feed.progress_bar(), compress=compress, may_code=may_code,
                      resident_work=folder.resident_work() if folder is not None and plan.inputs.dense_per_call
                      else None)
        if compress and split is not None and split.file_blocks:   # coded homes left room for more
            split = ram_room.split_for(engine, plan.residency, self.ringswap.ram_budget_gb)
            if len(split.ram_blocks) > len(ram_blocks):
                engine.reattach(plan.residency, split.ram_blocks, after_oom=False)
        live_feed.observe(engine, self.ringswap_node)
        mapped = mapped_tensors(self.model)   # non-block weights still views of the file's map (.gguf)
        # GGUF: the pack's layers never read lowvram weight functions, so its patches are always
        # hung on the weights (GGUFModelPatcher.load forces this too)
        force_patch_weights = force_patch_weights or gguf_tensors.holds_ggml(self.model)
        try:
            super().load(device_to, lowvram_model_memory, force_patch_weights, full_load, *args, **kwargs)
        except BaseException:
            engine.detach()
            raise
        given_back = page_out_moved(mapped)
        if not self.model.model_lowvram:
            self.model.model_loaded_weight_memory = self.model_size()
        else:
            self.model.model_loaded_weight_memory += engine.device_bytes()
        read, read_s = engine.read_back
        dense = max((folder.dense_bytes(i) for i in range(engine.num_blocks)), default=0) if folder else 0
        pairs = folder.pair_bytes(device) if folder else 0
        coding = compress_choice.line(engine, why, plan.residency.streamed, plan.inputs.calls_per_step)
        log.info("%s; %s memory, %.2f GB at home%s%s%s%s%s; placed in %.2f s%s%s", plan.line(), engine.memory,
                 engine.pool.nbytes / 1e9, f"; {split.line()}" if split is not None else "",
                 f"; {given_back / 1e9:.2f} GB of the file's pages given back" if given_back else "",
                 f"; {coding}" if coding else "",
                 f"; LoRA pairs: {pairs / 1e9:.2f} GB kept on the device (planned as non-block)" if pairs else "",
                 f"; GGUF dense weights: {dense / 1e9:.2f} GB a block on the device (planned"
                 f"{', made before each call where resident' if plan.inputs.dense_per_call else ''})"
                 if dense else "", time.perf_counter() - t0,
                 f" (read {read / 1e9:.2f} GB from the file in {read_s:.2f} s)" if read else "",
                 " (switched from another block-swapped model)" if switched else "")

    def _compress_for(self, plan, device: torch.device, split) -> tuple[bool, str]:
        """compress_choice.choose for `plan` on `device` with RAM split `split`: (code the streamed
        RAM homes?, why)."""
        engine = self.swap_engine
        ram_blocks = split.ram_blocks if split is not None else None
        return compress_choice.choose(self.ringswap.compress, device, plan, split,
                                      bool(engine.ram_homes(plan.residency, ram_blocks) & set(plan.residency.streamed)),
                                      own_load=engine.read_block is not None, coding=engine.coding,
                                      whole_short=ram_room.short_of_whole(engine, self.ringswap.ram_budget_gb))

    def _codes_now(self, plan, device: torch.device) -> bool:
        """Whether a load of `plan` would code the streamed homes the attachment holds raw (auto: the
        last run's rates make it copy-bound enough); the blocks are then placed again through `load`.
        Coded homes stay coded, so only this direction places again."""
        engine = self.swap_engine
        if engine.att.compress or (engine.coding is not None and engine.coding.pays is False):
            return False
        code, why = self._compress_for(plan, device, ram_room.split_for(engine, plan.residency,
                                                                         self.ringswap.ram_budget_gb))
        if code:
            log.info("RingSwap %s: placing the blocks again to code their homes", why)
        return code

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
        engine = state.engine
        if self.ringswap is not None and self.ringswap.window > 0:   # plan known before loading
            plan = ResidencyPlan.make(engine.num_blocks, min(self.ringswap.window, engine.num_blocks),
                                      self.ringswap.prefetch)
            return state.nonblock_bytes + engine.device_bytes(plan)
        return state.nonblock_bytes + engine.total_block_bytes()

    # ----- unloading -------------------------------------------------------------------
    def _owns_engine(self) -> bool:
        att = self.swap_engine.att
        return att is not None and att.owner() is self

    def _release_engine(self) -> int:
        """Detach the engine if this patcher attached it (frees ring and resident blocks);
        returns the bytes freed and marks the model partially loaded so the next load
        attaches again. A sibling clone being evicted or garbage-collected leaves the
        engine alone."""
        engine = self.swap_engine
        if sys.is_finalizing() or not self._owns_engine():
            return 0
        freed = engine.device_bytes()
        engine.detach(ram_room.capture_room(engine, self.ringswap.ram_budget_gb))
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
        plans = self._plans_to_keep(device_to, extra_memory) if self._owns_engine() else None
        if plans is None:
            out = super().partially_load(device_to, extra_memory + self._release_engine(), *args, **kwargs)
            if self._owns_engine():
                return out
            # ComfyUI returns without `load` where it only unloads (less memory offered than the
            # model holds) or counts the model loaded: the blocks still attach for the run
            used = self.model.model_loaded_weight_memory
            self.load(device_to, lowvram_model_memory=used, force_patch_weights=kwargs.get(
                "force_patch_weights", args[0] if args else False))
            return out + self.model.model_loaded_weight_memory - used
        plan, fresh = plans
        self.ringswap_run.plan = plan
        out = super().partially_load(device_to, max(0, extra_memory), *args, **kwargs)
        engine = self.swap_engine
        why = ("" if fresh is plan else f" (window {fresh.window} would fit; the copies hide already)"
               if fresh.window > plan.window else f" (it ran this size last time with no more memory than "
               f"now; the planner's numbers give window {fresh.window})")
        log.info("%s; %s memory, %.2f GB at home; kept on the device from the last run%s", plan.line(),
                 engine.memory, engine.pool.nbytes / 1e9, why)
        return out

    def _plans_to_keep(self, device_to, extra_memory: float):
        """(the plan to run with, this run's own plan) when the attached blocks can stay (same
        device and weight patches, the model fully loaded but for the blocks, and the planner
        keeps the attached residency: swap.window_plan.keep_attached), else None."""
        att = self.swap_engine.att
        device = self._device(device_to)
        if att.device != device or self.model.model_lowvram or \
                self.model.current_weight_patches_uuid != self.patches_uuid:
            return None
        full = self.model.model_loaded_weight_memory + extra_memory > self._size_before_attach()
        try:
            fresh = run_plan.plan_for_load(self, device, full)
        except NotEnoughVRAM:   # load() plans again and fails with the message
            return None
        kept = keep_attached(fresh, att.plan, run_plan.ran_here(self, device, att.plan, fresh.inputs.conds_per_call))
        if kept is None or self._codes_now(fresh, device):
            return None
        return kept, fresh

    def partially_unload(self, device_to, memory_to_free=0, *args, **kwargs):
        freed = self._release_engine()
        if memory_to_free > freed:
            freed += super().partially_unload(device_to, memory_to_free - freed, *args, **kwargs)
        return freed

    # ----- sampling runs ---------------------------------------------------------------
    def get_free_memory(self, device):
        """What ComfyUI's calc_cond_batch counts on for the step's conds: the plan decided
        whether they run batched (run_plan.free_for_batching)."""
        return run_plan.free_for_batching(self, comfy_memory.patcher_free_memory(self, device))

    def cleanup(self, *args, **kwargs):
        stats = self.swap_engine.end_run()
        run_plan.record_run(self, stats)
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
        planned = f" (planned {plan.inputs.calls_per_step})" if plan is not None else ""
        log.info("RingSwap steps: %d in %.2f s, %.3f s/step, %.2f model calls a step%s%s", steps, wall_s,
                 wall_s / steps, stats.calls / steps, planned,
                 f"; {live} live block maps sent to the browser" if live else "")
    if comfy_server.prompt_server() is not None:
        comfy_server.send_to_client(RUN_EVENT, run_payload(stats, plan, node, wall_s, steps, live))
