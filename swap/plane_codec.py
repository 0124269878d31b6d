"""Lossless byte-plane coding of a block's bytes for the link (issue "Fewer bytes, same bits").

A bf16/fp16 weight's high byte (sign and exponent) is highly predictable in trained and
N(0, s)-initialised weights, its low byte (mantissa) is not. A block's flat bytes are read as
little-endian 16-bit words and split into the plane of high bytes and the plane of low bytes;
the high plane is entropy-coded with nvCOMP's ANS on the GPU, the low plane travels raw. Both
split and join are plain torch ops (bit-exact on any device); only the ANS coder needs CUDA and
the optional `nvidia-nvcomp-cu12`/`-cu13` package. Written here because no library splits
float planes for a GPU entropy coder; nvCOMP does the coding.

Not used by the engine yet: bench/plane_probe.py measures ratio and speed with it first.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NVCOMP_PACKAGES = "nvidia-nvcomp-cu13 (torch built for CUDA 13) or nvidia-nvcomp-cu12 (CUDA 12)"


def split_planes(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high bytes, low bytes) of `flat` (uint8, even length) read as little-endian 16-bit words;
    each plane contiguous, half the length."""
    if flat.dtype != torch.uint8 or flat.numel() % 2:
        raise ValueError(f"split_planes needs an even number of bytes (uint8), got {flat.numel()} {flat.dtype}")
    words = flat.view(-1, 2)
    return words[:, 1].contiguous(), words[:, 0].contiguous()


def join_planes(high: torch.Tensor, low: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Write the words of `high` and `low` back into `out` (uint8, twice their length): the
    inverse of split_planes, bit for bit."""
    words = out.view(-1, 2)
    words[:, 1].copy_(high)
    words[:, 0].copy_(low)
    return out


def nvcomp_module():
    """nvidia.nvcomp, or ImportError naming the package to install."""
    try:
        from nvidia import nvcomp
    except ImportError as e:
        raise ImportError(f"RingSwap compress: nvCOMP's Python package is not installed; install {NVCOMP_PACKAGES} "
                          "(pip install nvidia-nvcomp-cu13; wheels exist for Linux and Windows)") from e
    return nvcomp


@dataclass
class CodedBlock:
    """A block's bytes as they wait in RAM and cross the link: the coded high plane and the
    raw low plane (host tensors), and the decoded size."""
    high: torch.Tensor
    low: torch.Tensor
    nbytes: int

    @property
    def coded_bytes(self) -> int:
        return self.high.numel() + self.low.numel()


class AnsPlanes:
    """Codes blocks' high planes with nvCOMP's ANS on one CUDA stream."""

    def __init__(self, device: torch.device, stream: "torch.cuda.Stream | None" = None):
        self.nvcomp = nvcomp_module()
        self.device = torch.device(device)
        self.stream = stream or torch.cuda.Stream(self.device)
        self.codec = self.nvcomp.Codec(algorithm="ANS", device_id=self.device.index or 0,
                                       cuda_stream=self.stream.cuda_stream, data_type="|u1")

    def encode(self, flat: torch.Tensor) -> CodedBlock:
        """Code a block's bytes (a CUDA uint8 tensor) into host tensors."""
        high, low = split_planes(flat)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            coded = self.codec.encode(self.nvcomp.as_array(high, cuda_stream=self.stream.cuda_stream))
            coded_t = torch.as_tensor(coded, device=self.device).view(torch.uint8).reshape(-1).clone()
        self.stream.synchronize()
        return CodedBlock(coded_t.cpu(), low.cpu(), flat.numel())

    def decode(self, coded_high: torch.Tensor, low: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Decode a block landed on the device (its coded high plane and raw low plane, CUDA
        tensors) into `out` (CUDA uint8, the block's size), on this coder's stream."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            high = torch.empty(out.numel() // 2, dtype=torch.uint8, device=self.device)
            self.codec.decode(self.nvcomp.as_array(coded_high, cuda_stream=self.stream.cuda_stream), out=high)
            join_planes(high, low, out)
        return out
