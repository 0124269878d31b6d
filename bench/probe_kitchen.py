"""Which comfy_kitchen backends serve nvfp4 on this GPU, and how fast (quantize, dequantize,
linear) at a Wan-14B weight shape. Usage: python bench/probe_kitchen.py"""
import time

import torch
import comfy_kitchen
from comfy_kitchen.registry import registry
from comfy_kitchen.tensor import QuantizedTensor


def ms(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def main() -> None:
    print("comfy_kitchen", getattr(comfy_kitchen, "__version__", "?"), "capability",
          torch.cuda.get_device_capability())
    for name, info in sorted(registry.list_backends().items()):
        print(f"  backend {name}: available={info['available']} reason={info['unavailable_reason']}")
    x = torch.randn(13824, 5120, device="cuda") * 0.02
    scale = (x.abs().amax() / 2688.0).reshape(())
    for fn in ("quantize_nvfp4", "dequantize_nvfp4", "scaled_mm_nvfp4"):
        try:
            print(f"  {fn}: capable backend {registry.get_capable_backend(fn)}")
        except Exception as e:   # noqa: BLE001
            print(f"  {fn}: {type(e).__name__}: {e}")
    try:
        q = QuantizedTensor.from_float(x, "TensorCoreNVFP4Layout", scale=scale)
        print(f"  from_float: {ms(lambda: QuantizedTensor.from_float(x, 'TensorCoreNVFP4Layout', scale=scale)):.2f} ms")
        print(f"  dequantize fp32: {ms(lambda: q.dequantize()):.2f} ms")
        a = torch.randn(4096, 5120, device="cuda", dtype=torch.bfloat16)
        print(f"  linear 4096x5120 @ nvfp4 13824x5120: "
              f"{ms(lambda: torch.nn.functional.linear(a, q)):.2f} ms; bf16: "
              f"{ms(lambda: torch.nn.functional.linear(a, x.bfloat16())):.2f} ms")
    except Exception as e:   # noqa: BLE001
        print(f"  nvfp4 failed: {type(e).__name__}: {str(e)[:300]}")


if __name__ == "__main__":
    main()
