"""fp8 codes compared with the slack of requantizing from float32 sums in another order."""
import torch


def assert_fp8_close(got, want, what, same=0.999):
    """fp8 codes requantized from float32 values that differ in the last bits: nearly all
    codes equal, none more than one fp8 step off. Where base and delta nearly cancel, float32
    sums in another order differ by a few float32 ulps of the operands (~fp8_max), which
    e5m2's fine grid near zero can resolve: that much is allowed on top."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    g, w = got.float(), want.float()
    fp8 = torch.finfo(want.dtype)
    step = fp8.eps   # at most the relative step of a normal value
    slack = fp8.smallest_normal * step + 16 * torch.finfo(torch.float32).eps * fp8.max
    off = (g - w).abs() > w.abs() * step + slack
    assert not off.any(), (f"{what}: {int(off.sum())} codes more than one step off, e.g. "
                           f"{list(zip(g[off][:4].tolist(), w[off][:4].tolist()))} (got, want)")
    assert (g == w).float().mean().item() >= same, what
