"""The RAM split of home=auto (swap/ram_split.py) as a table of RAM pictures."""
import pytest

from ringswap.swap.residency import ResidencyPlan
from ringswap.swap.ram_split import split_ram

WAN = (704_500_000,) * 40


@pytest.mark.parametrize("window,room_gb,staging,ram,file", [
    (30, 64.0, 4, 11, 0),    # 29 resident + 11 streamed, 7.7 GB: all streamed blocks in RAM
    (30, 7.75, 4, 11, 0),    # just enough
    (30, 5.0, 4, 3, 8),      # 5 GB less 4 staging buffers (2.8 GB): 3 blocks
    (30, 2.0, 4, 0, 11),     # not even the staging: everything from the file
    (8, 32.0, 4, 33, 0),     # 12 GiB card: 33 streamed, 23 GB fit a 32 GB machine's room
    (8, 20.0, 4, 24, 9),
])
def test_streamed_blocks_get_ram_first(window, room_gb, staging, ram, file):
    plan = ResidencyPlan.make(40, window, 1)
    split = split_ram(plan, WAN, int(room_gb * 1e9), "test", staging)
    assert (len(split.ram_blocks), len(split.file_blocks)) == (ram, file)
    assert split.ram_blocks <= set(plan.streamed) and not split.ram_blocks & set(plan.resident)
    assert split.bytes_of(split.ram_blocks) <= max(0, room_gb * 1e9 - split.staging_bytes) or not file
    line = split.line()
    assert f"{len(plan.resident)} blocks" in line and f"{ram} (" in line and "RAM counted on" in line
    assert ("read from the file each step" in line) == bool(file)


def test_file_blocks_are_spread_over_the_call_order():
    plan = ResidencyPlan.make(40, 8, 1)   # 33 streamed
    split = split_ram(plan, WAN, int(20e9), "test", 4)
    order = list(plan.streamed)
    pos = [order.index(b) for b in split.file_blocks]
    gaps = [b - a for a, b in zip(pos, pos[1:])]
    assert min(gaps) >= 3 and max(gaps) <= 4, pos   # 9 of 33: one every 3-4 streamed blocks


def test_unequal_blocks_never_exceed_the_room():
    sizes = tuple([100] * 10 + [300] * 10)
    plan = ResidencyPlan.make(20, 1, 1)
    for room in range(0, 4000, 37):
        split = split_ram(plan, sizes, room, "test", 1)
        assert split.bytes_of(split.ram_blocks) <= max(0, room - split.staging_bytes) or not split.file_blocks, room


def test_the_line_gives_resident_blocks_at_their_device_bytes_and_homes_at_their_ram_bytes():
    """Coded homes are smaller in RAM than on the device: the line's GPU part counts device bytes."""
    plan = ResidencyPlan.make(8, 3, 1)
    split = split_ram(plan, (50,) * 8, 10 ** 9, "test", 1, device_sizes=(10 ** 9,) * 8)
    n, s = len(plan.resident), len(plan.streamed)
    assert n and s and split.line().startswith(f"home auto: {n} blocks ({n}.0 GB) on the GPU, {s} (0.0 GB) in RAM")
