"""Where each tensor of a block lives inside one flat byte buffer.

A block's parameters and buffers are packed into one contiguous uint8 buffer (each
tensor 512-byte aligned, the CUDA allocator's alignment, so kernels see the same
alignment as for normally allocated weights). One flat buffer per block means one copy
per block on the wire. A quantized weight (a tensor subclass holding packed data and
scales) travels in its compact form: a registered `TensorCodec` splits it into its
plain inner tensors and builds it again around the landed bytes. Blocks with the same
structure share one `BlockLayout`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

ALIGN = 512


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class TensorCodec(Protocol):
    fresh_join: bool
    """True: the packed tensor may hold converted copies of its parts (made when joined or
    used), so it is joined afresh at every bind; False: one joined tensor per ring slot
    serves every block that lands there (its parts are views of the slot)."""

    def split(self, t: torch.Tensor, name: str) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
        """(spec, [(file attribute name, inner plain tensor), ...]) of the packed tensor
        held by module attribute `name` (e.g. [("weight", data), ("weight_scale", s)])."""

    def join(self, spec: Any, parts: list[torch.Tensor]) -> torch.Tensor:
        """The packed tensor around `parts` (same order as split)."""

    # Optional, for packed tensors a layer computes from in a dense form (a LoRA fold then
    # binds that form instead, lora/dense_fold.py): `quantized(spec) -> bool`,
    # `dequantize(spec, parts, dtype, dequant_dtype) -> Tensor` and `type_name(spec) -> str`
    # (e.g. "Q8_0": the forms a fused kernel folds).


_CODECS: dict[type, TensorCodec] = {}


def register_codec(cls: type, codec: TensorCodec) -> None:
    _CODECS[cls] = codec


def codec_for(t: torch.Tensor) -> TensorCodec | None:
    return next((_CODECS[c] for c in type(t).__mro__ if c in _CODECS), None)


@dataclass(frozen=True)
class TensorEntry:
    path: str          # submodule path inside the block ("" for the block itself)
    key: str           # attribute name in the file (e.g. "weight", "weight_scale")
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True)
class AttrEntry:
    """One module attribute: a plain tensor (one entry) or a packed one (several)."""
    path: str
    name: str
    is_param: bool
    entries: tuple[int, ...]                    # indices into BlockLayout.entries
    codec: Any = None
    spec: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class BlockLayout:
    entries: tuple[TensorEntry, ...]
    attrs: tuple[AttrEntry, ...]
    nbytes: int

    @classmethod
    def of(cls, block: nn.Module) -> "BlockLayout":
        entries, attrs, offset = [], [], 0
        for path, module in block.named_modules():
            tensors = [(n, t, True) for n, t in module._parameters.items() if t is not None]
            tensors += [(n, t, False) for n, t in module._buffers.items() if t is not None]
            for name, t, is_param in tensors:
                codec = codec_for(t)
                spec, parts = codec.split(t, name) if codec else (None, [(name, t)])
                first = len(entries)
                for key, part in parts:
                    nbytes = part.numel() * part.element_size()
                    entries.append(TensorEntry(path, key, tuple(part.shape), part.dtype, offset, nbytes))
                    offset += _align(nbytes)
                attrs.append(AttrEntry(path, name, is_param, tuple(range(first, len(entries))), codec, spec))
        return cls(tuple(entries), tuple(attrs), offset)

    @functools.cached_property
    def rejoins(self) -> bool:
        """Whether a packed tensor of this layout is joined afresh at every bind (`fresh_join`)."""
        return any(a.codec is not None and a.codec.fresh_join for a in self.attrs)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Typed tensor views of `flat` (uint8), one per entry."""
        return [flat[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries]

    def pack(self, tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
        """Copy `tensors` (one per entry, any device) into `flat` at this layout's offsets."""
        for view, t in zip(self.views(flat), tensors):
            view.copy_(t)

    def joined(self, tensors: list[torch.Tensor], before: list | None = None) -> list:
        """What the block's modules hold for `tensors` (one per entry), per attribute: the
        entry's tensor, or the packed tensor joined from its entries (an nn.Parameter for a
        parameter). `before`: what an earlier call returned for the same `tensors`; its
        packed tensors are kept where their codec allows (not `fresh_join`)."""
        out = []
        for k, a in enumerate(self.attrs):
            if a.codec is None:
                out.append(tensors[a.entries[0]])
                continue
            if before is not None and not a.codec.fresh_join:
                out.append(before[k])
                continue
            t = a.codec.join(a.spec, [tensors[i] for i in a.entries])
            out.append(nn.Parameter(t, requires_grad=False) if a.is_param else t)
        return out

    def placeholders(self, device: torch.device) -> list[torch.Tensor]:
        """Empty tensors of the right rank and dtype, standing in for unloaded weights."""
        return [torch.empty((0,) * max(1, len(e.shape)), dtype=e.dtype, device=device) for e in self.entries]


class BlockBinding:
    """The module attributes of one block that a layout's entries refer to."""

    def __init__(self, block: nn.Module, layout: BlockLayout):
        modules = dict(block.named_modules())
        self.layout = layout
        self.targets = [(modules[a.path], a) for a in layout.attrs]

    def current(self) -> list[torch.Tensor]:
        """The block's tensors, one per layout entry (packed ones split)."""
        out = []
        for module, a in self.targets:
            t = (module._parameters if a.is_param else module._buffers)[a.name]
            out += [p for _, p in a.codec.split(t, a.name)[1]] if a.codec else [t.data]
        return out

    def bind(self, tensors: list[torch.Tensor]) -> None:
        """Point the block's parameters and buffers at `tensors` (no copy)."""
        self.bind_joined(self.layout.joined(tensors))

    def bindable(self, values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """`values` (attr index -> tensor, e.g. a packed weight's dense form made when the block
        landed) as `bind_some` sets them: parameters wrapped once."""
        return {k: nn.Parameter(v, requires_grad=False) if self.targets[k][1].is_param else v
                for k, v in values.items()}

    def bind_some(self, values: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Point the attributes at these indices (into `layout.attrs`) at other tensors (from
        `bindable`); returns what they held before (to bind back)."""
        before = {}
        for k, v in values.items():
            module, a = self.targets[k]
            held = module._parameters if a.is_param else module._buffers
            before[k], held[a.name] = held[a.name], v
        return before

    def bind_joined(self, values: list) -> None:
        """Point the block's parameters and buffers at `values` from `layout.joined`."""
        for (module, a), v in zip(self.targets, values):
            if a.codec is None and a.is_param:
                module._parameters[a.name].data = v
            elif a.is_param:
                module._parameters[a.name] = v
            else:
                module._buffers[a.name] = v
