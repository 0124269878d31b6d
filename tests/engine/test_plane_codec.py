"""Byte-plane coding (swap/plane_codec.py): the planes split and join bit for bit on any device;
with CUDA and nvCOMP, a block coded and decoded on the GPU is itself bit for bit."""
import pytest
import torch

from ringswap.swap.plane_codec import join_planes, nvcomp_module, split_planes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_planes_split_and_join_bit_exact(dtype):
    flat = (torch.randn(4099, dtype=torch.float32) * 0.02).to(dtype).view(torch.uint8)
    high, low = split_planes(flat)
    assert high.numel() == low.numel() == flat.numel() // 2
    if dtype == torch.bfloat16:   # the high byte holds sign and exponent: few values
        assert high.unique().numel() < 16 < low.unique().numel()
    out = torch.empty_like(flat)
    assert torch.equal(join_planes(high, low, out), flat)


def test_odd_bytes_and_missing_package_are_named():
    with pytest.raises(ValueError, match="even number of bytes"):
        split_planes(torch.zeros(3, dtype=torch.uint8))
    try:
        nvcomp_module()
    except ImportError as e:
        assert "nvidia-nvcomp-cu13" in str(e) and "pip install" in str(e)


@pytest.mark.gpu
def test_ans_planes_round_trip_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        nvcomp_module()
    except ImportError:
        pytest.skip("needs nvCOMP (scripts/prepare_nvcomp_wheels.sh)")
    from ringswap.swap.plane_codec import AnsPlanes
    dev = torch.device("cuda", torch.cuda.current_device())
    flat = (torch.randn(3 << 20, device=dev) * 0.02).bfloat16().view(torch.uint8)
    planes = AnsPlanes(dev)
    coded = planes.encode(flat)
    assert coded.coded_bytes < 0.8 * flat.numel()
    out = torch.empty_like(flat)
    planes.decode(coded.high.to(dev), coded.low.to(dev), out)
    planes.stream.synchronize()
    assert torch.equal(out, flat)
