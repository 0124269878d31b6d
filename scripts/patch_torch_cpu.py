"""Make PyPI's CUDA-linked torchvision importable beside CPU torch (FACTS.md).

Guards the two fake-kernel registrations for C++ ops that the CPU build lacks, and
removes torchaudio's native libraries so it runs in pure-Python mode.
"""
import glob
import os
import sysconfig

site = sysconfig.get_paths()["purelib"]
meta = os.path.join(site, "torchvision", "_meta_registrations.py")
src = open(meta).read()
guard = "if torchvision.extension._has_ops():\n    "
changed = False
for op in ("nms", "qnms"):
    deco = f'@torch.library.register_fake("torchvision::{op}")'
    if deco in src and f"_has_ops():\n    {deco}" not in src:
        lines = src.split("\n")
        out, i = [], 0
        while i < len(lines):
            if lines[i].strip() == deco:
                block = [lines[i]]
                i += 1
                while i < len(lines) and (lines[i].startswith(" ") or lines[i].startswith("def ") or lines[i] == "" and i + 1 < len(lines) and lines[i + 1].startswith(" ")):
                    block.append(lines[i])
                    i += 1
                    if block[-1].startswith("def "):
                        continue
                out.append("if torchvision.extension._has_ops():")
                out.extend("    " + b if b else b for b in block)
            else:
                out.append(lines[i])
                i += 1
        src = "\n".join(out)
        changed = True
if changed:
    if "import torchvision.extension" not in src:
        src = "import torchvision.extension\n" + src
    open(meta, "w").write(src)
for lib in glob.glob(os.path.join(site, "torchaudio", "lib", "*.so")):
    os.remove(lib)
print("[setup] torchvision/torchaudio patched for CPU torch")
