"""Fold ComfyUI's weight patches (LoRA & co.) into each block as it lands on the device.

ComfyUI keeps every patch of a MODEL in `patcher.patches` (weight key -> list of patch
tuples, from `add_patches`, e.g. by `comfy.sd.load_lora_for_models`). ComfyUI applies the
patches of everything but the transformer blocks itself; for the blocks, `block_folder`
turns the patches into per-block fold work once, and the swap engine runs it on the
device copy of a block right after its bytes land (a ring slot or a resident buffer),
before the block computes. The host home is never written: nothing is written back, and
a strength change or a removed LoRA only needs a new fold plan.
Like ComfyUI's own loader, the fold leaves out patches on buffers and on parameters of
non-leaf modules (Wan's `blocks.N.modulation`): ComfyUI 0.3.75 and later never apply those
either, so results match. Block patches are checked once, when the fold plan is made
(lora/checks.py); the math per weight is in lora/fold_ops.py.
"""
from __future__ import annotations

import logging

import torch

from ..swap.dense_arena import DenseArena, aligned
from ..swap.state import ResidentWork
from .blocks import SwappedBlocks
from .checks import attr_index, attr_shape, check_patches, effective_patches
from .dense_fold import DenseOp, dense_codec
from .fold_ops import FoldOp, PlainOp, make_op

log = logging.getLogger("ringswap.fold")


class BlockFolder:
    """The fold work of every block: `folder(block, tensors)` runs it on a landed block and
    returns the dense weights the block binds instead of packed ones (dense_fold), if any."""

    def __init__(self, ops: dict[int, list[FoldOp]]):
        self.ops = ops
        self._dense = {b: [op for op in v if isinstance(op, DenseOp)] for b, v in ops.items()}
        self._in_place = {b: [op for op in v if not isinstance(op, DenseOp)] for b, v in ops.items()}
        self._with_pairs = frozenset(b for b, v in ops.items() if any(op.pairs for op in v))
        self._folded: set[int] = set()   # blocks folded since the pairs were last released

    def __call__(self, block: int, tensors: list[torch.Tensor], out: DenseArena | None = None
                 ) -> dict[int, torch.Tensor] | None:
        return self._fold(block, self.ops.get(block, ()), tensors, out)

    def warm(self, block: int) -> bool:
        """Does a fold of `block` cost what later ones will? Not its first with LoRA pairs: that
        one moves them to the device and lays them out (swap.state.warm: not timed)."""
        return block in self._folded or block not in self._with_pairs

    def in_place(self, block: int, tensors: list[torch.Tensor]) -> None:
        """The fold work that writes the block's own tensors (once, where it stays resident)."""
        self._run(self._in_place.get(block, ()), tensors)

    def dense(self, block: int, tensors: list[torch.Tensor], out: DenseArena | None = None
              ) -> dict[int, torch.Tensor] | None:
        """The dense weights to bind while the block computes (before each call, where resident)."""
        return self._fold(block, self._dense.get(block, ()), tensors, out)

    def _fold(self, block: int, ops, tensors: list[torch.Tensor], out: DenseArena | None
              ) -> dict[int, torch.Tensor] | None:
        dense = self._run(ops, tensors, out)
        self._folded.add(block)
        return dense

    def resident_work(self) -> ResidentWork:
        """How a resident block is folded: in place once, its dense weights before each call."""
        return ResidentWork(self.dense_blocks, self.in_place, self.dense)

    @staticmethod
    def _run(ops, tensors: list[torch.Tensor], arena: DenseArena | None = None) -> dict[int, torch.Tensor] | None:
        dense = None
        with torch.no_grad():
            for op in ops:
                out = op(tensors, arena) if isinstance(op, DenseOp) else op(tensors)
                if out is not None:
                    dense = dense or {}
                    dense[op.attr] = out
        return dense

    def dense_bytes(self, block: int) -> int:
        """Device bytes a landing of `block` holds beyond its own: its dense weights (as cut from
        a DenseArena, each view aligned)."""
        return sum(aligned(op.nbytes) for op in self._dense.get(block, ()))

    @property
    def dense_unpatched(self) -> bool:
        """Are some weights made dense on landing without patches (optional: they can stay packed)?"""
        return any(not op.patches for ops in self._dense.values() for op in ops)

    @property
    def writes_blocks(self) -> bool:
        """Does any fold write a block's own tensors? (Dense folds only hand back new ones.)"""
        return any(self._in_place.values())

    @property
    def dense_blocks(self) -> frozenset[int]:
        """The blocks whose fold makes dense weights to bind (folded before each call where resident)."""
        return frozenset(b for b, ops in self._dense.items() if ops)

    def workspace_bytes(self, device: torch.device) -> int:
        """Device bytes the largest dense fold needs for its temporaries on `device` (one at a time)."""
        return max((op.workspace_bytes(device) for ops in self._dense.values() for op in ops), default=0)

    def pair_bytes(self, device: torch.device) -> int:
        """Device bytes the LoRA pairs are planned to keep on `device` once folded there."""
        return sum(op.pair_bytes(device) for ops in self.ops.values() for op in ops)

    def kept_bytes(self, device: torch.device) -> int:
        """Device bytes the LoRA pairs keep on `device` now (moved there by their first fold)."""
        return sum(op.kept_bytes(device) for ops in self.ops.values() for op in ops)

    def release(self) -> None:
        """Drop the LoRA pairs kept on the device (when the model leaves it)."""
        for ops in self.ops.values():
            for op in ops:
                op._on_device.clear()
        self._folded.clear()

    def __repr__(self):
        return f"BlockFolder({sum(len(v) for v in self.ops.values())} weights in {len(self.ops)} blocks)"


