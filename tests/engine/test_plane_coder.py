"""Byte-plane coding (swap/plane_coder.py): the planes split and join bit for bit on any device;
with CUDA and nvCOMP, a block coded and decoded on the GPU is itself bit for bit."""
import pytest
import torch

from ringswap.swap.plane_coder import aligned, decode_block, encode_block, nvcomp_module, split_planes
from ringswap.swap.plane_join import join_planes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_planes_split_and_join_bit_exact(dtype):
    torch.manual_seed(0)
    flat = (torch.randn(4099, dtype=torch.float32) * 0.02).to(dtype).view(torch.uint8)
    high, low = split_planes(flat)
    assert high.numel() == low.numel() == flat.numel() // 2
    if dtype == torch.bfloat16:   # the high byte holds sign and exponent: few values
        assert high.unique().numel() < 32 < low.unique().numel()
    out = torch.empty_like(flat)
    assert torch.equal(join_planes(high, low, out), flat)


def test_odd_bytes_and_missing_package_are_named():
    with pytest.raises(ValueError, match="even number of bytes"):
        split_planes(torch.zeros(3, dtype=torch.uint8))
    try:
        nvcomp_module()
    except ImportError as e:
        assert "nvidia-nvcomp-cu13" in str(e) and "pip install" in str(e)


def _cuda_nvcomp():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        nvcomp_module()
    except ImportError:
        pytest.skip("needs nvCOMP (scripts/prepare_nvcomp_wheels.sh)")
    return torch.device("cuda", torch.cuda.current_device())


def test_blocks_code_in_parts_and_decode_bit_exact_on_the_cpu():
    """encode_block / decode_block with a real (zlib) coder: parts, layout, the bytes back."""
    from zlib_planes import ZlibPlanes
    flat = (torch.randn(5000) * 0.02).bfloat16().view(torch.uint8)
    coder = ZlibPlanes()
    block = encode_block(coder, flat, part_bytes=4096)
    assert [p[1] for p in block.parts] == [4096, 4096, 1808]
    assert block.coded_bytes < 0.8 * flat.numel()
    out = torch.empty_like(flat)
    decode_block(coder, block, torch.empty(block.scratch_bytes(), dtype=torch.uint8), out)
    assert torch.equal(out, flat) and coder.decodes == 3


def test_one_byte_formats_code_whole_bytes():
    """A block mostly of one-byte values (fp8) is coded whole, without planes; still bit exact."""
    from zlib_planes import ZlibPlanes
    from ringswap.swap.plane_coder import wants_planes
    assert wants_planes({2: 600, 4: 400}, 1000) and not wants_planes({1: 900, 4: 100}, 1000)
    assert not wants_planes({2: 1001}, 1001)   # odd bytes cannot be read as words
    flat = (torch.randn(5001) * 20).to(torch.float8_e4m3fn).view(torch.uint8)
    coder = ZlibPlanes()
    block = encode_block(coder, flat, part_bytes=2048, planes=False)
    assert not block.planes and block.scratch_bytes() == aligned(max(p[3] for p in block.parts))
    out = torch.empty_like(flat)
    decode_block(coder, block, torch.empty(block.scratch_bytes(), dtype=torch.uint8), out)
    assert torch.equal(out, flat)


@pytest.mark.gpu
def test_ans_planes_round_trip_on_cuda():
    dev = _cuda_nvcomp()
    from ringswap.swap.plane_coder import AnsPlanes
    flat = (torch.randn(3 << 20, device=dev) * 0.02).bfloat16().view(torch.uint8)
    planes = AnsPlanes(dev)
    block = encode_block(planes, flat, part_bytes=1 << 20)   # 6 parts, two part sizes share configs
    assert block.coded_bytes < 0.8 * flat.numel() and len(block.parts) == 6
    block.home.pin()
    out = torch.zeros_like(flat)
    scratch = torch.empty(block.scratch_bytes(), dtype=torch.uint8, device=dev)
    with torch.cuda.stream(planes.stream):
        decode_block(planes, block, scratch, out)
    planes.stream.synchronize()
    assert torch.equal(out, flat)


