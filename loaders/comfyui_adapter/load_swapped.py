"""Load a diffusion model for block streaming: skeleton from the header, blocks from the file.

Nothing of the blocks is read here for home=disk or auto (auto reads what each plan keeps in
RAM when it attaches); for home=ram every block is read once into its exact-size host buffer. Errors name the file and leave nothing loaded.

The model is built inside `mapped_allocations()`: ComfyUI's `torch.empty` block weights,
dropped for the engine's buffers right away, then cost no RAM and leave nothing in malloc's
heap (from there they would leave RSS a little higher every load), and the other large weights
are given back to the OS with the model.
"""
from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Callable

import comfy.model_management
import comfy.model_patcher
import torch

from ...swap import BlockSwapEngine
from ...swap.file_pages import FilePages
from ...swap.home_policy import home_policy
from ...swap.host_pool import mapped_allocations
from ...swap.load_plan import EngineFacts, pins_ahead
from ..model_file.block_reads import BlockReads
from ..model_file.range_reader import FileChangedError, RangeReader, file_identity
from ..model_file.safetensors_index import SafetensorsIndex
from . import comfy_models, gguf_file, gguf_tensors, run_facts
from .block_lists import ALL_NAMES, find_block_lists
from .skeleton import build_skeleton
from .swap_patcher import SwapModelPatcher, SwapSettings
from .swap_state import SwapState

log = logging.getLogger("ringswap.load_swapped")


def load_swapped_model(path: str, settings: SwapSettings, home: str = "ram", disk_workers: int = 0,
                       progress: Callable[[int, int], None] | None = None) -> SwapModelPatcher:
    """A block-swapping MODEL of the file at `path`."""
    return SwapModelPatcher.wrap(load_swapped_base(path, home, disk_workers, progress, settings=settings), settings)


# Loaded files, by identity, home and model options: changing window/prefetch/pin_memory
# re-runs a node but must not read the file again. Weak values: a model no graph uses is freed.
_LOADED: "weakref.WeakValueDictionary[tuple, comfy.model_patcher.ModelPatcher]" = weakref.WeakValueDictionary()


def cached_swapped_base(path: str, home: str = "ram", disk_workers: int = 0, model_options: dict | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        settings: SwapSettings | None = None) -> comfy.model_patcher.ModelPatcher:
    """load_swapped_base, reusing the model already loaded from the same unchanged file."""
    key = (os.path.realpath(path), *file_identity(path), home, disk_workers,
           repr(sorted((model_options or {}).items())))
    base = _LOADED.get(key)
    if base is None:
        base = load_swapped_base(path, home, disk_workers, progress, model_options, settings)
        _LOADED[key] = base
    return base


def own_model_for(model: comfy.model_patcher.ModelPatcher, progress: Callable[[int, int], None] | None = None,
                  settings: SwapSettings | None = None) -> comfy.model_patcher.ModelPatcher | None:
    """For a MODEL built for ComfyUI's dynamic VRAM (file tensors cast at use, or left
    uncast by its lazy ops): RingSwap's own static load of the same file with the same
    options (home=auto: RAM for the blocks that stream), to clone the MODEL onto; None for a MODEL
    RingSwap can swap as it is. A dynamic MODEL not made from a file by Load Diffusion
    Model is refused with what to use instead."""
    if not comfy_models.built_for_dynamic_vram(model):
        return None
    source = comfy_models.source_file(model)
    if source is None:
        raise ValueError(
            "RingSwap Patch: this MODEL was built for ComfyUI's dynamic VRAM, and not by Load Diffusion Model "
            "from a .safetensors file that RingSwap could read itself; use the RingSwap Model Loader node for "
            "this model, or start ComfyUI with --disable-dynamic-vram")
    path, options = source
    return cached_swapped_base(path, home="auto", model_options=options, progress=progress, settings=settings)


