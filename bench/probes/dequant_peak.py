"""Peak host bytes a value of ComfyUI-GGUF's dequantize per GGML type, beyond the dense bf16
weight it returns (lora/dense_fold.py plans a dense fold's temporaries from these). Each type
runs in a child process of its own (the peak is the process's RSS high-water mark), on the CPU:
the same torch ops, so the same temporaries, as on a GPU. Linux (reads /proc/self/statm).
Usage: python bench/probes/dequant_peak.py [--dequant PATH/TO/ComfyUI-GGUF/dequant.py]"""
import argparse
import os
import subprocess
import sys

CHILD = r"""
import importlib.util, os, resource, sys
import gguf, numpy as np, torch
spec = importlib.util.spec_from_file_location("dq", sys.argv[1])
dq = importlib.util.module_from_spec(spec); spec.loader.exec_module(dq)
name, mid = sys.argv[2], None if sys.argv[3] == "None" else getattr(torch, sys.argv[3])
m, n = 4096, 8192
qt = getattr(gguf.GGMLQuantizationType, name)
values, nbytes = gguf.GGML_QUANT_SIZES[qt]
raw = np.random.default_rng(0).integers(0, 256, (m * n // values, nbytes), dtype=np.uint8)
half = np.array([1e-3], dtype=np.float16).view(np.uint8)
for at in {"Q6_K": (nbytes - 2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (nbytes - 4, nbytes - 2), "Q3_K": (nbytes - 2,)}.get(name, (0,)):   # finite fp16 fields
    raw[:, at:at + 2] = half
data = torch.from_numpy(raw.reshape(m, -1).copy())
torch.set_num_threads(1)
start = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
out = dq.dequantize(data, qt, (m, n), dtype=mid).to(torch.bfloat16)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(f"{name} dequant dtype {sys.argv[3]}: {(peak - start) / (m * n) - 2:.2f} bytes a value beyond the bf16 weight")
"""


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument("--dequant", default=os.path.join(here, "..", "..", ".comfyui", "custom_nodes", "ComfyUI-GGUF",
                                                       "dequant.py"))
    a = ap.parse_args()
    for name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"):
        for mid in ("None", "bfloat16"):
            subprocess.run([sys.executable, "-c", CHILD, a.dequant, name, mid], check=True)


if __name__ == "__main__":
    main()
