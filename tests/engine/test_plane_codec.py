"""Byte-plane coding (swap/plane_codec.py): the planes split and join bit for bit on any device;
with CUDA and nvCOMP, a block coded and decoded on the GPU is itself bit for bit."""
import pytest
import torch

from ringswap.swap.plane_codec import aligned, decode_block, encode_block, join_planes, nvcomp_module, split_planes


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
    from ringswap.swap.plane_codec import wants_planes
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
    from ringswap.swap.plane_codec import AnsPlanes
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
    from ringswap.swap.plane_codec import PARTS_IN_FLIGHT, AnsPlanes
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
    from ringswap.swap.plane_codec import AnsPlanes
    from toy_blocks import run
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
            engine.attach(dev, ResidencyPlan.make(N, window, prefetch), compress=True)
            for _ in range(2):
                assert torch.equal(run(blocks, x), ref), (window, prefetch)
            engine.end_run()
            engine.detach()
    assert engine.coding.pays and engine.pool.coded


def test_join_words_on_the_cpu_is_torchs_join():
    """Off CUDA the fused re-interleave does not run: join_words joins with torch, bit for bit."""
    from ringswap.swap import join_kernel
    from ringswap.swap.plane_codec import join_words
    flat = torch.randint(0, 256, (4098,), dtype=torch.uint8)
    high, low = split_planes(flat)
    out = torch.empty_like(flat)
    assert not join_kernel.join(high, low, out, join_planes)
    join_words(high, low, out)
    assert torch.equal(out, flat)


@pytest.mark.gpu
def test_fused_join_gives_torchs_bytes_on_cuda():
    """The fused re-interleave on CUDA, at odd lengths and offsets into a slot, equals torch's."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ringswap.swap import join_kernel
    dev = torch.device("cuda", torch.cuda.current_device())
    for n in (1, 4095, 4096, 4097, 3 << 20):
        flat = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, device=dev)
        high, low = split_planes(flat)
        slot = torch.zeros(2 * n + 64, dtype=torch.uint8, device=dev)
        assert join_kernel.join(high, low, slot[32:32 + 2 * n], join_planes), "no Triton on the GPU machine"
        assert torch.equal(slot[32:32 + 2 * n], flat) and not slot[:32].any() and not slot[32 + 2 * n:].any()