def load_swapped_base(path: str, home: str = "ram", disk_workers: int = 0,
                      progress: Callable[[int, int], None] | None = None,
                      model_options: dict | None = None,
                      settings: SwapSettings | None = None) -> comfy.model_patcher.ModelPatcher:
    """The ModelPatcher of the file (plain, or ComfyUI-GGUF's for a .gguf), with its swap
    engine installed; wrap it with SwapModelPatcher.wrap for each set of swap settings (no re-read).
    `settings`: the node's, whose rule (swap.load_plan.pins_ahead) may page-lock the blocks' file
    pages from the header on, while the model is built (FilePages.lock_ahead)."""
    identity = file_identity(path)   # the file the model is built from is the one read below
    pages = None
    try:
        if gguf_file.is_gguf(path):
            patcher = gguf_file.load_gguf_model(path)
            gguf_tensors.register_for(patcher.model.diffusion_model)

            def make_reads(reader, blocks, keys):
                return gguf_file.block_reads(path, reader, blocks, keys, home, patcher.model.model_config)
        else:
            index = SafetensorsIndex.open(path)
            pages = _pages_ahead(index, home, settings)
            with mapped_allocations():
                skeleton = build_skeleton(index, ALL_NAMES, model_options)
            patcher = comfy.model_patcher.ModelPatcher(skeleton.model, load_device=skeleton.load_device,
                                                       offload_device=skeleton.offload_device)

            def make_reads(reader, blocks, keys):
                if pages is not None:
                    pages.check = reader.check_unchanged
                reads = BlockReads(index, reader, blocks, keys, skeleton.names.file_key, pages)
                reads.keep_ahead()
                return reads
        return _install(patcher, path, identity, make_reads, home, disk_workers, progress)
    except BaseException:
        if pages is not None:   # nothing stays page-locked
            pages.close()
        raise


def _install(patcher: comfy.model_patcher.ModelPatcher, path: str, identity: tuple, make_reads: Callable,
             home: str, disk_workers: int, progress: Callable[[int, int], None] | None) -> comfy.model_patcher.ModelPatcher:
    """The swap engine of `patcher`'s blocks, reading them with `make_reads(reader, blocks, keys)`."""
    dm = patcher.model.diffusion_model
    lists = find_block_lists(dm, path)
    blocks = [b for _, bl in lists for b in bl]
    keys = [f"{name}.{j}." for name, bl in lists for j in range(len(bl))]
    reader = RangeReader(path, workers=disk_workers)
    engine = None
    try:
        if reader.identity != identity:
            raise FileChangedError(f"RingSwap: {path} changed on disk while the model was loaded from it; "
                                   "load it again once it is written")
        reads = make_reads(reader, blocks, keys)
        if reads is None:   # homes copied from the model's own tensors at the first attach
            reader.close()
        else:
            weakref.finalize(dm, reads.close)
        engine = BlockSwapEngine(blocks, read_block=reads.read_block if reads else None, home=home,
                                 disk_workers=reader.workers, map_block=reads.mapped if reads else None)
        SwapState.install(dm, engine)
        t0 = time.perf_counter()
        nbytes = engine.fill_home(progress)   # home=ram with the file to read: every block into RAM now
        if nbytes:
            dt = max(time.perf_counter() - t0, 1e-9)
            log.info("RingSwap: read %.2f GB of %d blocks from %s into RAM in %.1f s (%.2f GB/s)",
                     nbytes / 1e9, len(blocks), path, dt, nbytes / dt / 1e9)
        return patcher
    except BaseException:
        if engine is not None:
            engine.release_home()
        reader.close()
        raise


def _pages_ahead(index: SafetensorsIndex, home: str, settings: SwapSettings | None) -> FilePages | None:
    """The file mapped, its blocks' pages page-locking from now on in file order, where the load
    plan's rule allows it for these settings and this machine's RAM (CUDA, home=auto, raw homes,
    RAM for every block); else None."""
    if settings is None or not torch.cuda.is_available():
        return None
    ranges = block_ranges(index)
    facts = EngineFacts(block_sizes=tuple(b - a for a, b in ranges), policy=home_policy(home), own_load=True)
    if not ranges or not pins_ahead(facts, run_facts.host_ram(comfy.model_management.get_torch_device()), settings):
        return None
    pages = FilePages(index.path)
    pages.lock_ahead(ranges)
    return pages


def block_ranges(index: SafetensorsIndex) -> list[tuple[int, int]]:
    """Each block's bytes in the file, [first tensor's start, last tensor's end), by block list
    (ALL_NAMES order) and index: the ranges a MappedBlock of that block spans (read from the header,
    before the model exists)."""
    return [(min(i.start for i in infos), max(i.end for i in infos))
            for name in ALL_NAMES for prefix in ("", "model.diffusion_model.")
            for infos in index.blocks_by_index(f"{prefix}{name}.").values()]