def _comfyui_patches(block, attr) -> bool:
    """Would ComfyUI's own loader patch this block attribute? It patches only parameters
    of leaf modules (`ModelPatcher._load_list` skips modules with parameters of their own
    and in children, e.g. Wan's `blocks.N.modulation`, and never patches buffers); the
    fold does the same so results equal ComfyUI's."""
    if not attr.is_param:
        return False
    module = block.get_submodule(attr.path) if attr.path else block
    own = set(module._parameters)
    return all(name in own for name, _ in module.named_parameters())


def _add_dense_on_land(blocks: SwappedBlocks, ops: dict[int, list[FoldOp]], compute_dtype: torch.dtype) -> None:
    """Unpatched packed weights whose codec makes them dense on landing (GGUF types whose
    dequantize blocks the stream in a forward: GgmlCodec.dense_on_land) get a DenseOp without
    patches: dequantized once per landing on the land stream, off the compute stream."""
    wanted: dict[int, list[int]] = {}   # a layout (blocks share them) -> its attributes made dense
    for b in range(blocks.block_count):
        module, layout = blocks.block(b)
        if id(layout) not in wanted:
            wanted[id(layout)] = [i for i, a in enumerate(layout.attrs) if (c := dense_codec(a)) is not None
                                  and hasattr(c, "dense_on_land") and c.dense_on_land(a.spec)]
        done = {op.attr for op in ops.get(b, ()) if isinstance(op, DenseOp)}
        for i in wanted[id(layout)]:
            if i in done:
                continue
            attr = layout.attrs[i]
            ops.setdefault(b, []).append(DenseOp(f"block {b}: {attr.path}.{attr.name}", (), i, layout,
                                                 module.get_submodule(attr.path), compute_dtype,
                                                 attr_shape(layout, attr)))


def block_folder(blocks: SwappedBlocks, patches_by_key: dict,
                 patch_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32,
                 dense_on_land: bool = True) -> BlockFolder | None:
    """The per-landing fold of the block patches among `patches_by_key` (a patcher's
    `patches`) and of the packed weights made dense on landing without patches, or None if
    there is neither. `patch_dtype`: what ComfyUI patches
    plain weights in on the fold's device (float32, or 0.33's `lora_compute_dtype`);
    `compute_dtype`: what the model's layers compute in (the dtype of a dense fold);
    `dense_on_land` False: unpatched weights stay packed. Raises ValueError for a patch that
    cannot apply (e.g. a shape mismatch)."""
    ops: dict[int, list[FoldOp]] = {}
    index_cache: dict[int, dict[str, int]] = {}
    left_out: list[str] = []
    for key, plist in patches_by_key.items():
        hit = blocks.block_of(key)
        if hit is None:
            continue
        patches = effective_patches(plist)
        if not patches:
            continue
        b, sub = hit
        module, layout = blocks.block(b)
        names = index_cache.get(id(layout))
        if names is None:
            names = index_cache[id(layout)] = attr_index(layout)
        i = names.get(sub)
        if i is None:
            raise ValueError(f"RingSwap LoRA: '{key}' is patched but block {b} has no tensor '{sub}'")
        attr = layout.attrs[i]
        if not _comfyui_patches(module, attr):
            left_out.append(key)
            continue
        if all(p[3] is None for p in patches):
            check_patches(key, patches, attr_shape(layout, attr))
        codec = dense_codec(attr)
        if codec is not None and codec.quantized(attr.spec):   # GGUF: dequantized and patched once per landing
            op = DenseOp(key, patches, i, layout, module.get_submodule(attr.path), compute_dtype,
                         attr_shape(layout, attr))
        elif codec is not None:   # GGUF's F32/F16 tensors: patched in place in float32, as the pack does
            op = PlainOp(key, patches, attr.entries[0], torch.float32)
        else:
            op = make_op(key, patches, layout, attr, names, patch_dtype)
        ops.setdefault(b, []).append(op)
    if left_out:
        log.info("RingSwap LoRA: %d patched block tensors are left out, as ComfyUI's own loader leaves them "
                 "out (parameters of non-leaf modules, buffers), e.g. %s", len(left_out), left_out[0])
    if dense_on_land:
        _add_dense_on_land(blocks, ops, compute_dtype)
    if not ops:
        return None
    folder = BlockFolder(ops)
    log.debug("RingSwap LoRA: %r", folder)
    return folder
