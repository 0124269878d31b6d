"""How fast RingSwap's BlockReader reads a model's blocks from the disk, against O_DIRECT.

Reads the first --gb of the bench's Wan-14B file block by block (the ranges an attach
reads) with BlockReader at several worker counts, the page cache dropped before each; and
the disk's own O_DIRECT rate (bench/io_rates.py) at 1 and 4 readers.

    python3 bench/probes/read_probe.py --gb 6 --workers 1 2 4 8 [--format bf16] [--json out.json]
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/: common and its support
import common  # noqa: E402
from io_rates import drop_page_cache, odirect_rate  # noqa: E402
from model_file import wan14b_file  # noqa: E402


def block_ranges(path: str, limit: int) -> list[list[tuple[int, int, int]]]:
    """Per block, the (file offset, length, dest offset) ranges of its tensors, blocks in
    order until `limit` bytes."""
    from ringswap.loaders.model_file.safetensors_index import SafetensorsIndex
    idx = SafetensorsIndex.open(path)
    out, total = [], 0
    for _, tensors in sorted(idx.blocks_by_index().items()):
        ranges, pos = [], 0
        for t in tensors:
            ranges.append((t.start, t.nbytes, pos))
            pos += t.nbytes
        out.append(ranges)
        total += pos
        if total >= limit:
            break
    return out


def reader_rate(path: str, blocks: list, workers: int, pinned: bool) -> dict:
    """Blocks read one after another, two in flight (as an attach's read-ahead does)."""
    from ringswap.loaders.model_file.range_reader import RangeReader
    size = max(sum(n for _, n, _ in r) for r in blocks)
    bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]
    drop = drop_page_cache(path, "auto")
    with RangeReader(path, workers=workers) as r:
        t0 = time.perf_counter()
        pending = []
        for i, ranges in enumerate(blocks):
            if len(pending) == 2:
                pending.pop(0).result()
            pending.append(r.read_into(bufs[i % 2], ranges))
        for f in pending:
            f.result()
        dt = time.perf_counter() - t0
        return {"workers": workers, "bytes": r.bytes_read, "seconds": dt,
                "gbps": r.bytes_read / dt / 1e9, "cache": drop}


def main() -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--format", default="bf16", choices=["bf16", "scaled_fp8"])
    ap.add_argument("--gb", type=float, default=6.0, help="GB read per setting")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    a = ap.parse_args()
    if a.device == "cpu":   # ComfyUI's model template (wan_template) asks for a device
        from comfy.cli_args import args
        args.cpu = True
    path = wan14b_file(a.dir, a.format, a.small, a.device, layers_small=4)
    blocks = block_ranges(path, int(a.gb * 1e9))
    pinned = torch.cuda.is_available()
    rows = [odirect_rate(path, int(a.gb * 1e9), True, "auto", t) for t in (1, 4)]
    for r in rows:
        common.say(f"[read_probe] disk {r['mode']}: {r['gbps']:.2f} GB/s")
    for w in a.workers:
        row = reader_rate(path, blocks, w, pinned)
        rows.append(row)
        common.say(f"[read_probe] BlockReader {w} workers: "
                   f"{row['gbps']:.2f} GB/s ({row['bytes'] / 1e9:.1f} GB in {row['seconds']:.1f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"path": path, "pinned": pinned, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
