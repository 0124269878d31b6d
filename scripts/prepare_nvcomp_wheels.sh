#!/usr/bin/env bash
# nvCOMP's Python wheels for the offline GPU machine (Python 3.12, torch cu130), into .whl-nvcomp/
# (git-ignored). Downloaded once from PyPI, then slimmed to what RingSwap loads there: the cp312
# extension and libnvcomp.so (no nvlzcat tool, headers or other Pythons' extensions), about 24 MB,
# so it travels beside .whl (without comfy-angle, PyOpenGL and diffusers) under the 64 MiB cap.
# On the device: pip install --no-deps --no-index --target /tmp/nvc .whl-nvcomp/*.whl; PYTHONPATH=/tmp/nvc.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl-nvcomp
raw=.wheels/nvcomp-download   # the wheels as downloaded (not carried)
mkdir -p "$raw" "$dest"
if ! ls "$raw"/nvidia_nvcomp_cu13-*.whl "$raw"/nvidia_libnvcomp_cu13-*.whl >/dev/null 2>&1; then
    mv "$dest"/nvidia_*nvcomp*.whl "$raw"/ 2>/dev/null || true
fi
if ! ls "$raw"/nvidia_nvcomp_cu13-*.whl "$raw"/nvidia_libnvcomp_cu13-*.whl >/dev/null 2>&1; then
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d "$raw" nvidia-nvcomp-cu13==6.0.0.12 nvidia-libnvcomp-cu13==6.0.0.12
fi
python3 - "$raw" "$dest" <<'PY'
import glob, os, re, sys, zipfile
raw, dest = sys.argv[1:]
drop = re.compile(r"(/bin/|/include/|nvcomp_impl\.cpython-(?!312-)[^/]*\.so$)")
for src in sorted(glob.glob(os.path.join(raw, "*.whl"))):
    out = os.path.join(dest, os.path.basename(src))
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out + ".part", "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if drop.search(info.filename):
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(l + "\n" for l in data.decode().splitlines() if not drop.search(l.split(",")[0])).encode()
            zout.writestr(info, data)
    os.replace(out + ".part", out)
    print(f"[nvcomp] {os.path.basename(out)}: {os.path.getsize(out) / 2**20:.1f} MiB (from {os.path.getsize(src) / 2**20:.1f})")
PY
du -ch "$dest"/*.whl | tail -1