@pytest.mark.gpu
@pytest.mark.parametrize("data_type", ["|u1", "<f2"])
def test_pipelined_decode_of_blocks_back_to_back_on_cuda(data_type):
    """The engine's way: copies on a copy stream into a ring of part rooms, up to three parts ahead,
    two blocks one after the other sharing the rooms' events; planes with bytes, or whole parts in
    ANS's 16-bit float mode."""
    dev = _cuda_nvcomp()
    from ringswap.swap.plane_coder import PARTS_IN_FLIGHT, AnsPlanes
    coder = AnsPlanes(dev, data_type=data_type)
    flats = [(torch.randn(3 << 20, device=dev) * 0.02).bfloat16().view(torch.uint8) for _ in range(2)]
    blocks = [encode_block(coder, f, part_bytes=1 << 20, planes=data_type == "|u1") for f in flats]
    assert all(b.coded_bytes < 0.9 * b.nbytes for b in blocks)
    for b in blocks:
        b.home.pin()
    scratch = torch.empty(PARTS_IN_FLIGHT * max(b.scratch_bytes() for b in blocks), dtype=torch.uint8, device=dev)
    outs, freed, copy_stream = [torch.zeros_like(f) for f in flats], [None] * PARTS_IN_FLIGHT, torch.cuda.Stream(dev)
    with torch.cuda.stream(coder.stream):
        for b, out in zip(blocks, outs):
            decode_block(coder, b, scratch, out, copy_stream, None, freed)
    coder.stream.synchronize()
    assert all(torch.equal(o, f) for o, f in zip(outs, flats))


@pytest.mark.gpu
def test_engine_streams_coded_blocks_bit_exact_on_cuda():
    """The engine with nvCOMP-coded homes on CUDA: every window and prefetch bit-exact, pinned."""
    dev = _cuda_nvcomp()
    from ringswap.swap import BlockSwapEngine, ResidencyPlan
    from ringswap.swap.plane_coder import AnsPlanes
    from toy_blocks import load_plan, run
    N = 5
    torch.manual_seed(0)   # blocks of 128 KiB: large enough for the coded form to pay
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 256))
                                 for _ in range(N)).to(torch.bfloat16)
    x = torch.randn(4, 256, dtype=torch.bfloat16, device=dev)
    ref = run(blocks.to(dev), x)
    blocks.cpu()
    engine = BlockSwapEngine(list(blocks))
    engine.coder_factory = AnsPlanes
    for window in (1, 2, 4, N):
        for prefetch in range(0, 3):
            engine.attach(dev, load_plan(ResidencyPlan.make(N, window, prefetch), compress=True))
            for _ in range(2):
                assert torch.equal(run(blocks, x), ref), (window, prefetch)
            engine.end_run()
            engine.detach()
    assert engine.coding.pays and engine.pool.coded


def test_join_words_on_the_cpu_is_torchs_join_plain_and_widened():
    """Off CUDA the fused re-interleave does not run: join_words joins with torch, bit for bit,
    and widened gives the fp16 words of the bf16 ones."""
    from ringswap.swap.plane_join import join_words
    flat = torch.randint(0, 256, (4098,), dtype=torch.uint8)
    high, low = split_planes(flat)
    out = torch.empty_like(flat)
    join_words(high, low, out)
    assert torch.equal(out, flat)
    narrow = (torch.randn(2049) * 0.02).to(torch.bfloat16)
    high, low = split_planes(narrow.view(torch.uint8))
    join_words(high, low, out, widen=True)
    assert torch.equal(out.view(torch.float16), narrow.to(torch.float16))


