"""lora/kernels.py on CUDA: the fused folds against the same math done op by op in float32
(TF32 off), on fresh random data, odd shapes, several pairs, every LoRA dtype and fp8 type."""
import sys

import gguf
import pytest
import torch

from conftest import COMFY
from ringswap.lora import gguf_kernels, kernels
from ringswap.lora.fold_ops import MIN_SCALE, NVFP4_MAX, KitchenOp, ScaledFp8Op, kitchen_from_float
from support.fp8_close import assert_fp8_close
from support.gguf_files import HALF_FIELDS, comfyui_gguf_pack

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def make_pairs(m, n, ranks, dtype, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return [((torch.randn(m, r, device=DEV, generator=g) * 0.05).to(dtype),
             (torch.randn(r, n, device=DEV, generator=g) * 0.05).to(dtype), 0.7 + 0.1 * k)
            for k, r in enumerate(ranks)]


def reference_add(w, pairs):
    out = w.clone()
    for up, down, scale in pairs:
        out.addmm_(up.float(), down.float(), alpha=scale)
    return out


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


CASES = [((384, 640), (64,), torch.bfloat16), ((300, 200), (16, 8), torch.bfloat16),
         ((256, 1000), (64,), torch.float16), ((129, 257), (4,), torch.float32),
         ((5120, 5120), (64,), torch.bfloat16)]


@pytest.mark.parametrize("shape,ranks,ldtype", CASES)
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fold_fp8_equals_op_by_op(shape, ranks, ldtype, qdtype):
    m, n = shape
    for seed in range(2):
        g = torch.Generator(device=DEV).manual_seed(100 + seed)
        w0 = torch.randn(m, n, device=DEV, generator=g) * 0.03
        fmax = torch.finfo(qdtype).max
        s = (w0.abs().amax() / fmax).reshape(())
        q = (w0 / s).to(qdtype)
        pairs = make_pairs(m, n, ranks, ldtype, seed)
        want = reference_add(q.float() * s, pairs)
        want_s = (want.abs().amax() / fmax).clamp_min(MIN_SCALE)
        want_q = (want / want_s).clamp(-fmax, fmax).to(qdtype)

        got_q, got_s = q.clone(), s.clone()
        assert kernels.fold_fp8_(got_q, got_s, kernels.Pairs(pairs, DEV), MIN_SCALE)
        assert abs(got_s.item() / want_s.item() - 1) < 1e-6
        assert_fp8_close(got_q, want_q, (shape, ranks, ldtype, qdtype), same=0.9999)


def test_later_folds_keep_the_first_amax_bit_for_bit():
    """A streamed block lands from the same home every step: the second and later folds of
    a weight with the same Pairs skip the amax pass and give the first fold's bytes and
    scales exactly (fp8 and nvfp4)."""
    m, n = 512, 768
    g = torch.Generator(device=DEV).manual_seed(5)
    w0 = torch.randn(m, n, device=DEV, generator=g) * 0.03
    s0 = (w0.abs().amax() / 448.0).reshape(())
    q0 = (w0 / s0).to(torch.float8_e4m3fn)
    kp = kernels.Pairs(make_pairs(m, n, (64,), torch.bfloat16, 1), DEV)
    runs = []
    for _ in range(3):
        q, s = q0.clone(), s0.clone()
        assert kernels.fold_fp8_(q, s, kp, MIN_SCALE)
        runs.append((q.view(torch.uint8), s, kp.amax_kept))
    assert runs[0][2] is not None and len({r[2] for r in runs}) == 1
    for q, s, _ in runs[1:]:
        assert torch.equal(q, runs[0][0]) and torch.equal(s, runs[0][1])
    assert not torch.equal(runs[0][0], q0.view(torch.uint8))   # the LoRA changed the weight

    nv = eager_nvfp4(w0)
    kp = kernels.Pairs(make_pairs(m, n, (64,), torch.bfloat16, 2), DEV)
    outs = []
    for _ in range(2):
        qd, gs, bs = nv._qdata.clone(), nv._params.scale.clone(), nv._params.block_scale.clone()
        assert kernels.fold_nvfp4_(qd, gs, bs, kp, NVFP4_MAX, MIN_SCALE)
        outs.append((qd, gs, bs.view(torch.uint8)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("shape,ranks,ldtype", CASES)
def test_add_pairs_equals_op_by_op(shape, ranks, ldtype):
    m, n = shape
    w = torch.randn(m, n, device=DEV) * 0.03
    pairs = make_pairs(m, n, ranks, ldtype, 7)
    want = reference_add(w, pairs)
    got = w.clone()
    amax = kernels.add_pairs_(got, kernels.Pairs(pairs, DEV))
    assert amax is not None
    err = ((got - want).norm() / (want - w).norm()).item()
    assert err < (1e-5 if ldtype != torch.float32 else 1e-4), err   # of the delta: float32 sums
    assert amax.item() == got.abs().amax().item()


def gguf_blocks(qtype, m, n, seed, offset=0):
    """GGUF bytes of an [m, n] weight of `qtype` (random bytes, the fp16 scales random finite
    values of both signs), starting `offset` bytes into their buffer."""
    values, nbytes = gguf_kernels.ROW_BYTES[qtype]
    g = torch.Generator(device=DEV).manual_seed(seed)
    buf = torch.randint(0, 256, (m * n // values * nbytes + offset,), device=DEV, generator=g, dtype=torch.uint8)
    blocks = buf[offset:].view(-1, nbytes)
    for at in HALF_FIELDS[qtype]:
        scale = (torch.rand(blocks.shape[0], 1, device=DEV, generator=g) - 0.5) * 0.004
        blocks[:, at:at + 2] = scale.half().view(torch.uint8)
    return buf[offset:].view(m, -1)


def pack_dequantize(blocks, qtype, shape, mid, dtype):
    """ComfyUI-GGUF's own dequantize (the linked pack's dequant.py), then to `dtype`, as its
    layers compute a weight (`mid`: its dequant dtype; float16 is what None gives)."""
    pack = comfyui_gguf_pack(COMFY)
    if pack is None:
        pytest.skip("ComfyUI-GGUF is not linked into custom_nodes")
    dequant = sys.modules[pack.__name__ + ".dequant"]
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    return dequant.dequantize(blocks.clone(), qt, shape, dtype=None if mid == torch.float16 else mid).to(dtype)


GGUF_CASES = [("Q8_0", (384, 640), (64,), torch.bfloat16, 0), ("Q8_0", (300, 224), (16, 8), torch.float16, 1),
              ("Q8_0", (5120, 13824), (64,), torch.bfloat16, 0), ("Q4_K", (384, 768), (64,), torch.bfloat16, 0),
              ("Q4_K", (300, 512), (16, 8), torch.float16, 3), ("Q4_K", (5120, 13824), (64,), torch.bfloat16, 0),
              ("Q5_K", (384, 768), (64,), torch.bfloat16, 0), ("Q5_K", (300, 512), (16, 8), torch.float16, 1),
              ("Q6_K", (384, 768), (64,), torch.bfloat16, 0), ("Q6_K", (300, 512), (16, 8), torch.float16, 5),
              ("Q6_K", (5120, 13824), (64,), torch.bfloat16, 0), ("Q4_0", (384, 640), (64,), torch.bfloat16, 0),
              ("Q4_1", (300, 224), (16, 8), torch.float16, 1), ("Q5_0", (384, 640), (64,), torch.bfloat16, 3),
              ("Q5_1", (300, 224), (16, 8), torch.float16, 0)]


DTYPES_MID = [(torch.bfloat16, torch.float16), (torch.float32, torch.float32), (torch.float16, torch.float16),
              (torch.bfloat16, torch.bfloat16)]   # (the model's dtype, the pack's dequant dtype)


@pytest.mark.parametrize("qtype,shape,ranks,ldtype,offset,dtype,mid",
                         [c + dm for c in GGUF_CASES
                          for dm in (DTYPES_MID if c[0] in ("Q8_0", "Q4_K", "Q6_K") else DTYPES_MID[:2])])
def test_dense_gguf_equals_the_packs_dequantize(qtype, shape, ranks, ldtype, offset, dtype, mid):
    """Without pairs the kernel equals ComfyUI-GGUF's dequantize (each step in the dequant dtype,
    then to the model's dtype) bit for bit, rows at any byte offset; with pairs it is that
    weight plus the float32 delta, rounded once (within one unit in the last place)."""
    m, n = shape
    blocks = gguf_blocks(qtype, m, n, 5, offset)
    dense = pack_dequantize(blocks, qtype, (m, n), mid, dtype)
    assert dense.isfinite().all()
    got = gguf_kernels.dense(qtype, blocks, (m, n), dtype, mid, None)
    assert got is not None and got.dtype == dtype and got.shape == (m, n)
    assert torch.equal(got, dense)
    for scale in (0.0, 0.8):
        pairs = [(u, dn, scale) for u, dn, _ in make_pairs(m, n, ranks, ldtype, 9)]
        got = gguf_kernels.dense(qtype, blocks, (m, n), dtype, mid, kernels.Pairs(pairs, DEV))
        if scale == 0.0:
            assert torch.equal(got, dense)
            continue
        want = reference_add(dense.float(), pairs)
        delta = (want - dense.float()).abs().max()
        # one rounding of the sum, plus float32's summation order (far below the delta)
        assert ((got.float() - want).abs() <= want.abs() * torch.finfo(dtype).eps + 1e-6 * delta).all()
        assert (got.float() - dense.float()).norm() > 0.5 * (want - dense.float()).norm(), "the delta is there"


def eager_nvfp4(w, scale=None):
    from comfy_kitchen.registry import registry
    from comfy_kitchen.tensor import QuantizedTensor
    with registry.use_backend("eager"):
        kw = {} if scale is None else {"scale": scale}
        return QuantizedTensor.from_float(w, "TensorCoreNVFP4Layout", **kw)


def nvfp4_values(qdata, scale, block_scale):
    from comfy_kitchen.backends.eager.quantization import dequantize_nvfp4
    return dequantize_nvfp4(qdata, scale.float(), block_scale, torch.float32)


@pytest.mark.parametrize("shape", [(256, 192), (208, 176), (5120, 13824)])
def test_fold_nvfp4_quantizes_as_comfy_kitchen(shape):
    """With a zero LoRA the kernel requantizes the dequantized weight exactly as
    comfy_kitchen's quantize_nvfp4 (eager, float32) does; with a LoRA it matches
    requantize(dequantize + delta) up to the float32 summation order."""
    m, n = shape
    q = eager_nvfp4(torch.randn(m, n, device=DEV) * 0.02)
    p = q._params
    base = nvfp4_values(q._qdata, p.scale, p.block_scale)
    for scale in (0.0, 0.8):
        pairs = [(u, d, scale) for u, d, _ in make_pairs(m, n, (64,), torch.bfloat16, 3)]
        # the format's definition on the CPU: torch on CUDA divides by a Python number
        # through its reciprocal, the kernel (like the CPU) divides
        want_w = reference_add(base, pairs).cpu()
        want = eager_nvfp4(want_w, (want_w.abs().amax() / NVFP4_MAX).clamp_min(MIN_SCALE))
        qd, gs, bs = q._qdata.clone(), p.scale.clone(), p.block_scale.clone()
        assert kernels.fold_nvfp4_(qd, gs, bs, kernels.Pairs(pairs, DEV), NVFP4_MAX, MIN_SCALE)
        qd, gs, bs = qd.cpu(), gs.cpu(), bs.cpu()
        got_v = nvfp4_values(qd, gs, bs)
        want_v = nvfp4_values(want._qdata, want._params.scale, want._params.block_scale)
        if scale == 0.0:
            assert torch.equal(gs.reshape(()), want._params.scale.reshape(()))
            assert torch.equal(bs.view(torch.uint8), want._params.block_scale.view(torch.uint8))
            assert torch.equal(got_v, want_v)   # codes may differ only as +0 / -0
        else:
            assert abs(gs.item() / want._params.scale.item() - 1) < 1e-6
            assert (qd == want._qdata).float().mean().item() > 0.999
            assert ((got_v - want_v).norm() / want_v.norm()).item() < 1e-3


def test_ops_use_the_kernels_and_match_the_op_by_op_fold(monkeypatch):
    """ScaledFp8Op and KitchenOp (nvfp4) on CUDA: fused result == op-by-op result within a
    requantization step."""
    import comfy.weight_adapter.lora as wl   # ComfyUI's own patch type, as load_lora makes it
    m, n, r = 512, 768, 32
    up, down = (torch.randn(m, r) * 0.05).bfloat16(), (torch.randn(r, n) * 0.05).bfloat16()
    patch = wl.LoRAAdapter({"up", "down"}, (up, down, torch.tensor(16.0), None, None, None))
    plist = ((0.8, patch, 1.0, None, None),)
    w0 = torch.randn(m, n, device=DEV) * 0.03

    def fp8_parts():
        s = (w0.abs().amax() / 448.0).reshape(())
        return [(w0 / s).to(torch.float8_e4m3fn), s.clone()]

    fused, plain = fp8_parts(), fp8_parts()
    op = ScaledFp8Op("k.weight", plist, 0, 1)
    assert op.pairs is not None
    op(fused)
    monkeypatch.setenv("RINGSWAP_FUSED_KERNELS", "0")
    ScaledFp8Op("k.weight", plist, 0, 1)(plain)
    monkeypatch.delenv("RINGSWAP_FUSED_KERNELS")
    assert abs(fused[1].item() / plain[1].item() - 1) < 1e-6
    assert_fp8_close(fused[0], plain[0], "fp8 op")
    assert ("fp8", fused[0].device) in kernels._BUILT, "the fused fp8 kernel did not run"

    q = kitchen_from_float(w0, "TensorCoreNVFP4Layout")
    fields = ("scale", "block_scale")

    def nv_parts():
        return [q._qdata.clone(), q._params.scale.clone(), q._params.block_scale.clone()]

    fused, plain = nv_parts(), nv_parts()
    KitchenOp("k.weight", plist, range(3), "TensorCoreNVFP4Layout", q._params, fields)(fused)
    monkeypatch.setenv("RINGSWAP_FUSED_KERNELS", "0")
    KitchenOp("k.weight", plist, range(3), "TensorCoreNVFP4Layout", q._params, fields)(plain)
    monkeypatch.delenv("RINGSWAP_FUSED_KERNELS")
    assert abs(fused[1].item() / plain[1].item() - 1) < 1e-6
    assert (fused[0] == plain[0]).float().mean().item() > 0.999
    assert not torch.equal(fused[0], q._qdata), "the LoRA changed nothing"
    assert ("nvfp4", fused[0].device) in kernels._BUILT, "the fused nvfp4 kernel did not run"


def test_kitchen_fp8_layout_op_uses_the_add_kernel(monkeypatch):
    """comfy_kitchen's fp8 layout (newer ComfyUI): dequantize, add_pairs_ (LoRA + amax in
    one pass), quantize; equal to the op-by-op fold within a requantization step."""
    import comfy.weight_adapter.lora as wl
    m, n, r = 512, 768, 32
    up, down = (torch.randn(m, r) * 0.05).bfloat16(), (torch.randn(r, n) * 0.05).bfloat16()
    patch = wl.LoRAAdapter({"up", "down"}, (up, down, torch.tensor(16.0), None, None, None))
    plist = ((0.8, patch, 1.0, None, None),)
    q = kitchen_from_float(torch.randn(m, n, device=DEV) * 0.03, "TensorCoreFP8Layout")

    def parts():
        return [q._qdata.clone(), q._params.scale.clone()]

    fused, plain = parts(), parts()
    KitchenOp("k.weight", plist, range(2), "TensorCoreFP8Layout", q._params, ("scale",))(fused)
    monkeypatch.setenv("RINGSWAP_FUSED_KERNELS", "0")
    KitchenOp("k.weight", plist, range(2), "TensorCoreFP8Layout", q._params, ("scale",))(plain)
    monkeypatch.delenv("RINGSWAP_FUSED_KERNELS")
    assert abs(fused[1].item() / plain[1].item() - 1) < 1e-6
    assert_fp8_close(fused[0], plain[0], "kitchen fp8 op")
    assert not torch.equal(fused[0], q._qdata), "the LoRA changed nothing"
    assert ("add", fused[0].device) in kernels._BUILT, "the fused add kernel did not run"


if kernels.triton is not None:
    import triton.language as tl

    @kernels.triton.jit
    def _fp8_roundtrip(b_ptr, v_ptr, o_ptr, MBITS: tl.constexpr, EMIN: tl.constexpr):
        i = tl.arange(0, 256)
        v = kernels._fp8_decode(tl.load(b_ptr + i), MBITS, EMIN)
        tl.store(v_ptr + i, v)
        tl.store(o_ptr + i, kernels._fp8_encode(kernels._round_fp8(v, MBITS, EMIN), MBITS, EMIN))


@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_coding_is_exact_for_every_code(qdtype):
    """Every finite fp8 code decodes to torch's value and encodes back to itself."""
    mbits, emin = kernels.FP8_GRID[qdtype]
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    values = torch.empty(256, device=DEV)
    back = torch.empty(256, dtype=torch.uint8, device=DEV)
    _fp8_roundtrip[(1,)](codes, values, back, MBITS=mbits, EMIN=emin)
    want = codes.view(qdtype).float()
    finite = torch.isfinite(want)
    assert torch.equal(values[finite], want[finite])
    assert torch.equal(back[finite], codes[finite])


if kernels.triton is not None:
    @kernels.triton.jit
    def _e2m1_roundtrip(c_ptr, v_ptr, o_ptr):
        i = tl.arange(0, 16)
        v = kernels._e2m1_decode(tl.load(c_ptr + i)) * 16384.0
        tl.store(v_ptr + i, v)
        tl.store(o_ptr + i, kernels._e2m1_encode(v))


def test_e2m1_coding_is_exact_for_every_code():
    """Every fp4 e2m1 code decodes to its value (0, .5, 1, 1.5, 2, 3, 4, 6, signed) and
    encodes back to itself, -0 included."""
    codes = torch.arange(16, dtype=torch.uint8, device=DEV)
    values = torch.empty(16, device=DEV)
    back = torch.empty(16, dtype=torch.uint8, device=DEV)
    _e2m1_roundtrip[(1,)](codes, values, back)
    mags = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device=DEV)
    want = torch.cat([mags, -mags])
    assert torch.equal(values, want)
    assert torch.equal(torch.signbit(values), torch.arange(16, device=DEV) >= 8)
    assert torch.equal(back, codes)


if kernels.triton is not None:
    @kernels.triton.jit
    def _e2m1_encode_all(v_ptr, o_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(o_ptr + i, kernels._e2m1_encode(tl.load(v_ptr + i)))


def test_e2m1_encode_rounds_ties_to_even():
    """Halfway values go to the even code, as comfy_kitchen's quantize (and IEEE) rounds;
    values just off a tie go to the nearer code; the sign is kept."""
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    codes = [0, 2, 2, 4, 4, 6, 6]
    off = [0.2500001, 0.7499999, 1.2500001, 1.7499999, 2.5000002, 3.4999998, 5.0000005]
    off_codes = [1, 1, 3, 3, 5, 5, 7]
    vals = torch.tensor(ties + off + [-x for x in ties] + [0.0, -0.0], device=DEV)
    want = codes + off_codes + [c | 8 for c in codes] + [0, 8]
    n = 32
    padded = torch.zeros(n, device=DEV)
    padded[:len(vals)] = vals
    out = torch.empty(n, dtype=torch.uint8, device=DEV)
    _e2m1_encode_all[(1,)](padded, out, N=n)
    assert out[:len(vals)].tolist() == want
