"""A real lossless plane coder for the CPU (zlib), so the engine's coded homes run in CI where
nvCOMP's GPU coder cannot; small parts so a toy block has several."""
import zlib

import torch


class ZlibPlanes:
    stream = None
    part_bytes = 1024

    def __init__(self, device=None):
        self.decodes = 0

    def encode(self, high: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(bytearray(zlib.compress(high.numpy().tobytes(), 9)), dtype=torch.uint8)

    def decode(self, coded: torch.Tensor, out: torch.Tensor) -> None:
        self.decodes += 1
        assert coded.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0, "nvCOMP reads and writes 16-byte aligned buffers"
        out.copy_(torch.frombuffer(bytearray(zlib.decompress(coded.numpy().tobytes())), dtype=torch.uint8))


class StoredPlanes(ZlibPlanes):
    """Codes nothing away (level 0 plus zlib's header): a block never shrinks, coding does not pay."""

    def encode(self, high: torch.Tensor) -> torch.Tensor:
        return torch.frombuffer(bytearray(zlib.compress(high.numpy().tobytes(), 0)), dtype=torch.uint8)