@pytest.mark.gpu
def test_fused_join_gives_torchs_bytes_on_cuda():
    """The fused re-interleave on CUDA, at odd lengths and offsets into a slot, plain and widened,
    equals torch's (exhaustively for widening: every finite bf16 word)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ringswap.swap import plane_join
    dev = torch.device("cuda", torch.cuda.current_device())
    assert plane_join._usable(dev), "the fused join does not run on the GPU machine"
    every = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    every = every[torch.isfinite(every.float())].to(dev)
    for flat, widen in [(torch.randint(0, 256, (2 * n,), dtype=torch.uint8, device=dev), False)
                        for n in (1, 4095, 4096, 4097, 3 << 20)] + [(every.view(torch.uint8), True)]:
        high, low = split_planes(flat)
        slot = torch.zeros(flat.numel() + 64, dtype=torch.uint8, device=dev)
        want = flat if not widen else flat.view(torch.bfloat16).to(torch.float16).view(torch.uint8)
        for join in (plane_join.join_words, plane_join._torch_join):   # the kernel, and torch's on CUDA
            slot.zero_()
            join(high, low, slot[32:32 + flat.numel()], widen)
            assert torch.equal(slot[32:32 + flat.numel()], want), (join, widen)
            assert not slot[:32].any() and not slot[32 + flat.numel():].any()


def test_fp16_words_from_bf16_are_narrowed_exactly_and_code_smaller():
    """fp16 weights cast from bf16 (ComfyUI computes Wan in fp16 from a bf16 file) are held as
    their bf16 words: smaller coded, given back as the same fp16 bits; specials included."""
    from zlib_planes import ZlibPlanes
    from ringswap.swap.plane_coder import narrow_fp16
    g = torch.Generator().manual_seed(0)
    weights = (torch.randn(6000, generator=g) * 0.02).to(torch.bfloat16)
    weights[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3e-8, -1e-6], dtype=torch.bfloat16)
    flat = weights.to(torch.float16).view(torch.uint8)
    assert narrow_fp16(flat) is not None
    coder = ZlibPlanes()
    wide = encode_block(coder, flat, part_bytes=4096)
    narrow = encode_block(coder, flat, part_bytes=4096, fp16=True)
    assert narrow.narrowed == frozenset(range(len(narrow.parts))) and not wide.narrowed
    assert narrow.coded_bytes < 0.92 * wide.coded_bytes, (narrow.coded_bytes, wide.coded_bytes)
    out = torch.empty_like(flat)
    decode_block(coder, narrow, torch.empty(narrow.scratch_bytes(), dtype=torch.uint8), out)
    assert torch.equal(out, flat)


def test_fp16_parts_that_do_not_survive_bf16_stay_fp16():
    """A part with fp16 words bf16 cannot hold (full mantissas) or with a NaN is coded as it is;
    the others are narrowed; the block comes back bit for bit."""
    from zlib_planes import ZlibPlanes
    from ringswap.swap.plane_coder import narrow_fp16
    g = torch.Generator().manual_seed(1)
    from_bf16 = (torch.randn(2048, generator=g) * 0.02).to(torch.bfloat16).to(torch.float16)
    full = (torch.randn(2048, generator=g) * 0.02).to(torch.float16)
    nan = from_bf16.clone().view(torch.int16)
    nan[5] = 0x7E00   # a NaN (one that would even survive torch's round trip)
    flat = torch.cat([from_bf16, full, nan.view(torch.float16)]).view(torch.uint8)
    assert narrow_fp16(full.view(torch.uint8)) is None and narrow_fp16(nan.view(torch.uint8)) is None
    block = encode_block(ZlibPlanes(), flat, part_bytes=4096, fp16=True)
    assert block.narrowed == frozenset({0}) and len(block.parts) == 3
    out = torch.empty_like(flat)
    decode_block(ZlibPlanes(), block, torch.empty(block.scratch_bytes(), dtype=torch.uint8), out)
    assert torch.equal(out, flat)
